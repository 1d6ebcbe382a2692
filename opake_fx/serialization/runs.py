"""Checkpoints of one :class:`~opake_fx.plan.DPPlan` run, checked to be one step of that run.

:func:`save_run` / :func:`load_run` (reached as ``plan.save_checkpoint`` /
``plan.load_checkpoint``) add to :func:`~opake_fx.serialization.save_checkpoint` what a
file's checksum cannot give. A checksum detects a damaged file; it does not stop a writer
who edits the file and recomputes it (anyone who can write the file can). What such a
writer could do to a resumed run -- rewind the noise step so that old noise is drawn
again and cancels against a released model, splice in an earlier accountant so that
fewer steps are reported than were taken, turn adaptive clipping's count noise off --
all leave the file disagreeing with itself or with the plan, and that is what is checked:

* the **plan identity** (``plan.to_dict()`` as canonical JSON) is a tree of the file,
  inside its checksum, and must equal the resuming plan's;
* every **counter** agrees with the run's step: the noise step, the clip step, the
  sampler's position, the accountant's step count, and the accountant's history (its
  spent process must be the plan's cost of exactly those steps);
* the **keys** restored (noise, count noise, sampler) are the ones the resuming pipeline
  and sampler were built with;
* **privacy parameters** (noise multiplier, clip norm, count-noise multiplier, rates,
  budget) come from the plan and its pipeline, never from the file: the saved copies are
  compared with the template's and a difference refuses the file (the clip states'
  serializers, the samplers' and the accountant's).

A file that passes is one step of one run of this plan. What no check can catch is a
writer who rewrites *everything* consistently (an earlier step's counters around later
parameters): that needs a key the writer lacks (a MAC), or storage only the trainer can
write. See ``docs/checkpoints.md``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import torch

from opake_fx.errors import CheckpointError, CheckpointRanksError, DistributedMismatchError, InputValueError
from opake_fx.random import RngKey
from opake_fx.serialization._ranks import check_shared_state
from opake_fx.serialization.files import read_checkpoint, restore_trees, save_checkpoint
from opake_fx.serialization._registry import serializer_for

__all__ = ["save_run", "load_run", "run_counters", "plan_identity", "refuse_together", "RUN_TREE"]

RUN_TREE = "run"
"""The name of the tree that holds the plan identity and the step in a run checkpoint."""

_RUN_TEMPLATE = {"plan": "", "step": 0}


def save_run(path: str | os.PathLike[str], plan: Any, *, params: Any, state: Any, sampler: Any = None,
             accountant: Any = None, **extra: Any) -> int:
    """Writes one step of ``plan``'s run to ``path`` (atomically), with the plan's identity; returns the step.

    The step is the pipeline state's (its noise and clip steps, which must agree). The
    sampler is saved at that step (its next batch is the step's, whatever a ``DataLoader``
    prefetched); the accountant must hold exactly the plan's cost of those steps.

    Args:
        path: the file (one per rank).
        plan: the run's :class:`~opake_fx.plan.DPPlan`.
        params, state: the parameters and ``plan.pipeline(...)``'s state.
        sampler: the rank's sampler from ``plan.sampler`` (its shard's sampler, unwrapped).
        accountant: the run's ``Accountant`` (``None`` for a non-private baseline).
        **extra: more trees to save (e.g. ``meta={...}``); not ``run``.

    Raises:
        InputValueError: the state's counters disagree, or the accountant's steps or
            history are not the plan's first ``step`` steps (the file would be refused on
            load; nothing is written).

    Privacy: as :func:`~opake_fx.serialization.save_checkpoint` (the file holds the
    noise keys: keep it as private as the data).

    Example:
        See :meth:`opake_fx.plan.DPPlan.save_checkpoint`.
    """
    if RUN_TREE in extra:
        raise InputValueError(f"save_run: the tree name {RUN_TREE!r} is the run's own; give your tree another name.")
    counters = run_counters(state, "state")
    steps = sorted({v for _, v in counters})
    if len(steps) != 1:
        raise InputValueError(
            "DPPlan.save_checkpoint: the state's step counters "
            + (f"disagree ({_listed(counters)})" if counters else "are missing (no noise or clip state in it)")
            + "; pass the state plan.pipeline(...) returned after the last step."
        )
    step = steps[0]
    problems = _accountant_problems(plan, step, accountant)
    if problems:
        raise InputValueError(f"DPPlan.save_checkpoint: {'; '.join(problems)}. Charge plan.step_cost_at(t) once per step t.")
    trees: dict[str, Any] = {"params": params, "state": state, **extra,
                             RUN_TREE: {"plan": plan_identity(plan), "step": step}}
    if sampler is not None:
        trees["sampler"] = {**sampler.state_dict(), "next_step": step}  # the sampler's own entries, at the step
    if accountant is not None:
        trees["accountant"] = accountant
    save_checkpoint(path, **trees)
    return step


def load_run(path: str | os.PathLike[str], plan: Any, *, params: Any, state: Any, sampler: Any = None,
             accountant: Any = None, check_ranks: bool = True, **extra: Any) -> dict[str, Any]:
    """Reads one step of ``plan``'s run from ``path``, refusing a file that is not one step of this run.

    Args:
        path: the file :func:`save_run` wrote.
        plan: the resuming run's plan (its identity must equal the saved one).
        params, state, sampler, accountant, **extra: the templates (``state`` from the
            resuming ``plan.pipeline(...).init(params)``: its keys and privacy parameters
            are the ones the file must have); ``sampler`` and ``accountant`` as saved.
        check_ranks: under ``torch.distributed`` with 2+ ranks, every rank calls together:
            a file refused on one rank is refused on every rank, and the ranks must have
            restored the same shared values (noise key and step, adaptive-clipping state).

    Returns:
        ``{name: restored tree}`` for every template, and ``"step"``: the run's step (the
        number of steps taken). The templates are not modified.

    Raises:
        CheckpointError: the file is missing, damaged or does not fit the templates; it was
            made by another plan; its counters (noise step, clip step, sampler position,
            accountant steps and history) disagree; its keys are not the pipeline's; or it
            carries other privacy parameters. The message names each disagreement.
        CheckpointRanksError: (a ``CheckpointError``) another rank's file was refused, or
            the ranks restored different shared values.

    Privacy: a file that loads is one step of one run of ``plan``: the resumed run draws
    the noise of the steps after it (no noise is drawn twice), the accountant holds every
    step taken, and the privacy parameters are the plan's.

    Example:
        See :meth:`opake_fx.plan.DPPlan.load_checkpoint`.
    """
    if RUN_TREE in extra:
        raise InputValueError(f"load_run: the tree name {RUN_TREE!r} is the run's own; give your tree another name.")
    where = os.fspath(path)
    templates: dict[str, Any] = {"params": params, "state": state, **extra, RUN_TREE: dict(_RUN_TEMPLATE)}
    if sampler is not None:
        templates["sampler"] = sampler
    if accountant is not None:
        templates["accountant"] = accountant
    error: CheckpointError | None = None
    out: dict[str, Any] = {}
    try:
        flats = read_checkpoint(path)
        if RUN_TREE not in flats:
            raise CheckpointError(
                f"{where} was not written by DPPlan.save_checkpoint: it has no {RUN_TREE!r} tree (the plan's identity "
                "and the step), so it cannot be checked to be one step of this run, and is refused. (A file of an "
                "earlier version, or of save_checkpoint; its trees can still be read with "
                "opake_fx.serialization.load_checkpoint, which checks none of this.)"
            )
        # the plan first: another plan's trees would not even fit this one's templates
        other = _plan_problems(plan, restore_trees(flats, where, **{RUN_TREE: dict(_RUN_TEMPLATE)})[RUN_TREE]["plan"])
        if other:
            raise CheckpointError(
                f"{where}: {other[0]}; resuming it under this plan would change the mechanism mid-run. Resume with "
                "the run's original plan (arguments), or start a new run."
            )
        out = restore_trees(flats, where, **templates)
        problems = _run_problems(plan, out, templates)
        if problems:
            error = CheckpointError(
                f"{where} is not one step of this run: {'; '.join(problems)}. Nothing was restored. A checkpoint "
                "whose counters, keys or plan disagree would repeat noise, under-report the steps taken or change "
                "the mechanism; resume from an intact checkpoint of this run (its checksum cannot tell: whoever "
                "writes a file can recompute it; see docs/checkpoints.md)."
            )
    except CheckpointError as exc:
        error = exc
    if check_ranks:
        _refuse_together(error, out, where)
    elif error is not None:
        raise error
    run = out.pop(RUN_TREE)
    out["step"] = run["step"]
    return out


def plan_identity(plan: Any) -> str:
    """The plan as canonical JSON (sorted keys): what a run checkpoint records and compares.

    Privacy: none (the plan is public configuration).

    Example:
        >>> from opake_fx.plan import DPPlan
        >>> plan = DPPlan(dataset_size=100, batch_size=10, steps=5, noise_multiplier=1.0, delta=1e-5)
        >>> '"noise_multiplier": 1.0' in plan_identity(plan)
        True
    """
    return json.dumps(plan.to_dict(), sort_keys=True)


def run_counters(tree: Any, path: str = "") -> list[tuple[str, int]]:
    """The step counters of the DP states in ``tree``: ``[(path.step, value), ...]``.

    The noise states (``GaussianNoiseState``, ``MfNoiseState``) and clip states
    (``FixedClipState``, ``AdaptiveClipState``) count the steps they took; in one run's
    pipeline state they all equal the run's step.

    Privacy: none (a walk of the tree).

    Example:
        >>> from opake_fx.dpsgd.noise import GaussianNoiseState
        >>> from opake_fx.random import key
        >>> run_counters({"noise": GaussianNoiseState(key(0), step=3)}, "state")
        [('state/noise.step', 3)]
    """
    return [(f"{p}.step", obj.step) for p, obj in _dp_states(tree, path)]


# --- private helpers ---------------------------------------------------------------


def _dp_state_types() -> tuple[type, ...]:
    from opake_fx.dpftrl.noise import MfNoiseState
    from opake_fx.dpsgd.clipping import AdaptiveClipState, FixedClipState
    from opake_fx.dpsgd.noise import GaussianNoiseState

    return (GaussianNoiseState, MfNoiseState, FixedClipState, AdaptiveClipState)


def _dp_states(tree: Any, path: str) -> list[tuple[str, Any]]:
    """``(path, state)`` of every noise and clip state in ``tree`` (containers, NamedTuples, dataclasses)."""
    types = _dp_state_types()
    found: list[tuple[str, Any]] = []

    def walk(obj: Any, at: str) -> None:
        if isinstance(obj, types):
            found.append((at, obj))
        elif isinstance(obj, Mapping):
            for k, v in obj.items():
                walk(v, f"{at}/{k}")
        elif isinstance(obj, (tuple, list)):
            for k, v in zip(getattr(obj, "_fields", None) or range(len(obj)), obj):
                walk(v, f"{at}/{k}")
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type) and serializer_for(type(obj)) is None:
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name), f"{at}/{f.name}")

    walk(tree, path)
    return found


def _run_problems(plan: Any, out: Mapping[str, Any], templates: Mapping[str, Any]) -> list[str]:
    """Every way the restored trees are not one step of ``plan``'s run (empty if they are)."""
    run = out[RUN_TREE]
    problems: list[str] = []
    step = run["step"]
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= plan.steps:
        return [*problems, f"its step {step!r} is not in [0, {plan.steps}] (the plan's steps)"]
    counters = run_counters(out["state"], "state")
    if not counters:
        problems.append("its state has no noise or clip state (not a plan.pipeline state)")
    problems += [f"{label} is {value}, the run's step is {step}" for label, value in counters if value != step]
    if "sampler" in out:
        restored = out["sampler"]
        if restored.next_step != step:
            problems.append(f"the sampler's position (next_step) is {restored.next_step}, the run's step is {step}")
        if getattr(restored, "key", None) != getattr(templates["sampler"], "key", None):
            problems.append(f"the sampler key {restored.key!r} is not this rank's sampler key "
                            f"{templates['sampler'].key!r}")
    problems += _accountant_problems(plan, step, out.get("accountant"))
    mine = {p: s.key for p, s in _dp_states(templates["state"], "state") if isinstance(getattr(s, "key", None), RngKey)}
    for p, s in _dp_states(out["state"], "state"):
        if p in mine and s.key != mine[p]:
            problems.append(f"{p}.key is {s.key!r}, the pipeline's is {mine[p]!r} (keys come from the run's seed)")
    return problems


