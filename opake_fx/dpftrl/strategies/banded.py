"""Banded strategies: identity, banded Toeplitz and column-normalised BandMF, BSR.

* :func:`identity_strategy` — ``C = I``: DP-SGD's independent noise.
* :func:`band_mf_strategy` — BandMF (Choquette-Choo et al. 2023, "(Amplified) Banded
  Matrix Factorization"; McKenna et al. 2024 for the Toeplitz version): a ``bands``-banded
  ``C`` optimised numerically for the mean or max error on a workload. Two structures:
  ``"toeplitz"`` (``bands`` coefficients, fast, within ~0.5% of the best banded matrix
  for long runs) and ``"column_normalized"`` (every entry of the band free, each column
  scaled to unit norm).
* :func:`bsr_strategy` — Banded Square Root (Kalinin and Lampert 2024): the first
  ``bandwidth`` diagonals of the square root of the workload, in closed form. With
  ``bandwidth = n`` it is the optimal-for-max-error square-root factorisation of
  prefix sums (Fichtenberger et al. 2023): ``C = B = A^{1/2}``.

Banded ``C`` with ``bands <= b`` have exact sensitivity under b-min-sep participation
and stream in ``bands - 1`` buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral
from typing import Any

import numpy as np
import torch

import opake_fx.validation as check
from opake_fx.dpftrl import _optim, _toeplitz
from opake_fx.dpftrl.strategies._base import (
    Reduction,
    Strategy,
    ToeplitzLike,
    check_n_steps,
    frozen,
    toeplitz_column,
)
from opake_fx.dpftrl.streaming import BandedSolve, IdentityInverse, StreamingInverse
from opake_fx.dpftrl.workloads import Workload, resolve_workload
from opake_fx.errors import InputValueError
from opake_fx.typing import typechecked

__all__ = [
    "IdentityStrategy",
    "ToeplitzStrategy",
    "BandedStrategy",
    "identity_strategy",
    "band_mf_strategy",
    "bsr_strategy",
    "matrix_to_band",
]


@dataclass(frozen=True, eq=False, repr=False)
class IdentityStrategy(ToeplitzLike):
    """``C = I`` (DP-SGD). ``n_steps`` may be None (any horizon)."""

    n_steps: int | None = None
    kind = "identity"

    @property
    def bands(self) -> int | None:
        return 1

    def coefficients(self) -> torch.Tensor:
        return torch.ones(1, dtype=torch.float64)

    def toeplitz_coefficients(self, n: int | None = None) -> torch.Tensor:
        return toeplitz_column(torch.ones(1, dtype=torch.float64), self._n(n))

    def inverse_toeplitz_coefficients(self, n: int | None = None) -> torch.Tensor:
        return self.toeplitz_coefficients(n)

    def inverse_noise(self) -> StreamingInverse:
        return IdentityInverse()

    @classmethod
    def _from_dict(cls, data: dict[str, Any]) -> IdentityStrategy:
        return cls(data.get("n_steps"))


@dataclass(frozen=True, eq=False, repr=False)
class ToeplitzStrategy(ToeplitzLike):
    """Lower-triangular Toeplitz ``C`` with first column ``coefs`` (banded when ``len(coefs) < n``).

    Attributes:
        n_steps: the horizon (None: any).
        coefs: ``C[t + j, t] = coefs[j]`` (read-only float64).
        name: how it was made (``"band_mf"``, ``"bsr"``, ...).
    """

    n_steps: int | None
    coefs: np.ndarray
    name: str = "toeplitz"
    kind = "toeplitz"

    def __post_init__(self) -> None:
        object.__setattr__(self, "coefs", frozen(self.coefs).reshape(-1))
        if self.coefs.size == 0 or self.coefs[0] == 0 or not np.all(np.isfinite(self.coefs)):
            raise InputValueError(
                "ToeplitzStrategy needs finite coefficients with coefs[0] != 0 (C must be invertible); "
                f"got {self.coefs[:4]}..."
            )
        if self.n_steps is not None and self.coefs.size > self.n_steps:
            object.__setattr__(self, "coefs", frozen(self.coefs[: self.n_steps]))

    @property
    def bands(self) -> int | None:
        if self.n_steps is not None and self.coefs.size >= self.n_steps:
            return None if self.coefs.size > 1 else 1
        return int(self.coefs.size)

    def coefficients(self) -> torch.Tensor:
        return torch.from_numpy(self.coefs.copy())

    def toeplitz_coefficients(self, n: int | None = None) -> torch.Tensor:
        return toeplitz_column(self.coefficients(), self._n(n))

    def inverse_noise(self) -> StreamingInverse:
        c = self.coefs
        return BandedSolve(np.array([c[0]]), (c[1:] / 1.0).reshape(1, -1) if c.size > 1 else np.zeros((1, 0)))

    @classmethod
    def _from_dict(cls, data: dict[str, Any]) -> ToeplitzStrategy:
        return cls(data["n_steps"], np.asarray(data["coefs"]), data.get("name", "toeplitz"))


@dataclass(frozen=True, eq=False, repr=False)
class BandedStrategy(Strategy):
    """A banded lower-triangular ``C`` given by its band: ``C[t + j, t] = band[t, j]``.

    Entries with ``t + j >= n`` are ignored (zero). Column-normalised BandMF has every
    column of unit norm, so its single-participation sensitivity is 1.

    Attributes:
        n_steps: ``n``.
        band: ``(n, bands)`` read-only float64.
        name: how it was made.
    """

    n_steps: int
    band: np.ndarray
    name: str = "banded"
    kind = "banded"

    def __post_init__(self) -> None:
        band = np.array(self.band, dtype=np.float64)
        if band.ndim != 2 or band.shape[0] != self.n_steps or band.shape[1] < 1:
            raise InputValueError(f"BandedStrategy needs a band of shape (n_steps, bands); got {band.shape}.")
        band[_invalid_mask(self.n_steps, band.shape[1])] = 0.0
        if np.any(band[:, 0] == 0) or not np.all(np.isfinite(band)):
            raise InputValueError("BandedStrategy needs a finite band with a non-zero diagonal (C must be invertible).")
        object.__setattr__(self, "band", frozen(band))

    @property
    def bands(self) -> int | None:
        return int(self.band.shape[1])

    def coefficients(self) -> torch.Tensor:
        return torch.from_numpy(self.band.copy())

    def materialize(self, n: int | None = None) -> torch.Tensor:
        n = self._n(n)
        full = _band_to_matrix(torch.from_numpy(self.band.copy()))
        return full[:n, :n]

    def column_norms(self, n: int | None = None) -> torch.Tensor:
        n = self._n(n)
        if n == self.n_steps:
            return torch.from_numpy(self.band.copy()).norm(dim=1)
        return super().column_norms(n)

    def inverse_noise(self) -> StreamingInverse:
        n, b = self.band.shape
        lower = np.zeros((n, b - 1))
        for j in range(1, b):
            lower[j:, j - 1] = self.band[: n - j, j]  # C[t, t-j] = band[t-j, j]
        return BandedSolve(self.band[:, 0].copy(), lower)

    def per_query_error(self, workload: Workload | None = None, *, n: int | None = None) -> torch.Tensor:
        n = self._n(n, workload)
        if n != self.n_steps:
            return super().per_query_error(workload, n=n)
        a = resolve_workload(workload, n, "per_query_error")
        with torch.no_grad():
            bt = _BandedRightSolve.apply(torch.from_numpy(self.band.copy()), a.materialize().T.contiguous())
        return (bt * bt).sum(dim=0)

    @classmethod
    def _from_dict(cls, data: dict[str, Any]) -> BandedStrategy:
        return cls(data["n_steps"], np.asarray(data["band"]), data.get("name", "banded"))


# ------------------------------------------------------------------ factories


@typechecked
def identity_strategy(n_steps: Integral | None = None) -> IdentityStrategy:
    """``C = I``: independent noise at every step, i.e. DP-SGD.

    Privacy: each step is the Gaussian mechanism; the sensitivity under b-min-sep
    participation is ``sqrt(k)``.

    Example:
        >>> s = identity_strategy(64)
        >>> s.expected_error(), s.expected_error(reduction="max")
        (32.5, 64.0)
    """
    return IdentityStrategy(check_n_steps(n_steps, "identity_strategy", allow_none=True))


# structure and reduction are hinted str (not the Literals): another string is a wrong
# value, reported as an InputValueError by the checks in the body.
@typechecked
def band_mf_strategy(
    n_steps: Integral,
    bands: Integral,
    *,
    workload: Workload | None = None,
    structure: str = "toeplitz",
    reduction: str = "mean",
    max_iterations: Integral = 250,
    progress: bool | None = None,
) -> Strategy:
    """BandMF: a ``bands``-banded ``C`` optimised for the workload's mean or max error.

    Minimises ``reduction(||B[t]||^2) * sens(C)^2`` (single participation) with
    L-BFGS in float64 from the banded square root. With ``bands <= min_sep`` of the
    sampler the same ``C`` is optimal under b-min-sep participation (the sensitivity
    only gains a factor ``sqrt(k)``), and cyclic Poisson sampling with ``bands``
    partitions amplifies it like DP-SGD (:func:`opake_fx.dpftrl.accounting.poisson`).

    Args:
        n_steps: the number of training steps ``n``.
        bands: number of non-zero diagonals of ``C`` (1 is DP-SGD up to scaling).
        workload: what the noise is evaluated on (default: prefix sums).
        structure: ``"toeplitz"`` (``bands`` free coefficients; normalised to unit
            sensitivity) or ``"column_normalized"`` (every band entry free, unit columns;
            initialised from the optimised Toeplitz one).
        reduction: ``"mean"`` or ``"max"`` squared error over steps.
        max_iterations: L-BFGS iterations (per stage).
        progress: show a progress bar (default: for long runs on a terminal).

    Returns:
        A :class:`ToeplitzStrategy` or :class:`BandedStrategy`.

    Privacy: a strategy only shapes the noise; see :class:`Strategy`.

    Example:
        >>> s = band_mf_strategy(64, bands=64)
        >>> s.expected_error() <= 4.75
        True
    """
    n = check_n_steps(n_steps, "band_mf_strategy")
    b = check.integer(bands, "bands", "band_mf_strategy", minimum=1)
    if b > n:
        raise InputValueError(f"band_mf_strategy: bands={b} exceeds n_steps={n}; use bands <= n_steps.")
    work = resolve_workload(workload, n, "band_mf_strategy")
    if structure not in ("toeplitz", "column_normalized"):
        raise InputValueError(f"band_mf_strategy: structure must be 'toeplitz' or 'column_normalized'; got {structure!r}.")
    check.choice(reduction, "reduction", "band_mf_strategy", ("mean", "max"))
    show = _optim.show_progress(progress, n)
    coefs = optimize_toeplitz(work, b, reduction=reduction, max_iterations=max_iterations, progress=show)
    if structure == "toeplitz":
        return ToeplitzStrategy(n, coefs.numpy(), name="band_mf")
    band = optimize_column_normalized(work, coefs, reduction=reduction, max_iterations=max_iterations, progress=show)
    return BandedStrategy(n, band.numpy(), name="band_mf")


@typechecked
def bsr_strategy(n_steps: Integral, bandwidth: Integral, *, workload: Workload | None = None) -> Strategy:
    """Banded Square Root (Kalinin and Lampert 2024): ``C`` = the first ``bandwidth`` diagonals of ``A^{1/2}``.

    Closed form, no optimisation. For a Toeplitz workload (prefix sums, momentum with
    a constant learning rate) ``C`` is Toeplitz with the first ``bandwidth`` power-series
    coefficients of ``sqrt(a(x))`` — for prefix sums ``binom(2k, k) / 4^k``, for momentum
    ``beta`` and decay ``alpha`` the convolution of those of ``(1 - alpha x)^{-1/2}`` and
    ``(1 - beta x)^{-1/2}``. Other workloads use the lower-triangular matrix square root.

    Args:
        n_steps: ``n``.
        bandwidth: number of diagonals kept (``n`` gives the full square root).
        workload: default prefix sums.

    Example:
        >>> s = bsr_strategy(64, bandwidth=64)
        >>> round(s.expected_error(), 4), round(s.expected_error(reduction="max"), 4)
        (4.9715, 5.7066)
    """
    n = check_n_steps(n_steps, "bsr_strategy")
    p = check.integer(bandwidth, "bandwidth", "bsr_strategy", minimum=1)
    if p > n:
        raise InputValueError(f"bsr_strategy: bandwidth={p} exceeds n_steps={n}.")
    work = resolve_workload(workload, n, "bsr_strategy")
    if work.is_toeplitz:
        coefs = _toeplitz.series_sqrt(work.toeplitz_coefficients(), p)
        return ToeplitzStrategy(n, coefs.numpy(), name="bsr")
    root = lower_triangular_sqrt(work.materialize())
    return BandedStrategy(n, matrix_to_band(root, p).numpy(), name="bsr")


# ---------------------------------------------------------------- optimisation


def optimize_toeplitz(
    workload: Workload,
    bands: int,
    *,
    reduction: Reduction = "mean",
    init: torch.Tensor | None = None,
    max_iterations: int = 250,
    progress: bool = False,
) -> torch.Tensor:
    """Optimal ``bands`` Toeplitz coefficients (unit norm) for ``workload`` under single participation."""
    n = workload.n_steps
    c0 = init if init is not None else _toeplitz.series_sqrt(_toeplitz_or_prefix(workload), bands)
    c0 = c0.double() / c0.double().norm()
    if bands == 1:
        return torch.ones(1, dtype=torch.float64)
    loss = toeplitz_loss_fn(workload, reduction)
    result = _optim.minimize(
        _optim.value_and_grad(loss), c0, max_iterations=max_iterations, progress=progress, desc=f"BandMF toeplitz b={bands}"
    )
    c = result.x
    c = c * torch.sign(c[0])
    return c / c.norm()


def toeplitz_loss_fn(workload: Workload, reduction: Reduction, min_sep: int = 1, max_participations: int | None = 1) -> Any:
    """``c -> reduced error * squared sensitivity`` for Toeplitz ``C`` with first column ``c``.

    The sensitivity term is ``||c||^2`` for single participation (or bands <= min_sep) and
    the closed form of decreasing Toeplitz matrices, applied to the non-increasing
    majorant of ``|c|`` (exact for decreasing ``c``, an upper bound otherwise).
    """
    n = workload.n_steps
    a = workload.toeplitz_coefficients() if workload.is_toeplitz else None
    mat = None if workload.is_toeplitz else workload.materialize()

    def loss(c: torch.Tensor) -> torch.Tensor:
        g = _toeplitz.series_inverse(c, n)
        if a is not None:
            beta = _toeplitz.conv(a, g, n)
            err = torch.cumsum(beta * beta, 0)
            red = err.mean() if reduction == "mean" else err[-1]
        else:
            bm = mat @ _toeplitz.materialize(g, n)
            err = (bm * bm).sum(1)
            red = err.mean() if reduction == "mean" else err.max()
        k = -(-n // min_sep) if max_participations is None else min(max_participations, -(-n // min_sep))
        if k == 1 or c.shape[0] <= min_sep:
            sens2 = torch.dot(c, c)
        else:
            # Majorant: equal to c when c is non-negative and non-increasing (then exact),
            # an upper bound otherwise, so the objective never understates the sensitivity.
            sens2 = _toeplitz.minsep_sensitivity_squared(_toeplitz.nonincreasing_majorant(c), n, min_sep, max_participations)
        return red * sens2

    return loss


def optimize_column_normalized(
    workload: Workload,
    init_coefs: torch.Tensor,
    *,
    reduction: Reduction = "mean",
    max_iterations: int = 250,
    progress: bool = False,
) -> torch.Tensor:
    """Optimal column-normalised band ``(n, bands)`` for ``workload``, from Toeplitz ``init_coefs``."""
    n, b = workload.n_steps, init_coefs.shape[0]
    mask = ~_invalid_mask(n, b)
    mask_t = torch.from_numpy(mask)
    p0 = init_coefs.double().expand(n, b) * mask_t
    if b == 1:
        return torch.ones(n, 1, dtype=torch.float64)
    at = workload.materialize().T.contiguous()

    def loss(p: torch.Tensor) -> torch.Tensor:
        v = p * mask_t
        v = v / v.norm(dim=1, keepdim=True)
        bt = _BandedRightSolve.apply(v, at)
        err = (bt * bt).sum(dim=0)
        return err.mean() if reduction == "mean" else err.max()

    # Each evaluation is O(n^2 bands); stop once an iteration gains less than 1e-8 (relative):
    # at n = 1024 that is ~60 evaluations, within 1e-6 of the fully converged loss.
    result = _optim.minimize(
        _optim.value_and_grad(loss),
        p0,
        max_iterations=max_iterations,
        ftol=1e-8,
        progress=progress,
        desc=f"BandMF column-normalized b={b}",
    )
    v = result.x * mask_t
    v = v * torch.sign(v[:, :1])
    return v / v.norm(dim=1, keepdim=True)


class _BandedRightSolve(torch.autograd.Function):
    """``B^T`` for ``B = A C^{-1}`` with banded lower-triangular ``C`` (``C[s+j, s] = V[s, j]``).

    Back-substitution over the columns of ``B`` (``B C = A``):
    ``B[:, s] = (A[:, s] - sum_{j>=1} V[s, j] B[:, s+j]) / V[s, 0]``, in O(n^2 bands), with
    the adjoint recursion as a hand-written backward pass (no O(n^3) solves).
    """

    @staticmethod
    def forward(ctx: Any, v: torch.Tensor, at: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        n, b = v.shape
        bt = torch.zeros_like(at)
        for s in range(n - 1, -1, -1):
            hi = min(n, s + b)
            row = at[s, s:]
            if hi > s + 1:
                row = row - v[s, 1 : hi - s] @ bt[s + 1 : hi, s:]
            bt[s, s:] = row / v[s, 0]
        ctx.save_for_backward(v, bt)
        return bt

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        v, bt = ctx.saved_tensors
        n, b = v.shape
        g = grad.clone()
        dv = torch.zeros_like(v)
        for s in range(n):
            r = g[s, s:] / v[s, 0]
            dv[s, 0] = -torch.dot(r, bt[s, s:])
            hi = min(n, s + b)
            if hi > s + 1:
                dv[s, 1 : hi - s] = -(bt[s + 1 : hi, s:] @ r)
                g[s + 1 : hi, s:] -= torch.outer(v[s, 1 : hi - s], r)
        return dv, None


def lower_triangular_sqrt(a: torch.Tensor) -> torch.Tensor:
    """The lower-triangular ``S`` with positive diagonal and ``S @ S = a`` (for lower-triangular ``a``).

    Computed diagonal by diagonal: ``S[j+d, j] = (A[j+d, j] - sum_{0<k<d} S[j+d, j+k] S[j+k, j])
    / (S[j+d, j+d] + S[j, j])`` (O(n^3) total, vectorised over ``j``).
    """
    a = a.double()
    n = a.shape[0]
    diag = torch.diagonal(a)
    if not bool((diag > 0).all()):
        raise InputValueError("lower_triangular_sqrt needs a positive diagonal (an invertible workload).")
    s = torch.zeros_like(a)
    idx = torch.arange(n)
    s[idx, idx] = diag.sqrt()
    for d in range(1, n):
        j = idx[: n - d]
        acc = torch.zeros(n - d, dtype=torch.float64)
        for k in range(1, d):
            acc = acc + s[j + d, j + k] * s[j + k, j]
        s[j + d, j] = (a[j + d, j] - acc) / (s[j + d, j + d] + s[j, j])
    return s


# ------------------------------------------------------------------ helpers


def _invalid_mask(n: int, b: int) -> np.ndarray:
    """True where ``band[t, j]`` would fall below the matrix (``t + j >= n``)."""
    t = np.arange(n)[:, None]
    j = np.arange(b)[None, :]
    return t + j >= n


def _band_to_matrix(band: torch.Tensor) -> torch.Tensor:
    n, b = band.shape
    c = torch.zeros(n, n, dtype=band.dtype)
    t = torch.arange(n)
    for j in range(b):
        rows = t[: n - j] + j
        c[rows, t[: n - j]] = band[: n - j, j]
    return c


def matrix_to_band(c: torch.Tensor, b: int) -> torch.Tensor:
    """The first ``b`` diagonals of the lower-triangular ``n x n`` matrix ``c`` in band storage.

    Returns a float64 ``[n, b]`` tensor with ``band[t, j] = c[t + j, t]`` (zero where
    ``t + j >= n``): column ``t``'s entries from the diagonal down, the layout
    :class:`BandedStrategy` takes. Entries below the ``b``-th diagonal are dropped.
    """
    n = c.shape[0]
    band = torch.zeros(n, b, dtype=torch.float64)
    t = torch.arange(n)
    for j in range(b):
        band[: n - j, j] = c[t[: n - j] + j, t[: n - j]]
    return band


def _toeplitz_or_prefix(workload: Workload) -> torch.Tensor:
    if workload.is_toeplitz:
        return workload.toeplitz_coefficients()
    # A non-Toeplitz workload: start from the square root of its first column.
    return workload.materialize()[:, 0].contiguous()


