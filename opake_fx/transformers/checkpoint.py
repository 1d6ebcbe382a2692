"""The DP part of a DPTrainer checkpoint: ``dp_state.rank{r}.pt`` (or ``dp_state/`` under fsdp) and ``accountant.json``.

A Hugging Face checkpoint directory holds the model (or the adapters), the trainer state
and the callbacks' state. DPTrainer adds what the private run depends on, through
:meth:`opake_fx.plan.DPPlan.save_checkpoint` (atomic, checksummed, nothing imported on
load):

* ``dp_state.rank{r}.pt``: the plan's identity and the run's step (the ``run`` tree), the
  trainable parameters, the pipeline state (clip state, the noise key and step, the
  optimizer), the rank's sampler position, the accountant's spent composition and step
  count, and the trainer's step and privacy seed (``meta``). On resume
  (:func:`load_dp_state`) all of it must be one step of the resuming trainer's plan, and
  Hugging Face's ``trainer_state.json`` must be at that step too;
* ``dp_state/`` instead, for a run whose model is sharded with FSDP2 (``fsdp``): ONE
  directory written by every rank together through ``DPPlan.save_checkpoint`` with the
  sharded parameters (:mod:`opake_fx.distributed.fsdp_checkpoint`: the parameters and
  the optimizer's per-parameter shards in ``torch.distributed.checkpoint``'s
  ``tensors/``, each rank's ``run.rank{r}.pt`` with the same trees as above, and
  ``meta.json``), renamed into place once complete. It resumes on the number of ranks
  that saved it only, with the same checks;
* ``accountant.json``: a human-readable report (the plan, the steps taken, the epsilon
  spent, in the plan's unit and per example / per user). Nothing is checked against it: deleting or editing it changes no check.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from opake_fx.errors import CheckpointError
from opake_fx.serialization import refuse_together

__all__ = ["ACCOUNTANT_NAME", "TRAINER_STATE_NAME", "SHARDED_DP_STATE", "dp_state_name", "save_dp_state",
           "load_dp_state", "read_dp_meta", "write_accountant_json", "read_accountant_json"]

ACCOUNTANT_NAME = "accountant.json"
TRAINER_STATE_NAME = "trainer_state.json"
SHARDED_DP_STATE = "dp_state"
"""The directory of a sharded (fsdp) run's DP state inside a checkpoint."""


def dp_state_name(rank: int) -> str:
    """The file of rank ``rank``'s DP state in a checkpoint directory."""
    return f"dp_state.rank{rank}.pt"


def save_dp_state(directory: str, rank: int, *, plan: Any, params: Any, state: Any, sampler: Any, accountant: Any,
                  meta: dict[str, Any], sharded: bool = False) -> None:
    """Writes rank ``rank``'s DP state into ``directory`` (atomically), as one step of ``plan``'s run.

    ``meta`` holds the trainer's ``step`` (which must be the pipeline state's) and the
    privacy ``seed``. ``sharded`` (``params`` are an FSDP2 model's ``DTensor`` s): every
    rank calls together and the ranks write one ``dp_state/`` directory
    (:data:`SHARDED_DP_STATE`, atomic: ``dp_state.partial`` renamed into place once every
    rank has written) instead of ``dp_state.rank{rank}.pt``.

    Raises:
        InputValueError: the state's counters, the accountant or ``meta["step"]`` disagree
            (nothing is written): a resume of such a file would be refused.

    Privacy: the file holds the noise keys; keep it as private as the training data.
    """
    path = os.path.join(directory, SHARDED_DP_STATE if sharded else dp_state_name(rank))
    step = plan.save_checkpoint(path, params=params, state=state, sampler=sampler, accountant=accountant, meta=meta)
    if meta["step"] != step:  # pragma: no cover - the trainer saves after completing its step
        raise CheckpointError(f"DPTrainer saved its DP state at trainer step {meta['step']}, but its state is at {step}.")


