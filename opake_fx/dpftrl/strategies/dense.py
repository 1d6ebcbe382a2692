"""The optimal dense multi-epoch factorisation (Denisov et al. 2022; Choquette-Choo et al. 2023).

For ``k`` epochs of ``b = n / k`` steps in a fixed order, the optimal ``C`` for the mean
error minimises ``tr(A^T A X^{-1}) / n`` over Gram matrices ``X = C^T C`` that are
positive definite, have ``X[i, j] = 0`` whenever ``i != j`` and ``i = j (mod b)`` (the
columns an example touches are orthogonal) and ``sum_{e} X[j + e b, j + e b] = 1`` for
every class ``j`` (unit fixed-epoch sensitivity). The problem is convex; it is solved
here by L-BFGS on the projected gradient ``-X^{-1} A^T A X^{-1} / n`` (backtracking out
of the non-positive-definite region) started from the optimal ``b``-banded Toeplitz
strategy, and ``C`` is the lower-triangular factor of ``X``. One loss evaluation costs a Cholesky factorisation and two triangular solves,
O(n^3): practical up to a few thousand steps. Streaming a dense ``C`` keeps every past
noise row (``n - 1`` buffers); that is what BandMF and BLT avoid.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

import numpy as np
import torch

import opake_fx.validation as check
from opake_fx.dpftrl import _optim
from opake_fx.dpftrl import sensitivity as _sens
from opake_fx.dpftrl.strategies._base import Strategy, check_n_steps, frozen
from opake_fx.dpftrl.streaming import DenseSolve, StreamingInverse
from opake_fx.dpftrl.workloads import Workload, resolve_workload
from opake_fx.errors import InputValueError
from opake_fx.typing import typechecked

__all__ = ["DenseStrategy", "dense_strategy"]


@dataclass(frozen=True, eq=False, repr=False)
class DenseStrategy(Strategy):
    """A dense lower-triangular ``C`` (read-only float64 ``matrix``) optimised for ``epochs``.

    Attributes:
        n_steps: ``n``.
        matrix: ``C``.
        epochs: the number of fixed-order epochs it was optimised for.
        name: ``"dense"``.
    """

    n_steps: int
    matrix: np.ndarray
    epochs: int = 1
    name: str = "dense"
    kind = "dense"

    def __post_init__(self) -> None:
        c = np.array(self.matrix, dtype=np.float64)
        if c.shape != (self.n_steps, self.n_steps):
            raise InputValueError(f"DenseStrategy needs an (n_steps, n_steps) matrix; got {c.shape}.")
        if np.any(np.triu(c, 1) != 0) or np.any(np.diag(c) == 0) or not np.all(np.isfinite(c)):
            raise InputValueError("DenseStrategy needs a finite lower-triangular matrix with a non-zero diagonal.")
        object.__setattr__(self, "matrix", frozen(c))

    @property
    def bands(self) -> int | None:
        return _sens.bandwidth(torch.from_numpy(self.matrix.copy()))

    def coefficients(self) -> torch.Tensor:
        return torch.from_numpy(self.matrix.copy())

    def materialize(self, n: int | None = None) -> torch.Tensor:
        n = self._n(n)
        return torch.from_numpy(self.matrix[:n, :n].copy())

    def inverse_noise(self) -> StreamingInverse:
        return DenseSolve(self.matrix.copy())

    @classmethod
    def _from_dict(cls, data: dict[str, Any]) -> DenseStrategy:
        return cls(data["n_steps"], np.asarray(data["matrix"]), int(data.get("epochs", 1)), data.get("name", "dense"))


@typechecked
def dense_strategy(
    n_steps: Integral,
    epochs: Integral = 1,
    *,
    workload: Workload | None = None,
    reduction: str = "mean",
    max_iterations: Integral = 300,
    ftol: Real = 1e-6,
    gtol: Real = 1e-9,
    threads: Integral | None = 1,
    progress: bool | None = None,
) -> DenseStrategy:
    """The optimal dense ``C`` for ``epochs`` fixed-order passes (mean error).

    Args:
        n_steps: ``n`` (``epochs`` must divide it).
        epochs: ``k``; ``1`` is single participation (Denisov et al. 2022).
        workload: default prefix sums.
        reduction: only ``"mean"`` (the objective is then convex and smooth).
        max_iterations: fixed-point iterations (one epoch) or L-BFGS iterations.
        ftol: stop when an iteration improves the loss by less than this fraction
            (the default stops within ~1e-5 of the optimum for one epoch, ~5e-4 for
            several; lower it for a tighter optimum at a higher cost).
        gtol: stop when the largest projected-gradient entry is below this.
        threads: torch threads while optimising (restored afterwards); None keeps the
            current setting. The default 1 is deliberate: multi-threaded LAPACK
            eigendecompositions and inverses slow down ~30x when the cores are shared
            with other processes, single-threaded ones do not.
        progress: progress bar (default: long runs on a terminal).

    Returns:
        A :class:`DenseStrategy` whose fixed-epoch sensitivity
        (``strategy.epoch_sensitivity(epochs)``) is 1.

    Privacy: a strategy only shapes the noise. Under fixed-epoch order use
    ``epoch_sensitivity(epochs)``; under b-min-sep participation ``sensitivity`` is an
    upper bound.

    Example:
        >>> from opake_fx.dpftrl import bsr_strategy
        >>> s = dense_strategy(32)
        >>> s.expected_error() < bsr_strategy(32, 32).expected_error()
        True
    """
    n = check_n_steps(n_steps, "dense_strategy")
    k = check.integer(epochs, "epochs", "dense_strategy", minimum=1)
    if n % k:
        raise InputValueError(f"dense_strategy: epochs={k} must divide n_steps={n}; pick n_steps as a multiple of epochs.")
    if reduction != "mean":
        raise InputValueError(
            "dense_strategy optimises the mean error only (max error is non-smooth in X); use reduction='mean', "
            "or band_mf_strategy / blt_strategy for max error."
        )
    work = resolve_workload(workload, n, "dense_strategy")
    saved = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(check.integer(threads, "threads", "dense_strategy", minimum=1))
    try:
        return _optimize_dense(work, n, k, max_iterations, ftol, gtol, _optim.show_progress(progress, n))
    finally:
        torch.set_num_threads(saved)


def _optimize_dense(work: Workload, n: int, k: int, max_iterations: int, ftol: float, gtol: float, show: bool) -> DenseStrategy:
    a = work.materialize()
    if k == 1:
        x = _fixed_point(a.T @ a, max_iterations=max_iterations, ftol=ftol, progress=show)
        return DenseStrategy(n, strategy_from_gram(x).numpy(), epochs=1)
    b = n // k
    idx = torch.arange(n)
    same_class = (idx[:, None] % b) == (idx[None, :] % b)
    keep = ~same_class | torch.eye(n, dtype=torch.bool)

    def fun(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = (x + x.T) / 2
        chol, info = torch.linalg.cholesky_ex(x)
        if int(info) != 0:
            return torch.tensor(float("inf"), dtype=torch.float64), torch.zeros_like(x)
        w = torch.linalg.solve_triangular(chol, a.T, upper=False)  # L^{-1} A^T: loss = ||W||^2 / n
        v = torch.linalg.solve_triangular(chol.T, w, upper=True)  # X^{-1} A^T
        loss = torch.linalg.vector_norm(w).square() / n
        return loss, torch.mm(v, v.T).mul_(-1.0 / n)  # gradient -X^{-1} A^T A X^{-1} / n

    drop = ~keep

    def project(g: torch.Tensor) -> torch.Tensor:  # in place: g is a fresh gradient from fun
        g.masked_fill_(drop, 0.0)
        diag = torch.diagonal(g)
        diag.sub_(diag.reshape(k, b).mean(0).repeat(k))
        return g

    x0 = _initial_gram(work, b, k)
    result = _optim.minimize(
        fun,
        x0,
        max_iterations=max_iterations,
        ftol=ftol,
        gtol=gtol,
        project=project,
        progress=show,
        desc="dense MF",
    )
    x = (result.x + result.x.T) / 2
    c = strategy_from_gram(x)
    return DenseStrategy(n, c.numpy(), epochs=k)


def _fixed_point(m: torch.Tensor, *, max_iterations: int, ftol: float, progress: bool) -> torch.Tensor:
    """Single participation: ``min tr(M X^{-1})`` s.t. ``diag(X) = 1`` by the fixed point of Denisov et al. 2022.

    Stationarity gives ``M = X V X`` for a diagonal ``V``, i.e.
    ``X = V^{-1/2} (V^{1/2} M V^{1/2})^{1/2} V^{-1/2}``; iterating
    ``v <- diag((V^{1/2} M V^{1/2})^{1/2})`` drives ``diag(X)`` to 1. Every iterate is made
    feasible by rescaling to a unit diagonal and the best one is kept, so stopping early
    is safe. One iteration is one symmetric eigendecomposition: about 20 reach 1e-5 of the
    optimum at n = 1024, where projected L-BFGS needs ~175 evaluations.
    """

    n = m.shape[0]
    v = torch.ones(n, dtype=torch.float64)
    best_x, best = None, float("inf")
    bar = _optim.Progress(max_iterations, "dense MF (fixed point)") if progress else None
    try:
        for _ in range(max_iterations):
            r = v.sqrt()
            evals, evecs = torch.linalg.eigh(r[:, None] * m * r[None, :])
            root = evals.clamp(min=0).sqrt()
            s_half = (evecs * root) @ evecs.T  # (V^1/2 M V^1/2)^1/2
            x = s_half / (r[:, None] * r[None, :])
            d = torch.diagonal(x).sqrt()
            x = x / (d[:, None] * d[None, :])
            x = (x + x.T) / 2
            chol, info = torch.linalg.cholesky_ex(x)
            if int(info) != 0:
                break
            loss = float((torch.cholesky_inverse(chol) * m).sum()) / n
            improved = best - loss
            if loss < best:
                best_x, best = x, loss
            if bar is not None:
                bar.update(best)
            if 0 <= improved <= ftol * abs(best):
                break
            v = torch.diagonal(s_half).clone()
    finally:
        if bar is not None:
            bar.close()
    if best_x is None:
        raise InputValueError("dense_strategy: the fixed-point iteration failed (workload too ill-conditioned).")
    return best_x


def _initial_gram(work: Workload, b: int, k: int) -> torch.Tensor:
    """A feasible start: the optimal ``b``-banded Toeplitz ``C``, columns normalised to ``1/sqrt(k)``.

    With at most ``b`` bands, columns ``b`` apart are orthogonal, so the Gram matrix meets
    the fixed-epoch constraints; it is already close to optimal, which saves most of the
    O(n^3) iterations a start from the identity would need.
    """
    from opake_fx.dpftrl import _toeplitz
    from opake_fx.dpftrl.strategies.banded import optimize_toeplitz

    n = work.n_steps
    coefs = optimize_toeplitz(work, b, max_iterations=200)
    c = _toeplitz.materialize(coefs, n)
    c = c / c.norm(dim=0, keepdim=True) / k**0.5
    return c.T @ c


def strategy_from_gram(x: torch.Tensor) -> torch.Tensor:
    """The lower-triangular ``C`` with ``C^T C = X`` (a Cholesky factorisation of the reversed ``X``)."""
    flipped = torch.flip(x, (0, 1))
    chol = torch.linalg.cholesky(flipped)
    return torch.flip(chol, (0, 1)).T.contiguous()

