"""The single-step mechanisms the engines know (numpy/scipy only).

Users build these through the factories in :mod:`opake_fx.dpsgd.accounting`
(``gaussian``, ``poisson``, ...) and :func:`eps_delta` here; the classes are public for
``isinstance`` checks and serialisation. Each one provides

* ``_directions()``: the exact hockey-stick curve(s) of its dominating pair(s) and their
  loss ranges, which the PLD engine discretises (one curve: symmetric; two: the
  'remove' and 'add' pairs of add-or-remove neighbours);
* ``_rdp(orders)``: its RDP curve, where one is implemented;
* ``_gaussian_mu()``: ``mu`` when the step is exactly a Gaussian mechanism (closed form).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from numbers import Real
from typing import Any, ClassVar

import numpy as np
from scipy import stats

from opake_fx._typecheck import typechecked
from opake_fx.accounting import _curves
import opake_fx.validation as check
from opake_fx.accounting import rdp as _rdp
from opake_fx.accounting.process import (
    ADD_OR_REMOVE_ONE,
    REPLACE_ONE,
    DpProcess,
    Identity,
    NonPrivate,
    identity,
    process_from_dict,
)
from opake_fx.errors import InputTypeError, InputValueError

__all__ = [
    "Gaussian",
    "AdaptiveClippingGaussian",
    "Laplace",
    "EpsDelta",
    "PoissonSampled",
    "TruncatedPoissonSampled",
    "SampledWithoutReplacement",
    "eps_delta",
    "check_step",
    "subsample_trivial",
]


class _Mechanism(DpProcess):
    """Base of the mechanisms here: serialised as their dataclass fields, in order.

    An ``inner`` field (the step a sampling wraps) is stored as its own ``to_dict()``.
    """

    __slots__ = ()

    def _fields(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        if "inner" in data:
            data["inner"] = data["inner"].to_dict()
        return data

    @classmethod
    def _from_fields(cls, data: dict[str, Any]) -> DpProcess:
        return cls(*(process_from_dict(data[f.name]) if f.name == "inner" else data[f.name] for f in fields(cls)))


class _Step(_Mechanism):
    """A single un-subsampled step that can be subsampled (base of the leaf mechanisms)."""

    __slots__ = ()

    def _pair(self) -> _curves.Pair:
        raise NotImplementedError

    def _replace_pair(self) -> _curves.Pair:
        """The dominating pair under replace-one (twice the add/remove sensitivity)."""
        raise InputValueError(f"{self!r} has no replace-one analysis; use a gaussian or laplace step.")

    def _directions(self) -> tuple[_curves.Direction, ...]:
        return (self._pair().direction(),)


class _GaussianLike(_Step):
    """A step that is exactly a Gaussian mechanism with some effective noise multiplier."""

    __slots__ = ()

    @property
    def effective_noise_multiplier(self) -> float:
        raise NotImplementedError

    @property
    def neighboring_relation(self) -> str | None:
        return ADD_OR_REMOVE_ONE

    def _pair(self) -> _curves.Pair:
        return _curves.GaussianPair(1.0 / self.effective_noise_multiplier)

    def _replace_pair(self) -> _curves.Pair:
        return _curves.GaussianPair(2.0 / self.effective_noise_multiplier)

    def _gaussian_mu(self) -> float | None:
        return 1.0 / self.effective_noise_multiplier

    def _rdp(self, orders: np.ndarray) -> np.ndarray:
        return _rdp.gaussian_rdp(self.effective_noise_multiplier, orders)


@dataclass(frozen=True)
class Gaussian(_GaussianLike):
    """The Gaussian mechanism: noise ``N(0, (noise_multiplier * C)^2)`` on a sum with L2 sensitivity C."""

    noise_multiplier: float
    _TYPE: ClassVar[str] = "gaussian"

    def __post_init__(self) -> None:
        z = check.positive(
            self.noise_multiplier, "noise_multiplier", "gaussian",
            "The noise multiplier is noise std / L2 sensitivity; a value <= 0 adds no noise (use nonprivate()).",
        )
        object.__setattr__(self, "noise_multiplier", z)

    @property
    def effective_noise_multiplier(self) -> float:
        return self.noise_multiplier


@dataclass(frozen=True)
class AdaptiveClippingGaussian(_GaussianLike):
    """One adaptive-clipping step (Andrew et al. 2021): gradient sum plus the noised clipped count.

    The gradient sum (sensitivity C, noise ``noise_multiplier * C``) and the centred count
    ``sum_i (1[||g_i|| <= C] - 1/2)`` (sensitivity 1/2, noise std ``count_noise_multiplier``)
    together form one Gaussian mechanism with effective noise multiplier
    ``(noise_multiplier^-2 + (2 count_noise_multiplier)^-2)^-1/2``.
    """

    noise_multiplier: float
    count_noise_multiplier: float
    _TYPE: ClassVar[str] = "adaptive_clipping_gaussian"

    def __post_init__(self) -> None:
        z = check.positive(self.noise_multiplier, "noise_multiplier", "adaptive_clipping_gaussian")
        sb = check.positive(
            self.count_noise_multiplier, "count_noise_multiplier", "adaptive_clipping_gaussian",
            "It is the std of the noise on the centred clipped count; a noiseless count is not private.",
        )
        object.__setattr__(self, "noise_multiplier", z)
        object.__setattr__(self, "count_noise_multiplier", sb)

    @property
    def effective_noise_multiplier(self) -> float:
        return (self.noise_multiplier**-2 + (2.0 * self.count_noise_multiplier) ** -2) ** -0.5


@dataclass(frozen=True)
class Laplace(_Step):
    """The Laplace mechanism: noise ``Lap(0, scale * C)`` on a query with L1 sensitivity C."""

    scale: float
    _TYPE: ClassVar[str] = "laplace"

    def __post_init__(self) -> None:
        b = check.positive(self.scale, "scale", "laplace", "The scale is the Laplace noise scale / L1 sensitivity.")
        object.__setattr__(self, "scale", b)

    @property
    def neighboring_relation(self) -> str | None:
        return ADD_OR_REMOVE_ONE

    def _pair(self) -> _curves.Pair:
        return _curves.LaplacePair(self.scale)

    def _replace_pair(self) -> _curves.Pair:
        return _curves.LaplacePair(self.scale / 2.0)

    def _rdp(self, orders: np.ndarray) -> np.ndarray:
        return _rdp.laplace_rdp(self.scale, orders)


@dataclass(frozen=True)
class EpsDelta(_Step):
    """A black-box (epsilon, delta)-DP mechanism, accounted through its canonical PLD."""

    epsilon: float
    delta: float
    _TYPE: ClassVar[str] = "eps_delta"

    def __post_init__(self) -> None:
        e = check.non_negative(self.epsilon, "epsilon", "eps_delta", "Pass the mechanism's epsilon (>= 0).")
        d = check.real(self.delta, "delta", "eps_delta")
        if not 0.0 <= d < 1.0:
            raise InputValueError(f"eps_delta: delta must be in [0, 1); got {d}.")
        object.__setattr__(self, "epsilon", e)
        object.__setattr__(self, "delta", d)

    def _pair(self) -> _curves.Pair:
        return _curves.EpsDeltaPair(self.epsilon, self.delta)

    def _rdp(self, orders: np.ndarray) -> np.ndarray:
        if self.delta > 0:
            raise InputValueError(
                f"{self!r}: an (epsilon, delta > 0) guarantee has no RDP curve; use accountant='pld'."
            )
        return _rdp.pure_dp_rdp(self.epsilon, orders)


@dataclass(frozen=True)
class PoissonSampled(_Mechanism):
    """``inner`` applied to a Poisson sample: each example included independently w.p. ``sample_rate``.

    Dominating pairs (add-or-remove): remove ``(qP + (1-q)Q, Q)`` and add
    ``(Q, qP + (1-q)Q)``, with ``(P, Q)`` the pair of ``inner``.
    """

    inner: DpProcess
    sample_rate: float
    _TYPE: ClassVar[str] = "poisson"

    def __post_init__(self) -> None:
        check_step(self.inner, "poisson")
        q = check.real(self.sample_rate, "sample_rate", "poisson")
        if not 0.0 < q < 1.0:
            raise InputValueError(f"PoissonSampled: sample_rate must be in (0, 1); got {q} (use the poisson() factory).")
        object.__setattr__(self, "sample_rate", q)

    @property
    def neighboring_relation(self) -> str | None:
        return ADD_OR_REMOVE_ONE

    def _directions(self) -> tuple[_curves.Direction, ...]:
        pair = self.inner._pair()  # type: ignore[attr-defined]
        return (_curves.poisson_remove(pair, self.sample_rate), _curves.poisson_add(pair, self.sample_rate))

    def _rdp(self, orders: np.ndarray) -> np.ndarray:
        if not isinstance(self.inner, _GaussianLike):
            raise InputValueError(
                f"The RDP accountant supports Poisson sampling of Gaussian steps only; got {self!r}. "
                "Use accountant='pld'."
            )
        return _rdp.poisson_gaussian_rdp(self.sample_rate, self.inner.effective_noise_multiplier, orders)


@dataclass(frozen=True)
class TruncatedPoissonSampled(_Mechanism):
    """Poisson sampling whose batches are cut to ``max_batch_size`` by a uniformly random subset.

    Bound (the analysis dp_accounting implements for its truncated-Poisson event, after
    Ganesh et al. 2025, "Tighter Privacy Analysis for Truncated Poisson Sampling"): with
    ``p_t = P[Binomial(n-1, q) >= B]`` the probability that the batch is truncated when the
    protected example is sampled, the step is dominated by the mixture
    ``(1 - p_t) * [Poisson-subsampled Gaussian(z, q)] + p_t * [replace-one
    Poisson-subsampled Gaussian(z / 2, q')]``, where
    ``q' = P[Binomial(n, q) > B] * B / (n * p_t)`` is the probability that the example is
    in the truncated batch given that truncation happens. Never tighter than plain Poisson.
    """

    inner: DpProcess
    sample_rate: float
    dataset_size: int
    max_batch_size: int
    _TYPE: ClassVar[str] = "truncated_poisson"

    def __post_init__(self) -> None:
        where = "truncated_poisson"
        if not isinstance(self.inner, _GaussianLike):
            raise InputValueError(
                f"{where}: the inner process must be gaussian(z) or adaptive_clipping_gaussian(...); "
                f"got {self.inner!r}. The truncation bound is derived for the Gaussian mechanism."
            )
        q = check.real(self.sample_rate, "sample_rate", where)
        if not 0.0 < q <= 1.0:
            raise InputValueError(f"{where}: sample_rate must be in (0, 1]; got {q}.")
        n = check.integer(self.dataset_size, "dataset_size", where, 1)
        b = check.integer(self.max_batch_size, "max_batch_size", where, 1)
        object.__setattr__(self, "sample_rate", q)
        object.__setattr__(self, "dataset_size", n)
        object.__setattr__(self, "max_batch_size", b)

    @property
    def neighboring_relation(self) -> str | None:
        return ADD_OR_REMOVE_ONE

    @property
    def truncation_probability(self) -> float:
        """``P[Binomial(n - 1, q) >= B]``: truncation happens when the example is sampled."""
        return float(stats.binom.sf(self.max_batch_size - 1, self.dataset_size - 1, self.sample_rate))

    def _directions(self) -> tuple[_curves.Direction, ...]:
        z = self.inner.effective_noise_multiplier  # type: ignore[attr-defined]
        q = self.sample_rate
        gauss = _curves.GaussianPair(1.0 / z)
        if q >= 1.0:
            plain = (gauss.direction(), gauss.direction())
        else:
            plain = (_curves.poisson_remove(gauss, q), _curves.poisson_add(gauss, q))
        p_t = self.truncation_probability
        if p_t <= 0.0:
            return plain
        n, b = self.dataset_size, self.max_batch_size
        q_cond = min(1.0, float(stats.binom.sf(b, n, q)) * b / (p_t * n))
        if q_cond <= 0.0:
            return plain
        branch = _curves.ReplaceGaussianPair(z / 2.0, q_cond).direction()
        return tuple(_curves.mixture(1.0 - p_t, d, branch) for d in plain)

    def _rdp(self, orders: np.ndarray) -> np.ndarray:
        if self.truncation_probability > 0.0:
            raise InputValueError(
                f"The RDP accountant has no curve for truncated Poisson sampling ({self!r}); "
                "use accountant='pld'."
            )
        z = self.inner.effective_noise_multiplier  # type: ignore[attr-defined]
        return _rdp.poisson_gaussian_rdp(self.sample_rate, z, orders)


@dataclass(frozen=True)
class SampledWithoutReplacement(_Mechanism):
    """``inner`` applied to a uniformly random batch of exactly ``batch_size`` of ``dataset_size``.

    Replace-one neighbours. If ``inner`` is f-DP under replace-one (a Gaussian step is
    ``G_{2/z}``: replacing an example moves the sum by up to 2C), the subsampled step is
    ``C_p(f) = min(f_p, f_p^-1)**``-DP with ``p = batch_size / dataset_size`` and
    ``f_p = p f + (1 - p) Id`` (Dong, Roth and Su 2022, Theorem 9). Its hockey-stick curve
    is the pointwise maximum of the curves of ``f_p`` and ``f_p^-1``, i.e. of the 'remove'
    and 'add' Poisson-style pairs built on the replace-one pair of ``inner``.
    """

    inner: DpProcess
    dataset_size: int
    batch_size: int
    _TYPE: ClassVar[str] = "sampled_without_replacement"

    def __post_init__(self) -> None:
        where = "sampled_without_replacement"
        if not isinstance(self.inner, _GaussianLike | Laplace):
            raise InputValueError(
                f"{where}: the inner process must be gaussian(z), adaptive_clipping_gaussian(...) or "
                f"laplace(b); got {self.inner!r}."
            )
        n = check.integer(self.dataset_size, "dataset_size", where, 1)
        b = check.integer(self.batch_size, "batch_size", where, 1)
        if b > n:
            raise InputValueError(f"{where}: batch_size ({b}) cannot exceed dataset_size ({n}).")
        object.__setattr__(self, "dataset_size", n)
        object.__setattr__(self, "batch_size", b)

    @property
    def sample_rate(self) -> float:
        return self.batch_size / self.dataset_size

    @property
    def neighboring_relation(self) -> str | None:
        return REPLACE_ONE

    def _directions(self) -> tuple[_curves.Direction, ...]:
        pair = self.inner._replace_pair()  # type: ignore[attr-defined]
        q = self.sample_rate
        if q >= 1.0:
            return (pair.direction(),)
        return (_curves.pointwise_max(_curves.poisson_remove(pair, q), _curves.poisson_add(pair, q)),)

    def _gaussian_mu(self) -> float | None:
        if self.batch_size == self.dataset_size and isinstance(self.inner, _GaussianLike):
            return 2.0 / self.inner.effective_noise_multiplier
        return None


@typechecked
def eps_delta(epsilon: Real, delta: Real = 0.0) -> DpProcess:
    """A mechanism known only to be (``epsilon``, ``delta``)-DP (e.g. a private hyper-parameter search).

    Privacy contract: composed through the canonical PLD of an (epsilon, delta)-DP
    mechanism (loss +inf w.p. delta, +/-epsilon otherwise, as dp_accounting), which is
    the worst case of any mechanism with that guarantee, under whatever neighbouring
    relation the guarantee was stated for.

    Args:
        epsilon: >= 0.
        delta: in [0, 1).

    Example:
        >>> import opake_fx.accounting as acc
        >>> acc.eps_delta(1.0, 1e-6).epsilon_at(1e-5) <= 1.0
        True
    """
    p = EpsDelta(epsilon, delta)
    return identity() if p.epsilon == 0.0 and p.delta == 0.0 else p


def check_step(inner: object, where: str) -> None:
    """Refuses anything but one un-subsampled step as the inner process of a subsampling.

    ``inner`` must be a single gaussian, laplace, adaptive_clipping_gaussian or eps_delta
    step; ``where`` names the caller in the error. Raises InputTypeError for a
    non-DpProcess and InputValueError for a composed, repeated, already subsampled,
    identity or non-private process: subsampling those would understate epsilon.
    """
    if not isinstance(inner, DpProcess):
        raise InputTypeError(f"{where}: inner must be a DpProcess (e.g. gaussian(1.0)); got {type(inner).__name__}.")
    if not isinstance(inner, _Step) or isinstance(inner, Identity | NonPrivate):
        raise InputValueError(
            f"{where}: the inner process must be one un-subsampled step (gaussian, laplace, "
            f"adaptive_clipping_gaussian or eps_delta); got {inner!r}. Subsampling an already "
            "subsampled or multi-step process would understate epsilon: write "
            "poisson(gaussian(z), q) * steps, not poisson(gaussian(z) * steps, q)."
        )


def subsample_trivial(inner: DpProcess, q: float) -> DpProcess | None:
    """The process of subsampling ``inner`` at rate ``q`` when it needs no mechanism, else None.

    ``q == 0`` or an identity ``inner`` give ``identity()``; a non-private ``inner`` gives
    ``NonPrivate()`` (pessimistic: a sampled non-private release is still unbounded).
    Callers build the subsampled mechanism only when this returns None.
    """
    if q == 0.0 or isinstance(inner, Identity):
        return identity()
    if isinstance(inner, NonPrivate):
        return NonPrivate()  # pessimistic: a sampled non-private release is still unbounded
    return None