def load_dp_state(directory: str, rank: int, *, plan: Any, params: Any, state: Any, sampler: Any, accountant: Any,
                  meta: dict[str, Any], sharded: bool = False) -> dict[str, Any]:
    """Reads rank ``rank``'s DP state from ``directory``; the keyword arguments are the templates.

    ``sharded``: the run's ``params`` are sharded ``DTensor`` s (fsdp) and the state is the
    ``dp_state/`` directory, read by every rank together on the number of ranks that saved
    it (another number is refused by :func:`opake_fx.distributed.fsdp_checkpoint.load_sharded_run`
    on every rank, with its reason); the returned ``params`` are new ``DTensor`` s placed
    like the template's.

    Everything is checked before anything is returned (the caller changes nothing until
    then): the file must be one step of ``plan``'s run (:meth:`DPPlan.load_checkpoint`:
    plan identity inside the file, noise step, clip step, sampler position, accountant
    steps and history, keys, privacy parameters), the trainer's step in ``meta`` must be
    that step, and so must ``trainer_state.json``'s ``global_step`` when the directory has
    one.

    Returns:
        The restored trees and ``"step"``.

    Raises:
        CheckpointError: the directory has no DP state (e.g. saved with ``save_only_model``:
            a weights-only export cannot be resumed), or it is not one step of this run
            (naming each disagreement). ``CheckpointRanksError`` on every rank when one
            rank's file is refused or the ranks' steps differ.

    Privacy: a DP state that loads continues the run: the noise of the later steps only,
    every step taken still charged, the plan's privacy parameters.
    """
    path = os.path.join(directory, SHARDED_DP_STATE if sharded else dp_state_name(rank))
    refuse_together(_layout_problem(directory, rank, sharded), directory)  # every rank, before any collective read
    out = plan.load_checkpoint(path, params=params, state=state, sampler=sampler, accountant=accountant, meta=meta)
    # the trainer's own counters, refused on every rank together (a rank going on alone would hang)
    refuse_together(_trainer_step_problem(directory, path, out["meta"]["step"], out["step"]), path)
    return out


def read_dp_meta(directory: str, rank: int, *, meta: dict[str, Any], sharded: bool = False) -> dict[str, Any]:
    """The trainer's ``meta`` tree (privacy ``seed``, ``step``) of ``directory``'s DP state, before the plan is built.

    Per rank: rank ``rank``'s file. ``sharded``: rank 0's run file of ``dp_state/`` on
    every rank (the seed is the run's, the same in every rank's file, and that file
    exists whatever the number of ranks resuming; each rank's own file is checked in full
    by :func:`load_dp_state`). Every rank calls it; a refusal is raised on every rank.

    Raises:
        CheckpointError: no DP state of this layout: none at all (a weights-only or plain
            Trainer checkpoint), or the other layout (a data-parallel checkpoint resumed
            with fsdp, or a sharded one without), naming what to do.

    Privacy: none (the seed only selects the keys that :func:`load_dp_state` then checks).
    """
    from opake_fx.serialization import load_checkpoint

    error, out = _layout_problem(directory, rank, sharded), None
    if error is None:
        path = os.path.join(directory, SHARDED_DP_STATE, "run.rank0.pt") if sharded else \
            os.path.join(directory, dp_state_name(rank))
        try:
            out = load_checkpoint(path, check_ranks=False, meta=dict(meta))["meta"]
        except CheckpointError as exc:
            error = exc
    refuse_together(error, directory)
    return out


