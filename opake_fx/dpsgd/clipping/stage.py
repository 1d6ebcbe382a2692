"""The clipping chain stages: :func:`clip`, :func:`auto_clip`, :func:`adaptive_clip` (batch in, ``ClippedPytree`` out).

Each is made from its clipping function (``clipped_grad``, ``auto_clipped_grad``,
``adaptive_clipped_grad``) by one builder, which takes that function's keywords but
``argnums``, ``has_aux``, ``return_aux`` and ``dtype`` (the stage's signature is derived
from the function's) and adds the stage's line in the privacy report. :func:`as_stage`
turns any ``(grad_fn, state)`` pair into a stage.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

import torch

from opake_fx.distributed.state_sync import register_sync_type, sync_fields
from opake_fx.dpsgd.clipping.adaptive import adaptive_clipped_grad
from opake_fx.dpsgd.clipping.auto import auto_clipped_grad
from opake_fx.dpsgd.clipping.fixed import clipped_grad
from opake_fx.dpsgd.clipping.types import ClippingStats
from opake_fx.errors import InputValueError
from opake_fx.pipeline_privacy import StagePrivacy
from opake_fx.signatures import signature_of
from opake_fx.transforms import Transform
from opake_fx.types import ClippedPytree, PerGroup, SecondMomentClippingOutput

__all__ = ["clip", "auto_clip", "adaptive_clip", "as_stage", "ClipStageState"]


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


#: The clipping functions' keywords a stage does not take: it differentiates argument 0
#: (``params``) and outputs the clipped sum alone, in the default dtype.
_NOT_STAGE_KEYWORDS = ("argnums", "has_aux", "return_aux", "dtype")

#: ``describe(keywords) -> (description, max_norm)``: a stage's line in the privacy report and
#: its sensitivity (``None``: known per step only), from its keyword arguments.
Describe = Callable[[Mapping[str, Any]], "tuple[str, float | PerGroup | None]"]


def _stage_of(name: str, clipping_function: Callable[..., Any], describe: Describe, doc: str) -> Callable[..., Transform]:
    """The chain-stage form ``name(loss_fn, **keywords) -> Transform`` of a clipping function.

    The stage takes the clipping function's keywords but ``_NOT_STAGE_KEYWORDS`` (its
    signature is derived from the function's, so the two cannot drift apart), makes
    ``clipping_function(loss_fn, argnums=0, **keywords)``, which checks them, and wraps
    it with :func:`as_stage`, described by ``describe``.

    Privacy: the stage outputs what the clipping function does; its ``StagePrivacy``
    states ``describe``'s ``max_norm`` (``paired`` with ``second_moment=True``) and the unit
    it clips (``loss_fn.privacy_unit``, set by :func:`opake_fx.users.user_loss`; else the example).
    """
    def stage(loss_fn: Callable[..., Any], **given: Any) -> Transform:
        grad_fn, state = clipping_function(loss_fn, argnums=0, **given)
        description, max_norm = describe(given)
        privacy = StagePrivacy("clip", description, max_norm=max_norm, paired=given["second_moment"],
                               unit=getattr(loss_fn, "privacy_unit", "example"))
        return as_stage(grad_fn, state, batch_argnums=given["batch_argnums"], privacy=privacy,
                        return_stats=given["return_stats"])

    stage.__name__ = stage.__qualname__ = name
    stage.__doc__ = doc
    return signature_of(clipping_function, drop=_NOT_STAGE_KEYWORDS)(stage)


clip = _stage_of(
    "clip",
    clipped_grad,
    lambda k: (f"clip to {k['clipping_norm']}, divided by {k['normalize_by']:g}", k["clipping_norm"] / k["normalize_by"]),
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

    ``pre_clip`` and ``second_moment`` are those of :func:`clipped_grad` (with
    ``second_moment=True`` the stage outputs a
    :class:`~opake_fx.types.SecondMomentClippingOutput`, which the noise stages noise
    jointly). :func:`auto_clip` and :func:`adaptive_clip` are the same stage for AUTO-S
    and adaptive clipping. The keywords are those of :func:`clipped_grad` but ``argnums``,
    ``has_aux``, ``return_aux`` and ``dtype``.

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
    """,
)

