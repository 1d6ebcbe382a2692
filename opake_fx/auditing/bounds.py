"""The statistics behind the audits: binomial confidence bounds, one-run tests, Gaussian DP.

Every function here is pure numpy/scipy and works on counts or parameters, not on
models. The estimators (:class:`~opake_fx.auditing.OneRunEstimate`,
:class:`~opake_fx.auditing.CanaryScoreAuditor`) decide *which* counts to test and pay
for the number of tests they try; these functions test one hypothesis each.

Sources: Clopper and Pearson (1934) for the binomial bounds; Steinke, Nasr and
Jagielski, "Privacy auditing with one (1) training run" (NeurIPS 2023), Theorem 5.2,
for the one-run p-value; Mahloujifar, Melis and Chaudhuri, "Auditing f-differential
privacy in one run" (2024), for the f-DP test; Dong, Roth and Su, "Gaussian
differential privacy" (2019), Corollary 2.13, for the mu-GDP <-> (epsilon, delta)
conversion.

Example:
    >>> round(gdp_epsilon(1.0, 1e-5), 3)
    4.377
    >>> round(epsilon_one_run(1000, 100, 100, significance=0.05, delta=0.0), 3)
    3.493
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import scipy.optimize
import scipy.special
import scipy.stats

from opake_fx.auditing._inputs import check_delta, check_significance
from opake_fx.errors import InputValueError

__all__ = [
    "clopper_pearson_upper",
    "clopper_pearson_lower",
    "gdp_delta",
    "gdp_epsilon",
    "gdp_mu",
    "one_run_p_value",
    "epsilon_one_run",
    "fdp_one_run_rejects",
    "mu_one_run_fdp",
    "epsilon_one_run_fdp",
]

_norm = scipy.stats.norm
_EPS_CAP = 200.0  # epsilons are searched in [0, _EPS_CAP]; a bound at the cap means "beyond it"
_MU_CAP = 40.0


def clopper_pearson_upper(successes: np.ndarray | int, trials: int, significance: float) -> np.ndarray:
    """One-sided upper Clopper-Pearson bound on a binomial rate, elementwise over ``successes``.

    With probability at least ``1 - significance`` the true rate is at most the returned
    value (exact, not asymptotic). ``successes == trials`` gives 1.

    Example:
        >>> float(clopper_pearson_upper(0, 100, 0.05).round(4))
        0.0295
    """
    check_significance(significance, "clopper_pearson_upper")
    k = np.asarray(successes, dtype=np.float64)
    n = float(trials)
    safe = np.maximum(n - k, 1.0)
    return np.where(k < n, scipy.stats.beta.ppf(1.0 - significance, k + 1.0, safe), 1.0)


def clopper_pearson_lower(successes: np.ndarray | int, trials: int, significance: float) -> np.ndarray:
    """One-sided lower Clopper-Pearson bound (``1 - upper`` of the failures).

    Example:
        >>> float(clopper_pearson_lower(100, 100, 0.05).round(4))
        0.9705
    """
    k = np.asarray(successes, dtype=np.float64)
    return 1.0 - clopper_pearson_upper(trials - k, trials, significance)


def gdp_delta(mu: float, epsilon: float) -> float:
    """The smallest delta for which mu-GDP implies (epsilon, delta)-DP (Dong et al., Cor. 2.13).

    ``delta = Phi(-eps/mu + mu/2) - exp(eps) * Phi(-eps/mu - mu/2)``, evaluated in logs.

    Example:
        >>> round(gdp_delta(1.0, 0.0), 4)
        0.3829
    """
    if mu <= 0:
        return 0.0
    if math.isinf(mu):
        return 1.0
    a = _norm.logcdf(-epsilon / mu + mu / 2)
    b = epsilon + _norm.logcdf(-epsilon / mu - mu / 2)
    if b >= a:
        return 0.0
    return float(math.exp(a + math.log1p(-math.exp(b - a))))


def gdp_epsilon(mu: float, delta: float) -> float:
    """The epsilon at ``delta`` of a mu-GDP mechanism (the Gaussian mechanism with sensitivity/sigma = mu).

    Example:
        >>> gdp_epsilon(0.0, 1e-5)
        0.0
    """
    check_delta(delta, "gdp_epsilon")
    if mu <= 0 or gdp_delta(mu, 0.0) <= delta:
        return 0.0
    if math.isinf(mu):
        return math.inf
    hi = 1.0
    while gdp_delta(mu, hi) > delta:
        hi *= 2.0
    root = float(scipy.optimize.brentq(lambda e: gdp_delta(mu, e) - delta, 0.0, hi, xtol=1e-10, rtol=1e-12))
    # The auditors report this as a lower bound: keep the side where delta(eps) >= delta (eps <= the exact one).
    return _rejected_side(lambda e: 1.0 if gdp_delta(mu, e) >= delta else -1.0, root, 0.0)


def gdp_mu(epsilon: float, delta: float) -> float:
    """The largest mu whose mu-GDP mechanism is (epsilon, delta)-DP (inverse of :func:`gdp_epsilon`).

    Example:
        >>> round(gdp_mu(gdp_epsilon(1.5, 1e-5), 1e-5), 6)
        1.5
    """
    check_delta(delta, "gdp_mu")
    if math.isinf(epsilon):
        return math.inf
    lo, hi = 0.0, 1.0
    while gdp_delta(hi, epsilon) < delta:
        lo, hi = hi, hi * 2.0
        if hi > 1e6:
            return math.inf
    if lo == 0.0 and gdp_delta(1e-12, epsilon) >= delta:
        return 0.0
    return float(scipy.optimize.brentq(lambda m: gdp_delta(m, epsilon) - delta, max(lo, 1e-12), hi, xtol=1e-12))


def one_run_p_value(num_canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """P-value of ``correct`` right guesses out of ``guesses`` under (epsilon, delta)-DP (Steinke et al., Thm 5.2).

    The game: ``num_canaries`` canaries, each included by a fair coin; the attacker
    guesses the coin of ``guesses`` of them (abstaining on the rest). Under
    (epsilon, delta)-DP the number of right guesses is stochastically dominated by
    ``Binomial(guesses, e^eps / (1 + e^eps))`` up to a delta term:
    ``P[W >= v] <= beta + 2 m delta max_{1<=i<=v} (P[B >= v - i] - beta) / i`` with
    ``beta = P[B >= v]``.

    Example:
        >>> round(one_run_p_value(100, 10, 10, 0.0, 0.0), 6)
        0.000977
    """
    if guesses <= 0 or correct <= 0:
        return 1.0
    q = float(scipy.special.expit(epsilon))
    beta = _at_least(correct, guesses, q)
    if delta == 0:
        return beta
    i = np.arange(1, correct + 1)
    gap = (_at_least(correct - i, guesses, q) - beta) / i
    return min(1.0, beta + 2.0 * num_canaries * delta * max(float(gap.max()), 0.0))


def epsilon_one_run(
    num_canaries: int, guesses: int, correct: int, *, significance: float, delta: float, at_least: float = 0.0
) -> float:
    """The largest epsilon that the guesses reject at ``significance`` (0 when none is rejected).

    One hypothesis test: the caller chose ``guesses`` before seeing the coins; if it tried
    several guess sets it must divide ``significance`` by their number (the estimators do).

    ``at_least``: skip the search below it (returns ``at_least`` if it is not rejected);
    for estimators keeping the best bound so far.

    Example:
        >>> epsilon_one_run(1000, 100, 50, significance=0.05, delta=1e-5)
        0.0
    """
    check_significance(significance, "epsilon_one_run")
    check_delta(delta, "epsilon_one_run", allow_zero=True)
    _counts(num_canaries, guesses, correct)

    def excess(eps: float) -> float:  # > 0 where (eps, delta) is rejected
        return significance - one_run_p_value(num_canaries, guesses, correct, eps, delta)

    return _largest_root(excess, _EPS_CAP, at_least)


def fdp_one_run_rejects(
    blow_up_inverse: Callable[[float], float], num_canaries: int, guesses: int, correct: int, significance: float
) -> float:
    """The f-DP one-run test of Mahloujifar et al. (2024): > 0 where the trade-off claim is rejected.

    ``blow_up_inverse(x)`` is the claimed trade-off's inverse blow-up: for mu-GDP,
    ``Phi(Phi^-1(x) - mu)``. The recursion bounds, for an f-DP mechanism, the mass of
    outcomes with at least ``correct`` right guesses out of ``guesses`` (their
    Algorithm "audit with cap"); a positive return means the observed count is less
    likely than ``significance`` under every f-DP mechanism.

    Example:
        >>> blow = lambda x: float(scipy.stats.norm.cdf(scipy.stats.norm.ppf(x) - 1.0))
        >>> fdp_one_run_rejects(blow, 1000, 500, 500, 0.05) > 0
        True
    """
    m, k, c = num_canaries, guesses, correct
    r = significance * c / m
    h = significance * (k - c) / m
    for i in range(c - 1, -1, -1):
        h_next = max(h, blow_up_inverse(r))
        if h_next == h:  # nothing moves any more
            break
        r = min(r + i / (k - i) * (h_next - h), 1.0)
        h = h_next
    return r + h - k / m


def mu_one_run_fdp(num_canaries: int, guesses: int, correct: int, *, significance: float, at_least: float = 0.0) -> float:
    """The largest mu for which mu-GDP is rejected by the f-DP one-run test (0 when none is).

    ``at_least`` as in :func:`epsilon_one_run`.

    Example:
        >>> round(mu_one_run_fdp(1000, 500, 500, significance=0.05), 2)
        1.99
    """
    check_significance(significance, "mu_one_run_fdp")
    _counts(num_canaries, guesses, correct)
    return _largest_root(lambda mu: fdp_one_run_rejects(_gdp_blow_up_inverse(mu), num_canaries, guesses, correct,
                                                       significance), _MU_CAP, at_least)


def epsilon_one_run_fdp(num_canaries: int, guesses: int, correct: int, *, significance: float, delta: float) -> float:
    """The epsilon at ``delta`` of the largest mu-GDP claim that the f-DP one-run test rejects.

    This is a lower bound on epsilon *for mechanisms whose trade-off curve is Gaussian*
    (the Gaussian mechanism, full-batch DP-SGD; approximately Poisson-subsampled DP-SGD
    by the CLT of Dong et al.). For an arbitrary mechanism use :func:`epsilon_one_run`.

    Example:
        >>> round(epsilon_one_run_fdp(1000, 1000, 1000, significance=0.05, delta=1e-5), 2)
        12.33
    """
    check_delta(delta, "epsilon_one_run_fdp")
    return gdp_epsilon(mu_one_run_fdp(num_canaries, guesses, correct, significance=significance), delta)


# --- helpers -----------------------------------------------------------------------------


def _at_least(v: Any, n: int, q: float) -> Any:
    """P[Binomial(n, q) >= v], elementwise (scipy.special.bdtrc: the upper tail, without scipy.stats' overhead)."""
    v = np.asarray(v)
    tail = scipy.special.bdtrc(np.maximum(v - 1, 0), n, q)
    out = np.where(v <= 0, 1.0, tail)
    return float(out) if out.ndim == 0 else out


def _gdp_blow_up_inverse(mu: float) -> Callable[[float], float]:
    ndtr, ndtri = scipy.special.ndtr, scipy.special.ndtri

    def inverse(x: float) -> float:
        return float(ndtr(ndtri(x) - mu))

    return inverse


def _largest_root(excess: Callable[[float], float], cap: float, start: float = 0.0) -> float:
    """The largest x in [start, cap] with excess(x) > 0, for an excess decreasing in x (start if excess(start) <= 0)."""
    if start >= cap or excess(start) <= 0:
        return min(start, cap)
    lo, hi = start, max(1.0, 2.0 * start)
    while excess(hi) > 0:
        lo, hi = hi, hi * 2.0
        if hi >= cap:
            if excess(cap) > 0:
                return cap
            hi = cap
            break
    return _rejected_side(excess, float(scipy.optimize.brentq(excess, lo, hi, xtol=1e-7)), lo)


def _rejected_side(excess: Callable[[float], float], x: float, lo: float) -> float:
    """``x`` moved down until it is itself rejected (``excess > 0``; ``lo`` is).

    brentq's root is within its tolerance on either side; a lower bound must be a value the
    test rejects, never one a hair above the largest of them.
    """
    step = max(1e-15, 1e-13 * abs(x))  # doubled each time: a few dozen evaluations at most
    while x > lo and excess(x) <= 0:
        x = max(lo, x - step)
        step *= 2.0
    return x


def _counts(m: int, k: int, c: int) -> None:
    if not (0 <= c <= k <= m and m >= 1):
        raise InputValueError(
            f"one-run counts must satisfy 0 <= correct <= guesses <= num_canaries; got num_canaries={m}, "
            f"guesses={k}, correct={c}."
        )
