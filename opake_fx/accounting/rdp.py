"""The Renyi-DP (RDP) engine: RDP curves of single steps, composition, conversion.

RDP composes by adding curves over a grid of orders (Mironov 2017). The grid is
dp_accounting's ``RdpAccountant`` default, so both give comparable numbers.

* Gaussian mechanism: ``alpha / (2 sigma^2)``.
* Poisson-subsampled Gaussian (add-or-remove): Mironov, Talwar and Zhang 2019,
  "Renyi Differential Privacy of the Sampled Gaussian Mechanism": the binomial
  expansion of ``A_alpha`` at integer orders and the two-sided series with
  Gaussian tail integrals at fractional orders (their Section 3.3). As in their
  reference implementation the series uses the absolute values of the generalised
  binomial coefficients, which upper-bounds ``A_alpha``.
* Laplace mechanism: Mironov 2017, Proposition 6.
* Pure eps-DP (``eps_delta(eps, 0)``): the RDP of randomized response, which is the
  largest RDP an eps-DP mechanism can have.
* Conversion to (eps, delta): ``eps = rdp(a) + log((a-1)/a) - (log(delta) + log(a))/(a-1)``
  minimised over the orders (Balle et al. 2020; Canonne, Kamath and Steinke 2020), with
  the same guards as dp_accounting (orders <= 1.01 skipped; a KL-based shortcut to 0).

Truncated Poisson sampling, sampling without replacement, subsampled Laplace and
(eps, delta > 0) mechanisms have no RDP curve here; they raise
:class:`~opake_fx.errors.InputValueError` pointing at the PLD accountant.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import special

__all__ = ["DEFAULT_RDP_ORDERS", "rdp_curve", "epsilon_from_rdp", "delta_from_rdp"]

DEFAULT_RDP_ORDERS: tuple[float, ...] = tuple(
    [1 + x / 10.0 for x in range(1, 100)] + [float(a) for a in range(11, 64)] + [128.0, 256.0, 512.0, 1024.0]
)
"""RDP orders used by default (dp_accounting ``RdpAccountant``'s default grid)."""

_FRAC_TERMS = 1000  # series terms tried at fractional orders before giving up (-> inf)


def rdp_curve(components: tuple[tuple[Any, int], ...], orders: Sequence[float]) -> np.ndarray:
    """Sum over components of ``count * leaf._rdp(orders)``."""
    orders_arr = np.asarray(orders, dtype=np.float64)
    total = np.zeros_like(orders_arr)
    for leaf, count in components:
        total = total + count * np.asarray(leaf._rdp(orders_arr), dtype=np.float64)
    return total


def epsilon_from_rdp(orders: Sequence[float], rdp: np.ndarray, delta: float) -> float:
    """Smallest eps over the orders for which the RDP curve implies (eps, delta)-DP."""
    best = math.inf
    for a, r in zip(orders, rdp):
        if r < 0 or delta * delta + math.expm1(-r) > 0:
            eps = 0.0  # delta >= sqrt(1 - e^-KL) already: eps = 0 suffices
        elif a > 1.01:
            eps = r + math.log1p(-1.0 / a) - math.log(delta * a) / (a - 1.0)
        else:
            eps = math.inf
        best = min(best, eps)
    return float(max(0.0, best))


def delta_from_rdp(orders: Sequence[float], rdp: np.ndarray, epsilon: float) -> float:
    """Smallest delta over the orders for which the RDP curve implies (epsilon, delta)-DP."""
    best = 0.0
    log_best = math.inf
    for a, r in zip(orders, rdp):
        if r < 0 or r == 0:
            log_d = -math.inf
        elif math.isinf(r):
            log_d = 0.0
        else:
            log_d = 0.5 * math.log1p(-math.exp(-r))
        if a > 1.01 and math.isfinite(r):
            log_d = min(log_d, (a - 1.0) * (r - epsilon + math.log1p(-1.0 / a)) - math.log(a))
        log_best = min(log_best, log_d)
    best = math.exp(log_best) if log_best > -math.inf else 0.0
    return float(min(best, 1.0))


# ------------------------------------------------------------ single-step curves


def gaussian_rdp(sigma: float, orders: np.ndarray) -> np.ndarray:
    """``alpha / (2 sigma^2)`` (``inf`` where ``sigma**2`` underflows, e.g. sigma = 1e-300)."""
    with np.errstate(divide="ignore"):
        return np.asarray(orders, dtype=np.float64) / (2.0 * sigma * sigma)


def laplace_rdp(scale: float, orders: np.ndarray) -> np.ndarray:
    """Mironov 2017, Prop. 6: ``eps + log(1 + (a-1)(e^{(1-2a) eps} - 1)/(2a-1)) / (a-1)``, eps = 1/b."""
    eps = 1.0 / scale
    out = []
    for a in np.asarray(orders, dtype=np.float64):
        if a == 1.0:  # the KL divergence, the limit a -> 1
            out.append(eps + math.expm1(-eps))
        else:  # log1p keeps its relative precision as a -> 1
            out.append(eps + math.log1p((a - 1) * math.expm1(eps * (1 - 2 * a)) / (2 * a - 1)) / (a - 1))
    return np.array(out)


def pure_dp_rdp(epsilon: float, orders: np.ndarray) -> np.ndarray:
    """RDP of randomized response with parameter eps (the worst eps-DP mechanism)."""
    orders = np.asarray(orders, dtype=np.float64)
    if epsilon == 0.0:
        return np.zeros_like(orders)
    log_p = -np.logaddexp(0.0, -epsilon)  # log(e^eps / (1 + e^eps))
    log_1mp = -np.logaddexp(0.0, epsilon)
    a = orders
    terms = np.logaddexp(a * log_p + (1 - a) * log_1mp, a * log_1mp + (1 - a) * log_p)
    return np.minimum(terms / (a - 1.0), epsilon)


def poisson_gaussian_rdp(q: float, sigma: float, orders: np.ndarray) -> np.ndarray:
    """RDP of the Poisson-subsampled Gaussian mechanism (Mironov, Talwar and Zhang 2019)."""
    orders = np.asarray(orders, dtype=np.float64)
    if q == 0.0:
        return np.zeros_like(orders)
    if q == 1.0:
        return gaussian_rdp(sigma, orders)
    if sigma * sigma == 0.0 or math.isinf(0.5 / (sigma * sigma)):
        return np.full_like(orders, math.inf)  # sigma**2 underflows: no bound (the terms would be NaN)
    out = np.empty_like(orders)
    for n, a in enumerate(orders):
        if math.isinf(a):
            out[n] = math.inf
        elif float(a).is_integer():
            out[n] = _log_a_int(q, sigma, int(a)) / (a - 1.0)
        else:
            out[n] = _log_a_frac(q, sigma, float(a)) / (a - 1.0)
    return out


def _log_comb(n: float, k: np.ndarray) -> np.ndarray:
    return special.gammaln(n + 1.0) - special.gammaln(k + 1.0) - special.gammaln(n - k + 1.0)


def _log_a_int(q: float, sigma: float, alpha: int) -> float:
    """``log A_alpha`` at an integer order: a binomial sum, evaluated with logsumexp."""
    i = np.arange(alpha + 1, dtype=np.float64)
    terms = _log_comb(alpha, i) + i * math.log(q) + (alpha - i) * math.log1p(-q) + (i * i - i) / (2.0 * sigma**2)
    return float(special.logsumexp(terms))


def _log_a_frac(q: float, sigma: float, alpha: float) -> float:
    """``log A_alpha`` at a fractional order (MTZ 2019, Sec. 3.3), summed until converged.

    Terms are added until both halves are decreasing and below ``total - 30`` (relative
    size e^-30); ``inf`` (order excluded) if that does not happen within 1000 terms.
    """
    i = np.arange(_FRAC_TERMS, dtype=np.float64)
    j = alpha - i
    z0 = sigma**2 * math.log(1.0 / q - 1.0) + 0.5
    log_coef = _log_comb(alpha, i)
    lq, l1q = math.log(q), math.log1p(-q)
    log_t0 = log_coef + i * lq + j * l1q
    log_t1 = log_coef + j * lq + i * l1q
    # log(0.5 * erfc(x)) = log_ndtr(-sqrt(2) x)
    log_e0 = special.log_ndtr(-(i - z0) / sigma)
    log_e1 = special.log_ndtr(-(z0 - j) / sigma)
    log_s0 = log_t0 + (i * i - i) / (2.0 * sigma**2) + log_e0
    log_s1 = log_t1 + (j * j - j) / (2.0 * sigma**2) + log_e1
    total = np.logaddexp.accumulate(np.logaddexp(log_s0, log_s1))
    prev0 = np.concatenate([[-np.inf], log_s0[:-1]])
    prev1 = np.concatenate([[-np.inf], log_s1[:-1]])
    done = (log_s0 < prev0) & (log_s1 < prev1) & (np.maximum(log_s0, log_s1) < total - 30.0)
    hits = np.flatnonzero(done)
    if hits.size == 0:
        return math.inf
    return float(total[hits[0]])
