"""A DP step run by ``torch.compile``: clip, aggregate, noise and the optimizer update as traced graphs.

:func:`compile_step` takes a pipeline (``DPPlan.pipeline(...)`` or a hand-built
``chain``/``named_chain`` of clip, psum, noise and optimizer stages) and returns a
:class:`CompiledStep`: ``params, state = step(params, state, batch)`` runs
``pipeline.update`` and ``apply_updates`` through ``torch.compile``. The sampler and the
accountant stay outside (they are host-side bookkeeping).

What is traced and what is not:

* The clipping (per-example gradients with ``torch.func.vmap``, the certified norms, the
  weights, the weighted sum), the aggregation, the noise's addition and the optimizer's
  update are traced into graphs that inductor compiles.
* The noise *draw* is an operator in the graph (:func:`opake_fx.random.flat_normal_group`,
  a ``torch.library.custom_op`` tagged ``cudagraph_unsafe``): the same keyed generator call
  as in an eager step, made when the graph runs, so the noise is bit-identical to the eager
  pipeline's for the same key and step, and the step is one graph. Exact, secure,
  per-group, row-sharded and ``prefetch=True`` draws, and a step whose mode records CUDA
  graphs (:attr:`CompiledStep.records_cuda_graphs`), draw eagerly between two graphs.
  Counters (steps of the noise, clip and optimizer states) are Python ints: the first step
  compiles them as constants, the second once more as symbols, and from then on they never
  recompile.
* ``clip_backend="auto"`` traces its own path: each example alone under ``vmap``, its
  ``nn.Linear`` / ``Conv1D`` calls tapped so that their layer rules run in the graph on
  ``(input, output gradient)``, exact per-example gradients for the other parameters
  (planned once per batch shape in an eager *planning step*, :func:`planning`). Where
  those exact gradients would exceed ``2**25`` elements it traces the whole-loss ``vmap``
  path (batches of at most 64), else its layer rules run eagerly, as one opaque call
  between graphs (module hooks and autograd taps do not trace). ``"ghost"`` always runs
  its rules eagerly.
* Batch shapes are static: with ``buckets``, each batch is padded up to a bucket size
  (:mod:`opake_fx.padding`) and the padding rows are masked out of the clip stage
  (weight 0: exactly zero contribution), so a Poisson run compiles once per bucket it
  meets instead of once per batch size.

Privacy: the compiled step computes the same mechanism as the pipeline it compiles
(same clip bound, same keyed noise; compiled and eager parameters agree to float
rounding, see ``tests/test_compiled.py``). The certified norms stay upper bounds when
compiled: their rounding bounds (``opake_fx.dpsgd.clipping._certified``) hold for any
summation order, which is all a compiler may change. Padding changes no accounting.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any, Callable

import optree
import torch

from opake_fx._gaussian import drawn_between_graphs
from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.padding import bucket_for, pad_batch
from opake_fx.pytree import NAMESPACE
from opake_fx.transforms import Transform, apply_updates

__all__ = ["CompiledStep", "compile_step", "inductor_options", "matmul_precision", "planning"]

_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile_step(pipeline: Transform, *, buckets: Sequence[int] | None = None, mode: str | None = None) -> CompiledStep:
    """Compiles ``pipeline``'s step (``update`` + ``apply_updates``) with ``torch.compile``.

    Args:
        pipeline: a :class:`~opake_fx.transforms.Transform` whose ``update(batch, state,
            params)`` returns updates (a DP pipeline: clip, psum, noise, optimizer).
        buckets: padded batch sizes (e.g. :func:`opake_fx.padding.geometric_buckets`): each
            batch is padded to the smallest bucket that holds it, and the padding rows are
            masked out of the clip stage. ``None``: no padding (fixed-size batches; every
            new batch size compiles once). Needs a clip stage that honours the mask
            (``clip``, ``auto_clip``, ``adaptive_clip``, ``as_stage``); others are refused.
        mode: ``torch.compile``'s mode (``"reduce-overhead"``: CUDA graphs on a GPU).

    Returns:
        A :class:`CompiledStep`.

    Raises:
        InputValueError: ``buckets`` with a pipeline whose clip stage cannot take the
            padding mask (or that says nothing about its stages), a clip stage whose norm
            moves every step (adaptive clipping: it would recompile every step), or an
            unknown ``mode``.

    Privacy: as the pipeline's (see the module docstring); the padding is masked out,
        and the noise is drawn by the pipeline's own keyed generator.

    Example (compiling takes seconds; ``tests/test_compiled.py`` runs it)::

        import torch
        from opake_fx.dpsgd import clip, noise
        from opake_fx.optimizers import sgd
        from opake_fx.random import key
        from opake_fx.transforms import chain

        loss = lambda p, x: ((p["w"] * x).sum() - 1.0) ** 2       # one example
        pipe = chain(clip(loss, clipping_norm=1.0, batch_argnums=1, normalize_by=4),
                     noise(noise_multiplier=0.0, key=key(0)), sgd(0.1))
        step = compile_step(pipe, buckets=(4, 8))
        params = {"w": torch.zeros(3)}
        state = step.init(params)
        params, state = step(params, state, (torch.ones(3, 3),))   # 3 rows, padded to 4
        params["w"]   # 0.0433 each: 3 clipped gradients of norm 1 / 4, the padding row adds 0
    """
    if not isinstance(pipeline, Transform):
        raise InputTypeError(f"compile_step needs a Transform (a DP pipeline); got {type(pipeline).__name__}.")
    if mode not in _MODES:
        raise InputValueError(f"compile_step: mode must be one of {_MODES}; got {mode!r}.")
    _check_fixed_clip_norm(pipeline)
    if buckets is not None:
        bucket_for(1, buckets)  # validates
        _check_takes_mask(pipeline)
    return CompiledStep(pipeline, tuple(sorted(buckets)) if buckets is not None else None, mode)


class CompiledStep:
    """A compiled DP step: ``params, state = step(params, state, batch)`` (see :func:`compile_step`).

    Attributes:
        pipeline: the compiled pipeline (its ``init`` builds the state).
        buckets: the padded batch sizes, or ``None``.
        graphs_compiled: how many graphs the compiler has built so far (each bucket's
            step is one graph, compiled twice: first with its counters as constants, then as symbols).
        sizes: the padded batch sizes met so far.
    """

    def __init__(self, pipeline: Transform, buckets: tuple[int, ...] | None, mode: str | None) -> None:
        self.pipeline = pipeline
        self.buckets = buckets
        self.mode = mode
        self.graphs_compiled = 0
        self.sizes: set[int] = set()
        self._planned: set[Any] = set()
        self._precision: tuple[Any, ...] | None = None
        self._compiled = torch.compile(self._step, backend=_counting_backend(mode))

    @functools.cached_property
    def records_cuda_graphs(self) -> bool:
        """Whether this step's mode records CUDA graphs (``"reduce-overhead"``, ``"max-autotune"``):
        its noise is then drawn eagerly between two graphs (:func:`opake_fx._gaussian.drawn_between_graphs`)."""
        from torch._inductor import list_mode_options

        return self.mode not in (None, "default") and bool(list_mode_options(self.mode).get("triton.cudagraphs"))

    def init(self, params: Any) -> Any:
        """The pipeline's initial state."""
        return self.pipeline.init(params)

    def __call__(self, params: Any, state: Any, batch: Any) -> tuple[Any, Any]:
        """One step: ``pipeline.update`` on the (padded) batch, then ``apply_updates``.

        An empty batch (possible under Poisson sampling) runs the pipeline eagerly: there
        is no example to pad with, and its release is the noise alone.
        """
        batch_t = batch if isinstance(batch, tuple) else (batch,)
        leaves = optree.tree_leaves(batch_t, namespace=NAMESPACE)
        if not leaves or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in leaves):
            raise InputTypeError("CompiledStep needs the batch as a tensor or a tuple of tensors with a leading batch axis.")
        n = leaves[0].shape[0]
        if n == 0:
            return self.eager(params, state, batch_t)
        self._check_matmul_precision()
        batch_t, mask = self._prepared(params, state, batch_t)
        self.sizes.add(optree.tree_leaves(batch_t, namespace=NAMESPACE)[0].shape[0])
        # Dynamo keeps its graphs per code object, and every compiled step shares the
        # pipeline's code objects (stage.update, the optimizer's update): past its recompile
        # limit (8 by default) it would run this step eagerly, silently. A step's own graphs
        # are few and bounded (buckets), so the limit is lifted for its calls only. Floats are
        # specialized: they are fixed within a step (clip norm, learning rate; a clip norm that
        # moves is refused), and dynamo's automatic dynamic shapes would otherwise turn one that
        # differs between two steps of a process (a sweep) into a tensor read back with .item()
        # every step.
        previous, _ACTIVE.step = getattr(_ACTIVE, "step", None), self
        try:
            with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT, specialize_float=True,
                                            accumulated_recompile_limit=_RECOMPILE_LIMIT * 4), \
                    drawn_between_graphs(self.records_cuda_graphs):
                return self._compiled(params, state, batch_t, mask)
        finally:
            _ACTIVE.step = previous

    def explain(self, params: Any, state: Any, batch: Any) -> Any:
        """What ``torch.compile`` makes of one step on ``batch`` (``torch._dynamo.explain``'s report).

        ``graph_count``, ``graph_break_count`` and ``break_reasons`` say what was traced
        and what ran eagerly and why: no break on a step whose stages all trace (the
        noise draw is an operator in the graph); one for a noise drawn eagerly (exact,
        secure, per-group, ``prefetch=True``) and one for a clip backend that runs its
        rules eagerly (``"ghost"``, or ``"auto"`` above its limits); a model with an untraceable
        operation (``.item()``, data-dependent Python branches) shows its own. A step
        with breaks is still correct: dynamo runs the untraced parts eagerly.
        Nothing is updated (the report is computed on the given values). The batch shape's
        planning step runs first, as before a compiled call, so the report is of the graphs
        that a call on this batch runs (``"auto"``'s traced path included).
        """
        batch_t, mask = self._prepared(params, state, batch if isinstance(batch, tuple) else (batch,))
        with drawn_between_graphs(self.records_cuda_graphs):
            return torch._dynamo.explain(self._step)(params, state, batch_t, mask)

    def _prepared(self, params: Any, state: Any, batch_t: tuple[Any, ...]) -> tuple[tuple[Any, ...], torch.Tensor | None]:
        """The batch as the compiled step takes it, and its padding mask: padded to its bucket,
        every dimension marked static, and its shape planned (:meth:`_plan`)."""
        mask = None
        if self.buckets is not None:
            n = optree.tree_leaves(batch_t, namespace=NAMESPACE)[0].shape[0]
            batch_t, mask = pad_batch(batch_t, bucket_for(n, self.buckets))
        # One graph per shape, never a symbolic one: every dimension of every tensor the step
        # takes is static. Dynamo keeps the shapes it has seen per code object, and every
        # compiled step shares the pipeline's, so a second step in the process on another
        # sequence length (or model) would otherwise make that size a symbol by its automatic
        # dynamic shapes, and dropout under vmap cannot draw a mask of symbolic size.
        _mark_all_static((params, state, batch_t, mask))
        self._plan(params, state, batch_t, mask)
        return batch_t, mask

    def _check_matmul_precision(self) -> None:
        """Refuses a call after torch's float32 matmul precision changed: the traced certified
        norms took the first call's rounding as a constant (TF32 rounds more than IEEE float32)."""
        now = matmul_precision()
        if self._precision is None:
            self._precision = now
        elif now != self._precision:
            raise InputValueError(
                f"compile_step: torch's float32 matmul precision settings changed since this step was compiled "
                f"({self._precision} -> {now}); its certified per-example norms assume the rounding of the first. "
                "Build a new compiled step after changing the precision (or restore the earlier settings).")

    def _plan(self, params: Any, state: Any, batch_t: tuple[Any, ...], mask: torch.Tensor | None) -> None:
        """Runs one eager step (discarded) for each new batch shape: ``"auto"`` clip stages plan
        there which layer calls their traced path taps (the plan needs the model run eagerly)."""
        shape = (tuple((tuple(t.shape), t.dtype) for t in optree.tree_leaves(batch_t, namespace=NAMESPACE)), mask is None)
        if shape not in self._planned:
            previous, _PLANNING.on = planning(), True
            try:
                self._step(params, state, batch_t, mask)
            finally:
                _PLANNING.on = previous
            self._planned.add(shape)

    def eager(self, params: Any, state: Any, batch: Any) -> tuple[Any, Any]:
        """The same step without the compiler (the reference the compiled step is tested against)."""
        return self._step(params, state, batch if isinstance(batch, tuple) else (batch,), None)

    def _step(self, params: Any, state: Any, batch: tuple[Any, ...], example_mask: torch.Tensor | None) -> tuple[Any, Any]:
        if example_mask is None:
            updates, state = self.pipeline.update(batch, state, params)
        else:
            updates, state = self.pipeline.update(batch, state, params, example_mask=example_mask)
        return apply_updates(params, updates), state


