"""Splitting a dataset between ranks: :func:`local_shard`.

Policy: rank ``r`` of ``W`` gets the contiguous block of indices
``[floor(r * N / W), floor((r + 1) * N / W))``. The blocks are disjoint, cover all ``N``
examples, depend only on ``(N, r, W)``, and their sizes differ by at most one, so when
``N`` is not divisible by ``W`` some ranks hold one example more. Nothing is dropped and,
above all, nothing is duplicated: padding shards by repeating examples (as
``torch.utils.data.DistributedSampler`` does) would put one example on two ranks and
double its influence on the summed gradient (sensitivity ``2 * max_norm``).

Unequal shards are fine for DP-SGD with Poisson sampling: every rank samples its shard
with the global rate ``q`` and its own key, so each example of the union is included
independently with probability ``q``, exactly as a single process sampling the whole
dataset, and every rank runs the same number of steps.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import Subset

import opake_fx.validation as check
from opake_fx.distributed.collectives import get_rank, get_world_size
from opake_fx.errors import InputTypeError, InputValueError

__all__ = ["local_shard", "shard_bounds"]


def local_shard(dataset: Any, rank: int | None = None, world_size: int | None = None) -> Subset:
    """This rank's disjoint share of ``dataset``, as a ``torch.utils.data.Subset``.

    Args:
        dataset: any map-style dataset (with ``__len__`` and ``__getitem__``).
        rank: this process's rank in ``[0, world_size)``; default: the current rank.
        world_size: the number of shards; default: the current world size.

    Returns:
        ``Subset(dataset, range(start, stop))`` with the bounds of :func:`shard_bounds`;
        ``subset.indices`` maps local positions to global indices.

    Raises:
        InputTypeError: ``rank``/``world_size`` are not ints, or ``dataset`` has no length.
        InputValueError: ``world_size < 1`` or ``rank`` outside ``[0, world_size)``.

    Privacy:
        The shards are disjoint, so each example lives on exactly one rank and the sum
        of the ranks' clipped gradients keeps sensitivity ``max_norm``. Sample each shard
        with the global ``sample_rate`` and ``key=fold_in(key, rank)``: the union of the
        ranks' batches is then a Poisson sample of the whole dataset.

    Example:
        >>> shards = [local_shard(list(range(10)), rank=r, world_size=3) for r in range(3)]
        >>> [list(s.indices) for s in shards]
        [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]
    """
    start, stop = shard_bounds(_length(dataset), rank, world_size)
    return Subset(dataset, range(start, stop))


def shard_bounds(n: int, rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """The half-open index range ``(start, stop)`` of rank ``rank``'s shard of ``n`` examples.

    Privacy: none (a function of public sizes).

    Example:
        >>> [shard_bounds(10, r, 4) for r in range(4)]
        [(0, 2), (2, 5), (5, 7), (7, 10)]
    """
    if world_size is None:
        world_size = get_world_size()
    world_size = check.integer(world_size, "world_size", "local_shard", minimum=1)
    rank = check.integer(get_rank() if rank is None else rank, "rank", "local_shard")
    n = check.integer(n, "n", "local_shard", minimum=0, hint="It is the dataset length.")
    if not 0 <= rank < world_size:
        raise InputValueError(
            f"local_shard needs 0 <= rank < world_size; got rank={rank}, world_size={world_size}. Pass "
            "rank=dist.get_rank() and world_size=dist.get_world_size() (or leave both out)."
        )
    return rank * n // world_size, (rank + 1) * n // world_size


def _length(dataset: Any) -> int:
    try:
        return len(dataset)
    except TypeError as exc:
        raise InputTypeError(
            f"local_shard needs a map-style dataset with __len__; got {type(dataset).__name__}. For an iterable "
            "dataset, shard the stream yourself (e.g. itertools.islice(stream, rank, None, world_size))."
        ) from exc
