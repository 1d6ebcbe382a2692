"""calibrate: the parameter value that spends a privacy budget, on its safe side.

``calibrate(budget, fn)`` needs no bracket. Which way the privacy loss moves is known
from what the parameter is (``param=``): a noise multiplier makes it fall (the answer is
the *smallest* value meeting the budget), a sample rate or a number of steps makes it
rise (the answer is the *largest*). The search starts inside a default range (noise
multiplier 0.05 to 1000, sample rate 1e-7 to 1, steps 1 to 10**7), walks outward until
it holds a point that meets the budget and one that does not, then narrows that bracket.
``param_min``/``param_max`` still narrow the range (or give a bracket whose direction is
read off its two ends, as before).

Soundness: every candidate is measured on its own, with the budget's accountant and
grid; the PLD engine coarsens a grid only where that candidate's composition would not
fit, and stays pessimistic. No candidate is ever judged by a grid chosen for another one:
a grid coarse enough to be cheap for a small noise multiplier is wildly pessimistic for
a large one (sigma=200, q=1e-5, 1e5 steps: epsilon 867 on a 1e-2 grid, 0.003 on the
default 1e-4), which is how a coarse screen once concluded that epsilon grows with sigma.
The search keeps a bracket ``[safe, unsafe]`` whose safe end has been measured to meet
the budget and returns that end, so the result is never under-noised, even where the
measured metric is not monotone (a grid's pessimism can grow with the parameter).
Between the ends it interpolates ``log(metric)`` against ``log(param)`` (near-linear for
noise multipliers and step counts) and falls back to bisection whenever an interpolation
step does not halve the bracket. Integer parameters give an integer answer.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

from opake_fx._typecheck import typechecked
import opake_fx.validation as check
from opake_fx.accounting.budgets import Budget
from opake_fx.accounting.process import DpProcess
from opake_fx.errors import CalibrationError, InputTypeError, InputValueError

__all__ = ["CalibrateResult", "calibrate", "PARAMETER_RANGES"]


@dataclass(frozen=True)
class _Kind:
    lo: float | int
    hi: float | int
    start: float | int
    decreasing: bool  # True: the privacy loss falls as the parameter grows
    integer: bool


_KINDS: dict[str, _Kind] = {
    "noise_multiplier": _Kind(0.05, 1000.0, 1.0, decreasing=True, integer=False),
    "sample_rate": _Kind(1e-7, 1.0, 1e-2, decreasing=False, integer=False),
    "steps": _Kind(1, 10**7, 1000, decreasing=False, integer=True),
}

PARAMETER_RANGES: dict[str, tuple[float | int, float | int]] = {k: (v.lo, v.hi) for k, v in _KINDS.items()}
"""The default search range of each ``param`` kind of :func:`calibrate` (read-only by convention)."""


@dataclass(frozen=True)
class CalibrateResult:
    """The outcome of :func:`calibrate`.

    Attributes:
        param: the calibrated parameter (an int for integer parameters); it meets the budget.
        achieved: the budgeted metric at ``param`` (<= the budget's value), measured with
            the budget's accountant and grid.
        converged: True when ``achieved`` is within ``tolerance`` (relative) of the
            budget (float parameters), when no representable parameter lies between the
            safe and the unsafe end (always the case for a finished integer search), or
            when the whole range meets the budget (``param`` is then the range end that
            spends the most); False only if ``max_iterations`` ran out first.
        evaluations: how many processes were measured.
    """

    param: float | int
    achieved: float
    converged: bool
    evaluations: int = 0


@typechecked
def calibrate(
    budget: Budget,
    fn: Callable[[Any], DpProcess],
    param_min: Real | None = None,
    param_max: Real | None = None,
    *,
    param: str | None = None,
    tolerance: Real = 1e-3,
    max_iterations: Integral = 60,
) -> CalibrateResult:
    """Finds the parameter at which ``fn(param)`` spends ``budget``, never beyond it.

    Args:
        budget: e.g. ``epsilon_budget(3.0, delta=1e-5)``; its accountant and
            discretization are used for every evaluation.
        fn: maps a parameter value to a DpProcess (noise multiplier, sample rate, steps...).
            Its true privacy loss must be monotone in the parameter.
        param_min, param_max: optional ends of the search range. With both and no
            ``param``, they are a bracket whose two ends tell the direction (both ints: an
            integer parameter). Otherwise they replace the default range's ends.
        param: what the parameter is: ``"noise_multiplier"`` (the default when no
            bracket is given; range 0.05 to 1000), ``"sample_rate"`` (1e-7 to 1) or
            ``"steps"`` (integers, 1 to 10**7). See :data:`PARAMETER_RANGES`.
        tolerance: relative gap to the budget at which a float search stops: the result
            satisfies ``value * (1 - tolerance) <= achieved <= value`` when reachable.
            Integer searches always end at the exact boundary (``param + 1`` exceeds).
        max_iterations: evaluations allowed to narrow the bracket once it is found.

    Returns:
        A :class:`CalibrateResult` whose ``param`` meets the budget.

    Raises:
        CalibrationError: no parameter in the range meets the budget (the message says
            which end to widen), the metric is the same at both ends of a bracket, or it
            moves against the direction that ``param`` implies (a wrong ``param``).
        InputValueError: a bad range, tolerance or ``param``.

    Privacy contract: the returned parameter meets the budget as measured by the
    budget's accountant and grid (as :class:`~opake_fx.accounting.Accountant` measures
    it); it is never on the violating side of the root.

    Example:
        >>> import opake_fx.accounting as acc
        >>> import opake_fx.dpsgd.accounting as dpsgd_acc
        >>> result = acc.calibrate(
        ...     acc.epsilon_budget(3.0, delta=1e-5),
        ...     lambda nm: dpsgd_acc.poisson(dpsgd_acc.gaussian(nm), 64 / 10_000) * 500)
        >>> round(result.param, 2), result.achieved <= 3.0
        (0.66, True)
        >>> steps = acc.calibrate(acc.epsilon_budget(3.0, delta=1e-5),
        ...     lambda t: dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), 0.01) * t, param="steps")
        >>> isinstance(steps.param, int)
        True
    """
    if not isinstance(budget, Budget):
        raise InputTypeError(f"calibrate: budget must come from epsilon_budget/delta_budget; got {type(budget).__name__}.")
    if not callable(fn):
        raise InputTypeError(f"calibrate: fn must be callable (param -> DpProcess); got {type(fn).__name__}.")
    if param is not None and param not in _KINDS:
        raise InputValueError(f"calibrate: param must be one of {sorted(_KINDS)}; got {param!r}.")
    tolerance = check.positive(tolerance, "tolerance", "calibrate")
    if tolerance >= 1.0:
        raise InputValueError(f"calibrate: tolerance is relative and must be < 1; got {tolerance}.")
    max_iterations = check.integer(max_iterations, "max_iterations", "calibrate", 1)

    search = _Search(budget, fn, tolerance)
    if param is None and param_min is not None and param_max is not None:
        integer = _is_int(param_min) and _is_int(param_max)
        lo, hi = _range(param_min, param_max, integer)
        return search.from_bracket(lo, hi, integer, max_iterations)
    kind = _KINDS[param or "noise_multiplier"]
    lo, hi = _range(
        kind.lo if param_min is None else param_min, kind.hi if param_max is None else param_max, kind.integer
    )
    if not lo > 0:
        raise InputValueError(
            f"calibrate: param_min must be > 0 for a search without a bracket (it walks geometrically); got {lo}. "
            "Pass both param_min and param_max to search a bracket that starts at or below 0."
        )
    start = min(max(kind.start, lo), hi)
    return search.outward(lo, hi, start, kind, param or "noise_multiplier", max_iterations)


class _Search:
    """One calibration: measures candidates with the budget's settings and narrows a bracket."""

    def __init__(self, budget: Budget, fn: Callable[[Any], DpProcess], tolerance: float) -> None:
        self.budget, self.fn, self.tolerance = budget, fn, tolerance
        self.target, self.name = budget.value, budget.metric
        self.evaluations = 0
        self.seen: dict[float | int, float] = {}

    def measure(self, p: float | int) -> float:
        if p in self.seen:
            return self.seen[p]
        process = self.fn(p)
        if not isinstance(process, DpProcess):
            raise InputTypeError(f"calibrate: fn({p!r}) returned {type(process).__name__}, not a DpProcess.")
        self.evaluations += 1
        self.seen[p] = float(self.budget.measure(process))
        return self.seen[p]

    def result(self, p: float | int, m: float, converged: bool) -> CalibrateResult:
        return CalibrateResult(p, m, converged, self.evaluations)

    def from_bracket(self, lo: float | int, hi: float | int, integer: bool, max_iterations: int) -> CalibrateResult:
        """A user bracket without ``param``: the direction is read off the metric, then the walk runs inside it.

        The direction comes from two interior points (the geometric middle and twice it),
        each measured on its own grid; the ends are measured only when the walk reaches
        them, or when the two interior points do not differ.
        """
        if lo > 0:
            g = math.sqrt(lo * hi)
            g = min(max(int(round(g)), lo), hi) if integer else g
            h = min(g * 2, hi) if g * 2 <= hi or g == lo else max(g / 2, lo)
            h = min(max(int(round(h)), lo), hi) if integer else h
            if h == g:
                h = hi if g != hi else lo
            a, b = sorted((g, h))
            m_a, m_b = self.measure(a), self.measure(b)
        else:
            a, b, m_a, m_b = lo, hi, self.measure(lo), self.measure(hi)
        if m_a == m_b and (a, b) != (lo, hi):
            a, b, m_a, m_b = lo, hi, self.measure(lo), self.measure(hi)
        if m_a == m_b:
            raise CalibrationError(
                f"calibrate: {self.name} is {m_a:.6g} at both param_min={lo} and param_max={hi}; the parameter "
                "does not change the privacy of fn(param) over this bracket, so there is nothing to calibrate."
            )
        kind = _Kind(lo, hi, a, decreasing=m_a > m_b, integer=integer)
        if lo <= 0:  # no geometric walk: the two measured ends are the bracket
            return self.bracket_ends(lo, m_a, hi, m_b, kind, max_iterations)
        return self.outward(lo, hi, a, kind, "parameter", max_iterations)

    def bracket_ends(
        self, lo: float | int, m_lo: float, hi: float | int, m_hi: float, kind: _Kind, max_iterations: int
    ) -> CalibrateResult:
        (safe, m_safe), (unsafe, m_unsafe) = ((hi, m_hi), (lo, m_lo)) if kind.decreasing else ((lo, m_lo), (hi, m_hi))
        if not m_safe <= self.target:
            end, verb = ("param_max", "increase") if kind.decreasing else ("param_min", "decrease")
            raise CalibrationError(
                f"calibrate: no parameter in [{lo}, {hi}] meets {self.name} <= {self.target:g}: even {end}={safe} "
                f"gives {self.name}={m_safe:.6g}. Widen the bracket: {verb} {end}."
            )
        if m_unsafe <= self.target:
            return self.result(unsafe, m_unsafe, True)
        return self.narrow(safe, m_safe, unsafe, m_unsafe, kind.integer, max_iterations)

    def outward(
        self, lo: float | int, hi: float | int, start: float | int, kind: _Kind, label: str, max_iterations: int
    ) -> CalibrateResult:
        """From ``start``, walks toward the side that can fix the current verdict until the budget is bracketed."""
        x, m = start, self.measure(start)
        met = m <= self.target
        # Moving toward `far` spends more privacy when the current point meets the budget
        # (to find where it stops meeting it), less when it does not.
        spend_more_at_hi = not kind.decreasing
        far = (hi if spend_more_at_hi else lo) if met else (lo if spend_more_at_hi else hi)
        previous: tuple[float | int, float] | None = None
        min_factor = 2.0  # doubles on every step of the walk, so a long walk takes O(log log) steps
        while True:
            if x == far:
                if met:
                    return self.result(x, m, True)  # the whole range meets the budget
                end = "param_max" if far == hi else "param_min"
                verb = "increase" if far == hi else "decrease"
                raise CalibrationError(
                    f"calibrate: no {label} in [{lo}, {hi}] meets {self.name} <= {self.target:g}: even {end}={far} "
                    f"gives {self.name}={m:.6g}. Widen the range: {verb} {end} (pass it to calibrate), or relax "
                    "the budget. A budget this close to 0 may also be below what the accountant's grid can "
                    "certify: a finer discretization in the budget measures less pessimistically."
                )
            nxt = _step_toward(x, far, m, previous, self.target, kind.integer, min_factor)
            min_factor = min(2.0 * min_factor, 100.0)
            m_nxt = self.measure(nxt)
            self._check_direction(x, m, nxt, m_nxt, kind, label)
            previous = (x, m)
            if (m_nxt <= self.target) == met:
                x, m = nxt, m_nxt
                continue
            safe, m_safe, unsafe, m_unsafe = (x, m, nxt, m_nxt) if met else (nxt, m_nxt, x, m)
            return self.narrow(safe, m_safe, unsafe, m_unsafe, kind.integer, max_iterations)

    def _check_direction(self, x: Any, m: float, y: Any, m_y: float, kind: _Kind, label: str) -> None:
        # A larger parameter must not spend noticeably more (decreasing kinds) or less
        # (increasing kinds); otherwise `param` does not describe what fn's argument is.
        (a, m_a), (b, m_b) = sorted([(x, m), (y, m_y)], key=lambda t: t[0])
        wrong = m_b > m_a * (1 + 1e-6) if kind.decreasing else m_b < m_a * (1 - 1e-6)
        if wrong and math.isfinite(m_a) and math.isfinite(m_b):
            trend = "grows" if kind.decreasing else "falls"
            raise CalibrationError(
                f"calibrate: {self.name} {trend} from {m_a:.6g} at {a} to {m_b:.6g} at {b}, but param={label!r} "
                f"means a larger value is {'more' if kind.decreasing else 'less'} private. Pass the param that "
                f"fn's argument is ({sorted(_KINDS)}), or an explicit bracket param_min, param_max."
            )

    def narrow(
        self,
        safe: float | int,
        m_safe: float,
        unsafe: float | int,
        m_unsafe: float,
        integer: bool,
        max_iterations: int,
    ) -> CalibrateResult:
        """Shrinks ``[safe, unsafe]`` (safe meets the budget, unsafe does not); returns the safe end."""
        target, tolerance = self.target, self.tolerance
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
            m_x = self.measure(x)
            history.append((x, m_x))
            if m_x <= target:
                safe, m_safe = x, m_x
            else:
                unsafe, m_unsafe = x, m_x
            stall = stall + 1 if abs(unsafe - safe) > width / 2.0 else 0
        else:
            converged = done()
        return self.result(safe, m_safe, converged)


