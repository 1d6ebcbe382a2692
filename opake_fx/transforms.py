"""Pure transforms and their composition (the optax contract, for torch).

A :class:`Transform` is a pair of pure functions::

    init(params) -> state
    update(x, state, params=None, **extra) -> (out, state)

Nothing is mutated and nothing lives in a module or a global RNG: all state is the
value returned next to the output. Unknown keyword arguments are accepted and ignored,
so one ``update`` call can feed every stage of a :func:`chain`; a stage that needs an
extra declares it keyword-only.

DP pipelines are chains whose stages exchange typed values: ``clip`` emits a
:class:`~opake_fx.types.ClippedPytree`, ``psum`` keeps it one, ``noise`` accepts only
that and emits a :class:`~opake_fx.types.NoisedPytree`, and optimizers accept either.
The privacy ordering (clip, aggregate, noise) is therefore enforced by types. After the
noise, :func:`postprocess` maps the noised value freely (post-processing) and says so in
the chain's ``privacy_report()``.

Example:
    >>> import torch
    >>> from opake_fx.optimizers import sgd
    >>> t = chain(stateless(lambda g, params=None: [2 * x for x in g]), sgd(0.1))
    >>> params = [torch.ones(2)]
    >>> updates, state = t.update([torch.ones(2)], t.init(params), params)
    >>> apply_updates(params, updates)[0].tolist()
    [0.800000011920929, 0.800000011920929]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import math

import torch

from opake_fx.errors import InputTypeError, InputValueError, NoiseInputError, OpakeError, OperationError
from opake_fx.pipeline_privacy import PrivacyReport, StagePrivacy, check_stage_order, privacy_report
from opake_fx.pytree import leaves, tree_flatten_with_paths, tree_map
from opake_fx.types import ClippedPytree, EmptyState, NoisedPytree, SecondMomentClippingOutput
from opake_fx.typing import typechecked

__all__ = ["Transform", "chain", "named_chain", "identity", "stateless", "postprocess", "apply_updates", "unwrap"]


class Transform(NamedTuple):
    """A pure stage: ``init(params) -> state`` and ``update(x, state, params=None, **extra) -> (out, state)``.

    ``privacy`` describes what the stage does to privacy (a
    :class:`~opake_fx.pipeline_privacy.StagePrivacy`; ``None`` for stages that do not
    say): :func:`chain` checks the stage order with it, and :meth:`privacy_report`
    reports it.
    """

    init: Callable[[Any], Any]
    update: Callable[..., tuple[Any, Any]]
    privacy: StagePrivacy | None = None

    def privacy_report(
        self, *, sample_rate: float | None = None, steps: int | None = None, delta: float | None = None
    ) -> PrivacyReport:
        """The stage-by-stage privacy of this transform (see :func:`opake_fx.pipeline_privacy.privacy_report`).

        Privacy: reading only.

        Example:
            >>> from opake_fx.optimizers import sgd
            >>> chain(sgd(0.1)).privacy_report().private   # no clip, no noise
            False
        """
        stages = self.privacy.stages if self.privacy is not None and self.privacy.kind == "chain" else (("0", self.privacy),)
        return privacy_report(stages, sample_rate=sample_rate, steps=steps, delta=delta)


def identity() -> Transform:
    """Passes its input through unchanged.

    Privacy: post-processing; changes no guarantee.
    """

    def update(x: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
        return x, state

    return Transform(lambda params: EmptyState(), update)


@typechecked
def stateless(fn: Callable[..., Any]) -> Transform:
    """Wraps ``fn(x, params=None)`` as a stateless :class:`Transform`.

    Privacy: whatever ``fn`` does; a function of a noised value and public data only is
    post-processing.
    """

    def update(x: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
        return fn(x, params=params), state

    return Transform(lambda params: EmptyState(), update)


@typechecked
def postprocess(fn: Callable[[Any], Any], *, scale: float | None = None, description: str | None = None) -> Transform:
    """A post-processing stage: applies ``fn`` to the noised value (a ``NoisedPytree``).

    Place it after the noise stage: any map is allowed there (a per-layer scale, a cast,
    a clamp, a projection), with no Lipschitz bound, because everything computed from the
    output of a DP mechanism (and public data) is exactly as private as that output. The
    stage's kind is ``"postprocess"``; ``privacy_report()`` says so, and tracks the noise
    stddev through it when ``scale`` is given.

    Args:
        fn: ``fn(value) -> value``; a function of its input and public data only. To keep
            the ``NoisedPytree`` wrapper (which optimizers' DP bias corrections read),
            map with its own operations: ``g * a``, ``g.map_with_path(fn)``, ``g.to(dtype)``.
        scale: the public factor by which ``fn`` multiplies the noise's stddev (``a`` for
            ``g -> a * g``, ``1.0`` for a cast); the report then gives the stddev after
            this stage. ``None`` (default): the report says ``"unknown"`` after it. When
            ``fn`` returns a ``NoisedPytree`` with a known ``noise_stddev``, the declared
            scale is checked against it at every step.
        description: one line for the report (default: ``fn``'s name).

    Privacy: post-processing; changes no guarantee. It needs a noised input: ``chain``
    refuses it before the noise stage (``OperationError``), and at run time it refuses an
    un-noised ``ClippedPytree`` (map that with ``.map(fn, lipschitz=L)`` or
    ``.map_with_path(fn, lipschitz=L)``, which keep the sensitivity bound).

    Raises:
        NoiseInputError: (at run time) the input is a ``ClippedPytree`` that was never noised.
        InputValueError: ``scale`` is not finite, or ``fn``'s output contradicts it.

    Example:
        >>> import torch
        >>> from opake_fx.types import NoisedPytree
        >>> scales = {"w": 2.0, "b": 1.0}                     # per-layer scaling
        >>> stage = postprocess(lambda g: g.map_with_path(lambda path, x: scales[path[-1]] * x))
        >>> g = NoisedPytree({"w": torch.ones(2), "b": torch.ones(1)}, max_norm=0.5, noise_stddev=0.1)
        >>> out, _ = stage.update(g, stage.init(None))
        >>> type(out).__name__, out.pytree["w"].tolist()
        ('NoisedPytree', [2.0, 2.0])
        >>> doubled, _ = postprocess(lambda g: 2 * g, scale=2.0).update(g, EmptyState())
        >>> doubled.noise_stddev
        0.2
    """
    if scale is not None and not math.isfinite(scale):
        raise InputValueError(f"postprocess: scale must be a finite real number (or None: unknown); got {scale!r}.")
    label = description if description is not None else getattr(fn, "__name__", type(fn).__name__)

    def update(x: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
        if isinstance(x, SecondMomentClippingOutput) or (isinstance(x, ClippedPytree) and not isinstance(x, NoisedPytree)):
            raise NoiseInputError(
                f"postprocess({label}) got a {type(x).__name__} that was never noised: a map with no bound is "
                "post-processing only after the noise stage. Move this stage after noise, or keep the sensitivity "
                "bound by mapping the clipped gradient with a declared Lipschitz constant: g.map(fn, lipschitz=L) "
                "or g.map_with_path(fn, lipschitz=L)."
            )
        out = fn(x)
        if scale is not None and isinstance(x, NoisedPytree) and isinstance(out, NoisedPytree):
            before, after = x.noise_stddev, out.noise_stddev
            if isinstance(before, float) and isinstance(after, float) and not math.isclose(
                after, abs(scale) * before, rel_tol=1e-9, abs_tol=1e-300
            ):
                raise InputValueError(
                    f"postprocess({label}) declared scale={scale:g}, but its output's noise_stddev is {after:.6g} "
                    f"for an input stddev of {before:.6g} (x{after / before if before else math.inf:.6g}). Pass the "
                    "factor fn multiplies the noise by, or scale=None (the report then says unknown)."
                )
        return out, state

    described = StagePrivacy("postprocess", label, scale=None if scale is None else float(scale))
    return Transform(lambda params: EmptyState(), update, described)


@typechecked
def chain(*transforms: Transform) -> Transform:
    """Composes transforms left to right; the state is the tuple of their states.

    Privacy: the chain's guarantee is that of its mechanisms (the noise stages); the
    typed values between stages make a noise stage refuse unclipped input. Building a
    chain whose clip stage reaches an optimizer without a noise stage in between, or with
    a gradient stage before clip, raises ``OperationError``
    (:func:`opake_fx.pipeline_privacy.check_stage_order`); a non-private baseline uses
    ``noise(noise_multiplier=0, ...)``. ``chain(...).privacy_report()`` reports it.

    Raises:
        InputTypeError: an argument is not a ``Transform``.
        OperationError: the stage order breaks clip -> (psum) -> noise -> optimizer.
    """
    for i, t in enumerate(transforms):
        _check_transform(t, f"chain argument {i}")
    described = tuple((str(i), t.privacy) for i, t in enumerate(transforms))
    check_stage_order(described, "chain")
    run = _Runner(tuple((str(i), t) for i, t in enumerate(transforms)), "chain")

    def init(params: Any) -> tuple[Any, ...]:
        return tuple(t.init(params) for t in transforms)

    def update(x: Any, state: tuple[Any, ...], params: Any = None, **extra: Any) -> tuple[Any, tuple[Any, ...]]:
        if not isinstance(state, tuple) or len(state) != len(transforms):
            raise InputValueError(
                f"chain of {len(transforms)} stages got a state of {type(state).__name__}"
                f"{'' if not isinstance(state, tuple) else f' with {len(state)} entries'}; "
                "pass the state returned by this chain's init or previous update."
            )
        x, new_states = run(x, state, params, extra)
        return x, tuple(new_states)

    return Transform(init, update, StagePrivacy("chain", stages=described))


@typechecked
def named_chain(*named: tuple[str, Transform]) -> Transform:
    """Like :func:`chain`, with named stages; the state is a ``dict`` name -> state.

    Names make states easy to find (``state["noise"]``) and to checkpoint, and name the
    rows of ``privacy_report()``. The stage order is checked as by :func:`chain`.

    Example:
        >>> from opake_fx.optimizers import sgd
        >>> t = named_chain(("id", identity()), ("opt", sgd(1.0)))
        >>> sorted(t.init(None))
        ['id', 'opt']
    """
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        raise InputValueError(f"named_chain stage names must be unique; got {names}.")
    for name, t in named:
        if not isinstance(name, str):
            raise InputTypeError(f"named_chain takes (name, transform) pairs; got name {name!r}.")
        _check_transform(t, f"named_chain stage {name!r}")
    described = tuple((name, t.privacy) for name, t in named)
    check_stage_order(described, "named_chain")
    run = _Runner(tuple(named), "named_chain")

    def init(params: Any) -> dict[str, Any]:
        return {name: t.init(params) for name, t in named}

    def update(x: Any, state: dict[str, Any], params: Any = None, **extra: Any) -> tuple[Any, dict[str, Any]]:
        if not isinstance(state, dict) or list(state) != names:
            raise InputValueError(
                f"named_chain with stages {names} got a state with keys "
                f"{list(state) if isinstance(state, dict) else type(state).__name__}; pass the state "
                "returned by this chain's init or previous update."
            )
        x, new_states = run(x, [state[name] for name in names], params, extra)
        return x, dict(zip(names, new_states))

    return Transform(init, update, StagePrivacy("chain", stages=described))


def unwrap(tree: Any) -> Any:
    """The raw pytree inside a DP wrapper (``ClippedPytree``/``NoisedPytree``), else ``tree``."""
    return tree.pytree if isinstance(tree, ClippedPytree) else tree


def apply_updates(params: Any, updates: Any) -> Any:
    """Returns ``params + updates`` leafwise (new tensors; ``params`` is not modified).

    ``updates`` may be a DP wrapper; its ``.pytree`` is used. Each update is cast to
    its parameter's dtype.

    Privacy: post-processing.
    """
    updates = unwrap(updates)
    return tree_map(lambda p, u: p + u.to(p.dtype), params, updates)


def _check_transform(t: Any, where: str) -> None:
    if not isinstance(t, Transform):
        raise InputTypeError(
            f"{where} is a {type(t).__name__}, not a Transform. Stages are built by functions "
            "such as opake_fx.dpsgd.clip(...), opake_fx.dpsgd.noise(...) or opake_fx.optimizers.sgd(...)."
        )




class _Runner:
    """Runs a chain's stages in order, with two checks that turn a distant failure into a named one.

    * A stage between clip and a later noise stage that receives the clipped gradient and
      returns something without its sensitivity bound (a ``tree_map``, a hand-written map)
      is named at once, with the map that keeps the bound: the noise stage could only say
      that it got an unclipped value.
    * When the clip stage fails on a batch that an earlier stage changed (dtype, shape,
      structure), the error names that stage and the change.
    """

    def __init__(self, stages: tuple[tuple[str, Transform], ...], where: str) -> None:
        self.stages = stages
        self.where = where
        kinds = [_kinds(t.privacy) for _, t in stages]
        self.clip_at = next((i for i, k in enumerate(kinds) if "clip" in k), None)
        # for each stage: the name of a later stage that adds noise (None when none does)
        self.noise_after: list[str | None] = []
        for i in range(len(stages)):
            later = next((stages[j][0] for j in range(i + 1, len(stages)) if "noise" in kinds[j]), None)
            self.noise_after.append(later if self.clip_at is not None and i >= self.clip_at else None)

    def __call__(self, x: Any, states: Any, params: Any, extra: dict[str, Any]) -> tuple[Any, list[Any]]:
        new_states = []
        trail: list[tuple[str, Any]] = [("the chain's input", x)]  # the batch before clip, stage by stage
        for i, ((name, t), s) in enumerate(zip(self.stages, states)):
            if i == self.clip_at and i > 0:
                try:
                    out, s = t.update(x, s, params, **extra)
                except Exception as error:  # noqa: BLE001 -- re-raised unchanged unless a stage before clip changed the batch
                    raise _pre_clip_error(self.where, name, error, trail, params) from error
            else:
                out, s = t.update(x, s, params, **extra)
            noise_name = self.noise_after[i]
            if noise_name is not None and _unnoised(x) and not isinstance(out, (ClippedPytree, SecondMomentClippingOutput)):
                raise NoiseInputError(
                    f"{self.where}: stage {name!r} received the clipped gradient (a {type(x).__name__}) and returned a "
                    f"{type(out).__name__}, which has no sensitivity bound, so the noise stage {noise_name!r} would "
                    "refuse it. A map of the clipped gradient keeps its bound when it declares its Lipschitz constant: "
                    "g.map(fn, lipschitz=L), or g.map_with_path(fn, lipschitz=L) for a per-leaf (per-layer) map, or "
                    "g * a for a public scalar a. A map meant for the noised gradient goes after the noise stage, as "
                    "postprocess(fn)."
                )
            if self.clip_at is not None and i < self.clip_at:
                trail.append((f"stage {name!r}", out))
            x = out
            new_states.append(s)
        return x, new_states


def _kinds(info: StagePrivacy | None) -> set[str]:
    """The stage kinds in ``info`` (nested chains read through)."""
    if info is None:
        return set()
    if info.kind == "chain":
        return set().union(*(_kinds(i) for _, i in info.stages)) if info.stages else set()
    return {info.kind}


def _unnoised(x: Any) -> bool:
    return isinstance(x, SecondMomentClippingOutput) or (isinstance(x, ClippedPytree) and not isinstance(x, NoisedPytree))


def _pre_clip_error(where: str, clip_name: str, error: Exception, trail: list[tuple[str, Any]], params: Any) -> Exception:
    """The error to raise when the clip stage failed: ``error`` itself unless a stage before clip changed the batch."""
    changes = []
    for (_, before), (who, after) in zip(trail, trail[1:]):
        diff = _batch_diff(before, after)
        if diff:
            changes.append(f"{who} changed {diff}")
    if not changes:
        return error
    try:
        param_dtypes = sorted({str(p.dtype) for p in leaves(params) if isinstance(p, torch.Tensor) and p.is_floating_point()})
    except Exception:  # noqa: BLE001 -- the params are only quoted
        param_dtypes = []
    return OperationError(
        f"{where}: the clip stage {clip_name!r} failed ({type(error).__name__}: {str(error)[:300]}) on a batch that the "
        f"stages before it changed: {'; '.join(changes)}"
        + (f" (the params are {', '.join(param_dtypes)})" if param_dtypes else "")
        + ". A stage before clip receives the data batch and must hand clip what the loss takes: the structure "
        "batch_argnums expects (a tuple), the batch axis first on every tensor, floats in the params' dtype. Fix "
        "that stage (or cast inside loss_fn); a map meant for the gradients goes after the noise stage, as postprocess(fn)."
        + ("" if isinstance(error, OpakeError) else " The original error is chained below.")
    )


def _batch_diff(before: Any, after: Any) -> str:
    """What changed between two batches (structure, tensor dtypes and shapes); '' when nothing did."""
    pb, lb, sb = tree_flatten_with_paths(before)
    pa, la, sa = tree_flatten_with_paths(after)
    if sb != sa:
        return f"the batch's structure ({_shape_of(before)} -> {_shape_of(after)})"
    out = []
    for path, b, a in zip(pb, lb, la):
        if isinstance(b, torch.Tensor) and isinstance(a, torch.Tensor):
            if b.dtype != a.dtype:
                out.append(f"the dtype of leaf {path} ({b.dtype} -> {a.dtype})")
            if b.shape != a.shape:
                out.append(f"the shape of leaf {path} ({tuple(b.shape)} -> {tuple(a.shape)})")
        elif type(b) is not type(a):
            out.append(f"the type of leaf {path} ({type(b).__name__} -> {type(a).__name__})")
    return ", ".join(out[:4]) + (f" and {len(out) - 4} more" if len(out) > 4 else "")


def _shape_of(tree: Any) -> str:
    return f"a {type(tree).__name__} of {len(leaves(tree))} leaves"
