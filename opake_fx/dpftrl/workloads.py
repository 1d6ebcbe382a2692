"""Workloads: the linear maps from gradients to what training actually uses.

DP-FTRL releases ``A x`` for a stream of gradients ``x_0, ..., x_{n-1}`` where the
workload ``A`` (lower triangular, ``n x n``) says how gradients enter the parameters.
A strategy factorises ``A = B C`` and adds noise ``C^{-1} z`` to the gradients; the
error it causes is ``B z``. Three workloads cover training:

* :func:`prefix_workload`: plain SGD (``theta_t = theta_0 - lr * sum_{s<=t} g_s``),
  the all-ones lower-triangular matrix;
* :func:`momentum_workload`: SGD with momentum ``beta``, weight-decay factor ``alpha``
  and an optional learning-rate schedule ``eta_s`` (Denisov et al. 2022):
  ``A[t, r] = sum_{s=r..t} alpha^(t-s) eta_s beta^(s-r)``;
* :func:`matrix_workload`: any lower-triangular matrix.

Momentum and learning-rate schedules can be *folded into the workload* (optimise the
strategy for the matrix the optimizer really applies) or *applied after* the noise
(optimise for the prefix workload and run any optimizer on the noised gradients). Both
are the same pipeline at run time (noise on gradients, then the optimizer); folding
only changes which error the strategy minimises, never the privacy.

Example:
    >>> w = momentum_workload(4, momentum=0.5)
    >>> w.materialize()[3].tolist()
    [1.875, 1.75, 1.5, 1.0]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

import opake_fx.validation as check
from opake_fx.errors import InputTypeError, InputValueError

__all__ = ["Workload", "prefix_workload", "momentum_workload", "matrix_workload"]


@dataclass(frozen=True, eq=False)
class Workload:
    """An ``n x n`` lower-triangular workload matrix ``A`` (immutable).

    Attributes:
        n_steps: ``n``.
        name: a short description.
        toeplitz: the first column when ``A`` is Toeplitz (then every computation uses
            fast convolutions), else ``None``.
        factors: ``(alpha, beta)`` when ``A``'s generating function is
            ``1 / ((1 - alpha x)(1 - beta x))`` (closed forms for BSR/BISR), else ``None``.
    """

    n_steps: int
    name: str
    toeplitz: np.ndarray | None = None
    factors: tuple[float, float] | None = None
    _matrix: np.ndarray | None = field(default=None, repr=False)

    @property
    def is_toeplitz(self) -> bool:
        """True when ``A`` is a lower-triangular Toeplitz matrix."""
        return self.toeplitz is not None

    def toeplitz_coefficients(self) -> torch.Tensor:
        """The first column of a Toeplitz ``A`` (float64); raises for other workloads."""
        if self.toeplitz is None:
            raise InputValueError(f"workload {self.name!r} is not Toeplitz; use materialize().")
        return torch.from_numpy(self.toeplitz.copy())

    def materialize(self) -> torch.Tensor:
        """The dense ``n x n`` float64 matrix ``A``."""
        if self._matrix is not None:
            return torch.from_numpy(self._matrix.copy())
        from opake_fx.dpftrl._toeplitz import materialize

        return materialize(self.toeplitz_coefficients(), self.n_steps)

    def __repr__(self) -> str:
        return f"Workload({self.name}, n_steps={self.n_steps})"


def prefix_workload(n_steps: int) -> Workload:
    """Prefix sums: ``A[t, r] = 1`` for ``r <= t`` (SGD with a constant learning rate).

    Example:
        >>> prefix_workload(3).materialize().tolist()
        [[1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
    """
    n = check.integer(n_steps, "n_steps", "prefix_workload", minimum=1)
    return Workload(n, "prefix", toeplitz=_frozen(np.ones(n)), factors=(1.0, 0.0))


def momentum_workload(
    n_steps: int,
    momentum: float = 0.0,
    *,
    learning_rates: Sequence[float] | Callable[[int], float] | None = None,
    decay: float = 1.0,
) -> Workload:
    """SGD with heavy-ball momentum, a decay factor and an optional learning-rate schedule.

    The optimizer ``m_t = beta m_{t-1} + g_t``, ``theta_t = alpha theta_{t-1} - eta_t m_t``
    moves the parameters by ``-A g`` with ``A[t, r] = sum_{s=r..t} alpha^(t-s) eta_s
    beta^(s-r)``. With a constant learning rate (``learning_rates=None``, i.e. 1) the
    matrix is Toeplitz with generating function ``1 / ((1 - alpha x)(1 - beta x))``.

    Args:
        n_steps: number of training steps ``n``.
        momentum: ``beta`` in [0, 1).
        learning_rates: a length-``n`` sequence or a schedule ``step -> lr`` (e.g. from
            :mod:`opake_fx.scheduling`); None means a constant 1 (scale is irrelevant
            to the optimal strategy).
        decay: ``alpha`` in (0, 1], the multiplicative weight decay per step.

    Example:
        >>> momentum_workload(3, momentum=0.5).toeplitz_coefficients().tolist()
        [1.0, 1.5, 1.75]
    """
    n = check.integer(n_steps, "n_steps", "momentum_workload", minimum=1)
    beta = check.interval(momentum, "momentum", "momentum_workload", 0.0, 1.0, high_open=True)
    alpha = check.interval(decay, "decay", "momentum_workload", 0.0, 1.0, low_open=True)
    if learning_rates is None:
        k = np.arange(n, dtype=np.float64)
        if beta == alpha:
            coefs = (k + 1) * alpha**k
        else:
            coefs = (alpha ** (k + 1) - beta ** (k + 1)) / (alpha - beta)
        name = f"momentum(beta={beta:g}, decay={alpha:g})"
        return Workload(n, name, toeplitz=_frozen(coefs), factors=(alpha, beta))
    lrs = _learning_rates(learning_rates, n)
    t = np.arange(n)
    a = np.zeros((n, n))
    # A[t, r] = sum_{s=r..t} alpha^(t-s) eta_s beta^(s-r), built row by row: row t = alpha * row t-1 + eta_t beta^(t-r).
    for i in range(n):
        prev = alpha * a[i - 1] if i > 0 else np.zeros(n)
        contrib = np.where(t <= i, lrs[i] * beta ** np.clip(i - t, 0, None), 0.0)
        a[i] = prev + contrib
    name = f"momentum(beta={beta:g}, decay={alpha:g}, schedule)"
    return Workload(n, name, _matrix=_frozen(a))


def matrix_workload(matrix: torch.Tensor | np.ndarray, name: str = "matrix") -> Workload:
    """Any square lower-triangular workload matrix (copied, float64).

    Example:
        >>> matrix_workload(torch.eye(2)).n_steps
        2
    """
    a = np.array(matrix.detach().cpu().numpy() if isinstance(matrix, torch.Tensor) else matrix, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] != a.shape[1] or a.shape[0] == 0:
        raise InputValueError(f"matrix_workload needs a non-empty square matrix; got shape {a.shape}.")
    if np.any(np.triu(a, 1) != 0):
        raise InputValueError(
            "matrix_workload needs a lower-triangular matrix: step t can only use gradients up to t. "
            "Zero the entries above the diagonal."
        )
    if not np.all(np.isfinite(a)):
        raise InputValueError("matrix_workload got non-finite entries.")
    return Workload(a.shape[0], name, _matrix=_frozen(a))


def resolve_workload(workload: Workload | None, n_steps: int, where: str) -> Workload:
    """``workload`` checked against ``n_steps`` (None: the prefix workload)."""
    if workload is None:
        return prefix_workload(n_steps)
    if not isinstance(workload, Workload):
        raise InputTypeError(
            f"{where}: workload must be a Workload (prefix_workload, momentum_workload, matrix_workload); "
            f"got {type(workload).__name__}."
        )
    if workload.n_steps != n_steps:
        raise InputValueError(
            f"{where}: the workload has n_steps={workload.n_steps} but the strategy has n_steps={n_steps}; "
            "build the workload for the same number of steps."
        )
    return workload


def _learning_rates(lrs: Sequence[float] | Callable[[int], float], n: int) -> np.ndarray:
    if callable(lrs):
        values = np.array([float(lrs(t)) for t in range(n)], dtype=np.float64)
    else:
        values = np.asarray(list(lrs), dtype=np.float64)
        if values.shape != (n,):
            raise InputValueError(f"momentum_workload: learning_rates has {values.size} entries; need n_steps={n}.")
    if not np.all(np.isfinite(values)) or np.any(values < 0):
        raise InputValueError("momentum_workload: learning rates must be finite and >= 0.")
    if values[0] <= 0 and n > 0:
        raise InputValueError("momentum_workload: the first learning rate must be > 0 (A must be invertible).")
    return values


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=np.float64)
    a.setflags(write=False)
    return a
