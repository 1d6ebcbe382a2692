"""The clipping chain stage: :func:`clip` (batch in, ``ClippedPytree`` out)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from torch import nn

from opake_fx.dpsgd.clipping._ghost import ClipBackend
from opake_fx.dpsgd.clipping.fixed import clipped_grad
from opake_fx.dpsgd.clipping.types import ClippingStats
from opake_fx.functional import FunctionalModel
from opake_fx.errors import InputValueError
from opake_fx.pipeline_privacy import StagePrivacy
from opake_fx.transforms import Transform
from opake_fx.types import ClippedPytree, PerGroup

__all__ = ["clip", "as_stage", "ClipStageState"]


@dataclass(frozen=True)
class ClipStageState:
    """The state of a clip stage built with ``return_stats=True``.

    Attributes:
        clip_state: the clipping function's own state (``FixedClipState``, ``AdaptiveClipState``).
        stats: the :class:`~opake_fx.dpsgd.clipping.ClippingStats` of the last step (all
            zeros, ``batch_size=0``, before the first: the same structure throughout, so a
            checkpoint template from ``init`` fits). **Not private**: computed from the raw
            per-example norms; log them for debugging, or release them through a DP
            mechanism of their own.
    """

    clip_state: Any
    stats: ClippingStats | None = None


def clip(
    loss_fn: Callable[..., Any],
    *,
    clipping_norm: float | PerGroup,
    normalize_by: float = 1.0,
    batch_argnums: int | Sequence[int] = 1,
    microbatch_size: int | None = None,
    clip_backend: ClipBackend = "vmap",
    model: FunctionalModel | nn.Module | None = None,
    return_stats: bool = False,
) -> Transform:
    """Per-example clipping as the first stage of a pipeline.

    ``update(batch, state, params)`` calls ``loss_fn(params, *batch)`` per example
    (``batch`` is a tuple filling positions ``batch_argnums``, which must be ``1..k``)
    and returns the :class:`~opake_fx.types.ClippedPytree` of :func:`clipped_grad`.
    With ``clip_backend="ghost"`` or ``"auto"`` (and ``model=fmodel``), ``loss_fn`` takes
    the whole batch and returns the per-example losses ``[B]``, and the norms come from
    layer activations without per-example gradients (see :func:`clipped_grad`).

    With ``return_stats=True`` the stage's state is a :class:`ClipStageState` whose
    ``stats`` holds the last step's :class:`~opake_fx.dpsgd.clipping.ClippingStats`
    (``state["clip"].stats`` in a named chain): non-private diagnostics.

    Privacy: output sensitivity ``clipping_norm / normalize_by`` (add-or-remove-one). The
    stats in the state are computed from raw per-example norms and are not private.

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
        return_stats=return_stats,
    )  # validates clipping_norm and normalize_by
    described = StagePrivacy(
        "clip", f"clip to {clipping_norm}, divided by {normalize_by:g}", max_norm=clipping_norm / normalize_by
    )
    return as_stage(grad_fn, state, batch_argnums=batch_argnums, privacy=described, return_stats=return_stats)


def as_stage(
    grad_fn: Callable[..., Any],
    state: Any,
    *,
    batch_argnums: int | Sequence[int] = 1,
    privacy: StagePrivacy | None = None,
    return_stats: bool = False,
) -> Transform:
    """Turns any ``(grad_fn, state)`` pair (``clipped_grad``, ``auto_clipped_grad``,
    ``adaptive_clipped_grad``, made with ``argnums=0`` and without aux) into a stage.

    For a clipping function made with ``return_stats=True``, pass ``return_stats=True``
    here too: the stage's state is then a :class:`ClipStageState` carrying the last
    step's stats (non-private diagnostics), and the stage still outputs the
    ``ClippedPytree`` alone.

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
        return ClipStageState(state, _no_stats(state)) if return_stats else state

    def update(batch: Any, clip_state: Any, params: Any = None, **extra: Any) -> tuple[ClippedPytree, Any]:
        if params is None:
            raise InputValueError("the clip stage needs params: call pipeline.update(batch, state, params).")
        batch_t = batch if isinstance(batch, tuple) else (batch,)
        if len(batch_t) != len(positions):
            raise InputValueError(
                f"the clip stage expects a batch of {len(positions)} tensors (batch_argnums={batch_argnums}); "
                f"got {len(batch_t)}."
            )
        inner = clip_state.clip_state if isinstance(clip_state, ClipStageState) else clip_state
        out, new_state = grad_fn(params, *batch_t, state=inner)
        if return_stats:
            if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], ClippingStats)):
                raise InputValueError(
                    "as_stage(return_stats=True) needs a clipping function made with return_stats=True (and "
                    "without return_aux/has_aux)."
                )
            out, stats = out
            new_state = ClipStageState(new_state, stats)
        if not isinstance(out, ClippedPytree):
            raise InputValueError(
                "as_stage needs a clipping function made without return_aux/has_aux, and return_stats=True on "
                "both or neither; its output must be a ClippedPytree."
            )
        return out, new_state

    return Transform(init, update, privacy)


def _no_stats(clip_state: Any) -> ClippingStats:
    """Zero stats shaped like the ones the clipping function returns (per group for a PerGroup norm)."""
    norm = getattr(clip_state, "clipping_norm", None)
    if isinstance(norm, PerGroup):
        zeros = {name: 0.0 for name in sorted(norm.values)}
        return ClippingStats(dict(zeros), dict(zeros), 0, 0)
    return ClippingStats(0.0, 0.0, 0, 0)
