"""Aggregating gradients across ranks, keeping their privacy metadata honest.

:func:`sum_gradients` / :func:`sum_gradients_` are the DP-SGD aggregation step: they sum a
:class:`~opake_fx.types.ClippedPytree` over ranks *before* noise is added, and refuse a
:class:`~opake_fx.types.NoisedPytree`. :func:`reduce_pytree` / :func:`reduce_pytree_` are
the general tools behind them (any reduction of a pytree of tensors; sum and mean of the
DP wrappers with updated metadata).

Metadata rules (every example lives on exactly one rank, as
:func:`opake_fx.distributed.local_shard` guarantees; ``W`` is the world size):

=====================  ==============================  ======================================
reduction              ``max_norm``                    ``noise_stddev`` (``NoisedPytree``)
=====================  ==============================  ======================================
``sum``                unchanged                       ``* sqrt(W)``
``mean``               ``/ W``                         ``* sqrt(W) / W``
``max``/``min``/       refused (no sensitivity bound)  refused
``prod``
=====================  ==============================  ======================================

``sum`` keeps ``max_norm``: adding or removing one example changes only its own rank's
clipped sum, by at most ``max_norm``. The ``noise_stddev`` rule is exact when each rank
drew independent noise; if every rank used the same noise key the true stddev of the sum
is ``W * sigma``, so ``sqrt(W) * sigma`` is a lower bound (the recorded value never
overstates the noise). ``mean`` is ``sum`` divided by the public scalar ``W``. See
``docs/distributed.md`` ("sigma-inflation pitfalls").

Before any tensor moves, every rank checks that all ranks hold the same tree (leaf shapes,
dtypes, wrapper types) and the same metadata; a mismatch raises
:class:`~opake_fx.errors.DistributedMismatchError` on every rank, naming both values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import optree
import torch

from opake_fx.distributed._checks import fingerprint
from opake_fx.distributed.agreement import agree
from opake_fx.distributed._backend import collective_device, resolve_op
from opake_fx.distributed.collectives import all_reduce_, get_world_size, is_distributed
from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.pytree import NAMESPACE
from opake_fx.types import ClippedPytree, NoisedPytree, SecondMomentClippingOutput, SecondMomentNoiseOutput

__all__ = [
    "sum_gradients",
    "sum_gradients_",
    "reduce_pytree",
    "reduce_pytree_",
    "reduce_copy",
    "check_reduction",
    "refuse_noised",
]

PyTree = Any

_WRAPPER_OPS = ("sum", "mean")
# Tensors are all-reduced in flat buckets of at most this many elements (per dtype and
# device): few collectives for many small leaves, bounded extra memory for big ones.
_BUCKET_NUMEL = 1 << 24


def sum_gradients(gradients: PyTree) -> PyTree:
    """Sums clipped gradients over all ranks; returns a copy (DP alias of ``reduce_pytree(op="sum")``).

    Call it between clipping and noise: ``clip -> sum_gradients -> noise``. A
    :class:`~opake_fx.types.ClippedPytree` keeps its ``max_norm``; plain pytrees of tensors
    are summed too. In a single process it returns a copy of the input.

    Args:
        gradients: a ``ClippedPytree``, a ``SecondMomentClippingOutput``, or a pytree of
            tensors (same structure, shapes and dtypes on every rank).

    Returns:
        The summed value, of the same type, with new tensors.

    Raises:
        InputTypeError: for a ``NoisedPytree`` (noise must be added after the sum), or a
            non-tensor leaf.
        DistributedMismatchError: if ranks hold different trees or different ``max_norm``.
        OperationError: if the all-reduce failed (another rank crashed or timed out).

    Privacy:
        Under add-or-remove-one neighbours, with every example on exactly one rank
        (:func:`~opake_fx.distributed.local_shard`), the sum has the same L2 sensitivity
        ``max_norm`` as each rank's clipped sum. Adding noise to it once, with the same
        key on every rank, is one Gaussian mechanism over the union of the ranks' batches.

    Example:
        >>> import torch
        >>> from opake_fx.types import ClippedPytree
        >>> g = sum_gradients(ClippedPytree((torch.ones(2),), max_norm=0.5))
        >>> g.max_norm, g.pytree[0].tolist()   # one process: a copy
        (0.5, [1.0, 1.0])
    """
    refuse_noised(gradients, "sum_gradients")
    return reduce_copy(gradients, "sum", where="sum_gradients")


def sum_gradients_(gradients: PyTree) -> None:
    """In-place :func:`sum_gradients`: overwrites the tensor leaves with the sum over ranks.

    Args:
        gradients: a ``ClippedPytree``, ``SecondMomentClippingOutput`` or pytree of tensors.

    Raises:
        InputTypeError: for a ``NoisedPytree`` or a non-tensor leaf.
        DistributedMismatchError: if ranks hold different trees or different ``max_norm``.
        OperationError: if the all-reduce failed.

    Privacy:
        As :func:`sum_gradients`: ``max_norm`` stays valid for the summed tensors.

    Example:
        >>> import torch
        >>> from opake_fx.types import ClippedPytree
        >>> g = ClippedPytree((torch.ones(2),), max_norm=0.5)
        >>> sum_gradients_(g)          # in one process the values stay as they are
        >>> g.pytree[0].tolist()
        [1.0, 1.0]
    """
    refuse_noised(gradients, "sum_gradients_")
    _execute(_plan(gradients, "sum", in_place=True, where="sum_gradients_"))


def reduce_pytree(pytree: PyTree, op: str = "sum") -> PyTree:
    """Returns a copy of ``pytree`` with every tensor leaf reduced over ranks; the input is unchanged.

    DP wrappers anywhere in the tree (``ClippedPytree``, ``NoisedPytree``, the
    second-moment pairs) are reduced with updated metadata for ``"sum"`` and ``"mean"``
    (see the module docstring) and refused for other reductions. In a single process
    the result is a copy with the same values and metadata.

    Args:
        pytree: a pytree of tensors, possibly containing DP wrappers.
        op: ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or ``"prod"``.

    Returns:
        A new pytree of the same structure with detached, reduced tensors.

    Raises:
        InputValueError: unknown ``op``, or ``max``/``min``/``prod`` of a DP wrapper.
        InputTypeError: a non-tensor leaf, or ``"mean"`` of an integer leaf.
        DistributedMismatchError: ranks hold different trees or different metadata.
        OperationError: the collective failed.

    Privacy:
        Sum of a ``ClippedPytree``: sensitivity ``max_norm`` (one example lives on one
        rank). Mean: ``max_norm / W``. A ``NoisedPytree`` keeps its guarantee
        (post-processing) and records ``noise_stddev * sqrt(W)`` (sum), exact for
        independent per-rank noise and a lower bound for identical noise; prefer
        aggregating before noise (:func:`sum_gradients`).

    Example:
        >>> import torch
        >>> from opake_fx.types import NoisedPytree
        >>> n = reduce_pytree(NoisedPytree((torch.ones(1),), max_norm=1.0, noise_stddev=2.0), op="mean")
        >>> n.max_norm, n.noise_stddev     # one process: W = 1
        (1.0, 2.0)
    """
    return reduce_copy(pytree, op, where="reduce_pytree")


def reduce_pytree_(pytree: PyTree, op: str = "sum") -> None:
    """All-reduces the tensor leaves of ``pytree`` in place.

    Only reductions that leave the wrappers' metadata unchanged are accepted: ``"sum"``
    of a ``ClippedPytree`` (or a ``SecondMomentClippingOutput``). ``"mean"`` of any
    wrapper and ``"sum"`` of a ``NoisedPytree`` change ``max_norm``/``noise_stddev``, which
    a frozen wrapper cannot do in place: they raise at any world size (so a
    single-process test catches them), and :func:`reduce_pytree` returns the updated wrapper.

    Args:
        pytree: a pytree of tensors, possibly containing DP wrappers.
        op: ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or ``"prod"``.

    Raises:
        InputValueError: unknown ``op``, or ``max``/``min``/``prod`` of a DP wrapper.
        InputTypeError: the reduction would change wrapper metadata; a non-tensor leaf;
            ``"mean"`` of an integer leaf.
        DistributedMismatchError: ranks hold different trees or different metadata.
        OperationError: the collective failed.

    Privacy:
        As :func:`reduce_pytree`; the accepted cases keep the metadata valid as it is.

    Example:
        >>> import torch
        >>> t = {"w": torch.ones(2)}
        >>> reduce_pytree_(t, op="max")    # one process: nothing changes
        >>> t["w"].tolist()
        [1.0, 1.0]
    """
    _execute(_plan(pytree, op, in_place=True, where="reduce_pytree_"))


def reduce_copy(tree: PyTree, op: str, *, where: str, full_check: bool = True) -> PyTree:
    """:func:`reduce_pytree` for stages and wrappers: ``where`` names the caller in error messages.

    ``full_check=False`` checks the ranks' agreement by one all-reduce of a digest (the
    full comparison runs only when the digests differ), for stages past their first step.
    """
    plan = _plan(tree, op, in_place=False, where=where)
    _execute(plan, full_check=full_check)
    return plan.result


def check_reduction(tree: PyTree, op: str, *, where: str) -> None:
    """Runs every local check of reducing ``tree`` with ``op`` (op, leaves, wrapper rules) without moving data.

    Raises what :func:`reduce_pytree_` would raise for the same input, naming ``where``;
    for callers that skip the collective on one process and must still refuse what a
    multi-process run would refuse.
    """
    _plan(tree, op, in_place=True, where=where)


def refuse_noised(tree: PyTree, where: str) -> None:
    """Raises InputTypeError if ``tree`` holds a NoisedPytree: noise must come after aggregation."""
    found = optree.tree_leaves(tree, is_leaf=_is_noised, namespace=NAMESPACE)
    if any(_is_noised(leaf) for leaf in found):
        raise InputTypeError(
            f"{where} got a NoisedPytree: noise was added before the gradients were aggregated across ranks. "
            "Aggregate the ClippedPytree first, then add noise once, with the same key on every rank "
            "(clip -> sum_gradients -> noise). Noising before the all-reduce sums W noise draws (W * sigma "
            "for identical keys, sqrt(W) * sigma for independent ones) for a sensitivity of max_norm: far "
            "more noise than the accountant was told about, and with identical keys the per-rank values "
            "reveal the differences of the ranks' clipped gradients without any noise."
        )


# --- planning and execution ------------------------------------------------------------


@dataclass
class _Plan:
    op: str
    where: str
    in_place: bool
    world_size: int
    tensors: list[torch.Tensor] = field(default_factory=list)
    fields: list[tuple[str, Any]] = field(default_factory=list)
    shapes: list[Any] = field(default_factory=list)
    result: Any = None


def _plan(tree: PyTree, op: str, *, in_place: bool, where: str) -> _Plan:
    resolve_op(op)
    plan = _Plan(op=op, where=where, in_place=in_place, world_size=get_world_size())
    plan.result = _walk(tree, plan, path=(), inside_wrapper=False)
    return plan


def _execute(plan: _Plan, *, full_check: bool = True) -> None:
    if not is_distributed():
        return
    device = collective_device(plan.tensors[0] if plan.tensors else None)
    agree(
        plan.where,
        [("tree structure (leaf shapes, dtypes and wrapper types)", fingerprint(plan.shapes)), *plan.fields],
        full=full_check,
        fix=(
            "Every rank must pass the same tree (same parameters in the same order, same dtypes) with the same "
            "wrapper metadata: build clipped_grad with the same clipping_norm and normalize_by on every rank, "
            "and keep noise after aggregation."
        ),
        device=device,
    )
    with torch.no_grad():
        for bucket in _buckets(plan.tensors):
            if len(bucket) == 1 and bucket[0].is_contiguous():
                all_reduce_(bucket[0], op=plan.op)
                continue
            flat = torch.cat([t.reshape(-1) for t in bucket])
            all_reduce_(flat, op=plan.op)
            offset = 0
            for t in bucket:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def _buckets(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    # Same order on every rank (the tree structure was checked equal): group by
    # (device, dtype) in order of first appearance, then cut into size-capped buckets.
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    out: list[list[torch.Tensor]] = []
    for members in groups.values():
        current: list[torch.Tensor] = []
        size = 0
        for t in members:
            if current and size + t.numel() > _BUCKET_NUMEL:
                out.append(current)
                current, size = [], 0
            current.append(t)
            size += t.numel()
        if current:
            out.append(current)
    return out


def _is_special(x: Any) -> bool:
    return isinstance(x, (ClippedPytree, SecondMomentClippingOutput, SecondMomentNoiseOutput, torch.Tensor))


def _is_noised(x: Any) -> bool:
    return isinstance(x, (NoisedPytree, SecondMomentNoiseOutput))


def _walk(tree: PyTree, plan: _Plan, *, path: tuple[Any, ...], inside_wrapper: bool) -> PyTree:
    paths, leaves, spec = optree.tree_flatten_with_path(tree, is_leaf=_is_special, namespace=NAMESPACE)
    rebuilt = [_visit(leaf, plan, path + p, inside_wrapper) for p, leaf in zip(paths, leaves)]
    return optree.tree_unflatten(spec, rebuilt)


def _visit(leaf: Any, plan: _Plan, path: tuple[Any, ...], inside_wrapper: bool) -> Any:
    if isinstance(leaf, torch.Tensor):
        if plan.op == "mean" and not (leaf.is_floating_point() or leaf.is_complex()):
            raise InputTypeError(
                f"{plan.where}(op='mean') needs floating-point leaves; the leaf at path {path} is {leaf.dtype}. "
                "Cast it (tree_map(torch.Tensor.float, tree)) or use op='sum'."
            )
        t = leaf if plan.in_place else leaf.detach().clone()
        plan.tensors.append(t)
        plan.shapes.append((tuple(t.shape), str(t.dtype)))
        return t
    if isinstance(leaf, (ClippedPytree, SecondMomentClippingOutput, SecondMomentNoiseOutput)):
        if inside_wrapper and isinstance(leaf, ClippedPytree):
            raise InputTypeError(
                f"{plan.where} found a {type(leaf).__name__} inside another ClippedPytree (at path {path}); "
                "wrappers do not nest. Keep one wrapper around the raw gradient pytree."
            )
        label = type(leaf).__name__ + (f"@{path}" if path else "")
        plan.shapes.append(label)
        if isinstance(leaf, SecondMomentClippingOutput):
            return SecondMomentClippingOutput(
                _visit(leaf.grads, plan, path + ("grads",), inside_wrapper),
                _visit(leaf.squared_grads, plan, path + ("squared_grads",), inside_wrapper),
            )
        if isinstance(leaf, SecondMomentNoiseOutput):
            return SecondMomentNoiseOutput(
                _visit(leaf.noisy_grads, plan, path + ("noisy_grads",), inside_wrapper),
                _visit(leaf.noisy_squared_grads, plan, path + ("noisy_squared_grads",), inside_wrapper),
            )
        return _visit_clipped(leaf, plan, path, label)
    raise InputTypeError(
        f"{plan.where} expects tensor leaves; the leaf at path {path} is a {type(leaf).__name__}. Convert it with "
        "torch.as_tensor or keep it out of the tree (a DP wrapper's max_norm and noise_stddev are metadata and "
        "handled separately)."
    )


def _visit_clipped(node: ClippedPytree, plan: _Plan, path: tuple[Any, ...], label: str) -> ClippedPytree:
    kind = type(node).__name__
    noised = isinstance(node, NoisedPytree)
    if plan.op not in _WRAPPER_OPS:
        raise InputValueError(
            f"{plan.where}(op={plan.op!r}) of a {kind}: no sensitivity bound is known for the {plan.op} of "
            f"clipped values, so the result could not stay a {kind}. Use op='sum' or op='mean', or reduce "
            f"`.pytree` (non-private use) and wrap the result with a max_norm you can justify."
        )
    if plan.in_place and (plan.op == "mean" or noised):
        changed = "max_norm and noise_stddev" if noised and plan.op == "mean" else (
            "noise_stddev" if noised else "max_norm"
        )
        raise InputTypeError(
            f"in-place {plan.op} of a {kind} would change its {changed}, which a {kind} cannot do in place "
            f"(its metadata is frozen). Use reduce_pytree({kind.lower()}, op={plan.op!r}), which returns a new "
            "wrapper with the updated metadata."
            + (" For DP-SGD, aggregate the ClippedPytree before adding noise instead." if noised else "")
        )
    plan.fields.append((f"{label}.max_norm", node.max_norm))
    if noised:
        plan.fields.append((f"{label}.noise_stddev", node.noise_stddev))
    inner = _walk(node.pytree, plan, path=path + ("pytree",), inside_wrapper=True)
    w = plan.world_size
    if plan.in_place:
        return node
    max_norm = node.max_norm if plan.op == "sum" else node.max_norm / w
    if not noised:
        return replace(node, pytree=inner, max_norm=max_norm)
    # Independent per-rank noise: the sum has stddev sqrt(W) * sigma (a lower bound for
    # identical noise, whose sum has W * sigma). The mean is the sum divided by W.
    factor = math.sqrt(w) if plan.op == "sum" else math.sqrt(w) / w
    stddev = None if node.noise_stddev is None else node.noise_stddev * factor
    return replace(node, pytree=inner, max_norm=max_norm, noise_stddev=stddev)
