"""Sharded checkpoints of an FSDP2 DP run, through ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a directory that every rank can see:

* ``tensors/``: DCP's files of the sharded parameters and the optimizer state. Each
  optimizer leaf that belongs to one parameter (a moment of Adam: a tuple leaf ``i`` of
  the local shard's shape) is saved as that parameter's shard; every other leaf (a step
  count) must be equal on every rank and is saved once. DCP records the full shapes, so
  these tensors load onto any number of ranks (:func:`load_sharded_model_state`).
* ``run.rank{r}.pt``: each rank's run file, written by ``DPPlan.save_checkpoint``: the
  plan identity, the noise and clip states, the rank's sampler at the step, the
  accountant, the world size, and a digest of the rank's shards of ``tensors/``.
* ``meta.json``: the world size and step (read first, for a clear message; the run
  files' copies are the ones checked).

:func:`save_sharded_run` writes it under ``<directory>.partial`` and renames it into place
once every rank has written, so a run killed while saving keeps its previous checkpoint.
:func:`load_sharded_run` resumes on the same number of ranks, bit for bit: everything the
plan's run checkpoints check (plan identity, every counter, the keys, the accountant),
plus the world size and the digest that binds the tensors to the run files. On another
world size it refuses: each rank's sampler draws Poisson batches of its own shard with
``fold_in(key, rank)``, so another split of the data is another run.
``DPPlan.save_checkpoint`` / ``load_checkpoint`` call these when ``params`` are sharded.

Privacy contract: as ``DPPlan.save_checkpoint``: the files hold the noise keys (whoever
reads them can recompute the noise): keep them as private as the training data. A resumed
run continues the noise sequence after the saved step and its accountant holds every step
taken. Loading only the model and optimizer state on another world size
(:func:`load_sharded_model_state`) starts a NEW run: its privacy cost adds to the first's.

Example:
    See ``docs/sharded.md`` (it needs a process group of 2+ ranks).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from opake_fx.errors import CheckpointError, InputTypeError, InputValueError
from opake_fx.distributed.fsdp import FSDPStepState, ShardLayout

__all__ = ["save_sharded_run", "load_sharded_run", "load_sharded_model_state", "is_sharded", "saved_world_size"]

_META = "meta.json"
_TENSORS = "tensors"
_SHARDS_TEMPLATE = {"world_size": 0, "rank": -1, "digest": ""}


def is_sharded(params: Any) -> bool:
    """True when ``params`` are FSDP2 parameters (a sequence of ``DTensor`` s), as :func:`make_functional_fsdp` gives.

    Example:
        >>> is_sharded((torch.zeros(2),))
        False
    """
    from torch.distributed.tensor import DTensor

    return isinstance(params, (tuple, list)) and len(params) > 0 and all(isinstance(p, DTensor) for p in params)


def save_sharded_run(directory: str | os.PathLike[str], plan: Any, *, params: Any, state: Any, sampler: Any = None,
                     accountant: Any = None, **extra: Any) -> int:
    """Writes one step of an FSDP2 run of ``plan`` (every rank calls it together); returns the step.

    Args:
        directory: the checkpoint's directory, on a file system every rank sees (an
            existing one is replaced once the new one is complete).
        plan: the run's :class:`~opake_fx.plan.DPPlan`.
        params: the sharded parameters (``DTensor`` s of :func:`make_functional_fsdp`).
        state: the state of ``plan.pipeline(..., model=fmodel)`` after the last step.
        sampler: this rank's sampler from ``plan.sampler``.
        accountant: the run's accountant (``None`` for a non-private baseline).
        **extra: more named trees, saved in each rank's run file (e.g. a trainer's
            ``meta``; not ``shards``).

    Raises:
        InputTypeError: ``state`` is not a sharded pipeline's state.
        InputValueError: the state's counters or the accountant disagree with the step,
            or an optimizer leaf is neither one parameter's shard nor equal on every rank
            (nothing is written, on any rank).

    Privacy: see the module docstring (the files hold the noise keys).
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    layout, rank = _layout_of(params, state, "save_sharded_run"), dist.get_rank()
    _check_extra(extra, "save_sharded_run")
    final = Path(directory)
    partial = final.with_name(final.name + ".partial")
    error: Exception | None = None
    tensors: dict[str, Any] = {}
    step = -1
    try:
        tensors = _tensor_dict(params, state.opt, layout)
        _check_replicated_agree(tensors)
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
    except (InputValueError, OSError) as exc:
        error = exc
    _raise_together(error, str(final))
    dist.barrier()
    try:
        step = plan.save_checkpoint(partial / f"run.rank{rank}.pt", params=(), state=_without_opt(state),
                                    sampler=sampler, accountant=accountant, **extra,
                                    shards={"world_size": layout.mesh.size(), "rank": rank,
                                            "digest": _digest(tensors)})
    except InputValueError as exc:
        error = exc
    _raise_together(error, str(final))
    dcp.save(tensors, checkpoint_id=str(partial / _TENSORS))
    dist.barrier()
    if rank == 0:
        try:
            (partial / _META).write_text(json.dumps({"world_size": layout.mesh.size(), "step": step}))
            previous = final.with_name(final.name + ".previous")
            shutil.rmtree(previous, ignore_errors=True)
            if final.exists():
                final.rename(previous)
            partial.rename(final)
            shutil.rmtree(previous, ignore_errors=True)
        except OSError as exc:  # raised on every rank below (the others would wait at a barrier)
            error = exc
    _raise_together(error, str(final))
    return step


