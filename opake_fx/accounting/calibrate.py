"""calibrate: the parameter value that spends a privacy budget, on its safe side.

The search direction is read off the metric at the two ends of the bracket: for a noise
multiplier the privacy loss falls as the parameter grows (the answer is the *smallest*
value meeting the budget); for a sample rate or a number of steps it rises (the answer
is the *largest* such value). Integer brackets (``param_min`` and ``param_max`` both
ints) give an integer answer, e.g. a number of steps.

The search keeps a bracket ``[safe, unsafe]`` whose safe end always meets the budget and
returns that end, so the result is never under-noised. It interpolates ``log(metric)``
against ``log(param)`` (a near-linear relation for noise multipliers and step counts)
and falls back to bisection whenever an interpolation step does not halve the bracket.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

from opake_fx._typecheck import typechecked
from opake_fx.accounting import _validation as check
from opake_fx.accounting.budgets import Budget
from opake_fx.accounting.process import DpProcess
from opake_fx.errors import CalibrationError, InputTypeError, InputValueError

__all__ = ["CalibrateResult", "calibrate"]


@dataclass(frozen=True)
class CalibrateResult:
    """The outcome of :func:`calibrate`.

    Attributes:
        param: the calibrated parameter (an int for integer brackets); it meets the budget.
        achieved: the budgeted metric at ``param`` (<= the budget's value).
        converged: True when ``achieved`` is within ``tolerance`` (relative) of the
            budget (float parameters), when no representable parameter lies between the
            safe and the unsafe end (always the case for a finished integer search), or
            when the whole bracket meets the budget (``param`` is then the bracket
            end that spends the most); False only if ``max_iterations`` ran out first.
    """

    param: float | int
    achieved: float
    converged: bool


@typechecked
def calibrate(
    budget: Budget,
    fn: Callable[[Any], DpProcess],
    param_min: Real,
    param_max: Real,
    *,
    tolerance: Real = 1e-3,
    max_iterations: Integral = 60,
) -> CalibrateResult:
    """Finds the parameter at which ``fn(param)`` spends ``budget``, never beyond it.

    Args:
        budget: e.g. ``epsilon_budget(3.0, delta=1e-5)``; its accountant and
            discretization are used for every evaluation.
        fn: maps a parameter value to a DpProcess (noise multiplier, sample rate, steps...).
            The metric must be monotone in the parameter over the bracket.
        param_min, param_max: the bracket; both ints for an integer parameter.
        tolerance: relative gap to the budget at which a float search stops: the result
            satisfies ``value * (1 - tolerance) <= achieved <= value`` when reachable.
            Integer searches always end at the exact boundary (``param + 1`` exceeds).
        max_iterations: evaluations allowed after the two bracket ends.

    Returns:
        A :class:`CalibrateResult` whose ``param`` meets the budget.

    Raises:
        CalibrationError: the bracket holds no parameter meeting the budget (the message
            says which end to widen), or the metric is the same at both ends.

    Privacy contract: the returned parameter meets the budget as measured by the
    budget's accountant; it is never on the violating side of the root.

    Example:
        >>> import opake_fx.accounting as acc
        >>> import opake_fx.dpsgd.accounting as dpsgd_acc
        >>> result = acc.calibrate(
        ...     acc.epsilon_budget(3.0, delta=1e-5),
        ...     lambda nm: dpsgd_acc.poisson(dpsgd_acc.gaussian(nm), 64 / 10_000) * 500,
        ...     param_min=0.1, param_max=10.0)
        >>> round(result.param, 2), result.achieved <= 3.0
        (0.66, True)
    """
    if not isinstance(budget, Budget):
        raise InputTypeError(f"calibrate: budget must come from epsilon_budget/delta_budget; got {type(budget).__name__}.")
    if not callable(fn):
        raise InputTypeError(f"calibrate: fn must be callable (param -> DpProcess); got {type(fn).__name__}.")
    integer = _is_int(param_min) and _is_int(param_max)
    lo = int(param_min) if integer else check.real(param_min, "param_min", "calibrate")
    hi = int(param_max) if integer else check.real(param_max, "param_max", "calibrate")
    if not (math.isfinite(lo) and math.isfinite(hi)) or not lo < hi:
        raise InputValueError(f"calibrate: need finite param_min < param_max; got [{param_min}, {param_max}].")
    tolerance = check.positive(tolerance, "tolerance", "calibrate")
    if tolerance >= 1.0:
        raise InputValueError(f"calibrate: tolerance is relative and must be < 1; got {tolerance}.")
    max_iterations = check.integer(max_iterations, "max_iterations", "calibrate", 1)

    target = budget.value
    name = budget.metric

    def measure(p: float | int, how: Budget = budget) -> float:
        process = fn(p)
        if not isinstance(process, DpProcess):
            raise InputTypeError(f"calibrate: fn({p!r}) returned {type(process).__name__}, not a DpProcess.")
        return float(how.measure(process))

    # The bracket ends are first measured on a coarse grid: cheap even where the fine grid
    # is huge (tiny noise multipliers), and never below the fine value (a coarser
    # connect-the-dots grid dominates a finer one). Only the direction and the
    # interpolation use these values; every returned parameter is measured on the fine grid.
    screen = _coarse(budget)
    c_lo, c_hi = measure(lo, screen), measure(hi, screen)
    if c_lo == c_hi and screen is not budget:
        c_lo, c_hi = measure(lo), measure(hi)
    if c_lo == c_hi:
        raise CalibrationError(
            f"calibrate: {name} is {c_lo:.6g} at both param_min={lo} and param_max={hi}; the parameter "
            "does not change the privacy of fn(param) over this bracket, so there is nothing to calibrate."
        )
    decreasing = c_lo > c_hi  # e.g. noise multiplier: larger is more private
    safe, unsafe = (hi, lo) if decreasing else (lo, hi)
    m_safe = measure(safe) if screen is not budget else (c_hi if decreasing else c_lo)
    m_unsafe = c_lo if decreasing else c_hi
    if not m_safe <= target:
        end, verb = ("param_max", "increase") if decreasing else ("param_min", "decrease")
        raise CalibrationError(
            f"calibrate: no parameter in [{lo}, {hi}] meets {name} <= {target:g}: even {end}={safe} gives "
            f"{name}={m_safe:.6g}. Widen the bracket: {verb} {end}."
        )
    if m_unsafe <= target:
        fine = measure(unsafe) if screen is not budget else m_unsafe
        if fine <= target:
            return CalibrateResult(unsafe, fine, True)

    converged = False
    stall = 0
    history = [(unsafe, m_unsafe), (safe, m_safe)]
    aim = target * (1.0 - tolerance / 2.0)
    # integers (e.g. steps) are searched to the exact boundary; floats to the tolerance
    def done() -> bool:
        return _adjacent(safe, unsafe, integer) or (not integer and m_safe >= target * (1.0 - tolerance))

    for _ in range(max_iterations):
        if done():
            converged = True
            break
        width = abs(unsafe - safe)
        x = _propose(safe, unsafe, m_safe, m_unsafe, history, aim, bisect=stall >= 2)
        if integer:
            x = int(round(x))
            if x == safe or x == unsafe:
                x = (safe + unsafe) // 2
        m_x = measure(x)
        history.append((x, m_x))
        if m_x <= target:
            safe, m_safe = x, m_x
        else:
            unsafe, m_unsafe = x, m_x
        stall = stall + 1 if abs(unsafe - safe) > width / 2.0 else 0
    else:
        converged = done()
    if unsafe == (lo if decreasing else hi) and screen is not budget:
        # the far end was only screened on the coarse grid: it may meet the budget after all
        fine = measure(unsafe)
        if fine <= target:
            return CalibrateResult(unsafe, fine, True)
    return CalibrateResult(safe, m_safe, converged)


def _coarse(budget: Budget) -> Budget:
    """The budget measured on a grid of about 1e-2 (a multiple of the budget's own grid)."""
    if budget.accountant != "pld" or budget.discretization >= 1e-2:
        return budget
    factor = max(1, round(1e-2 / budget.discretization))
    return dataclasses.replace(budget, discretization=budget.discretization * factor)


def _propose(
    s: float, u: float, m_s: float, m_u: float, history: list[tuple[float, float]], aim: float, bisect: bool
) -> float:
    """Next point strictly inside (s, u).

    A secant step through the two latest evaluations, in ``log(metric)`` vs ``log(param)``;
    if it leaves the bracket, regula falsi on the bracket ends; after repeated steps that
    fail to halve the bracket, a (geometric) bisection.
    """
    lo, hi = min(s, u), max(s, u)
    margin = 0.02 * (hi - lo)
    if not bisect:
        (x1, m1), (x2, m2) = history[-2:]
        narrow = lo > 0 and hi < 1.2 * lo
        pairs = [((x1, m1), (x2, m2)), ((s, m_s), (u, m_u))]
        if not (narrow or (m1 - aim) * (m2 - aim) < 0):
            pairs.reverse()  # far from the root: interpolate between the bracket ends first
        for (a, ma), (b, mb) in pairs:
            x = _loglog_root(a, ma, b, mb, aim)
            if x is not None and lo + margin < x < hi - margin:
                return x
    return _geometric_mid(s, u) if s > 0 and u > 0 else (s + u) / 2.0


def _loglog_root(x1: float, m1: float, x2: float, m2: float, aim: float) -> float | None:
    """Where the line through (x1, m1), (x2, m2) in log-log (or lin-log) space reaches ``aim``."""
    if not (m1 > 0 and m2 > 0 and math.isfinite(m1) and math.isfinite(m2)) or m1 == m2 or x1 == x2:
        return None
    logs = x1 > 0 and x2 > 0
    a, b = (math.log(x1), math.log(x2)) if logs else (x1, x2)
    t = (math.log(aim) - math.log(m1)) / (math.log(m2) - math.log(m1))
    x = a + t * (b - a)
    if logs:
        return math.exp(x) if x < 700 else None
    return x


def _geometric_mid(s: float, u: float) -> float:
    g = math.sqrt(s * u)
    return g if min(s, u) < g < max(s, u) else (s + u) / 2.0


def _adjacent(s: float | int, u: float | int, integer: bool) -> bool:
    if integer:
        return abs(u - s) <= 1
    return abs(u - s) <= 4.0 * math.ulp(max(abs(s), abs(u)))


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)
