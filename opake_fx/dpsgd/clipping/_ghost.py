"""The fast clipping backends (``clip_backend="ghost"`` / ``"auto"``).

One forward pass of the BATCHED loss records, for every call of a module that uses a
differentiated parameter, the module's input (forward hook) and the gradient edge of
its output. One backward pass of ``sum_i L_i``, asked only for those outputs (so
autograd forms no weight gradient at all), gives the output gradients ``g``. The
per-layer rules of :mod:`._layers` turn ``(a, g)`` into per-example squared norms;
the engine turns the norms into weights ``w_i``; the rules then form
``sum_i w_i dP_i`` straight from ``(a, g)`` (book-keeping, Bu et al. 2023). Cost:
one forward, one backward, plus the norms; never a second backward and, for the
ghost-norm layers, never a per-example gradient.

Whatever the rules cannot do exactly goes to an exact fallback, per parameter:

* a module of another type (or a subclass with its own ``forward``) that owns
  parameters: ``vmap`` of that module's vjp, restricted to its parameters (and to those
  of submodules it uses without calling them, like ``nn.MultiheadAttention.out_proj``);
* a parameter used by several module calls (weight tying, a layer applied twice):
  per-example gradients of every call, summed (for an embedding this is ``[B, V, D]``);
* a parameter used outside any module call (directly in ``loss_fn``), one whose module
  was called without the batch as first dimension, or one whose module fallback does not
  add up to the batch gradient: ``vmap`` of the whole loss, restricted to it.
"""

from __future__ import annotations

from typing import Any, Callable, Literal

import optree
import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.nn.modules.batchnorm import _BatchNorm

from opake_fx.dpsgd.clipping import _layers as L
from opake_fx.dpsgd.clipping._compat import checkpoint_passthrough
from opake_fx.dpsgd.clipping._engine import (
    Backend,
    ClipConfig,
    PerExampleNorms,
    _diff_tree,
    batch_size_of,
    vmap_backend,
)
from opake_fx.errors import InputTypeError, InputValueError, OperationError
from opake_fx.functional import FunctionalModel
from opake_fx.pytree import NAMESPACE, tree_flatten_with_paths

ClipBackend = Literal["vmap", "ghost", "auto"]
_NORM_TYPES: tuple[type, ...] = (nn.LayerNorm, nn.GroupNorm) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())


def make_backend(clip_backend: str, model: FunctionalModel | nn.Module | None) -> Backend:
    """The backend for ``clip_backend``; ``model`` is required by ``"ghost"`` and ``"auto"``."""
    if clip_backend == "vmap":
        return vmap_backend
    if clip_backend not in ("ghost", "auto"):
        raise InputValueError(f"clip_backend must be 'vmap', 'ghost' or 'auto'; got {clip_backend!r}.")
    if model is None:
        raise InputValueError(
            f"clip_backend={clip_backend!r} needs model=fmodel (the FunctionalModel, or the nn.Module, that "
            "loss_fn calls): it reads layer inputs and output gradients through module hooks."
        )
    root = model.model if isinstance(model, FunctionalModel) else model
    if not isinstance(root, nn.Module):
        raise InputTypeError(f"model must be a FunctionalModel or an nn.Module; got {type(model).__name__}.")
    return _NormBackend(root, clip_backend)


class _Use:
    """One call of one module that used differentiated parameters."""

    __slots__ = ("module", "kind", "names", "args", "kwargs", "versions", "edges", "bound")

    def __init__(self, module: nn.Module, kind: str, names: dict[str, int], args: tuple[Any, ...],
                 kwargs: dict[str, Any], edges: list[Any], bound: dict[str, torch.Tensor] | None) -> None:
        self.module, self.kind, self.names = module, kind, names
        self.args, self.kwargs, self.edges, self.bound = args, kwargs, edges, bound
        self.versions = [t._version for t in optree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]


