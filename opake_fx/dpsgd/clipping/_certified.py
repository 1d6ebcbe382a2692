"""Per-example norms that are upper bounds after rounding.

A clip weight ``w_i = min(1, C / n_i)`` bounds example ``i``'s contribution by ``C``
only if ``n_i`` is at least the norm of what the weighted sum actually adds for that
example. Training examples may come from an adversary, who can choose activations whose
per-position terms cancel (nearly equal rows with output gradients of alternating sign):
then a Gram-product norm ``sum_{t,s} (a_t . a_s)(g_t . g_s)`` evaluated in float32 can
come out far below the true value, or negative (a NaN norm). So every norm that decides
a weight is *certified* here: computed with float64 accumulation, plus a rigorous bound
on what rounding can hide (Higham, "Accuracy and Stability of Numerical Algorithms",
2002, section 3.1: a sum or dot product of ``n`` terms evaluated in any order has
relative error at most ``gamma_n = n u / (1 - n u)`` of the sum of absolute terms).

The bounds below use only that standard model of floating point, never a particular
summation order, so they hold on any device and any BLAS.
"""

from __future__ import annotations

import torch

#: Unit roundoff of each floating-point dtype (half the machine epsilon).
_UNIT = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
}

# Rows of a float32 tensor are converted to float64 this many elements at a time, so the
# float64 copy stays in cache.
_CHUNK_ELEMS = 1 << 18


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u`` of ``dtype``: every rounded operation has relative error at most ``u``."""
    return _UNIT.get(dtype, 2.0**-24)


def gamma(n: int, dtype: torch.dtype) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)``: the relative error bound of an ``n``-term sum."""
    nu = n * unit_roundoff(dtype)
    if nu >= 0.5:
        raise ValueError(f"a sum of {n} terms in {dtype} has no useful rounding bound")
    return nu / (1.0 - nu)


