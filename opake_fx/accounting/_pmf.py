"""Discrete privacy-loss PMFs: the value, its discretisation, trimming, and one convolution.

A :class:`Pmf` is the privacy-loss distribution of one dominating pair on the grid
``(lo + i) * d`` plus a mass at ``+inf``. Everything here keeps it *pessimistic*: the
discrete PMF dominates the exact one (connect-the-dots), trimmed upper mass goes to
``+inf``, trimmed lower mass is rounded up, and the floating-point error of an FFT is
bounded and added to every bin. :mod:`opake_fx.accounting.pld` composes many PMFs at once
(Fourier domain); :func:`convolve` adds one more to a running composition, which is what
:class:`~opake_fx.accounting.IncrementalPld` and compositions of many distinct processes
are built from.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from scipy import fft as sfft
from scipy import signal

from opake_fx.accounting import _curves
from opake_fx.errors import InputValueError

__all__ = [
    "LOSS_CAP",
    "Pmf",
    "GridTooLarge",
    "discretize",
    "trim",
    "convolve",
    "compose_balanced",
    "coarsen",
    "unit",
    "both",
    "pmf_from_dict",
]

TRIM_MASS = 1e-20  # single-step mass trimmed from each end (pessimistically)
FOLD_TAIL = 1e-16  # composed mass trimmed from each end after one convolution (pessimistically)
MAX_GRID = 2**23  # largest window / single-step grid before coarsening
LOSS_CAP = 1000.0
"""The largest privacy loss (in nats) a single step's grid represents; beyond it, +inf.

A step whose losses reach past it (e.g. a Gaussian of noise multiplier below ~0.03: losses
around ``1 / (2 sigma**2)``) has its mass above ``LOSS_CAP`` put at ``+inf`` and its mass
below ``-LOSS_CAP`` rounded up, which can only raise the reported delta and epsilon; an
epsilon that large is no privacy guarantee anyway, and the cut keeps the grid finite (a
noise multiplier of 1e-8 would need ~1e20 points, 1e-300 infinitely many). See
:func:`opake_fx.accounting.pld.pld_of`, which also coarsens the grid of such steps."""
_BAND = 1e-3  # an operand's entries below this fraction of its peak are convolved apart
LAMBDAS = np.concatenate([2.0 ** (np.arange(-4, 11) / 2.0), -(2.0 ** (np.arange(-4, 11) / 2.0))])
"""Tilts at which log-MGFs are kept for the Chernoff windows (ratio sqrt(2), 0.25 to 32)."""
_POSITIVE = LAMBDAS > 0
_NARROW = 4  # an operand this many times narrower than the other's bulk is not split
_LOW_TRIM = 100.0  # the low end of a composition is trimmed at this times its tail budget
_DIRECT = 32  # below this many points in the smaller operand, convolve directly (no FFT)
_EPS = float(np.finfo(np.float64).eps)


class GridTooLarge(Exception):
    """Raised internally when a grid would exceed ``MAX_GRID`` points."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


