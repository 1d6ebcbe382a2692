"""``mechanism="gaussian"``: DP-SGD's independent Gaussian noise at every step."""

from __future__ import annotations

from typing import Any

from opake_fx.planning.fields import PlanFields
from opake_fx.planning.mechanisms.base import NoiseMechanism
from opake_fx.planning.samplers.base import EVERY_STEP
from opake_fx.random import RngKey

__all__ = ["GaussianMechanism"]


class GaussianMechanism(NoiseMechanism):
    """Independent isotropic Gaussian noise, ``noise_multiplier * sensitivity / batch_size`` per coordinate.

    Privacy: one step releases the clipped sum plus that noise (and whatever the clip mode
    releases with it: :meth:`opake_fx.planning.clip_modes.base.ClipMode.release`); the
    sampling part amplifies it, every step.

    Example:
        >>> from opake_fx.plan import DPPlan
        >>> plan = DPPlan(dataset_size=100, batch_size=10, steps=5, noise_multiplier=1.0)
        >>> GaussianMechanism().opportunity(plan, 1.0)
        Gaussian(noise_multiplier=1.0)
    """

    name = "gaussian"
    accounts = frozenset({EVERY_STEP})
    independent_steps = True

    def noise_stage(self, plan: PlanFields, key: RngKey) -> Any:
        from opake_fx.dpsgd import noise

        # isotropic: every coordinate at the total sensitivity (a scalar max_norm ignores it)
        return noise(noise_multiplier=plan.noise_multiplier, key=key, allocation="isotropic")

    def opportunity(self, plan: PlanFields, noise_multiplier: float) -> Any:
        return plan.parts.clip_mode.release(plan, noise_multiplier)
