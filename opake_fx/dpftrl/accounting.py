"""Whole-run privacy accounting for DP-FTRL (numpy/scipy; strategies are read for their numbers).

Every function returns a :class:`~opake_fx.accounting.DpProcess` for the *whole run* (the
noise is correlated across steps, so a run is not ``steps`` independent releases), or,
for prefix accounting, the per-step increments whose composition after ``t`` steps is
exactly the privacy of the first ``t`` releases.

=====================  ===============================  ==================================
sampling               process                          method
=====================  ===============================  ==================================
any fixed pattern      :func:`mf_gaussian`              exact: the Gaussian mechanism
(b-min-sep, epochs)                                     ``C x + z`` with its sensitivity
cyclic Poisson         :func:`poisson`                  exact reduction to DP-SGD
(banded C)                                              (Choquette-Choo et al. 2023, Thm. 4)
b-min-sep sampling     :func:`b_min_sep`                exact for one band and ``b = 1``
                                                        (Poisson); else Monte Carlo
balls-in-bins          :func:`balls_in_bins`            exact for cycle 1 (Gaussian); else
                                                        Monte Carlo
=====================  ===============================  ==================================

Monte-Carlo processes (:class:`MonteCarloProcess`) report upper bounds that hold with
probability ``confidence`` over their own draws, which are a function of their key (so
a reported number is reproducible). They do not compose with other processes.

Noise calibration conventions: :func:`mf_gaussian` assumes the noise was made by
``mf_gaussian_noise`` with the same ``min_sep``/``max_participations``/``epochs``; the
amplified processes (:func:`poisson`, :func:`b_min_sep`, :func:`balls_in_bins`) assume
the default per-participation calibration (``min_sep=1, max_participations=1``: the
largest column norm of ``C``). Pass ``noise_sensitivity=`` when the noise was scaled
differently.

Prefix accounting: :func:`mf_gaussian_steps` and :func:`poisson_steps` give one process
per step; feed them to :class:`opake_fx.accounting.Accountant` to report epsilon after
every step and stop before a budget is exceeded::

    acct = Accountant(epsilon_budget(3.0, delta=1e-5))
    for t, cost in enumerate(poisson_steps(nm, strategy, q)):
        acct.step(cost)        # raises BudgetExceededError before step t is released
        ...train step t...

Example:
    >>> from opake_fx.dpftrl import band_mf_strategy
    >>> import opake_fx.dpsgd.accounting as dpsgd_acc
    >>> s = band_mf_strategy(100, bands=1)
    >>> poisson(1.0, s, sample_rate=0.01) == dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), 0.01) * 100
    True
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any, ClassVar

import numpy as np
import torch

import opake_fx.dpsgd.accounting as _dpsgd
from opake_fx.accounting import DpProcess, identity
from opake_fx.accounting.process import ADD_OR_REMOVE_ONE, process_from_dict
from opake_fx.dpftrl import _monte_carlo as _mc
from opake_fx.dpftrl import sensitivity as _sens
from opake_fx.dpftrl.strategies._base import Strategy, ToeplitzLike
import opake_fx.validation as check
from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.random import RngKey
from opake_fx.typing import typechecked

__all__ = [
    "mf_gaussian",
    "poisson",
    "b_min_sep",
    "balls_in_bins",
    "mf_gaussian_steps",
    "poisson_steps",
    "prefix_epsilons",
    "MonteCarloProcess",
    "MonteCarloEstimate",
]

MonteCarloEstimate = _mc.MonteCarloEstimate


@typechecked
def mf_gaussian(
    noise_multiplier: Real,
    strategy: Strategy,
    min_sep: Integral = 1,
    max_participations: Integral | None = 1,
    *,
    epochs: Integral | None = None,
    n_steps: Integral | None = None,
    noise_sensitivity: Real | None = None,
) -> DpProcess:
    """The whole run ``C x + z`` as one Gaussian mechanism.

    With ``z ~ N(0, (noise_multiplier * noise_sensitivity * max_norm)^2)`` and a run
    sensitivity ``sens * max_norm`` under the participation pattern, the run is exactly
    ``gaussian(noise_multiplier * noise_sensitivity / sens)`` (mu-GDP with
    ``mu = sens / (noise_multiplier * noise_sensitivity)``; Denisov et al. 2022 for
    adaptively chosen gradients).

    Args:
        noise_multiplier: the ``noise_multiplier`` given to ``mf_gaussian_noise``.
        strategy: the strategy used.
        min_sep, max_participations: the b-min-sep pattern the sampler guarantees.
        epochs: fixed-epoch order with this many epochs instead (exact for dense
            multi-epoch strategies).
        n_steps: the horizon for strategies built without one.
        noise_sensitivity: the sensitivity the noise was scaled by (default: the one
            for this same pattern, i.e. ``mf_gaussian_noise`` got the same arguments).

    Privacy contract: add-or-remove-one neighbours; an upper bound whenever the
    strategy's sensitivity is (see ``strategy.sensitivity_is_exact``), else exact.

    Example:
        >>> from opake_fx.dpftrl import band_mf_strategy
        >>> s = band_mf_strategy(64, bands=8)
        >>> mf_gaussian(2.0, s, min_sep=8, max_participations=None).epsilon_at(1e-5) > 0
        True
    """
    nm = _noise_multiplier(noise_multiplier, "mf_gaussian")
    n = _horizon(strategy, n_steps, "mf_gaussian")
    sens = strategy.epoch_sensitivity(epochs, n=n) if epochs is not None else strategy.sensitivity(min_sep, max_participations, n=n)
    noise_sens = sens if noise_sensitivity is None else check.positive(noise_sensitivity, "noise_sensitivity", "mf_gaussian")
    return _dpsgd.gaussian(nm * noise_sens / sens)


@typechecked
def mf_gaussian_steps(
    noise_multiplier: Real,
    strategy: Strategy,
    min_sep: Integral = 1,
    max_participations: Integral | None = 1,
    *,
    n_steps: Integral | None = None,
    noise_sensitivity: Real | None = None,
) -> list[DpProcess]:
    """Per-step increments of :func:`mf_gaussian`: their composition over steps ``0..t-1`` is the first ``t`` releases.

    The first ``t`` rows of ``C x + z`` are a Gaussian mechanism with sensitivity
    ``sens_t`` (that of the top-left ``t x t`` block of ``C``), i.e.
    ``mu_t = sens_t / (noise_multiplier * noise_sensitivity)``. Gaussian mechanisms
    compose by adding ``mu^2``, so step ``t`` costs ``gaussian(1 / sqrt(mu_{t+1}^2 - mu_t^2))``
    (``identity()`` when it adds nothing) and the composition of the first ``t`` steps is
    exact. ``sens_t`` is exact or an upper bound as ``strategy.sensitivity`` is; for
    non-banded, non-Toeplitz strategies longer than 256 steps every prefix is charged the
    whole run's sensitivity (conservative, and cheap).

    Example:
        >>> from opake_fx.dpftrl import bsr_strategy
        >>> steps = mf_gaussian_steps(1.0, bsr_strategy(10, 3))
        >>> len(steps)
        10
    """
    nm = _noise_multiplier(noise_multiplier, "mf_gaussian_steps")
    n = _horizon(strategy, n_steps, "mf_gaussian_steps")
    full = strategy.sensitivity(min_sep, max_participations, n=n)
    noise_sens = full if noise_sensitivity is None else check.positive(noise_sensitivity, "noise_sensitivity", "mf_gaussian_steps")
    sens = _prefix_sensitivities(strategy, n, min_sep, max_participations)
    mu2_prev = 0.0
    out: list[DpProcess] = []
    for value in sens:
        mu2 = max((value / (nm * noise_sens)) ** 2, mu2_prev)
        inc = mu2 - mu2_prev
        out.append(_dpsgd.gaussian(1.0 / math.sqrt(inc)) if inc > 0 else identity())
        mu2_prev = mu2
    return out


@typechecked
def poisson(
    noise_multiplier: Real,
    strategy: Strategy,
    sample_rate: Real,
    *,
    partitions: Integral | None = None,
    n_steps: Integral | None = None,
    noise_sensitivity: Real | None = None,
) -> DpProcess:
    """Amplified BandMF: a banded strategy under cyclic Poisson sampling.

    The data are split into ``partitions`` groups (:class:`~opake_fx.dpftrl.sampling.CyclicPoissonSampler`);
    step ``t`` Poisson-samples group ``t mod partitions`` at ``sample_rate``. With at most
    ``partitions`` bands, the rows of ``C x + z`` an example can influence through its
    ``j``-th opportunity are disjoint from those of its other opportunities, so the run
    is ``ceil(n / partitions)`` adaptively composed Poisson-subsampled Gaussian
    mechanisms (Choquette-Choo et al. 2023, "Amplified BandMF", Thm. 4). With the noise
    calibrated to the largest column norm (``mf_gaussian_noise`` defaults) that is
    ``poisson(gaussian(noise_multiplier), sample_rate) * ceil(n / partitions)``; with one
    band it is DP-SGD's accounting.

    Args:
        noise_multiplier: as given to ``mf_gaussian_noise``.
        strategy: a banded strategy (``strategy.bands <= partitions``).
        sample_rate: the per-group Poisson rate (``expected_batch_size * partitions / N``).
        partitions: number of groups (default: ``strategy.bands``).
        n_steps: horizon for strategies built without one.
        noise_sensitivity: the sensitivity the noise was scaled by (default: the largest
            column norm, ``strategy.sensitivity()``).

    Privacy contract: add-or-remove-one neighbours, with independent keyed group
    assignment (as the sampler does).
    """
    nm = _noise_multiplier(noise_multiplier, "poisson")
    n = _horizon(strategy, n_steps, "poisson")
    b = _check_banded(strategy, partitions, "poisson", "partitions")
    per_participation = float(strategy.column_norms(n).max())
    noise_sens = strategy.sensitivity(n=n) if noise_sensitivity is None else check.positive(noise_sensitivity, "noise_sensitivity", "poisson")
    step = _dpsgd.poisson(_dpsgd.gaussian(nm * noise_sens / per_participation), check.probability(sample_rate, "sample_rate", "poisson"))
    return step * (-(-n // b))


@typechecked
def poisson_steps(
    noise_multiplier: Real,
    strategy: Strategy,
    sample_rate: Real,
    *,
    partitions: Integral | None = None,
    n_steps: Integral | None = None,
    noise_sensitivity: Real | None = None,
) -> list[DpProcess]:
    """Per-step increments of :func:`poisson`: step ``t`` costs one subsampled Gaussian when ``t % partitions == 0``.

    After ``t`` steps the worst-placed example (group 0) has had ``ceil(t / partitions)``
    opportunities; the composition of the first ``t`` increments is exactly that.

    Example:
        >>> from opake_fx.dpftrl import band_mf_strategy
        >>> steps = poisson_steps(1.0, band_mf_strategy(8, 4, max_iterations=5), 0.1)
        >>> [repr(s) == "identity()" for s in steps[:4]]
        [False, True, True, True]
    """
    whole = poisson(noise_multiplier, strategy, sample_rate, partitions=partitions, n_steps=n_steps, noise_sensitivity=noise_sensitivity)
    n = _horizon(strategy, n_steps, "poisson_steps")
    b = _check_banded(strategy, partitions, "poisson_steps", "partitions")
    one = whole._components()[0][0]
    return [one if t % b == 0 else identity() for t in range(n)]


@typechecked
def b_min_sep(
    noise_multiplier: Real,
    strategy: Strategy,
    sample_rate: Real,
    min_sep: Integral,
    *,
    warm_start: bool = False,
    n_steps: Integral | None = None,
    noise_sensitivity: Real | None = None,
    num_samples: Integral = 100_000,
    key: RngKey | None = None,
    confidence: Real = 0.99,
) -> DpProcess:
    """A banded strategy under b-min-sep sampling (:class:`~opake_fx.dpftrl.sampling.MinSepSampler`).

    An available example participates with probability ``sample_rate`` and then rests
    ``min_sep - 1`` steps. Exact for ``min_sep = 1`` with one band (Poisson sampling:
    DP-SGD's accounting); otherwise a :class:`MonteCarloProcess` (needs
    ``strategy.bands <= min_sep`` and ``C^T C >= 0``).

    Args:
        noise_multiplier, strategy: as for ``mf_gaussian_noise``.
        sample_rate: ``p`` in (0, 1).
        min_sep: ``b``.
        warm_start: the sampler starts in its stationary state.
        num_samples: Monte-Carlo draws per direction (certifying ``delta`` needs about
            ``10 / delta`` of them).
        key: the Monte-Carlo key (required when Monte Carlo is used).
        confidence: probability that the reported bounds hold.
    """
    nm = _noise_multiplier(noise_multiplier, "b_min_sep")
    n = _horizon(strategy, n_steps, "b_min_sep")
    b = _check_banded(strategy, min_sep, "b_min_sep", "min_sep")
    p = check.probability(sample_rate, "sample_rate", "b_min_sep")
    noise_sens = strategy.sensitivity(n=n) if noise_sensitivity is None else check.positive(noise_sensitivity, "noise_sensitivity", "b_min_sep")
    if b == 1:
        per_step = float(strategy.column_norms(n).max())
        return _dpsgd.poisson(_dpsgd.gaussian(nm * noise_sens / per_step), p) * n
    if not 0.0 < p < 1.0:
        raise InputValueError(f"b_min_sep: sample_rate must be in (0, 1) for min_sep > 1; got {p}.")
    band = _band_of(strategy, n)
    _check_nonnegative_gram(strategy.materialize(n), "b_min_sep")
    spec = (n, band.shape[1], p, b, bool(warm_start), tuple(band.reshape(-1).tolist()))
    samples, level = _monte_carlo_settings(num_samples, confidence, "b_min_sep")
    return MonteCarloProcess("b_min_sep", spec, nm * noise_sens, samples, _key_words(key, "b_min_sep"), level)


@typechecked
def balls_in_bins(
    noise_multiplier: Real,
    strategy: Strategy,
    cycle_length: Integral,
    *,
    n_steps: Integral | None = None,
    noise_sensitivity: Real | None = None,
    num_samples: Integral = 100_000,
    key: RngKey | None = None,
    confidence: Real = 0.99,
) -> DpProcess:
    """Any strategy under balls-in-bins sampling (:class:`~opake_fx.dpftrl.sampling.BallsInBinsSampler`).

    Each example gets a uniformly random bin ``J < cycle_length`` and participates at
    steps ``J, J + cycle_length, ...``. Exact for ``cycle_length = 1`` (every example in
    every step: a Gaussian mechanism with sensitivity ``||C 1||``); otherwise a
    :class:`MonteCarloProcess` (needs ``C^T C >= 0``).

    Args:
        noise_multiplier, strategy: as for ``mf_gaussian_noise``.
        cycle_length: number of bins ``b``.
        num_samples, key, confidence: see :func:`b_min_sep`.
    """
    nm = _noise_multiplier(noise_multiplier, "balls_in_bins")
    n = _horizon(strategy, n_steps, "balls_in_bins")
    b = check.integer(cycle_length, "cycle_length", "balls_in_bins", minimum=1)
    if b > n:
        raise InputValueError(f"balls_in_bins: cycle_length={b} exceeds n_steps={n}: some bins would never be used.")
    noise_sens = strategy.sensitivity(n=n) if noise_sensitivity is None else check.positive(noise_sensitivity, "noise_sensitivity", "balls_in_bins")
    if b == 1:
        # Every example in every step: the Gaussian mechanism with the all-steps sensitivity
        # (||C 1|| when C^T C >= 0, an upper bound otherwise).
        return _dpsgd.gaussian(nm * noise_sens / strategy.sensitivity(1, None, n=n))
    c = strategy.materialize(n)
    gram = _bin_gram(c, b)
    _check_nonnegative_gram(c, "balls_in_bins")
    spec = (b, tuple(gram.reshape(-1).tolist()))
    samples, level = _monte_carlo_settings(num_samples, confidence, "balls_in_bins")
    return MonteCarloProcess("balls_in_bins", spec, nm * noise_sens, samples, _key_words(key, "balls_in_bins"), level)


@typechecked
def prefix_epsilons(steps: Iterable[DpProcess], delta: Real) -> list[float]:
    """Epsilon after each step of a prefix-accounted run (``steps`` from ``*_steps``).

    Example:
        >>> from opake_fx.dpftrl import identity_strategy
        >>> eps = prefix_epsilons(mf_gaussian_steps(4.0, identity_strategy(3), 1, None), 1e-5)
        >>> eps[0] < eps[1] < eps[2]
        True
    """
    from opake_fx.accounting import compose

    out, spent = [], identity()
    for s in steps:
        spent = compose(spent, s)
        out.append(spent.epsilon_at(delta))
    return out


# ------------------------------------------------------------------ Monte Carlo


@dataclass(frozen=True)
class MonteCarloProcess(DpProcess):
    """A whole DP-FTRL run accounted by Monte Carlo (see :mod:`opake_fx.dpftrl._monte_carlo`).

    ``epsilon_at`` / ``delta_at`` are upper bounds that hold with probability at least
    ``confidence`` over the process's own draws (a function of ``key``, so every call
    and every machine reports the same numbers). :meth:`delta_estimate` gives the point
    estimate with a two-sided interval. Such a process cannot be composed: account for
    the whole run in one process.

    Attributes:
        sampler: ``"balls_in_bins"`` or ``"b_min_sep"``.
        spec: the sampler's parameters and the strategy's numbers (hashable).
        noise_std: std of ``z`` in units of the clip norm.
        num_samples: draws per direction.
        key: the Monte-Carlo key words.
        confidence: the probability that the bounds hold.
    """

    sampler: str
    spec: tuple
    noise_std: float
    num_samples: int
    key: tuple[int, int]
    confidence: float
    _TYPE: ClassVar[str] = "dpftrl_monte_carlo"

    @property
    def neighboring_relation(self) -> str | None:
        return ADD_OR_REMOVE_ONE

    def _losses(self) -> tuple[np.ndarray, np.ndarray]:
        return _mc.sample_losses(self.sampler, self.spec, self.noise_std, self.num_samples, tuple(self.key))

    def _upper(self, epsilon: float) -> float:
        alpha = (1.0 - self.confidence) / 2.0
        p_loss, q_loss = self._losses()
        remove = _mc.kl_upper(_mc.hockey_stick(p_loss, epsilon, 1.0), self.num_samples, alpha)
        add = _mc.kl_upper(_mc.hockey_stick(q_loss, epsilon, -1.0), self.num_samples, alpha)
        return max(remove, add)

    def delta_at(self, epsilon: float, *, accountant: str = "pld", discretization: float = 1e-4) -> float:
        """Upper bound on delta at ``epsilon`` (holds with probability ``confidence``)."""
        _monte_carlo_only(accountant)
        return self._upper(float(epsilon))

    def epsilon_at(self, delta: float, *, accountant: str = "pld", discretization: float = 1e-4) -> float:
        """Upper bound on epsilon at ``delta`` (holds with probability ``confidence``); ``inf`` if not certifiable."""
        _monte_carlo_only(accountant)
        if not 0.0 < delta < 1.0:
            raise InputValueError(f"epsilon_at: delta must be in (0, 1); got {delta}.")
        if self._upper(0.0) <= delta:
            return 0.0
        hi = 1.0
        while self._upper(hi) > delta:
            hi *= 2.0
            if hi > 1e4:
                return math.inf
        lo = 0.0
        for _ in range(60):
            mid = (lo + hi) / 2.0
            if self._upper(mid) <= delta:
                hi = mid
            else:
                lo = mid
            if hi - lo <= 1e-6 * max(1.0, hi):
                break
        return hi

    def delta_estimate(self, epsilon: float) -> MonteCarloEstimate:
        """Point estimate and two-sided ``confidence`` interval of delta at ``epsilon`` (worse direction)."""
        alpha = (1.0 - self.confidence) / 4.0  # two sides, two directions
        p_loss, q_loss = self._losses()
        rem = _mc.hockey_stick(p_loss, float(epsilon), 1.0)
        add = _mc.hockey_stick(q_loss, float(epsilon), -1.0)
        n = self.num_samples
        return MonteCarloEstimate(
            epsilon=float(epsilon),
            estimate=max(rem, add),
            lower=max(_mc.kl_lower(rem, n, alpha), _mc.kl_lower(add, n, alpha)),
            upper=max(_mc.kl_upper(rem, n, alpha), _mc.kl_upper(add, n, alpha)),
            confidence=self.confidence,
            num_samples=n,
        )

    def advantage(self, *, accountant: str = "pld", discretization: float = 1e-4) -> float:
        return self.delta_at(0.0, accountant=accountant)

    def _directions(self) -> tuple[Any, ...]:
        raise InputValueError(
            "A Monte-Carlo DP-FTRL process cannot be composed with other processes or repeated (its bound "
            "holds for the whole run at a confidence level, not as a privacy curve). Account for the whole "
            "run, including every other release, in one process, or use mf_gaussian / poisson."
        )

    def _fields(self) -> dict[str, Any]:
        return {
            "sampler": self.sampler,
            "spec": _to_lists(self.spec),
            "noise_std": self.noise_std,
            "num_samples": self.num_samples,
            "key": list(self.key),
            "confidence": self.confidence,
        }

    @classmethod
    def _from_fields(cls, data: dict[str, Any]) -> DpProcess:
        return cls(data["sampler"], _to_tuples(data["spec"]), data["noise_std"], data["num_samples"], tuple(data["key"]), data["confidence"])

    def __repr__(self) -> str:
        return (
            f"MonteCarloProcess({self.sampler}, noise_std={self.noise_std:.4g}, num_samples={self.num_samples}, "
            f"confidence={self.confidence})"
        )


# ------------------------------------------------------------------- helpers


def _prefix_sensitivities(strategy: Strategy, n: int, min_sep: int, k: int | None) -> list[float]:
    if isinstance(strategy, ToeplitzLike):
        c = strategy.toeplitz_coefficients(n)
        if strategy.bands is not None:
            c = c[: strategy.bands]
        return [_sens.toeplitz_sensitivity(c[:t], t, min_sep, k)[0] for t in range(1, n + 1)]
    bands = strategy.bands
    if bands is not None and (bands <= min_sep or _sens.max_participations_of(n, min_sep, k) == 1):
        c = strategy.materialize(n)
        out = []
        for t in range(1, n + 1):
            col2 = (c[:t, :t] ** 2).sum(0)
            out.append(_sens.banded_sensitivity(col2, min_sep, k))
        return out
    if n <= 256:
        return [strategy.sensitivity(min_sep, k, n=t) for t in range(1, n + 1)]
    return [strategy.sensitivity(min_sep, k, n=n)] * n


def _bin_gram(c: torch.Tensor, b: int) -> np.ndarray:
    n = c.shape[0]
    u = torch.zeros(n, b, dtype=torch.float64)
    u[torch.arange(n), torch.arange(n) % b] = 1.0
    m = c @ u  # column j: C u_j
    return (m.T @ m).numpy()


def _band_of(strategy: Strategy, n: int) -> np.ndarray:
    c = strategy.materialize(n)
    bands = _sens.bandwidth(c)
    band = np.zeros((n, bands))
    for j in range(bands):
        band[: n - j, j] = torch.diagonal(c, -j).numpy()
    return band


def _check_banded(strategy: Strategy, sep: int | None, where: str, name: str) -> int:
    if not isinstance(strategy, Strategy):
        raise InputTypeError(f"{where}: expected a Strategy; got {type(strategy).__name__}.")
    bands = strategy.bands
    if bands is None:
        raise InputValueError(
            f"{where}: {strategy!r} is not banded, so participations {name} apart share rows of C and the "
            "amplification reduction does not apply. Use a banded strategy (band_mf_strategy, bsr_strategy) or "
            "account without amplification with mf_gaussian."
        )
    b = bands if sep is None else check.integer(sep, name, where, minimum=1)
    if bands > b:
        raise InputValueError(
            f"{where}: the strategy has {bands} bands but {name}={b}; the reduction needs bands <= {name}. Build "
            f"the strategy with bands={b} (or fewer), or use {name}={bands}."
        )
    return b


def _check_nonnegative_gram(c: torch.Tensor, where: str) -> None:
    x = c.T @ c
    if float(x.min()) < -1e-12 * float(x.abs().max()):
        raise InputValueError(
            f"{where}: C^T C has negative entries (min {float(x.min()):.3g}); the Monte-Carlo reduction assumes "
            "aligned gradients are the worst case, which needs C^T C >= 0. Use a strategy with non-negative bands."
        )


def _horizon(strategy: Strategy, n_steps: int | None, where: str) -> int:
    if not isinstance(strategy, Strategy):
        raise InputTypeError(f"{where}: expected a Strategy; got {type(strategy).__name__}.")
    n = strategy.n_steps if strategy.n_steps is not None else n_steps
    if n is None:
        raise InputValueError(f"{where}: {strategy!r} has no n_steps; pass n_steps= (the length of the run).")
    return check.integer(n, "n_steps", where, minimum=1)


def _monte_carlo_settings(num_samples: Any, confidence: Any, where: str) -> tuple[int, float]:
    samples = check.integer(num_samples, "num_samples", where, minimum=1)
    level = check.interval(confidence, "confidence", where, 0.0, 1.0, low_open=True, high_open=True)
    return samples, level


def _noise_multiplier(nm: Any, where: str) -> float:
    return check.positive(nm, "noise_multiplier", where)


def _key_words(key: RngKey | None, where: str) -> tuple[int, int]:
    if not isinstance(key, RngKey):
        raise InputTypeError(
            f"{where}: this configuration is accounted by Monte Carlo, which needs key=opake_fx.random.key(seed) "
            f"(the estimate is a function of the key, so it is reproducible); got {type(key).__name__}."
        )
    return key.words


def _monte_carlo_only(accountant: str) -> None:
    if accountant not in ("pld", "monte_carlo"):
        raise InputValueError(f"A Monte-Carlo process has no {accountant!r} curve; call it without accountant=.")


def _to_lists(x: Any) -> Any:
    return [_to_lists(v) for v in x] if isinstance(x, tuple) else x


def _to_tuples(x: Any) -> Any:
    return tuple(_to_tuples(v) for v in x) if isinstance(x, list) else x


_ = process_from_dict  # MonteCarloProcess registers itself for process_from_dict
