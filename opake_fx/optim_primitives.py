"""Gradient-transformation primitives for optimizers (optax's ``scale_by_*`` building blocks).

Each primitive is a small :class:`~opake_fx.transforms.Transform` with one job; an
optimizer is a :func:`~opake_fx.transforms.chain` of them::

    opt = chain(add_decayed_weights(1e-2), trace(0.9), scale_by_learning_rate(0.1))   # SGD, L2, momentum
    opt = chain(scale_by_adam(), add_decayed_weights(1e-2), scale_by_learning_rate(1e-3))  # optax's AdamW

The primitives (:func:`trace`, :func:`add_decayed_weights`, :func:`scale_by_adam`,
:func:`scale_by_private_second_moment`, :func:`scale_by_learning_rate`,
:func:`add_decoupled_weight_decay`) hold all the arithmetic of
:func:`~opake_fx.optimizers.sgd`, :func:`~opake_fx.optimizers.adam` and
:func:`~opake_fx.optimizers.adamw`, which are built from them and keep their own state
types. Two options exist for torch.optim's order of operations, which those optimizers
reproduce bit for bit: ``scale_by_adam(learning_rate=lr)`` folds the learning rate into
the bias correction (``-(lr / (1 - b1**t)) * (m / denom)``, torch.optim.Adam's
``step_size``), and :func:`add_decoupled_weight_decay` subtracts ``lr * wd * params``
after it (AdamW). Chained the optax way (``scale_by_adam()`` then
``scale_by_learning_rate(lr)``) the same numbers come out to rounding.

Inputs: plain pytrees of tensors or a :class:`~opake_fx.types.NoisedPytree`; a
:class:`~opake_fx.types.SecondMomentNoiseOutput` (the noised gradient with its noised
squares) is read by :func:`add_decayed_weights` and :func:`scale_by_private_second_moment`
only. A ``ClippedPytree`` that was never noised is refused by every primitive.

``name`` (keyword-only, every primitive): the name that error messages use; an optimizer
built from a primitive passes its own (``"adam"``), so its errors read as before.

Privacy: every primitive is post-processing of the noised gradient it is given, using
only the parameters, the step count and public constants of the mechanism; none changes
a guarantee, and none adds one (on a plain gradient the result is not private).

Example:
    >>> import torch
    >>> from opake_fx.transforms import apply_updates, chain
    >>> opt = chain(trace(0.9), scale_by_learning_rate(0.1))
    >>> params = {"w": torch.ones(2)}
    >>> updates, state = opt.update({"w": torch.ones(2)}, opt.init(params), params)
    >>> [round(x, 6) for x in apply_updates(params, updates)["w"].tolist()]
    [0.9, 0.9]
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from numbers import Real
from typing import Any

import optree
import torch

import opake_fx.validation as check
from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.pipeline_privacy import StagePrivacy
from opake_fx.pytree import NAMESPACE, tree_flatten_with_paths, zeros_like
from opake_fx.transforms import Transform, unwrap
from opake_fx.types import (
    ClippedPytree,
    EmptyState,
    NoisedPytree,
    PerGroup,
    SecondMomentClippingOutput,
    SecondMomentNoiseOutput,
)
from opake_fx.typing import typechecked

__all__ = [
    "ScalarOrSchedule",
    "BiasCorrection",
    "DecayMask",
    "TraceState",
    "ScaleByAdamState",
    "ScheduleState",
    "trace",
    "add_decayed_weights",
    "scale_by_adam",
    "scale_by_private_second_moment",
    "scale_by_learning_rate",
    "add_decoupled_weight_decay",
]

# Real: int, float and numpy scalars. BiasCorrection is "auto", a noise variance or None;
# it is hinted str rather than Literal["auto"] so that another string is reported as a
# wrong value (InputValueError), not a wrong type.
ScalarOrSchedule = Real | Callable[[int], float]
BiasCorrection = Real | str | None
# A pytree of bools shaped like the parameters, or a callable params -> such a pytree (optax's ``mask``).
DecayMask = Any


@dataclass(frozen=True)
class TraceState:
    """State of :func:`trace`: the momentum buffers, shaped like the parameters."""

    trace: Any


@dataclass(frozen=True)
class ScaleByAdamState:
    """State of :func:`scale_by_adam` / :func:`scale_by_private_second_moment`: ``count``
    updates applied, first (``mu``) and second (``nu``) moments."""

    count: int
    mu: Any
    nu: Any


@dataclass(frozen=True)
class ScheduleState:
    """State of :func:`scale_by_learning_rate` / :func:`add_decoupled_weight_decay`: ``count``
    updates applied (the step a learning-rate schedule is called with)."""

    count: int


@typechecked
def trace(decay: Real, nesterov: bool = False, *, name: str = "trace") -> Transform:
    """Momentum (optax's ``trace``), with torch.optim.SGD's semantics (dampening 0).

    ::

        buf = decay * buf + g                 # buf starts at 0, so buf_1 = g_1
        out = g + decay * buf if nesterov else buf

    Args:
        decay: the momentum factor, >= 0.
        nesterov: Nesterov momentum.
        name: the name errors use.

    Privacy: post-processing of the gradient it is given (a running sum of released values).

    Raises:
        InputValueError: ``decay`` < 0 or NaN; ``init(None)`` (the buffers need the parameters' shapes).

    Example:
        >>> import torch
        >>> t = trace(0.5, nesterov=True)
        >>> state = t.init([torch.zeros(1)])
        >>> out, state = t.update([torch.ones(1)], state)
        >>> out[0].tolist(), state.trace[0].tolist()     # buf = 1, out = 1 + 0.5 * 1
        ([1.5], [1.0])
    """
    decay = check.non_negative(decay, "decay", name)

    def init(params: Any) -> TraceState:
        if params is None:
            raise InputValueError(f"{name}.init needs params to shape its momentum buffers; call init(params).")
        return TraceState(trace=zeros_like(params))

    def update(grads: Any, state: TraceState, params: Any = None, **extra: Any) -> tuple[Any, TraceState]:
        expect_state(state, TraceState, name)
        g_leaves, spec, _ = _flatten(grads, name)
        b_leaves = _state_leaves(state.trace, spec, name, "momentum")
        b_leaves = [decay * b + g for b, g in zip(b_leaves, g_leaves)]
        d_leaves = [g + decay * b for g, b in zip(g_leaves, b_leaves)] if nesterov else b_leaves
        return optree.tree_unflatten(spec, d_leaves), TraceState(trace=optree.tree_unflatten(spec, b_leaves))

    return Transform(init, update, StagePrivacy("optimizer", f"trace(decay={decay:g}{', nesterov' if nesterov else ''})"))


@typechecked
def add_decayed_weights(weight_decay: Real, mask: DecayMask = None, *, name: str = "add_decayed_weights") -> Transform:
    """Adds ``weight_decay * params`` to the gradient (L2 weight decay, optax's ``add_decayed_weights``).

    Placed before the optimizer's scaling it is coupled L2 (torch.optim.SGD/Adam's
    ``weight_decay``); placed after :func:`scale_by_adam` and before
    :func:`scale_by_learning_rate` it is optax's decoupled AdamW.

    A :class:`~opake_fx.types.NoisedPytree` stays one, with the same ``max_norm`` and
    ``noise_stddev`` (a shift by the public parameters moves no noise), so a later
    ``scale_by_adam(dp_bias_correction="auto")`` still reads it. For a
    :class:`~opake_fx.types.SecondMomentNoiseOutput` the squared stream becomes the squares
    of ``g + weight_decay * params``: ``s + 2 * weight_decay * params * g + (weight_decay *
    params)**2`` (its ``noise_stddev`` is then no longer a single known number: ``None``).

    Args:
        weight_decay: the L2 factor, >= 0 (0 passes the gradient through).
        mask: which parameters decay (optax's ``mask``): a pytree of bools with the
            parameters' structure (``True``: decayed), or a callable ``params ->`` such a
            pytree, called at each update; ``None``: every parameter.
        name: the name errors use.

    Privacy: post-processing; the added term depends on the parameters only, never on the
    data, so it changes no guarantee.

    Raises:
        InputValueError: ``params`` missing in ``update``; a mask or params of another structure.
        InputTypeError: a mask leaf that is not a bool; an un-noised ``ClippedPytree``.

    Example:
        >>> import torch
        >>> t = add_decayed_weights(0.5, mask={"w": True, "b": False})
        >>> params = {"w": torch.ones(1), "b": torch.ones(1)}
        >>> out, _ = t.update({"w": torch.zeros(1), "b": torch.zeros(1)}, t.init(params), params)
        >>> out["w"].tolist(), out["b"].tolist()
        ([0.5], [0.0])
    """
    weight_decay = check.non_negative(weight_decay, "weight_decay", name)

    def update(grads: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
        if weight_decay == 0.0:
            return grads, state
        pair = grads if isinstance(grads, SecondMomentNoiseOutput) else None
        if pair is not None:
            grads = pair.noisy_grads
        g_leaves, spec, _ = _flatten(grads, name)
        squares = None if pair is None else _squared_leaves(pair, spec, name)
        p_leaves = _param_leaves(params, spec, name, "weight_decay")
        decayed = _decay_mask(mask, params, spec, name)
        if squares is not None:  # the squares of g + wd * p, from the two private streams
            squares = [
                s + 2.0 * weight_decay * p * g + (weight_decay * p) ** 2 if d else s
                for s, g, p, d in zip(squares, g_leaves, p_leaves, decayed)
            ]
        g_leaves = [g + weight_decay * p if d else g for g, p, d in zip(g_leaves, p_leaves, decayed)]
        out = _rewrap(grads, optree.tree_unflatten(spec, g_leaves))
        if pair is not None:
            sq_tree = optree.tree_unflatten(spec, squares)
            out = SecondMomentNoiseOutput(out, replace(pair.noisy_squared_grads, pytree=sq_tree, noise_stddev=None))
        return out, state

    return Transform(lambda params: EmptyState(), update, StagePrivacy("optimizer", f"add_decayed_weights({weight_decay:g})"))


@typechecked
def scale_by_adam(
    b1: Real = 0.9,
    b2: Real = 0.999,
    eps: Real = 1e-8,
    *,
    dp_bias_correction: BiasCorrection = None,
    dp_bias_correction_gamma: Real = 1e-8,
    learning_rate: ScalarOrSchedule | None = None,
    name: str = "scale_by_adam",
) -> Transform:
    """Adam's moments and direction (Kingma & Ba 2015), with optional DP bias correction.

    ::

        m = b1 * m + (1 - b1) * g;  v = b2 * v + (1 - b2) * g**2        # t = count + 1
        denom = sqrt(v) / sqrt(1 - b2**t) + eps                          # sqrt(v_hat) + eps
        out = (m / (1 - b1**t)) / denom                                  # m_hat / denom

    The denominator with ``dp_bias_correction`` (DP-AdamBC; Tang, Shpilevskiy & Lécuyer,
    AAAI 2024): DP-SGD's Gaussian noise adds its variance ``Phi = noise_stddev**2`` to every
    coordinate of ``v_hat``, which then mostly measures the noise; the corrected
    denominator is ``sqrt(max(v_hat - Phi, gamma))`` (``eps`` unused, as in the paper).

    Args:
        b1, b2: moment decay rates in ``[0, 1)``.
        eps: added to ``sqrt(v_hat)``, >= 0.
        dp_bias_correction: ``None`` (plain Adam); ``"auto"``: ``Phi = noise_stddev**2`` read
            from the input, which must be a :class:`~opake_fx.types.NoisedPytree` (per leaf
            for a :class:`~opake_fx.types.PerGroup` stddev); or a float ``Phi >= 0`` (an
            error if a ``NoisedPytree`` input's ``noise_stddev**2`` disagrees).
        dp_bias_correction_gamma: the floor ``gamma`` of the corrected second moment, > 0
            with ``dp_bias_correction``.
        learning_rate: ``None`` (default): the output is the direction above, to be scaled
            by :func:`scale_by_learning_rate`. A float or schedule: the output is the update
            ``-(lr / (1 - b1**t)) * (m / denom)``, torch.optim.Adam's order of operations
            (its ``step_size``), which :func:`~opake_fx.optimizers.adam` uses to match it bit
            for bit; do not chain a learning-rate stage after it.
        name: the name errors use.

    Privacy: post-processing of the gradient it is given. The bias correction reads only
    ``noise_stddev``, a public parameter of the mechanism, so it changes no guarantee.

    Raises:
        InputValueError: a hyperparameter out of range; ``gamma == 0`` with
            ``dp_bias_correction``; a float ``Phi`` contradicting the input's ``noise_stddev``.
        InputTypeError: ``"auto"`` without a ``NoisedPytree``; a ``SecondMomentNoiseOutput``
            (use :func:`scale_by_private_second_moment`); an un-noised ``ClippedPytree``.

    Example:
        >>> import torch
        >>> t = scale_by_adam()
        >>> params = [torch.zeros(2)]
        >>> out, state = t.update([torch.tensor([1.0, -2.0])], t.init(params))
        >>> [round(x, 4) for x in out[0].tolist()]   # the first direction is sign(g)
        [1.0, -1.0]
    """
    if learning_rate is not None:
        _check_lr(learning_rate, name)
    b1 = check.interval(b1, "b1", name, 0.0, 1.0, high_open=True)
    b2 = check.interval(b2, "b2", name, 0.0, 1.0, high_open=True)
    eps = check.non_negative(eps, "eps", name)
    gamma = check.non_negative(dp_bias_correction_gamma, "dp_bias_correction_gamma", name)
    if dp_bias_correction is not None and dp_bias_correction != "auto":
        if isinstance(dp_bias_correction, str):
            raise InputValueError(
                f"{name} needs dp_bias_correction to be None, 'auto' or a noise variance >= 0; "
                f"got {dp_bias_correction!r}."
            )
        dp_bias_correction = check.non_negative(dp_bias_correction, "dp_bias_correction", name)
    if dp_bias_correction is not None and gamma == 0.0:
        raise InputValueError(
            f"{name} with dp_bias_correction needs dp_bias_correction_gamma > 0 (the floor of the "
            "corrected second moment); got 0, which can divide by zero."
        )

    def update(grads: Any, state: ScaleByAdamState, params: Any = None, **extra: Any) -> tuple[Any, ScaleByAdamState]:
        expect_state(state, ScaleByAdamState, name)
        if isinstance(grads, SecondMomentNoiseOutput):
            raise InputTypeError(
                f"{name} feeds v with the square of the gradient; got a SecondMomentNoiseOutput, whose noised squared "
                "stream it would ignore. Use scale_by_private_second_moment (or adam/adamw, which choose it for the "
                "pair), or clip without second_moment=True."
            )
        lr = None if learning_rate is None else _lr_at(learning_rate, state.count, name, like=grads)
        g_leaves, spec, paths = _flatten(grads, name)
        phis = None if dp_bias_correction is None else _noise_variances(grads, paths, dp_bias_correction, name)
        m_leaves, v_leaves, t = _moments(state, spec, g_leaves, lambda i, v: g_leaves[i] * g_leaves[i], b1, b2, name)
        bc2 = 1.0 - b2**t
        denoms = []
        for i, v in enumerate(v_leaves):
            if phis is None:
                # torch.optim.Adam's order of operations, so the numbers agree to rounding.
                denoms.append(v.sqrt() / math.sqrt(bc2) + eps)
            else:
                denoms.append(torch.clamp(v / bc2 - phis[i], min=gamma).sqrt())
        return _adam_step(spec, m_leaves, v_leaves, t, denoms, 1.0 - b1**t, lr)

    described = f"scale_by_adam(b1={b1:g}, b2={b2:g}{', dp_bias_correction' if dp_bias_correction is not None else ''})"
    return Transform(_adam_init(name), update, StagePrivacy("optimizer", described))


@typechecked
def scale_by_private_second_moment(
    b1: Real = 0.9,
    b2: Real = 0.999,
    gamma: Real = 1e-8,
    *,
    learning_rate: ScalarOrSchedule | None = None,
    name: str = "scale_by_private_second_moment",
) -> Transform:
    """Adam fed by the private second moment: ``v`` from the noised squared-gradient stream.

    Its input is a :class:`~opake_fx.types.SecondMomentNoiseOutput` (``clipped_grad(...,
    second_moment=True)`` then the noise stage)::

        m = b1 * m + (1 - b1) * noisy_grads
        v = b2 * v + (1 - b2) * noisy_squared_grads          # cast to v's dtype
        out = (m / (1 - b1**t)) / sqrt(max(v_hat, gamma))

    ``noisy_squared_grads`` is an unbiased estimate of the mean per-example squared
    gradient, so there is no noise variance to subtract (the alternative to
    ``scale_by_adam(dp_bias_correction=...)``); the floor keeps noised squares, which can
    be negative, from dividing by zero. For coupled L2 decay put
    :func:`add_decayed_weights` before it: it turns the squares into those of
    ``g + wd * params``.

    Args:
        b1, b2: moment decay rates in ``[0, 1)``.
        gamma: the floor of ``v_hat``, > 0.
        learning_rate: as in :func:`scale_by_adam`: ``None`` for the direction, or a float or
            schedule for torch's fused update ``-(lr / (1 - b1**t)) * (m / denom)``.
        name: the name errors use.

    Privacy: post-processing of two streams released together under one budget by the
    noise stage; it changes no guarantee.

    Raises:
        InputTypeError: the input is not a ``SecondMomentNoiseOutput``.
        InputValueError: a hyperparameter out of range; streams of different structures.

    Example:
        >>> import torch
        >>> from opake_fx.types import NoisedPytree, SecondMomentNoiseOutput
        >>> pair = SecondMomentNoiseOutput(NoisedPytree([torch.tensor([0.5])], 1.0, noise_stddev=0.1),
        ...                                NoisedPytree([torch.tensor([-0.1])], 1.0, noise_stddev=0.1))
        >>> t = scale_by_private_second_moment(gamma=0.25)
        >>> out, _ = t.update(pair, t.init([torch.zeros(1)]))
        >>> out[0].tolist()                    # v_hat < 0 sits on the floor: 0.5 / sqrt(0.25)
        [1.0]
    """
    if learning_rate is not None:
        _check_lr(learning_rate, name)
    b1 = check.interval(b1, "b1", name, 0.0, 1.0, high_open=True)
    b2 = check.interval(b2, "b2", name, 0.0, 1.0, high_open=True)
    gamma = check.positive(gamma, "gamma", name, "It is the floor of the noised second moment, which can be <= 0.")

    def update(pair: Any, state: ScaleByAdamState, params: Any = None, **extra: Any) -> tuple[Any, ScaleByAdamState]:
        expect_state(state, ScaleByAdamState, name)
        if not isinstance(pair, SecondMomentNoiseOutput):
            _flatten(pair, name)  # an un-noised clipped input gets its own message
            raise InputTypeError(
                f"{name} reads v from a SecondMomentNoiseOutput (clipped_grad(..., second_moment=True), then the "
                f"noise stage); got {type(pair).__name__}. For a gradient alone use scale_by_adam."
            )
        lr = None if learning_rate is None else _lr_at(learning_rate, state.count, name, like=pair.noisy_grads)
        g_leaves, spec, _ = _flatten(pair.noisy_grads, name)
        squares = _squared_leaves(pair, spec, name)
        m_leaves, v_leaves, t = _moments(state, spec, g_leaves, lambda i, v: squares[i].to(v.dtype), b1, b2, name)
        bc2 = 1.0 - b2**t
        denoms = [torch.clamp(v / bc2, min=gamma).sqrt() for v in v_leaves]
        return _adam_step(spec, m_leaves, v_leaves, t, denoms, 1.0 - b1**t, lr)

    described = f"scale_by_private_second_moment(b1={b1:g}, b2={b2:g})"
    return Transform(_adam_init(name), update, StagePrivacy("optimizer", described))


@typechecked
def scale_by_learning_rate(learning_rate: ScalarOrSchedule, *, name: str = "scale_by_learning_rate") -> Transform:
    """Multiplies by ``-learning_rate`` (the sign makes the output an update to add, as in optax).

    Args:
        learning_rate: a float >= 0, or a schedule ``step -> float`` called with the number
            of updates already applied (0 first); it must return a finite value >= 0.
        name: the name errors use.

    Privacy: post-processing; the factor depends on the step count only.

    Raises:
        InputValueError: a negative learning rate, or a schedule value that is negative or not finite.
        InputTypeError: a schedule that returns a non-number.

    Example:
        >>> import torch
        >>> t = scale_by_learning_rate(lambda step: 0.1 * (step + 1))
        >>> state = t.init(None)
        >>> out, state = t.update([torch.ones(1)], state)
        >>> out, state = t.update([torch.ones(1)], state)
        >>> out[0].tolist(), state.count
        ([-0.20000000298023224], 2)
    """
    _check_lr(learning_rate, name)

    def update(updates: Any, state: ScheduleState, params: Any = None, **extra: Any) -> tuple[Any, ScheduleState]:
        expect_state(state, ScheduleState, name)
        lr = _lr_at(learning_rate, state.count, name, like=updates)
        leaves, spec, _ = _flatten(updates, name)
        return optree.tree_unflatten(spec, [-lr * u for u in leaves]), ScheduleState(count=state.count + 1)

    return Transform(lambda params: ScheduleState(count=0), update, StagePrivacy("optimizer", "scale_by_learning_rate"))


@typechecked
def add_decoupled_weight_decay(
    weight_decay: Real,
    learning_rate: ScalarOrSchedule,
    mask: DecayMask = None,
    *,
    name: str = "add_decoupled_weight_decay",
) -> Transform:
    """Decoupled weight decay (Loshchilov & Hutter 2019): subtracts ``learning_rate * weight_decay * params``.

    It goes after the learning rate has been applied (after
    :func:`scale_by_learning_rate`, or after ``scale_by_adam(learning_rate=lr)``), so the
    decay bypasses Adam's moments and scales with the learning rate, as
    torch.optim.AdamW: ``out = updates - (lr * weight_decay) * params``.

    Args:
        weight_decay: the decay factor, >= 0 (0 passes the updates through).
        learning_rate: the learning rate the decay is scaled by (a float or the same schedule
            as the optimizer's, called with the update count).
        mask: which parameters decay, as in :func:`add_decayed_weights`.
        name: the name errors use.

    Privacy: post-processing; the term depends on the parameters and the step count only.

    Raises:
        InputValueError: ``params`` missing in ``update``; a mask or params of another structure.

    Example:
        >>> import torch
        >>> t = add_decoupled_weight_decay(0.5, 0.1)
        >>> params = [torch.ones(1)]
        >>> out, _ = t.update([torch.zeros(1)], t.init(params), params)
        >>> out[0].tolist()
        [-0.05000000074505806]
    """
    weight_decay = check.non_negative(weight_decay, "weight_decay", name)
    _check_lr(learning_rate, name)

    def update(updates: Any, state: ScheduleState, params: Any = None, **extra: Any) -> tuple[Any, ScheduleState]:
        expect_state(state, ScheduleState, name)
        if weight_decay == 0.0:
            return updates, ScheduleState(count=state.count + 1)
        lr = _lr_at(learning_rate, state.count, name, like=updates)
        leaves, spec, _ = _flatten(updates, name)
        p_leaves = _param_leaves(params, spec, name, "weight_decay")
        decayed = _decay_mask(mask, params, spec, name)
        out = [u - (lr * weight_decay) * p if d else u for u, p, d in zip(leaves, p_leaves, decayed)]
        return optree.tree_unflatten(spec, out), ScheduleState(count=state.count + 1)

    described = f"add_decoupled_weight_decay({weight_decay:g})"
    return Transform(lambda params: ScheduleState(count=0), update, StagePrivacy("optimizer", described))


# --- private helpers ---------------------------------------------------------------


def _adam_init(name: str) -> Callable[[Any], ScaleByAdamState]:
    def init(params: Any) -> ScaleByAdamState:
        if params is None:
            raise InputValueError(f"{name}.init needs params to shape its moments; call init(params).")
        return ScaleByAdamState(count=0, mu=zeros_like(params), nu=zeros_like(params))

    return init


def _moments(state: ScaleByAdamState, spec: Any, g_leaves: list[torch.Tensor],
             square: Callable[[int, torch.Tensor], torch.Tensor], b1: float, b2: float,
             name: str) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """Adam's moments after one more gradient, ``(m, v, t)``: ``m`` from the gradient leaves,
    ``v`` from ``square(i, v_i)`` (the gradient's square, or a noised squared stream)."""
    m_leaves = _state_leaves(state.mu, spec, name, "mu")
    v_leaves = _state_leaves(state.nu, spec, name, "nu")
    m_leaves = [b1 * m + (1.0 - b1) * g for m, g in zip(m_leaves, g_leaves)]
    v_leaves = [b2 * v + (1.0 - b2) * square(i, v) for i, v in enumerate(v_leaves)]
    return m_leaves, v_leaves, state.count + 1


def _adam_step(spec: Any, m_leaves: list[torch.Tensor], v_leaves: list[torch.Tensor], t: int,
               denoms: list[torch.Tensor], bc1: float, lr: Any) -> tuple[Any, ScaleByAdamState]:
    """The direction ``m_hat / denom`` (``lr`` None), or torch.optim.Adam's update
    ``-(lr / bc1) * (m / denom)``, and the new state."""
    if lr is None:
        out = [(m / bc1) / d for m, d in zip(m_leaves, denoms)]
    else:
        step_size = lr / bc1
        out = [-step_size * (m / d) for m, d in zip(m_leaves, denoms)]
    new_state = ScaleByAdamState(count=t, mu=optree.tree_unflatten(spec, m_leaves), nu=optree.tree_unflatten(spec, v_leaves))
    return optree.tree_unflatten(spec, out), new_state


def _rewrap(like: Any, tree: Any) -> Any:
    """``tree`` in ``like``'s DP wrapper (same sensitivity and noise), or ``tree`` itself."""
    return replace(like, pytree=tree) if isinstance(like, ClippedPytree) else tree


def _squared_leaves(pair: SecondMomentNoiseOutput, spec: Any, where: str) -> list[torch.Tensor]:
    squares, sq_spec, _ = _flatten(pair.noisy_squared_grads, where)
    if sq_spec != spec:
        raise InputValueError(f"{where}: the squared-gradient stream's structure {sq_spec} differs from the gradient's {spec}.")
    return squares


def _decay_mask(mask: DecayMask, params: Any, spec: Any, where: str) -> list[bool]:
    """Per parameter leaf: whether weight decay applies (``mask=None``: every leaf)."""
    if mask is None:
        return [True] * spec.num_leaves
    tree = mask(params) if callable(mask) else mask
    leaves, mspec = optree.tree_flatten(tree, namespace=NAMESPACE)
    if mspec != spec:
        raise InputValueError(
            f"{where}: the weight-decay mask's tree structure ({mspec}) differs from the parameters' ({spec}); give "
            "one bool per parameter leaf, in the parameters' structure (or a callable params -> such a tree)."
        )
    for leaf in leaves:
        if not isinstance(leaf, bool):
            raise InputTypeError(
                f"{where}: the weight-decay mask's leaves must be bools (True: decayed); got a {type(leaf).__name__}."
            )
    return list(leaves)


def _noise_variances(grads: Any, paths: list[Any], setting: Any, where: str) -> list[float]:
    """Per-leaf noise variance Phi for DP bias correction."""
    from_input = None
    if isinstance(grads, NoisedPytree) and grads.noise_stddev is not None:
        sd = grads.noise_stddev
        if isinstance(sd, PerGroup):
            from_input = [sd.for_path(p) ** 2 for p in paths]
        else:
            from_input = [float(sd) ** 2] * len(paths)
    if setting == "auto":
        if from_input is None:
            raise InputTypeError(
                f"{where}(dp_bias_correction='auto') reads noise_stddev from a NoisedPytree (the output of the "
                f"noise stage); got {type(grads).__name__}"
                f"{' with noise_stddev=None' if isinstance(grads, NoisedPytree) else ''}. Pass the noised "
                "gradient itself, or give the noise variance as a float: dp_bias_correction=(sigma * C / B) ** 2."
            )
        return from_input
    if from_input is not None and any(not math.isclose(setting, v, rel_tol=1e-6, abs_tol=0.0) for v in from_input):
        raise InputValueError(
            f"{where}: dp_bias_correction={setting!r} disagrees with the gradient's noise variance "
            f"noise_stddev**2 = {sorted(set(from_input))}. Use dp_bias_correction='auto' to take it from the "
            "NoisedPytree, or check the value (it is a variance, on the scale of the normalized gradient)."
        )
    return [float(setting)] * len(paths)


def _flatten(grads: Any, where: str) -> tuple[list[torch.Tensor], Any, list[Any]]:
    if isinstance(grads, SecondMomentClippingOutput):
        raise InputTypeError(
            f"{where} got a SecondMomentClippingOutput that was never noised: training on it would release the "
            "clipped gradients and their squares without noise. Add the noise stage before the optimizer."
        )
    if isinstance(grads, SecondMomentNoiseOutput):
        raise InputTypeError(
            f"{where} has no second moment to feed from a SecondMomentNoiseOutput: the squared-gradient stream "
            "would cost budget for nothing. Use adam or adamw, or clip without second_moment=True."
        )
    if isinstance(grads, ClippedPytree) and not isinstance(grads, NoisedPytree):
        raise InputTypeError(
            f"{where} got a ClippedPytree that was never noised: training on it would release the clipped "
            "gradients without noise, which is not private. Add the noise stage (noise(noise_multiplier=sigma, "
            "key=key) or gaussian_noise) before the optimizer, or noise_multiplier=0 for an explicit non-private "
            "baseline; pass `.pytree` only if you mean to leave DP altogether."
        )
    paths, leaves, spec = tree_flatten_with_paths(unwrap(grads))
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            raise InputTypeError(
                f"{where} needs gradients that are a pytree of tensors; the leaf at path {path} is a "
                f"{type(leaf).__name__}."
            )
    return leaves, spec, paths


def _param_leaves(params: Any, spec: Any, where: str, why: str) -> list[torch.Tensor]:
    if params is None:
        raise InputValueError(
            f"{where} with {why} != 0 needs the parameters: call update(grads, state, params)."
        )
    leaves, pspec = optree.tree_flatten(unwrap(params), namespace=NAMESPACE)
    if pspec != spec:
        raise InputValueError(f"{where}: params and gradients have different tree structures ({pspec} vs {spec}).")
    return leaves


def _state_leaves(tree: Any, spec: Any, where: str, what: str) -> list[torch.Tensor]:
    leaves, sspec = optree.tree_flatten(tree, namespace=NAMESPACE)
    if sspec != spec:
        raise InputValueError(
            f"{where}: the gradient's tree structure does not match the state's {what} ({spec} vs {sspec}); "
            "initialise the optimizer with params shaped like the gradients."
        )
    return leaves


def expect_state(state: Any, cls: type, where: str) -> None:
    """Raises unless ``state`` is the ``cls`` an optimizer's ``init`` (or a previous update)
    returned; ``where`` names the transform in the message (shared by the primitives and the
    optimizers built from them)."""
    if not isinstance(state, cls):
        raise InputTypeError(
            f"{where}.update needs the {cls.__name__} returned by init or a previous update; got {type(state).__name__}."
        )


def _check_lr(lr: Any, where: str) -> None:
    if callable(lr):
        return
    check.non_negative(lr, "learning_rate", where)


def _lr_at(lr: ScalarOrSchedule, count: int, where: str, like: Any = None) -> float | torch.Tensor:
    """The learning rate at ``count``: a float, or inside a compiled step a scheduled one as a
    0-d tensor on ``like``'s device, computed outside the graph. A schedule traced with a
    symbolic step would specialize on each step's value (``float``, range checks, the
    schedule's own branches) and recompile every step."""
    if not callable(lr):
        return float(lr)
    if torch.compiler.is_compiling():
        return _scheduled_lr_tensor(lr, count, where, _first_leaf(like))
    return _scheduled_lr(lr, count, where)


@torch.compiler.disable
def _scheduled_lr_tensor(lr: Callable[[int], Any], count: int, where: str, like: torch.Tensor | None) -> torch.Tensor:
    device = like.device if isinstance(like, torch.Tensor) else None
    return torch.tensor(_scheduled_lr(lr, count, where), dtype=torch.float64, device=device)


def _first_leaf(tree: Any) -> torch.Tensor | None:
    found = optree.tree_leaves(unwrap(tree), namespace=NAMESPACE) if tree is not None else []
    return found[0] if found and isinstance(found[0], torch.Tensor) else None


def _scheduled_lr(lr: Callable[[int], Any], count: int, where: str) -> float:
    value = lr(count)
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise InputTypeError(
            f"{where}: the learning-rate schedule returned {type(value).__name__} at step {count}; it must return a float."
        ) from None
    if not math.isfinite(value) or value < 0:
        raise InputValueError(f"{where}: the learning-rate schedule returned {value} at step {count}; it must be finite and >= 0.")
    return value
