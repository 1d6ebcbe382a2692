"""``mechanism="band_mf"``: DP-FTRL with an optimised ``bands``-banded strategy."""

from __future__ import annotations

from typing import Any

from opake_fx.planning.fields import PlanFields
from opake_fx.planning.mechanisms.strategy import StrategyMechanism
from opake_fx.planning.samplers.base import CYCLIC, MIN_SEPARATION


__all__ = ["BandMFMechanism"]


class BandMFMechanism(StrategyMechanism):
    """BandMF: ``band_mf_strategy(steps, bands)``; under cyclic Poisson (amplified) or a
    min-separation scheme (see :class:`~opake_fx.planning.mechanisms.strategy.StrategyMechanism`).

    Example:
        >>> sorted(BandMFMechanism.accounts)
        ['cyclic', 'min_separation']
    """

    name = "band_mf"
    accounts = frozenset({CYCLIC, MIN_SEPARATION})
    needs_bands = True

    def strategy(self, plan: PlanFields) -> Any:
        from opake_fx.dpftrl import band_mf_strategy

        return band_mf_strategy(plan.steps, plan.bands)
