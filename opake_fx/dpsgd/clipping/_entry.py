"""The one entry behind :func:`clipped_grad`, :func:`auto_clipped_grad` and :func:`adaptive_clipped_grad`.

The three clipping functions differ only in a :class:`ClipFunctionSpec`: the clip norm a call
uses, the rule that turns per-example norms into weights, and the state after the
call. Everything they share — the keyword arguments, checked once into one
:class:`~.options.ClipConfig`, the backend, ``pre_clip``, the second-moment stream, the
state check and the packaging of the result — is built here, once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

import torch

from opake_fx.compiled import planning
from opake_fx.dpsgd.clipping._engine import StepResult, WeightFn, clipped_step, package
from opake_fx.dpsgd.clipping._ghost import make_backend, traced_whole_loss_pays, whole_loss_backend
from opake_fx.dpsgd.clipping._traced import TracedTaps, taps_pay
from opake_fx.dpsgd.clipping.options import ClipConfig
from opake_fx.dpsgd.clipping.types import FixedClipState, check_state
from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.types import PerGroup

__all__ = ["ClipFunctionSpec", "fixed_norm_grad_fn", "make_grad_fn"]


@dataclass(frozen=True)
class ClipFunctionSpec:
    """What makes one clipping function different from another.

    Attributes:
        maker: the public function's name (for error messages).
        state_type: the type of its state.
        clipping_norm: the clip norm a call uses, given the state it was passed.
        weights: ``(norms [G, B], bounds [G]) -> weights [G, B]``.
        advance: the state after a call, from the state before and the call's result.
    """

    maker: str
    state_type: type
    clipping_norm: Callable[[Any], float | PerGroup]
    weights: WeightFn
    advance: Callable[[Any, StepResult], Any]


def fixed_norm_grad_fn(
    maker: str, weights: WeightFn, arguments: Mapping[str, Any]
) -> tuple[Callable[..., Any], FixedClipState]:
    """:func:`make_grad_fn` for a mode that clips at ``arguments["clipping_norm"]`` on every call
    and whose state only counts calls (fixed and AUTO-S clipping): ``(grad_fn, state)``."""
    clipping_norm = arguments["clipping_norm"]
    mode = ClipFunctionSpec(maker, FixedClipState, clipping_norm=lambda state: clipping_norm, weights=weights,
                    advance=_count_call)
    return make_grad_fn(arguments["loss_fn"], mode, arguments), FixedClipState(clipping_norm=clipping_norm)


def _count_call(state: FixedClipState, result: StepResult) -> FixedClipState:
    return replace(state, step=state.step + 1)


def make_grad_fn(loss_fn: Callable[..., Any], mode: ClipFunctionSpec, arguments: Mapping[str, Any]) -> Callable[..., Any]:
    """Checks the shared options among ``arguments`` (the public function's ``locals()``) into one
    :class:`~.options.ClipConfig` and returns ``grad_fn(*args, state=state, **kwargs)`` for ``mode``."""
    if not callable(loss_fn):
        raise InputTypeError(f"{mode.maker} needs loss_fn to be callable; got {type(loss_fn).__name__}.")
    cfg = ClipConfig.of(arguments)
    backend = make_backend(cfg.clip_backend, cfg.model)
    if cfg.clip_backend != "vmap":
        needs = [name for name, on in (("pre_clip", cfg.pre_clip is not None), ("second_moment", cfg.second_moment)) if on]
        if needs:
            raise InputValueError(
                f"{mode.maker}({'=..., '.join(needs)}=...) needs each example's gradient itself, which "
                f"clip_backend={cfg.clip_backend!r} never forms (it computes norms and the weighted sum from "
                "layer activations). Use clip_backend=\"vmap\" (with a per-example loss_fn) for this."
            )

    plans: dict[Any, Any] = {}  # structure-only derivations, reused across calls (_engine.StaticPlan)
    traced = TracedTaps(backend.root) if cfg.clip_backend == "auto" else None

    def finish(run_backend: Any, args: tuple[Any, ...], kwargs: dict[str, Any], state: Any, norm: Any,
               example_mask: torch.Tensor | None) -> Any:
        result = clipped_step(loss_fn, args, kwargs, cfg, clipping_norm=norm, weight_fn=mode.weights,
                              backend=run_backend, plans=plans, example_mask=example_mask)
        return package(result, cfg, norm, mode.advance(state, result))

    # The eager fast backends observe the model through module hooks, autograd taps and probes
    # that torch.compile cannot trace: inside a compiled step they run eagerly, the whole call
    # (clip and packaging) as one opaque call between graphs, so that dynamo compiles grad_fn's
    # frame with the decision in its guards (a graph break inside the packaging made dynamo give
    # up on the frame for good, and every later compiled step of the process ran it eagerly).
    # "auto" traces its own path where it can (._traced: the layer rules on tapped calls, exact
    # per-example gradients for the rest; planned in the compiled step's eager planning step),
    # or the whole-loss vmap path where that is the cheaper one.
    finish_eagerly = torch.compiler.disable(finish)

    def grad_fn(*args: Any, state: Any = None, example_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
        check_state(state, mode.state_type, mode.maker)
        norm = mode.clipping_norm(state)
        if cfg.clip_backend == "vmap":
            return finish(backend, args, kwargs, state, norm, example_mask)
        if traced is not None and (torch.compiler.is_compiling() or planning()):
            plan = traced.plan_for(loss_fn, args, kwargs, cfg)
            if plan is not None and taps_pay(plan, args, cfg):
                return finish(traced.backend(plan), args, kwargs, state, norm, example_mask)
            if torch.compiler.is_compiling() and traced_whole_loss_pays(args, cfg):
                return finish(whole_loss_backend, args, kwargs, state, norm, example_mask)
        return finish_eagerly(backend, args, kwargs, state, norm, example_mask)

    return grad_fn