def _plan_problems(plan: Any, saved: Any) -> list[str]:
    identity = plan_identity(plan)
    if saved == identity:
        return []
    try:
        theirs = json.loads(saved)
    except (TypeError, ValueError):
        return ["it records no readable plan identity"]
    if not isinstance(theirs, dict):
        return ["it records no readable plan identity"]
    mine = json.loads(identity)
    differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    shown = ", ".join(f"{k}: {theirs.get(k)!r:.60} in the checkpoint, {mine.get(k)!r:.60} now" for k in differ[:6])
    return [f"it was made by another privacy plan (differs in {differ}: {shown})"]


def _accountant_problems(plan: Any, step: int, accountant: Any) -> list[str]:
    if accountant is None:
        return []
    problems = []
    if accountant.steps != step:
        problems.append(
            f"the accountant recorded {'an unknown number of' if accountant.steps is None else accountant.steps} "
            f"steps, the run's step is {step}"
        )
    expected = plan.spent_after(step)
    if accountant.spent != expected:
        problems.append(
            f"the accountant's history (spent {accountant.spent!r:.160}) is not the plan's first {step} steps "
            f"({expected!r:.160})"
        )
    return problems


def refuse_together(error: CheckpointError | None, where: str) -> None:
    """Raises on every rank if any rank has an ``error`` (a collective; every rank calls it).

    In one process: raises ``error`` if there is one. Under ``torch.distributed`` with 2+
    ranks: a rank with an error raises it, and every other rank raises a
    :class:`~opake_fx.errors.CheckpointRanksError` naming the refusing ranks, so no rank
    goes on alone into a collective the others never reach.

    Privacy: none by itself; it keeps one rank's refused checkpoint from being resumed by
    the others.

    Example:
        >>> refuse_together(None, "ckpt.pt")  # one process, nothing refused: nothing to do
    """
    from opake_fx.distributed import all_reduce, get_rank, get_world_size, is_distributed

    if not is_distributed() or get_world_size() < 2:
        if error is not None:
            raise error
        return
    refused = torch.zeros(get_world_size(), dtype=torch.int64)
    refused[get_rank()] = int(error is not None)
    ranks = torch.nonzero(all_reduce(refused, "sum")).flatten().tolist()
    if error is not None:
        raise error
    if ranks:
        raise CheckpointRanksError(
            f"{where}: rank(s) {ranks} refused their checkpoint (see their error), so every rank refuses: the ranks "
            "must resume one step of one run together."
        )


def _refuse_together(error: CheckpointError | None, out: Mapping[str, Any], where: str) -> None:
    """:func:`refuse_together`, then the cross-rank check of the shared values."""
    refuse_together(error, where)
    try:
        check_shared_state(out, where)
    except DistributedMismatchError as exc:
        raise CheckpointRanksError(str(exc)) from None


def _listed(counters: list[tuple[str, int]]) -> str:
    return ", ".join(f"{label}={value}" for label, value in counters)