class _NormBackend:
    """Callable backend: ``(loss_fn, args, kwargs, cfg) -> PerExampleNorms`` for one (micro)batch."""

    def __init__(self, root: nn.Module, mode: str) -> None:
        self.root, self.mode = root, mode

    def __call__(self, loss_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], cfg: ClipConfig) -> PerExampleNorms:
        batch = batch_size_of(args, cfg)
        _, flat, treedef = tree_flatten_with_paths(_diff_tree(args, cfg))
        leaves = [x.detach().requires_grad_(True) for x in flat]
        run_args = _with_diff(args, cfg, optree.tree_unflatten(treedef, leaves))
        index = {id(x): i for i, x in enumerate(leaves)}
        capture = _Capture(self.root, index, batch)
        with capture:
            out = loss_fn(*run_args, **kwargs)
        losses, loss_aux = _split_loss(out, cfg, batch)

        plan = _Plan(leaves, capture)
        plan.resolve_unseen(_leaf_use_counts(losses, index))
        slots = [(u, k) for u in plan.active_uses() for k, e in enumerate(u.edges) if e is not None]
        verify = sorted(plan.fallback)
        inputs = [u.edges[k] for u, k in slots] + [leaves[i] for i in verify]
        grads: list[torch.Tensor | None] = [None] * len(inputs)
        if inputs and losses.requires_grad:
            grads = list(torch.autograd.grad(losses.sum(), inputs, allow_unused=True))
        out_grads: dict[int, list[Any]] = {id(u): [None] * len(u.edges) for u in plan.active_uses()}
        for (u, k), go in zip(slots, grads):
            out_grads[id(u)][k] = go
        batch_grads = dict(zip(verify, grads[len(slots):]))
        del grads, inputs, slots

        rules = {}
        for u in plan.active_uses():
            rules[id(u)] = _build_rule(u, plan.names_of(u), out_grads.pop(id(u)), self.mode, batch, leaves)
            u.args = u.kwargs = None  # the rule keeps what it needs; free the rest now
        per_ex: dict[int, torch.Tensor] = {}
        for i in range(len(leaves)):
            uses = plan.uses_of(i)
            if i in plan.whole or (len(uses) == 1 and i not in plan.fallback) or not uses:
                continue
            parts = [rules[id(u)].per_example(name) for u, name in uses if rules[id(u)] is not None]
            pe = sum(parts[1:], parts[0]) if parts else torch.zeros((batch, *leaves[i].shape), dtype=leaves[i].dtype)
            if i in plan.fallback and not _adds_up(pe, batch_grads.get(i)):
                plan.whole.add(i)  # used somewhere the module fallback cannot see
                continue
            per_ex[i] = pe
        if plan.whole:
            per_ex.update(_whole_loss_per_example(loss_fn, args, kwargs, cfg, treedef, leaves, sorted(plan.whole)))

        single: dict[int, tuple[Any, str]] = {}
        sq = torch.zeros((len(leaves), batch), dtype=torch.float64)
        for i, leaf in enumerate(leaves):
            if i in per_ex:
                sq[i] = L.sq_norms_of(per_ex[i]).cpu()
                continue
            uses = plan.uses_of(i)
            if uses and rules[id(uses[0][0])] is not None:
                single[i] = (rules[id(uses[0][0])], uses[0][1])
                sq[i] = single[i][0].sq_norm(single[i][1]).cpu()
        sq = sq.to(leaves[0].device) if leaves else sq
        shapes = [(leaf.shape, L.compute_dtype(leaf.dtype), leaf.device) for leaf in leaves]

        def weighted_sum(leaf_weights: torch.Tensor, finite: torch.Tensor) -> list[torch.Tensor]:
            keep = None if bool(finite.all()) else finite
            out = []
            for i, (shape, dtype, device) in enumerate(shapes):
                if i in per_ex:
                    out.append(L.weighted_sum_of(per_ex[i], leaf_weights[i], keep))
                elif i in single:
                    rule, name = single[i]
                    out.append(rule.weighted(name, leaf_weights[i], keep))
                else:  # a parameter the loss does not use: its gradient is zero
                    out.append(torch.zeros(shape, dtype=dtype, device=device))
            return out

        return PerExampleNorms(sq, weighted_sum, losses.detach(), loss_aux)