class Pmf:
    """A PLD of one pair on the grid ``(lo + i) * d`` plus a mass at +inf."""

    def __init__(self, d: float, lo: int, probs: np.ndarray, inf: float, mgf: np.ndarray | None = None) -> None:
        self.d = float(d)
        self.lo = int(lo)
        self.probs = np.ascontiguousarray(probs, dtype=np.float64)
        self.probs.setflags(write=False)
        self.inf = float(min(1.0, max(0.0, inf)))
        self._tails: tuple[np.ndarray, np.ndarray] | None = None
        self._mgf = mgf

    def log_mgfs(self) -> np.ndarray:
        """``log sum_j p_j e^{lam l_j}`` at every ``lam`` of ``LAMBDAS`` (finite part).

        For a composition built by :func:`convolve` this is the sum of the operands'
        values: for ``lam > 0`` an upper bound on the log-MGF of the exact composition
        (every operand dominates its exact PMF bin by bin, up to mass moved upwards),
        which is all the upper Chernoff cut needs.
        """
        if self._mgf is None:
            self._mgf = _log_mgfs(self.probs, self.lo, self.d)
        return self._mgf

    @property
    def size(self) -> int:
        return self.probs.size

    def to_dict(self) -> dict[str, Any]:
        """Everything that decides this PMF's metrics and its next convolution.

        ``{"d", "lo", "inf", "probs", "log_mgfs"}``: plain numbers and float64 arrays
        (copies); ``log_mgfs`` is ``None`` until it was needed (it is then the sum of the
        operands' values, not a function of ``probs``, so it is kept as computed). The
        query tails are a cache of ``probs`` and are rebuilt on demand.
        """
        return {
            "d": self.d,
            "lo": self.lo,
            "inf": self.inf,
            "probs": self.probs.copy(),
            "log_mgfs": None if self._mgf is None else np.array(self._mgf, dtype=np.float64),
        }

    def losses(self) -> np.ndarray:
        return (self.lo + np.arange(self.size)) * self.d

    def tails(self) -> tuple[np.ndarray, np.ndarray]:
        """``(S, D)``: ``S_i = sum_{j>i} p_j e^{l_i - l_j}`` and ``D_i = delta(l_i)``.

        Both come from recursions with non-negative terms only (no cancellation):
        ``S_i = e^-d (S_{i+1} + p_{i+1})`` and ``D_i = D_{i+1} + (e^d - 1) S_i``.
        """
        if self._tails is None:
            ed = math.exp(-self.d)
            s = signal.lfilter([0.0, ed], [1.0, -ed], self.probs[::-1])[::-1]
            dd = self.inf + math.expm1(self.d) * np.cumsum(s[::-1])[::-1]
            self._tails = (np.ascontiguousarray(s), np.ascontiguousarray(dd))
        return self._tails

    def log_mgf(self, lam: float) -> float:
        """``log sum_j p_j e^{lam l_j}`` over the finite part.

        The grid is uniform, so ``e^{lam l_j}`` factors into a block offset and an
        in-block power: one matrix-vector product plus a short logsumexp instead of one
        exponential per grid point (blocks are kept short enough not to overflow).
        """
        step = lam * self.d
        block = 1 << int(max(0, min(6, math.log2(40.0 / abs(step))))) if step != 0 else 64
        p = self.probs
        rows = p.size // block
        weights = np.exp(step * np.arange(block))
        sums = p[: rows * block].reshape(rows, block) @ weights  # a view: no copy
        offsets = step * block * np.arange(rows)
        rest = p.size - rows * block
        if rest:
            sums = np.append(sums, p[rows * block :] @ weights[:rest])
            offsets = np.append(offsets, step * block * rows)
        with np.errstate(divide="ignore"):
            terms = np.log(sums) + offsets
        top = float(terms.max())
        if not math.isfinite(top):
            return top
        return lam * self.lo * self.d + top + math.log(float(np.exp(terms - top).sum()))

    def delta_at(self, eps: float) -> float:
        if eps == math.inf:
            return self.inf
        s, dd = self.tails()
        i = int(np.searchsorted(self.losses(), eps, side="left"))
        if i >= self.size:
            return self.inf
        li = (self.lo + i) * self.d
        value = dd[i] - (s[i] + self.probs[i]) * math.expm1(min(eps - li, 0.0))
        return float(min(1.0, max(0.0, value)))

    def epsilon_at(self, delta: float) -> float:
        if self.inf > delta:
            return math.inf
        s, dd = self.tails()
        i = int(np.searchsorted(-dd, -delta, side="left"))  # first grid point with D_i <= delta
        i = min(i, self.size - 1)
        li = (self.lo + i) * self.d
        denom = s[i] + self.probs[i]
        if denom <= 0:
            eps = li if i > 0 else -math.inf
        else:
            eps = li + math.log1p(max(-1.0, (dd[i] - delta) / denom))
        if i > 0:
            eps = max(eps, (self.lo + i - 1) * self.d)  # delta(l_{i-1}) > delta: stay above it
        return max(0.0, eps)

    def beta_at(self, alpha: float) -> float:
        """Trade-off ``sup_eps 1 - delta(eps) - e^eps alpha`` (attained at grid points)."""
        _, dd = self.tails()
        if alpha <= 0.0:
            return 1.0 - self.inf
        li = self.losses()
        keep = li < math.log(1.0 / alpha) + 1.0
        vals = 1.0 - dd[keep] - alpha * np.exp(li[keep])
        best = float(vals.max()) if vals.size else 0.0
        return max(0.0, min(1.0 - alpha, best))



