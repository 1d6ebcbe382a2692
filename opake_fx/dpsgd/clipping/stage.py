"""The clipping chain stage: :func:`clip` (batch in, ``ClippedPytree`` out)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from torch import nn

from opake_fx.dpsgd.clipping._ghost import ClipBackend
from opake_fx.dpsgd.clipping.fixed import clipped_grad
from opake_fx.functional import FunctionalModel
from opake_fx.errors import InputValueError
from opake_fx.pipeline_privacy import StagePrivacy
from opake_fx.transforms import Transform
from opake_fx.types import ClippedPytree, PerGroup

__all__ = ["clip", "as_stage"]


def clip(
    loss_fn: Callable[..., Any],
    *,
    clipping_norm: float | PerGroup,
    normalize_by: float = 1.0,
    batch_argnums: int | Sequence[int] = 1,
    microbatch_size: int | None = None,
    clip_backend: ClipBackend = "vmap",
    model: FunctionalModel | nn.Module | None = None,
) -> Transform:
    """Per-example clipping as the first stage of a pipeline.

    ``update(batch, state, params)`` calls ``loss_fn(params, *batch)`` per example
    (``batch`` is a tuple filling positions ``batch_argnums``, which must be ``1..k``)
    and returns the :class:`~opake_fx.types.ClippedPytree` of :func:`clipped_grad`.
    With ``clip_backend="ghost"`` or ``"auto"`` (and ``model=fmodel``), ``loss_fn`` takes
    the whole batch and returns the per-example losses ``[B]``, and the norms come from
    layer activations without per-example gradients (see :func:`clipped_grad`).

    Privacy: output sensitivity ``clipping_norm / normalize_by`` (add-or-remove-one).

    Example:
        >>> import torch
        >>> from opake_fx.dpsgd import noise
        >>> from opake_fx.transforms import chain
        >>> from opake_fx.random import key
        >>> f = lambda p, x: ((x - p) ** 2).sum()
        >>> t = chain(clip(f, clipping_norm=1.0, batch_argnums=(1,)), noise(noise_multiplier=0.0, key=key(0)))
        >>> p = torch.zeros(2)
        >>> out, s = t.update((torch.ones(4, 2),), t.init(p), p)
        >>> type(out).__name__, out.max_norm
        ('NoisedPytree', 1.0)
    """
    grad_fn, state = clipped_grad(
        loss_fn,
        argnums=0,
        clipping_norm=clipping_norm,
        normalize_by=normalize_by,
        batch_argnums=batch_argnums,
        microbatch_size=microbatch_size,
        clip_backend=clip_backend,
        model=model,
    )  # validates clipping_norm and normalize_by
    described = StagePrivacy(
        "clip", f"clip to {clipping_norm}, divided by {normalize_by:g}", max_norm=clipping_norm / normalize_by
    )
    return as_stage(grad_fn, state, batch_argnums=batch_argnums, privacy=described)


def as_stage(
    grad_fn: Callable[..., Any],
    state: Any,
    *,
    batch_argnums: int | Sequence[int] = 1,
    privacy: StagePrivacy | None = None,
) -> Transform:
    """Turns any ``(grad_fn, state)`` pair (``clipped_grad``, ``auto_clipped_grad``,
    ``adaptive_clipped_grad``, made with ``argnums=0`` and without stats/aux) into a stage.

    ``privacy`` describes the stage for ``chain``'s order check and ``privacy_report``
    (default: a clip stage whose ``max_norm`` is known per step, as for adaptive clipping).

    Privacy: that of the wrapped clipping function.
    """
    if privacy is None:
        privacy = StagePrivacy("clip", "clipping function (max_norm read from its output each step)")
    positions = (batch_argnums,) if isinstance(batch_argnums, int) else tuple(batch_argnums)
    if positions != tuple(range(1, len(positions) + 1)):
        raise InputValueError(
            f"a clip stage fills arguments 1..k with the batch tuple; got batch_argnums={batch_argnums}. "
            "Reorder loss_fn's arguments to (params, *batch)."
        )

    def init(params: Any) -> Any:
        return state

    def update(batch: Any, clip_state: Any, params: Any = None, **extra: Any) -> tuple[ClippedPytree, Any]:
        if params is None:
            raise InputValueError("the clip stage needs params: call pipeline.update(batch, state, params).")
        batch_t = batch if isinstance(batch, tuple) else (batch,)
        if len(batch_t) != len(positions):
            raise InputValueError(
                f"the clip stage expects a batch of {len(positions)} tensors (batch_argnums={batch_argnums}); "
                f"got {len(batch_t)}."
            )
        out, new_state = grad_fn(params, *batch_t, state=clip_state)
        if not isinstance(out, ClippedPytree):
            raise InputValueError(
                "as_stage needs a clipping function made without return_stats/return_aux/has_aux; "
                "its output must be a ClippedPytree."
            )
        return out, new_state

    return Transform(init, update, privacy)
