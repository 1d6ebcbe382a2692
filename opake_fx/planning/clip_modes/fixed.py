"""``clipping_mode="fixed"``: every example clipped to ``clipping_norm`` (one norm or per group)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opake_fx.planning.clip_modes.base import ClipMode
from opake_fx.planning.fields import PlanFields
from opake_fx.random import RngKey

__all__ = ["FixedClipping"]


class FixedClipping(ClipMode):
    """Fixed clipping (:func:`opake_fx.dpsgd.clip`), the norm a float or a ``PerGroup``.

    Privacy: sensitivity ``clipping_norm`` (per group: ``sqrt(sum_g C_g**2)``); one step
    releases the Gaussian of the gradient alone.

    Example:
        >>> from opake_fx.plan import DPPlan
        >>> FixedClipping().clip_args(DPPlan(dataset_size=100, batch_size=10, steps=5, noise_multiplier=1.0))
        {'clipping_norm': 1.0}
    """

    name = "fixed"
    defaults: dict[str, float | None] = {}

    def stage_factory(self, count_key: RngKey | None) -> Callable[..., Any]:
        from opake_fx.dpsgd.clipping import clip

        return clip

    def grad_maker(self, count_key: RngKey | None) -> Callable[..., Any]:
        from opake_fx.dpsgd.clipping import clipped_grad

        return clipped_grad

    def clip_args(self, plan: PlanFields) -> dict[str, Any]:
        return {"clipping_norm": plan.clipping_norm}