def discretize(direction: _curves.Direction, d: float) -> Pmf:
    """Pessimistic connect-the-dots PMF of one hockey-stick curve on the grid ``i * d``.

    The grid spans the curve's loss range cut to ``[-LOSS_CAP, LOSS_CAP]`` (see
    :data:`LOSS_CAP`): the mass above the top point goes to ``+inf`` and the mass below
    the bottom one is rounded up to it, as for the range itself.
    """
    lo, hi = max(direction.lo, -LOSS_CAP), min(direction.hi, LOSS_CAP)  # NaN-free: the range is never NaN
    # the grid always contains 0: the curve is split as (1 - e^eps)_+ (a unit mass at
    # loss 0, exactly) plus its small excess, so no tail mass is lost to cancellation
    i_lo = min(0, math.floor(lo / d))
    i_hi = max(0, math.ceil(hi / d))
    n = i_hi - i_lo + 1
    if n > MAX_GRID:
        raise GridTooLarge(n)
    h = np.clip(direction.excess(np.arange(i_lo, i_hi + 1) * d), 0.0, 1.0)
    probs = np.zeros(n)
    if n > 1:
        diffs = np.diff(h)
        em1 = math.expm1(d)
        probs[0] = -h[0] + diffs[0] / em1
        probs[1:-1] = (diffs[1:] - diffs[:-1] * math.exp(d)) / em1
        probs[-1] = diffs[-1] / math.expm1(-d)
    probs[-i_lo] += 1.0
    np.maximum(probs, 0.0, out=probs)
    return trim(Pmf(d, i_lo, probs, h[-1]), TRIM_MASS)


def trim(pmf: Pmf, budget: float, low: float | None = None) -> Pmf:
    """Drops end bins holding <= ``budget`` mass per side: low end rounded up, high end to +inf.

    ``low`` (default ``budget``) is the budget of the low end: rounding up never
    under-reports, so it only trades tightness for a shorter support.
    """
    p = pmf.probs
    if p.size <= 2:
        return pmf
    left = int(np.searchsorted(np.cumsum(p), budget if low is None else low, side="right"))
    right = int(np.searchsorted(np.cumsum(p[::-1]), budget, side="right"))
    left, right = min(left, p.size - 1), min(right, p.size - 1 - left)
    if left == 0 and right == 0:
        return pmf
    kept = p[left : p.size - right].copy()
    kept[0] += float(p[:left].sum())
    # a log-MGF bound of the exact composition stays one (see Pmf.log_mgfs)
    return Pmf(pmf.d, pmf.lo + left, kept, pmf.inf + float(p[p.size - right :].sum()), pmf._mgf)



def both(first: Callable[[], Any], second: Callable[[], Any]) -> tuple[Any, Any]:
    """``(first(), second())``, the second on a helper thread.

    The 'remove' and 'add' pairs of a step are independent, and the work on each (curve
    evaluation, FFTs) runs in numpy/scipy loops that release the GIL, so the two pairs
    use two cores.
    """
    result: list[Any] = [None, None]

    def work() -> None:
        try:
            result[1] = (True, second())
        except BaseException as exc:  # re-raised in the caller's thread
            result[1] = (False, exc)

    helper = threading.Thread(target=work, daemon=True)
    helper.start()
    try:
        result[0] = first()
    finally:
        helper.join()
    ok, value = result[1]
    if not ok:
        raise value
    return result[0], value


