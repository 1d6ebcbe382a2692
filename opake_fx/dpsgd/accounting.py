"""DP-SGD mechanisms as DpProcess values (numpy/scipy only; no torch).

Each factory returns one training step; compose steps with ``* steps`` and ``|``:

    >>> import opake_fx.dpsgd.accounting as dpsgd_acc
    >>> step = dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), 64 / 10_000)
    >>> round((step * 500).epsilon_at(1e-5), 4)
    0.8246

Units: a *noise multiplier* is noise std / L2 sensitivity (the clipping norm C for a
sum of clipped per-example gradients under add-or-remove neighbours), a Laplace *scale*
is noise scale / L1 sensitivity. Metrics, budgets, calibration and the Accountant live
in :mod:`opake_fx.accounting`.
"""

from __future__ import annotations

import math
from numbers import Integral, Real

from opake_fx._typecheck import typechecked
import opake_fx.validation as check
from opake_fx.accounting.mechanisms import (
    AdaptiveClippingGaussian,
    Gaussian,
    Laplace,
    PoissonSampled,
    SampledWithoutReplacement,
    TruncatedPoissonSampled,
    check_step,
    subsample_trivial,
)
from opake_fx.accounting.process import DpProcess
from opake_fx.errors import InputValueError

__all__ = [
    "gaussian",
    "laplace",
    "poisson",
    "truncated_poisson",
    "sampled_without_replacement",
    "adaptive_clipping_gaussian",
    "adaptive_clipping_noise_multiplier",
]


@typechecked
def gaussian(noise_multiplier: Real) -> DpProcess:
    """One release of a sum with Gaussian noise of std ``noise_multiplier * C``.

    Privacy contract: add-or-remove neighbours, L2 sensitivity C (the clipping norm of
    a sum of clipped per-example gradients). Exactly mu-GDP with mu = 1/noise_multiplier;
    compositions of Gaussian steps are answered in closed form.

    Args:
        noise_multiplier: noise std / sensitivity, > 0.

    Example:
        >>> round(gaussian(1.0).epsilon_at(1e-5), 4)
        4.3772
    """
    return Gaussian(noise_multiplier)


@typechecked
def laplace(scale: Real) -> DpProcess:
    """One release of a query with Laplace noise of scale ``scale * C1``.

    Privacy contract: add-or-remove neighbours, L1 sensitivity C1; (1/scale)-DP.

    Example:
        >>> laplace(1.0).epsilon_at(1e-5) <= 1.0
        True
    """
    return Laplace(scale)


@typechecked
def poisson(inner: DpProcess, sample_rate: Real) -> DpProcess:
    """``inner`` applied to a Poisson sample (each example kept independently w.p. ``sample_rate``).

    Privacy contract: add-or-remove neighbours; amplification by subsampling for the
    dominating pairs ``(qP + (1-q)Q, Q)`` and ``(Q, qP + (1-q)Q)``, the worse of the two
    reported after composition. It requires the sampler to really be Poisson with this
    rate (e.g. ``opake_fx.dpsgd.sampling.PoissonSampler``) and the noise to be calibrated to
    the clipping norm of one example.

    Args:
        inner: one un-subsampled step: ``gaussian``, ``laplace``,
            ``adaptive_clipping_gaussian`` or ``eps_delta`` (``identity()`` gives identity).
        sample_rate: in [0, 1]; 1 means no subsampling (returns ``inner``), 0 returns identity.

    Raises:
        InputValueError: ``inner`` is already subsampled or multi-step (that would
            understate epsilon), or ``sample_rate`` is outside [0, 1].

    Example:
        >>> step = poisson(gaussian(1.1), 256 / 60_000)
        >>> round((step * 2340).epsilon_at(1e-5), 2)
        0.92
    """
    _check_inner(inner, "poisson")
    q = check.unit_interval(sample_rate, "sample_rate", "poisson", "It is the probability that an example is in a batch.")
    trivial = subsample_trivial(inner, q)
    if trivial is not None:
        return trivial
    check_step(inner, "poisson")
    return inner if q == 1.0 else PoissonSampled(inner, q)


@typechecked
def truncated_poisson(inner: DpProcess, sample_rate: Real, dataset_size: Integral, max_batch_size: Integral) -> DpProcess:
    """Poisson sampling whose batches are cut to ``max_batch_size`` by a uniformly random subset.

    Matches ``opake_fx.dpsgd.sampling.TruncatedPoissonSampler``. Never more private than
    ``poisson(inner, sample_rate)``; equal to it when truncation is impossible.

    Privacy contract: add-or-remove neighbours; the bound of Ganesh et al. 2025 as
    implemented by dp_accounting (see :class:`~opake_fx.accounting.TruncatedPoissonSampled`).

    Args:
        inner: ``gaussian(z)`` or ``adaptive_clipping_gaussian(...)``.
        sample_rate: in [0, 1] (0 returns identity).
        dataset_size: number of examples n >= 1.
        max_batch_size: the cap B >= 1.

    Example:
        >>> step = truncated_poisson(gaussian(1.0), 0.01, dataset_size=10_000, max_batch_size=120)
        >>> (step * 100).epsilon_at(1e-5) >= (poisson(gaussian(1.0), 0.01) * 100).epsilon_at(1e-5)
        True
    """
    _check_inner(inner, "truncated_poisson")
    q = check.unit_interval(sample_rate, "sample_rate", "truncated_poisson")
    trivial = subsample_trivial(inner, q)
    if trivial is not None:
        return trivial
    return TruncatedPoissonSampled(inner, q, dataset_size, max_batch_size)


