"""Accountant: the privacy spent so far, checked against a budget before every step.

Example:
    >>> import opake_fx.accounting as acc
    >>> import opake_fx.dpsgd.accounting as dpsgd_acc
    >>> acct = acc.Accountant(acc.epsilon_budget(1.0, delta=1e-5))
    >>> step = dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), 0.01)
    >>> acct |= step * 100
    >>> acct.remaining_steps(step)
    154
"""

from __future__ import annotations

from typing import Any

from opake_fx._typecheck import typechecked
from opake_fx.accounting.budgets import Budget, budget_from_dict
# _compose/_repeat: compose/repeat without their signature check; step() runs once per
# training step and checks its own argument.
from opake_fx.accounting.process import DpProcess, _compose, _repeat, identity, process_from_dict
from opake_fx.errors import BudgetExceededError, InputTypeError, InputValueError

__all__ = ["Accountant"]

_STATE_VERSION = 1


class Accountant:
    """Tracks the composition of every step taken and refuses steps that would exceed the budget.

    Privacy contract: after any sequence of successful :meth:`step` calls, ``spent``
    meets ``budget`` (as measured by the budget's accountant). A refused step raises
    :class:`~opake_fx.errors.BudgetExceededError` and leaves the accountant unchanged, so
    the caller must not release that step's output.

    Args:
        budget: from :func:`epsilon_budget` or :func:`delta_budget`.
        spent: what was already spent (default: nothing); it must meet the budget.
    """

    @typechecked
    def __init__(self, budget: Budget, spent: DpProcess | None = None) -> None:
        if not isinstance(budget, Budget):
            raise InputTypeError(f"Accountant: budget must come from epsilon_budget/delta_budget; got {type(budget).__name__}.")
        spent = identity() if spent is None else spent
        if not isinstance(spent, DpProcess):
            raise InputTypeError(f"Accountant: spent must be a DpProcess; got {type(spent).__name__}.")
        self._budget = budget
        self._spent = spent
        # (process, n): n more runs of `process` fit on top of `spent` (computed once when
        # the same process is stepped twice in a row, so long runs are checked in O(1))
        self._headroom: tuple[DpProcess, int] | None = None
        self._last: DpProcess | None = None

    @property
    def budget(self) -> Budget:
        """The budget every step is checked against."""
        return self._budget

    @property
    def spent(self) -> DpProcess:
        """The composition of all steps taken so far."""
        return self._spent

    @property
    def budget_exceeded(self) -> bool:
        """True if ``spent`` does not meet the budget (only possible via the constructor)."""
        return not self._budget.is_met_by(self._spent)

    def spent_epsilon(self, delta: float) -> float:
        """Epsilon spent so far at ``delta`` (with the budget's accountant and grid)."""
        return self._spent.epsilon_at(delta, accountant=self._budget.accountant, discretization=self._budget.discretization)

    def spent_delta(self, epsilon: float) -> float:
        """Delta spent so far at ``epsilon`` (with the budget's accountant and grid)."""
        return self._spent.delta_at(epsilon, accountant=self._budget.accountant, discretization=self._budget.discretization)

    def would_exceed(self, process: DpProcess) -> bool:
        """True if taking ``process`` now would exceed the budget (nothing changes)."""
        process = _checked(process)
        if self._headroom is not None and self._headroom[0] == process:
            return self._headroom[1] < 1
        return not self._budget.is_met_by(_compose(self._spent, process))

    def step(self, process: DpProcess) -> None:
        """Records ``process`` as spent.

        The first steps are checked directly; from the second consecutive step of the same
        process on, the accountant computes once how many more of it fit
        (:meth:`remaining_steps`) and counts down, so long training runs are cheap.

        Raises:
            BudgetExceededError: the step would exceed the budget; nothing is recorded.
        """
        process = _checked(process)
        if self._headroom is None and process == self._last and process._components():
            self._headroom = (process, self.remaining_steps(process))
        if self._headroom is not None and self._headroom[0] == process:
            fits = self._headroom[1] >= 1
        else:
            self._headroom = None
            fits = self._budget.is_met_by(_compose(self._spent, process))
        if not fits:
            after = _compose(self._spent, process)
            value = self._budget.measure(after)
            raise BudgetExceededError(
                f"Accountant: taking {process!r} would spend {self._budget.metric}={value:.6g} > budget "
                f"{self._budget.value:g}; the step was not recorded. Do not release its output: stop "
                "training, or add noise / use fewer steps."
            )
        self._spent = _compose(self._spent, process)
        self._last = process
        if self._headroom is not None:
            self._headroom = (process, self._headroom[1] - 1)

    def __ior__(self, process: DpProcess) -> Accountant:
        self.step(process)
        return self

    def __or__(self, process: DpProcess) -> Accountant:
        """A new accountant with ``process`` recorded (this one is unchanged)."""
        out = Accountant(self._budget, self._spent)
        out.step(process)
        return out

    def remaining_steps(self, process: DpProcess, *, limit: int = 10**9) -> int:
        """How many more runs of ``process`` fit in the budget (at most ``limit``).

        Raises:
            InputValueError: ``process`` spends no privacy (the answer would be unbounded).
        """
        process = _checked(process)
        if not process._components():
            raise InputValueError(
                "remaining_steps: the process spends no privacy, so any number of steps fits."
            )

        def fits(k: int) -> bool:
            return self._budget.is_met_by(_compose(self._spent, _repeat(process, k)))

        if not fits(1):
            return 0
        good, bad = 1, 2
        while bad <= limit and fits(bad):
            good, bad = bad, bad * 2
        if bad > limit:
            if fits(limit):
                return limit
            bad = limit
        while bad - good > 1:
            mid = (good + bad) // 2
            good, bad = (mid, bad) if fits(mid) else (good, mid)
        return good

    def state_dict(self) -> dict[str, Any]:
        """Plain, JSON-able state: ``{"version", "budget", "spent"}``."""
        return {"version": _STATE_VERSION, "budget": self._budget.to_dict(), "spent": self._spent.to_dict()}

    @classmethod
    @typechecked
    def from_state_dict(cls, state: dict[str, Any]) -> Accountant:
        """Rebuilds an accountant from :meth:`state_dict` output."""
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise InputValueError(
                f"Accountant.from_state_dict: expected a state_dict of version {_STATE_VERSION}; got {state!r:.200}."
            )
        return cls(budget_from_dict(state["budget"]), process_from_dict(state["spent"]))

    def __repr__(self) -> str:
        return f"Accountant(budget={self._budget!r}, spent={self._spent!r})"


def _checked(process: object) -> DpProcess:
    if not isinstance(process, DpProcess):
        raise InputTypeError(f"Accountant: expected a DpProcess step; got {type(process).__name__}.")
    return process