def pmf_from_dict(data: Any, where: str) -> Pmf:
    """The :class:`Pmf` of :meth:`Pmf.to_dict` output, bit for bit, after checking its form.

    ``where`` names the value in error messages. Refused (``InputValueError``): a missing
    or extra field, a grid spacing that is not a positive finite number, a non-integer
    offset, a mass at infinity outside ``[0, 1]``, ``probs`` that is not a non-empty 1-D
    float64 array of finite non-negative values, ``log_mgfs`` that is not ``None`` or one
    float64 value (not NaN) per tilt of ``LAMBDAS``.
    """
    fields = ("d", "lo", "inf", "probs", "log_mgfs")
    if not isinstance(data, dict) or set(data) != set(fields):
        got = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise InputValueError(f"{where}: expected a PMF with the fields {list(fields)}; got {got}.")
    d, lo, inf, probs, mgf = (data[f] for f in fields)
    if isinstance(d, bool) or not isinstance(d, (int, float)) or not (math.isfinite(d) and d > 0):
        raise InputValueError(f"{where}/d: the grid spacing must be a positive finite number; got {d!r}.")
    if isinstance(lo, bool) or not isinstance(lo, int):
        raise InputValueError(f"{where}/lo: the grid offset must be an int; got {lo!r}.")
    if isinstance(inf, bool) or not isinstance(inf, (int, float)) or not 0.0 <= inf <= 1.0:
        raise InputValueError(f"{where}/inf: the mass at infinity must be in [0, 1]; got {inf!r}.")
    probs = _float64_vector(probs, f"{where}/probs")
    if probs.size == 0 or not np.all(np.isfinite(probs)) or bool((probs < 0).any()):
        raise InputValueError(f"{where}/probs: expected a non-empty array of finite, non-negative masses.")
    if mgf is not None:
        mgf = _float64_vector(mgf, f"{where}/log_mgfs")
        if mgf.size != LAMBDAS.size or bool(np.isnan(mgf).any()):
            raise InputValueError(
                f"{where}/log_mgfs: expected {LAMBDAS.size} values (one per tilt), none NaN; got {mgf.size}."
            )
    return Pmf(float(d), lo, probs, float(inf), mgf)


def _float64_vector(value: Any, where: str) -> np.ndarray:
    if not isinstance(value, np.ndarray) or value.dtype != np.float64 or value.ndim != 1:
        kind = f"{value.dtype} array of shape {value.shape}" if isinstance(value, np.ndarray) else type(value).__name__
        raise InputValueError(f"{where}: expected a 1-D float64 array; got a {kind}.")
    return np.array(value, dtype=np.float64, copy=True)


def unit(d: float) -> Pmf:
    """The PMF of a process that releases nothing: all mass at loss 0."""
    return Pmf(d, 0, np.array([1.0]), 0.0)


def convolve(a: Pmf, b: Pmf, tail: float = FOLD_TAIL) -> Pmf:
    """The PMF of the sum of independent losses ``a`` and ``b`` (one composition step).

    FFT convolution at the full length ``a.size + b.size - 1`` (no wrap-around), kept
    pessimistic in floating point with precision *relative to each bin's order*:

    * An FFT's rounding error is spread evenly over its output, at about
      ``(log2 N + 7) * eps`` times the mean magnitude of the product spectrum (the bound
      :mod:`opake_fx.accounting.pld` uses; checked there against extended precision).
      Added to every bin at every step of a long composition, that floor would swamp
      the tails that decide delta.
    * So each operand is split exactly into its *bulk* (entries >= ``_BAND`` times its
      peak) and the rest. ``bulk * bulk`` is one short FFT whose floor is added only on
      its own support; ``rest * b + bulk * rest_b`` is one FFT whose floor scales with
      the small entries.
    * When the smaller operand has at most 32 points the sum is taken directly
      (non-negative terms only: relative error at most ``size * eps``, paid by scaling
      the result up).

    Then the support is cut to the window outside of which the exact composition holds
    at most ``tail / 2`` mass per side, by a Chernoff bound on the summed log-MGFs of
    the operands (:meth:`Pmf.log_mgfs`): ``tail / 2`` goes to ``+inf`` for the upper
    cut, the mass below the window is rounded up to its first point. So the support
    stays the width of the composed distribution instead of growing by the operand's
    width at every step. Then end bins holding at most ``tail`` computed mass per side
    are trimmed (:func:`trim`; sound because every computed bin bounds its exact value
    from above), and the lowest bins holding ``100 * tail`` are rounded up (that only
    costs tightness, and little: they sit far below zero). At most ``1.5 * tail`` goes
    to ``+inf`` per call. Mass at infinity composes as ``1 - (1 - a.inf)(1 - b.inf)``.

    Raises:
        GridTooLarge: the full support would exceed ``MAX_GRID`` points (coarsen first).
    """
    if a.d != b.d:
        raise InputValueError(f"convolve: the grids differ ({a.d:g} vs {b.d:g}); coarsen the finer PMF first.")
    inf = a.inf + b.inf - a.inf * b.inf
    width = a.size + b.size - 1
    if width > MAX_GRID:
        raise GridTooLarge(width)
    long, short = (a.probs, b.probs) if a.size >= b.size else (b.probs, a.probs)
    if short.size <= _DIRECT:
        out = np.convolve(long, short) * (1.0 + (short.size + 2) * _EPS)
    else:
        out = _banded_convolution(long, short)
    mgf = a.log_mgfs() + b.log_mgfs()
    # every bin is an upper bound of its exact value (rounding bounds added), so ends
    # holding <= tail computed mass can go too: this is what shortens the support where
    # the Chernoff window (a bound, on a coarse grid of tilts) is loose
    return trim(_cut(Pmf(a.d, a.lo + b.lo, out, inf, mgf), tail), tail, _LOW_TRIM * tail)


