"""``mechanism="blt"``: DP-FTRL with a buffered linear Toeplitz strategy optimised for the plan's pattern."""

from __future__ import annotations

from typing import Any

from opake_fx.planning.fields import PlanFields
from opake_fx.planning.mechanisms.strategy import StrategyMechanism
from opake_fx.planning.samplers.base import MIN_SEPARATION


__all__ = ["BLTMechanism"]


class BLTMechanism(StrategyMechanism):
    """BLT: ``blt_strategy(steps, min_sep=..., max_participations=...)`` for the plan's
    :attr:`~opake_fx.plan.DPPlan.participation`; min-separation schemes only (a BLT is not
    banded, so the amplified cyclic accounting does not apply).

    Example:
        >>> sorted(BLTMechanism.accounts)
        ['min_separation']
    """

    name = "blt"
    accounts = frozenset({MIN_SEPARATION})

    def strategy(self, plan: PlanFields) -> Any:
        from opake_fx.dpftrl import blt_strategy

        p = plan.participation
        return blt_strategy(plan.steps, min_sep=p.min_sep, max_participations=p.max_participations)
