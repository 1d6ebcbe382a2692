"""Fixed-norm per-example clipping: :func:`clipped_grad`."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from opake_fx.dpsgd.clipping._entry import fixed_norm_grad_fn
from opake_fx.dpsgd.clipping.options import check_clipping_norm
from opake_fx.dpsgd.clipping.types import ClipBackend, FixedClipState
from opake_fx.errors import InputValueError
from opake_fx.functional import FunctionalModel
from opake_fx.types import PerGroup

__all__ = ["clipped_grad", "clip_weights"]


def clipped_grad(
    loss_fn: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    clipping_norm: float | PerGroup,
    normalize_by: float = 1.0,
    batch_argnums: int | Sequence[int] = 1,
    microbatch_size: int | None = None,
    return_stats: bool = False,
    return_aux: bool = False,
    dtype: torch.dtype | None = None,
    clip_backend: ClipBackend = "vmap",
    model: FunctionalModel | nn.Module | None = None,
    pre_clip: Callable[[Any], Any] | None = None,
    second_moment: bool = False,
) -> tuple[Callable[..., Any], FixedClipState]:
    """Makes a function that returns the sum of clipped per-example gradients.

    With the default ``clip_backend="vmap"``, ``loss_fn`` is written for ONE example: it
    is vmapped over the leading dimension of the ``batch_argnums`` arguments (with
    ``"ghost"`` / ``"auto"`` it takes the whole batch and returns per-example losses). Each example's gradient (w.r.t. ``argnums``, over
    all their leaves together) is scaled to L2 norm ``<= clipping_norm``, the scaled
    gradients are summed and divided by ``normalize_by``.

    Args:
        loss_fn: ``loss_fn(params, x, y, ...) -> scalar`` for one example (or
            ``(scalar, aux)`` with ``has_aux``).
        argnums: position(s) of the arguments to differentiate (no batch axis).
        has_aux: ``loss_fn`` also returns a per-example auxiliary value.
        clipping_norm: the clip norm C (``inf`` disables clipping), or a
            :class:`~opake_fx.types.PerGroup` of per-group norms (see :func:`per_group`).
        normalize_by: divide the clipped sum by this (use the expected batch size for
            a mean gradient).
        batch_argnums: position(s) of the arguments that carry the batch axis.
        microbatch_size: process the batch in chunks of this many examples (same
            result, peak memory bounded by the chunk).
        return_stats: also return :class:`ClippingStats` (number/fraction clipped,
            batch size, non-finite count).
        return_aux: also return :class:`ClippedGradAux` (per-example losses and norms).
        dtype: dtype of the returned sum (default: at least float32).
        clip_backend: how per-example norms and the clipped sum are computed.
            ``"vmap"`` (default): ``vmap(grad(loss_fn))`` over single examples.
            ``"ghost"`` / ``"auto"``: from layer activations and output gradients of
            ONE batched forward and backward pass, without per-example gradients
            (ghost norms / book-keeping; ``"auto"`` picks the cheaper rule per layer).
            For these, ``loss_fn`` is called on the WHOLE batch and must return the
            per-example losses, shape ``[B]`` (``reduction="none"``), and ``model`` is
            required. Same result as ``"vmap"`` (see ``docs/clipping.md``). After the
            first call per module and input signature (which probes and decides), a
            step of either makes no host synchronisation. On a CUDA device ``"auto"``
            does not take the layer rules: they are slower than ``vmap`` there today
            (GPT-2 small, batch 16 x 256 tokens, float32, one H200: 1,445 ms per step
            against 210 ms for ``vmap`` and 175 ms non-private), so every parameter
            takes the exact whole-loss path, ``vmap`` of the batched ``loss_fn`` over
            single examples (decided once per signature, by the parameters' device
            type); ``"ghost"`` still forces the rules on any device. Inside a compiled
            step (:func:`opake_fx.compiled.compile_step`) ``"auto"`` traces its own path:
            each example alone under ``vmap``, the Linear rules on tapped calls, exact
            per-example gradients for the other parameters (``opake_fx/dpsgd/clipping/_traced.py``);
            where those would exceed ``2**25`` elements, the whole-loss path for batches
            of at most 64, else the rules eagerly.
        model: the :class:`~opake_fx.functional.FunctionalModel` (or ``nn.Module``)
            that ``loss_fn`` calls; its modules are hooked during the call. Only used
            by ``"ghost"`` / ``"auto"``.
        pre_clip: a per-example hook: ``pre_clip(grads) -> grads`` is applied to each
            example's gradient pytree (the structure of the ``argnums`` arguments,
            without a batch axis) before its norm is taken and it is clipped; it must
            return a pytree of the same structure and leaf shapes. The sanctioned place
            for per-example transforms (loss unscaling, preconditioning, masking): the
            clip bound holds for what it returns, whatever it does. It runs inside
            ``vmap`` (or the exact per-example loop where vmap cannot run), so it must
            be vmap-compatible. Needs ``clip_backend="vmap"``: the fast backends never
            form per-example gradients (an ``InputValueError`` says so).
        second_moment: also release the sum of the clipped per-example squared
            gradients, ``sum_i (w_i g_i) ** 2 / normalize_by`` (elementwise), for Adam's
            second moment: ``grad_fn`` then returns a
            :class:`~opake_fx.types.SecondMomentClippingOutput` ``(grads, squared_grads)``
            that the noise stages noise jointly (see ``docs/optimizers.md``). Needs
            ``clip_backend="vmap"`` and a scalar ``clipping_norm``.

    Returns:
        ``(grad_fn, state)``. ``grad_fn(*args, state=state, **kwargs)`` returns
        ``(ClippedPytree, state)``, or ``((ClippedPytree, stats_or_aux), state)``
        (a ``SecondMomentClippingOutput`` in place of the ``ClippedPytree`` with
        ``second_moment=True``).

    Privacy:
        Under add-or-remove-one neighbours the returned ``ClippedPytree`` has L2
        sensitivity ``max_norm = clipping_norm / normalize_by`` (``.effective`` of the
        per-group norms); under replace-one it is twice that. An example whose gradient
        is NaN or inf is zeroed (and counted), never propagated. Stats and aux are
        per-example, non-private diagnostics. ``pre_clip`` runs before the norm, so the
        bound is unaffected by it. With ``second_moment=True`` the squared stream has
        sensitivity ``clipping_norm**2 / normalize_by`` (``||v * v||_2 <= ||v||_2**2``
        for a clipped ``v``); the two streams together are ONE release, which the noise
        stages calibrate jointly so that it costs what the gradient alone would.

    Example (fast backend, batched loss)::

        fmodel, params = make_functional(net)
        loss = lambda p, x, y: F.cross_entropy(fmodel(p, x), y, reduction="none")  # [B]
        grad_fn, state = clipped_grad(loss, batch_argnums=(1, 2), clipping_norm=1.0,
                                      clip_backend="auto", model=fmodel)

    Example:
        >>> import torch
        >>> f = lambda p, x: 0.5 * ((x - p) ** 2).sum()
        >>> g, s = clipped_grad(f, clipping_norm=1.0)
        >>> out, s = g(torch.tensor(3.0), torch.tensor([0.0, 7.0, 3.5]), state=s)
        >>> round(float(out.pytree), 4), out.max_norm
        (-0.5, 1.0)
    """
    check_clipping_norm(clipping_norm)
    if second_moment and isinstance(clipping_norm, PerGroup):
        raise InputValueError(
            "clipped_grad(second_moment=True) needs one global clipping_norm; per-group norms are not supported "
            "for the squared-gradient stream."
        )
    return fixed_norm_grad_fn("clipped_grad", clip_weights, locals())


def clip_weights(norms: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """``min(1, C / norm)`` per example and group; exactly 1 at or below C."""
    # C / norm >= 1 exactly when norm <= C (also for norm = 0 and C = inf), so the clamp
    # gives exactly 1 there; NaN and inf norms are zeroed by the caller's finite mask.
    return (bounds.unsqueeze(1) / norms).clamp_max_(1.0)