def _range(a: Any, b: Any, integer: bool) -> tuple[float | int, float | int]:
    if integer:
        if not (_is_int(a) and _is_int(b)):
            raise InputTypeError(f"calibrate: an integer parameter needs int param_min/param_max; got {a!r}, {b!r}.")
        lo, hi = int(a), int(b)
    else:
        lo, hi = check.real(a, "param_min", "calibrate"), check.real(b, "param_max", "calibrate")
    if not (math.isfinite(lo) and math.isfinite(hi)) or not lo < hi:
        raise InputValueError(f"calibrate: need finite param_min < param_max; got [{a}, {b}].")
    return lo, hi


def _step_toward(
    x: float | int,
    far: float | int,
    m: float,
    previous: tuple[float | int, float] | None,
    target: float,
    integer: bool,
    min_factor: float,
) -> float | int:
    """The next point of the outward walk from ``x`` toward ``far``.

    A factor ``min_factor`` first; then the log-log extrapolation through the last two
    points to the target, overshot by 1.5x and kept between ``min_factor`` and 100x of
    ``x``; never past ``far``.
    """
    up = far > x
    factor = min_factor
    if previous is not None:
        root = _loglog_root(previous[0], previous[1], x, m, target)
        if root is not None and root > 0 and (root > x) == up:
            ratio = (root / x) if up else (x / root)
            factor = min(max(1.5 * ratio, min_factor), 100.0)
    nxt = x * factor if up else x / factor  # x > 0: outward ranges are positive (see calibrate)
    nxt = min(nxt, far) if up else max(nxt, far)
    if integer:
        nxt = int(math.ceil(nxt)) if up else int(math.floor(nxt))
        if nxt == x:
            nxt = x + 1 if up else x - 1
    return nxt


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