def sq_norms(x: torch.Tensor) -> torch.Tensor:
    """Upper bounds of the squared L2 norm of each row of ``x`` ``[B, ...]``, float64 ``[B]``.

    The entries are taken as they are stored (the values a weighted sum will read): every
    square of a float32 / bfloat16 / float16 value is exact in float64, and the float64
    sum's rounding is covered by a ``(1 + gamma_{n+2})`` factor. float64 rows whose sum
    of squares overflows are rescaled by their largest entry; the square of a norm above
    ~1.3e154 is inf, which the engine treats as a non-finite example (weight 0).
    """
    b = x.shape[0]
    x = x.reshape(b, -1)
    n = x.shape[1]
    if x.dtype == torch.float64:
        sq = torch.linalg.vecdot(x, x)
        bad = ~torch.isfinite(sq)
        if bool(bad.any()):
            finite = torch.isfinite(x).all(dim=1) & bad
            if bool(finite.any()):
                scale = _power_of_two_scale(x.abs().amax(dim=1))
                scaled = x / scale.unsqueeze(1)  # exact: a power of two
                sq = torch.where(finite, torch.linalg.vecdot(scaled, scaled) * scale.square(), sq)
    else:
        step = max(1, _CHUNK_ELEMS // max(1, n))
        parts = []
        for lo in range(0, b, step):
            rows = x[lo : lo + step].to(torch.float64)
            parts.append(torch.linalg.vecdot(rows, rows))
        sq = parts[0] if len(parts) == 1 else torch.cat(parts)
    return sq * (1.0 + gamma(n + 2, torch.float64))


def gram_sq_norms(a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Certified ``||sum_t g_t a_t^T||_F^2`` per example and group, summed over groups.

    Args:
        a: ``[b, G, T, d_in]`` layer inputs (or unfolded patches), any float dtype.
        g: ``[b, G, T, d_out]`` output gradients.

    Returns:
        ``(sq, s)``, float64 ``[b]`` each: ``sq`` is an upper bound of the exact squared
        norm of the per-example weight gradient of the stored ``a`` and ``g``; ``s`` is
        ``sum_{G,t} |a_t| |g_t|`` (rounded up), an upper bound of the norm itself
        (triangle inequality) that also bounds the rounding of sums over positions.

    The Gram products are evaluated in float64, where the products of float32 inputs are
    exact and cannot overflow. With ``A = a a^T``, ``H = g g^T`` and ``r_ts = |a_t| |a_s|
    |g_t| |g_s|`` (``sum_ts r_ts = s_G^2`` per group), the computed ``sum_ts A_ts H_ts``
    differs from the exact one by at most ``(gamma_{d_in} + gamma_{d_out} +
    gamma_{T^2}) (1 + gamma)^2 sum_G s_G^2``; that bound is added, and the result is
    capped at ``sum_G s_G^2`` (never below zero).
    """
    b, groups, t = a.shape[0], a.shape[1], a.shape[2]
    d_in, d_out = a.shape[3], g.shape[3]
    a64, g64 = a.to(torch.float64), g.to(torch.float64)
    scale = None
    if a.dtype == torch.float64 or g.dtype == torch.float64:
        # float64 inputs can overflow (or underflow) in the Gram products: take every example
        # at the power-of-two scale of its largest entry, so the rescaling is exact.
        sa = _power_of_two_scale(a64.abs().flatten(1).amax(1))
        sg = _power_of_two_scale(g64.abs().flatten(1).amax(1))
        if bool(((sa > 2.0**300) | (sg > 2.0**300) | (sa < 2.0**-300) | (sg < 2.0**-300)).any()):
            a64, g64 = a64 / sa.view(-1, 1, 1, 1), g64 / sg.view(-1, 1, 1, 1)
            scale = (sa * sg).square()
    a3, g3 = a64.reshape(b * groups, t, d_in), g64.reshape(b * groups, t, d_out)
    aa = torch.bmm(a3, a3.transpose(1, 2))
    gg = torch.bmm(g3, g3.transpose(1, 2))
    p = torch.linalg.vecdot(aa.view(b, -1), gg.view(b, -1))
    na = torch.linalg.vector_norm(a64, dim=3)  # [b, G, T]
    ng = torch.linalg.vector_norm(g64, dim=3)
    s_group = (na * ng).sum(dim=2)  # [b, G]
    slack = 1.0 + gamma(2 * t + d_in + d_out + groups + 8, torch.float64)  # rounding of the norms and their sums
    s_sq = s_group.square().sum(dim=1) * slack**2
    err = (gamma(d_in + 2, torch.float64) + gamma(d_out + 2, torch.float64) + gamma(groups * t * t + 2, torch.float64)) * 1.01
    sq = torch.minimum((p + err * s_sq).clamp_min(0.0), s_sq)
    s = s_group.sum(dim=1) * slack
    if scale is not None:
        sq, s = sq * scale, s * scale.sqrt()
    return sq, s


def matmul_rounding(terms: int, dtype: torch.dtype) -> float:
    """Relative bound (of ``sum_t |g_t| |a_t|``) on the rounding of ``sum_t w g_t a_t^T``
    evaluated in ``dtype`` over ``terms`` positions: the weighted sum of a ghost-norm layer."""
    return gamma(terms + 2, dtype)


def output_factor(dtype: torch.dtype) -> float:
    """Factor on a certified norm covering the few roundings between a weight and the
    output (the weight's cast, its product with the gradient, the division by
    ``normalize_by``): ``1 + 4u`` of the output dtype."""
    return 1.0 + 4.0 * unit_roundoff(dtype)


def _power_of_two_scale(amax: torch.Tensor) -> torch.Tensor:
    """A power of two near ``amax`` (1 for zeros and non-finite values): dividing by it is exact."""
    _, exponent = torch.frexp(amax)
    ok = torch.isfinite(amax) & (amax > 0)
    return torch.where(ok, torch.ldexp(torch.ones_like(amax), exponent.to(amax.dtype)), torch.ones_like(amax))
