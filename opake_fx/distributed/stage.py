"""The aggregation chain stage: :func:`psum`."""

from __future__ import annotations

from typing import Any

from opake_fx.distributed.collectives import is_distributed
from opake_fx.distributed.gradients import check_reduction, reduce_copy, refuse_noised
from opake_fx.pipeline_privacy import StagePrivacy
from opake_fx.transforms import Transform
from opake_fx.types import EmptyState

__all__ = ["psum"]


def psum() -> Transform:
    """Sums the stage input over all ranks: the "aggregate" step between ``clip`` and ``noise``.

    With a process group, ``update`` returns :func:`~opake_fx.distributed.sum_gradients` of
    its input (a new value; a ``ClippedPytree`` stays one, with ``max_norm`` checked equal
    across ranks). Without one it returns the input unchanged, so the same pipeline runs
    on 1 or N ranks. Plain pytrees of tensors are summed too (non-private use, e.g.
    ``noise_multiplier=0`` baselines); a ``NoisedPytree`` is refused on any world size.

    Returns:
        A stateless :class:`~opake_fx.transforms.Transform`.

    Raises (from ``update``):
        InputTypeError: the input is (or contains) a ``NoisedPytree``, or has non-tensor leaves.
        DistributedMismatchError: ranks hold different trees or ``max_norm`` (compared in
            full on the first call in this process, then by one all-reduce of a digest).
        OperationError: the all-reduce failed.

    Privacy:
        Every example lives on one rank, so the summed ``ClippedPytree`` keeps sensitivity
        ``max_norm``; the following ``noise`` stage (same key on every rank) adds one
        Gaussian draw to the sum over the union of the ranks' batches. Noise before
        ``psum`` is refused: it would add W draws for one sensitivity.

    Example:
        >>> import torch
        >>> from opake_fx.dpsgd import clip, noise
        >>> from opake_fx.random import key
        >>> from opake_fx.transforms import chain
        >>> f = lambda p, x: ((x - p) ** 2).sum()
        >>> t = chain(clip(f, clipping_norm=1.0, batch_argnums=(1,)), psum(), noise(noise_multiplier=0.0, key=key(0)))
        >>> p = torch.zeros(2)
        >>> out, _ = t.update((torch.ones(4, 2),), t.init(p), p)
        >>> type(out).__name__, out.max_norm
        ('NoisedPytree', 1.0)
    """

    calls = [0]  # the first all-reduce in this process compares in full; later ones by digest

    def init(params: Any) -> EmptyState:
        return EmptyState()

    def update(x: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
        refuse_noised(x, "psum")
        if not is_distributed():
            check_reduction(x, "sum", where="psum")
            return x, state
        out = reduce_copy(x, "sum", where="psum", full_check=calls[0] == 0)
        calls[0] += 1
        return out, state

    return Transform(init, update, StagePrivacy("aggregate", "sum over ranks"))
