"""``sampling="balls_in_bins"``: each example in one of ``min_sep`` keyed bins, each bin used every ``min_sep`` steps."""

from __future__ import annotations

import math
from typing import Any

from opake_fx.errors import InputValueError
from opake_fx.planning.fields import PlanFields
from opake_fx.planning.participation import Participation
from opake_fx.planning.samplers.b_min_sep import min_separation_pattern
from opake_fx.planning.samplers.base import MIN_SEPARATION, SamplingScheme
from opake_fx.random import RngKey

__all__ = ["BallsInBinsSampling"]


class BallsInBinsSampling(SamplingScheme):
    """Balls-in-bins sampling: ``min_sep`` bins cycled through, the expected batch
    ``dataset_size / min_sep`` (derived when the plan gives no batch size).

    Privacy: as :class:`~opake_fx.planning.samplers.b_min_sep.MinSepSampling`: no
    amplification charged, the whole run one Gaussian mechanism over participations
    ``min_sep`` apart.

    Example:
        >>> BallsInBinsSampling().default_batch_size(1000, 10)
        100.0
    """

    name = "balls_in_bins"
    accounting = MIN_SEPARATION
    uses_min_sep = True

    def default_batch_size(self, dataset_size: int, min_sep: int | None) -> float | None:
        return dataset_size / min_sep  # every example once per cycle of min_sep bins

    def check(self, plan: PlanFields, batch_size: float) -> None:
        n, min_sep = plan.dataset_size, plan.min_sep
        if min_sep > plan.steps:
            raise InputValueError(
                f"DPPlan: min_sep={min_sep} bins exceed steps={plan.steps}: the examples of the unused bins would "
                "never be seen. Use at most `steps` bins."
            )
        if not math.isclose(batch_size, n / min_sep, rel_tol=1e-9):
            raise InputValueError(
                f"DPPlan: balls_in_bins with min_sep={min_sep} bins has expected batch size dataset_size / min_sep "
                f"= {n / min_sep}, not batch_size={batch_size}; leave batch_size out (it is derived) or change min_sep."
            )

    def participation(self, plan: PlanFields) -> Participation:
        return min_separation_pattern(plan)

    def build(self, plan: PlanFields, shard: range, key: RngKey, world_size: int) -> Any:
        from opake_fx.dpftrl.sampling import BallsInBinsSampler

        return BallsInBinsSampler(shard, cycle_length=plan.min_sep, n_steps=plan.steps, key=key)
