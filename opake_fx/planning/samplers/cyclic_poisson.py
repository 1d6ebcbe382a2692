"""``sampling="cyclic_poisson"``: ``bands`` keyed groups, step ``t`` Poisson-samples group ``t mod bands``."""

from __future__ import annotations

from typing import Any

import opake_fx.validation as check
from opake_fx.errors import InputValueError
from opake_fx.planning.fields import PlanFields
from opake_fx.planning.participation import Participation
from opake_fx.planning.samplers.base import CYCLIC, SamplingScheme
from opake_fx.random import RngKey

__all__ = ["CyclicPoissonSampling"]


class CyclicPoissonSampling(SamplingScheme):
    """Cyclic Poisson sampling (Amplified BandMF): an example's group is active every
    ``bands`` steps, where it joins with probability :attr:`~opake_fx.plan.DPPlan.group_rate`.

    Privacy: with a strategy of at most ``bands`` bands, the rows of ``C x + z`` that an
    example's opportunities touch are disjoint, so the run is ``ceil(steps / bands)``
    composed ``poisson(opportunity, group_rate)`` (Choquette-Choo et al. 2023, Thm. 4),
    charged at steps ``0, bands, 2 * bands, ...`` (the worst-placed example's group).

    Example:
        >>> from opake_fx.plan import DPPlan
        >>> plan = DPPlan(dataset_size=120, batch_size=10, steps=7, noise_multiplier=1.0,
        ...               mechanism="bsr", sampling="cyclic_poisson", bands=3)
        >>> scheme = CyclicPoissonSampling()
        >>> scheme.participation(plan), scheme.opportunities(plan, 7)
        (Participation(steps=7, min_sep=3, max_participations=1, amplified=True), 3)
    """

    name = "cyclic_poisson"
    accounting = CYCLIC
    needs_bands = True

    def check(self, plan: PlanFields, batch_size: float) -> None:
        bands = plan.bands
        if bands is not None and batch_size * bands > plan.dataset_size:
            raise InputValueError(
                f"DPPlan: batch_size * bands = {batch_size * bands} exceeds dataset_size={plan.dataset_size}: each of "
                f"the {bands} groups cannot supply the expected batch. Use fewer bands or a smaller batch."
            )

    def participation(self, plan: PlanFields) -> Participation:
        return Participation(plan.steps, plan.bands, 1, amplified=True)

    def build(self, plan: PlanFields, shard: range, key: RngKey, world_size: int) -> Any:
        from opake_fx.dpftrl.sampling import CyclicPoissonSampler

        return CyclicPoissonSampler(shard, sample_rate=plan.group_rate, partitions=plan.bands, n_steps=plan.steps,
                                    key=key)

    def amplify(self, plan: PlanFields, opportunity: Any) -> Any:
        from opake_fx.dpsgd.accounting import poisson

        return poisson(opportunity, check.probability(plan.group_rate, "sample_rate", "poisson"))

    def has_opportunity(self, plan: PlanFields, step: int) -> bool:
        return step % plan.bands == 0

    def opportunities(self, plan: PlanFields, steps: int) -> int:
        return -(-steps // plan.bands)  # ceil(steps / bands)
