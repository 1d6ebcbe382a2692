"""Checks shared by every Gaussian mechanism (DP-SGD's and DP-FTRL's): what may be noised."""

from __future__ import annotations

import math
from typing import Any

from opake_fx.errors import InputValueError, NoiseInputError
from opake_fx.types import ClippedPytree, NoisedPytree


def check_noise_multiplier(nm: Any, *, calibrate_with: str = "opake_fx.accounting.calibrate") -> None:
    """Raises unless ``nm`` is a finite real number >= 0."""
    if isinstance(nm, bool) or not isinstance(nm, (int, float)) or math.isnan(nm) or nm < 0 or math.isinf(nm):
        raise InputValueError(
            f"noise_multiplier must be a finite number >= 0; got {nm!r}. Calibrate it for a target epsilon "
            f"with {calibrate_with}."
        )


def check_clipped_input(x: Any, noise_multiplier: float, *, mechanism: str) -> None:
    """Raises unless ``x`` is a not-yet-noised ``ClippedPytree`` of finite sensitivity (when noising).

    Unclipped gradients have unbounded sensitivity, a ``NoisedPytree`` would be noised twice
    (noise goes once, after the cross-rank aggregation), and ``max_norm=inf`` cannot be made
    private by any noise; each is refused with the fix in the message.
    """
    if isinstance(x, NoisedPytree):
        raise NoiseInputError(
            f"{mechanism} got a NoisedPytree: this gradient is already noised. Add noise once, after the "
            "clipped gradients are aggregated across ranks."
        )
    if not isinstance(x, ClippedPytree):
        raise NoiseInputError(
            f"{mechanism} expects a ClippedPytree (the output of clipped_grad or the clip stage); "
            f"got {type(x).__name__}. Clip first: noise on unclipped gradients has no privacy guarantee."
        )
    if noise_multiplier > 0 and not math.isfinite(x.sensitivity):
        raise NoiseInputError(
            f"{mechanism} got a ClippedPytree with max_norm={x.max_norm} (clipping_norm=inf): its sensitivity "
            "is unbounded, so no amount of noise makes it private. Set a finite clipping_norm, or "
            "noise_multiplier=0 for a non-private run."
        )
