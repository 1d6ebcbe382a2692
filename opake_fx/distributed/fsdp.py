"""DP training of an FSDP2-sharded model (``torch.distributed.fsdp.fully_shard``).

A model sharded with ``fully_shard`` (per block and at the root, the usual recipe) holds
each parameter as a ``DTensor`` whose first axis is split over the ranks. A DP step on it:

1. every rank gathers the full parameters (:func:`gather_params`) and computes the
   clipped sum of ITS examples with the usual clip stage, on a functional view of the
   model with FSDP's own forward hooks held off (:func:`make_functional_fsdp`);
2. the clipped sums are reduce-scattered (:func:`reduce_scatter_clipped`): each rank
   receives the sum over all ranks of its own rows, as a
   :class:`~opake_fx.types.RowShardedClippedPytree`;
3. the noise stage adds exactly this rank's rows of the ONE unsharded noise
   (:func:`opake_fx.random.flat_tree_normal_rows`: the same key, step and layout as an
   unsharded run), so every coordinate gets its noise once (DP-FTRL's correlated noise
   too: its streaming buffers hold this rank's rows);
4. the optimizer updates the local shards only; its state is sharded too.

:func:`fsdp_pipeline` chains the four; ``DPPlan.pipeline(..., model=fmodel)`` builds it
when ``fmodel`` comes from :func:`make_functional_fsdp`. With the same keys and data, the
parameters equal a single-process run's up to float summation order
(``tests/distributed/test_fsdp_ranks.py``).

What each rank holds: the full parameters during the step (gathered once per step, not
block by block), its shard of the clipped sum, of the noise and of the optimizer state.

Privacy contract: each example lives on one rank and is clipped once, to ``C``, by the
clip stage; the reduce-scatter is a sum over ranks, so the ranks' shards together are one
clipped sum of sensitivity ``C / normalize_by`` (the clip stage's ``max_norm``); the noise
of every coordinate is drawn once, by the rank that owns it, from the unsharded draw.
Ranks must agree on the key, step, noise multiplier and sensitivity (the noise stage
checks it, as under DDP). Sharded values never reach a mechanism that would draw the
same keyed noise on every rank: the plain ``ClippedPytree`` path refuses them.

Example:
    See ``docs/sharded.md`` (it needs a process group of 2+ ranks).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.functional import FunctionalModel
from opake_fx.pipeline_privacy import StagePrivacy, check_stage_order
from opake_fx.transforms import Transform
from opake_fx.types import ClippedPytree, RowShardedClippedPytree

__all__ = ["FSDPFunctionalModel", "ShardLayout", "make_functional_fsdp", "is_fsdp_model", "gather_params",
           "reduce_scatter_clipped", "fsdp_pipeline"]


def is_fsdp_model(model: Any) -> bool:
    """True when ``model`` (or one of its submodules) was sharded with FSDP2's ``fully_shard``.

    Example:
        >>> is_fsdp_model(torch.nn.Linear(2, 2))
        False
    """
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, nn.Module) and any(isinstance(m, FSDPModule) for m in model.modules())


@dataclass(frozen=True)
class ShardLayout:
    """How every parameter is split: its full shape and this rank's rows ``[start, stop)`` of its first axis.

    Attributes:
        full_shapes: the unsharded shapes, in ``params`` order.
        rows: this rank's ``(start, stop)`` of each.
        mesh: the 1-D device mesh the parameters are sharded over.
    """

    full_shapes: tuple[tuple[int, ...], ...]
    rows: tuple[tuple[int, int], ...]
    mesh: Any

    @staticmethod
    def of(params: Sequence[Any]) -> ShardLayout:
        """The layout of FSDP2 parameters (``DTensor`` s sharded on their first axis over one 1-D mesh).

        Raises:
            InputTypeError: a parameter that is not a ``DTensor``.
            InputValueError: a placement other than ``Shard(0)``, several meshes, or a
                local shard that is not FSDP2's ``ceil(n / world)``-row chunk.
        """
        from torch.distributed.tensor import DTensor, Shard

        meshes: list[Any] = []
        full, rows = [], []
        for i, p in enumerate(params):
            if not isinstance(p, DTensor):
                raise InputTypeError(
                    f"ShardLayout: parameter {i} is a {type(p).__name__}, not a DTensor: shard every parameter of the "
                    "model with fully_shard (per block and at the root), or train it data-parallel."
                )
            if tuple(p.placements) != (Shard(0),) or p.device_mesh.ndim != 1:
                raise InputValueError(
                    f"ShardLayout: parameter {i} is placed {tuple(p.placements)} on a {p.device_mesh.ndim}-D mesh; the "
                    "sharded DP step takes FSDP2's default (Shard(0) on one 1-D mesh). HSDP and custom shard "
                    "placements are not built."
                )
            if not any(p.device_mesh == m for m in meshes):  # equal meshes (DeviceMesh compares its ranks)
                meshes.append(p.device_mesh)
            n, world, rank = p.shape[0], p.device_mesh.size(), p.device_mesh.get_local_rank()
            chunk = -(-n // world)
            start, stop = min(rank * chunk, n), min((rank + 1) * chunk, n)
            if p.to_local().shape[0] != stop - start:
                raise InputValueError(
                    f"ShardLayout: parameter {i} holds {p.to_local().shape[0]} rows on rank {rank}, not FSDP2's chunk "
                    f"[{start}, {stop}) of {n}."
                )
            full.append(tuple(p.shape))
            rows.append((start, stop))
        if len(meshes) > 1:
            raise InputValueError("ShardLayout: the parameters are sharded over several meshes; shard them over one.")
        return ShardLayout(tuple(full), tuple(rows), params[0].device_mesh if params else None)


class FSDPFunctionalModel(FunctionalModel):
    """A :class:`~opake_fx.functional.FunctionalModel` of an FSDP2 model: called with FULL parameters.

    ``fmodel(full_params, *inputs)`` runs the model with ``full_params`` (plain tensors,
    e.g. from :func:`gather_params`) while FSDP's forward hooks are held off, so FSDP
    neither gathers nor reshards inside the call; everything else is
    :class:`~opake_fx.functional.FunctionalModel`'s (``vmap``/``grad`` and the fast
    clipping backends work as on an unsharded model).

    With ``trainable_only=True`` the frozen parameters (a sharded base under LoRA
    adapters) are constants: :meth:`frozen_gathered` gathers their full tensors for the
    duration of a step (:func:`fsdp_pipeline` does), and a call outside it is refused.

    Privacy: none by itself; it only changes how the model is called.
    """

    def __init__(self, model: nn.Module, *, trainable_only: bool = False) -> None:
        super().__init__(model, trainable_only=trainable_only)
        trainable = set(self.param_names)
        frozen = {id(p): p for name, p in model.named_parameters() if name not in trainable}
        order = {k: i for i, k in enumerate(frozen)}
        self._frozen: tuple[Any, ...] = tuple(frozen.values())
        self._frozen_slots: tuple[tuple[nn.Module, str, int], ...] = tuple(
            (m, name, order[id(p)])
            for _, m in model.named_modules(remove_duplicate=False)
            for name, p in m._parameters.items()
            if p is not None and id(p) in order
        )
        self._frozen_full: tuple[torch.Tensor, ...] | None = None
        self._policies = _mixed_precision_policies(model)
        dtypes = {policy.param_dtype for _, policy in self._policies}
        if len(dtypes) > 1:
            raise InputValueError(
                f"make_functional_fsdp: the model's fully_shard calls ask for different param_dtype {sorted(map(str, dtypes))}; "
                "the DP step computes the whole model in one dtype. Give every fully_shard the same MixedPrecisionPolicy."
            )
        self.compute_dtype: torch.dtype | None = dtypes.pop() if dtypes else None
        """The dtype the forward and backward run in (FSDP2's ``MixedPrecisionPolicy.param_dtype``), or ``None``."""

    def in_compute_dtype(self, full: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """``full`` parameters cast to :attr:`compute_dtype` (unchanged without a mixed precision policy)."""
        if self.compute_dtype is None:
            return tuple(full)
        return tuple(t.to(self.compute_dtype) if t.is_floating_point() else t for t in full)

    @contextlib.contextmanager
    def gathered(self, params: Sequence[Any]) -> Iterator[tuple[torch.Tensor, ...]]:
        """The full ``params`` (gathered, in :attr:`compute_dtype`) as this model takes them, with
        the frozen parameters gathered for the block (collectives: every rank enters together)."""
        with self.frozen_gathered():
            yield self.in_compute_dtype(tuple(t.detach() for t in gather_params(params)))

    @contextlib.contextmanager
    def frozen_gathered(self) -> Iterator[None]:
        """The frozen parameters' full tensors, gathered for the block (released after)."""
        self._frozen_full = tuple(t.detach() for t in self.in_compute_dtype(gather_params(self._frozen)))
        try:
            yield
        finally:
            self._frozen_full = None

    def __call__(self, params: Sequence[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        if self.compute_dtype is not None:
            wrong = sorted({str(p.dtype) for p in params if p.is_floating_point() and p.dtype != self.compute_dtype})
            if wrong:
                raise InputValueError(
                    f"FSDPFunctionalModel: the model's MixedPrecisionPolicy computes in {self.compute_dtype}, but it was "
                    f"called with {wrong} parameters. Build the step with fsdp_pipeline(..., model=fmodel) or "
                    "DPPlan.pipeline(..., model=fmodel), which cast the gathered parameters (the clipped sums, the "
                    "noise and the optimizer stay in float32)."
                )
        if not self._frozen_slots:
            with fsdp_hooks_held_off(self.model), _mixed_precision_casts(self._policies):
                return super().__call__(params, *args, **kwargs)
        if self._frozen_full is None:
            raise InputValueError(
                "FSDPFunctionalModel: the model has frozen sharded parameters; call it inside "
                "fmodel.frozen_gathered() (fsdp_pipeline does) so that they are gathered once for the step."
            )
        saved = [(m, name, m._parameters[name]) for m, name, _ in self._frozen_slots]
        try:
            for m, name, j in self._frozen_slots:
                m._parameters[name] = self._frozen_full[j]
            with fsdp_hooks_held_off(self.model), _mixed_precision_casts(self._policies):
                return super().__call__(params, *args, **kwargs)
        finally:
            for m, name, old in saved:
                m._parameters[name] = old


@contextlib.contextmanager
def fsdp_hooks_held_off(model: nn.Module) -> Iterator[None]:
    """Removes FSDP2's forward hooks from every submodule for the duration (restored, in order, after)."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    saved = []
    for m in model.modules():
        for table in (m._forward_pre_hooks, m._forward_hooks):
            mine = [(k, h) for k, h in table.items() if isinstance(getattr(h, "__self__", None), FSDPState)]
            if mine:
                saved.append((table, dict(table)))
                for k, _ in mine:
                    del table[k]
    try:
        yield
    finally:
        for table, original in saved:
            table.clear()
            table.update(original)


def _mixed_precision_policies(model: nn.Module) -> tuple[tuple[nn.Module, Any], ...]:
    """``(module, policy)`` of every ``fully_shard`` -ed module whose ``MixedPrecisionPolicy`` sets a dtype."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            policy = m._get_fsdp_state()._mp_policy
            if policy.param_dtype is not None or policy.output_dtype is not None:
                out.append((m, policy))
    return tuple(out)


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    import torch.utils._pytree as pytree

    return pytree.tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


@contextlib.contextmanager
def _mixed_precision_casts(policies: Sequence[tuple[nn.Module, Any]]) -> Iterator[None]:
    """What FSDP2's hooks do for a ``MixedPrecisionPolicy`` besides gathering: cast each sharded module's
    floating inputs to ``param_dtype`` (``cast_forward_inputs``) and its outputs to ``output_dtype``."""
    handles = []
    try:
        for m, policy in policies:
            if policy.param_dtype is not None and policy.cast_forward_inputs:
                handles.append(m.register_forward_pre_hook(
                    lambda _m, args, kwargs, d=policy.param_dtype: (_cast_floats(args, d), _cast_floats(kwargs, d)),
                    with_kwargs=True))
            if policy.output_dtype is not None:
                handles.append(m.register_forward_hook(
                    lambda _m, _args, out, d=policy.output_dtype: _cast_floats(out, d)))
        yield
    finally:
        for h in handles:
            h.remove()


def make_functional_fsdp(model: nn.Module, trainable_only: bool = False) -> tuple[FSDPFunctionalModel, tuple[Any, ...]]:
    """Splits an FSDP2-sharded ``model`` into a function of FULL parameters and its sharded parameters.

    Args:
        model: a module sharded with ``fully_shard``.
        trainable_only: as for :func:`opake_fx.functional.make_functional`: only the
            parameters with ``requires_grad`` (LoRA adapters) are in ``params``; the frozen
            ones stay sharded in the model and are gathered once per step as constants.

    Returns:
        ``(fmodel, params)``: ``params`` are the model's ``DTensor`` parameters (detached,
        sharded); ``fmodel(full_params, *inputs)`` runs the model on full ones. Give
        ``fmodel`` to ``DPPlan.pipeline(..., model=fmodel)`` (or :func:`fsdp_pipeline`)
        and ``params`` to its ``init``/``update``; the updates are sharded like
        ``params`` (``opake_fx.transforms.apply_updates`` adds them shard by shard).

    Raises:
        InputValueError: the model is not sharded with ``fully_shard``, or
            ``trainable_only=True`` and nothing is trainable.

    Privacy: none by itself.
    """
    if not is_fsdp_model(model):
        raise InputValueError(
            "make_functional_fsdp: the model is not sharded with torch.distributed.fsdp.fully_shard; use "
            "opake_fx.functional.make_functional for an unsharded model."
        )
    fmodel = FSDPFunctionalModel(model, trainable_only=trainable_only)
    if trainable_only and not fmodel.param_names:
        raise InputValueError("make_functional_fsdp(trainable_only=True): no parameter of the model requires grad.")
    own = dict(model.named_parameters())
    params = tuple(own[name].detach() for name in fmodel.param_names)
    ShardLayout.of(params)  # refuses what the step cannot shard
    return fmodel, params


def gather_params(params: Sequence[Any]) -> tuple[torch.Tensor, ...]:
    """The full tensors of sharded ``params`` (one all-gather each); plain tensors pass through."""
    from torch.distributed.tensor import DTensor

    return tuple(p.full_tensor() if isinstance(p, DTensor) else p for p in params)


def reduce_scatter_clipped(clipped: ClippedPytree, layout: ShardLayout) -> RowShardedClippedPytree:
    """Sums a clipped value over the ranks and keeps this rank's rows of every leaf.

    Privacy: a sum over ranks (each example lives on one rank): the ranks' shards together
    are one clipped sum with the same ``max_norm``.

    Raises:
        InputTypeError: not a ``ClippedPytree`` (an unclipped or already noised value).
        InputValueError: leaves that do not fit the layout.
    """
    import optree
    import torch.distributed as dist

    from opake_fx.pytree import NAMESPACE
    from opake_fx.types import NoisedPytree

    if not isinstance(clipped, ClippedPytree) or isinstance(clipped, NoisedPytree):
        raise InputTypeError(
            f"reduce_scatter_clipped needs the clip stage's ClippedPytree; got {type(clipped).__name__}."
        )
    leaves, spec = optree.tree_flatten(clipped.pytree, namespace=NAMESPACE)
    if [tuple(t.shape) for t in leaves] != list(layout.full_shapes):
        raise InputValueError(
            f"reduce_scatter_clipped: leaf shapes {[tuple(t.shape) for t in leaves]} are not the layout's full shapes "
            f"{list(layout.full_shapes)}."
        )
    group = layout.mesh.get_group()
    world = layout.mesh.size()
    shards = []
    for t, shape, (start, stop) in zip(leaves, layout.full_shapes, layout.rows):
        chunk = -(-shape[0] // world)
        if chunk * world == shape[0]:
            padded = t
        else:  # FSDP2's last rank holds fewer rows: zero rows pad the sum to equal chunks
            padded = t.new_zeros((chunk * world, *shape[1:]))
            padded[: shape[0]] = t
        out = t.new_empty((chunk, *shape[1:]))
        dist.reduce_scatter_single(out, padded.contiguous(), group=group)
        shards.append(out[: stop - start])
    # a per-group max_norm keeps each leaf's group: the shards' paths are the unsharded leaves'
    return RowShardedClippedPytree(spec.unflatten(shards), clipped.max_norm, layout.full_shapes, layout.rows)


@dataclass(frozen=True)
class FSDPStepState:
    """The state of :func:`fsdp_pipeline`: the clip, noise and optimizer stages' (the optimizer's sharded)."""

    clip: Any
    noise: Any
    opt: Any


def fsdp_pipeline(clip_stage: Transform, noise_stage: Transform, optimizer: Transform, *,
                  model: FSDPFunctionalModel | None = None) -> Transform:
    """The DP step of an FSDP2 model: gather, clip, reduce-scatter, noise this rank's rows, update its shards.

    ``update(batch, state, params)`` takes the sharded ``params`` of
    :func:`make_functional_fsdp` and returns sharded updates (``DTensor`` s placed like
    ``params``); ``clip_stage`` must be built on the ``FSDPFunctionalModel`` (its loss
    sees full parameters), given as ``model`` when it has frozen parameters (they are
    gathered once per step).

    Privacy: clip -> sum over ranks -> Gaussian noise -> optimizer, as the unsharded
    ``named_chain(clip, psum, noise, opt)``: see the module docstring.
    """
    from torch.distributed.tensor import DTensor

    described = (("clip", clip_stage.privacy), ("reduce_scatter", StagePrivacy(
        "aggregate", "reduce-scatter over ranks (each rank keeps its rows)")), ("noise", noise_stage.privacy),
        ("opt", optimizer.privacy))
    check_stage_order(described, "fsdp_pipeline")

    def gathered(params: Any) -> Any:  # the full parameters as the clip stage's model takes them
        return model.gathered(params) if model is not None else contextlib.nullcontext(gather_params(params))

    def init(params: Any) -> FSDPStepState:
        ShardLayout.of(params)  # refuses parameters the step cannot shard
        local = tuple(p.to_local() for p in params)
        with gathered(params) as full:
            clip_state = clip_stage.init(full)
        return FSDPStepState(clip_state, noise_stage.init(None), optimizer.init(local))

    def update(batch: Any, state: FSDPStepState, params: Any = None, **extra: Any) -> tuple[Any, FSDPStepState]:
        if params is None:
            raise InputValueError("fsdp_pipeline.update needs params (the sharded parameters).")
        layout = ShardLayout.of(params)
        with gathered(params) as full:
            clipped, clip_state = clip_stage.update(batch, state.clip, full, **extra)
        del full  # the gathered parameters are not needed past the clip: free them before the reduce-scatter
        rows = reduce_scatter_clipped(clipped, layout)
        del clipped  # the full-size clipped sum is not needed past the reduce-scatter
        noised, noise_state = noise_stage.update(rows, state.noise)
        local = tuple(p.to_local() for p in params)
        updates, opt_state = optimizer.update(noised, state.opt, local)
        sharded = tuple(DTensor.from_local(u, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                        for u, p in zip(updates, params))
        return sharded, FSDPStepState(clip_state, noise_state, opt_state)

    return Transform(init, update, StagePrivacy("chain", stages=described))
