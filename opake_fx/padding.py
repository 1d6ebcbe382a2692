"""Fixed batch shapes for variable batches: padding buckets and padding masks.

Poisson sampling gives every step a different batch size, and a compiled step
(:func:`opake_fx.compiled.compile_step`) compiles once per input shape. Padding each
batch up to one of a few *bucket* sizes bounds the number of compilations; the padding
rows are marked by a bool mask (``True``: a real example) that the clip stage honours:
a padding row gets clip weight 0, so it contributes exactly zero to the clipped sum,
to every count (clipped, non-finite, the adaptive clip's quantile count) and to the
reported losses and norms, whatever it holds.

Padding never touches the accounting: the sampler decides which examples are in the
batch, the padding only adds rows that the mask removes again (the same idea as
jax_privacy's padded batches). It never truncates: a batch larger than the largest
bucket is padded to a multiple of that bucket.

Example:
    >>> import torch
    >>> sizes = geometric_buckets(16, up_to=64)
    >>> sizes
    (8, 10, 13, 17, 22, 28, 35, 44, 55, 64)
    >>> bucket_for(11, sizes)
    13
    >>> (x, y), mask = pad_batch((torch.arange(3.0), torch.tensor([0, 1, 2])), 5)
    >>> x.tolist(), mask.tolist()
    ([0.0, 1.0, 2.0, 2.0, 2.0], [True, True, True, False, False])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import optree
import torch

from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.pytree import NAMESPACE

__all__ = ["geometric_buckets", "bucket_for", "pad_batch"]


def geometric_buckets(expected_batch_size: float, *, up_to: int, growth: float = 1.25, lowest: float = 0.5) -> tuple[int, ...]:
    """Bucket sizes from ``lowest * expected_batch_size`` up to ``up_to``, each ``growth`` times the last.

    A Poisson batch of mean ``b`` is padded by at most a factor ``growth`` (and small
    batches up to the smallest bucket), and the number of sizes a run meets, hence of
    compilations, grows like ``log(spread) / log(growth)``: about 6 for ``b = 16`` over a
    200-step run with the default growth.

    Args:
        expected_batch_size: the sampler's mean batch size (> 0).
        up_to: the largest batch the sampler can draw (e.g. the dataset size); the last
            bucket.
        growth: the ratio of consecutive buckets (> 1).
        lowest: the smallest bucket as a fraction of ``expected_batch_size``.

    Privacy: none (sizes only).
    """
    if not (isinstance(expected_batch_size, (int, float)) and math.isfinite(expected_batch_size) and expected_batch_size > 0):
        raise InputValueError(f"geometric_buckets: expected_batch_size must be a finite number > 0; got {expected_batch_size!r}.")
    if isinstance(up_to, bool) or not isinstance(up_to, int) or up_to < 1:
        raise InputValueError(f"geometric_buckets: up_to must be a positive int (the largest batch); got {up_to!r}.")
    if not (isinstance(growth, (int, float)) and math.isfinite(growth) and growth > 1):
        raise InputValueError(f"geometric_buckets: growth must be a finite number > 1; got {growth!r}.")
    size = max(1, min(up_to, math.ceil(lowest * expected_batch_size)))
    sizes = [size]
    while sizes[-1] < up_to:
        sizes.append(min(up_to, max(sizes[-1] + 1, math.ceil(sizes[-1] * growth))))
    return tuple(sizes)


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """The padded size of a batch of ``n`` examples: the smallest bucket ``>= n``.

    Beyond the largest bucket, the next multiple of it (never fewer rows than ``n``: the
    batch is padded, never cut, so every sampled example is in it).

    Privacy: none (sizes only).
    """
    if not buckets or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in buckets):
        raise InputValueError(f"bucket sizes must be a non-empty sequence of positive ints; got {buckets!r}.")
    for size in sorted(buckets):
        if size >= n:
            return size
    top = max(buckets)
    return top * math.ceil(n / top)


def pad_batch(batch: Any, size: int) -> tuple[Any, torch.Tensor]:
    """Pads every tensor of ``batch`` along its first axis to ``size`` rows; returns ``(padded, mask)``.

    The padding rows repeat the last real example (ordinary values: no NaN or
    out-of-range input reaches the model), and ``mask`` (bool ``[size]``, on the device
    of the first tensor) is ``True`` for the ``n`` real rows. Pass the mask as
    ``example_mask=`` to a clip stage (or a clipping function's ``grad_fn``): the padding
    rows then contribute exactly zero.

    Args:
        batch: a tensor or a pytree of tensors sharing their first (batch) dimension,
            ``n >= 1``.
        size: the padded size, ``>= n``.

    Privacy: the padding rows hold copies of a real example, but their clip weight is 0,
        so the release is that of the unpadded batch; the accounting is unchanged.
    """
    leaves, spec = optree.tree_flatten(batch, namespace=NAMESPACE)
    if not leaves or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in leaves):
        raise InputTypeError("pad_batch needs a tensor or a pytree of tensors, each with a leading batch dimension.")
    n = leaves[0].shape[0]
    if any(t.shape[0] != n for t in leaves):
        raise InputValueError(f"pad_batch: the batch's tensors disagree on the batch size: {[t.shape[0] for t in leaves]}.")
    if n == 0:
        raise InputValueError("pad_batch: an empty batch has no example to pad with; run the step unpadded.")
    if isinstance(size, bool) or not isinstance(size, int) or size < n:
        raise InputValueError(f"pad_batch: size must be an int >= the batch size {n} (padding never drops an example); got {size!r}.")
    mask = torch.arange(size, device=leaves[0].device) < n
    if size == n:
        return batch, mask
    padded = [torch.cat([t, t[-1:].expand(size - n, *t.shape[1:])]) for t in leaves]
    return spec.unflatten(padded), mask
