"""What a plan's noise mechanism owns: its noise stage and its unamplified cost.

A mechanism part is the object behind ``DPPlan(mechanism=...)``. It builds the noise
stage of the pipeline and states what one release costs before any sampling
amplification: the cost of one opportunity (for the amplified sampling kinds, which the
sampling part then subsamples), or, for the unamplified ``MIN_SEPARATION`` kind, the
whole run as one mechanism and its per-step increments. Which sampling kinds it can be
accounted under is :attr:`NoiseMechanism.accounts`; the pairs a plan accepts follow from it.
"""

from __future__ import annotations

from typing import Any, ClassVar

from opake_fx.errors import InputValueError
from opake_fx.planning.fields import PlanFields
from opake_fx.random import RngKey

__all__ = ["NoiseMechanism"]


class NoiseMechanism:
    """The base of a plan's mechanism parts (closed: the library's parts are registered in
    :mod:`opake_fx.planning.mechanisms`).

    Attributes:
        name: what ``DPPlan(mechanism=...)`` names it.
        accounts: the sampling accounting kinds
            (:mod:`opake_fx.planning.samplers.base`) this mechanism has a sound
            accounting under.
        needs_bands: the plan's ``bands`` field is this mechanism's (required).
        independent_steps: each step's noise is independent of the others', so every step
            of an every-step scheme costs the same and a clip mode may release more per
            step (adaptive clipping's noised count) and be charged for it step by step.

    Privacy contract: :meth:`noise_stage` adds exactly the noise that :meth:`opportunity`
    (amplified kinds) or :meth:`whole_run` / :meth:`step_increments` (unamplified) charge,
    scaled to the plan's :attr:`~opake_fx.plan.DPPlan.participation`.
    """

    name: ClassVar[str]
    accounts: ClassVar[frozenset[str]]
    needs_bands: ClassVar[bool] = False
    independent_steps: ClassVar[bool] = False

    def bands_message(self) -> str:
        """The error when a plan with this mechanism is given no ``bands``."""
        return f"DPPlan(mechanism={self.name!r}) needs bands (e.g. 4): the strategy's band count."

    def strategy(self, plan: PlanFields) -> Any:
        """The DP-FTRL strategy over the plan's steps (mechanisms that have one)."""
        raise InputValueError(f"DPPlan.strategy: a mechanism={self.name!r} plan has no DP-FTRL strategy.")

    def noise_stage(self, plan: PlanFields, key: RngKey) -> Any:
        """The pipeline's noise stage, keyed by ``key``."""
        raise NotImplementedError

    def opportunity(self, plan: PlanFields, noise_multiplier: float) -> Any:
        """The unamplified :class:`~opake_fx.accounting.DpProcess` of one participation at
        ``noise_multiplier`` (amplified sampling kinds)."""
        raise NotImplementedError

    def whole_run(self, plan: PlanFields, noise_multiplier: float) -> Any:
        """The whole run as one mechanism over the plan's participation pattern (unamplified kind)."""
        raise NotImplementedError

    def step_increments(self, plan: PlanFields) -> list[Any]:
        """Per-step costs at the plan's noise multiplier that compose to :meth:`whole_run` (unamplified kind)."""
        raise NotImplementedError
