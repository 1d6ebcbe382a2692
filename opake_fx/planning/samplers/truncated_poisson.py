"""``sampling="truncated_poisson"``: Poisson batches capped at ``max_batch_size``."""

from __future__ import annotations

from typing import Any

from opake_fx.errors import InputValueError
from opake_fx.planning.fields import PlanFields
from opake_fx.planning.samplers.base import EVERY_STEP, SamplingScheme
from opake_fx.random import RngKey

__all__ = ["TruncatedPoissonSampling"]


class TruncatedPoissonSampling(SamplingScheme):
    """Poisson sampling whose batches are cut at ``max_batch_size`` (fixed-shape batches).

    Privacy: each step is ``truncated_poisson(mechanism, sample_rate, dataset_size,
    max_batch_size)``: the cap is part of the mechanism, so the accounting charges it.
    The cap is of the whole batch, so one process draws it: refused under a process group.

    Example:
        >>> from opake_fx.plan import DPPlan
        >>> plan = DPPlan(dataset_size=100, batch_size=10, steps=5, noise_multiplier=1.0,
        ...               sampling="truncated_poisson", max_batch_size=16)
        >>> TruncatedPoissonSampling().largest_batch(plan)
        16
    """

    name = "truncated_poisson"
    accounting = EVERY_STEP
    uses_max_batch_size = True

    def build(self, plan: PlanFields, shard: range, key: RngKey, world_size: int) -> Any:
        from opake_fx.dpsgd.sampling import TruncatedPoissonSampler

        if world_size > 1:
            raise InputValueError(
                "DPPlan: sampling='truncated_poisson' caps the whole batch, which ranks sampling their shards "
                "independently cannot do; use sampling='poisson' under a process group."
            )
        return TruncatedPoissonSampler(shard, sample_rate=plan.sample_rate, n_steps=plan.steps, key=key,
                                       max_batch_size=plan.max_batch_size)

    def amplify(self, plan: PlanFields, opportunity: Any) -> Any:
        from opake_fx.dpsgd.accounting import truncated_poisson

        return truncated_poisson(opportunity, plan.sample_rate, plan.dataset_size, plan.max_batch_size)

    def largest_batch(self, plan: PlanFields) -> int:
        return plan.max_batch_size or plan.dataset_size
