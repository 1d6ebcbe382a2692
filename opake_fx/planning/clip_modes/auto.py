"""``clipping_mode="auto"``: AUTO-S, every gradient scaled to norm just under ``clipping_norm``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import opake_fx.validation as check
from opake_fx.planning.clip_modes.base import ClipMode
from opake_fx.planning.fields import PlanFields
from opake_fx.random import RngKey

__all__ = ["AutoClipping"]


class AutoClipping(ClipMode):
    """AUTO-S (Bu et al. 2023, :func:`opake_fx.dpsgd.auto_clip`) with stability constant ``gamma``.

    Privacy: the same sensitivity ``clipping_norm`` and the same accounting as fixed clipping.

    Example:
        >>> AutoClipping().fill({}, 64.0)
        {'gamma': 0.01}
    """

    name = "auto"
    defaults = {"gamma": 0.01}
    one_norm_reason = "AUTO-S scales every gradient to one norm"

    def fill(self, given: Mapping[str, Any], batch_size: float) -> dict[str, float]:
        out = super().fill(given, batch_size)
        out["gamma"] = check.non_negative(out["gamma"], "clipping_kwargs['gamma']", f"DPPlan(clipping_mode={self.name!r})",
                                          "AUTO-S's stability constant (Bu et al. use 0.01).")
        return out

    def stage_factory(self, count_key: RngKey | None) -> Callable[..., Any]:
        from opake_fx.dpsgd.clipping import auto_clip

        return auto_clip

    def grad_maker(self, count_key: RngKey | None) -> Callable[..., Any]:
        from opake_fx.dpsgd.clipping import auto_clipped_grad

        return auto_clipped_grad

    def clip_args(self, plan: PlanFields) -> dict[str, Any]:
        return {"clipping_norm": plan.clipping_norm, "gamma": plan.clipping_kwargs["gamma"]}
