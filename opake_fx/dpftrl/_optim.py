"""A small deterministic L-BFGS for strategy optimisation (private; torch float64).

Written here rather than using ``torch.optim.LBFGS`` because strategy losses have
infeasible regions (a Gram matrix that stops being positive definite, a coefficient
that reaches zero): the loss returns ``inf`` there and the backtracking line search
simply shrinks the step. Everything is float64 and sequential, so a run is a
deterministic function of its inputs (for a fixed number of torch threads).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["OptimizeResult", "minimize", "value_and_grad", "Progress", "show_progress"]

Objective = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class OptimizeResult:
    """Outcome of :func:`minimize`: the point, its loss, iterations and why it stopped."""

    x: torch.Tensor
    loss: float
    iterations: int
    evaluations: int
    reason: str


def value_and_grad(loss_fn: Callable[[torch.Tensor], torch.Tensor]) -> Objective:
    """Wraps a differentiable scalar loss as ``x -> (loss, gradient)`` (non-finite loss: no gradient)."""

    def fun(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            loss = loss_fn(x)
            if not bool(torch.isfinite(loss)):
                return torch.tensor(math.inf, dtype=torch.float64), torch.zeros_like(x)
            (grad,) = torch.autograd.grad(loss, x)
        if not bool(torch.isfinite(grad).all()):
            return torch.tensor(math.inf, dtype=torch.float64), torch.zeros_like(x)
        return loss.detach(), grad.detach()

    return fun


def minimize(
    fun: Objective,
    x0: torch.Tensor,
    *,
    max_iterations: int = 250,
    ftol: float = 1e-12,
    gtol: float = 1e-9,
    memory: int = 15,
    project: Callable[[torch.Tensor], torch.Tensor] | None = None,
    progress: bool = False,
    desc: str = "optimising",
) -> OptimizeResult:
    """Minimises ``fun`` (returning loss and gradient) from ``x0`` with L-BFGS.

    Args:
        fun: ``x -> (loss, grad)``; return ``inf`` loss for an infeasible ``x``.
        x0: a feasible starting point (float64).
        max_iterations: L-BFGS iterations (each one or a few evaluations).
        ftol: stop when the relative decrease of the loss falls below this.
        gtol: stop when the largest gradient entry falls below this.
        memory: number of curvature pairs kept.
        project: optional linear projection applied to every gradient (optimisation
            over a linear subspace, e.g. the dense strategy's constraints).
        progress: show a progress bar on stderr (tqdm when installed).
        desc: label of the progress bar.
    """
    x = x0.detach().clone()
    proj = project if project is not None else (lambda g: g)
    f, g = fun(x)
    g = proj(g)
    evaluations = 1
    if not bool(torch.isfinite(f)):
        raise ValueError("minimize: the starting point is infeasible (loss is not finite).")
    s_hist: list[torch.Tensor] = []
    y_hist: list[torch.Tensor] = []
    sy_hist: list[float] = []  # s.y of each pair, computed once (not in every two-loop pass)
    bar = Progress(max_iterations, desc) if progress else None
    reason = "max_iterations"
    it = 0
    try:
        for it in range(1, max_iterations + 1):
            if float(torch.linalg.vector_norm(g, math.inf)) <= gtol:
                reason = "gtol"
                it -= 1
                break
            d = _two_loop(g, s_hist, y_hist, sy_hist).neg_()
            gd = float(torch.dot(g.reshape(-1), d.reshape(-1)))
            if not gd < 0:
                s_hist.clear()
                y_hist.clear()
                sy_hist.clear()
                d = -g
                gd = -float(torch.dot(g.reshape(-1), g.reshape(-1)))
            step = 1.0 if s_hist else min(1.0, 1.0 / max(float(g.abs().sum()), 1e-300))
            accepted = False
            for _ in range(60):
                x_new = torch.add(x, d, alpha=step)
                f_new, g_new = fun(x_new)
                evaluations += 1
                if bool(torch.isfinite(f_new)) and float(f_new) <= float(f) + 1e-4 * step * gd:
                    accepted = True
                    break
                step *= 0.5 if not bool(torch.isfinite(f_new)) else _interpolate(float(f), gd, float(f_new), step)
            if not accepted:
                reason = "line_search"
                break
            g_new = proj(g_new)
            s, y = x_new - x, g_new - g
            sy = float(torch.dot(s.reshape(-1), y.reshape(-1)))
            if sy > 1e-12 * float(s.norm() * y.norm()):
                s_hist.append(s)
                y_hist.append(y)
                sy_hist.append(sy)
                if len(s_hist) > memory:
                    s_hist.pop(0)
                    y_hist.pop(0)
                    sy_hist.pop(0)
            decrease = float(f) - float(f_new)
            x, f, g = x_new, f_new, g_new
            if bar is not None:
                bar.update(float(f))
            if decrease <= ftol * max(abs(float(f)), 1.0):
                reason = "ftol"
                break
    finally:
        if bar is not None:
            bar.close()
    return OptimizeResult(x=x, loss=float(f), iterations=it, evaluations=evaluations, reason=reason)


def _two_loop(g: torch.Tensor, s_hist: list[torch.Tensor], y_hist: list[torch.Tensor], sy_hist: list[float]) -> torch.Tensor:
    """The L-BFGS two-loop recursion: an approximation of ``H^{-1} g``."""
    # In place on one buffer: strategy variables can be n x n matrices (1M entries at
    # n = 1024), where every temporary costs a pass over memory and fresh pages.
    q = g.clone()
    alphas = []
    for s, y, sy in zip(reversed(s_hist), reversed(y_hist), reversed(sy_hist)):
        rho = 1.0 / sy
        a = rho * float(torch.dot(s.reshape(-1), q.reshape(-1)))
        alphas.append((a, rho))
        q.add_(y, alpha=-a)
    if s_hist:
        s, y = s_hist[-1], y_hist[-1]
        q.mul_(sy_hist[-1] / float(torch.dot(y.reshape(-1), y.reshape(-1))))
    for (s, y), (a, rho) in zip(zip(s_hist, y_hist), reversed(alphas)):
        b = rho * float(torch.dot(y.reshape(-1), q.reshape(-1)))
        q.add_(s, alpha=a - b)
    return q


def _interpolate(f0: float, gd: float, f1: float, step: float) -> float:
    """Shrink factor from a quadratic fit of the loss along the line, kept in [0.1, 0.5]."""
    denom = 2.0 * (f1 - f0 - gd * step)
    if denom <= 0:
        return 0.5
    t = -gd * step * step / denom
    return min(0.5, max(0.1, t / step))


def show_progress(progress: bool | None, n: int) -> bool:
    """Whether a strategy optimisation over ``n`` steps shows a progress bar.

    ``progress`` as the user gave it wins; ``None`` (the factories' default) shows one
    for long runs (``n >= 512``) when stderr is a terminal.
    """
    if progress is not None:
        return bool(progress)
    return n >= 512 and sys.stderr.isatty()


class Progress:
    """A progress bar on stderr: tqdm if installed, else a one-line counter.

    ``update(loss)`` once an iteration, ``close()`` at the end.
    """

    def __init__(self, total: int, desc: str) -> None:
        self._tqdm: Any = None
        self._count = 0
        self._total = total
        self._desc = desc
        try:
            from tqdm import tqdm

            self._tqdm = tqdm(total=total, desc=desc, leave=False, file=sys.stderr)
        except ImportError:  # pragma: no cover - tqdm is optional
            self._tqdm = None

    def update(self, loss: float) -> None:
        self._count += 1
        if self._tqdm is not None:
            self._tqdm.set_postfix(loss=f"{loss:.6g}", refresh=False)
            self._tqdm.update(1)
        elif self._count % 10 == 0:  # pragma: no cover
            print(f"\r{self._desc}: {self._count}/{self._total} loss={loss:.6g}", end="", file=sys.stderr)

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
        elif self._count >= 10:  # pragma: no cover
            print(file=sys.stderr)
