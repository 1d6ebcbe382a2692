"""The privacy-loss-distribution (PLD) engine: discretise, compose, query.

A privacy loss distribution is the law of ``L = log(P(o) / Q(o))``, ``o ~ P``, for a
dominating pair ``(P, Q)``; ``delta(eps) = E[(1 - e^(eps - L))_+] + P(L = inf)`` and the
composition of mechanisms is the convolution of their PLDs. This module holds the
numerics; :class:`~opake_fx.accounting.DpProcess` is the user-facing way in.

* Discretisation: pessimistic connect-the-dots (Doroshenko, Ghazi, Kamath, Kumar and
  Manurangsi, PETS 2022). Masses sit on the grid ``eps_i = i * d`` so that the discrete
  PLD's delta(eps) equals the exact one at every grid point and interpolates linearly in
  ``e^eps`` between them; it dominates the exact PLD. Mass above the grid goes to +inf,
  mass below is rounded up to the lowest grid point.
* Composition: one real FFT per distinct step, raised to its repeat count in the Fourier
  domain, multiplied, inverted once. The FFT length covers only the window where the
  composed mass is non-negligible (a Chernoff bound with tail mass ``1e-15``); that tail
  mass is added to +inf, which pays for the mass outside the window and for its
  wrap-around. Mass at infinity composes as ``1 - prod(1 - p_inf)``.
* Rounding: the FFT's floating-point error is bounded per output bin (it grows with the
  number of composed steps) and that bound is added to every bin, so the composed PLD
  stays pessimistic in floating point too. Where that bound would add more than 5e-12
  of mass, the composition runs in extended precision (``numpy.longdouble``) instead.
* Add-or-remove neighbours: the 'remove' and 'add' pairs are composed separately and the
  worse of the two is reported, as dp_accounting does.
* Cost control: single-step PLDs are cached per ``(mechanism, discretization)`` and
  composed PLDs per ``(process, discretization)`` (``functools.lru_cache``); a composition
  whose window would exceed ``2**23`` grid points is recomputed on a grid coarsened by an
  integer factor (still pessimistic; :attr:`PrivacyLossDistribution.discretization`
  reports the grid actually used).

Pure Gaussian processes (any composition of un-subsampled Gaussian mechanisms, which is
itself a Gaussian mechanism with ``mu = sqrt(sum mu_i^2)``) are answered in closed form
by :func:`privacy_profile`; :func:`pld_of` always discretises.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import fft as sfft

from opake_fx.accounting import _curves, _pmf
from opake_fx.accounting._pmf import GridTooLarge as _GridTooLarge
from opake_fx.accounting._pmf import Pmf as _Pmf

__all__ = [
    "DEFAULT_DISCRETIZATION",
    "PrivacyLossDistribution",
    "pld_of",
    "privacy_profile",
    "pmfs_of",
    "clear_caches",
]

DEFAULT_DISCRETIZATION = 1e-4
"""Default spacing of the privacy-loss grid (as dp_accounting's PLD accountant)."""

_TAIL_MASS = 1e-15  # composed mass allowed outside the FFT window (added to +inf)
_FULL_CONV_LIMIT = 2**18  # below this composed length, convolve the full support exactly
_ROUNDING_BUDGET = 5e-12  # rounding-bound mass above which FFTs switch to long double
_EXTENDED = np.finfo(np.longdouble).eps < np.finfo(np.float64).eps  # a real extended type?
_CAPPED_POINTS = 2**16  # grid points of a step whose loss range is cut at _pmf.LOSS_CAP
_FOURIER_PARTS = 8  # compositions of more distinct steps are grouped, then convolved in a tree


# ------------------------------------------------------------------ composition


def _compose(parts: Sequence[tuple[_Pmf, int]], tail: float = _TAIL_MASS) -> _Pmf:
    """The PMF of the sum of ``k`` independent copies of each part (FFT in a window)."""
    parts = [(p, int(k)) for p, k in parts if k > 0]
    if len(parts) == 1 and parts[0][1] == 1:
        return parts[0][0]
    d = parts[0][0].d
    start = sum(k * p.lo for p, k in parts)
    stop = sum(k * (p.lo + p.size - 1) for p, k in parts)
    log_finite = sum(k * math.log1p(-p.inf) if p.inf < 1 else -math.inf for p, k in parts)
    inf = -math.expm1(log_finite) if log_finite > -math.inf else 1.0
    a, b = start, stop
    if stop - start + 1 > _FULL_CONV_LIMIT:
        lo_bound, hi_bound = _chernoff_window(parts, tail)
        a, b = max(start, math.floor(lo_bound / d)), min(stop, math.ceil(hi_bound / d))
        b = max(a, b)
    truncated = a > start or b < stop
    width = b - a + 1
    if width > _pmf.MAX_GRID:
        raise _GridTooLarge(width)
    n_fft = sfft.next_fast_len(max(width, max(p.size for p, _ in parts)), real=True)
    steps = sum(k for _, k in parts)
    # Floating point: raising the spectrum to the k-th power multiplies its relative
    # rounding error by k, so every output bin may be off by up to ~(k + log2 N) * eps
    # times the mean spectrum magnitude (~ the peak of the composed pmf). That bound is
    # added to every bin, so rounding cannot make the result optimistic. (Checked against
    # higher-precision recomputations: the largest per-bin error is below 2/3 of it.)
    # When the bound would add more than _ROUNDING_BUDGET of mass in double precision,
    # the composition is redone in extended precision (numpy.longdouble: 64-bit mantissa
    # on x86, ~2000x less rounding for ~4x the FFT cost).
    factor = steps + math.log2(n_fft) + 5.0
    spectrum = _spectrum(parts, n_fft, np.float64)
    magnitude = (abs(spectrum[0]) + 2.0 * np.abs(spectrum[1:]).sum()) / n_fft
    dtype = np.float64
    if factor * np.finfo(np.float64).eps * magnitude * width > _ROUNDING_BUDGET and _EXTENDED:
        dtype = np.longdouble
        spectrum = _spectrum(parts, n_fft, dtype)
        magnitude = (abs(spectrum[0]) + 2.0 * np.abs(spectrum[1:]).sum()) / n_fft
    out = sfft.irfft(spectrum, n_fft)
    window = out[(np.arange(a, b + 1) - start) % n_fft]
    error = factor * np.finfo(dtype).eps * magnitude
    window = (np.maximum(window, 0.0) + error).astype(np.float64)
    return _Pmf(d, a, window, inf + (tail if truncated else 0.0))


def _spectrum(parts: Sequence[tuple[_Pmf, int]], n_fft: int, dtype: Any) -> np.ndarray:
    """``prod_k rfft(p_k)^k`` at length ``n_fft`` in the given precision."""
    spectrum: np.ndarray | None = None
    for p, k in parts:
        f = _power(sfft.rfft(p.probs.astype(dtype), n_fft), k)
        spectrum = f if spectrum is None else spectrum * f
    return spectrum  # type: ignore[return-value]


def _power(f: np.ndarray, k: int) -> np.ndarray:
    """``f ** k`` by repeated squaring (several times faster than complex ``pow``)."""
    result: np.ndarray | None = None
    base = f
    while True:
        if k & 1:
            result = base if result is None else result * base
        k >>= 1
        if not k:
            return result  # type: ignore[return-value]
        base = base * base


def _chernoff_window(parts: Sequence[tuple[_Pmf, int]], tail: float) -> tuple[float, float]:
    """Losses ``[lo, hi]`` outside of which the composed finite mass is <= tail/2 per side.

    Chernoff: ``P(S > u) <= exp(sum_k k log M_k(lam) - lam u)`` for every lam > 0 (and the
    mirror bound for lam < 0). Any lam gives a valid window; the best one is found by a
    golden-section search over ``log lam`` (the bound, a secant slope of a convex
    function, is unimodal in lam).
    """
    c = math.log(2.0 / tail)
    d = parts[0][0].d

    def bound(sign: float, t: float) -> float:
        lam = sign * math.exp(t)
        value = (sum(k * p.log_mgf(lam) for p, k in parts) + c) / lam
        value = value if sign > 0 else -value  # both sides: minimise
        return value if math.isfinite(value) else math.inf

    hi = _golden_min(lambda t: bound(1.0, t), math.log(1e-3), math.log(1e3 / d))
    lo = -_golden_min(lambda t: bound(-1.0, t), math.log(1e-3), math.log(1e3 / d))
    return lo, hi


def _golden_min(f: Any, a: float, b: float, iterations: int = 26) -> float:
    """Minimum value found by golden-section search of a unimodal ``f`` on [a, b]."""
    g = (math.sqrt(5.0) - 1.0) / 2.0
    x1, x2 = b - g * (b - a), a + g * (b - a)
    f1, f2 = f(x1), f(x2)
    best = min(f1, f2)
    for _ in range(iterations):
        if f1 <= f2:
            b, x2, f2 = x2, x1, f1
            x1 = b - g * (b - a)
            f1 = f(x1)
        else:
            a, x1, f1 = x1, x2, f2
            x2 = a + g * (b - a)
            f2 = f(x2)
        best = min(best, f1, f2)
    return best


# ------------------------------------------------------------------ public PLD


class PrivacyLossDistribution:
    """A discrete, pessimistic privacy loss distribution (its 'remove' and 'add' pairs).

    Built by :meth:`DpProcess.pld`; every metric is the worse of the two pairs. The
    discrete PLD dominates the exact one, so ``epsilon_at`` / ``delta_at`` never
    understate the true values.

    Example:
        >>> import opake_fx.dpsgd.accounting as dpsgd_acc
        >>> pld = (dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), 0.01) * 100).pld()
        >>> round(pld.epsilon_at(1e-5), 3)
        0.718
    """

    def __init__(self, remove: _Pmf, add: _Pmf | None = None) -> None:
        self._remove = remove
        self._add = add

    @property
    def discretization(self) -> float:
        """Grid spacing actually used (coarser than requested only for huge compositions)."""
        return self._remove.d

    @property
    def symmetric(self) -> bool:
        """True when the 'add' and 'remove' pairs coincide."""
        return self._add is None

    def _pmfs(self) -> tuple[_Pmf, ...]:
        return (self._remove,) if self._add is None else (self._remove, self._add)

    def epsilon_at(self, delta: float) -> float:
        """Smallest eps >= 0 with delta(eps) <= ``delta`` (``inf`` if none)."""
        return max(p.epsilon_at(delta) for p in self._pmfs())

    def delta_at(self, epsilon: float) -> float:
        """The hockey-stick divergence at ``epsilon`` (worse pair)."""
        return max(p.delta_at(epsilon) for p in self._pmfs())

    def advantage(self) -> float:
        """``delta_at(0)``: the total-variation distance, i.e. the membership advantage."""
        return self.delta_at(0.0)

    def beta_at(self, alpha: float) -> float:
        """Smallest type-II error of a test with type-I error ``alpha`` (worse pair)."""
        return min(p.beta_at(alpha) for p in self._pmfs())

    def arrays(self) -> dict[str, Any]:
        """The PMFs as plain arrays: ``{"remove": (losses, probs, inf_mass), "add": ...}``."""
        out = {"remove": (self._remove.losses(), self._remove.probs, self._remove.inf)}
        if self._add is not None:
            out["add"] = (self._add.losses(), self._add.probs, self._add.inf)
        return out

    def __repr__(self) -> str:
        sizes = "/".join(str(p.size) for p in self._pmfs())
        return f"PrivacyLossDistribution(discretization={self.discretization:g}, points={sizes})"


class _GaussianProfile:
    """Closed-form metrics of the Gaussian mechanism ``N(mu, 1)`` vs ``N(0, 1)`` (mu in [0, inf])."""

    def __init__(self, mu: float) -> None:
        self.mu = mu

    def epsilon_at(self, delta: float) -> float:
        if self.mu == 0.0:
            return 0.0
        if math.isinf(self.mu):
            return math.inf
        return _curves.gaussian_epsilon(self.mu, delta)

    def delta_at(self, epsilon: float) -> float:
        if self.mu == 0.0:
            return 0.0
        if math.isinf(self.mu):
            return 1.0
        return float(_curves.gaussian_delta(np.array([epsilon]), self.mu)[0])

    def advantage(self) -> float:
        return self.delta_at(0.0)

    def beta_at(self, alpha: float) -> float:
        if math.isinf(self.mu):
            return 0.0
        return _curves.gaussian_beta(self.mu, alpha)


# ------------------------------------------------------------------- builders


def privacy_profile(components: tuple[tuple[Any, int], ...], discretization: float) -> Any:
    """An object with ``epsilon_at``/``delta_at``/``advantage``/``beta_at`` for the components.

    Pure Gaussian compositions are exact (closed form); everything else is a PLD.
    """
    mus = [leaf._gaussian_mu() for leaf, _ in components]
    if all(m is not None for m in mus):
        if any(math.isinf(m) for m in mus):
            return _GaussianProfile(math.inf)
        return _GaussianProfile(math.sqrt(sum(k * m * m for m, (_, k) in zip(mus, components))))
    return pld_of(components, discretization)


@functools.lru_cache(maxsize=8)
def pld_of(components: tuple[tuple[Any, int], ...], discretization: float) -> PrivacyLossDistribution:
    """The discretised PLD of a composition (coarsening the grid if it would be too large).

    Cached per ``(components, discretization)``.
    """
    d = _grid_for(components, float(discretization))
    while True:
        try:
            return _composed(components, d)
        except _GridTooLarge as exc:
            d *= max(2, math.ceil(exc.size / _pmf.MAX_GRID))


def _grid_for(components: tuple[tuple[Any, int], ...], d: float) -> float:
    """``d``, or an integer multiple of it giving at most ``_CAPPED_POINTS`` points per step
    when some step's losses reach past ``_pmf.LOSS_CAP`` (cut there, see ``discretize``).

    Such a step (a noise multiplier of 1e-8, say) has an epsilon of thousands or infinity;
    a grid fine enough to resolve 1e-4 in it would cost seconds per step (and 1e-300 could
    not be gridded at all), while the coarser grid is as pessimistic and answers at once.
    """
    for leaf, _ in components:
        if math.isinf(leaf._gaussian_mu() or 0.0):  # nonprivate(): no curve, the composition is all at +inf
            continue
        if any(not (-_pmf.LOSS_CAP <= r.lo and r.hi <= _pmf.LOSS_CAP) for r in leaf._directions()):
            return d * max(1, math.ceil(2.0 * _pmf.LOSS_CAP / _CAPPED_POINTS / d))
    return d


def pmfs_of(components: tuple[tuple[Any, int], ...], discretization: float) -> tuple[_Pmf, _Pmf | None]:
    """The composed ('remove', 'add') PMFs of :func:`pld_of` (``add`` None when symmetric).

    For engines that keep composing (:class:`~opake_fx.accounting.IncrementalPld`).
    """
    out = pld_of(components, discretization)
    return out._remove, out._add


@functools.lru_cache(maxsize=128)
def _single(leaf: Any, d: float) -> tuple[_Pmf, _Pmf | None]:
    directions = leaf._directions()
    if len(directions) == 1:
        return _pmf.discretize(directions[0], d), None
    return _pmf.both(lambda: _pmf.discretize(directions[0], d), lambda: _pmf.discretize(directions[1], d))


def _composed(components: tuple[tuple[Any, int], ...], d: float) -> PrivacyLossDistribution:
    if not components:
        return PrivacyLossDistribution(_pmf.unit(d))
    if any(math.isinf(leaf._gaussian_mu() or 0.0) for leaf, _ in components):
        return PrivacyLossDistribution(_Pmf(d, 0, np.array([0.0]), 1.0))
    if len(components) <= _FOURIER_PARTS:
        singles = [(_single(leaf, d), k) for leaf, k in components]
        remove = _compose([(r, k) for (r, _), k in singles])
        if all(a is None for (_, a), _ in singles):
            return PrivacyLossDistribution(remove)
        add = _compose([(a if a is not None else r, k) for (r, a), k in singles])
        return PrivacyLossDistribution(remove, add)
    symmetric = all(_single(leaf, d)[1] is None for leaf, _ in components)
    remove = _grouped_tree(components, d, 0)
    return PrivacyLossDistribution(remove, None if symmetric else _grouped_tree(components, d, 1))


def _grouped_tree(components: tuple[tuple[Any, int], ...], d: float, pair: int) -> _Pmf:
    """One pair's PMF (0: remove, 1: add) of a composition of many distinct steps.

    Up to ``_FOURIER_PARTS`` distinct steps are one product in the Fourier domain
    (:func:`_compose`). With more, each distinct step is self-composed by repeated
    squaring in its own window, and the groups are convolved in a balanced tree
    (:func:`_pmf.compose_balanced`: a rounding bound of each bin's order, Chernoff cuts),
    streamed so that memory stays at ``log2 K`` PMFs. One product of thousands of spectra
    would need a window search over all of them and extended precision (its uniform
    rounding bound grows with the total step count).
    """

    def group(leaf: Any, k: int) -> _Pmf:
        remove, add = _single(leaf, d)
        return _compose([(add if pair == 1 and add is not None else remove, k)])

    return _pmf.compose_balanced(group(leaf, k) for leaf, k in components)


def clear_caches() -> None:
    """Empties the single-step and composed PLD caches (e.g. before timing)."""
    _single.cache_clear()
    pld_of.cache_clear()