def _mark_all_static(tree: Any) -> None:
    """Marks every dimension of every tensor leaf of ``tree`` static for dynamo."""
    for leaf in optree.tree_leaves(tree, namespace=NAMESPACE):
        if isinstance(leaf, torch.Tensor):
            torch._dynamo.mark_static(leaf)  # no index: every dimension


def matmul_precision() -> tuple[Any, ...]:
    """Torch's settings that decide how a float32 matmul rounds (TF32, bf16 inputs).

    Example:
        >>> from opake_fx.compiled import matmul_precision
        >>> matmul_precision()[0]  # torch.get_float32_matmul_precision()
        'highest'
    """
    mkldnn = getattr(torch.backends.mkldnn, "matmul", None)

    def fp32(backend: Any) -> str:  # "none" (not set) and "ieee" round alike
        value = getattr(backend, "fp32_precision", "none")
        return "ieee" if value in ("none", "ieee", None) else str(value)

    return (torch.get_float32_matmul_precision(), fp32(torch.backends), torch.backends.cuda.matmul.allow_tf32,
            fp32(torch.backends.cuda.matmul), fp32(mkldnn))


def inductor_options(devices: set[str] | frozenset[str]) -> dict[str, Any]:
    """Inductor settings a compiled DP step adds for a graph whose inputs live on ``devices``.

    On a CPU, no layout optimization: inductor would otherwise run the graph's convolutions
    channels-last, and under ``vmap`` the per-example normalisation and pooling around
    them (their per-example parameter gradients, reductions over each example's pixels)
    then read channels-last and contiguous tensors side by side, as strided gathers.
    Measured with ``benchmarks/clipping.py`` (2 CPU threads, compiled ``"auto"``): cnn-64
    1.38x -> 1.09x of the floor, cnn-256 1.42x -> 1.09x. A GPU graph keeps inductor's
    default (not measured here).

    Example:
        >>> from opake_fx.compiled import inductor_options
        >>> inductor_options({"cpu"})
        {'layout_optimization': False}
        >>> inductor_options({"cuda"})
        {}
    """
    return {"layout_optimization": False} if devices <= {"cpu"} else {}