def _layout_problem(directory: str, rank: int, sharded: bool) -> CheckpointError | None:
    """Why ``directory`` holds no DP state that this run (``sharded`` or not) can read, or ``None``."""
    has_dir = os.path.isdir(os.path.join(directory, SHARDED_DP_STATE))
    has_file = os.path.isfile(os.path.join(directory, dp_state_name(rank)))
    if (has_dir if sharded else has_file):
        return None
    if sharded and has_file:
        return CheckpointError(
            f"DPTrainer: {directory} was saved by a data-parallel run (its DP state is one file per rank, "
            f"{dp_state_name(rank)}), and this run shards the model (fsdp): a run resumes only as it was saved. Resume "
            "it without fsdp on the number of ranks that saved it; to train its model under fsdp, start a new run from "
            "its weights (a new accountant: the two runs' epsilons add up)."
        )
    if not sharded and has_dir:
        return CheckpointError(
            f"DPTrainer: {directory} was saved by a sharded (fsdp) run on {_sharded_world(directory)} ranks (its DP "
            f"state is the directory {SHARDED_DP_STATE}/, parameters and optimizer state sharded over the ranks), and "
            "this run does not shard the model. Resume it with the same fsdp arguments under torchrun on that number "
            "of ranks; to train its model otherwise, start a new run from its weights (model.safetensors; a new "
            "accountant: the two runs' epsilons add up)."
        )
    return CheckpointError(
        f"DPTrainer: {directory} has no {SHARDED_DP_STATE + '/' if sharded else dp_state_name(rank)}, so the private "
        "run cannot be resumed from it (was it saved with save_only_model=True, or by a plain Trainer?). Resume from a "
        "DPTrainer checkpoint."
    )


def _sharded_world(directory: str) -> str:
    from opake_fx.distributed.fsdp_checkpoint import saved_world_size

    try:
        return str(saved_world_size(os.path.join(directory, SHARDED_DP_STATE)))
    except CheckpointError:
        return "an unknown number of"


def _trainer_step_problem(directory: str, path: str, trainer_step: Any, step: int) -> CheckpointError | None:
    if trainer_step != step:
        return CheckpointError(
            f"DPTrainer: {path} is not one step of a run: the trainer's step is {trainer_step}, the run's step is "
            f"{step}. Resume from an intact checkpoint."
        )
    hf_state = os.path.join(directory, TRAINER_STATE_NAME)
    if not os.path.isfile(hf_state):
        return None
    try:
        with open(hf_state) as f:
            global_step = json.load(f).get("global_step")
    except (OSError, ValueError, AttributeError) as exc:
        return CheckpointError(f"DPTrainer: cannot read {hf_state} ({exc}).")
    if global_step != step:
        return CheckpointError(
            f"DPTrainer: {hf_state} has global_step={global_step!r}, the DP state's step is {step}: the two files are "
            "from different steps. Resume from an intact checkpoint directory."
        )
    return None


def write_accountant_json(directory: str, *, plan: Any, steps: int, epsilon: float, accountant: Any,
                          epsilons: dict[str, float] | None = None) -> None:
    """``accountant.json``: a report of the plan, the steps taken, epsilon spent and the accountant's state.

    ``epsilon`` is in the plan's unit, which the report names (``privacy_unit``: ``"example"``
    or ``"user"``; ``epsilon_unit``: ``"per example"`` / ``"per user"``); ``epsilons`` (the
    spent epsilon in every unit that applies, :meth:`DPPlan.spent_epsilons`: both for
    ``user_sampling="examples"``) is written as ``epsilon_per_example`` / ``epsilon_per_user``.
    Not read back by any check (the plan identity a resume checks is inside ``dp_state.rank{r}.pt``).
    """
    doc = {
        "plan": plan.to_dict(),
        "steps": steps,
        "privacy_unit": plan.privacy_unit,
        "epsilon_unit": plan.epsilon_unit,
        "epsilon": _finite_or_inf(epsilon),
        **{f"epsilon_{unit}": _finite_or_inf(value) for unit, value in (epsilons or {}).items()},
        "delta": plan.delta,
        "noise_multiplier": plan.noise_multiplier,
        "accountant": None if accountant is None else accountant.state_dict(),
    }
    tmp = os.path.join(directory, ACCOUNTANT_NAME + ".tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(directory, ACCOUNTANT_NAME))


def read_accountant_json(directory: str) -> dict[str, Any]:
    """The content of ``accountant.json`` (every ``epsilon*`` as a float, inf included)."""
    with open(os.path.join(directory, ACCOUNTANT_NAME)) as f:
        doc = json.load(f)
    for name in [k for k in doc if k.startswith("epsilon") and k != "epsilon_unit"]:
        if doc[name] == "inf":
            doc[name] = math.inf
    return doc


def _finite_or_inf(value: float) -> Any:
    return value if math.isfinite(value) else "inf"
