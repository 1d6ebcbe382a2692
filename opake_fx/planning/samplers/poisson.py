"""``sampling="poisson"``: every example joins every step with probability ``sample_rate``."""

from __future__ import annotations

from typing import Any

from opake_fx.planning.fields import PlanFields
from opake_fx.planning.samplers.base import EVERY_STEP, SamplingScheme
from opake_fx.random import RngKey

__all__ = ["PoissonSampling"]


class PoissonSampling(SamplingScheme):
    """Poisson sampling: one amplified opportunity per step (DP-SGD's accounting).

    Privacy: each step is ``poisson(mechanism, sample_rate)`` (add-or-remove-one),
    composed over the steps.

    Example:
        >>> from opake_fx.dpsgd.accounting import gaussian
        >>> PoissonSampling().amplify_at(gaussian(1.0), 0.01)
        PoissonSampled(inner=Gaussian(noise_multiplier=1.0), sample_rate=0.01)
    """

    name = "poisson"
    accounting = EVERY_STEP

    def build(self, plan: PlanFields, shard: range, key: RngKey, world_size: int) -> Any:
        from opake_fx.dpsgd.sampling import PoissonSampler

        return PoissonSampler(shard, sample_rate=plan.sample_rate, n_steps=plan.steps, key=key)

    def amplify(self, plan: PlanFields, opportunity: Any) -> Any:
        return self.amplify_at(opportunity, plan.sample_rate)

    def amplify_at(self, opportunity: Any, sample_rate: float) -> Any:
        """``opportunity`` Poisson-subsampled at ``sample_rate`` (also what ``privacy_report`` charges)."""
        from opake_fx.dpsgd.accounting import poisson

        return poisson(opportunity, sample_rate)