def planning() -> bool:
    """Whether a :class:`CompiledStep`'s eager planning step is running in this thread.

    Each new batch shape first runs the step once eagerly (its result discarded): the
    ``"auto"`` clip backend plans there which layer calls its traced path taps, which
    needs the model run eagerly. Code that should only plan, not release, can ask this.

    Example:
        >>> from opake_fx.compiled import planning
        >>> planning()
        False
    """
    return getattr(_PLANNING, "on", False)


_PLANNING = threading.local()
_RECOMPILE_LIMIT = 1024
_ACTIVE = threading.local()  # the CompiledStep whose call is compiling (counts its graphs)


@functools.cache
def _counting_backend(mode: str | None) -> Callable[..., Any]:
    """Inductor with ``mode``'s options, counting each graph for the step being called.

    One backend per mode for the whole process: dynamo checks that the cached graphs of
    a code object came from the same backend callable, so a backend per step would make
    every step built later invalidate (and recompile) the others'.
    """
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    patches = list_mode_options(mode) if mode not in (None, "default") else {}

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        step = getattr(_ACTIVE, "step", None)
        if step is not None:
            step.graphs_compiled += 1
        devices = {x.device.type for x in example_inputs if isinstance(x, torch.Tensor)}
        return compile_fx(gm, example_inputs, config_patches={**patches, **inductor_options(devices)})

    return backend