def load_sharded_run(directory: str | os.PathLike[str], plan: Any, *, params: Any, state: Any, sampler: Any = None,
                     accountant: Any = None, **extra: Any) -> dict[str, Any]:
    """Reads one step of an FSDP2 run of ``plan`` on the ranks that saved it (every rank calls it together).

    Args:
        directory: what :func:`save_sharded_run` wrote.
        plan: the resuming run's plan.
        params: template sharded parameters (of the resuming, identically sharded model;
            not modified).
        state: ``plan.pipeline(..., model=fmodel).init(params)`` (the run's keys).
        sampler: this rank's sampler from ``plan.sampler`` (the run's sampler key).
        accountant: a fresh ``plan.accountant()``.
        **extra: templates of the extra trees saved.

    Returns:
        ``{"params", "state", "sampler", "accountant", ..., "step"}`` as
        ``DPPlan.load_checkpoint``; ``params`` are new ``DTensor`` s placed like the
        template's.

    Raises:
        CheckpointError: on every rank (``CheckpointRanksError`` on the ranks whose own
            part was intact) when the directory was saved by another number of ranks,
            a run file is refused (another plan, counters, keys, accountant: see
            ``DPPlan.load_checkpoint``), or the tensors are not the ones saved with the run
            files.

    Privacy: see the module docstring.
    """
    import torch.distributed as dist

    layout, rank = _layout_of(params, state, "load_sharded_run"), dist.get_rank()
    _check_extra(extra, "load_sharded_run")
    root, world = Path(directory), layout.mesh.size()
    error: Exception | None = None
    try:
        saved_world = saved_world_size(root)
        if saved_world != world:
            raise CheckpointError(
                f"{root} was saved by {saved_world} ranks and is resumed by {world}. Each rank's sampler draws Poisson "
                "batches of its own shard of the data (fold_in(key, rank)), so resuming on another number of ranks "
                f"would be another run, not this one. Resume on {saved_world} ranks; or read the parameters and "
                "optimizer state on any number of ranks with opake_fx.distributed.fsdp_checkpoint."
                "load_sharded_model_state and start a new run (a new accountant: the two runs' privacy costs add up)."
            )
    except CheckpointError as exc:
        error = exc
    _raise_together(error, str(root))
    out = plan.load_checkpoint(root / f"run.rank{rank}.pt", params=(), state=_without_opt(state), sampler=sampler,
                               accountant=accountant, **extra, shards=dict(_SHARDS_TEMPLATE))
    shards = out.pop("shards")
    targets = _tensor_dict(_fresh_like(params), state.opt, layout)
    _dcp_load(targets, root)
    try:
        if shards["world_size"] != world or shards["rank"] != rank:
            raise CheckpointError(
                f"{root}/run.rank{rank}.pt records rank {shards['rank']} of {shards['world_size']}, not rank {rank} of "
                f"{world}: the directory's run files were moved or mixed; resume from an intact checkpoint."
            )
        if _digest(targets) != shards["digest"]:
            raise CheckpointError(
                f"{root}: the tensors in {_TENSORS}/ are not the ones saved with run.rank{rank}.pt (their digest "
                "differs): parameters or optimizer state of another step. Resume from an intact checkpoint."
            )
    except CheckpointError as exc:
        error = exc
    _raise_together(error, str(root))
    new_params, opt = _from_tensor_dict(targets, params, state.opt)
    out["params"] = new_params
    out["state"] = dataclasses.replace(out["state"], opt=opt)
    return out