class _Capture:
    """Forward hooks on the model's modules, registered for one forward pass only."""

    def __init__(self, root: nn.Module, index: dict[int, int], batch: int) -> None:
        self.root, self.index, self.batch = root, index, batch
        self.uses: list[_Use] = []
        self.whole: set[int] = set()  # leaves that only the whole-loss fallback can handle
        self.handles: list[Any] = []

    def __enter__(self) -> _Capture:
        for m in self.root.modules():
            if m._parameters or isinstance(m, _BatchNorm):
                self.handles.append(m.register_forward_hook(self._hook, with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        if isinstance(module, _BatchNorm) and module.training:
            raise InputValueError(
                f"{type(module).__name__} in training mode normalises with statistics of the whole batch, so one "
                "example's gradient depends on the others and clipping it bounds nothing. Use GroupNorm or "
                "LayerNorm (or put the BatchNorm in eval mode) for DP training."
            )
        names = {}
        for n in module._parameters:
            p = getattr(module, n, None)
            if isinstance(p, torch.Tensor) and id(p) in self.index:
                names[n] = self.index[id(p)]
        if not names:
            return
        kind = _kind(module)
        outputs = [o for o in optree.tree_leaves(output) if isinstance(o, torch.Tensor)]
        if not _batched(kind, module, args, kwargs, outputs, self.batch):
            self.whole.update(names.values())
            return
        edges = [get_gradient_edge(o) if o.requires_grad else None for o in outputs]
        bound = None
        if kind == "fallback":
            bound = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        self.uses.append(_Use(module, kind, names, args, kwargs, edges, bound))


class _Plan:
    """Which call(s) and which method handle each differentiated leaf."""

    def __init__(self, leaves: list[torch.Tensor], capture: _Capture) -> None:
        num_leaves = len(leaves)
        self._ids = [id(x) for x in leaves]
        self.uses = capture.uses
        self.whole = set(capture.whole)
        self.fallback: set[int] = set()  # leaves with a module-fallback use: verified against the batch gradient
        self._by_leaf: dict[int, list[tuple[_Use, str]]] = {i: [] for i in range(num_leaves)}
        for u in self.uses:
            for name, i in u.names.items():
                self._by_leaf[i].append((u, name))
                if u.kind == "fallback":
                    self.fallback.add(i)

    def resolve_unseen(self, counts: dict[int, int]) -> None:
        """Routes leaves by how often the autograd graph uses them vs. how often hooked calls did."""
        for i, uses in self._by_leaf.items():
            if i in self.whole:
                continue
            if uses and i not in self.fallback and counts.get(i, 0) > len(uses):
                self.whole.add(i)  # also used outside the hooked calls (e.g. directly in loss_fn)
            elif not uses and counts.get(i, 0) > 0:
                owner = self._enclosing_fallback(i)
                if owner:
                    uses.extend(owner)
                    self.fallback.add(i)
                else:
                    self.whole.add(i)
        for i in self.whole:
            self._by_leaf[i] = []
        self.fallback -= self.whole

    def uses_of(self, i: int) -> list[tuple[_Use, str]]:
        return self._by_leaf[i]

    def names_of(self, use: _Use) -> dict[str, int]:
        return {n: i for i, uses in self._by_leaf.items() for u, n in uses if u is use}

    def active_uses(self) -> list[_Use]:
        seen = {id(u): u for uses in self._by_leaf.values() for u, _ in uses}
        return [u for u in self.uses if id(u) in seen]

    def _enclosing_fallback(self, i: int) -> list[tuple[_Use, str]]:
        # The innermost module-fallback call whose subtree holds the leaf (all calls of that module).
        best: list[tuple[_Use, str]] = []
        for u in self.uses:
            if u.kind != "fallback" or u.bound is None:
                continue
            name = next((n for n, t in u.bound.items() if self._ids[i] == id(t)), None)
            if name is None:
                continue
            if not best or len(u.bound) < len(best[0][0].bound or ()):
                best = [(u, name)]
            elif u.module is best[0][0].module:
                best.append((u, name))
        return best


def _kind(module: nn.Module) -> str:
    t = type(module)
    if isinstance(module, nn.Linear) and t.forward is nn.Linear.forward:
        return "linear"
    if isinstance(module, (nn.Conv1d, nn.Conv2d)) and t.forward in (nn.Conv1d.forward, nn.Conv2d.forward) and (
        t._conv_forward in (nn.Conv1d._conv_forward, nn.Conv2d._conv_forward)
    ):
        return "conv"
    if isinstance(module, nn.Embedding) and t.forward is nn.Embedding.forward:
        if module.scale_grad_by_freq:
            raise InputValueError(
                "nn.Embedding(scale_grad_by_freq=True) divides gradients by token counts over the whole batch, so "
                "one example's gradient depends on the others and clipping it bounds nothing. Set it to False."
            )
        if module.max_norm is not None:
            raise InputValueError(
                "nn.Embedding(max_norm=...) renormalises its weight in place during the forward pass, which a "
                "functional per-example gradient cannot follow. Remove max_norm (clipping bounds updates instead)."
            )
        return "embedding"
    if isinstance(module, _NORM_TYPES) and t.forward in tuple(c.forward for c in _NORM_TYPES):
        return "norm"
    return "fallback"


def _batched(kind: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
             outputs: list[torch.Tensor], batch: int) -> bool:
    """Whether the call carries the batch as the first dimension of its input and outputs."""
    if not outputs or any(o.dim() == 0 or o.shape[0] != batch for o in outputs):
        return False
    if kind == "fallback":
        return any(isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch for t in optree.tree_leaves((args, kwargs)))
    a = args[0] if args else kwargs.get("input")
    if not isinstance(a, torch.Tensor) or a.dim() == 0 or a.shape[0] != batch:
        return False
    if kind == "linear":
        return a.dim() >= 2
    if kind == "conv":
        return a.dim() == (3 if isinstance(module, nn.Conv1d) else 4)
    if kind == "norm":
        return a.dim() >= 2 and (isinstance(module, nn.GroupNorm) or a.dim() > len(module.normalized_shape))
    return True


def _build_rule(use: _Use, names: dict[str, int], grads_out: list[Any], mode: str, batch: int,
                leaves: list[torch.Tensor]) -> Any:
    tensors = [t for t in optree.tree_leaves((use.args, use.kwargs)) if isinstance(t, torch.Tensor)]
    if any(t._version != v for t, v in zip(tensors, use.versions)):
        raise OperationError(
            f"the input of {type(use.module).__name__} was modified in place after the module used it (e.g. by an "
            "inplace activation or `x += ...` on a tensor a layer reads). The fast clipping backend reads layer "
            "inputs after the backward pass: make that operation out of place, or use clip_backend='vmap'."
        )
    args, kwargs = optree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, (use.args, use.kwargs))
    if use.kind == "fallback":
        return L.module_per_example(use.module, use.bound or {}, list(names), args, kwargs, grads_out, batch)
    g = grads_out[0]
    if g is None:  # the output does not reach the loss: zero gradient
        return None
    a = args[0] if args else kwargs["input"]
    dtype = leaves[next(iter(names.values()))].dtype
    roles = {n: n for n in names}
    if use.kind == "linear":
        return L.linear_grad(use.module, a, g, roles, mode, dtype)
    if use.kind == "conv":
        return L.conv_grad(use.module, a, g, roles, mode, dtype)
    if use.kind == "embedding":
        return L.EmbeddingGrad(a, g, use.module, L.compute_dtype(dtype))
    return L.norm_grad(use.module, a, g, roles, dtype)


def _leaf_use_counts(losses: torch.Tensor, index: dict[int, int]) -> dict[int, int]:
    """How many autograd edges lead into each differentiated leaf (its uses in the graph)."""
    counts: dict[int, int] = {}
    if losses.grad_fn is None:
        return counts
    stack, seen = [losses.grad_fn], {losses.grad_fn}
    while stack:
        node = stack.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            var = getattr(nxt, "variable", None)
            if var is not None:
                i = index.get(id(var))
                if i is not None:
                    counts[i] = counts.get(i, 0) + 1
            elif nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return counts


def _adds_up(pe: torch.Tensor, batch_grad: torch.Tensor | None) -> bool:
    """Whether per-example gradients sum to the batch gradient (a fallback missed no use)."""
    total = pe.sum(dim=0)
    if batch_grad is None:
        return not bool(total.abs().max() > 0) if total.numel() else True
    if not bool(torch.isfinite(batch_grad).all()):
        return True  # a non-finite example: nothing to compare, its weight will be 0 anyway
    ref = batch_grad.to(total.dtype)
    diff = torch.linalg.vector_norm(total - ref)
    return bool(diff <= 1e-4 * (torch.linalg.vector_norm(ref) + torch.linalg.vector_norm(total)) + 1e-30)


def _whole_loss_per_example(loss_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], cfg: ClipConfig,
                            treedef: Any, leaves: list[torch.Tensor], idx: list[int]) -> dict[int, torch.Tensor]:
    """Per-example gradients of the leaves ``idx`` by ``vmap(grad)`` of the loss on one example."""
    base = [x.detach() for x in leaves]

    def one(sub: tuple[torch.Tensor, ...], *a: Any) -> torch.Tensor:
        ls = list(base)
        for k, t in zip(idx, sub):
            ls[k] = t
        full = _with_diff(a, cfg, optree.tree_unflatten(treedef, ls))
        full = tuple(
            optree.tree_map(lambda t: t.unsqueeze(0), x, namespace=NAMESPACE) if i in cfg.batch_argnums else x
            for i, x in enumerate(full)
        )
        out = loss_fn(*full, **kwargs)
        return (out[0] if cfg.has_aux else out).reshape(())

    in_dims = tuple(0 if i in cfg.batch_argnums else None for i in range(len(args)))
    with checkpoint_passthrough():
        grads = torch.func.vmap(torch.func.grad(one), in_dims=(None, *in_dims))(tuple(base[k] for k in idx), *args)
    return dict(zip(idx, grads))


def _split_loss(out: Any, cfg: ClipConfig, batch: int) -> tuple[torch.Tensor, Any]:
    if cfg.has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise InputValueError("has_aux=True: loss_fn must return (per_example_losses, aux).")
        loss, aux = out
        aux = optree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, aux, namespace=NAMESPACE)
    else:
        loss, aux = out, None
    if not isinstance(loss, torch.Tensor) or tuple(loss.shape) != (batch,):
        got = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise InputValueError(
            f"with clip_backend='ghost' or 'auto', loss_fn is called on the whole batch and must return the "
            f"per-example losses, shape [B] = [{batch}]; got {got}. Return per-example losses, e.g. "
            "F.cross_entropy(logits, y, reduction='none') (sum or average over tokens within each example); "
            "a batch mean or sum would hide which example each gradient came from."
        )
    return loss, aux


def _with_diff(args: tuple[Any, ...], cfg: ClipConfig, tree: Any) -> tuple[Any, ...]:
    out = list(args)
    if cfg.single_argnum:
        out[cfg.argnums[0]] = tree
    else:
        for a, sub in zip(cfg.argnums, tree):
            out[a] = sub
    return tuple(out)
