"""Fixed-norm per-example clipping: :func:`clipped_grad`."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Sequence

import torch
from torch import nn

from opake_fx.dpsgd.clipping._engine import check_clipping_norm, clipped_step, make_config, package
from opake_fx.dpsgd.clipping._ghost import ClipBackend, make_backend
from opake_fx.dpsgd.clipping.types import FixedClipState, check_state
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
            required. Same result as ``"vmap"`` (see ``docs/clipping.md``).
        model: the :class:`~opake_fx.functional.FunctionalModel` (or ``nn.Module``)
            that ``loss_fn`` calls; its modules are hooked during the call. Only used
            by ``"ghost"`` / ``"auto"``.

    Returns:
        ``(grad_fn, state)``. ``grad_fn(*args, state=state, **kwargs)`` returns
        ``(ClippedPytree, state)``, or ``((ClippedPytree, stats_or_aux), state)``.

    Privacy:
        Under add-or-remove-one neighbours the returned ``ClippedPytree`` has L2
        sensitivity ``max_norm = clipping_norm / normalize_by`` (``.effective`` of the
        per-group norms); under replace-one it is twice that. An example whose gradient
        is NaN or inf is zeroed (and counted), never propagated. Stats and aux are
        per-example, non-private diagnostics.

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
    cfg = make_config(
        argnums,
        batch_argnums,
        has_aux=has_aux,
        normalize_by=normalize_by,
        microbatch_size=microbatch_size,
        dtype=dtype,
        return_aux=return_aux,
        return_stats=return_stats,
    )
    backend = make_backend(clip_backend, model)

    def grad_fn(*args: Any, state: FixedClipState | None = None, **kwargs: Any) -> Any:
        check_state(state, FixedClipState, "clipped_grad")
        result = clipped_step(loss_fn, args, kwargs, cfg, clipping_norm=clipping_norm, weight_fn=clip_weights, backend=backend)
        return package(result, cfg, clipping_norm, replace(state, step=state.step + 1))

    return grad_fn, FixedClipState(clipping_norm=clipping_norm)


def clip_weights(norms: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """``min(1, C / norm)`` per example and group; exactly 1 at or below C."""
    # C / norm >= 1 exactly when norm <= C (also for norm = 0 and C = inf), so the clamp
    # gives exactly 1 there; NaN and inf norms are zeroed by the caller's finite mask.
    return (bounds.unsqueeze(1) / norms).clamp_max_(1.0)
