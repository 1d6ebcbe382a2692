"""Shared tensors: parameter-derived tensors without a batch axis that meet the batch later.

Position embeddings looked up on ``[1, T]`` or ``[T]`` ids (GPT-2 without
``position_ids``, DistilBERT, BART's decoder), T5's relative-attention bias looked up
on a ``[T, T]`` bucket tensor: a module call whose outputs have no batch axis (a *shared
call*, decided by provenance: the output's shape is the same at sub-batches of 2 and 3).
Its output ``D`` (after any ops that keep it free of the batch: ``permute``,
``unsqueeze``, ``.to``, other shared tensors...) enters the batch at an elementwise op
with a batched operand: ``x + D``, ``scores += D``, ``x * D``,
``torch.where(mask, D, -inf)``, the ``attn_mask`` of ``scaled_dot_product_attention``. There, example ``i``'s
gradient of ``D`` is row ``i`` of the gradient of ``D`` broadcast along the batch, and
example ``i``'s gradient of every parameter ``P`` that ``D`` is computed from is the
vector-Jacobian product of ``D(P)`` with that row. So, at such a *site*, ``D`` is
replaced by ``D`` expanded along a new leading batch axis (detached, through a tap that
reports the gradient ``[B, *D.shape]``), the values and the forward are unchanged, and
after the backward pass one batched vector-Jacobian product of the shared subgraph
(``torch.autograd.grad(..., is_grads_batched=True)``) gives ``[B, *P.shape]`` for every
parameter reachable from the sites. No per-example copy of the model is made.

What is proven, not guessed: the op that is a site is found by provenance (its result
has the batch as first axis at sub-batches of 2 and 3 and ``D`` does not, so ``D``
is broadcast along it), numbered in the order the shared tensors are read, and matched
by function and shape (:class:`SharedTensors`); any other op that reads a shared tensor
and gives a batched result (``bmm``, ``cat``, ``repeat``...) is not a site, and since the
sites are the only place ``D``'s graph is cut, the parameters behind such a use are still
seen by the autograd graph of the losses and take the exact whole-loss fallback with a
:class:`~opake_fx.errors.SlowPathWarning`, as before. Whether the model mixes examples
is checked at the sites too (:mod:`._independence` watches their rows).

Privacy contract: the engine's weights come from certified norms of the stored
``[B, *P.shape]`` per-example gradients that the weighted sum reads, so each example's
contribution is at most ``C`` as computed in floating point.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from opake_fx.dpsgd.clipping._rules_elementwise import BINARY_OPS

Shape = tuple[int, ...]

#: In-place forms of :data:`BINARY_OPS` (they write into the first operand).
_INPLACE = {
    torch.Tensor.add_, torch.Tensor.__iadd__, torch.Tensor.sub_, torch.Tensor.__isub__,
    torch.Tensor.mul_, torch.Tensor.__imul__, torch.Tensor.div_, torch.Tensor.__itruediv__,
}


#: ``where(condition, x, y)``: elementwise with broadcasting over its three operands.
_WHERE = {torch.where, torch.Tensor.where}
_SDPA = {torch.nn.functional.scaled_dot_product_attention}

Slot = Any  # an index into args, or a keyword name


def site_of(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Shape, list[Slot]] | None:
    """For an op whose operands broadcast elementwise, the shape they broadcast to and the
    operands that do (the slots a shared tensor may be expanded in); None for other calls.

    * two-tensor arithmetic (``+ - * /``, also in place, where the result has the first
      operand's shape): both operands;
    * ``where(condition, x, y)``: its three operands (scalars allowed);
    * ``scaled_dot_product_attention``: its ``attn_mask``, which broadcasts to
      ``[*batch, L, S]`` (the scores) whatever the other operands are;
    * ``d.repeat(B, 1, ...)``: ``d`` stacked ``B`` times along its first axis (DeBERTa's
      position projections meet its ``[B * heads, ...]`` scores so): the shape is
      ``[B, *d.shape]`` and the result is read as ``len(d)`` rows per example.
    """
    if func is torch.Tensor.repeat:
        return _repeat_site(args, kwargs)
    if func in _SDPA:
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        if not isinstance(mask, torch.Tensor) or len(args) < 3 or not all(isinstance(a, torch.Tensor) for a in args[:3]):
            return None
        q, k = args[0], args[1]
        try:
            batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
            shape = tuple(torch.broadcast_shapes(mask.shape, (*batch, q.shape[-2], k.shape[-2])))
        except RuntimeError:
            return None
        return shape, ["attn_mask" if "attn_mask" in kwargs else 3]
    if kwargs and set(kwargs) - {"alpha"} or "out" in kwargs:
        return None
    if func in _WHERE:
        if len(args) != 3 or not isinstance(args[0], torch.Tensor) or not any(isinstance(a, torch.Tensor) for a in args[1:]):
            return None
        slots = [j for j, a in enumerate(args) if isinstance(a, torch.Tensor)]
    elif func in BINARY_OPS or func in _INPLACE:
        if len(args) != 2 or not all(isinstance(a, torch.Tensor) for a in args):
            return None
        if func in _INPLACE:
            return tuple(args[0].shape), [1]
        slots = [0, 1]
    else:
        return None
    try:
        return tuple(torch.broadcast_shapes(*(args[j].shape for j in slots))), slots
    except RuntimeError:
        return None


def _repeat_site(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Shape, list[Slot]] | None:
    """``d.repeat(r, 1, ..., 1)``: ``r`` copies of ``d`` stacked along its first axis (the
    result's rows ``j * len(d) + i`` are ``d[i]``); the site shape is ``[r, *d.shape]``."""
    if kwargs or not args or not isinstance(args[0], torch.Tensor):
        return None
    d, reps = args[0], args[1:]
    if len(reps) == 1 and isinstance(reps[0], (tuple, list, torch.Size)):
        reps = tuple(reps[0])
    if len(reps) != d.dim() or d.dim() == 0 or not all(isinstance(r, int) for r in reps) or any(r != 1 for r in reps[1:]):
        return None
    return (reps[0], *d.shape), [0]


def expand_for_site(d: torch.Tensor, shape: Shape, detach: bool = True) -> torch.Tensor | None:
    """``d`` (detached unless ``detach=False``) with a leading axis of ``shape[0]`` rows,
    broadcastable against ``shape`` exactly as ``d`` was: its aligned leading size must be
    1 or absent."""
    if not shape or d.dim() > len(shape):
        return None
    aligned = (1,) * (len(shape) - d.dim()) + tuple(d.shape)
    if aligned[0] != 1:
        return None
    return (d.detach() if detach else d).reshape(aligned).expand(shape[0], *aligned[1:])


@dataclass
class OpRecord:
    """One op that read a shared tensor, as the probe records it."""

    func: Any
    producers: tuple[int, ...]  # records (or -1: a shared call) that made its shared operands
    outputs: list[Shape]  # the result's shape for a site candidate, else its tensor leaves' shapes


#: (op number, func, result shapes) -> rows per example of the single result (1: batch first), 0 (no
#: batch axis in any result) or None (undecidable)
Verdict = Callable[[int, Any, list[Shape]], "int | None"]
#: (op number, shared operand, result shape) -> replacement for the operand
OnSite = Callable[[int, torch.Tensor, Shape], torch.Tensor]


class SharedTensors(TorchFunctionMode):
    """Follows shared tensors through a forward pass.

    Two ways to run:

    * *recording* (``verdict=None``, the probe): every op that reads a followed tensor is
      recorded (:class:`OpRecord`) and all its tensor results are followed, whatever their
      shape; :func:`number_reached` later keeps the ops the real run reaches;
    * *following* (``verdict`` given): an op that reads a followed tensor gets the next
      number; an elementwise op whose result is batched (by ``verdict``) is a site, where
      each followed operand is replaced by ``on_site(k, d, shape)``; the results of an op
      with no batch axis are followed; anything else is left as it is (:attr:`escaped`).
    """

    def __init__(self, verdict: Verdict | None = None, on_site: OnSite | None = None) -> None:
        super().__init__()
        self.verdict, self.on_site = verdict, on_site
        self.producer: dict[int, int] = {}  # id(tensor) -> its record (-1: a shared call's output)
        self.keep: list[torch.Tensor] = []  # strong references: ids are not reused while we follow them
        self.records: list[OpRecord] = []
        self.count = 0
        self.escaped: list[str] = []  # ops that read a shared tensor with a batched or undecidable result
        self.pauses = 0

    def seed(self, tensors: list[torch.Tensor]) -> None:
        """Follows the outputs of a shared call."""
        for t in tensors:
            self._follow(t, -1)

    def _follow(self, t: torch.Tensor, producer: int) -> None:
        self.producer[id(t)] = producer
        self.keep.append(t)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Ops run in the body are not followed (hooks and rules reading shapes or checking a call)."""
        self.pauses += 1
        try:
            yield
        finally:
            self.pauses -= 1

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        read = _followed(args, kwargs, self.producer) if not self.pauses else []
        if not read:
            return func(*args, **kwargs)
        site = site_of(func, args, kwargs)
        if site is None:  # ops without a tensor result (shapes, sizes, .item()) carry no gradient: not numbered
            out = func(*args, **kwargs)
            outs = _tensors(out)
            if not outs:
                return out
        if self.verdict is None:
            return self._record(func, out if site is None else func(*args, **kwargs), site, read)
        k, self.count = self.count, self.count + 1
        if site is not None:
            if func is torch.Tensor.repeat:  # its verdict is of its result, [r * len(d), ...]
                r, rows, *rest = site[0]
                v = self.verdict(k, func, [(r * rows, *rest)])
                if v is not None and v > 0 and v == rows and id(args[0]) in {id(t) for t in read}:
                    return self._repeat(k, args[0], site[0])
            else:
                v = self.verdict(k, func, [site[0]])
                if v == 1:
                    return self._site(func, args, kwargs, k, site, read)
            out = func(*args, **kwargs)
            outs = _tensors(out)
        else:
            v = self.verdict(k, func, [tuple(t.shape) for t in outs])
        if v == 0:
            for t in outs:
                self._follow(t, k)
        else:
            self.escaped.append(getattr(func, "__name__", repr(func)))
        return out

    def _record(self, func: Any, out: Any, site: tuple[Shape, list[Slot]] | None, read: list[torch.Tensor]) -> Any:
        outs = _tensors(out)
        k = len(self.records)
        self.records.append(OpRecord(func, tuple(self.producer[id(t)] for t in read),
                                     [tuple(t.shape) for t in outs] if site is None or func is torch.Tensor.repeat
                                     else [site[0]]))
        for t in outs:
            self._follow(t, k)
        return out

    def _site(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], k: int,
              site: tuple[Shape, list[Slot]], read: list[torch.Tensor]) -> Any:
        shape, slots = site
        ids = {id(t) for t in read}
        new_args, new_kwargs = list(args), dict(kwargs)
        replaced = set()
        for slot in slots:
            a = new_kwargs[slot] if isinstance(slot, str) else new_args[slot]
            if isinstance(a, torch.Tensor) and id(a) in ids:
                e = expand_for_site(a, shape)
                if e is None:  # (provenance says the result is batched and the operand is not: cannot happen)
                    break
                r = self.on_site(k, a, shape) if self.on_site is not None else a
                if isinstance(slot, str):
                    new_kwargs[slot] = r
                else:
                    new_args[slot] = r
                replaced.add(id(a))
        else:
            if replaced == ids:
                return func(*new_args, **new_kwargs)
        self.escaped.append(getattr(func, "__name__", repr(func)))  # a shared operand outside the slots
        return func(*args, **kwargs)


    def _repeat(self, k: int, d: torch.Tensor, shape: Shape) -> torch.Tensor:
        """``d.repeat(B, 1, ...)`` as ``d`` expanded along a new batch axis, flattened: the same values."""
        d1 = d.unsqueeze(0)
        e = self.on_site(k, d1, shape) if self.on_site is not None else d1.expand(shape)
        return e.expand(shape).reshape(shape[0] * shape[1], *shape[2:])


def number_reached(small: list[OpRecord], large: list[OpRecord],
                   rows: Callable[[OpRecord, OpRecord], int | None]) -> list[tuple[Any, OpRecord, OpRecord]] | None:
    """The ops a following run reaches, in order, from two recording runs (sub-batches of 2
    and 3): an op is reached when one of its shared operands comes from a shared call or from
    a reached op whose result has no batch axis (``rows(...) == 0``). None when the two runs
    recorded different ops."""
    if len(small) != len(large) or any(a.func != b.func or a.producers != b.producers
                                       or len(a.outputs) != len(b.outputs) for a, b in zip(small, large)):
        return None
    free: set[int] = {-1}  # records whose results a following run keeps following
    reached = []
    for k, (a, b) in enumerate(zip(small, large)):
        if not any(p in free for p in a.producers):
            continue
        reached.append((a.func, a, b))
        if rows(a, b) == 0:
            free.add(k)
    return reached


def _followed(args: tuple[Any, ...], kwargs: dict[str, Any], producer: dict[int, int]) -> list[torch.Tensor]:
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            if id(a) in producer:
                found.append(a)
        elif isinstance(a, (list, tuple)):
            found += [t for t in a if isinstance(t, torch.Tensor) and id(t) in producer]
    return found


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []


__all__ = ["OnSite", "OpRecord", "SharedTensors", "Verdict", "expand_for_site", "number_reached", "site_of"]
