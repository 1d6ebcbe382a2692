"""``sampling="b_min_sep"``: an available example joins with a fixed probability, then rests ``min_sep - 1`` steps."""

from __future__ import annotations

from typing import Any

from opake_fx.errors import InputValueError
from opake_fx.planning.fields import PlanFields
from opake_fx.planning.participation import Participation
from opake_fx.planning.samplers.base import MIN_SEPARATION, SamplingScheme
from opake_fx.random import RngKey

__all__ = ["MinSepSampling", "min_separation_pattern"]


def min_separation_pattern(plan: PlanFields) -> Participation:
    """Participations at least ``min_sep`` steps apart, at most ``ceil(steps / min_sep)``, unamplified.

    Example:
        >>> from opake_fx.plan import DPPlan
        >>> min_separation_pattern(DPPlan(dataset_size=400, batch_size=20, steps=60, noise_multiplier=1.0,
        ...                               mechanism="blt", sampling="b_min_sep", min_sep=10))
        Participation(steps=60, min_sep=10, max_participations=6, amplified=False)
    """
    return Participation(plan.steps, plan.min_sep, -(-plan.steps // plan.min_sep), amplified=False)


class MinSepSampling(SamplingScheme):
    """b-min-sep sampling (warm-started, so the mean batch is ``batch_size`` from step 0).

    Privacy: no amplification is charged; the guaranteed pattern (participations at
    least ``min_sep`` apart) makes the whole run ``C x + z`` one Gaussian mechanism of the
    strategy's sensitivity under that pattern (the mechanism's accounting).

    Example:
        >>> from opake_fx.plan import DPPlan
        >>> plan = DPPlan(dataset_size=400, batch_size=20, steps=60, noise_multiplier=1.0,
        ...               mechanism="blt", sampling="b_min_sep", min_sep=10)
        >>> round(MinSepSampling().join_rate(plan), 4)  # N p / (1 + (min_sep - 1) p) = batch_size
        0.0909
    """

    name = "b_min_sep"
    accounting = MIN_SEPARATION
    uses_min_sep = True

    def check(self, plan: PlanFields, batch_size: float) -> None:
        n, min_sep = plan.dataset_size, plan.min_sep
        if batch_size * min_sep > n:
            raise InputValueError(
                f"DPPlan: batch_size * min_sep = {batch_size * min_sep} exceeds dataset_size={n}: with each example "
                f"resting min_sep - 1 = {min_sep - 1} steps after it joins, the expected batch cannot reach "
                f"{batch_size}. Use a smaller min_sep or batch."
            )

    def participation(self, plan: PlanFields) -> Participation:
        return min_separation_pattern(plan)

    def build(self, plan: PlanFields, shard: range, key: RngKey, world_size: int) -> Any:
        from opake_fx.dpftrl.sampling import MinSepSampler

        return MinSepSampler(shard, sample_rate=self.join_rate(plan), min_sep=plan.min_sep, n_steps=plan.steps,
                             key=key, warm_start=True)

    def join_rate(self, plan: PlanFields) -> float:
        """The join probability ``p`` of an available example: the stationary mean batch
        ``N p / (1 + (min_sep - 1) p)`` is ``batch_size``."""
        b = plan.batch_size
        return min(1.0, b / (plan.dataset_size - (plan.min_sep - 1) * b))
