"""Optimizers as pure transforms (the optax contract): ``sgd``, ``adam``, ``adamw``.

Each returns a :class:`~opake_fx.transforms.Transform`::

    state = opt.init(params)
    updates, state = opt.update(grads, state, params)
    params = apply_updates(params, updates)        # params + updates

``updates`` are to be *added* to the parameters (``-learning_rate * direction``), exactly
as in optax. Gradients may be plain pytrees or a noised DP wrapper
(:class:`~opake_fx.types.NoisedPytree`; an un-noised ``ClippedPytree`` is refused); the
updates are plain pytrees. Nothing is modified in place: ``grads``, ``params`` and the
old state are left untouched, and the numbers match ``torch.optim.SGD``, ``Adam`` and
``AdamW`` step for step.

Each is a composition of the primitives of :mod:`opake_fx.optim_primitives` (``sgd``:
``add_decayed_weights``, ``trace``, ``scale_by_learning_rate``; ``adam``/``adamw``:
``add_decayed_weights`` or ``add_decoupled_weight_decay`` around ``scale_by_adam`` or
``scale_by_private_second_moment``), which hold all the arithmetic; the optimizers keep
their own state types (:class:`SgdState`, :class:`AdamState`) and argument checks.

``learning_rate`` is a float or a schedule (:mod:`opake_fx.scheduling`), called with the
number of updates already applied (0 for the first update).

DP bias correction (DP-AdamBC; Tang, Shpilevskiy & Lécuyer, AAAI 2024): the Gaussian
noise of DP-SGD adds its variance ``Phi = noise_stddev**2`` to every coordinate of
Adam's second moment, so ``sqrt(v_hat)`` is dominated by noise and DP-Adam behaves like
DP-SGD with a rescaled learning rate. ``adam(..., dp_bias_correction=...)`` subtracts
``Phi`` and divides by ``sqrt(max(v_hat - Phi, gamma))`` instead of ``sqrt(v_hat) + eps``.

The private second moment (the alternative to bias correction): ``clipped_grad(...,
second_moment=True)`` also releases the clipped per-example squared gradients, and the
noise stage noises both streams under one budget (a
:class:`~opake_fx.types.SecondMomentNoiseOutput`). Given that pair, :func:`adam` and
:func:`adamw` feed ``v`` with the noised squared stream instead of the square of the
noised gradient, whose ``noise_stddev**2`` floor it never sees; see :func:`adam`.

Privacy: optimizers are post-processing of their input: applied to a ``NoisedPytree``
they change no guarantee. They add no privacy either: applied to a plain gradient the
result is not private, and a ``ClippedPytree`` that was never noised is refused
(``InputTypeError``: a clipped gradient means DP was intended, and training on it
without noise would release it); a non-private baseline adds ``noise_multiplier=0``.

Example:
    >>> import torch
    >>> from opake_fx.transforms import apply_updates
    >>> params = {"w": torch.ones(2)}
    >>> opt = sgd(0.1, momentum=0.9)
    >>> state = opt.init(params)
    >>> updates, state = opt.update({"w": torch.ones(2)}, state, params)
    >>> [round(x, 6) for x in apply_updates(params, updates)["w"].tolist()]
    [0.9, 0.9]
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Real
from typing import Any

import opake_fx.validation as check
from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.optim_primitives import (
    BiasCorrection,
    DecayMask,
    ScalarOrSchedule,
    ScaleByAdamState,
    ScheduleState,
    TraceState,
    add_decayed_weights,
    add_decoupled_weight_decay,
    expect_state,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_private_second_moment,
    trace,
)
from opake_fx.pipeline_privacy import StagePrivacy
from opake_fx.transforms import Transform
from opake_fx.types import EmptyState, SecondMomentNoiseOutput
from opake_fx.typing import typechecked

__all__ = ["SgdState", "AdamState", "sgd", "adam", "adamw"]


@dataclass(frozen=True)
class SgdState:
    """State of :func:`sgd`: ``count`` updates applied, and the momentum buffers (``None`` without momentum)."""

    count: int
    momentum: Any = None


@dataclass(frozen=True)
class AdamState:
    """State of :func:`adam` / :func:`adamw`: ``count`` updates applied, first (``mu``) and second (``nu``) moments."""

    count: int
    mu: Any
    nu: Any


@typechecked
def sgd(
    learning_rate: ScalarOrSchedule,
    momentum: Real = 0.0,
    nesterov: bool = False,
    weight_decay: Real = 0.0,
    *,
    mask: DecayMask = None,
) -> Transform:
    """Stochastic gradient descent with optional (Nesterov) momentum and L2 weight decay.

    Matches ``torch.optim.SGD`` (dampening 0)::

        g = grad + weight_decay * params
        buf = momentum * buf + g                # buf starts at 0, so buf_1 = g_1
        d = g + momentum * buf if nesterov else buf
        updates = -learning_rate(count) * d

    Args:
        learning_rate: a float >= 0 or a schedule ``step -> float``.
        momentum: momentum factor >= 0 (0 disables the buffers).
        nesterov: use Nesterov momentum (needs ``momentum > 0``).
        weight_decay: L2 penalty added to the gradient; needs ``params`` in ``update``.
        mask: which parameters ``weight_decay`` applies to (see :func:`adamw`); ``None``:
            all of them.

    Privacy: post-processing of the gradient it is given.

    Example:
        >>> import torch
        >>> opt = sgd(0.5)
        >>> updates, _ = opt.update([torch.ones(2)], opt.init(None))
        >>> updates[0].tolist()
        [-0.5, -0.5]
    """
    # The learning-rate stage is built first: it checks learning_rate, under sgd's name.
    lr_stage = scale_by_learning_rate(learning_rate, name="sgd")
    momentum = check.non_negative(momentum, "momentum", "sgd")
    weight_decay = check.non_negative(weight_decay, "weight_decay", "sgd")
    if not isinstance(nesterov, bool):
        raise InputTypeError(f"sgd needs nesterov to be a bool; got {type(nesterov).__name__}.")
    if nesterov and momentum == 0.0:
        raise InputValueError("sgd(nesterov=True) needs momentum > 0; got momentum=0.")
    # chain(add_decayed_weights, trace, scale_by_learning_rate), its state kept as one SgdState
    decay = add_decayed_weights(weight_decay, mask, name="sgd") if weight_decay != 0.0 else None
    momentum_stage = trace(momentum, nesterov, name="sgd") if momentum != 0.0 else None

    def init(params: Any) -> SgdState:
        if momentum_stage is None:
            return SgdState(count=0)
        if params is None:
            raise InputValueError(
                "sgd(momentum > 0).init needs params to shape its momentum buffers; call init(params)."
            )
        return SgdState(count=0, momentum=momentum_stage.init(params).trace)

    def update(grads: Any, state: SgdState, params: Any = None, **extra: Any) -> tuple[Any, SgdState]:
        expect_state(state, SgdState, "sgd")
        if decay is not None:
            grads, _ = decay.update(grads, EmptyState(), params)
        new_buf = None
        if momentum_stage is not None:
            grads, traced = momentum_stage.update(grads, TraceState(trace=state.momentum))
            new_buf = traced.trace
        updates, counted = lr_stage.update(grads, ScheduleState(count=state.count))
        return updates, SgdState(count=counted.count, momentum=new_buf)

    return Transform(init, update, StagePrivacy("optimizer", f"sgd(momentum={momentum:g})"))


@typechecked
def adam(
    learning_rate: ScalarOrSchedule,
    b1: Real = 0.9,
    b2: Real = 0.999,
    eps: Real = 1e-8,
    weight_decay: Real = 0.0,
    *,
    dp_bias_correction: BiasCorrection = None,
    dp_bias_correction_gamma: Real = 1e-8,
    mask: DecayMask = None,
) -> Transform:
    """Adam (Kingma & Ba 2015) with optional L2 weight decay and DP bias correction.

    Matches ``torch.optim.Adam``: ``weight_decay`` is an L2 penalty added to the
    gradient (coupled; see :func:`adamw` for decoupled decay)::

        g = grad + weight_decay * params
        m = b1 * m + (1 - b1) * g;  v = b2 * v + (1 - b2) * g**2        # t = count + 1
        m_hat = m / (1 - b1**t);    v_hat = v / (1 - b2**t)
        updates = -lr * m_hat / (sqrt(v_hat) + eps)
        # with dp_bias_correction (DP-AdamBC, Tang et al. 2024):
        updates = -lr * m_hat / sqrt(max(v_hat - Phi, gamma))

    Args:
        learning_rate: a float >= 0 or a schedule ``step -> float``.
        b1, b2: moment decay rates in ``[0, 1)``.
        eps: added to ``sqrt(v_hat)`` (unused with bias correction, as in the paper).
        weight_decay: L2 penalty added to the gradient; needs ``params`` in ``update``.
        mask: which parameters ``weight_decay`` applies to (see :func:`adamw`); ``None``:
            all of them.
        dp_bias_correction: ``None`` (default) for plain Adam. Otherwise the noise
            variance ``Phi`` per coordinate to subtract from ``v_hat``:

            * ``"auto"``: read it from the gradient, which must then be a
              :class:`~opake_fx.types.NoisedPytree`: ``Phi = noise_stddev**2`` (per leaf
              for a :class:`~opake_fx.types.PerGroup` stddev). In the pipeline the noised
              gradient is the clipped sum divided by ``normalize_by``, and
              ``noise_stddev`` is already on that scale (``sigma * C / normalize_by``).
            * a float ``Phi >= 0``: use it (e.g. ``(sigma * C / B) ** 2`` for code that
              passes plain tensors). If the gradient is a ``NoisedPytree`` whose
              ``noise_stddev**2`` differs, an error is raised.
        dp_bias_correction_gamma: the floor ``gamma`` (``gamma'`` in the paper) of the
            corrected (or private) second moment; it bounds the per-coordinate step by
            ``lr * |m_hat| / sqrt(gamma)``, so tune it with the learning rate.

    The private second moment: when ``grads`` is a
    :class:`~opake_fx.types.SecondMomentNoiseOutput` (``clipped_grad(...,
    second_moment=True)`` then the noise stage), ``m`` is fed with the noised gradient
    ``noisy_grads`` and ``v`` with the noised clipped squared gradients
    ``noisy_squared_grads`` (an unbiased estimate of the mean per-example squared
    gradient, so no noise variance to subtract), and
    ``updates = -lr * m_hat / sqrt(max(v_hat, gamma))`` (the noised squares can be
    negative; ``gamma = dp_bias_correction_gamma``). With coupled ``weight_decay`` the
    squares are those of ``g + weight_decay * params``:
    ``s + 2 * weight_decay * params * g + (weight_decay * params)**2``. It is an
    alternative to ``dp_bias_correction`` (both together would correct twice: refused).
    Note that ``v`` then tracks the mean per-example ``g_i**2``, not the square of the
    batch mean, so the learning rate wants retuning.

    Privacy: post-processing of the gradient it is given. Bias correction uses only
    ``noise_stddev``, a public parameter of the mechanism, so it changes no guarantee;
    the private second moment uses a stream already released under the same budget.

    Example:
        >>> import torch
        >>> params = [torch.zeros(2)]
        >>> opt = adam(1e-3)
        >>> updates, state = opt.update([torch.tensor([1.0, -2.0])], opt.init(params), params)
        >>> [round(u, 6) for u in updates[0].tolist()]  # Adam's first step: -lr * sign(g)
        [-0.001, 0.001]
    """
    return _adam("adam", learning_rate, b1, b2, eps, weight_decay, False, dp_bias_correction, dp_bias_correction_gamma, mask)


@typechecked
def adamw(
    learning_rate: ScalarOrSchedule,
    b1: Real = 0.9,
    b2: Real = 0.999,
    eps: Real = 1e-8,
    weight_decay: Real = 1e-2,
    *,
    dp_bias_correction: BiasCorrection = None,
    dp_bias_correction_gamma: Real = 1e-8,
    mask: DecayMask = None,
) -> Transform:
    """Adam with decoupled weight decay (Loshchilov & Hutter 2019), as ``torch.optim.AdamW``.

    ``updates = -lr * (adam_direction + weight_decay * params)``: the decay is applied
    to the parameters directly, not through the moments. The default ``weight_decay``
    is torch's ``1e-2``; ``params`` must be passed to ``update`` when it is nonzero.
    Arguments are those of :func:`adam` (including ``dp_bias_correction``).

    ``mask`` (optax's): which parameters are decayed. A pytree of bools with the
    parameters' structure (``True``: decayed), or a callable ``params ->`` such a pytree,
    called at each update; ``None`` (default) decays every parameter. A masked-out
    parameter gets the plain Adam update, as a parameter in a ``weight_decay=0`` group of
    ``torch.optim.AdamW`` (Hugging Face's Trainer exempts biases and LayerNorm weights
    this way). A mask of another structure is an error.

    Privacy: post-processing of the gradient it is given; the decay (masked or not)
    depends on the parameters only, never on the data, so it changes no guarantee.

    Example:
        >>> import torch
        >>> params = [torch.ones(2)]
        >>> opt = adamw(0.1, weight_decay=0.5)
        >>> updates, _ = opt.update([torch.zeros(2)], opt.init(params), params)
        >>> updates[0].tolist()
        [-0.05000000074505806, -0.05000000074505806]
        >>> params = {"w": torch.ones(2), "bias": torch.ones(2)}
        >>> opt = adamw(0.1, weight_decay=0.5, mask=lambda p: {k: k != "bias" for k in p})
        >>> updates, _ = opt.update({"w": torch.zeros(2), "bias": torch.zeros(2)}, opt.init(params), params)
        >>> updates["w"].tolist(), updates["bias"].abs().tolist()  # zero gradients: only "w" decays
        ([-0.05000000074505806, -0.05000000074505806], [0.0, 0.0])
    """
    return _adam("adamw", learning_rate, b1, b2, eps, weight_decay, True, dp_bias_correction, dp_bias_correction_gamma, mask)


# --- private helpers ---------------------------------------------------------------


def _adam(
    name: str,
    learning_rate: ScalarOrSchedule,
    b1: Real,
    b2: Real,
    eps: Real,
    weight_decay: Real,
    decoupled: bool,
    dp_bias_correction: BiasCorrection,
    gamma: Real,
    mask: DecayMask = None,
) -> Transform:
    """adam/adamw as a composition of primitives, with the state kept as one :class:`AdamState`.

    adam:  add_decayed_weights -> scale_by_adam(learning_rate=lr)  (or scale_by_private_second_moment)
    adamw: scale_by_adam(learning_rate=lr) -> add_decoupled_weight_decay
    The Adam stage folds the learning rate in (torch.optim.Adam's order of operations), so
    the numbers are those of torch to rounding, and exactly those of the former monolith.
    """
    # scale_by_adam checks learning_rate, b1, b2, eps, the gamma and dp_bias_correction under the optimizer's name.
    moments = scale_by_adam(
        b1, b2, eps, dp_bias_correction=dp_bias_correction, dp_bias_correction_gamma=gamma,
        learning_rate=learning_rate, name=name,
    )
    weight_decay = check.non_negative(weight_decay, "weight_decay", name)
    gamma = float(gamma)
    # The floor of a private second moment, whose noised squares can be <= 0.
    private = scale_by_private_second_moment(b1, b2, gamma if gamma > 0 else 1e-8, learning_rate=learning_rate, name=name)
    coupled = add_decayed_weights(weight_decay, mask, name=name) if weight_decay != 0.0 and not decoupled else None
    uncoupled = add_decoupled_weight_decay(weight_decay, learning_rate, mask, name=name) if weight_decay != 0.0 and decoupled else None

    def init(params: Any) -> AdamState:
        s = moments.init(params)
        return AdamState(count=s.count, mu=s.mu, nu=s.nu)

    def update(grads: Any, state: AdamState, params: Any = None, **extra: Any) -> tuple[Any, AdamState]:
        expect_state(state, AdamState, name)
        if isinstance(grads, SecondMomentNoiseOutput) and dp_bias_correction is not None:
            raise InputValueError(
                f"{name}: got a SecondMomentNoiseOutput (a private second moment) and dp_bias_correction is set; "
                "they are alternative fixes of the same noise floor and together would correct it twice. Drop "
                "dp_bias_correction, or clip without second_moment=True."
            )
        stage = private if isinstance(grads, SecondMomentNoiseOutput) else moments
        if coupled is not None:
            grads, _ = coupled.update(grads, EmptyState(), params)
        updates, s = stage.update(grads, ScaleByAdamState(count=state.count, mu=state.mu, nu=state.nu))
        if uncoupled is not None:
            updates, _ = uncoupled.update(updates, ScheduleState(count=state.count), params)
        return updates, AdamState(count=s.count, mu=s.mu, nu=s.nu)

    return Transform(init, update, StagePrivacy("optimizer", name))

