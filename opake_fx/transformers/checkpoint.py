"""The DP part of a DPTrainer checkpoint: ``dp_state.rank{r}.pt`` and ``accountant.json``.

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

__all__ = ["ACCOUNTANT_NAME", "TRAINER_STATE_NAME", "dp_state_name", "save_dp_state", "load_dp_state",
           "write_accountant_json", "read_accountant_json"]

ACCOUNTANT_NAME = "accountant.json"
TRAINER_STATE_NAME = "trainer_state.json"


def dp_state_name(rank: int) -> str:
    """The file of rank ``rank``'s DP state in a checkpoint directory."""
    return f"dp_state.rank{rank}.pt"


def save_dp_state(directory: str, rank: int, *, plan: Any, params: Any, state: Any, sampler: Any, accountant: Any,
                  meta: dict[str, Any]) -> None:
    """Writes rank ``rank``'s DP state into ``directory`` (atomically), as one step of ``plan``'s run.

    ``meta`` holds the trainer's ``step`` (which must be the pipeline state's) and the
    privacy ``seed``.

    Raises:
        InputValueError: the state's counters, the accountant or ``meta["step"]`` disagree
            (nothing is written): a resume of such a file would be refused.

    Privacy: the file holds the noise keys; keep it as private as the training data.
    """
    step = plan.save_checkpoint(os.path.join(directory, dp_state_name(rank)), params=params, state=state,
                                sampler=sampler, accountant=accountant, meta=meta)
    if meta["step"] != step:  # pragma: no cover - the trainer saves after completing its step
        raise CheckpointError(f"DPTrainer saved its DP state at trainer step {meta['step']}, but its state is at {step}.")


def load_dp_state(directory: str, rank: int, *, plan: Any, params: Any, state: Any, sampler: Any, accountant: Any,
                  meta: dict[str, Any]) -> dict[str, Any]:
    """Reads rank ``rank``'s DP state from ``directory``; the keyword arguments are the templates.

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
    path = os.path.join(directory, dp_state_name(rank))
    if not os.path.isfile(path):
        raise CheckpointError(
            f"DPTrainer: {directory} has no {dp_state_name(rank)}, so the private run cannot be resumed from it "
            "(was it saved with save_only_model=True, or by a plain Trainer?). Resume from a DPTrainer checkpoint."
        )
    out = plan.load_checkpoint(path, params=params, state=state, sampler=sampler, accountant=accountant, meta=meta)
    # the trainer's own counters, refused on every rank together (a rank going on alone would hang)
    refuse_together(_trainer_step_problem(directory, path, out["meta"]["step"], out["step"]), path)
    return out


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