def _check_fixed_clip_norm(pipeline: Transform) -> None:
    moving = [name for name, stage in _clip_stages(pipeline.privacy) if stage.max_norm is None]
    if moving:
        raise InputValueError(
            f"compile_step: the clip stage {moving[0]!r} sets its clip norm step by step (adaptive clipping, or a "
            "clipping function whose max_norm is only known per call); the compiled graph holds the norm as a "
            "constant, so every step would compile again. Run this pipeline eagerly (pipeline.update), or use a "
            "fixed or AUTO-S clip norm (DPPlan(clipping_mode='fixed' or 'auto'))."
        )


def _check_takes_mask(pipeline: Transform) -> None:
    described = pipeline.privacy
    clips = list(_clip_stages(described)) if described is not None else []
    if not clips:
        raise InputValueError(
            "compile_step(buckets=...) pads batches and masks the padding out of the clip stage, but this pipeline has "
            "no described clip stage (build it from opake_fx.dpsgd.clip / auto_clip / adaptive_clip, or a plan's "
            "pipeline), so the mask could be ignored and the padding rows would add their gradients. Pass buckets=None "
            "(fixed-size batches) or build the pipeline from the library's clip stages."
        )
    refusing = [name for name, stage in clips if not stage.takes_example_mask]
    if refusing:
        raise InputValueError(
            f"compile_step(buckets=...): the clip stage {refusing[0]!r} does not take the padding mask (example_mask), "
            "so padding rows would add their gradients to the release. Use buckets=None with this stage (every batch "
            "size then compiles once), or a clip stage built by clip / auto_clip / adaptive_clip / as_stage."
        )


def _clip_stages(described: Any, name: str = "pipeline") -> Any:
    if described is None:
        return
    if described.kind == "chain":
        for child_name, child in described.stages:
            yield from _clip_stages(child, child_name)
    elif described.kind == "clip":
        yield name, described