def load_sharded_model_state(directory: str | os.PathLike[str], *, params: Any, opt_state: Any = None
                             ) -> tuple[tuple[Any, ...], Any]:
    """The parameters (and optimizer state) of a sharded checkpoint, on ANY number of ranks.

    DCP records every tensor's full shape, so each rank reads exactly its own rows
    (bit for bit the saved values): the way to continue on another world size, to
    evaluate, or to fine-tune further. The run state (noise, sampler, accountant) is not
    read: what follows is a new run.

    Args:
        directory: what :func:`save_sharded_run` wrote.
        params: template sharded parameters of the model on the current ranks.
        opt_state: the template optimizer state (``optimizer.init`` of the local shards),
            or ``None`` for the parameters alone.

    Returns:
        ``(params, opt_state)``: new ``DTensor`` s placed like ``params``, and the
        optimizer state (``None`` when not asked for).

    Raises:
        CheckpointError: the directory holds no sharded checkpoint, or its tensors do not
            fit the templates (another model).

    Privacy: a run that continues from these parameters is a NEW run: its privacy cost
    adds to the saved run's (compose the two accountants' costs); the saved run's noise
    keys are not reused by reading this.
    """
    layout = ShardLayout.of(params)
    root = Path(directory)
    if not (root / _TENSORS).is_dir():
        raise CheckpointError(f"{root} holds no sharded checkpoint (no {_TENSORS}/ directory); give the directory "
                              "that DPPlan.save_checkpoint wrote for the sharded run.")
    targets = _tensor_dict(_fresh_like(params), opt_state, layout)
    if opt_state is None:
        targets = {k: v for k, v in targets.items() if k.startswith("params/")}
    _dcp_load(targets, root)
    return _from_tensor_dict(targets, params, opt_state)


# --- private helpers ---------------------------------------------------------------


def _layout_of(params: Any, state: Any, who: str) -> ShardLayout:
    if not isinstance(state, FSDPStepState):
        raise InputTypeError(
            f"{who}: state is a {type(state).__name__}, not the state of a sharded pipeline "
            "(plan.pipeline(..., model=fmodel) with fmodel from make_functional_fsdp)."
        )
    return ShardLayout.of(params)


