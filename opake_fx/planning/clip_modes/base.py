"""What a plan's clip mode owns: its options, its clip stage, and what one step releases."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from opake_fx.planning.fields import PlanFields
from opake_fx.random import RngKey

__all__ = ["ClipMode"]


class ClipMode:
    """The base of a plan's clip modes (closed: the library's modes are registered in
    :mod:`opake_fx.planning.clip_modes`).

    Attributes:
        name: what ``DPPlan(clipping_mode=...)`` names it.
        defaults: the ``clipping_kwargs`` the mode takes, with their defaults (``None``:
            derived by :meth:`fill`).
        one_norm_reason: why the mode refuses per-group norms (``None``: it takes them).
        takes_count_key: ``DPPlan.pipeline(count_key=...)`` is this mode's key.

    Privacy contract: the stage of :meth:`stage_factory` bounds each example's
    contribution by the plan's sensitivity, and :meth:`release` is what one step releases
    before amplification (the gradient's Gaussian at ``noise_multiplier``, and anything
    the mode releases beside it), which the plan's accounting charges.
    """

    name: ClassVar[str]
    defaults: ClassVar[Mapping[str, float | None]]
    one_norm_reason: ClassVar[str | None] = None
    takes_count_key: ClassVar[bool] = False

    def fill(self, given: Mapping[str, Any], batch_size: float) -> dict[str, float]:
        """The mode's options: ``given`` (keys already checked) over the defaults, validated, sorted by name."""
        return dict(sorted({**self.defaults, **given}.items()))

    def check(self, plan: PlanFields) -> None:
        """Checks the rest of the plan against this mode (raises ``InputValueError``)."""

    def stage_factory(self, count_key: RngKey | None) -> Callable[..., Any]:
        """The clip stage's factory (``clip``, ``auto_clip``, ``adaptive_clip`` with its key bound)."""
        raise NotImplementedError

    def grad_maker(self, count_key: RngKey | None) -> Callable[..., Any]:
        """The clipping function's maker of the same mode (``clipped_grad``, ...), for a stage
        that also records the losses."""
        raise NotImplementedError

    def clip_args(self, plan: PlanFields) -> dict[str, Any]:
        """The mode's keywords of the clip stage (the norm and the mode's options)."""
        raise NotImplementedError

    def release(self, plan: PlanFields, noise_multiplier: float) -> Any:
        """What one step releases, unamplified: a :class:`~opake_fx.accounting.DpProcess`."""
        from opake_fx.dpsgd.accounting import gaussian

        return gaussian(noise_multiplier)

    def check_budget(self, plan: PlanFields, budget: Any) -> None:
        """Refuses a target budget that no gradient noise can meet (before calibrating)."""

    def finish(self, stage: Any) -> Any:
        """The clip stage as the pipeline runs it (e.g. with its state synced over ranks)."""
        return stage
