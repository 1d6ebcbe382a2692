"""Adaptive clipping by private quantile tracking (Andrew et al. 2021): :func:`adaptive_clipped_grad`."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
from torch import nn

from opake_fx.dpsgd.clipping._engine import StepResult
from opake_fx.dpsgd.clipping._entry import ClipFunctionSpec, make_grad_fn
from opake_fx.dpsgd.clipping.options import check_clipping_norm
from opake_fx.distributed.state_sync import register_sync_type
from opake_fx.distributed.builtin_sync import sync_adaptive_clip_state
from opake_fx.dpsgd.clipping.types import ClipBackend
from opake_fx.dpsgd.clipping.fixed import clip_weights
from opake_fx.functional import FunctionalModel
import opake_fx.validation as check
from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.random import RngKey, fold_in, normal

__all__ = ["AdaptiveClipState", "adaptive_clipped_grad", "next_clipping_norm"]


@dataclass(frozen=True)
class AdaptiveClipState:
    """State of adaptive clipping.

    Attributes:
        clipping_norm: the clip norm the NEXT call will use.
        step: number of calls so far (the count noise of call t uses ``fold_in(key, t)``).
        key: the count-noise key (must be the same on every rank).
        target_quantile, learning_rate, count_noise_multiplier, expected_batch_size:
            the tracking hyperparameters.
        prev_clipping_norm: the norm used by the last call.
        centered_count: the last call's LOCAL ``sum_i (1[||g_i|| <= C] - 1/2)``; ``sync``
            all-reduces it and recomputes ``clipping_norm`` so every rank agrees.
        count_noise: the noise added to the last count (identical on every rank).
    """

    clipping_norm: float
    step: int
    key: RngKey
    target_quantile: float
    learning_rate: float
    count_noise_multiplier: float
    expected_batch_size: float
    prev_clipping_norm: float | None = None
    centered_count: float = 0.0
    count_noise: float = 0.0


def next_clipping_norm(state: AdaptiveClipState, centered_count: float) -> float:
    """The geometric quantile update ``C * exp(-eta * (b - gamma))`` for a given count.

    ``b = (centered_count + noise) / expected_batch_size + 1/2`` estimates the fraction
    of examples whose gradient norm was at most ``C``.
    """
    assert state.prev_clipping_norm is not None
    frac = (centered_count + state.count_noise) / state.expected_batch_size + 0.5
    return state.prev_clipping_norm * math.exp(-state.learning_rate * (frac - state.target_quantile))


def adaptive_clipped_grad(
    loss_fn: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    initial_clipping_norm: float,
    count_noise_multiplier: float,
    key: RngKey,
    target_quantile: float = 0.5,
    learning_rate: float = 0.2,
    normalize_by: float = 1.0,
    expected_batch_size: float | None = None,
    batch_argnums: int | Sequence[int] = 1,
    microbatch_size: int | None = None,
    return_stats: bool = False,
    return_aux: bool = False,
    dtype: torch.dtype | None = None,
    clip_backend: ClipBackend = "vmap",
    model: FunctionalModel | nn.Module | None = None,
    pre_clip: Callable[[Any], Any] | None = None,
    second_moment: bool = False,
) -> tuple[Callable[..., Any], AdaptiveClipState]:
    """Clipping whose norm tracks a quantile of the gradient norms, privately.

    Each call clips at the state's current norm C (like :func:`clipped_grad`) and
    releases a noised count of examples with ``||g_i|| <= C``:
    ``b = (sum_i (1[||g_i|| <= C] - 1/2) + N(0, sigma_b^2)) / m + 1/2`` with ``m`` the
    expected batch size; then ``C <- C * exp(-learning_rate * (b - target_quantile))``
    (geometric update of Andrew, Thakkar, McMahan, Ramaswamy, NeurIPS 2021).

    The other arguments (``clip_backend`` / ``model``, ``pre_clip``, ``second_moment``,
    microbatching, stats and aux) are those of :func:`clipped_grad`, with the same
    meaning (``"ghost"`` / ``"auto"`` take a batched ``loss_fn`` returning per-example
    losses); the weight rule does not depend on how norms are obtained.

    Privacy:
        The gradient sum has sensitivity ``max_norm = C_t / normalize_by`` at every step
        (the squared stream of ``second_moment=True``: ``C_t**2 / normalize_by``).
        The centred count has sensitivity 1/2, so the count release is a Gaussian
        mechanism with noise multiplier ``2 * count_noise_multiplier``; together with
        gradient noise multiplier z the step costs a Gaussian with effective multiplier
        ``(z**-2 + (2 * count_noise_multiplier)**-2) ** -0.5``. Account for it with
        ``opake_fx.dpsgd.accounting.adaptive_clipping_gaussian(z, count_noise_multiplier)``
        (inside ``poisson(...)``). Under DDP call ``opake_fx.distributed.sync(state)`` after
        each step so the count is summed over ranks and every rank keeps the same norm.

    Example:
        >>> import torch
        >>> from opake_fx.random import key
        >>> f = lambda p, x: ((x - p) ** 2).sum()
        >>> g, s = adaptive_clipped_grad(f, initial_clipping_norm=1.0, count_noise_multiplier=0.0,
        ...                              key=key(0), expected_batch_size=4)
        >>> out, s = g(torch.tensor(0.0), torch.tensor([10.0, 10.0, 10.0, 10.0]), state=s)
        >>> s.clipping_norm > 1.0   # every norm was above C: the norm grows
        True
    """
    check_clipping_norm(initial_clipping_norm, "initial_clipping_norm")
    if not math.isfinite(initial_clipping_norm):
        raise InputValueError("adaptive clipping needs a finite initial_clipping_norm.")
    if not isinstance(key, RngKey):
        raise InputTypeError(f"key must be an RngKey (opake_fx.random.key(seed)); got {type(key).__name__}.")
    where = "adaptive_clipped_grad"
    target_quantile = check.interval(
        target_quantile, "target_quantile", where, 0.0, 1.0, low_open=True, high_open=True,
        hint="It is a fraction, e.g. 0.5 for the median norm.",
    )
    learning_rate = check.positive(
        learning_rate, "learning_rate", where, "It is the step of the geometric update; Andrew et al. use 0.2."
    )
    count_noise_multiplier = check.non_negative(
        count_noise_multiplier, "count_noise_multiplier", where,
        "0 releases the exact count (not private); Andrew et al. use about batch_size / 20.",
    )

    @torch.compiler.disable  # host-side: the noised count (keyed draw, .item()) and the next norm
    def advance(state: AdaptiveClipState, result: StepResult) -> AdaptiveClipState:
        c = state.clipping_norm
        below = ((result.norms[0] <= c) & result.counted).sum().item()
        centered = float(below) - 0.5 * result.examples
        noise = state.count_noise_multiplier * float(normal(fold_in(state.key, state.step), (), dtype=torch.float64, exact=True))
        stepped = replace(state, step=state.step + 1, prev_clipping_norm=c, centered_count=centered, count_noise=noise)
        return replace(stepped, clipping_norm=next_clipping_norm(stepped, centered))

    def configured_norm(state: AdaptiveClipState) -> float:
        # The hyperparameters are this function's; the state's copies must agree (a state from
        # another configuration, e.g. a checkpoint with count_noise_multiplier=0, would release
        # the count with other noise than the accountant charges for).
        mine = (float(target_quantile), float(learning_rate), float(count_noise_multiplier), m)
        theirs = (state.target_quantile, state.learning_rate, state.count_noise_multiplier, state.expected_batch_size)
        if theirs != mine:
            names = ("target_quantile", "learning_rate", "count_noise_multiplier", "expected_batch_size")
            differ = [f"{n}={t!r} (this function's: {g!r})" for n, t, g in zip(names, theirs, mine) if t != g]
            raise InputValueError(
                f"adaptive_clipped_grad: the state has {', '.join(differ)}. The privacy parameters are the "
                "function's own; pass the state this function (or its stage's init) returned."
            )
        return state.clipping_norm

    mode = ClipFunctionSpec(
        "adaptive_clipped_grad",
        AdaptiveClipState,
        clipping_norm=configured_norm,
        weights=clip_weights,
        advance=advance,
    )
    grad_fn = make_grad_fn(loss_fn, mode, locals())  # validates the shared options
    m = check.positive(
        expected_batch_size if expected_batch_size is not None else normalize_by,
        "expected_batch_size",
        where,
        "The noised count is divided by it to estimate the fraction of unclipped examples (an infinite one would "
        "freeze that estimate at 1/2): pass the sample rate times the dataset size.",
    )
    state = AdaptiveClipState(
        clipping_norm=float(initial_clipping_norm),
        step=0,
        key=key,
        target_quantile=float(target_quantile),
        learning_rate=float(learning_rate),
        count_noise_multiplier=float(count_noise_multiplier),
        expected_batch_size=m,
    )
    return grad_fn, state


# the state's own sync: the count summed over ranks, then the norm moved by it (the same on every rank)
register_sync_type(AdaptiveClipState, functools.partial(sync_adaptive_clip_state, next_norm=next_clipping_norm))
