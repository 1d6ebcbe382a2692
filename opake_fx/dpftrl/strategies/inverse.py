"""Strategies defined by a banded noise matrix ``C^{-1}``: BISR and lambda-CGD.

Here the noise added at step ``t`` is ``sum_{j < p} d_{t,j} z_{t-j}``: a short moving
average of fresh Gaussians, so streaming needs the last ``p - 1`` draws, or none at all
when they are re-drawn from their keys (``replay=True``).

* :func:`bisr_strategy` — Banded Inverse Square Root (Kalinin et al. 2025, "Back to
  square roots"): ``C^{-1}`` = the first ``bandwidth`` diagonals of ``A^{-1/2}`` (for
  prefix sums the coefficients of ``sqrt(1 - x)``: ``1, -1/2, -1/8, -1/16, ...``); with
  momentum ``beta`` and decay ``alpha`` the convolution of those of ``sqrt(1 - alpha x)``
  and ``sqrt(1 - beta x)``. Closed form; ``optimize=True`` refines the coefficients for
  the mean error under b-min-sep participation.
* :func:`lambda_cgd_strategy` — anti-correlated noise ``z_t - lambda z_{t-1}``
  (Koloskova et al. 2023, "Gradient descent with linearly correlated noise"):
  ``C^{-1} = I - lambda S``; O(1) memory by re-drawing ``z_{t-1}`` from its key.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

import numpy as np
import torch

import opake_fx.validation as check
from opake_fx.dpftrl import _optim, _toeplitz
from opake_fx.dpftrl import sensitivity as _sens
from opake_fx.dpftrl.strategies._base import Strategy, ToeplitzLike, check_n_steps, frozen, toeplitz_column
from opake_fx.dpftrl.strategies.banded import lower_triangular_sqrt, matrix_to_band
from opake_fx.dpftrl.streaming import BandedInverseApply, StreamingInverse
from opake_fx.dpftrl.workloads import Workload, resolve_workload
from opake_fx.errors import InputValueError
from opake_fx.typing import typechecked

__all__ = ["InverseToeplitzStrategy", "InverseBandedStrategy", "bisr_strategy", "lambda_cgd_strategy"]


@dataclass(frozen=True, eq=False, repr=False)
class InverseToeplitzStrategy(ToeplitzLike):
    """``C^{-1}`` lower-triangular Toeplitz with first column ``inverse_coefs`` (banded).

    Attributes:
        n_steps: the horizon (None: any, as for lambda-CGD).
        inverse_coefs: ``C^{-1}[t + j, t] = inverse_coefs[j]`` (read-only float64).
        replay: stream by re-drawing past noise from its key (no buffers).
        name: ``"bisr"`` or ``"lambda_cgd"``.
    """

    n_steps: int | None
    inverse_coefs: np.ndarray
    replay: bool = False
    name: str = "inverse_toeplitz"
    kind = "inverse_toeplitz"

    def __post_init__(self) -> None:
        d = frozen(self.inverse_coefs).reshape(-1)
        if d.size == 0 or d[0] == 0 or not np.all(np.isfinite(d)):
            raise InputValueError("InverseToeplitzStrategy needs finite coefficients with a non-zero first one.")
        object.__setattr__(self, "inverse_coefs", d)

    @property
    def noise_bands(self) -> int:
        """Number of non-zero diagonals of ``C^{-1}``."""
        return int(self.inverse_coefs.size)

    @property
    def bands(self) -> int | None:
        return 1 if self.inverse_coefs.size == 1 else None

    def coefficients(self) -> torch.Tensor:
        return torch.from_numpy(self.inverse_coefs.copy())

    def inverse_toeplitz_coefficients(self, n: int | None = None) -> torch.Tensor:
        return toeplitz_column(self.coefficients(), self._n(n))

    def toeplitz_coefficients(self, n: int | None = None) -> torch.Tensor:
        n = self._n(n)
        return _toeplitz.series_inverse(self.coefficients()[:n], n)

    def inverse_noise(self) -> StreamingInverse:
        return BandedInverseApply(self.inverse_coefs.reshape(1, -1).copy(), replay=self.replay)

    @classmethod
    def _from_dict(cls, data: dict[str, Any]) -> InverseToeplitzStrategy:
        return cls(data["n_steps"], np.asarray(data["inverse_coefs"]), bool(data.get("replay", False)), data.get("name", "inverse_toeplitz"))


@dataclass(frozen=True, eq=False, repr=False)
class InverseBandedStrategy(Strategy):
    """``C^{-1}`` banded lower-triangular (not Toeplitz): ``C^{-1}[t, t-j] = rows[t, j]``.

    Used by BISR for workloads with a learning-rate schedule.
    """

    n_steps: int
    rows: np.ndarray
    replay: bool = False
    name: str = "inverse_banded"
    kind = "inverse_banded"

    def __post_init__(self) -> None:
        r = np.array(self.rows, dtype=np.float64)
        if r.ndim != 2 or r.shape[0] != self.n_steps:
            raise InputValueError(f"InverseBandedStrategy needs rows of shape (n_steps, p); got {r.shape}.")
        t = np.arange(self.n_steps)[:, None]
        r[np.arange(r.shape[1])[None, :] > t] = 0.0
        if np.any(r[:, 0] == 0) or not np.all(np.isfinite(r)):
            raise InputValueError("InverseBandedStrategy needs finite rows with a non-zero diagonal.")
        object.__setattr__(self, "rows", frozen(r))

    def coefficients(self) -> torch.Tensor:
        return torch.from_numpy(self.rows.copy())

    def materialize_inverse(self, n: int | None = None) -> torch.Tensor:
        n = self._n(n)
        full = torch.zeros(self.n_steps, self.n_steps, dtype=torch.float64)
        t = torch.arange(self.n_steps)
        for j in range(self.rows.shape[1]):
            full[t[j:], t[j:] - j] = torch.from_numpy(self.rows[j:, j].copy())
        return full[:n, :n]

    def materialize(self, n: int | None = None) -> torch.Tensor:
        inv = self.materialize_inverse(n)
        return torch.linalg.solve_triangular(inv, torch.eye(inv.shape[0], dtype=torch.float64), upper=False)

    def inverse_noise(self) -> StreamingInverse:
        return BandedInverseApply(self.rows.copy(), replay=self.replay)

    @classmethod
    def _from_dict(cls, data: dict[str, Any]) -> InverseBandedStrategy:
        return cls(data["n_steps"], np.asarray(data["rows"]), bool(data.get("replay", False)), data.get("name", "inverse_banded"))


@typechecked
def bisr_strategy(
    n_steps: Integral,
    bandwidth: Integral,
    *,
    workload: Workload | None = None,
    optimize: bool = False,
    min_sep: Integral = 1,
    max_participations: Integral | None = 1,
    replay: bool = False,
    max_iterations: Integral = 100,
    progress: bool | None = None,
) -> Strategy:
    """Banded Inverse Square Root: ``C^{-1}`` = first ``bandwidth`` diagonals of ``A^{-1/2}``.

    Args:
        n_steps: ``n``.
        bandwidth: ``p``, the number of diagonals of ``C^{-1}`` (memory ``p - 1``).
        workload: default prefix sums (Toeplitz workloads give a Toeplitz ``C^{-1}``).
        optimize: refine the ``p`` coefficients for the mean error times the squared
            b-min-sep sensitivity (L-BFGS from the closed form; Toeplitz workloads only).
        min_sep, max_participations: the participation the optimisation targets.
        replay: stream by re-drawing the last ``p - 1`` noise vectors from their keys
            instead of storing them (no buffers, ``p`` draws per step).
        max_iterations: L-BFGS iterations when ``optimize``.
        progress: progress bar.

    Privacy: a strategy only shapes the noise; its sensitivity (exact when ``C``'s
    coefficients are non-negative and non-increasing, as for prefix-sum BISR) calibrates it.

    Example:
        >>> s = bisr_strategy(64, bandwidth=8)
        >>> s.coefficients()[:3].tolist()
        [1.0, -0.5, -0.125]
    """
    n = check_n_steps(n_steps, "bisr_strategy")
    p = check.integer(bandwidth, "bandwidth", "bisr_strategy", minimum=1)
    if p > n:
        raise InputValueError(f"bisr_strategy: bandwidth={p} exceeds n_steps={n}.")
    work = resolve_workload(workload, n, "bisr_strategy")
    if not work.is_toeplitz:
        if optimize:
            raise InputValueError("bisr_strategy(optimize=True) needs a Toeplitz workload (no learning-rate schedule).")
        root = lower_triangular_sqrt(work.materialize())
        inv_root = torch.linalg.solve_triangular(root, torch.eye(n, dtype=torch.float64), upper=False)
        rows = torch.zeros(n, p, dtype=torch.float64)
        band = matrix_to_band(inv_root, p)  # band[t, j] = S^-1[t + j, t]
        for j in range(p):
            rows[j:, j] = band[: n - j, j]  # rows[t, j] = S^-1[t, t - j]
        return InverseBandedStrategy(n, rows.numpy(), replay=replay, name="bisr")
    d = _toeplitz.series_inverse(_toeplitz.series_sqrt(work.toeplitz_coefficients(), p), p)
    if optimize and p > 1:
        d = _optimize_inverse(work, d, min_sep, max_participations, max_iterations, _optim.show_progress(progress, n))
    return InverseToeplitzStrategy(n, d.numpy(), replay=replay, name="bisr")


@typechecked
def lambda_cgd_strategy(lambda_: Real, n_steps: Integral | None = None) -> InverseToeplitzStrategy:
    """Anti-correlated noise ``z_t - lambda z_{t-1}`` (Koloskova et al. 2023).

    ``C^{-1} = I - lambda S`` (``S`` the shift), so ``C`` is Toeplitz with coefficients
    ``lambda^k``: non-negative and non-increasing, hence an exact b-min-sep sensitivity.
    ``lambda = 0`` is DP-SGD; ``lambda = 1`` is anti-PGD. Streams in O(1) memory: the
    previous step's noise is re-drawn from its key instead of stored.

    Args:
        lambda_: in [0, 1].
        n_steps: optional horizon (needed for sensitivity and errors; pass ``n=`` otherwise).

    Example:
        >>> s = lambda_cgd_strategy(0.5, n_steps=4)
        >>> s.materialize()[3].tolist()
        [0.125, 0.25, 0.5, 1.0]
    """
    lam = check.unit_interval(lambda_, "lambda_", "lambda_cgd_strategy")
    n = check_n_steps(n_steps, "lambda_cgd_strategy", allow_none=True)
    coefs = np.array([1.0]) if lam == 0.0 else np.array([1.0, -lam])
    return InverseToeplitzStrategy(n, coefs, replay=True, name="lambda_cgd")


def _optimize_inverse(
    workload: Workload, d0: torch.Tensor, min_sep: int, k: int | None, max_iterations: int, progress: bool
) -> torch.Tensor:
    """Optimise ``C^{-1}``'s Toeplitz coefficients for mean error times min-sep sensitivity^2."""
    n = workload.n_steps
    a = workload.toeplitz_coefficients()
    kk = _sens.max_participations_of(n, min_sep, k)

    def loss(d: torch.Tensor) -> torch.Tensor:
        beta = _toeplitz.conv(a, d, n)
        err = torch.cumsum(beta * beta, 0).mean()
        c = _toeplitz.series_inverse(d, n)
        if kk == 1:
            return err * torch.dot(c, c)
        # The sensitivity of the non-increasing majorant: exact for decreasing C, an upper
        # bound otherwise, and the value the final strategy will report.
        return err * _toeplitz.minsep_sensitivity_squared(_toeplitz.nonincreasing_majorant(c), n, min_sep, k)

    d0 = d0.double()
    result = _optim.minimize(_optim.value_and_grad(loss), d0, max_iterations=max_iterations, progress=progress, desc="BISR")
    d = result.x / result.x[0]
    return d if float(loss(d)) <= float(loss(d0)) else d0
