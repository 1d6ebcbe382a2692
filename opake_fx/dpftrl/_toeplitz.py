"""Lower-triangular Toeplitz algebra on coefficient vectors (private; torch, differentiable).

A lower-triangular Toeplitz ``n x n`` matrix is its first column ``c`` (``C[i, j] =
c[i - j]``), i.e. the power series ``c(x) = sum c_k x^k`` truncated at ``x^n``: products
of such matrices are truncated convolutions, inverses are power-series inverses. Every
function here works on float64 coefficient tensors and is differentiable with autograd,
so the strategy optimisers can use them inside their losses.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "conv",
    "series_inverse",
    "series_sqrt",
    "materialize",
    "minsep_sensitivity_squared",
    "nonincreasing_majorant",
]

_DIRECT_CONV = 64  # below this length a direct convolution is faster and exact


def conv(a: torch.Tensor, b: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` coefficients of the product of the series ``a`` and ``b`` (zero-padded)."""
    la, lb = a.shape[-1], b.shape[-1]
    a, b = a[..., :n], b[..., :n]
    la, lb = a.shape[-1], b.shape[-1]
    m = la + lb - 1
    if min(la, lb) <= _DIRECT_CONV:
        # Direct: sum over the shorter sequence of shifted copies of the longer one.
        short, long = (a, b) if la <= lb else (b, a)
        out = torch.zeros((*torch.broadcast_shapes(a.shape[:-1], b.shape[:-1]), min(m, n)), dtype=a.dtype, device=a.device)
        for k in range(short.shape[-1]):
            if k >= n:
                break
            width = min(long.shape[-1], n - k)
            out[..., k : k + width] = out[..., k : k + width] + short[..., k : k + 1] * long[..., :width]
        return _pad(out, n)
    size = 1 << (m - 1).bit_length()
    fa = torch.fft.rfft(a, size)
    fb = torch.fft.rfft(b, size)
    return _pad(torch.fft.irfft(fa * fb, size)[..., : min(m, n)], n)


def series_inverse(c: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` coefficients of ``1 / c(x)`` (the first column of ``C^{-1}``).

    Newton's iteration ``g <- g (2 - c g)`` doubles the number of correct coefficients
    per step, so the cost is O(n log n) with FFT convolutions.
    """
    if c.shape[-1] == 0:
        raise ValueError("series_inverse needs at least one coefficient.")
    g = (1.0 / c[..., :1]).clone()
    m = 1
    while m < n:
        m = min(2 * m, n)
        cg = conv(c, g, m)
        two_minus = -cg
        two_minus = two_minus + torch.nn.functional.pad(torch.ones_like(c[..., :1]) * 2.0, (0, m - 1))
        g = conv(g, two_minus, m)
    return g[..., :n]


def series_sqrt(a: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` coefficients of ``sqrt(a(x))`` with ``sqrt(a_0) > 0``.

    Solves ``s * s = a`` term by term: ``s_k = (a_k - sum_{0<j<k} s_j s_{k-j}) / (2 s_0)``
    (O(n^2) scalar work; only used for closed-form strategies with modest ``n``).
    """
    a = _pad(a[:n].double(), n)
    if not float(a[0]) > 0:
        raise ValueError("series_sqrt needs a positive leading coefficient.")
    s = torch.zeros(n, dtype=torch.float64)
    s[0] = math.sqrt(float(a[0]))
    for k in range(1, n):
        inner = torch.dot(s[1:k], s[1:k].flip(0)) if k > 1 else 0.0
        s[k] = (a[k] - inner) / (2.0 * s[0])
    return s


def materialize(c: torch.Tensor, n: int) -> torch.Tensor:
    """The dense ``n x n`` lower-triangular Toeplitz matrix with first column ``c`` (zero-padded)."""
    c = _pad(c[:n], n)
    i = torch.arange(n)
    diff = i[:, None] - i[None, :]
    return torch.where(diff >= 0, c[diff.clamp(min=0)], torch.zeros((), dtype=c.dtype))


def minsep_sensitivity_squared(c: torch.Tensor, n: int, min_sep: int, max_participations: int | None) -> torch.Tensor:
    """Squared sensitivity of the Toeplitz matrix ``T(c)`` under b-min-sep participation.

    Exact when ``c`` is non-negative and non-increasing (McMahan et al. 2024,
    arXiv:2405.13763, Thm. 2): the worst case
    is ``k`` participations at steps ``0, b, 2b, ...``, whose contributions are aligned.
    The caller must check the assumption (or pass :func:`nonincreasing_majorant`'s
    output for an upper bound).
    """
    b = int(min_sep)
    k = _max_participations(n, b, max_participations)
    c = _pad(c[:n], n)
    blocks = -(-n // b)
    padded = _pad(c, blocks * b).reshape(blocks, b)
    v = torch.cumsum(padded, dim=0)
    if k < blocks:
        v = torch.cat([v[:k], v[k:] - v[:-k]], dim=0)
    v = v.reshape(-1)[:n]
    return torch.dot(v, v)


def nonincreasing_majorant(c: torch.Tensor) -> torch.Tensor:
    """The smallest non-negative, non-increasing sequence that dominates ``|c|`` entrywise."""
    return torch.flip(torch.cummax(torch.flip(c.abs(), (0,)), dim=0).values, (0,))


def _max_participations(n: int, min_sep: int, max_participations: int | None) -> int:
    most = -(-n // min_sep)
    return most if max_participations is None else min(int(max_participations), most)


def _pad(x: torch.Tensor, n: int) -> torch.Tensor:
    if x.shape[-1] >= n:
        return x[..., :n]
    return torch.nn.functional.pad(x, (0, n - x.shape[-1]))
