"""Gaussian noise that resists floating-point attacks: :func:`secure_normal` and :func:`add_secure_gaussian`.

The default noise (:func:`opake_fx.random.normal`) is fast, keyed and reproducible, but
its floating-point outputs have a structure an attacker can exploit: a sampler built on
``log`` / ``sqrt`` / ``cos`` of finitely many uniforms can produce only some doubles, and
``x + noise`` rounded to the gradient's dtype keeps, in its low-order bits, information
about ``x`` (Mironov 2012, "On significance of the least significant bits for
differential privacy", for Laplace; Holohan and Braghin 2021, "Secure random sampling in
differential privacy", for the Gaussian). The defences here:

1. **A cryptographically strong source**: uniforms from the operating system's CSPRNG
   (``os.urandom``), never from a seedable generator; nobody, the checkpoint's holder
   included, can recompute the noise.
2. **Sampling that hides the sampler's lattice** (Holohan and Braghin 2021; what
   Opacus's ``secure_mode`` does): each value is the sum of four independent Box-Muller
   normals divided by two (a standard normal again), drawn from 53-bit uniforms in float64.
3. **Adding in float64, then snapping**: ``x + std * z`` is computed in float64 and
   rounded to a grid of spacing ``2**(floor(log2(std)) - 30)`` (about ``std / 1e9``,
   negligible next to the noise), then cast once to the gradient's dtype. The released
   value lies on a grid that does not depend on ``x`` (as for Mironov's snapping), and the
   float64 fine structure sits far below the grid.

Privacy: the output is the Gaussian mechanism with stddev ``std`` up to a rounding of at
most half a grid step (post-processing), drawn from a source the attacker cannot predict.
It is not reproducible by design: keyed replay, identical noise across ranks from a
shared key, and bit-identical resumes do not apply; under ``torch.distributed`` rank 0
draws and every rank receives its result.

Example:
    >>> import torch
    >>> z = secure_normal((10_000,))
    >>> abs(float(z.std()) - 1.0) < 0.05
    True
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch

from opake_fx.distributed.collectives import get_rank, is_distributed
from opake_fx.errors import InputValueError

__all__ = ["secure_uniform", "secure_normal", "add_secure_gaussian", "snap_grid"]

_SUMMANDS = 4  # normals summed per value (Holohan and Braghin 2021; Opacus's secure_mode)
_GRID_BITS = 30  # the snapping grid lies this many binary digits below the stddev


def secure_uniform(n: int) -> torch.Tensor:
    """``n`` float64 uniforms in ``(0, 1]`` on a 2**-53 grid, from the OS's CSPRNG.

    Privacy: unpredictable; not reproducible.

    Example:
        >>> u = secure_uniform(1000)
        >>> bool((u > 0).all() and (u <= 1).all()), u.dtype
        (True, torch.float64)
    """
    if n < 0:
        raise InputValueError(f"secure_uniform needs n >= 0; got {n}.")
    if n == 0:
        return torch.zeros(0, dtype=torch.float64)
    words = torch.frombuffer(bytearray(os.urandom(8 * n)), dtype=torch.int64)
    mantissa = (words >> 11) & ((1 << 53) - 1)  # the top 53 bits, whatever the sign
    return (mantissa + 1).to(torch.float64) * 2.0**-53  # exact: mantissa + 1 <= 2**53


def secure_normal(shape: Sequence[int]) -> torch.Tensor:
    """Standard normals (float64, CPU): each the sum of four Box-Muller normals divided by two.

    Privacy: unpredictable; the output's floating-point support does not follow the
    lattice of a single Box-Muller transform.

    Example:
        >>> secure_normal((2, 3)).shape
        torch.Size([2, 3])
    """
    n = math.prod(shape)
    u = secure_uniform(_SUMMANDS * n).view(_SUMMANDS, n)
    total = torch.zeros(n, dtype=torch.float64)
    for pair in range(_SUMMANDS // 2):  # one Box-Muller pair gives two independent normals
        radius = torch.sqrt(-2.0 * torch.log(u[2 * pair]))
        angle = (2.0 * math.pi) * u[2 * pair + 1]
        total += radius * (torch.cos(angle) + torch.sin(angle))
    return (total / math.sqrt(_SUMMANDS)).view(tuple(shape))


def snap_grid(std: float) -> float:
    """The snapping grid for stddev ``std``: ``2**(floor(log2(std)) - 30)``.

    Example:
        >>> snap_grid(1.0) == 2.0**-30
        True
    """
    if not (std > 0 and math.isfinite(std)):
        raise InputValueError(f"snap_grid needs a finite stddev > 0; got {std}.")
    return 2.0 ** (math.floor(math.log2(std)) - _GRID_BITS)


def add_secure_gaussian(leaves: Sequence[torch.Tensor], stds: Sequence[float]) -> list[torch.Tensor]:
    """``leaf + N(0, std**2)`` per leaf: CSPRNG draws, added in float64, snapped, cast once.

    Under ``torch.distributed`` rank 0 computes the noised leaves and broadcasts them, so
    every rank holds the same values (the leaves must already agree, as after ``psum``).

    Args:
        leaves: the tensors to noise (any floating dtype, any device).
        stds: one stddev >= 0 per leaf (0 leaves the leaf unchanged).

    Returns:
        New tensors, each with its leaf's dtype and device.

    Privacy: the Gaussian mechanism with stddev ``std`` on each leaf, as in the module
    docstring.

    Example:
        >>> import torch
        >>> out = add_secure_gaussian([torch.zeros(4, dtype=torch.bfloat16)], [1.0])
        >>> out[0].dtype, out[0].shape
        (torch.bfloat16, torch.Size([4]))
    """
    if len(leaves) != len(stds):
        raise InputValueError(f"add_secure_gaussian needs one stddev per leaf; got {len(stds)} for {len(leaves)} leaves.")
    receiving = is_distributed() and get_rank() != 0
    out = []
    for leaf, std in zip(leaves, stds):
        std = float(std)
        if receiving:
            out.append(torch.empty_like(leaf, memory_format=torch.contiguous_format))  # filled by rank 0's broadcast
        elif std == 0.0:
            out.append(leaf.clone(memory_format=torch.contiguous_format))
        else:
            grid = snap_grid(std)
            noised = leaf.to(torch.float64) + std * secure_normal(leaf.shape).to(leaf.device)
            out.append((torch.round(noised / grid) * grid).to(leaf.dtype))  # /, round, * by a power of 2: exact
    if is_distributed():
        for t in out:
            torch.distributed.broadcast(t, src=0)
    return out
