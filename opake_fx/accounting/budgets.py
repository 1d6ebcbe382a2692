"""Privacy budgets: a target value of one privacy-loss metric.

A budget names the metric (epsilon at a fixed delta, or delta at a fixed epsilon), its
target, the unit of privacy it is about (``unit``: ``"example"`` or ``"user"``, what one
neighbouring data set adds or removes), and how to measure it (``accountant`` and
``discretization``), so that
:func:`~opake_fx.accounting.calibrate` and :class:`~opake_fx.accounting.Accountant`
measure a process the same way.

Example:
    >>> import opake_fx.accounting as acc
    >>> import opake_fx.dpsgd.accounting as dpsgd_acc
    >>> budget = acc.epsilon_budget(3.0, delta=1e-5)
    >>> budget.is_met_by(dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), 0.01) * 1000)
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Real
from typing import Any, ClassVar

from opake_fx._typecheck import typechecked
import opake_fx.validation as check
from opake_fx.accounting.pld import DEFAULT_DISCRETIZATION
from opake_fx.accounting.process import DpProcess
from opake_fx.errors import InputTypeError, InputValueError

__all__ = ["Budget", "EpsilonBudget", "DeltaBudget", "epsilon_budget", "delta_budget", "budget_from_dict", "UNITS"]

UNITS = ("example", "user")
"""The units of privacy a budget can be about: one example, or one user with all of their examples."""


@dataclass(frozen=True, kw_only=True)
class Budget:
    """Base class: a privacy-loss metric that must stay at or below :attr:`value`."""

    accountant: str = "pld"
    discretization: float = DEFAULT_DISCRETIZATION
    unit: str = "example"
    metric: ClassVar[str] = ""

    @property
    def per_unit(self) -> str:
        """``"per example"`` or ``"per user"``: how a report of this budget's metric names its unit."""
        return f"per {self.unit}"

    @property
    def value(self) -> float:
        """The target value of the budgeted metric."""
        raise NotImplementedError

    def measure(self, process: DpProcess) -> float:
        """The budgeted metric of ``process``."""
        raise NotImplementedError

    def measure_profile(self, profile: Any) -> float:
        """The budgeted metric read off an already composed profile.

        ``profile`` is anything with ``epsilon_at(delta)`` and ``delta_at(epsilon)``
        (an :class:`~opake_fx.accounting.IncrementalPld`, a ``PrivacyLossDistribution``),
        which lets the :class:`~opake_fx.accounting.Accountant` reuse its running
        composition instead of recomposing the whole history.

        Example:
            >>> import opake_fx.accounting as acc
            >>> import opake_fx.dpsgd.accounting as dpsgd_acc
            >>> running = acc.IncrementalPld().then(dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), 0.01) * 1000)
            >>> acc.epsilon_budget(3.0, delta=1e-5).measure_profile(running) <= 3.0
            True
        """
        raise NotImplementedError

    def is_met_by(self, process: DpProcess) -> bool:
        """True when ``process`` spends no more than the budget (metric <= value)."""
        if not isinstance(process, DpProcess):
            raise InputTypeError(f"is_met_by: expected a DpProcess; got {type(process).__name__}.")
        return self.measure(process) <= self.value

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-able data (see :func:`budget_from_dict`)."""
        raise NotImplementedError

    def _check_settings(self) -> None:
        if self.accountant not in ("pld", "rdp"):
            raise InputValueError(f"{type(self).__name__}: accountant must be 'pld' or 'rdp'; got {self.accountant!r}.")
        d = check.positive(self.discretization, "discretization", type(self).__name__)
        object.__setattr__(self, "discretization", d)
        check.choice(self.unit, "unit", type(self).__name__, UNITS)

    def _settings_dict(self) -> dict[str, Any]:
        """The measuring settings as plain data; ``unit`` only when it is not the default (the example)."""
        out: dict[str, Any] = {"accountant": self.accountant, "discretization": self.discretization}
        if self.unit != "example":
            out["unit"] = self.unit
        return out


@dataclass(frozen=True)
class EpsilonBudget(Budget):
    """Epsilon at a fixed ``delta`` must be <= ``epsilon``."""

    epsilon: float
    delta: float
    metric: ClassVar[str] = "epsilon"

    def __post_init__(self) -> None:
        e = check.non_negative(self.epsilon, "epsilon", "epsilon_budget", "Pass the target epsilon (>= 0).")
        object.__setattr__(self, "epsilon", e)
        object.__setattr__(self, "delta", check.delta(self.delta, "epsilon_budget"))
        self._check_settings()

    @property
    def value(self) -> float:
        return self.epsilon

    def measure(self, process: DpProcess) -> float:
        return process.epsilon_at(self.delta, accountant=self.accountant, discretization=self.discretization)

    def measure_profile(self, profile: Any) -> float:
        return float(profile.epsilon_at(self.delta))

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "epsilon",
            "epsilon": self.epsilon,
            "delta": self.delta,
            **self._settings_dict(),
        }


@dataclass(frozen=True)
class DeltaBudget(Budget):
    """Delta at a fixed ``epsilon`` must be <= ``delta``."""

    delta: float
    epsilon: float
    metric: ClassVar[str] = "delta"

    def __post_init__(self) -> None:
        object.__setattr__(self, "delta", check.delta(self.delta, "delta_budget"))
        e = check.non_negative(self.epsilon, "epsilon", "delta_budget", "Pass the epsilon at which delta is measured.")
        object.__setattr__(self, "epsilon", e)
        self._check_settings()

    @property
    def value(self) -> float:
        return self.delta

    def measure(self, process: DpProcess) -> float:
        return process.delta_at(self.epsilon, accountant=self.accountant, discretization=self.discretization)

    def measure_profile(self, profile: Any) -> float:
        return float(profile.delta_at(self.epsilon))

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "delta",
            "delta": self.delta,
            "epsilon": self.epsilon,
            **self._settings_dict(),
        }


@typechecked
def epsilon_budget(
    epsilon: Real,
    delta: Real,
    *,
    accountant: str = "pld",
    discretization: Real = DEFAULT_DISCRETIZATION,
    unit: str = "example",
) -> EpsilonBudget:
    """A budget of (``epsilon``, ``delta``)-DP: epsilon measured at ``delta``.

    Args:
        epsilon: target epsilon, >= 0.
        delta: in (0, 1).
        accountant: ``"pld"`` (default) or ``"rdp"``.
        discretization: PLD grid spacing used to measure epsilon.
        unit: ``"example"`` (default) or ``"user"``: the unit of privacy the epsilon is
            about (what the accountant's reports name; the measurement is the same).

    Example:
        >>> import opake_fx.accounting as acc
        >>> acc.epsilon_budget(3.0, delta=1e-5).value
        3.0
    """
    return EpsilonBudget(accountant=accountant, discretization=discretization, unit=unit, epsilon=epsilon, delta=delta)


@typechecked
def delta_budget(
    delta: Real,
    epsilon: Real,
    *,
    accountant: str = "pld",
    discretization: Real = DEFAULT_DISCRETIZATION,
    unit: str = "example",
) -> DeltaBudget:
    """A budget of (``epsilon``, ``delta``)-DP: delta measured at ``epsilon``.

    Example:
        >>> import opake_fx.accounting as acc
        >>> acc.delta_budget(1e-5, epsilon=2.0).value
        1e-05
    """
    return DeltaBudget(accountant=accountant, discretization=discretization, unit=unit, delta=delta, epsilon=epsilon)


@typechecked
def budget_from_dict(data: dict[str, Any]) -> Budget:
    """Inverse of :meth:`Budget.to_dict`."""
    if not isinstance(data, dict):
        raise InputTypeError(f"budget_from_dict: expected a dict; got {type(data).__name__}.")
    settings = {
        "accountant": data.get("accountant", "pld"),
        "discretization": data.get("discretization", DEFAULT_DISCRETIZATION),
        "unit": data.get("unit", "example"),
    }
    if data.get("type") == "epsilon":
        return epsilon_budget(data["epsilon"], data["delta"], **settings)
    if data.get("type") == "delta":
        return delta_budget(data["delta"], data["epsilon"], **settings)
    raise InputValueError(f"budget_from_dict: unknown budget type {data.get('type')!r}; expected 'epsilon' or 'delta'.")
