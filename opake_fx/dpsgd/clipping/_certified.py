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
summation order, so they hold on any device and any BLAS. Underflow is covered by an
absolute term: a float32 operation whose result is subnormal errs by at most ``2**-150``
(Higham, section 2.1), which :data:`TINY32` bounds per operation.

float32 inputs take a fast path where it is sound: row sums and Gram matrices are
formed in float32 (a float32 matmul is IEEE float32 only when torch's float32 matmul
precision is ``"highest"`` and no TF32/bf16 shortcut is enabled:
:func:`float32_matmul_is_ieee`; otherwise the float64 path is taken), and their rounding
bound is added.

No host synchronisation: nothing here reads a tensor's value on the host, so a step can
run ahead of the device (and be traced). Rows, or examples, whose largest entry is outside
a safe band (``[2**-21, 2**20)`` in float32, ``[2**-300, 2**300)`` in float64) are first
multiplied by the power of two that brings it into ``[0.5, 1)``: exact (but for entries
pushed into underflow, whose bound is added), undone exactly in float64, and applied to
every row on the device (by 1 inside the band), so no row overflows or loses its digits
to underflow and no row needs recomputing. The float32 row sums are then within about
``gamma_514`` (3e-5) of the value for every finite row. A float32 Gram bound can still be
loose for an example crafted to cancel (nearly equal positions against output gradients
of alternating sign): it is kept (no host synchronisation to find such examples and
recompute them in float64, as an earlier version did): still an upper bound, above the
exact norm by at most about ``sqrt(gamma_{d_in} + gamma_{d_out} + 2 gamma_T)`` of the
triangle bound ``sum_t |a_t| |g_t|`` (~2e-2 of it for GPT-2 small's widest layer, T = 1024), so
such an example is clipped harder than needed by that much, never less; ordinary
examples are over-estimated by about 1e-4 of the squared norm. Only a row or example
holding a NaN or an inf gets a non-finite norm (weight 0 in the engine).
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

# float32 tensors of fewer elements than this take the float64 path of :func:`sq_norms`:
# three operations (copy, dot products, one factor) against the float32 path's dozen small
# ones (row scales, segment sums, bounds), about 5x faster below it on CPU (measured:
# 31 us against 170 us for 16 x 4096 on 2 threads; at 16 x 8192 the float32 path wins).
_FLOAT32_PATH_ELEMS = 1 << 17

#: Bound on the absolute error of one float32 operation whose result underflows (twice
#: the half-spacing of float32's subnormals, for margin).
TINY32 = 2.0**-149

#: A float32 bound above its computed value by more than this fraction is *loose*
#: (:func:`_gram_sq_norms_float32` reports which; the public functions keep such bounds).
LOOSE = 1e-2

# Row sums of squares in float32 are taken over segments of this many entries and the
# segments summed in float64, so the float32 rounding bound is that of a short sum.
_SEGMENT = 512
# Squared row norms below this keep every float32 Gram entry and partial sum finite.
_RANGE32 = 2.0**120


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u`` of ``dtype``: every rounded operation has relative error at most ``u``."""
    return _UNIT.get(dtype, 2.0**-24)


def gamma(n: int, dtype: torch.dtype) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)``: the relative error bound of an ``n``-term sum."""
    nu = n * unit_roundoff(dtype)
    if nu >= 0.5:
        raise ValueError(f"a sum of {n} terms in {dtype} has no useful rounding bound")
    return nu / (1.0 - nu)


@torch.compiler.assume_constant_result
def float32_matmul_is_ieee(device: torch.device) -> bool:
    """Whether a float32 matmul on ``device`` rounds as IEEE float32 (no TF32 / bf16 inputs).

    Traced code takes the answer as a constant (:class:`opake_fx.compiled.CompiledStep`
    refuses a step once torch's matmul precision settings differ from its first call's).

    Example:
        >>> float32_matmul_is_ieee(torch.device("cpu"))  # torch's default settings
        True
    """
    if torch.get_float32_matmul_precision() != "highest":
        return False
    if getattr(torch.backends, "fp32_precision", "none") not in ("none", "ieee"):
        return False
    if device.type == "cuda":
        matmul = torch.backends.cuda.matmul
        return not matmul.allow_tf32 and getattr(matmul, "fp32_precision", "none") in ("none", "ieee")
    if device.type == "cpu":
        mkldnn = getattr(torch.backends.mkldnn, "matmul", None)
        return getattr(mkldnn, "fp32_precision", "none") in ("none", "ieee")
    return False  # other devices: no known guarantee


def sq_norms(x: torch.Tensor) -> torch.Tensor:
    """Upper bounds of the squared L2 norm of each row of ``x`` ``[B, ...]``, float64 ``[B]``.

    The entries are taken as they are stored (the values a weighted sum will read). float32
    rows of a tensor of ``2**17`` entries or more are summed in float32 over segments of
    (up to) 512 entries and the segments in float64, with the float32 rounding bound (and
    an underflow term) added. A row whose largest entry is outside ``[2**-21, 2**20)`` is
    first multiplied by the power of two that brings that entry into ``[0.5, 1)`` (exact,
    and undone exactly in float64), so no row overflows float32 or loses its digits to
    underflow: every finite row gets a bound within about ``gamma_514`` (3e-5) of its
    value, with no recomputation and no host synchronisation. Smaller float32 tensors and
    other dtypes take the float64 path: every square of a float32 / bfloat16 / float16
    value is exact in float64, and the float64 sum's rounding is covered by a
    ``(1 + gamma_{n+2})`` factor; float64 rows are rescaled the same way (outside ``[2**-300, 2**300)``). A norm whose square is beyond
    float64's range (above ~1.3e154) is inf, and a row holding a NaN or an inf has a
    non-finite bound: the engine gives those examples weight 0.

    Example:
        >>> sq = sq_norms(torch.tensor([[3.0, 4.0], [0.0, 0.0]]))
        >>> bool(sq[0] >= 25.0) and bool(sq[0] <= 25.0 * (1 + 1e-5)), float(sq[1])
        (True, 0.0)
    """
    b = x.shape[0]
    x = x.reshape(b, -1)
    n = x.shape[1]
    if x.dtype == torch.float32 and x.is_contiguous() and n > 0 and b * n >= _FLOAT32_PATH_ELEMS:
        return _sq_norms_float32_scaled(x)
    return _sq_norms_float64(x)


def _sq_norms_float32_scaled(x: torch.Tensor) -> torch.Tensor:
    """:func:`sq_norms` of a float32 ``[b, n]``: float32 segment sums of each row at the
    power-of-two scale of its largest entry (:func:`_row_scales`), undone in float64.

    A row scaled down can lose entries to underflow (the scaled value of an entry below
    ``2**-126`` is rounded, off by at most ``2**-150``); with every scaled entry below 4
    that moves the norm by at most ``sqrt(n) 2**-150`` and the squared norm by at most
    ``4 n 2**-150 + n 2**-300``, which is added (it vanishes next to such a row's squared
    norm, at least 0.25). Rows of zeros are exactly 0; a NaN or inf entry gives a
    non-finite bound."""
    amax = x.abs().amax(dim=1)
    e, down = _row_scales(amax, _BAND32, _EXP32)
    xs = x * _exp2(-e, torch.float32).unsqueeze(1)  # exact, but for entries that underflow
    sq, _ = _sq_norms_float32(xs)
    sq = torch.where(down, sq + x.shape[1] * 2.0**-147, sq)
    sq = sq * _exp2(2 * e, torch.float64)  # 2e in [-200, 252]: exact in float64
    return torch.where(amax == 0, torch.zeros((), dtype=sq.dtype, device=sq.device), sq)  # (NaN stays NaN)


def _sq_norms_float32(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Certified squared row norms of a float32 ``[b, n]`` from float32 segment sums, and
    which rows to recompute (bound looser than :data:`LOOSE`, or not finite)."""
    b, n = x.shape
    seg = min(_SEGMENT, n)
    k = n // seg
    head = x[:, : k * seg].reshape(b, k, seg)
    parts = torch.linalg.vecdot(head, head).to(torch.float64)  # [b, k] float32 segment sums
    # A segment of m squares summed in float32 is below the exact sum by at most gamma_m of
    # it plus the underflow of m + 1 operations: exact <= (fl + (m + 2) TINY) / (1 - gamma_{m+2}).
    factor = _inverse_margin(seg)
    tiny = (seg + 2) * TINY32
    total = parts.sum(dim=1)
    slack = k * tiny
    if k * seg < n:
        rest = x[:, k * seg:]
        m = rest.shape[1]
        r = torch.linalg.vecdot(rest, rest).to(torch.float64)
        total = total + r * (_inverse_margin(m) / factor)
        slack += (m + 2) * TINY32
        k += 1
    # (the float64 sum of k nonnegative terms and the products above: gamma_{k+4} in float64)
    sq = (total * factor + slack) * (1.0 + gamma(k + 4, torch.float64))
    loose = ~torch.isfinite(sq) | (sq - total > LOOSE * total)
    return sq, loose


def _inverse_margin(m: int) -> float:
    """``1 / (1 - gamma_{m+2})`` in float32, rounded up: what a float32 sum of ``m`` squares
    (relative error at most ``gamma_{m+2}`` below) is multiplied by to bound the exact sum."""
    g = gamma(m + 2, torch.float32)
    return 1.0 + g / (1.0 - g) * (1.0 + 1e-12)


def _sq_norms_float64(x: torch.Tensor) -> torch.Tensor:
    b, n = x.shape
    if x.dtype == torch.float64:
        # float64 rows can overflow or underflow in their squares: rows whose largest entry is
        # outside [2**-300, 2**300) are taken at the power-of-two scale of that entry (exact, but
        # for entries that underflow: the squared norm moves by at most ~4 n 2**-1075, far
        # inside the (1 + gamma) factor of a scaled row, whose squared norm is at least 0.25).
        amax = x.abs().amax(dim=1)
        e, _ = _row_scales(amax, _BAND64, _EXP64)
        xs = x * _exp2(-e, torch.float64).unsqueeze(1)
        sq = torch.linalg.vecdot(xs, xs) * (1.0 + gamma(n + 2, torch.float64))
        return _unscale64(sq, 2 * e)
    if b * n <= _CHUNK_ELEMS:  # one chunk
        rows = x.to(torch.float64)
        sq = torch.linalg.vecdot(rows, rows)
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
        an upper bound of ``sum_{G,t} |a_t| |g_t|``, itself an upper bound of the norm
        (triangle inequality) that also bounds the rounding of sums over positions.

    float32 inputs (with IEEE float32 matmuls) take :func:`_gram_sq_norms_float32`; the
    examples it leaves loose, and every other input, take :func:`_gram_sq_norms_float64`.

    Example:
        >>> a = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])  # one example, T = 2, d_in = 2
        >>> g = torch.tensor([[[[2.0], [2.0]]]])            # d_out = 1: dW = [2, 2]
        >>> sq, s = gram_sq_norms(a, g)
        >>> bool(8.0 <= sq[0] <= 8.0 * (1 + 1e-4)), bool(s[0] >= 4.0)
        (True, True)
    """
    if a.dtype == torch.float32 and g.dtype == torch.float32 and float32_matmul_is_ieee(a.device):
        return _gram_sq_norms_float32_scaled(a, g)
    return _gram_sq_norms_float64(a, g)


def _gram_sq_norms_float32_scaled(a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 path of :func:`gram_sq_norms`, every example at the power-of-two scale of its
    largest ``a`` and ``g`` entries, so that no example is out of float32's range.

    Each example's ``a`` (and ``g``) whose largest entry is outside ``[2**-21, 2**20)`` is
    multiplied by the power of two that brings it into ``[0.5, 1)``; inside that band every
    float32 intermediate of :func:`_gram_sq_norms_float32` stays finite for ``T d_in d_out <
    2**48``. The scaling is exact but for entries it pushes below ``2**-126`` (scaled down:
    off by at most ``2**-150`` each); with scaled entries below 4 that moves the norm and
    ``s`` by at most ``delta = G T (d_in + d_out) 2**-146``, and the squared norm by at most
    ``(2 s + delta) delta``, which are added for examples scaled down.

    No example is recomputed (that would need a host synchronisation to find it): an example
    whose float32 bound is loose (above :data:`LOOSE` of its value, i.e. crafted cancellation
    of nearly equal positions against output gradients of alternating sign) keeps that bound.
    It is still an upper bound of its exact norm, only looser: at most about
    ``sqrt((gamma_{d_in+2} + gamma_{d_out+2} + 2 gamma_T) (1 + 1e-2))`` of the triangle bound
    ``s = sum_t |a_t| |g_t|`` above the exact norm (for GPT-2 small's widest layer, d_in +
    d_out = 3840 at T = 1024, about 2e-2 s), so such an example is clipped at most that much
    harder than necessary; an example whose positions do not cancel is never loose (measured
    on random sequences: about 1e-4 of the squared norm). Only an example holding a NaN or an
    inf gets a non-finite norm (weight 0), as in float64; an example whose ``a`` or ``g`` is
    all zeros gets exactly 0.
    """
    b, groups, t = a.shape[0], a.shape[1], a.shape[2]
    d_in, d_out = a.shape[3], g.shape[3]
    amax_a, amax_g = a.abs().reshape(b, -1).amax(dim=1), g.abs().reshape(b, -1).amax(dim=1)
    ea, down_a = _row_scales(amax_a, _BAND32, _EXP32)
    eg, down_g = _row_scales(amax_g, _BAND32, _EXP32)
    a_s = a * _exp2(-ea, torch.float32).view(-1, 1, 1, 1)
    g_s = g * _exp2(-eg, torch.float32).view(-1, 1, 1, 1)
    sq, s, _ = _gram_sq_norms_float32(a_s, g_s)
    delta = groups * t * (d_in + d_out) * 2.0**-146
    down = down_a | down_g
    sq = torch.where(down, sq + (2.0 * s + delta) * delta, sq)
    s = torch.where(down, s + delta, s)
    e = ea + eg  # in [-200, 252]: 2**e and 2**(2 e) are exact float64 numbers
    sq, s = sq * _exp2(2 * e, torch.float64), s * _exp2(e, torch.float64)
    # an example whose a or g is all zeros has an exactly zero gradient (the bound's underflow
    # terms would give it ~1e-43)
    zero = (amax_a == 0) | (amax_g == 0)
    return torch.where(zero, 0.0, sq), torch.where(zero, 0.0, s)


def _row_sq_upper32(fl: torch.Tensor, d: int) -> torch.Tensor:
    """Upper bounds (float64) of squared row norms from their float32 dot products ``fl``
    over ``d`` entries: ``(fl + (d + 2) TINY) / (1 - gamma_{d+2})``."""
    return (fl.to(torch.float64) + (d + 2) * TINY32) * (_inverse_margin(d) * (1.0 + gamma(4, torch.float64)))


def _gram_sq_norms_float32(a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sq, s, loose)``: the certified norms from float32 Gram matrices, and which examples
    to recompute in float64 (bound above :data:`LOOSE` of the value, or out of range).

    With ``A = a a^T`` and ``H = g g^T`` rounded in float32 (``Â``, ``Ĥ``), each entry errs by
    at most ``e^A_ts = gamma_A alpha_ts + eps_A`` with ``alpha_ts = |a_t| |a_s|``,
    ``gamma_A = gamma_{d_in+2}`` and ``eps_A = (d_in + 2) TINY`` (underflow); likewise
    ``e^H_ts`` with ``beta_ts = |g_t| |g_s|``. Since ``ÂĤ - AH = (Â - A) Ĥ + A (Ĥ - H)``,
    ``|A| <= |Â| + e^A`` and ``|Â| <= (1 + gamma_A) alpha + eps_A``::

        |sum Â Ĥ - sum A H| <= gamma_A sum alpha |Ĥ| + gamma_H sum |Â| beta + eps_A sum |Ĥ|
                               + eps_H sum |Â| + sum e^A e^H

    with ``sum |Ĥ| <= (1 + gamma_H) sum beta + G T^2 eps_H`` (and likewise ``sum |Â|``). The
    quadratic forms ``sum alpha |Ĥ| = |a|^T |Ĥ| |a|`` are taken from the computed Grams, so
    the bound follows how the positions align (random sequences: about 1e-4 of the squared
    norm), not the worst case ``(gamma_A + gamma_H) s^2``. ``p = sum Â Ĥ`` is evaluated row
    by row in float32 (``T`` products each: error at most ``gamma_T sum_s |Â_ts Ĥ_ts| +
    T TINY``) and the rows summed in float64; ``sum |Â Ĥ|`` itself is bounded from its own
    float32 row sums (non-negative terms: the computed value is at least ``1 - gamma_T`` of
    it, less the underflow). The quadratic forms are float32 matrix-vector products of
    non-negative values with the row norms rounded up, bounded the same way. Row norms are
    the Grams' diagonals with their own bound (:func:`_row_sq_upper32`); rows whose squared
    norm could push a Gram entry past float32's range are out of range, and any non-finite
    intermediate (a product past float32's range) leaves the example loose.
    """
    b, groups, t = a.shape[0], a.shape[1], a.shape[2]
    d_in, d_out = a.shape[3], g.shape[3]
    n = b * groups
    a3, g3 = a.reshape(n, t, d_in), g.reshape(n, t, d_out)
    aa = torch.bmm(a3, a3.transpose(1, 2))
    gg = torch.bmm(g3, g3.transpose(1, 2))
    # The Grams' diagonals are the rows' float32 dot products: their squared norms, with the
    # same bound (a's row 0, g's row 1).
    rows_sq = torch.stack((_row_sq_upper32(aa.diagonal(dim1=1, dim2=2), d_in),
                           _row_sq_upper32(gg.diagonal(dim1=1, dim2=2), d_out)))  # [2, n, T]
    out_of_range = ~(rows_sq.amax(dim=2) < _RANGE32).all(dim=0).view(b, groups).all(dim=1)  # (NaN too)
    up = 1.0 + 2.0**-50  # sqrt and products of these few float64 values
    norms = rows_sq.sqrt_().mul_(up)  # [2, n, T]: upper bounds of |a_t| and |g_t|
    p_rows = torch.linalg.vecdot(aa, gg)  # [n, T] float32: sum_s Â_ts Ĥ_ts
    aa.abs_(), gg.abs_()  # (the signed Grams are not needed any more)
    m_rows = torch.linalg.vecdot(aa, gg)  # sum_s |Â_ts| |Ĥ_ts|
    up32 = (norms * (1.0 + 2.0**-23)).to(torch.float32)  # rounded to float32 at or above the bounds
    q_ag = torch.bmm(gg, up32[0].unsqueeze(2)).squeeze(2)  # |Ĥ| |a|
    q_ga = torch.bmm(aa, up32[1].unsqueeze(2)).squeeze(2)  # |Â| |g|
    rows = torch.stack((p_rows, m_rows, q_ag, q_ga)).to(torch.float64)  # [4, n, T]
    slack = (1.0 + gamma(t * t + 2 * t + groups + 8, torch.float64)) * up  # rounding of these float64 sums
    p = rows[0].view(b, -1).sum(dim=1)
    # Non-negative float32 sums of t products: exact <= (computed + t TINY) / (1 - gamma_t).
    sums_nonneg = (rows[1:] + t * TINY32).mul_(_inverse_margin(t))  # [3, n, T]
    m_abs = sums_nonneg[0].view(b, -1).sum(dim=1) * slack  # >= sum |Â Ĥ|
    forms = (norms * sums_nonneg[1:]).sum(dim=2).view(2, b, groups).sum(dim=2) * slack  # sum alpha |Ĥ|, sum |Â| beta
    s_group = (norms[0] * norms[1]).sum(dim=1).view(b, groups)
    s_sq = s_group.square().sum(dim=1) * slack**2  # sum alpha beta
    sab_sq = norms.sum(dim=2).square().view(2, b, groups).sum(dim=2) * slack**2  # sum alpha, sum beta
    ga, gh = gamma(d_in + 2, torch.float32), gamma(d_out + 2, torch.float32)
    ea, eh = (d_in + 2) * TINY32, (d_out + 2) * TINY32
    cells = groups * t * t
    # The Grams' rounding (the display above, with sum e^A e^H expanded and sum |Â|, sum |Ĥ| bounded).
    gram_err = (ga * forms[0] + gh * forms[1] + ga * gh * s_sq + eh * (1.0 + 2.0 * ga) * sab_sq[0]
                + ea * (1.0 + 2.0 * gh) * sab_sq[1] + 3.0 * cells * ea * eh)
    # The evaluation of p: float32 rows, then their float64 sum over G T rows.
    p_err = (gamma(t, torch.float32) * m_abs + cells * TINY32
             + gamma(groups * t + 2, torch.float64) * (2.0 * m_abs + cells * TINY32))
    err = (gram_err * slack + p_err) * 1.01  # margin for the rounding of this error sum itself
    sq = torch.minimum((p + err).clamp_min(0.0), s_sq)
    s = s_group.sum(dim=1) * slack
    loose = out_of_range | ~torch.isfinite(sq) | ~(err <= LOOSE * p)
    return sq, s, loose


def _gram_sq_norms_float64(a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 path of :func:`gram_sq_norms` (same arguments and results).

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
    scaled: tuple[torch.Tensor, torch.Tensor] | None = None
    if a.dtype == torch.float64 or g.dtype == torch.float64:
        # float64 inputs can overflow (or underflow) in the Gram products: an example whose
        # largest entry is outside [2**-300, 2**300) is taken at the power-of-two scale of that
        # entry (exact; every example is multiplied, by 1 inside the band: no host
        # synchronisation decides which).
        amax_a, amax_g = a64.abs().flatten(1).amax(1), g64.abs().flatten(1).amax(1)
        ea, down_a = _row_scales(amax_a, _BAND64, _EXP64)
        eg, down_g = _row_scales(amax_g, _BAND64, _EXP64)
        a64 = a64 * _exp2(-ea, torch.float64).view(-1, 1, 1, 1)
        g64 = g64 * _exp2(-eg, torch.float64).view(-1, 1, 1, 1)
        scaled = (ea + eg, down_a | down_g)
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
    if scaled is not None:
        e, down = scaled
        # entries a scaling down pushed below 2**-1022 are off by at most 2**-1075 each (the
        # float32 path's argument, scaled entries below 4)
        delta = groups * t * (d_in + d_out) * 2.0**-1071
        sq = torch.where(down, sq + (2.0 * s + delta) * delta, sq)
        s = torch.where(down, s + delta, s)
        sq, s = _unscale64(sq, 2 * e), _unscale64(s, e)
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


# Rows (examples) whose largest entry has a binary exponent outside this band (frexp's
# convention: amax = m 2**e, 0.5 <= m < 1) are rescaled; inside it they are taken as they
# are. float32: entries below 2**20 keep every float32 Gram product and sum finite for
# T d_in d_out < 2**48, and entries of at least 2**-21 keep the squares clear of underflow.
_BAND32 = (-20, 20)
_BAND64 = (-299, 300)
# Exponents a row is scaled by, clamped so that 2**-e is a normal number of the dtype (a row
# of float32 subnormals is scaled up by 2**100 only, to at least 2**-49; float32's largest
# rows end below 4).
_EXP32 = (-100, 126)
_EXP64 = (-1000, 1022)


def _row_scales(amax: torch.Tensor, band: tuple[int, int], clamp: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e, down)`` per row: rows are multiplied by ``2**-e`` (``e = 0`` inside ``band``, for
    zero rows and for non-finite ones), and ``down`` marks the rows scaled down (whose small
    entries may underflow). Decided on the device: no host synchronisation."""
    exponent = _binary_exponent(amax)
    out = torch.isfinite(amax) & (amax > 0) & ((exponent < band[0]) | (exponent > band[1]))
    e = torch.where(out, exponent.clamp(*clamp), torch.zeros_like(exponent))
    return e, e > 0


def _binary_exponent(x: torch.Tensor) -> torch.Tensor:
    """``torch.frexp(x)``'s exponent (``x = m 2**e``, ``0.5 <= m < 1``) for normal float32 and
    float64 ``x``, read from the exponent bits, int32; a subnormal gets that of the smallest
    normal number less one (at least its own exponent: both are below every band and clamped
    alike by :func:`_row_scales`). Inductor's CPU code for a float64 ``frexp`` does not
    compile (torch 2.13: vectorised int32 exponents of two widths), so a compiled step
    reads the bits instead. Other dtypes take ``frexp``."""
    if x.dtype == torch.float32:
        return ((x.view(torch.int32) >> 23) & 0xFF) - 126
    if x.dtype == torch.float64:
        return (((x.view(torch.int64) >> 52) & 0x7FF) - 1022).to(torch.int32)
    return torch.frexp(x)[1].to(torch.int32)


def _exp2(e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``2**e`` for integer ``e`` in the normal range of ``dtype``, built from its bits (exact on
    every device, unlike ``pow``)."""
    if dtype == torch.float32:
        return ((e.to(torch.int32) + 127) << 23).view(torch.float32)
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def _unscale64(x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """``x 2**e`` for float64 ``x >= 0`` and integer ``|e| <= 5000`` (in steps of at most
    ``2**1000``), rounded up where it underflows (by ``2**-1071``, more than the roundings of
    the steps together, and absorbed by a normal result); exact zeros stay 0, NaN and inf are
    kept, and a squared norm beyond float64's range overflows to inf."""
    y, rest = x, e.to(torch.int64)
    for _ in range(5):
        step = rest.clamp(-1000, 1000)
        y = y * _exp2(step, torch.float64)
        rest = rest - step
    return torch.where(x == 0, x, y + 2.0**-1071)
