"""What a plan's parts may read of the plan: the resolved fields and the derived values.

The parts (:mod:`opake_fx.planning.samplers`, :mod:`~opake_fx.planning.mechanisms`,
:mod:`~opake_fx.planning.clip_modes`) are given the plan they serve; they depend on this
interface, not on :mod:`opake_fx.plan`, so the layers stay one-way
(``plan`` -> ``planning`` -> the stages and the accounting).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from opake_fx.planning.participation import Participation

__all__ = ["PlanFields"]


class PlanFields(Protocol):
    """The fields of a :class:`~opake_fx.plan.DPPlan` after construction (every one filled in)
    and the values derived from them, as its parts read them."""

    dataset_size: int
    batch_size: float
    sample_rate: float
    steps: int
    clipping_norm: Any
    clipping_mode: str
    clipping_kwargs: Mapping[str, float]
    target_epsilon: float | None
    delta: float | None
    noise_multiplier: float
    sampling: str
    max_batch_size: int | None
    mechanism: str
    bands: int | None
    min_sep: int | None

    @property
    def participation(self) -> Participation:
        """The pattern the noise is scaled to and the accounting charges."""

    @property
    def strategy(self) -> Any:
        """The DP-FTRL strategy (DP-FTRL mechanisms)."""

    @property
    def group_rate(self) -> float:
        """The Poisson rate within the active group."""

    @property
    def parts(self) -> Any:
        """The plan's sampling, mechanism and clip mode."""

    def run_cost(self, noise_multiplier: float, steps: int) -> Any:
        """The DpProcess of the first ``steps`` steps at ``noise_multiplier``."""
