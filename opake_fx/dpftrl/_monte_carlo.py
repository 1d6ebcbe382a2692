"""Monte-Carlo privacy accounting for amplified DP-FTRL (private; numpy/torch).

For sampling schemes without a closed-form reduction (balls-in-bins, b-min-sep) the
dominating pair of the whole run is a Gaussian mixture: ``P`` = the output ``C x + s xi``
with the example's random participation vector ``x``, ``Q`` = ``s xi`` without it (``s``
the noise std in units of the clip norm). The privacy loss ``L(y) = log P(y)/Q(y)`` has a
tractable form for both samplers, so

    delta_remove(eps) = E_{y~P}[(1 - e^(eps - L(y)))_+],
    delta_add(eps)    = E_{y~Q}[(1 - e^(eps + L(y)))_+]

are means of i.i.d. [0, 1]-valued variables, estimated from ``num_samples`` draws of each
(keyed: the estimate is a function of the key). Each mean gets a one-sided Chernoff
(KL-Hoeffding) confidence bound at level ``(1 - confidence) / 2``; the reported delta is
the larger upper bound, so with probability at least ``confidence`` over the draws it
bounds the true delta. The same holds for the reported epsilon: it is the smallest eps
whose upper bound is below delta, and because the estimated and the true curves are both
non-increasing in eps, that eps is wrong only if the bound fails at one fixed eps.

Loss of one draw (``ell_i = <C^T y, e_i> / s^2 - ||C e_i||^2 / (2 s^2)``):

* balls-in-bins with cycle ``b`` (Chua et al. 2024, arXiv:2410.06266 and arXiv:2412.16802): the
  example sits in bin ``J`` (uniform) and participates at ``J, J + b, ...``;
  ``L = log mean_j exp(v_j / s^2 - G_jj / (2 s^2))`` with ``v_j = <y, C u_j>`` and
  ``G = U^T C^T C U`` (``U`` the bin indicators). Only the ``b``-vector ``v`` matters:
  ``v ~ N(G e_J, s^2 G)`` under ``P_J`` and ``N(0, s^2 G)`` under ``Q``.
* b-min-sep with rate ``p`` (the b-min-sep analysis of DP-BandMF, arXiv:2602.09338):
  an available example participates with probability ``p`` and
  then rests ``b - 1`` steps. With ``bands <= b`` the columns of two participations are
  orthogonal, and ``L`` is a backward recursion over steps:
  ``F_i = log((1 - p) e^{F_{i+1}} + p e^{ell_i + F_{i+b}})``, ``F_{>= n} = 0``, ``L = F_0``
  (mixed over the stationary start with ``warm_start``).

Both reductions assume ``C^T C >= 0`` entrywise (true for BandMF with non-negative
bands), under which aligned clipped gradients are the worst case.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
from scipy import optimize

from opake_fx.random import RngKey, fold_in, normal

__all__ = ["MonteCarloEstimate", "kl_upper", "kl_lower", "sample_losses"]

_CHUNK = 8192


@dataclass(frozen=True)
class MonteCarloEstimate:
    """A Monte-Carlo estimate of delta at one epsilon, with a two-sided confidence interval.

    ``lower <= delta <= upper`` with probability at least ``confidence`` (over the draws);
    ``estimate`` is the sample mean of the worse direction.
    """

    epsilon: float
    estimate: float
    lower: float
    upper: float
    confidence: float
    num_samples: int


def kl_bernoulli(p: float, q: float) -> float:
    """KL(Bernoulli(p) || Bernoulli(q))."""
    out = 0.0
    if p > 0:
        out += p * math.log(p / q) if q > 0 else math.inf
    if p < 1:
        out += (1 - p) * math.log((1 - p) / (1 - q)) if q < 1 else math.inf
    return out


def kl_upper(mean: float, n: int, alpha: float) -> float:
    """The largest ``q >= mean`` with ``n KL(mean || q) <= log(1/alpha)``: P(true > it) <= alpha."""
    mean = min(max(mean, 0.0), 1.0)
    budget = math.log(1.0 / alpha) / n
    if mean >= 1.0 or kl_bernoulli(mean, 1.0 - 1e-300) <= budget:
        return 1.0
    return float(optimize.brentq(lambda q: kl_bernoulli(mean, q) - budget, mean, 1.0 - 1e-300, xtol=1e-300, rtol=1e-12))


def kl_lower(mean: float, n: int, alpha: float) -> float:
    """The smallest ``q <= mean`` with ``n KL(mean || q) <= log(1/alpha)``."""
    mean = min(max(mean, 0.0), 1.0)
    budget = math.log(1.0 / alpha) / n
    if mean <= 0.0 or kl_bernoulli(mean, 1e-300) <= budget:
        return 0.0
    return float(optimize.brentq(lambda q: kl_bernoulli(mean, q) - budget, 1e-300, mean, xtol=1e-300, rtol=1e-12))


def hockey_stick(losses: np.ndarray, eps: float, sign: float) -> float:
    """Sample mean of ``(1 - exp(eps - sign * L))_+``."""
    return float(np.mean(-np.expm1(np.minimum(eps - sign * losses, 0.0))))


@functools.lru_cache(maxsize=8)
def sample_losses(kind: str, spec: tuple, noise_std: float, num_samples: int, key_words: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """``(losses under P, losses under Q)`` for one Monte-Carlo process (cached)."""
    k = RngKey(key_words)
    kp, kq = fold_in(k, 1), fold_in(k, 2)
    if kind == "balls_in_bins":
        gram = np.array(spec[1], dtype=np.float64).reshape(spec[0], spec[0])
        return _bib_losses(gram, noise_std, num_samples, kp, True), _bib_losses(gram, noise_std, num_samples, kq, False)
    if kind == "b_min_sep":
        n, bands, p, b, warm = spec[0], spec[1], spec[2], spec[3], spec[4]
        band = np.array(spec[5], dtype=np.float64).reshape(n, bands)
        return (
            _bms_losses(band, p, b, warm, noise_std, num_samples, kp, True),
            _bms_losses(band, p, b, warm, noise_std, num_samples, kq, False),
        )
    raise ValueError(f"unknown Monte-Carlo kind {kind!r}")


# ----------------------------------------------------------------- balls in bins


def _bib_losses(gram: np.ndarray, s: float, num: int, k: RngKey, positive: bool) -> np.ndarray:
    b = gram.shape[0]
    g = torch.from_numpy(gram)
    evals, evecs = torch.linalg.eigh(g)
    root = evecs * evals.clamp(min=0).sqrt()  # root @ root.T = G
    shift = torch.diagonal(g) / (2 * s * s)
    out = []
    for c, size in enumerate(_chunks(num)):
        kc = fold_in(k, c)
        xi = normal(fold_in(kc, 0), (size, b), dtype=torch.float64)
        v = s * xi @ root.T
        if positive:
            u = _uniform(fold_in(kc, 1), (size,))
            j = torch.clamp((u * b).long(), max=b - 1)
            v = v + g[j]  # row J of G = G e_J (symmetric)
        out.append((torch.logsumexp(v / (s * s) - shift, dim=1) - math.log(b)).numpy())
    return np.concatenate(out)


# ------------------------------------------------------------------- b-min-sep


def _bms_losses(band: np.ndarray, p: float, b: int, warm: bool, s: float, num: int, k: RngKey, positive: bool) -> np.ndarray:
    n, bands = band.shape
    v = torch.from_numpy(band)  # v[t, j] = C[t + j, t]
    col2 = (v * v).sum(1)
    log_p, log_q = math.log(p), math.log1p(-p)
    start = torch.tensor([1.0] + [p] * (b - 1), dtype=torch.float64) / (1.0 + (b - 1) * p)
    out = []
    for c, size in enumerate(_chunks(num)):
        kc = fold_in(k, c)
        y = s * normal(fold_in(kc, 0), (size, n), dtype=torch.float64)
        if positive:
            x = _min_sep_participation(fold_in(kc, 1), size, n, p, b, warm, start)
            y = y + _banded_matvec(v, x)
        w = _banded_rmatvec(v, y)  # C^T y
        ell = w / (s * s) - col2 / (2 * s * s)
        f = torch.zeros(size, n + b, dtype=torch.float64)  # F_i for i in [0, n + b); F_{>= n} = 0
        for i in range(n - 1, -1, -1):
            f[:, i] = torch.logaddexp(log_q + f[:, i + 1], log_p + ell[:, i] + f[:, i + b])
        if warm and b > 1:
            loss = torch.logsumexp(f[:, :b] + torch.log(start), dim=1)
        else:
            loss = f[:, 0]
        out.append(loss.numpy())
    return np.concatenate(out)


def _min_sep_participation(k: RngKey, size: int, n: int, p: float, b: int, warm: bool, start: torch.Tensor) -> torch.Tensor:
    u = _uniform(fold_in(k, 0), (size, n))
    if warm and b > 1:
        # First available step: 0 w.p. 1 / (1 + (b-1) p), each of 1..b-1 w.p. p / (1 + (b-1) p).
        u0 = _uniform(fold_in(k, 1), (size,))
        first = torch.searchsorted(torch.cumsum(start, 0)[:-1].contiguous(), u0, right=True)
    else:
        first = torch.zeros(size, dtype=torch.int64)
    available = first.clone()
    x = torch.zeros(size, n, dtype=torch.float64)
    for i in range(n):
        take = (available <= i) & (u[:, i] < p)
        x[:, i] = take.double()
        available = torch.where(take, torch.full_like(available, i + b), available)
    return x


def _banded_matvec(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``C x`` for each row of ``x``: ``(C x)_t = sum_j v[t-j, j] x_{t-j}``."""
    n, bands = v.shape
    out = torch.zeros_like(x)
    for j in range(bands):
        out[:, j:] += v[: n - j, j] * x[:, : n - j]
    return out


def _banded_rmatvec(v: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``(C^T y)_s = sum_j v[s, j] y_{s+j}`` for each row of ``y``."""
    n, bands = v.shape
    out = torch.zeros_like(y)
    for j in range(bands):
        out[:, : n - j] += v[: n - j, j] * y[:, j:]
    return out


def _uniform(k: RngKey, shape: tuple[int, ...]) -> torch.Tensor:
    """U(0, 1) from keyed normals (the normal CDF of a normal is uniform)."""
    return torch.special.ndtr(normal(k, shape, dtype=torch.float64))


def _chunks(num: int) -> list[int]:
    sizes = [_CHUNK] * (num // _CHUNK)
    if num % _CHUNK:
        sizes.append(num % _CHUNK)
    return sizes
