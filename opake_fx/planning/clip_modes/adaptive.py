"""``clipping_mode="adaptive"``: the norm tracks a quantile of the gradient norms through a noised count."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import opake_fx.validation as check
from opake_fx.errors import InputValueError
from opake_fx.planning.clip_modes.base import ClipMode
from opake_fx.planning.fields import PlanFields
from opake_fx.random import RngKey

__all__ = ["AdaptiveClipping", "synced_counts"]


class AdaptiveClipping(ClipMode):
    """Adaptive clipping (Andrew et al. 2021, :func:`opake_fx.dpsgd.adaptive_clip`):
    ``clipping_norm`` is the initial norm ``C_0``.

    Privacy: every step releases the gradient (noise ``sigma * C_t``) and the noised
    centred clipped count (noise ``count_noise_multiplier``), charged together as
    ``adaptive_clipping_gaussian`` (effective multiplier ``(sigma**-2 + (2 *
    count_noise_multiplier)**-2)**-1/2``). Needs a mechanism whose steps are independent
    (the count is accounted step by step beside the gradient), one norm, a count key, and
    count noise > 0 unless the plan is an explicit non-private baseline.

    Example:
        >>> AdaptiveClipping().fill({}, 64.0)
        {'count_noise_multiplier': 3.2, 'learning_rate': 0.2, 'target_quantile': 0.5}
    """

    name = "adaptive"
    defaults = {"target_quantile": 0.5, "learning_rate": 0.2, "count_noise_multiplier": None}
    one_norm_reason = "adaptive clipping tracks one norm"
    takes_count_key = True

    def fill(self, given: Mapping[str, Any], batch_size: float) -> dict[str, float]:
        out = super().fill(given, batch_size)
        where = f"DPPlan(clipping_mode={self.name!r})"
        if out["count_noise_multiplier"] is None:
            out["count_noise_multiplier"] = batch_size / 20.0
        out["target_quantile"] = check.interval(out["target_quantile"], "clipping_kwargs['target_quantile']", where,
                                                0.0, 1.0, low_open=True, high_open=True,
                                                hint="A fraction, e.g. 0.5 for the median gradient norm.")
        out["learning_rate"] = check.positive(out["learning_rate"], "clipping_kwargs['learning_rate']", where,
                                              "The step of the geometric norm update; Andrew et al. use 0.2.")
        out["count_noise_multiplier"] = check.non_negative(
            out["count_noise_multiplier"], "clipping_kwargs['count_noise_multiplier']", where,
            "The std of the clipped count's noise, in counts (default batch_size / 20).")
        return out

    def check(self, plan: PlanFields) -> None:
        from opake_fx.planning.mechanisms import MECHANISMS

        if not MECHANISMS.get(plan.mechanism).independent_steps:
            takes = " or ".join(repr(m.name) for m in MECHANISMS.parts() if m.independent_steps)
            raise InputValueError(
                f"DPPlan: clipping_mode='adaptive' needs mechanism={takes}; with mechanism={plan.mechanism!r} the "
                "correlated DP-FTRL noise is scaled to one fixed sensitivity for the whole run, and the plan has no "
                "accounting for a noised count released next to it. Use clipping_mode='fixed' or 'auto' with DP-FTRL, "
                f"or mechanism={takes} with adaptive clipping."
            )
        if plan.clipping_kwargs["count_noise_multiplier"] == 0 and not (
            plan.target_epsilon is None and plan.noise_multiplier is not None and plan.noise_multiplier == 0
        ):
            raise InputValueError(
                "DPPlan: clipping_mode='adaptive' with clipping_kwargs['count_noise_multiplier']=0 releases the exact "
                "clipped count, which is not private. Give count_noise_multiplier > 0 (Andrew et al. suggest "
                "batch_size / 20, the default), or noise_multiplier=0 for a non-private baseline."
            )

    def stage_factory(self, count_key: RngKey | None) -> Callable[..., Any]:
        from opake_fx.dpsgd.clipping import adaptive_clip

        # the count key is bound here: augmult's own keyword `key` is the augmentation key
        return functools.partial(adaptive_clip, key=count_key)

    def grad_maker(self, count_key: RngKey | None) -> Callable[..., Any]:
        from opake_fx.dpsgd.clipping import adaptive_clipped_grad

        return functools.partial(adaptive_clipped_grad, key=count_key)

    def clip_args(self, plan: PlanFields) -> dict[str, Any]:
        kw = plan.clipping_kwargs
        return {"initial_clipping_norm": plan.clipping_norm, "count_noise_multiplier": kw["count_noise_multiplier"],
                "target_quantile": kw["target_quantile"], "learning_rate": kw["learning_rate"],
                "expected_batch_size": plan.batch_size}

    def release(self, plan: PlanFields, noise_multiplier: float) -> Any:
        from opake_fx.dpsgd.accounting import adaptive_clipping_gaussian

        # the gradient and the noised clipped count: one Gaussian (Andrew et al.)
        return adaptive_clipping_gaussian(noise_multiplier, plan.clipping_kwargs["count_noise_multiplier"])

    def check_budget(self, plan: PlanFields, budget: Any) -> None:
        # However much gradient noise, the count alone costs a Gaussian of multiplier 2 * count_noise_multiplier.
        sb = plan.clipping_kwargs["count_noise_multiplier"]
        count_only = dataclasses.replace(plan, clipping_mode="fixed", clipping_kwargs=None, noise_multiplier=2.0 * sb,
                                         target_epsilon=None)
        if not budget.is_met_by(count_only.run_cost(2.0 * sb, plan.steps)):
            raise InputValueError(
                f"DPPlan: clipping_kwargs['count_noise_multiplier']={sb:g} is too small for target_epsilon="
                f"{plan.target_epsilon} at delta={plan.delta}: the noised clipped count alone spends more than the "
                f"budget over {plan.steps} steps, whatever the gradient noise. Give a larger count_noise_multiplier "
                "(Andrew et al. suggest batch_size / 20) or a larger target_epsilon."
            )

    def finish(self, stage: Any) -> Any:
        return synced_counts(stage)


def synced_counts(stage: Any) -> Any:
    """An adaptive clip stage that ``sync``-s its state after each step (the count summed over ranks).

    In one process ``sync`` is the identity. The state may be wrapped (``augmult``'s
    ``AugmultState``, ``ClipStageState``, ``RecordedLossState``): the adaptive state inside
    is synced.

    Privacy: every rank then clips the next step at the same norm, moved by the count of
    the whole batch (what the accounting charges), not by its own shard's.
    """
    from opake_fx.distributed import sync
    from opake_fx.transforms import Transform

    def synced(state: Any) -> Any:
        inner = getattr(state, "clip_state", None)
        if inner is not None and dataclasses.is_dataclass(state):
            return dataclasses.replace(state, clip_state=synced(inner))
        return sync(state)

    def update(x: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
        out, new_state = stage.update(x, state, params, **extra)
        return out, synced(new_state)

    return Transform(stage.init, update, stage.privacy)
