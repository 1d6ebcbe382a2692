"""The traced fast path of ``clip_backend="auto"``: layer rules inside a compiled step.

The eager fast backend (:mod:`._ghost`) observes the model through hooks, autograd taps
and probes that ``torch.compile`` cannot trace. This path owns its graph instead:

* **Each example alone.** ``vmap`` over the examples of the batched loss on a batch of
  one (as the whole-loss path does): each example's loss, activations and gradients are
  computed from that example only, so independence holds by construction, with no probe.
* **Taps as inputs.** Every tapped call (``nn.Linear``, Hugging Face's ``Conv1D`` and
  ``nn.Embedding``: :data:`TAPPED_RULES`) adds a zero tensor ``z`` to its
  output; ``z`` is an input of the per-example gradient, so its gradient is ``g``, the
  gradient of the example's loss with respect to the layer's output, and the layer's
  input ``a`` (an embedding's ids) is returned beside the loss. No weight gradient is
  formed for these layers. Their per-example norms and weighted sums come from ``(a, g)``
  by the eager backend's own layer rules (ghost norms or per-example weight gradients by
  the cost rule, certified the same way), in their static-shaped form.
* **Everything else exactly.** Every other differentiated parameter takes the exact
  per-example gradient from the same ``vmap`` (the whole-loss path, restricted to it).
* **Attention batched.** On a CPU, ``F.scaled_dot_product_attention`` runs by its math
  backend when the batch's attention scores are small enough
  (:data:`MATH_ATTENTION_MAX_ELEMENTS`): the CPU flash kernel has no ``vmap`` batching rule
  and would run once per example. The same function, computed another way: each example's
  loss stays its own.

Which calls are tapped is planned once per call signature, eagerly, on the first
example (:func:`plan_taps`; :class:`~opake_fx.compiled.CompiledStep` runs one discarded
eager step for each new batch shape to make the plan before compiling,
:func:`opake_fx.compiled.planning`): a module of those rules (running its class's own
``forward``) called once, whose parameters the loss uses through that call only. A
parameter also used elsewhere (tied weights, a layer called twice, a direct use in
``loss_fn``) is found from the autograd graph of that example's loss with the tapped
uses cut, and goes to the exact path.

Privacy contract: each example's contribution to the weighted sum is a function of that
example alone (``vmap`` over single examples), and the norm that decides its weight is a
certified upper bound of the norm of exactly what is summed for it: the tapped layers'
``(a, g)`` products by their rules' certified norms, the others' per-example
gradients by :func:`._certified.sq_norms`. A plan that no longer describes the model
could only leave part of a gradient out, never let an example contribute more than the
clip norm; and a tapped call that does not happen exactly once when traced is refused.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable

import optree
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from opake_fx.dpsgd.clipping import _numerics as N
from opake_fx.dpsgd.clipping import _registry
from opake_fx.dpsgd.clipping._engine import PerExampleNorms, batch_size_of, diff_tree
from opake_fx.dpsgd.clipping import _ghost
from opake_fx.dpsgd.clipping._ghost import example_args, example_outputs, leaf_edges, with_diff
from opake_fx.dpsgd.clipping._per_example import autograd_grad, map_examples
from opake_fx.dpsgd.clipping._rule import BuildContext, Rule
from opake_fx.dpsgd.clipping._rules_embedding import EMBEDDING
from opake_fx.dpsgd.clipping._rules_linear import LINEAR, TRANSPOSED_LINEAR
from opake_fx.dpsgd.clipping.options import ClipConfig
from opake_fx.errors import OperationError
from opake_fx.pytree import NAMESPACE, tree_flatten_with_paths

__all__ = ["MATH_ATTENTION_MAX_ELEMENTS", "TAPPED_RULES", "Tap", "TapPlan", "TracedTaps", "attention_backend", "plan_taps",
           "taps_pay", "traced_norms"]


@dataclass(frozen=True)
class Tap:
    """One tapped call: its module and layer rule, the differentiated parameters it takes
    (name -> leaf), and its per-example output's shape and dtype. (A Linear rule takes any
    leading axes, so the example's axis of one that ``vmap`` stacks needs no reshaping.)"""

    module: nn.Module
    rule: Rule
    names: tuple[tuple[str, int], ...]
    out_shape: tuple[int, ...]  # one example's output (its batch axis of one included)
    out_dtype: torch.dtype  # the output's (the zero input added to it keeps it)


