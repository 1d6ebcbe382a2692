"""Exact hockey-stick curves of dominating pairs (private; numpy/scipy only).

For a dominating pair ``(P, Q)`` (``P``: the output distribution on the dataset *with*
the protected example, ``Q``: without it) the hockey-stick curve is

    delta(eps) = H_{e^eps}(P || Q) = integral of (P - e^eps Q)_+ ,

defined for every real ``eps``. The PLD engine only ever evaluates these curves on its
grid and derives the discrete privacy-loss masses from them (connect-the-dots), so a
curve plus a loss range is all a mechanism has to provide. Every curve here is a closed
form evaluated in log space (``scipy.special.log_ndtr``) so that deltas down to 1e-300
keep their relative precision.

A :class:`Direction` is one such curve, the curve of the swapped pair ``(Q, P)``, and the
range ``[lo, hi]`` of privacy losses that carries all but ~e^-50 of the mass (the same
truncation as dp_accounting). The swapped curve gives the negative-eps part precisely:
``delta(eps) = 1 - e^eps + e^eps * delta_swapped(-eps)``, where computing ``delta``
directly would lose the small excess over ``1 - e^eps`` to cancellation.
Losses below ``lo`` are rounded up to ``lo`` and the mass above ``hi`` is put at
``+inf`` by the discretisation, so the range affects tightness only, never soundness.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
from scipy import special

# x-truncation of the Gaussian noise, in standard deviations: the noise mass beyond it
# on each side is 0.5 * e^-50 (as dp_accounting's ``log_mass_truncation_bound=-50``).
_GAUSS_T = float(-special.ndtri(0.5 * math.exp(-50.0)))

CurveFn = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Direction:
    """One hockey-stick curve ``fn(eps)``, its swapped curve, and its loss range ``[lo, hi]``."""

    fn: CurveFn
    swapped: CurveFn
    lo: float
    hi: float

    def excess(self, eps: np.ndarray) -> np.ndarray:
        """``delta(eps) - (1 - e^eps)_+``, accurate even where it is tiny next to ``1 - e^eps``."""
        eps = np.asarray(eps, dtype=np.float64)
        out = np.empty_like(eps)
        pos = eps >= 0
        out[pos] = self.fn(eps[pos])
        out[~pos] = np.exp(eps[~pos]) * self.swapped(-eps[~pos])
        return out


class Pair:
    """A dominating pair of one un-subsampled step (abstract)."""

    def delta(self, eps: np.ndarray) -> np.ndarray:
        """``H_{e^eps}(P || Q)``."""
        raise NotImplementedError

    def delta_swapped(self, eps: np.ndarray) -> np.ndarray:
        """``H_{e^eps}(Q || P)``; the pairs used here are symmetric."""
        return self.delta(eps)

    def loss_range(self) -> tuple[float, float]:
        """Losses ``log P/Q`` outside this range carry negligible mass under P and Q."""
        raise NotImplementedError

    def direction(self) -> Direction:
        lo, hi = self.loss_range()
        return Direction(self.delta, self.delta_swapped, lo, hi)


@dataclass(frozen=True)
class GaussianPair(Pair):
    """``P = N(mu, 1)``, ``Q = N(0, 1)`` (a Gaussian mechanism with mu = sensitivity / sigma)."""

    mu: float

    def delta(self, eps: np.ndarray) -> np.ndarray:
        return gaussian_delta(eps, self.mu)

    def loss_range(self) -> tuple[float, float]:
        half = self.mu * self.mu / 2.0 + _GAUSS_T * self.mu
        return -half, half


@dataclass(frozen=True)
class LaplacePair(Pair):
    """``P = Lap(1, b)``, ``Q = Lap(0, b)``: losses live in ``[-1/b, 1/b]``."""

    scale: float

    def delta(self, eps: np.ndarray) -> np.ndarray:
        return laplace_delta(eps, self.scale)

    def loss_range(self) -> tuple[float, float]:
        return -1.0 / self.scale, 1.0 / self.scale


@dataclass(frozen=True)
class EpsDeltaPair(Pair):
    """The canonical dominating pair of an (eps0, delta0)-DP mechanism (Kairouz et al. 2015).

    Under P the loss is +inf with probability delta0, +eps0 with probability
    (1 - delta0) / (1 + e^-eps0) and -eps0 otherwise (the PLD dp_accounting uses too).
    """

    epsilon: float
    delta0: float

    def delta(self, eps: np.ndarray) -> np.ndarray:
        eps = np.asarray(eps, dtype=np.float64)
        p_plus = special.expit(self.epsilon)
        p_minus = special.expit(-self.epsilon)
        with np.errstate(over="ignore"):
            up = np.maximum(-np.expm1(eps - self.epsilon), 0.0)
            down = np.maximum(-np.expm1(eps + self.epsilon), 0.0)
        return np.clip(self.delta0 + (1.0 - self.delta0) * (p_plus * up + p_minus * down), 0.0, 1.0)

    def loss_range(self) -> tuple[float, float]:
        return -self.epsilon, self.epsilon


@dataclass(frozen=True)
class ReplaceGaussianPair(Pair):
    """Poisson-subsampled Gaussian under replace-one, as dp_accounting's ``REPLACE`` adjacency.

    ``P = q N(-1, s^2) + (1 - q) N(0, s^2)``, ``Q = q N(1, s^2) + (1 - q) N(0, s^2)``
    (symmetric). Used for the truncation branch of truncated Poisson sampling.
    """

    std: float
    q: float

    def delta(self, eps: np.ndarray) -> np.ndarray:
        eps = np.asarray(eps, dtype=np.float64)
        s, q = self.std, self.q
        if q >= 1.0:
            return gaussian_delta(eps, 2.0 / s)
        log_a = math.log(q) - math.log1p(-q) - 1.0 / (2.0 * s * s)
        half = np.abs(eps) / 2.0
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            # log|sinh(eps/2)|, then the inverse loss x(eps) = s^2 (asinh(-sinh(eps/2)/A) - eps/2)
            log_sinh = half + np.log1p(-np.exp(-2.0 * half)) - math.log(2.0)
            w = log_sinh - log_a
            asinh = -np.sign(eps) * np.logaddexp(w, 0.5 * np.logaddexp(0.0, 2.0 * w))
            x = s * s * (asinh - eps / 2.0)
            xs = x / s
            base = math.log1p(-q) + special.log_ndtr(xs)
            lu = np.logaddexp(base, math.log(q) + special.log_ndtr(xs + 1.0 / s))
            ll = np.logaddexp(base, math.log(q) + special.log_ndtr(xs - 1.0 / s))
            out = np.exp(lu) * -np.expm1(np.minimum(eps + ll - lu, 0.0))
        out = np.where(eps == -np.inf, 1.0, out)
        out = np.where(eps == np.inf, 0.0, out)
        return np.clip(np.nan_to_num(out, nan=0.0), 0.0, 1.0)

    def loss_range(self) -> tuple[float, float]:
        s, q = self.std, self.q
        if q >= 1.0:
            return GaussianPair(2.0 / s).loss_range()

        def loss(x: float) -> float:
            l1q, lq = math.log1p(-q), math.log(q)
            up = np.logaddexp(l1q, lq - (2.0 * x + 1.0) / (2.0 * s * s))
            low = np.logaddexp(l1q, lq + (2.0 * x - 1.0) / (2.0 * s * s))
            return float(up - low)

        return loss(_GAUSS_T * s), loss(-_GAUSS_T * s - 1.0)


# --------------------------------------------------------------------------- curves


def gaussian_delta(eps: np.ndarray, mu: float) -> np.ndarray:
    """``Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu)``, computed in log space."""
    eps = np.asarray(eps, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        la = special.log_ndtr(mu / 2.0 - eps / mu)
        lb = special.log_ndtr(-mu / 2.0 - eps / mu)
        out = np.exp(la) * -np.expm1(np.minimum(eps + lb - la, 0.0))
    out = np.where(eps == -np.inf, 1.0, out)
    out = np.where(eps == np.inf, 0.0, out)
    return np.clip(np.nan_to_num(out, nan=0.0), 0.0, 1.0)


def laplace_delta(eps: np.ndarray, scale: float) -> np.ndarray:
    """Hockey-stick curve of the Laplace mechanism (sensitivity 1, scale ``b``).

    ``1 - e^eps`` for eps <= -1/b, ``1 - exp((eps - 1/b) / 2)`` in between, 0 above 1/b.
    """
    eps = np.asarray(eps, dtype=np.float64)
    e = 1.0 / scale
    with np.errstate(over="ignore", invalid="ignore"):
        mid = -np.expm1((eps - e) / 2.0)
        low = -np.expm1(eps)
    out = np.where(eps >= e, 0.0, np.where(eps <= -e, low, mid))
    return np.clip(out, 0.0, 1.0)


def poisson_remove(pair: Pair, q: float) -> Direction:
    """``H(qP + (1-q)Q || Q)``: the 'remove' pair of Poisson subsampling at rate ``q``.

    Uses ``H_{e^eps}(qP + (1-q)Q || Q) = q H_{e^eps'}(P || Q)`` with
    ``e^eps' = 1 + (e^eps - 1) / q`` for eps > log(1-q), and ``1 - e^eps`` below.
    Its swapped pair is the 'add' pair.
    """
    lo, hi = pair.loss_range()
    l1q, lq = math.log1p(-q), math.log(q)
    return Direction(_remove_curve(pair, q), _add_curve(pair, q), _log_mix(l1q, lq, lo), _log_mix(l1q, lq, hi))


def poisson_add(pair: Pair, q: float) -> Direction:
    """``H(Q || qP + (1-q)Q)``: the 'add' pair of Poisson subsampling at rate ``q``.

    With ``c = 1 - e^eps (1-q)``: ``c * H_{e^eps q / c}(Q || P)`` for eps < -log(1-q), else 0.
    Its swapped pair is the 'remove' pair.
    """
    lo, hi = pair.loss_range()
    l1q, lq = math.log1p(-q), math.log(q)
    return Direction(_add_curve(pair, q), _remove_curve(pair, q), -_log_mix(l1q, lq, hi), -_log_mix(l1q, lq, lo))


def _remove_curve(pair: Pair, q: float) -> CurveFn:
    l1q = math.log1p(-q)

    def fn(eps: np.ndarray) -> np.ndarray:
        eps = np.asarray(eps, dtype=np.float64)
        with np.errstate(over="ignore"):
            out = -np.expm1(eps)
        mask = eps > l1q
        e = eps[mask]
        with np.errstate(divide="ignore", over="ignore"):
            # log(1 + (e^eps - 1) / q); above eps = 1 as eps - log q + log1p(-(1-q) e^-eps), which
            # does not overflow: expm1(eps) is inf beyond eps ~ 709, and an inf here read the curve
            # as 0 there, moving every loss above ~709 below it (an under-report of epsilon).
            inner = np.where(e > 1.0, e - math.log(q) + np.log1p(-(1.0 - q) * np.exp(-np.maximum(e, 1.0))),
                             np.log1p(np.expm1(np.minimum(e, 1.0)) / q))
        out[mask] = q * pair.delta(inner)
        return np.clip(out, 0.0, 1.0)

    return fn


def _add_curve(pair: Pair, q: float) -> CurveFn:
    l1q, lq = math.log1p(-q), math.log(q)

    def fn(eps: np.ndarray) -> np.ndarray:
        eps = np.asarray(eps, dtype=np.float64)
        out = np.zeros_like(eps)
        mask = eps < -l1q
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            log_c = np.log(-np.expm1(eps[mask] + l1q))
            inner = eps[mask] + lq - log_c
        out[mask] = np.exp(log_c) * pair.delta_swapped(inner)
        return np.clip(np.nan_to_num(out, nan=0.0), 0.0, 1.0)

    return fn


def mixture(weight: float, first: Direction, second: Direction) -> Direction:
    """``weight * first + (1 - weight) * second``: the pair that also reveals the branch."""

    def combine(f1: CurveFn, f2: CurveFn) -> CurveFn:
        return lambda eps: np.clip(weight * f1(eps) + (1.0 - weight) * f2(eps), 0.0, 1.0)

    return Direction(
        combine(first.fn, second.fn),
        combine(first.swapped, second.swapped),
        min(first.lo, second.lo),
        max(first.hi, second.hi),
    )


def pointwise_max(first: Direction, second: Direction) -> Direction:
    """The curve ``max(first, second)`` (the delta-curve of ``min(f1, f2)**``)."""

    def combine(f1: CurveFn, f2: CurveFn) -> CurveFn:
        return lambda eps: np.maximum(f1(eps), f2(eps))

    return Direction(
        combine(first.fn, second.fn),
        combine(first.swapped, second.swapped),
        min(first.lo, second.lo),
        max(first.hi, second.hi),
    )


# ------------------------------------------------------------- analytic Gaussian


def gaussian_epsilon(mu: float, delta: float) -> float:
    """Smallest eps >= 0 with ``gaussian_delta(eps, mu) <= delta`` (never below the exact value)."""
    if mu == 0.0:
        return 0.0
    if math.isinf(mu):
        return math.inf

    def gap(e: float) -> float:
        d = float(gaussian_delta(np.array([e]), mu)[0])
        return (math.log(d) if d > 0 else -1e300) - math.log(delta)

    if gap(0.0) <= 0:
        return 0.0
    hi = mu * mu / 2.0 + mu * math.sqrt(2.0 * math.log(1.0 / delta)) + 1.0
    while gap(hi) > 0:
        hi *= 2.0
    from scipy import optimize

    eps = optimize.brentq(gap, 0.0, hi, xtol=1e-13, rtol=1e-15, maxiter=500)
    # brentq stops within its tolerance of the root; step to the safe side.
    step = 1e-13 * max(1.0, eps)
    while gap(eps) > 0:
        eps += step
        step *= 2.0
    return float(eps)


def gaussian_beta(mu: float, alpha: float) -> float:
    """Trade-off curve of mu-GDP: ``Phi(Phi^-1(1 - alpha) - mu)`` (Dong, Roth and Su 2022)."""
    if alpha <= 0.0:
        return 1.0
    if alpha >= 1.0:
        return 0.0
    return float(special.ndtr(special.ndtri(1.0 - alpha) - mu))


def _log_mix(l1q: float, lq: float, loss: float) -> float:
    """``log(1 - q + q e^loss)``."""
    return float(np.logaddexp(l1q, lq + loss))