def _cut(pmf: Pmf, tail: float) -> Pmf:
    """Cuts ``pmf`` to its Chernoff window at ``tail / 2`` per side (see :func:`convolve`)."""
    mgf = pmf.log_mgfs()
    c = math.log(2.0 / tail)
    with np.errstate(invalid="ignore", over="ignore"):
        upper = (mgf[_POSITIVE] + c) / LAMBDAS[_POSITIVE]
        lower = (mgf[~_POSITIVE] + c) / LAMBDAS[~_POSITIVE]
    upper, lower = upper[np.isfinite(upper)], lower[np.isfinite(lower)]
    last = pmf.lo + pmf.size - 1
    hi = min(last, math.ceil(float(upper.min()) / pmf.d)) if upper.size else last
    hi = max(hi, pmf.lo)  # a bound below the support: all finite mass is within tail / 2
    lo = max(pmf.lo, math.floor(float(lower.max()) / pmf.d)) if lower.size else pmf.lo
    lo = min(lo, hi)
    if lo == pmf.lo and hi == last:
        return pmf
    p = pmf.probs
    kept = p[lo - pmf.lo : hi - pmf.lo + 1].copy()
    kept[0] += float(p[: lo - pmf.lo].sum())
    inf = pmf.inf + (tail / 2.0 if hi < last else 0.0)
    return Pmf(pmf.d, lo, kept, inf, mgf)


