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

import math
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Real
from typing import Any

import optree
import torch

import opake_fx.validation as check
from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.pytree import NAMESPACE, tree_flatten_with_paths, zeros_like
from opake_fx.transforms import Transform, unwrap
from opake_fx.pipeline_privacy import StagePrivacy
from opake_fx.types import (
    ClippedPytree,
    NoisedPytree,
    PerGroup,
    SecondMomentClippingOutput,
    SecondMomentNoiseOutput,
)
from opake_fx.typing import typechecked

__all__ = ["SgdState", "AdamState", "sgd", "adam", "adamw"]

# Real: int, float and numpy scalars. BiasCorrection is "auto", a noise variance or None;
# it is hinted str rather than Literal["auto"] so that another string is reported as a
# wrong value (InputValueError), not a wrong type.
ScalarOrSchedule = Real | Callable[[int], float]
BiasCorrection = Real | str | None
# A pytree of bools shaped like the parameters, or a callable params -> such a pytree (optax's ``mask``).
DecayMask = Any


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
    _check_lr(learning_rate, "sgd")
    momentum = check.non_negative(momentum, "momentum", "sgd")
    weight_decay = check.non_negative(weight_decay, "weight_decay", "sgd")
    if not isinstance(nesterov, bool):
        raise InputTypeError(f"sgd needs nesterov to be a bool; got {type(nesterov).__name__}.")
    if nesterov and momentum == 0.0:
        raise InputValueError("sgd(nesterov=True) needs momentum > 0; got momentum=0.")

    def init(params: Any) -> SgdState:
        if momentum == 0.0:
            return SgdState(count=0)
        if params is None:
            raise InputValueError(
                "sgd(momentum > 0).init needs params to shape its momentum buffers; call init(params)."
            )
        return SgdState(count=0, momentum=zeros_like(params))

    def update(grads: Any, state: SgdState, params: Any = None, **extra: Any) -> tuple[Any, SgdState]:
        _check_state(state, SgdState, "sgd")
        lr = _lr_at(learning_rate, state.count, "sgd", like=grads)
        g_leaves, spec, _ = _flatten(grads, "sgd")
        if weight_decay != 0.0:
            p_leaves = _param_leaves(params, spec, "sgd", "weight_decay")
            decayed = _decay_mask(mask, params, spec, "sgd")
            g_leaves = [g + weight_decay * p if d else g for g, p, d in zip(g_leaves, p_leaves, decayed)]
        new_buf = None
        if momentum != 0.0:
            b_leaves = _state_leaves(state.momentum, spec, "sgd", "momentum")
            b_leaves = [momentum * b + g for b, g in zip(b_leaves, g_leaves)]
            d_leaves = [g + momentum * b for g, b in zip(g_leaves, b_leaves)] if nesterov else b_leaves
            new_buf = optree.tree_unflatten(spec, b_leaves)
        else:
            d_leaves = g_leaves
        updates = optree.tree_unflatten(spec, [-lr * d for d in d_leaves])
        return updates, SgdState(count=state.count + 1, momentum=new_buf)

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
    b1: float,
    b2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    dp_bias_correction: BiasCorrection,
    gamma: float,
    mask: DecayMask = None,
) -> Transform:
    _check_lr(learning_rate, name)
    b1 = check.interval(b1, "b1", name, 0.0, 1.0, high_open=True)
    b2 = check.interval(b2, "b2", name, 0.0, 1.0, high_open=True)
    eps = check.non_negative(eps, "eps", name)
    weight_decay = check.non_negative(weight_decay, "weight_decay", name)
    gamma = check.non_negative(gamma, "dp_bias_correction_gamma", name)
    if dp_bias_correction is not None and dp_bias_correction != "auto":
        if isinstance(dp_bias_correction, str):
            raise InputValueError(
                f"{name} needs dp_bias_correction to be None, 'auto' or a noise variance >= 0; "
                f"got {dp_bias_correction!r}."
            )
        dp_bias_correction = check.non_negative(dp_bias_correction, "dp_bias_correction", name)
    # The floor of a private second moment, whose noised squares can be <= 0.
    gamma_floor = gamma if gamma > 0 else 1e-8
    if dp_bias_correction is not None and gamma == 0.0:
        raise InputValueError(
            f"{name} with dp_bias_correction needs dp_bias_correction_gamma > 0 (the floor of the "
            "corrected second moment); got 0, which can divide by zero."
        )

    def init(params: Any) -> AdamState:
        if params is None:
            raise InputValueError(f"{name}.init needs params to shape its moments; call init(params).")
        return AdamState(count=0, mu=zeros_like(params), nu=zeros_like(params))

    def update(grads: Any, state: AdamState, params: Any = None, **extra: Any) -> tuple[Any, AdamState]:
        _check_state(state, AdamState, name)
        lr = _lr_at(learning_rate, state.count, name, like=grads)
        squares = None  # the private second moment's noised squared gradients, leaf by leaf
        if isinstance(grads, SecondMomentNoiseOutput):
            if dp_bias_correction is not None:
                raise InputValueError(
                    f"{name}: got a SecondMomentNoiseOutput (a private second moment) and dp_bias_correction is set; "
                    "they are alternative fixes of the same noise floor and together would correct it twice. Drop "
                    "dp_bias_correction, or clip without second_moment=True."
                )
            squares, sq_spec, _ = _flatten(grads.noisy_squared_grads, name)
            grads = grads.noisy_grads
        g_leaves, spec, paths = _flatten(grads, name)
        if squares is not None and sq_spec != spec:
            raise InputValueError(f"{name}: the squared-gradient stream's structure {sq_spec} differs from the gradient's {spec}.")
        phis = None if dp_bias_correction is None else _noise_variances(grads, paths, dp_bias_correction, name)
        p_leaves = None
        decayed = [False] * len(g_leaves)
        if weight_decay != 0.0:
            p_leaves = _param_leaves(params, spec, name, "weight_decay")
            decayed = _decay_mask(mask, params, spec, name)
            if not decoupled:
                if squares is not None:  # the squares of g + wd * p, from the two private streams
                    squares = [
                        s + 2.0 * weight_decay * p * g + (weight_decay * p) ** 2 if d else s
                        for s, g, p, d in zip(squares, g_leaves, p_leaves, decayed)
                    ]
                g_leaves = [g + weight_decay * p if d else g for g, p, d in zip(g_leaves, p_leaves, decayed)]
        m_leaves = _state_leaves(state.mu, spec, name, "mu")
        v_leaves = _state_leaves(state.nu, spec, name, "nu")
        m_leaves = [b1 * m + (1.0 - b1) * g for m, g in zip(m_leaves, g_leaves)]
        if squares is None:
            v_leaves = [b2 * v + (1.0 - b2) * (g * g) for v, g in zip(v_leaves, g_leaves)]
        else:
            v_leaves = [b2 * v + (1.0 - b2) * sq.to(v.dtype) for v, sq in zip(v_leaves, squares)]
        t = state.count + 1
        bc1 = 1.0 - b1**t
        bc2 = 1.0 - b2**t
        step_size = lr / bc1
        out = []
        for i, (m, v) in enumerate(zip(m_leaves, v_leaves)):
            if squares is not None:
                denom = torch.clamp(v / bc2, min=gamma_floor).sqrt()
            elif phis is None:
                # torch.optim.Adam's order of operations, so the numbers agree to rounding.
                denom = v.sqrt() / math.sqrt(bc2) + eps
            else:
                denom = torch.clamp(v / bc2 - phis[i], min=gamma).sqrt()
            u = -step_size * (m / denom)
            if decoupled and p_leaves is not None and decayed[i]:
                u = u - (lr * weight_decay) * p_leaves[i]
            out.append(u)
        new_state = AdamState(count=t, mu=optree.tree_unflatten(spec, m_leaves), nu=optree.tree_unflatten(spec, v_leaves))
        return optree.tree_unflatten(spec, out), new_state

    return Transform(init, update, StagePrivacy("optimizer", name))


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


def _check_state(state: Any, cls: type, where: str) -> None:
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