@typechecked
def sampled_without_replacement(inner: DpProcess, dataset_size: Integral, batch_size: Integral) -> DpProcess:
    """``inner`` applied to a uniformly random batch of exactly ``batch_size`` examples.

    Privacy contract: *replace-one* neighbours (datasets of equal size differing in one
    example), under which a Gaussian step has twice its add/remove sensitivity. Uses the
    subsampling theorem of Dong, Roth and Su 2022 (Thm. 9). Cannot be composed with
    add-or-remove processes.

    Args:
        inner: ``gaussian(z)``, ``adaptive_clipping_gaussian(...)`` or ``laplace(b)``.
        dataset_size: n >= 1.
        batch_size: 1 <= b <= n.

    Example:
        >>> swor = sampled_without_replacement(gaussian(1.0), 10_000, 100)
        >>> swor.neighboring_relation
        'replace_one'
    """
    _check_inner(inner, "sampled_without_replacement")
    return SampledWithoutReplacement(inner, dataset_size, batch_size)


@typechecked
def adaptive_clipping_gaussian(noise_multiplier: Real, count_noise_multiplier: Real) -> DpProcess:
    """One step of DP-SGD with adaptive clipping (Andrew et al. 2021, "Differentially
    Private Learning with Adaptive Clipping").

    Each step releases the noised gradient sum (noise ``noise_multiplier * C``) and the
    noised centred clipped count ``sum_i (1[||g_i|| <= C] - 1/2) + N(0, count_noise_multiplier^2)``.
    The centred count has sensitivity 1/2, so the pair is one Gaussian mechanism with
    effective noise multiplier ``(noise_multiplier^-2 + (2 count_noise_multiplier)^-2)^-1/2``
    (their Thm. 1). Wrap it in :func:`poisson` like a plain Gaussian step.

    Privacy contract: add-or-remove neighbours; valid only if the count is centred
    (``- 1/2`` per example) and noised with std ``count_noise_multiplier`` in count units,
    as ``opake_fx.dpsgd.clipping.adaptive_clipped_grad`` does. Without centring the count
    has sensitivity 1: pass ``count_noise_multiplier / 2`` instead.

    Example:
        >>> p = adaptive_clipping_gaussian(1.0, 10.0)
        >>> round(p.effective_noise_multiplier, 5)
        0.99875
    """
    return AdaptiveClippingGaussian(noise_multiplier, count_noise_multiplier)


@typechecked
def adaptive_clipping_noise_multiplier(effective_noise_multiplier: Real, count_noise_multiplier: Real) -> float:
    """The gradient noise multiplier that keeps adaptive clipping at a target effective one.

    Solves ``(z^-2 + (2 sigma_b)^-2)^-1/2 = effective_noise_multiplier`` for ``z``:
    calibrate ``gaussian(z_eff)`` first, then noise the gradients with the returned ``z``.

    Raises:
        InputValueError: ``2 * count_noise_multiplier <= effective_noise_multiplier``
            (the count alone would already spend the whole budget).

    Example:
        >>> round(adaptive_clipping_noise_multiplier(1.0, 10.0), 5)
        1.00125
    """
    z_eff = check.positive(effective_noise_multiplier, "effective_noise_multiplier", "adaptive_clipping_noise_multiplier")
    sb = check.positive(count_noise_multiplier, "count_noise_multiplier", "adaptive_clipping_noise_multiplier")
    rest = z_eff**-2 - (2.0 * sb) ** -2
    if rest <= 0:
        raise InputValueError(
            f"adaptive_clipping_noise_multiplier: the count noise ({sb}) is too small for an effective noise "
            f"multiplier of {z_eff}: the count release alone spends the budget. Use count_noise_multiplier > "
            f"{z_eff / 2:g} (Andrew et al. suggest about expected_batch_size / 20)."
        )
    return 1.0 / math.sqrt(rest)


def _check_inner(inner: object, where: str) -> None:
    if not isinstance(inner, DpProcess):
        from opake_fx.errors import InputTypeError

        raise InputTypeError(f"{where}: inner must be a DpProcess such as gaussian(1.0); got {type(inner).__name__}.")
