"""Buffered linear Toeplitz (BLT) strategies (Dvijotham et al. 2024, arXiv:2404.16706; arXiv:2408.08868).

A BLT ``C`` is lower-triangular Toeplitz with ``C[t, t] = 1`` and
``C[t, s] = sum_j w_j theta_j^(t-s-1)`` for ``s < t`` (``theta``: buffer decays,
``w``: output scales). Its inverse is again a BLT, and ``C x = z`` is solved in a
stream with one parameter-sized buffer per ``theta_j``: O(buffers) memory whatever
the horizon, against O(bands) for BandMF and O(n) for dense strategies.

:func:`blt_strategy` optimises ``(theta, w)`` for the mean or max error under b-min-sep
participation, parameterised so that ``0 < theta_j < 1``, ``w_j > 0`` and
``sum_j w_j < 1``: the Toeplitz coefficients are then positive and decreasing, so the
min-sep sensitivity in the objective is exact (McMahan et al. 2024, arXiv:2405.13763, Thm. 2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

import numpy as np
import torch

import opake_fx.validation as check
from opake_fx.dpftrl import _optim, _toeplitz
from opake_fx.dpftrl.strategies._base import ToeplitzLike, check_n_steps, frozen, toeplitz_column
from opake_fx.dpftrl.strategies.banded import toeplitz_loss_fn
from opake_fx.dpftrl.streaming import BltSolve, StreamingInverse
from opake_fx.dpftrl.workloads import Workload, resolve_workload
from opake_fx.errors import InputValueError
from opake_fx.typing import typechecked

__all__ = ["BltStrategy", "blt_strategy"]


@dataclass(frozen=True, eq=False, repr=False)
class BltStrategy(ToeplitzLike):
    """A BLT strategy: ``C[t, t] = 1``, ``C[t, s] = sum_j output_scale_j * buf_decay_j^(t-s-1)``.

    Attributes:
        n_steps: the horizon it was optimised for (None: any).
        buf_decay: ``theta`` (read-only float64, decreasing).
        output_scale: ``w`` (read-only float64).
        name: ``"blt"``.
    """

    n_steps: int | None
    buf_decay: np.ndarray
    output_scale: np.ndarray
    name: str = "blt"
    kind = "blt"

    def __post_init__(self) -> None:
        theta = frozen(self.buf_decay).reshape(-1)
        omega = frozen(self.output_scale).reshape(-1)
        if theta.shape != omega.shape:
            raise InputValueError(
                f"BltStrategy needs buf_decay and output_scale of the same length; got {theta.size} and {omega.size}."
            )
        if not (np.all(np.isfinite(theta)) and np.all(np.isfinite(omega))):
            raise InputValueError("BltStrategy needs finite parameters.")
        order = np.argsort(-theta, kind="stable")
        object.__setattr__(self, "buf_decay", frozen(theta[order]))
        object.__setattr__(self, "output_scale", frozen(omega[order]))

    @property
    def num_buffers(self) -> int:
        """Number of buffers (parameter-sized tensors kept while streaming)."""
        return int(self.buf_decay.size)

    @property
    def bands(self) -> int | None:
        return 1 if self.num_buffers == 0 else None

    def coefficients(self) -> dict[str, torch.Tensor]:
        return {"buf_decay": torch.from_numpy(self.buf_decay.copy()), "output_scale": torch.from_numpy(self.output_scale.copy())}

    def toeplitz_coefficients(self, n: int | None = None) -> torch.Tensor:
        n = self._n(n)
        return blt_coefficients(torch.from_numpy(self.buf_decay.copy()), torch.from_numpy(self.output_scale.copy()), n)

    def inverse_noise(self) -> StreamingInverse:
        return BltSolve(self.buf_decay.copy(), self.output_scale.copy())

    @classmethod
    def _from_dict(cls, data: dict[str, Any]) -> BltStrategy:
        return cls(data["n_steps"], np.asarray(data["buf_decay"]), np.asarray(data["output_scale"]), data.get("name", "blt"))


@typechecked
def blt_strategy(
    n_steps: Integral,
    max_buffers: Integral = 6,
    min_sep: Integral = 1,
    max_participations: Integral | None = 1,
    *,
    workload: Workload | None = None,
    reduction: str = "mean",
    rtol: Real = 1.01,
    max_iterations: Integral = 400,
    progress: bool | None = None,
) -> BltStrategy:
    """An optimised BLT for ``n_steps`` steps under b-min-sep participation.

    Optimises BLTs with 1, 2, ... buffers (L-BFGS, float64) and stops adding buffers
    when one more improves the loss by less than a factor ``rtol`` (3 to 6 buffers are
    typical).

    Args:
        n_steps: ``n``.
        max_buffers: the most buffers tried (memory while streaming).
        min_sep: ``b`` of the participation pattern the loss uses.
        max_participations: ``k`` (None: as many as ``n`` and ``b`` allow).
        workload: default prefix sums.
        reduction: ``"mean"`` or ``"max"``.
        rtol: minimal improvement factor for accepting one more buffer.
        max_iterations: L-BFGS iterations per number of buffers.
        progress: progress bar (default: long runs on a terminal).

    Privacy: a strategy only shapes the noise; calibrate it with
    ``strategy.sensitivity(min_sep, max_participations)``, which is exact for BLTs.

    Example:
        >>> s = blt_strategy(64, max_buffers=3)
        >>> s.num_buffers <= 3 and s.expected_error() < 5.0
        True
    """
    n = check_n_steps(n_steps, "blt_strategy")
    m = check.integer(max_buffers, "max_buffers", "blt_strategy", minimum=1) if max_buffers != 0 else 0
    b = check.integer(min_sep, "min_sep", "blt_strategy", minimum=1)
    k = None if max_participations is None else check.integer(max_participations, "max_participations", "blt_strategy", minimum=1)
    work = resolve_workload(workload, n, "blt_strategy")
    check.choice(reduction, "reduction", "blt_strategy", ("mean", "max"))
    check.interval(rtol, "rtol", "blt_strategy", 1.0, math.inf, hint="It is the least improvement factor that accepts one more buffer (e.g. 1.01).")
    show = _optim.show_progress(progress, n)
    loss_c = toeplitz_loss_fn(work, reduction, b, k)
    best = BltStrategy(n, np.zeros(0), np.zeros(0))
    best_loss = float(loss_c(best.toeplitz_coefficients()))
    for nbuf in range(1, m + 1):
        x0 = _initial_params(nbuf, n)

        def loss(x: torch.Tensor, nbuf: int = nbuf) -> torch.Tensor:
            theta, omega = _unpack(x, nbuf)
            return loss_c(blt_coefficients(theta, omega, n))

        result = _optim.minimize(
            _optim.value_and_grad(loss), x0, max_iterations=max_iterations, progress=show, desc=f"BLT {nbuf} buffers"
        )
        theta, omega = _unpack(result.x, nbuf)
        candidate = BltStrategy(n, theta.detach().numpy(), omega.detach().numpy())
        cand_loss = float(loss_c(candidate.toeplitz_coefficients()))
        if not math.isfinite(cand_loss) or rtol * cand_loss >= best_loss:
            break
        best, best_loss = candidate, cand_loss
    return best


def blt_coefficients(theta: torch.Tensor, omega: torch.Tensor, n: int) -> torch.Tensor:
    """First column of the BLT: ``[1, sum w, sum w theta, sum w theta^2, ...]`` (length ``n``)."""
    if theta.numel() == 0 or n == 1:
        return toeplitz_column(torch.ones(1, dtype=torch.float64), n)
    k = torch.arange(n - 1, dtype=torch.float64)
    powers = torch.exp(k[:, None] * torch.log(theta)[None, :])
    tail = powers @ omega
    return torch.cat([torch.ones(1, dtype=torch.float64), tail])


def _unpack(x: torch.Tensor, nbuf: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unconstrained ``x`` -> ``theta in (0, 1)``, ``w > 0`` with ``sum w < 1``."""
    theta = torch.sigmoid(x[:nbuf])
    omega = torch.sigmoid(x[-1]) * torch.softmax(x[nbuf : 2 * nbuf], dim=0)
    return theta, omega


def _initial_params(nbuf: int, n: int) -> torch.Tensor:
    """Decays ``1 - theta`` log-spaced from ``~1/n`` to ``1/2``; weights sum to 1/2 (the optimal second coefficient)."""
    gaps = torch.exp(torch.linspace(math.log(2.0 / n), math.log(0.5), nbuf, dtype=torch.float64)) if nbuf > 1 else torch.tensor(
        [1.0 / math.sqrt(n)], dtype=torch.float64
    )
    theta = 1.0 - gaps
    u = torch.log(theta) - torch.log1p(-theta)
    v = torch.zeros(nbuf, dtype=torch.float64)
    w = torch.zeros(1, dtype=torch.float64)
    return torch.cat([u, v, w])


_ = _toeplitz  # re-exported helpers live there