@dataclass(frozen=True)
class TapPlan:
    """Which calls are tapped, and which leaves take the exact per-example path."""

    taps: tuple[Tap, ...]
    exact: tuple[int, ...]
    why_exact: tuple[tuple[int, str], ...]  # leaf -> why it is not tapped (for the docs and tests)
    attention_cells: int = 0  # one example's attention scores, summed over its attention calls

    @property
    def tapped(self) -> tuple[int, ...]:
        return tuple(sorted(i for t in self.taps for _, i in t.names))


class _Recording:
    """The taps of one example's forward pass: the zero inputs, the layers' inputs, the calls."""

    def __init__(self, slots: dict[int, int], z: tuple[torch.Tensor, ...]) -> None:
        self.slots, self.z = slots, z
        self.inputs: list[Any] = [None] * len(slots)
        self.calls = [0] * len(slots)


class _Slot:
    rec: _Recording | None = None  # the recording in progress (the taps are inert without one)


_SLOT = _Slot()


def _tap_hook(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> Any:
    rec = _SLOT.rec
    if rec is None:
        return None
    k = rec.slots.get(id(module))
    if k is None:
        return None
    rec.calls[k] += 1
    rec.inputs[k] = inputs[0]
    return output + rec.z[k]


def _install(module: nn.Module) -> None:
    """The inert forward hook on ``module`` (once per module; it acts only during a recording)."""
    if getattr(module, "_opake_traced_tap", None) is None:
        module._opake_traced_tap = module.register_forward_hook(_tap_hook)


#: The layer rules the traced path runs, whose norms and weighted sums are static-shaped tensor
#: code: Linear layers (``nn.Linear``, Hugging Face's ``Conv1D``) and ``nn.Embedding`` (its
#: static form, :class:`._rules_embedding.StaticEmbeddingGrad`: sorted ids in place of
#: ``torch.unique``). Convolutions are not tapped: their rule compiled measured slower than the
#: exact per-example gradients (benchmarks/clipping.py, 2 CPU threads: cnn-64 29.8 ms against
#: 13.5 ms, cnn-256 105 against 51 ms). ``nn.EmbeddingBag``'s rule reads its offsets on the host.
TAPPED_RULES: tuple[Rule, ...] = (LINEAR, TRANSPOSED_LINEAR, EMBEDDING)


def _untappable(rule: Rule, module: nn.Module, a: Any, output: Any) -> str | None:
    """Why this call cannot be tapped (its parameters then take the exact path), or None: a
    tap needs one input tensor (floating-point for a Linear, integer ids for an embedding) and
    an output tensor; an embedding that renormalises its table (``max_norm``) or scales by
    token counts (``scale_grad_by_freq``) is left to the exact per-example gradients."""
    name = type(module).__name__
    if not isinstance(a, torch.Tensor) or not isinstance(output, torch.Tensor) or output.dim() < 1:
        return f"its {name} is not called on one tensor"
    if rule is EMBEDDING:
        if a.is_floating_point() or a.is_complex() or a.dtype == torch.bool:
            return f"its {name} is not called on integer ids"
        if module.max_norm is not None or module.scale_grad_by_freq:
            return f"its {name} sets max_norm or scale_grad_by_freq"
        return None
    if not a.is_floating_point():
        return f"its {name} is not called on a floating-point tensor"
    return None


#: The traced step on a CPU runs ``F.scaled_dot_product_attention`` by its math backend (scores
#: as a ``softmax`` of batched matmuls) when the batch's attention scores, over all calls, hold at
#: most this many elements. The CPU flash kernel has no ``vmap`` batching rule, so ``vmap`` loops it
#: over the examples (benchmarks/clipping.py, 2 CPU threads: 1.45x -> 1.32x of the floor on lm-16,
#: 1.58x -> 1.47x on lm-64); the math backend keeps the scores for the backward pass, so past this
#: size (128 MiB in float32) the loop's smaller memory wins.
MATH_ATTENTION_MAX_ELEMENTS = 2**25


class _AttentionCalls(TorchFunctionMode):
    """Counts the attention scores (``prod(q.shape[:-1]) * k.shape[-2]``) of the
    ``F.scaled_dot_product_attention`` calls made under it (eager planning only)."""

    def __init__(self) -> None:
        super().__init__()
        self.cells = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q = args[0] if args else kwargs.get("query")
            k = args[1] if len(args) > 1 else kwargs.get("key")
            if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() >= 2 and k.dim() >= 2:
                self.cells += math.prod(q.shape[:-1]) * k.shape[-2]
        return func(*args, **kwargs)


def attention_backend(plan: TapPlan, batch: int, device: torch.device | None) -> Any:
    """The context the traced step runs its loss in: the math attention backend on a CPU when
    the batch's scores fit :data:`MATH_ATTENTION_MAX_ELEMENTS`, else no change. Decided from
    the plan's shapes (static: one choice per compiled graph)."""
    if (device is not None and device.type == "cpu" and plan.attention_cells
            and batch * plan.attention_cells <= MATH_ATTENTION_MAX_ELEMENTS):
        return sdpa_kernel(SDPBackend.MATH)
    return contextlib.nullcontext()


def _candidates(root: nn.Module) -> list[nn.Module]:
    return [m for m in root.modules() if _registry.lookup(m) in TAPPED_RULES and m._parameters]


def _one_example(args: tuple[Any, ...], cfg: ClipConfig) -> tuple[Any, ...]:
    return tuple(optree.tree_map(lambda t: t[:1], a, namespace=NAMESPACE) if i in cfg.batch_argnums else a
                 for i, a in enumerate(args))


def plan_taps(root: nn.Module, loss_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
              cfg: ClipConfig) -> TapPlan:
    """Plans the taps from one eager forward and backward pass on the batch's first example.

    A call of a module that a rule of :data:`TAPPED_RULES` takes is tapped for each of its
    differentiated parameters when the module is called once and the loss reaches that
    parameter through no other use: the pass cuts the tapped uses (the call runs again on
    detached parameters) and reads the autograd graph of the loss for edges into the
    parameter.
    """
    _, flat, treedef = tree_flatten_with_paths(diff_tree(args, cfg))
    leaves = [x.detach().requires_grad_(True) for x in flat]
    index = {id(x): i for i, x in enumerate(leaves)}
    modules = _candidates(root)
    seen: dict[int, dict[str, Any]] = {}
    cutting = [False]

    def hook(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> Any:
        if cutting[0]:
            return None
        info = seen.setdefault(id(module), {"module": module, "calls": 0, "ok": True})
        info["calls"] += 1
        own = dict(module.named_parameters(recurse=False))
        info["names"] = tuple((n, index[id(p)]) for n, p in own.items() if id(p) in index)
        rule = _registry.lookup(module)
        a = inputs[0] if len(inputs) == 1 else None
        refusal = _untappable(rule, module, a, output)
        if refusal is not None:
            info["ok"], info["why"] = False, refusal
            return None
        info.update(rule=rule, out_shape=tuple(output.shape), out_dtype=output.dtype)
        cutting[0] = True
        try:  # the call again on detached parameters: only other uses then reach the leaves
            return torch.func.functional_call(module, {n: p.detach() for n, p in own.items()}, (a,))
        finally:
            cutting[0] = False

    handles = [m.register_forward_hook(hook) for m in modules]
    attention = _AttentionCalls()
    try:
        with torch.enable_grad(), attention:
            out = loss_fn(*with_diff(_one_example(args, cfg), cfg, optree.tree_unflatten(treedef, leaves)), **kwargs)
        loss = out[0] if cfg.has_aux else out
    finally:
        for h in handles:
            h.remove()
    other_uses = leaf_edges([loss], index) if isinstance(loss, torch.Tensor) and loss.grad_fn is not None else {}
    owners: dict[int, int] = {}
    for info in seen.values():
        for _, i in info.get("names", ()):
            owners[i] = owners.get(i, 0) + 1
    taps, why = [], {}
    for info in seen.values():
        names = info.get("names", ())
        if not info["ok"] or info["calls"] != 1:
            for _, i in names:
                why[i] = info.get("why", f"its {type(info['module']).__name__} is called more than once")
            continue
        chosen = []
        for name, i in names:
            if owners[i] > 1:
                why[i] = "it is shared by several tapped modules"
            elif other_uses.get(i, 0):
                why[i] = "the loss also uses it outside its tapped call"
            else:
                chosen.append((name, i))
        if chosen:
            taps.append(Tap(info["module"], info["rule"], tuple(chosen), info["out_shape"], info["out_dtype"]))
    tapped = {i for t in taps for _, i in t.names}
    exact = tuple(i for i in range(len(leaves)) if i not in tapped)
    for i in exact:
        why.setdefault(i, "no tapped call uses it (its module has no traced rule)")
    return TapPlan(tuple(taps), exact, tuple(sorted(why.items())), attention.cells)


def taps_pay(plan: TapPlan, args: tuple[Any, ...], cfg: ClipConfig) -> bool:
    """Whether the traced path runs ``plan``: it taps at least one call, and the per-example
    gradients of its exact leaves (``batch * numel``) stay within
    :data:`._ghost.TRACED_WHOLE_LOSS_MAX_ELEMENTS` (else the whole-loss path or the eager rules run)."""
    if not plan.taps:
        return False
    leaves = optree.tree_leaves(diff_tree(args, cfg), namespace=NAMESPACE)
    exact = sum(leaves[i].numel() for i in plan.exact)
    return batch_size_of(args, cfg) * exact <= _ghost.TRACED_WHOLE_LOSS_MAX_ELEMENTS


def _plan_key(args: tuple[Any, ...], kwargs: dict[str, Any], cfg: ClipConfig, training: bool) -> Any:
    """What a plan depends on, the batch size left out: each tensor's shape (without the
    batch axis when batched) and dtype, each scalar's value. Plain Python on static facts,
    so dynamo folds it to a constant (no graph break) and the lookup is a guard."""

    def part(x: Any, batched: bool) -> Any:
        if isinstance(x, torch.Tensor):
            return (tuple(x.shape[1:]) if batched else tuple(x.shape), str(x.dtype))
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        return type(x).__name__

    parts = [tuple(part(x, i in cfg.batch_argnums) for x in optree.tree_leaves(a, namespace=NAMESPACE))
             for i, a in enumerate(args)]
    parts.append(tuple((k, part(v, False)) for k, v in sorted(kwargs.items())))
    return (training, tuple(parts))


class TracedTaps:
    """The traced path of one ``"auto"`` clipping function: its tap plans, per call signature."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self.plans: dict[Any, TapPlan] = {}

    def plan_for(self, loss_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                 cfg: ClipConfig) -> TapPlan | None:
        """The plan for this call signature: made now when eager, ``None`` when tracing without one."""
        key = (id(loss_fn), _plan_key(args, kwargs, cfg, self.root.training))
        plan = self.plans.get(key)
        if plan is None and not torch.compiler.is_compiling() and batch_size_of(args, cfg):
            if len(self.plans) >= 256:  # many shapes: keep the cache bounded
                self.plans.clear()
            plan = self.plans[key] = plan_taps(self.root, loss_fn, args, kwargs, cfg)
            for tap in plan.taps:
                _install(tap.module)
        return plan

    def backend(self, plan: TapPlan) -> Callable[..., PerExampleNorms]:
        """The norm backend that runs ``plan`` (``(loss_fn, args, kwargs, cfg) -> PerExampleNorms``)."""

        def run(loss_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], cfg: ClipConfig) -> PerExampleNorms:
            return traced_norms(plan, loss_fn, args, kwargs, cfg)

        return run


def traced_norms(plan: TapPlan, loss_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                 cfg: ClipConfig) -> PerExampleNorms:
    """Certified per-example norms and the weighted sum by ``plan`` (see the module docstring)."""
    batch = batch_size_of(args, cfg)
    _, flat, treedef = tree_flatten_with_paths(diff_tree(args, cfg))
    base = [x.detach() for x in flat]
    slots = {id(t.module): k for k, t in enumerate(plan.taps)}
    device = base[0].device if base else None
    zeros = tuple(torch.zeros(t.out_shape, dtype=t.out_dtype, device=device) for t in plan.taps)

    def one(z: tuple[torch.Tensor, ...], exact: tuple[torch.Tensor, ...], *a: Any) -> tuple[torch.Tensor, Any]:
        full = example_args(a, cfg, treedef, base, plan.exact, exact)
        rec, previous = _Recording(slots, z), _SLOT.rec
        _SLOT.rec = rec
        try:
            with attention_backend(plan, batch, device):
                out = loss_fn(*full, **kwargs)
        finally:
            _SLOT.rec = previous
        missed = [plan.taps[k].module for k, c in enumerate(rec.calls) if c != 1]
        if missed:
            raise OperationError(
                f"clip_backend='auto' (traced): a tapped {type(missed[0]).__name__} was called "
                f"{rec.calls[slots[id(missed[0])]]} times in this step where its plan saw one call; the model's "
                "structure changed within a call signature. Run this step eagerly, or keep the model's calls the same "
                "for a given input shape.")
        loss, aux = example_outputs(out, cfg)
        inputs = tuple(x.detach() for x in rec.inputs)
        return loss, ((loss.detach(), inputs) if aux is None else (loss.detach(), inputs, aux))

    in_dims = tuple(0 if i in cfg.batch_argnums else None for i in range(len(args)))
    exact0 = tuple(base[k] for k in plan.exact)
    (g_taps, g_exact), outputs = map_examples(
        torch.func.grad(one, argnums=(0, 1), has_aux=True), (None, None, *in_dims), (zeros, exact0, *args), batch,
        what="the traced fast path", loop_fn=autograd_grad(one, argnums=(0, 1), has_aux=True))
    losses, acts = outputs[0], outputs[1]
    loss_aux = outputs[2] if cfg.has_aux else None
    rules: dict[int, tuple[Any, str]] = {}
    for k, tap in enumerate(plan.taps):
        a, g = acts[k], g_taps[k]
        names = dict(tap.names)
        layer = tap.rule.build(tap.module, (a,), g, names, BuildContext(mode="auto", dtype=base[tap.names[0][1]].dtype,
                                                                        static=True))
        for name, i in tap.names:
            rules[i] = (layer, name)
    per_ex = dict(zip(plan.exact, g_exact))
    rows = []
    for i in range(len(base)):
        if i in rules:
            rule, role = rules[i]
            rows.append(rule.sq_norm(role))
        else:
            rows.append(N.sq_norms_of(per_ex[i]))
    sq = torch.stack(rows) if rows else torch.zeros((0, batch), dtype=torch.float64, device=device)

    def weighted_sum(leaf_weights: torch.Tensor, keep: torch.Tensor | None) -> list[torch.Tensor]:
        out = []
        for i in range(len(base)):
            if i in rules:
                rule, role = rules[i]
                out.append(rule.weighted(role, leaf_weights[i], keep))
            else:
                out.append(N.weighted_sum_of(per_ex[i], leaf_weights[i], keep))
        return out

    return PerExampleNorms(sq, weighted_sum, losses, loss_aux)