def _dcp_load(targets: dict[str, Any], root: Path) -> None:
    """DCP's load of ``targets`` in place (a collective); its failures as a ``CheckpointError``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: every rank's causes

    try:
        dcp.load(targets, checkpoint_id=str(root / _TENSORS))
    except (CheckpointException, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"{root}: its tensors do not fit the templates (another model or optimizer?): "
                              f"{type(exc).__name__}: {exc}"[:2000]) from exc


def _check_extra(extra: dict[str, Any], who: str) -> None:
    if "shards" in extra:
        raise InputValueError(f"{who}: the tree name 'shards' is the sharded checkpoint's own; name yours otherwise.")


def _without_opt(state: FSDPStepState) -> FSDPStepState:
    """The state the run file holds (the optimizer's shards live in DCP's files)."""
    return dataclasses.replace(state, opt=None)


def _raise_together(error: Exception | None, where: str) -> None:
    """Every rank raises when any rank has an ``error`` (so none goes on alone into a collective).

    The rank with the error raises it; the others raise ``CheckpointRanksError`` naming it.
    """
    from opake_fx.errors import CheckpointRanksError
    from opake_fx.serialization import refuse_together

    as_checkpoint = error if error is None or isinstance(error, CheckpointError) else CheckpointError(str(error))
    try:
        refuse_together(as_checkpoint, where)
    except CheckpointRanksError:
        raise
    except CheckpointError:
        raise error from None


def saved_world_size(directory: str | os.PathLike[str]) -> int:
    """The number of ranks that saved the sharded checkpoint ``directory`` (from its ``meta.json``).

    Raises:
        CheckpointError: no complete sharded checkpoint there, or an unreadable ``meta.json``.

    Privacy: none (the run files' own copy is the one :func:`load_sharded_run` checks).

    Example:
        >>> import json, tempfile
        >>> d = tempfile.mkdtemp()
        >>> _ = open(f"{d}/meta.json", "w").write(json.dumps({"world_size": 2, "step": 3}))
        >>> saved_world_size(d)
        2
    """
    root = Path(directory)
    try:
        meta = json.loads((root / _META).read_text())
        return int(meta["world_size"])
    except OSError:
        raise CheckpointError(f"{root} holds no complete sharded checkpoint (no {_META}); a save that was killed "
                              "leaves its directory as <name>.partial and the previous checkpoint in place.") from None
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"{root}/{_META} is not readable.") from None


def _fresh_like(params: Any) -> tuple[Any, ...]:
    from torch.distributed.tensor import DTensor

    return tuple(DTensor.from_local(p.to_local().detach().clone(), p.device_mesh, p.placements, shape=p.shape,
                                    stride=p.stride()) for p in params)


def _per_parameter_groups(flat: dict[str, Any], local_shapes: list[tuple[int, ...]]) -> dict[str, int]:
    """``{path: parameter index}`` of the optimizer leaves that are one parameter's shard.

    A leaf is one when it is entry ``i`` of a container whose entries are exactly
    ``0 .. N-1`` (N = the number of parameters) and every one of them is a tensor of the
    matching local shard's shape: a tree mapped over the parameters, as an elementwise
    optimizer's moments are. Anything else is not taken to be sharded.
    """
    n = len(local_shapes)
    parents: dict[str, dict[str, Any]] = {}
    for path, leaf in flat.items():
        parent, _, last = path.rpartition("/")
        parents.setdefault(parent, {})[last] = leaf
    out: dict[str, int] = {}
    for parent, children in parents.items():
        if sorted(children) != sorted(str(i) for i in range(n)):
            continue
        if all(isinstance(children[str(i)], torch.Tensor) and tuple(children[str(i)].shape) == local_shapes[i]
               for i in range(n)):
            for i in range(n):
                out[f"{parent}/{i}" if parent else str(i)] = i
    return out


def _tensor_dict(params: Any, opt_state: Any, layout: ShardLayout) -> dict[str, Any]:
    """What DCP saves: ``params/i`` (the parameters' DTensors) and ``opt/<path>`` (shards or replicated leaves)."""
    from torch.distributed.tensor import DTensor, Shard

    from opake_fx.serialization import state_dict

    out: dict[str, Any] = {f"params/{i}": p for i, p in enumerate(params)}
    if opt_state is None:
        return out
    flat = state_dict(opt_state)
    local_shapes = [(stop - start, *shape[1:]) for (start, stop), shape in zip(layout.rows, layout.full_shapes)]
    sharded = _per_parameter_groups(flat, local_shapes)
    for path, leaf in flat.items():
        if path in sharded:
            shape = layout.full_shapes[sharded[path]]
            stride = torch.empty(shape, device="meta").stride()
            leaf = DTensor.from_local(leaf.contiguous(), layout.mesh, (Shard(0),), shape=torch.Size(shape),
                                      stride=stride)
        out[f"opt/{path}"] = leaf
    return out


def _from_tensor_dict(tensors: dict[str, Any], params: Any, opt_state: Any) -> tuple[tuple[Any, ...], Any]:
    from torch.distributed.tensor import DTensor

    from opake_fx.serialization import from_state_dict

    new_params = tuple(tensors[f"params/{i}"] for i in range(len(params)))
    if opt_state is None:
        return new_params, None
    flat = {k[len("opt/"):]: (v.to_local() if isinstance(v, DTensor) else v)
            for k, v in tensors.items() if k.startswith("opt/")}
    return new_params, from_state_dict(opt_state, flat)


def _leaf_bytes(leaf: Any) -> bytes:
    from torch.distributed.tensor import DTensor

    if isinstance(leaf, DTensor):
        leaf = leaf.to_local()
    if isinstance(leaf, torch.Tensor):
        t = leaf.detach().cpu().contiguous().reshape(-1)
        return repr((str(t.dtype), tuple(leaf.shape))).encode() + t.view(torch.uint8).numpy().tobytes()
    return repr((type(leaf).__name__, leaf)).encode()


def _digest(tensors: dict[str, Any]) -> str:
    """A hash of this rank's part of ``tensors`` (its shards, and the replicated leaves)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode() + b"\0" + _leaf_bytes(tensors[name]))
    return h.hexdigest()


def _check_replicated_agree(tensors: dict[str, Any]) -> None:
    """Leaves saved once (not a parameter's shard) must be equal on every rank, else DCP would keep one rank's."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    replicated = {k: v for k, v in tensors.items() if not isinstance(v, DTensor)}
    mine = {k: hashlib.sha256(_leaf_bytes(v)).hexdigest() for k, v in replicated.items()}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    differ = sorted(k for k in mine if any(other.get(k) != mine[k] for other in everyone))
    if differ or any(set(other) != set(mine) for other in everyone):
        raise InputValueError(
            f"save_sharded_run: optimizer state {differ or 'entries'} differ between the ranks and are not one "
            "parameter's shard (a tree mapped over the parameters, leaf i of the local shard's shape), so they cannot "
            "be saved once for all ranks. Use an elementwise optimizer (sgd, adam, ...) or keep the state replicated."
        )
