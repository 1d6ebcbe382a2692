"""Checks shared by every Gaussian mechanism (DP-SGD's and DP-FTRL's): what may be noised."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from opake_fx.errors import InputTypeError, InputValueError, NoiseInputError
from opake_fx.random import RngKey
from opake_fx.types import ClippedPytree, NoisedPytree

MAX_STEPS = 2**64
"""Step counters stay below this: ``fold_in(key, step)`` gives a distinct key for every step in ``[0, 2**64)``."""


def check_noise_key(key: Any, what: str) -> None:
    """Raises unless ``key`` is an :class:`~opake_fx.random.RngKey` (``what`` names it in the message).

    The one check of a Gaussian mechanism's key (DP-SGD's and DP-FTRL's noise stages and
    their states): step ``t`` draws from ``fold_in(key, t)``, and every rank must hold the
    same key so that all ranks add identical noise.
    """
    if not isinstance(key, RngKey):
        raise InputTypeError(
            f"{what} must be an RngKey (opake_fx.random.key(seed)); got {type(key).__name__}. Use the same key "
            "on every rank, so that all ranks add identical noise."
        )


def check_noise_state(key: Any, step: Any, owner: str) -> int:
    """Validates a noise state's key and step counter; returns the step as an ``int``.

    The step selects the noise key ``fold_in(key, step)``: a negative step, or one past
    ``2**64``, would alias another step's key and repeat its noise.
    """
    check_noise_key(key, f"{owner}.key")
    if isinstance(step, torch.Tensor) and step.numel() == 1 and not (step.is_floating_point() or step.dtype == torch.bool):
        step = int(step)
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise InputTypeError(f"{owner}.step must be an int (the number of steps noised so far); got {type(step).__name__}.")
    step = int(step)
    if not 0 <= step < MAX_STEPS:
        raise InputValueError(
            f"{owner}.step must be in [0, 2**64); got {step}. Step t draws its noise from fold_in(key, t): a negative "
            "step would reuse another step's noise. Resume from the state the noise stage returned."
        )
    return step


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
            f"got {type(x).__name__}. Clip first: noise on unclipped gradients has no privacy guarantee. If you did "
            "clip, a map between clip and noise (tree_map, a hand-written stage) dropped the sensitivity bound: map "
            "the clipped gradient with g.map(fn, lipschitz=L) or g.map_with_path(fn, lipschitz=L), or scale it by a "
            "public scalar (g * a), which keep it."
        )
    if noise_multiplier > 0 and not math.isfinite(x.sensitivity):
        raise NoiseInputError(
            f"{mechanism} got a ClippedPytree with max_norm={x.max_norm} (clipping_norm=inf): its sensitivity "
            "is unbounded, so no amount of noise makes it private. Set a finite clipping_norm, or "
            "noise_multiplier=0 for a non-private run."
        )