def _log_mgfs(probs: np.ndarray, lo: int, d: float) -> np.ndarray:
    """``log sum_i p_i e^{lam (lo + i) d}`` for every ``lam`` in ``LAMBDAS``.

    Blocks of ``L`` points share one table ``e^{lam d i}``, ``i < L`` (short enough not
    to overflow): one matrix product, then a log-sum-exp over the block offsets.
    """
    block = max(1, min(1024, int(600.0 / (float(np.abs(LAMBDAS).max()) * d))))
    table = _mgf_table(d, block)
    rows = -(-probs.size // block)
    padded = np.zeros(rows * block)
    padded[: probs.size] = probs
    sums = padded.reshape(rows, block) @ table  # (rows, lambdas)
    offsets = np.outer(np.arange(rows) * block * d, LAMBDAS)
    with np.errstate(divide="ignore"):
        terms = np.log(sums) + offsets
    top = terms.max(axis=0)
    safe = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        total = safe + np.log(np.exp(terms - safe).sum(axis=0))
    # relative rounding of the sums is far below this margin (keeps the bound an upper one)
    return np.where(np.isfinite(top), total + 1e-9, top) + LAMBDAS * lo * d


@functools.lru_cache(maxsize=8)
def _mgf_table(d: float, block: int) -> np.ndarray:
    return np.exp(np.outer(np.arange(block) * d, LAMBDAS))


def _banded_convolution(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``np.convolve(a, b)`` by FFT, plus a per-bin rounding bound of each bin's own order.

    ``a`` is the longer operand. When ``b`` is much narrower than ``a``'s bulk (a late
    step of a long run), ``b`` is not split: ``bulk_a * b`` only smears the bulk's bound
    over ``b``'s short width, where ``a`` is still within ~1e-3 of its peak's order.
    """
    width = a.size + b.size - 1
    a_hi, a_lo, (a0, a1) = _split(a)
    n = sfft.next_fast_len(width, real=True)
    fa_lo = sfft.rfft(a_lo, n)
    if b.size * _NARROW <= a1 - a0:
        bulk = _fft_convolution(a_hi[a0:a1], b)
        rest_spectrum = fa_lo * sfft.rfft(b, n)
        bound = _floor(rest_spectrum, n)
        offset = a0
    else:
        b_hi, b_lo, (b0, b1) = _split(b)
        bulk = _fft_convolution(a_hi[a0:a1], b_hi[b0:b1])
        fb_lo = sfft.rfft(b_lo, n)
        first = fa_lo * (sfft.rfft(b_hi, n) + fb_lo)
        second = sfft.rfft(a_hi, n) * fb_lo
        rest_spectrum = first + second
        bound = _floor(first, n) + _floor(second, n)
        offset = a0 + b0
    out = np.maximum(sfft.irfft(rest_spectrum, n)[:width], 0.0) + bound
    out[offset : offset + bulk.size] += bulk
    return out


def _fft_convolution(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Full linear convolution by FFT with its rounding bound added to every bin."""
    width = a.size + b.size - 1
    n = sfft.next_fast_len(width, real=True)
    spectrum = sfft.rfft(a, n) * sfft.rfft(b, n)
    return np.maximum(sfft.irfft(spectrum, n)[:width], 0.0) + _floor(spectrum, n)


def _split(p: np.ndarray) -> tuple[np.ndarray, np.ndarray, tuple[int, int]]:
    """``p = hi + lo`` exactly: ``hi`` keeps entries >= ``_BAND * max``; and hi's index range."""
    big = p >= _BAND * float(p.max())
    idx = np.flatnonzero(big)
    hi = np.where(big, p, 0.0)
    return hi, p - hi, (int(idx[0]), int(idx[-1]) + 1)


def _floor(spectrum: np.ndarray, n_fft: int) -> float:
    """Per-bin rounding bound of an inverse FFT of ``spectrum``: ``(log2 N + 7) eps mean|F|``."""
    magnitude = (abs(spectrum[0]) + 2.0 * np.abs(spectrum[1:]).sum()) / n_fft
    return (math.log2(n_fft) + 7.0) * _EPS * float(magnitude)


def compose_balanced(pmfs: Iterable[Pmf], tail: float = FOLD_TAIL) -> Pmf:
    """The PMF of the sum of all ``pmfs``, convolved pairwise in a balanced tree.

    A tree of depth ``log2 K`` instead of a chain of ``K`` convolutions: operands of
    similar width meet and each partial result passes through few later roundings. The
    tree is built as a binary counter over the stream, so at most ``log2 K`` partial
    results are held at once (``pmfs`` may be a generator). Total trimmed mass is at most
    ``(K - 1) * tail`` per side.
    """
    stack: list[tuple[int, Pmf]] = []  # (level, pmf): a level-l entry holds 2**l inputs
    for pmf in pmfs:
        level = 0
        while stack and stack[-1][0] == level:
            pmf = convolve(stack.pop()[1], pmf, tail)
            level += 1
        stack.append((level, pmf))
    if not stack:
        raise InputValueError("compose_balanced: nothing to compose; pass at least one PMF.")
    result = stack.pop()[1]
    while stack:
        result = convolve(stack.pop()[1], result, tail)
    return result


def coarsen(pmf: Pmf, factor: int) -> Pmf:
    """The same PMF on the grid ``factor * d``, every loss rounded up (pessimistic)."""
    if factor == 1:
        return pmf
    first = -((-pmf.lo) // factor)  # ceil(lo / factor): the coarse point at or above lo
    # fine index i (loss (lo + i) d) goes to coarse point ceil((lo + i) / factor)
    offsets = np.arange(pmf.size) + pmf.lo
    coarse = -((-offsets) // factor) - first
    probs = np.bincount(coarse, weights=pmf.probs, minlength=int(coarse[-1]) + 1)
    return Pmf(pmf.d * factor, first, probs, pmf.inf)
