"""Checks shared by every Gaussian mechanism (DP-SGD's and DP-FTRL's): what may be noised.

The one home of the checks :mod:`opake_fx._gaussian` draws under: the noise key and step
counter of a state, the noise multiplier, the input of a noise call (a clipped gradient,
or a second-moment pair of them) and the state passed back in. Each check raises with
the fix in its message; both mechanisms call the same check, so they refuse the same
inputs with the same words.

Privacy: these checks keep the guarantee the accountant assumes: noise is added once, to
an input of bounded sensitivity, from a key no earlier step used.

Example:
    >>> from opake_fx.random import key
    >>> check_noise_state(key(0), 3, "MyNoiseState")
    3
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from opake_fx.errors import InputTypeError, InputValueError, NoiseInputError
from opake_fx.random import RngKey
from opake_fx.types import ClippedPytree, NoisedPytree, PerGroup, RowShardedClippedPytree, SecondMomentClippingOutput

MAX_STEPS = 2**64
"""Step counters stay below this: ``fold_in(key, step)`` gives a distinct key for every step in ``[0, 2**64)``."""

SQUARED_STREAM_COUNTER = MAX_STEPS - 1
"""``fold_in(key, this)`` roots the squared-gradient stream's keys; a paired release may not reach this step."""


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


def row_shards(x: Any, *, mechanism: str, keyed: bool) -> tuple[Any, tuple[Any, Any] | None]:
    """``(x, None)``, or for an FSDP2 rank's :class:`~opake_fx.types.RowShardedClippedPytree`
    its rows as a ``ClippedPytree`` and ``rows = (full_shapes, row_ranges)`` for the draw.

    ``keyed``: the mechanism draws the keyed normals (not ``exact`` / ``secure``), the only
    draw whose rows a rank can take alone; otherwise a row shard is refused.

    Privacy: a shard must get exactly its rows of the ONE unsharded noise (equal noise on
    two ranks' shards would cancel in their difference); the caller draws with ``rows``.
    """
    if not isinstance(x, RowShardedClippedPytree):
        return x, None
    if not keyed:
        raise InputValueError(
            f"{mechanism}: row-sharded (FSDP2) gradients take the keyed draw, whose rows every rank can draw alone; "
            "not exact=True or secure=True."
        )
    return ClippedPytree(x.pytree, x.max_norm), (x.full_shapes, x.rows)


def check_noise_call(x: Any, state: Any, state_type: type, noise_multiplier: float, *, mechanism: str) -> bool:
    """Checks one call ``noise_fn(x, state)`` of a Gaussian mechanism; returns whether ``x`` is a pair.

    ``x`` must be a :class:`~opake_fx.types.ClippedPytree` (:func:`check_clipped_input`)
    or a :class:`~opake_fx.types.SecondMomentClippingOutput` (:func:`check_pair_input`),
    and ``state`` the ``state_type`` the mechanism returned.

    Example:
        >>> import torch
        >>> from opake_fx.random import key
        >>> from opake_fx.dpsgd.noise import GaussianNoiseState
        >>> check_noise_call(ClippedPytree((torch.zeros(2),), max_norm=1.0), GaussianNoiseState(key(0)),
        ...                  GaussianNoiseState, 1.0, mechanism="gaussian_noise")
        False
        >>> check_noise_call(ClippedPytree((torch.zeros(2),), max_norm=1.0), None, GaussianNoiseState, 1.0,
        ...                  mechanism="gaussian_noise")
        Traceback (most recent call last):
        ...
        opake_fx.errors.InputTypeError: noise_fn needs the GaussianNoiseState it returned; got NoneType.
    """
    pair = isinstance(x, SecondMomentClippingOutput)
    if pair:
        check_pair_input(x, noise_multiplier, mechanism=mechanism)
    else:
        check_clipped_input(x, noise_multiplier, mechanism=mechanism)
    if not isinstance(state, state_type):
        raise InputTypeError(f"noise_fn needs the {state_type.__name__} it returned; got {type(state).__name__}.")
    return pair


def check_second_moment_share(share: Any) -> float:
    """Validates the squared stream's share of the budget: a real number in ``(0, 1)``.

    Example:
        >>> check_second_moment_share(0.25)
        0.25
    """
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 < float(share) < 1.0:
        raise InputValueError(
            f"second_moment_share must be a number in (0, 1), the share of the budget given to the squared-gradient "
            f"stream; got {share!r}. The default 1/3 costs the gradient stream sqrt(3/2) times more noise."
        )
    return float(share)


def check_pair_input(pair: SecondMomentClippingOutput, noise_multiplier: float, *, mechanism: str) -> None:
    """Both streams must be un-noised, finite-sensitivity ``ClippedPytree`` with a scalar ``max_norm``."""
    for name, stream in (("grads", pair.grads), ("squared_grads", pair.squared_grads)):
        check_clipped_input(stream, noise_multiplier, mechanism=f"{mechanism} ({name} stream)")
        if isinstance(stream.max_norm, PerGroup):
            raise InputValueError(
                f"{mechanism}: the second-moment pair needs a scalar max_norm on both streams; {name} has per-group "
                "norms. Clip with one global clipping_norm for second_moment=True."
            )


def check_pair_step(step: int) -> None:
    """A paired release may not reach the counter that roots the squared stream's keys."""
    if step >= SQUARED_STREAM_COUNTER:
        raise InputValueError(
            f"step {step} is the counter reserved for the squared-gradient stream's key (2**64 - 1): a paired "
            "release there would reuse a key. Start a new key."
        )
