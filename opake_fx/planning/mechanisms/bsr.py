"""``mechanism="bsr"``: DP-FTRL with the banded square root strategy, ``bands`` wide."""

from __future__ import annotations

from typing import Any

from opake_fx.planning.fields import PlanFields
from opake_fx.planning.mechanisms.strategy import StrategyMechanism
from opake_fx.planning.samplers.base import CYCLIC, MIN_SEPARATION


__all__ = ["BSRMechanism"]


class BSRMechanism(StrategyMechanism):
    """Banded square root: ``bsr_strategy(steps, bands)``; under cyclic Poisson (amplified)
    or a min-separation scheme (see :class:`~opake_fx.planning.mechanisms.strategy.StrategyMechanism`).

    Example:
        >>> BSRMechanism.needs_bands
        True
    """

    name = "bsr"
    accounts = frozenset({CYCLIC, MIN_SEPARATION})
    needs_bands = True

    def strategy(self, plan: PlanFields) -> Any:
        from opake_fx.dpftrl import bsr_strategy

        return bsr_strategy(plan.steps, plan.bands)