auto_clip = _stage_of(
    "auto_clip",
    auto_clipped_grad,
    lambda k: (f"AUTO-S to {k['clipping_norm']} (gamma={k['gamma']:g}), divided by {k['normalize_by']:g}",
               k["clipping_norm"] / k["normalize_by"]),
    """AUTO-S clipping (:func:`~opake_fx.dpsgd.clipping.auto_clipped_grad`) as a chain stage.

    Arguments as :func:`clip`, plus AUTO-S's ``gamma``.

    Privacy: output sensitivity ``clipping_norm / normalize_by`` (add-or-remove-one), as
    :func:`clip`.

    Example:
        >>> import torch
        >>> f = lambda p, x: ((x - p) ** 2).sum()
        >>> stage = auto_clip(f, clipping_norm=2.0, batch_argnums=(1,), normalize_by=4)
        >>> p = torch.zeros(2)
        >>> out, _ = stage.update((torch.ones(4, 2),), stage.init(p), p)
        >>> out.max_norm
        0.5
    """,
)

adaptive_clip = _stage_of(
    "adaptive_clip",
    adaptive_clipped_grad,
    lambda k: (f"adaptive clipping from {k['initial_clipping_norm']} (quantile {k['target_quantile']:g}), divided by "
               f"{k['normalize_by']:g}; count noise multiplier {k['count_noise_multiplier']:g}", None),
    """Adaptive clipping (:func:`~opake_fx.dpsgd.clipping.adaptive_clipped_grad`) as a chain stage.

    Arguments as :func:`clip`, plus the quantile-tracking ones of
    ``adaptive_clipped_grad``. The stage's state is the ``AdaptiveClipState`` (inside a
    :class:`ClipStageState` with ``return_stats=True``); under DDP ``sync`` it after
    each step, as for the function.

    Privacy: output sensitivity ``C_t / normalize_by`` at step ``t`` (read from each
    step's output); the noised count costs privacy too: account for the step with
    ``opake_fx.dpsgd.accounting.adaptive_clipping_gaussian(z, count_noise_multiplier)``.

    Example:
        >>> import torch
        >>> from opake_fx.random import key
        >>> f = lambda p, x: ((x - p) ** 2).sum()
        >>> stage = adaptive_clip(f, initial_clipping_norm=1.0, count_noise_multiplier=0.0, key=key(0),
        ...                       batch_argnums=(1,), expected_batch_size=4)
        >>> p = torch.zeros(2)
        >>> out, state = stage.update((torch.full((4, 2), 10.0),), stage.init(p), p)
        >>> out.max_norm, state.clipping_norm > 1.0
        (1.0, True)
    """,
)


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
    privacy = replace(privacy, takes_example_mask=True)  # grad_fn(..., example_mask=) of _entry
    positions = (batch_argnums,) if isinstance(batch_argnums, int) else tuple(batch_argnums)
    if positions != tuple(range(1, len(positions) + 1)):
        raise InputValueError(
            f"a clip stage fills arguments 1..k with the batch tuple; got batch_argnums={batch_argnums}. "
            "Reorder loss_fn's arguments to (params, *batch)."
        )

    def init(params: Any) -> Any:
        return ClipStageState(state, _no_stats(state)) if return_stats else state

    def update(batch: Any, clip_state: Any, params: Any = None, *, example_mask: torch.Tensor | None = None,
               **extra: Any) -> tuple[ClippedPytree, Any]:
        if params is None:
            raise InputValueError("the clip stage needs params: call pipeline.update(batch, state, params).")
        batch_t = batch if isinstance(batch, tuple) else (batch,)
        if len(batch_t) != len(positions):
            raise InputValueError(
                f"the clip stage expects a batch of {len(positions)} tensors (batch_argnums={batch_argnums}); "
                f"got {len(batch_t)}."
            )
        inner = clip_state.clip_state if isinstance(clip_state, ClipStageState) else clip_state
        # (only a padded batch passes a mask: a grad_fn of another kind need not take one)
        out, new_state = (grad_fn(params, *batch_t, state=inner) if example_mask is None
                          else grad_fn(params, *batch_t, state=inner, example_mask=example_mask))
        if return_stats:
            if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], ClippingStats)):
                raise InputValueError(
                    "as_stage(return_stats=True) needs a clipping function made with return_stats=True (and "
                    "without return_aux/has_aux)."
                )
            out, stats = out
            new_state = ClipStageState(new_state, stats)
        if not isinstance(out, (ClippedPytree, SecondMomentClippingOutput)):
            raise InputValueError(
                "as_stage needs a clipping function made without return_aux/has_aux, and return_stats=True on "
                "both or neither; its output must be a ClippedPytree (or a SecondMomentClippingOutput)."
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


register_sync_type(ClipStageState, sync_fields("clip_state", "stats"))  # synced field by field, where it is defined
