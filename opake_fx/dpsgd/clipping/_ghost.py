"""The fast clipping backends (``clip_backend="ghost"`` / ``"auto"``).

One forward pass of the BATCHED loss runs with forward hooks on the model's modules.
Every call of a module that uses a differentiated parameter passes its output through
a *tap*: an identity autograd node that keeps the module's input and, in the backward
pass, sees the gradient ``g`` of ``sum_i L_i`` with respect to the output. The
backward pass asks autograd only for the gradient of a dummy scalar that every tap
touches, so autograd propagates activation gradients through the whole model but forms
no weight gradient at all. Each tap hands ``(a, g)`` to the module's layer rule (an
entry of :mod:`._registry`, one interface for every rule family) the moment ``g``
exists: the rule computes the per-example squared
norms and keeps what the weighted sum will need (per-example weight gradients, or just
``a`` and ``g`` for ghost-norm layers), so everything else is freed as the backward pass
goes. The engine turns norms into weights ``w_i``; the rules then form
``sum_i w_i dP_i`` (book-keeping, Bu et al. 2023). Cost: one forward, one backward, the
norms; never a second backward pass.

A rule may also rewrite a call: ``nn.MultiheadAttention`` used as batch-first self- or
cross-attention is recomputed in its forward hook from its projections, each tapped as a
Linear; the recomputation replaces the module's output when it reproduces it (checked once
per module and call signature; :mod:`._rules_attention`).

Whatever the rules cannot do exactly goes to an exact fallback, per parameter:

* a module of another type (or a subclass with its own ``forward``) that owns
  parameters (other than those it only broadcasts over the batch, which the elementwise
  rule takes: :mod:`._rules_elementwise`): ``vmap`` of that module's vjp, restricted to its parameters (and to those
  of submodules it uses without calling them, like ``nn.MultiheadAttention.out_proj``);
* a parameter used by several module calls (weight tying, a layer applied twice):
  per-example gradients of every call, summed (for an embedding this is ``[B, V, D]``);
* a parameter used outside any module call (directly in ``loss_fn``), one whose module
  was called without the batch as first dimension, or one whose module fallback does not
  add up to the batch gradient: ``vmap`` of the whole loss, restricted to it.

Gradient checkpointing (``torch.utils.checkpoint``, non-reentrant) composes: taps save
their inputs through autograd, so checkpointed inputs are recomputed rather than kept,
and the parameters seen in the forward pass are bound again while the backward pass
recomputes (``functional_call`` has returned by then; without rebinding, recomputation
would silently use the module's own, possibly stale, parameters).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable

import optree
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from opake_fx.dpsgd.clipping import _numerics as N
from opake_fx.dpsgd.clipping import _registry
from opake_fx.dpsgd.clipping import _rules_fallback as FB
from opake_fx.dpsgd.clipping._rule import BuildContext, Rule, first_input
from opake_fx.dpsgd.clipping._rules_elementwise import ELEMENTWISE, watch
from opake_fx.dpsgd.clipping._rules_embedding import LookupRule
from opake_fx.dpsgd.clipping._rules_linear import InlineLinearRule
from opake_fx.dpsgd.clipping._rules_fallback import FALLBACK
from opake_fx.dpsgd.clipping._rules_shared import SharedTensors, expand_for_site
from opake_fx.dpsgd.clipping._tied import sum_of_uses
from opake_fx.dpsgd.clipping.types import ClipBackend
from opake_fx.dpsgd.clipping._provenance import BatchLayout, probe, signature, tensor_leaves
from opake_fx.dpsgd.clipping._per_example import autograd_grad, map_examples, warn_slow_path
from opake_fx.dpsgd.clipping._engine import Backend, ClipConfig, PerExampleNorms, batch_size_of, diff_tree, vmap_backend
from opake_fx.errors import InputTypeError, InputValueError, OperationError
from opake_fx.functional import FunctionalModel
from opake_fx.pytree import NAMESPACE, tree_flatten_with_paths



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


class _NormBackend:
    """Callable backend: ``(loss_fn, args, kwargs, cfg) -> PerExampleNorms`` for one (micro)batch."""

    def __init__(self, root: nn.Module, mode: str) -> None:
        self.root, self.mode = root, mode
        # Rewritten calls (attention with dropout) whose recomputation was checked without
        # dropout against the module: (module, call signature) -> whether it matched.
        self.rewrites_checked: dict[tuple[Any, ...], bool] = {}
        # Batch layouts found by probing (see ._provenance), per call signature of the loss.
        self.layouts: dict[Any, BatchLayout] = {}
        self.rules_checked: set[tuple[Any, ...]] = set()

    def layout(self, loss_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], cfg: ClipConfig,
               batch: int) -> BatchLayout:
        """The batch layout for this call signature (probed once, then cached); refuses a model
        that mixes examples (:mod:`._independence`), and gives an empty layout (every parameter on
        the exact per-example path) while independence is undecided."""
        key = (id(loss_fn), signature(args, kwargs, cfg.batch_argnums, self.root.training))
        layout = self.layouts.get(key)
        if layout is None or (batch >= 2 and not layout.mixing_checked):
            if len(self.layouts) >= 256:  # many shapes (e.g. unpadded sequences): keep the cache bounded
                self.layouts.clear()
            layout = probe(self.root, loss_fn, args, kwargs, cfg.batch_argnums, cfg.has_aux, batch)
            self.layouts[key] = layout
        if layout.mixing is not None:
            raise InputValueError(layout.mixing)
        if batch >= 2 and not layout.mixing_checked:  # independence undecided (too few finite examples)
            return BatchLayout(exact="independence of examples could not be decided on this batch (fewer than two "
                                     "of its first examples have a finite loss); checked again at the next call")
        return layout

    def __call__(self, loss_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], cfg: ClipConfig) -> PerExampleNorms:
        batch = batch_size_of(args, cfg)
        _, flat, treedef = tree_flatten_with_paths(diff_tree(args, cfg))
        if self.mode == "auto" and batch and flat and not rules_pay_off(flat[0].device):
            return _whole_loss_norms(loss_fn, args, kwargs, cfg, treedef, [x.detach() for x in flat], batch)
        leaves = [x.detach().requires_grad_(True) for x in flat]
        run_args = with_diff(args, cfg, optree.tree_unflatten(treedef, leaves))
        layout = self.layout(loss_fn, run_args, kwargs, cfg, batch) if batch else BatchLayout()
        capture = _Capture(self.root, leaves, batch, self.mode, self.rewrites_checked, layout, self.rules_checked)
        try:
            with capture.forward():
                out = loss_fn(*run_args, **kwargs)
            losses, loss_aux = _split_loss(out, cfg, batch)
            capture.plan(_leaf_use_counts(losses, capture.index))
            # Whether a leaf's module fallback adds up to its batch gradient is decided once per
            # call signature (it depends on where the leaf is used, not on the data); until it is,
            # the batch gradient of the leaf is computed to compare with.
            verdicts = layout.adds_up
            verify = sorted(i for i in capture.fallback if i not in verdicts)
            decided = sorted(i for i in capture.fallback if i in verdicts)
            batch_grads: list[Any] = [None] * len(verify)
            if losses.requires_grad and (capture.uses or verify or capture.sites):
                with capture.backward():
                    grads = torch.autograd.grad(losses.sum(), [capture.anchor] + [leaves[i] for i in verify], allow_unused=True)
                batch_grads = list(grads[1:])
        finally:
            capture.close()
        shared_pe = capture.shared_per_example()
        rules = capture.rules
        for u in capture.uses:  # module fallbacks run now, outside the backward pass
            if u.rule.deferred and u.pending is not None:
                rules[id(u)] = _fallback_rule(u, capture.names_of(u), batch)

        # Parameters used by several calls: from the calls' rules and their cross terms where
        # there are formulas, else by summing per-example gradients.
        combined: dict[int, Any] = {}
        for i in sorted(capture.multi):
            if i in shared_pe:
                continue  # also read through shared tensors: summed per example below
            parts = [(rules[id(u)], n) for u, n in capture.uses_of(i) if rules.get(id(u)) is not None]
            rule = sum_of_uses(parts, N.compute_dtype(leaves[i].dtype)) if parts else None
            if rule is not None:
                combined[i] = rule
        per_ex: dict[int, torch.Tensor] = {}
        listed = set(verify) | set(decided) | (capture.multi - set(combined))
        for i, check in (list(zip(verify, batch_grads)) + [(i, None) for i in decided]
                         + [(i, None) for i in sorted(capture.multi) if i not in combined]
                         + [(i, None) for i in sorted(shared_pe) if i not in listed]):  # read through shared tensors
            if i in capture.whole:
                continue
            parts = [rules[id(u)].per_example(n) for u, n in capture.uses_of(i) if rules.get(id(u)) is not None]
            zero_dtype = shared_pe[i].dtype if i in shared_pe else leaves[i].dtype
            pe = sum(parts[1:], parts[0]) if parts else torch.zeros((batch, *leaves[i].shape), dtype=zero_dtype, device=leaves[i].device)
            if i in capture.fallback and i not in verdicts:
                found = _adds_up(pe, check)
                if found is not None and batch:  # (a verdict of the real layout, kept for this signature)
                    verdicts[i] = found
            if i in capture.fallback and verdicts.get(i, True) is False:
                capture.whole.add(i)  # used somewhere the module fallback cannot see
                use, name = capture.uses_of(i)[0]
                capture.why.setdefault(i, ("used somewhere its module's own call cannot see", use.module, name))
                continue
            per_ex[i] = pe + shared_pe[i].to(pe.dtype) if i in shared_pe else pe
        module_fallback = sorted(i for i in capture.fallback if i in per_ex)
        if module_fallback:
            _warn_module_fallback(self.root, self.mode, capture, module_fallback)
        if capture.whole:
            _warn_slow_path(self.root, self.mode, capture, leaves)
            per_ex.update(_whole_loss_per_example(loss_fn, args, kwargs, cfg, treedef, leaves, sorted(capture.whole)))

        single: dict[int, tuple[Any, str]] = {}
        rows = []
        for i, leaf in enumerate(leaves):
            if i in per_ex:
                rows.append(N.sq_norms_of(per_ex[i]))
                continue
            if i in combined:
                single[i] = (combined[i], "")
                rows.append(combined[i].sq_norm(""))
                continue
            uses = capture.uses_of(i)
            rule = rules.get(id(uses[0][0])) if uses else None
            if rule is not None:
                single[i] = (rule, uses[0][1])
                rows.append(rule.sq_norm(uses[0][1]))
            else:  # unused by the loss: zero gradient
                rows.append(torch.zeros(batch, dtype=torch.float64, device=leaf.device))
        sq = torch.stack(rows) if rows else torch.zeros((0, batch), dtype=torch.float64, device=leaves[0].device if leaves else None)
        shapes = [(leaf.shape, N.compute_dtype(leaf.dtype), leaf.device) for leaf in leaves]

        def weighted_sum(leaf_weights: torch.Tensor, keep: torch.Tensor | None) -> list[torch.Tensor]:
            out = []
            for i, (shape, dtype, device) in enumerate(shapes):
                if i in per_ex:
                    out.append(N.weighted_sum_of(per_ex[i], leaf_weights[i], keep))
                elif i in single:
                    rule, name = single[i]
                    out.append(rule.weighted(name, leaf_weights[i], keep))
                else:
                    out.append(torch.zeros(shape, dtype=dtype, device=device))
            return out

        return PerExampleNorms(sq, weighted_sum, losses.detach(), loss_aux)


#: Rules whose calls may read ``[k B, ...]`` rows as ``[B, k, ...]`` (row-wise layers).
_GROUPED_KINDS = frozenset({"linear", "linear_t", "norm"})


class _Use:
    """One call of one module that used differentiated parameters."""

    __slots__ = ("module", "rule", "names", "spec", "items", "positions", "axes_in", "axes_out", "n_out", "bound", "pending",
                 "block", "group")

    def __init__(self, module: nn.Module, rule: Rule, names: dict[str, int]) -> None:
        self.module, self.rule, self.names = module, rule, names  # rule: its registry entry
        self.spec: Any = None  # fallback only: structure of (args, kwargs) and its non-tensor items
        self.items: list[Any] = []
        self.positions: list[int] = []  # where the saved tensors go in ``items``
        self.axes_in: list[int | None] = []  # fallback only: each saved tensor's batch axis (None: not split)
        self.axes_out: list[int] = []  # fallback only: each output's batch axis
        self.n_out = 0
        self.bound: dict[str, torch.Tensor] | None = None  # fallback only: params and buffers it used
        self.pending: tuple[tuple[torch.Tensor, ...], tuple[Any, ...]] | None = None  # fallback: (inputs, grads)
        self.block: tuple[int, int] | None = None  # attention projections: rows of in_proj_weight they use
        self.group = 0  # k > 1: the call reads [k B, ...] rows, k consecutive rows per example


class _Tap(torch.autograd.Function):
    """Identity on a module's outputs that saves its inputs and reports ``g`` in the backward pass.

    Outputs are returned as detached aliases (no copy): later in-place ops on them are
    allowed and share the version counter, so autograd's own checks still hold.
    """

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, report: Any, n_in: int, *tensors: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.report, ctx.n_in, ctx.anchor_device = report, n_in, anchor.device
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*tensors[:n_in])
        outs = tuple(t.detach() for t in tensors[n_in:])
        return outs if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        if ctx.report is not None:
            try:
                saved = ctx.saved_tensors
            except RuntimeError as e:
                if "inplace" not in str(e):
                    raise
                raise OperationError(
                    "the input of a layer was modified in place after the layer used it (e.g. by an inplace "
                    "activation or `x += ...` on a tensor a layer reads). The fast clipping backend needs layer "
                    "inputs in the backward pass: make that operation out of place, or use clip_backend='vmap'."
                ) from e
            ctx.report(saved, grads)
        return (torch.zeros((), device=ctx.anchor_device), None, None) + (None,) * ctx.n_in + grads


class _Capture:
    """Hooks, taps and per-leaf bookkeeping for one (micro)batch."""

    def __init__(self, root: nn.Module, leaves: list[torch.Tensor], batch: int, mode: str,
                 rewrites_checked: dict[tuple[Any, ...], bool], layout: BatchLayout,
                 rules_checked: set[tuple[Any, ...]]) -> None:
        self.root, self.batch, self.mode = root, batch, mode
        self.modules = list(root.modules())  # (walked once per call: hooks, broadcasts, bindings)
        self.layout = layout  # which inputs and outputs of each call carry the batch axis
        self.children_params: dict[int, set[int]] = {}
        self.rules_checked = rules_checked  # registered rules checked against autograd (the backend's)
        self.rewrites_checked = rewrites_checked  # the backend's, kept across steps
        self.leaves = leaves
        self.index = {id(x): i for i, x in enumerate(leaves)}
        self.anchor = torch.zeros((), device=leaves[0].device if leaves else None, requires_grad=True)
        self.uses: list[_Use] = []
        self.rules: dict[int, Any] = {}
        self.whole: set[int] = set()  # leaves only the whole-loss fallback can handle
        self.why: dict[int, tuple[str, nn.Module | None, str]] = {}  # leaf -> (reason, module, param name)
        self.fallback: set[int] = set()  # leaves with a module-fallback use (checked against the batch gradient)
        self.multi: set[int] = set()  # leaves used by several calls: rules plus cross terms (or summed)
        self.by_leaf: dict[int, list[tuple[_Use, str]]] = {i: [] for i in range(len(leaves))}
        self.handles: list[Any] = []
        self.recording = False
        self.bindings: dict[nn.Module, dict[str, Any]] = {}
        self.active: dict[int, dict[str, int]] = {}
        self.broadcast: dict[int, set[str]] = {}  # id(module) -> its parameters tapped as broadcasts in this call
        self.following: SharedTensors | None = None  # follows shared tensors (._rules_shared) when the layout has any
        self.sites: list[_Site] = []  # where shared tensors met the batch, tapped
        self.shared_calls: dict[int, tuple[nn.Module, str]] = {}  # leaf -> a shared call that used it
        self.ahead: dict[int, tuple[Any, list[tuple[_Use, dict[str, int], nn.Module]]]] = {}  # see _RewriteAhead

    # -- phases --------------------------------------------------------------------------

    def forward(self) -> _Capture:
        self.handles += watch(self.modules, lambda m: _registry.lookup(m) is FALLBACK, self._on_broadcast)
        for m in self.modules:
            if m._parameters or isinstance(m, _BatchNorm):
                self.handles.append(m.register_forward_hook(self._hook, with_kwargs=True))
                rule = _registry.lookup(m)
                if rule.rewrites and "forward" not in m.__dict__:
                    self.handles.append(_RewriteAhead(self, rule, m))
        if self.layout.shared_ops and self.batch:
            self.following, seeds = self.layout.following(self.modules, self.batch, self._on_site)
            self.handles += seeds
        self.recording = True
        return self

    def __enter__(self) -> _Capture:
        if self.following is not None:
            self.following.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.recording = False
        if self.following is not None:
            self.following.__exit__(*exc)

    def backward(self) -> _Rebind:
        return _Rebind(self.bindings)

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def plan(self, counts: dict[int, int]) -> None:
        """Routes every leaf, from its hooked uses and its uses in the autograd graph."""
        for i, uses in self.by_leaf.items():
            if any(u.rule.deferred for u, _ in uses):
                self.fallback.add(i)
        for i, uses in self.by_leaf.items():
            if i in self.whole:
                continue
            if uses and i not in self.fallback and counts.get(i, 0) > len(uses):
                self.whole.add(i)  # also used outside the hooked calls (e.g. directly in loss_fn)
                self.why.setdefault(i, ("also used outside the hooked module calls", uses[0][0].module, uses[0][1]))
            elif not uses and counts.get(i, 0) > 0:
                owner = self._enclosing_fallback(i)
                if owner:
                    uses.extend(owner)
                    self.fallback.add(i)
                elif i in self.shared_calls:
                    self.whole.add(i)
                    ops = sorted(set(self.following.escaped)) if self.following is not None else []
                    self.why.setdefault(i, (
                        "its module's outputs have no batch axis and meet the batch in an op the shared-tensor rule "
                        f"does not take ({', '.join(ops) or 'outside the followed ops'}; it takes + - * /, where, the "
                        "attn_mask of scaled_dot_product_attention and repeat over the batch)", *self.shared_calls[i]))
                else:
                    self.whole.add(i)
                    self.why.setdefault(i, ("used outside any module call (e.g. directly in loss_fn)", None, ""))
        for i in self.whole:
            self.by_leaf[i] = []
        self.fallback -= self.whole
        self.multi = {i for i, uses in self.by_leaf.items() if len(uses) > 1 and i not in self.fallback}
        self.active: dict[int, dict[str, int]] = {}
        for i, uses in self.by_leaf.items():
            for u, n in uses:
                self.active.setdefault(id(u), {})[n] = i
        self.uses = [u for u in self.uses if id(u) in self.active]

    def uses_of(self, i: int) -> list[tuple[_Use, str]]:
        return self.by_leaf[i]

    def names_of(self, use: _Use) -> dict[str, int]:
        """The parameters (name -> leaf) this call's rule handles, after :meth:`plan`."""
        return self.active.get(id(use), {})

    # -- hooks ---------------------------------------------------------------------------

    def _hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        if self.following is not None:
            with self.following.paused():  # what the rules compute here is not the model's forward
                return self._hook_call(module, args, kwargs, output)
        return self._hook_call(module, args, kwargs, output)

    def _hook_call(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        if not torch.is_grad_enabled():
            return None
        if isinstance(module, _BatchNorm) and module.training:
            raise InputValueError(
                f"{type(module).__name__} in training mode normalises with statistics of the whole batch, so one "
                "example's gradient depends on the others and clipping it bounds nothing. Use GroupNorm or "
                "LayerNorm (or put the BatchNorm in eval mode) for DP training."
            )
        batched = self._verdict(module, args, kwargs, output)  # id(tensor) -> carries the batch axis first
        rule = _registry.lookup(module)
        group = self._group(rule, module, args, kwargs, output)
        if group:  # [k B, ...] rows, k per example: the rule reads them as [B, k, ...]
            batched = {**batched, **{id(t): True for t in [first_input(args, kwargs), *tensor_leaves(output)]}}
        names = self._call_names(module, self.broadcast.pop(id(module), ()))
        rule.check(module, args, kwargs, batched, self.batch, bool(names))
        if rule.rewrites:
            ahead = self.ahead.pop(id(module), None)
            if ahead is not None and ahead[0] is output:  # the forward ran the rule's recomputation
                if rule.confirms(module, args, kwargs, output, batched):
                    self._register_taps(ahead[1])
                    return None
                # else its taps stay silent and this output is routed as the module's own
            else:
                replaced = self._rewrite(rule, module, args, kwargs, output, names, batched)
                if replaced is not None:
                    return replaced  # else: the rule's own routing (the module fallback for attention)
        if not names:
            return None
        single = isinstance(output, torch.Tensor)
        outputs = [output] if single else [o for o in optree.tree_leaves(output) if isinstance(o, torch.Tensor)]
        if not rule.batched(module, args, kwargs, outputs, batched):
            if self.following is not None and self.layout.shared_call(module, tensor_leaves((args, kwargs)), outputs,
                                                                      self.batch):
                for n, i in names.items():
                    self.shared_calls.setdefault(i, (module, n))
                return None  # a shared call: its parameters are read where its outputs meet the batch
            if self.recording:
                self.whole.update(names.values())
                shapes = [tuple(t.shape) for t in optree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
                reason = self.layout.exact or (
                    f"its module was called without the batch ({self.batch} examples) as first dimension of its "
                    f"input and outputs, as found by probing (or undecidable): inputs {shapes}")
                for n, i in names.items():
                    self.why.setdefault(i, (reason, module, n))
            return None
        saved = None if rule.deferred else rule.route(module, args, kwargs, output)
        if saved is None and not rule.deferred:
            rule = FALLBACK  # this call does not fit its rule
        if rule.deferred:
            items, spec = optree.tree_flatten((args, kwargs))
            positions = [k for k, t in enumerate(items) if isinstance(t, torch.Tensor)]
            inputs = [items[k] for k in positions]
        else:
            assert saved is not None
            inputs, items, spec, positions = list(saved), [], None, []
        report = None
        if self.recording:  # (not during a checkpoint's recomputation in the backward pass)
            use = _Use(module, rule, names)
            use.n_out = len(outputs)
            use.group = group if not rule.deferred else 0
            if rule.deferred:
                use.spec, use.positions = spec, positions
                use.axes_in, use.axes_out = rule.batch_axes(module, args, kwargs, inputs, outputs, batched)
                use.items = [None if isinstance(t, torch.Tensor) else t for t in items]
                use.bound = {**dict(module.named_parameters()), **dict(module.named_buffers())}
            self.uses.append(use)
            for n, i in names.items():
                self.by_leaf[i].append((use, n))
            self._remember_bindings(module)
            report = _Report(self, use)
        tapped = _Tap.apply(self.anchor, report, len(inputs), *inputs, *outputs)
        if single:
            return tapped
        tapped = list(tapped) if isinstance(tapped, tuple) else [tapped]
        leaves, treedef = optree.tree_flatten(output)
        it = iter(tapped)
        return optree.tree_unflatten(treedef, [next(it) if isinstance(t, torch.Tensor) else t for t in leaves])

    def _on_broadcast(self, module: nn.Module, use: int, name: str, expanded: torch.Tensor,
                      call: tuple[Any, ...] | None = None) -> torch.Tensor:
        """A broadcast, table lookup or inline Linear (``call``, see ._rules_elementwise.OnUse) of
        ``module``'s own parameters in its forward: tapped for the elementwise, lookup or
        inline-Linear rule when one of them is differentiated and the probe found the batch as
        the first axis of ``expanded``; else left as it is (its module's fallback)."""
        if call is not None and call[0] == "linear":
            x, roles, d_in, d_out = call[1:]
            rule: Rule = InlineLinearRule(d_in, d_out, roles)
            params, saved = list(roles.values()), (x,)
        elif call is not None:
            rule, params, saved = LookupRule(call[2]), [name], (call[1],)
        else:
            rule, params, saved = ELEMENTWISE, [name], ()
        names = {n: self.index[id(module._parameters[n])] for n in params
                 if module._parameters.get(n) is not None and id(module._parameters[n]) in self.index}
        if not names or not torch.is_grad_enabled() or not self.layout.lookup_use(module, use, expanded, self.batch):
            return expanded
        if saved and saved[0].shape[:1] != expanded.shape[:1]:
            return expanded  # (ids and inputs carry the call's leading axes; anything else stays on the fallback)
        report = None
        if self.recording:
            u = _Use(module, rule, names)
            u.n_out = 1
            self.uses.append(u)
            for n, i in names.items():
                self.by_leaf[i].append((u, n))
            self._remember_bindings(module)
            self.broadcast.setdefault(id(module), set()).update(names)
            report = _Report(self, u)
        return _Tap.apply(self.anchor, report, len(saved), *saved, expanded)

    def _on_site(self, k: int, d: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """A shared tensor ``d`` where it meets the batch (._rules_shared): replaced by its
        detached expansion along the batch, through a tap that keeps the gradient rows."""
        if not self.recording or not torch.is_grad_enabled() or not d.requires_grad:
            return d
        e = expand_for_site(d, shape)
        if e is None:
            return d
        site = _Site(d)
        self.sites.append(site)
        return _Tap.apply(self.anchor, site, 0, e)

    def shared_per_example(self) -> dict[int, torch.Tensor]:
        """``[B, *shape]`` per-example gradients, through the sites, of every differentiated
        leaf the shared tensors are computed from (not those on the whole-loss path): one
        batched vector-Jacobian product of the shared subgraph."""
        sites = [s for s in self.sites if s.g is not None]
        if not sites:
            return {}
        reach = sorted(i for i in _leaves_reached([s.d for s in sites], self.index) if i not in self.whole)
        for i in [i for i in reach if i in self.fallback]:
            # A module fallback recomputes its call whole (sites included), so it and the sites
            # would both count the sites' paths: the exact whole-loss path takes the leaf instead.
            self.whole.add(i)
            use, name = self.uses_of(i)[0]
            self.why.setdefault(i, ("used by a module without a rule on the side of a tensor without the batch axis",
                                    use.module, name))
            reach.remove(i)
        if not reach:
            return {}
        with warnings.catch_warnings():  # vmap's note that a backward op runs in a loop (still exact)
            warnings.filterwarnings("ignore", message=".*performance drop.*")
            grads = torch.autograd.grad([s.d for s in sites], [self.leaves[i] for i in reach],
                                        [s.g.reshape(self.batch, *s.d.shape).to(s.d.dtype) for s in sites],
                                        is_grads_batched=True, allow_unused=True)
        out = {}
        for i, g in zip(reach, grads):
            leaf = self.leaves[i]
            if g is None:
                g = torch.zeros((self.batch, *leaf.shape), dtype=leaf.dtype, device=leaf.device)
            out[i] = N.as_dtype(g, N.compute_dtype(leaf.dtype))
        return out

    def _group(self, rule: Rule, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> int:
        """``k > 1`` when this call of a row-wise rule (Linear, Conv1D, LayerNorm/GroupNorm/RMSNorm)
        reads ``[k B, ...]`` input and output rows, ``k`` consecutive rows per example (OPT's
        decoder layers flatten the batch with the positions): the layout says so by provenance and
        the independence check proved the grouping; else 0."""
        if rule.kind not in _GROUPED_KINDS or not self.layout.grouped or not self.batch:
            return 0
        a, outputs = first_input(args, kwargs), tensor_leaves(output)
        if not isinstance(a, torch.Tensor) or a.dim() < 2 or len(outputs) != 1:
            return 0
        rows = self.layout.rows(module, tensor_leaves((args, kwargs)), outputs, self.batch)
        if rows is None:
            return 0
        k_in = dict(zip((id(t) for t in tensor_leaves((args, kwargs))), rows[0])).get(id(a), 0)
        k = rows[1][0]
        return k if k > 1 and k_in == k and a.shape[0] == k * self.batch == outputs[0].shape[0] else 0

    def _held_by_children(self, module: nn.Module) -> set[int]:
        """Ids of the parameters a submodule also holds (``decoder.bias = self.bias`` in BERT's
        LM head): the submodule's call uses them, so the owner's call must not count them
        again. A direct use by the owner is still seen by the graph-use count (:meth:`plan`)."""
        found = self.children_params.get(id(module))
        if found is None:
            found = {id(p) for child in module.children() for m in child.modules() for p in m._parameters.values()
                     if p is not None}
            self.children_params[id(module)] = found
        return found

    def _verdict(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> dict[int, bool]:
        """Which tensors of this call carry the batch axis first (by provenance: ._provenance);
        empty when the layout cannot decide the call."""
        inputs, outputs = tensor_leaves((args, kwargs)), tensor_leaves(output)
        found = self.layout.lookup(module, inputs, outputs, self.batch)
        if found is None:
            return {}
        return {id(t): v for t, v in zip(inputs + outputs, found[0] + found[1])}

    def _call_names(self, module: nn.Module, broadcast: Any) -> dict[str, int]:
        """The differentiated parameters this call of ``module`` routes: name -> leaf (a tied
        child parameter is the child call's; ``broadcast``: taken by the elementwise rule)."""
        held = self._held_by_children(module)
        names = {}
        for n, p in module._parameters.items():
            i = self.index.get(id(p))
            if i is not None and id(p) not in held and n not in broadcast:
                names[n] = i
        return names

    def _tapper(self, taps: list[tuple[_Use, dict[str, int], nn.Module]]) -> Callable[..., torch.Tensor]:
        """The ``tap(entry, owner, names, a, y, block)`` a rewriting rule wraps each sub-call's
        output with; the taps are collected in ``taps`` (registered by :meth:`_register_taps`,
        otherwise none reports)."""

        def tap(entry: Rule, owner: nn.Module, used: dict[str, int], a: torch.Tensor, y: torch.Tensor,
                block: tuple[int, int] | None = None) -> torch.Tensor:
            if not used:
                return y
            use = _Use(owner, entry, used)
            use.block = block
            taps.append((use, used, owner))
            return _Tap.apply(self.anchor, _Report(self, use) if self.recording else None, 1, a, y)

        return tap

    def _register_taps(self, taps: list[tuple[_Use, dict[str, int], nn.Module]]) -> None:
        if self.recording:
            for use, used, owner in taps:
                use.n_out = 1
                self.uses.append(use)
                for n, i in used.items():
                    self.by_leaf[i].append((use, n))
                self._remember_bindings(owner)

    def _rewrite(self, rule: Rule, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any,
                 names: dict[str, int], batched: dict[int, bool]) -> Any:
        """The rule's replacement output (attention from tapped projections), or None. The
        taps are registered only when the rule replaces the output."""
        taps: list[tuple[_Use, dict[str, int], nn.Module]] = []
        out = rule.rewrite(module, args, kwargs, output, names, batched, self._tapper(taps), self._params_of,
                           self.rewrites_checked)
        if out is None:
            return None
        self._register_taps(taps)
        return out

    def rewrite_ahead(self, rule: Rule, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The rule's recomputation of a call in place of the module's forward (so the module's
        own computation is not run and then thrown away), where the rule has checked this call
        signature before; None: the module runs. The forward hook registers the taps once the
        call's layout confirms the rule (:meth:`Rule.confirms`)."""
        if not (self.recording and torch.is_grad_enabled()):
            return None
        taps: list[tuple[_Use, dict[str, int], nn.Module]] = []
        names = self._call_names(module, self.broadcast.get(id(module), ()))
        with self.following.paused() if self.following is not None else contextlib.nullcontext():
            out = rule.rewrite_ahead(module, args, kwargs, names, self._tapper(taps), self._params_of,
                                     self.rewrites_checked)
        if out is not None:
            self.ahead[id(module)] = (out, taps)
        return out

    def _params_of(self, module: nn.Module) -> dict[str, int]:
        """The differentiated parameters ``module`` holds directly: name -> leaf."""
        return {n: self.index[id(p)] for n, p in module._parameters.items() if p is not None and id(p) in self.index}

    def _remember_bindings(self, module: nn.Module) -> None:
        # The tensors functional_call bound to every module now, for checkpoint recomputation.
        if module not in self.bindings:
            for m in self.modules:
                if m._parameters and m not in self.bindings:
                    self.bindings[m] = dict(m._parameters)

    def _enclosing_fallback(self, i: int) -> list[tuple[_Use, str]]:
        # The innermost module-fallback call whose subtree holds the leaf (all calls of that module).
        target = id(self.leaves[i])
        best: list[tuple[_Use, str]] = []
        for u in self.uses:
            if not u.rule.deferred or u.bound is None:
                continue
            name = next((n for n, t in u.bound.items() if id(t) == target), None)
            if name is None:
                continue
            if not best or len(u.bound) < len(best[0][0].bound or ()):
                best = [(u, name)]
            elif u.module is best[0][0].module:
                best.append((u, name))
        return best


class _RewriteAhead:
    """Runs a rewriting rule's recomputation in place of a module's ``forward`` while the
    capture is open (an instance attribute over the class's method); ``remove()`` restores it."""

    def __init__(self, capture: _Capture, rule: Rule, module: nn.Module) -> None:
        self.module = module
        original = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            out = capture.rewrite_ahead(rule, module, args, kwargs)
            return original(*args, **kwargs) if out is None else out

        module.forward = forward  # type: ignore[method-assign]

    def remove(self) -> None:
        self.module.__dict__.pop("forward", None)


class _Report:
    """What a tap calls in the backward pass: build the layer's rule while ``a`` and ``g`` are at hand."""

    __slots__ = ("capture", "use")

    def __init__(self, capture: _Capture, use: _Use) -> None:
        self.capture, self.use = capture, use

    def __call__(self, saved: tuple[torch.Tensor, ...], grads: tuple[Any, ...]) -> None:
        cap, use = self.capture, self.use
        names = cap.names_of(use)
        if not names:
            return
        if use.rule.deferred:
            use.pending = (tuple(t.detach() for t in saved), grads)
            return
        g = grads[0]
        if g is None:  # the output does not reach the loss: zero gradient
            cap.rules[id(use)] = None
            return
        if use.group:  # k consecutive rows per example: [B, k, ...]
            b = cap.batch
            saved = tuple(t.reshape(b, use.group, *t.shape[1:]) for t in saved)
            g = g.reshape(b, use.group, *g.shape[1:])
        ctx = BuildContext(mode=cap.mode, dtype=cap.leaves[next(iter(names.values()))].dtype,
                           shared=any(i in cap.multi for i in names.values()),  # a tied table: cross terms
                           checked=cap.rules_checked, block=use.block)
        cap.rules[id(use)] = use.rule.build(use.module, tuple(t.detach() for t in saved), g, names, ctx)


class _Site:
    """One place a shared tensor ``d`` met the batch; the tap reports its gradient rows ``g``."""

    __slots__ = ("d", "g")

    def __init__(self, d: torch.Tensor) -> None:
        self.d, self.g = d, None

    def __call__(self, saved: tuple[torch.Tensor, ...], grads: tuple[Any, ...]) -> None:
        self.g = None if grads[0] is None else grads[0].detach()


class _Rebind:
    """Binds the forward pass's parameters to their modules again (for checkpoint recomputation)."""

    def __init__(self, bindings: dict[nn.Module, dict[str, Any]]) -> None:
        self.bindings = bindings
        self.saved: list[tuple[nn.Module, dict[str, Any]]] = []

    def __enter__(self) -> None:
        for m, params in self.bindings.items():
            self.saved.append((m, dict(m._parameters)))
            m._parameters.update(params)

    def __exit__(self, *exc: Any) -> None:
        for m, params in self.saved:
            m._parameters.update(params)
        self.saved = []


def _fallback_rule(use: _Use, names: dict[str, int], batch: int) -> Any:
    assert use.pending is not None
    saved, grads = use.pending
    use.pending = None
    items = list(use.items)
    for k, t in zip(use.positions, saved):
        items[k] = t
    args, kwargs = optree.tree_unflatten(use.spec, items)
    split = [(k, ax) for k, ax in zip(use.positions, use.axes_in) if ax is not None]
    return FB.module_per_example(use.module, use.bound or {}, list(names), tuple(args), kwargs, list(grads), batch,
                                [k for k, _ in split], [ax for _, ax in split], use.axes_out)


def _leaf_use_counts(losses: torch.Tensor, index: dict[int, int]) -> dict[int, int]:
    """How many autograd edges lead into each differentiated leaf (its uses in the graph)."""
    return leaf_edges([losses], index)


def _leaves_reached(tensors: list[torch.Tensor], index: dict[int, int]) -> set[int]:
    """The differentiated leaves the autograd graphs of ``tensors`` lead into."""
    return {index[id(t)] for t in tensors if id(t) in index} | set(leaf_edges(tensors, index))


def leaf_edges(tensors: list[torch.Tensor], index: dict[int, int]) -> dict[int, int]:
    """For each differentiated leaf (``index``: id -> leaf), the autograd edges into it from
    the graphs of ``tensors`` (one walk over their nodes)."""
    counts: dict[int, int] = {}
    stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
    seen = set(stack)
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


def _adds_up(pe: torch.Tensor, batch_grad: torch.Tensor | None) -> bool | None:
    """Whether per-example gradients sum to the batch gradient (a fallback missed no use);
    None when it cannot be told on this batch (a non-finite batch gradient). Host
    synchronisations: called once per call signature and leaf (:meth:`_NormBackend.__call__`)."""
    total = pe.sum(dim=0)
    if batch_grad is None:
        return not bool(total.abs().max() > 0) if total.numel() else True
    if not bool(torch.isfinite(batch_grad).all()):
        return None  # a non-finite example: nothing to compare (its weight will be 0); decided later
    ref = batch_grad.to(total.dtype)
    diff = torch.linalg.vector_norm(total - ref)
    return bool(diff <= 1e-4 * (torch.linalg.vector_norm(ref) + torch.linalg.vector_norm(total)) + 1e-30)


def _warn_module_fallback(root: nn.Module, mode: str, capture: _Capture, idx: list[int]) -> None:
    """Says which parameters took the per-module fallback (no layer rule for their module)."""
    paths = {id(m): p for p, m in root.named_modules()}
    parts = []
    for i in idx:
        use, name = capture.uses_of(i)[0]
        parts.append(f"{paths.get(id(use.module), '?')}.{name} ({type(use.module).__name__})".lstrip("."))
    warn_slow_path(
        f"clip_backend={mode!r}: {len(parts)} parameter(s) take the per-module fallback (per-example gradients of "
        f"their module's call, one example at a time under vmap; exact, but slower than a layer rule and they "
        f"materialise [B, *shape]): " + ", ".join(parts) + ". Their modules have no layer rule, or use them outside "
        "a submodule call; a rule for the module type keeps them fast."
    )


def _warn_slow_path(root: nn.Module, mode: str, capture: _Capture, leaves: list[torch.Tensor]) -> None:
    """Says (once per message) which parameters took the whole-loss fallback, and why."""
    paths = {id(m): p for p, m in root.named_modules()}
    parts = []
    for i in sorted(capture.whole):
        reason, module, name = capture.why.get(i, ("no layer rule could take it", None, ""))
        where = f"{paths.get(id(module), type(module).__name__)}.{name}".lstrip(".") if module is not None else (
            f"leaf {i} (shape {tuple(leaves[i].shape)})")
        parts.append(f"{where}: {reason}")
    warn_slow_path(
        f"clip_backend={mode!r}: {len(parts)} parameter(s) take the whole-loss fallback (vmap of the loss over single "
        f"examples; exact, but it runs the model once more per example): " + "; ".join(parts) + ". To keep them on the "
        "layer rules, give every layer input the batch as first dimension (for position embeddings: "
        "position_ids=torch.arange(T).expand(B, T)) and use parameters only inside module calls."
    )


def rules_pay_off(device: torch.device) -> bool:
    """Whether ``clip_backend="auto"`` takes the layer rules on ``device`` (else the exact
    whole-loss ``vmap`` path for every parameter): decided by the device type alone, so once
    per call signature (the signature holds each tensor's device type).

    On CUDA the rules are slower than ``vmap`` today: GPT-2 small (batch 16 x 256 tokens,
    float32, H200) took 1,445 ms per step with the rules against 210 ms with ``vmap`` (175 ms
    non-private): thousands of small kernels per step. Until the rules beat ``vmap`` there,
    ``"auto"`` does not pick them on CUDA; ``"ghost"`` still forces them.
    """
    return device.type != "cuda"


# In a compiled step, where its traced path (._traced) does not pay, ``"auto"`` traces the
# whole-loss ``vmap`` path (inductor fuses the per-example gradients, norms and weighted sum)
# where that measured faster than running the layer rules eagerly; both bound the memory of
# their per-example gradients by the element limit below. Measured on 2 CPU
# threads (benchmarks/clipping.py, one run; traced vs eager rules, ms): mlp-64 0.72 vs 1.06,
# cnn-64 13.8 vs 14.2, lm-16 41.2 vs 53.2 (small batches: the rules' fixed per-step cost
# dominates and the graph removes it); mlp-1024 4.67 vs 1.47, cnn-256 52.6 vs 45.8 (large
# batches: per-example gradients cost more than the rules); embedding bag at batch 256 (328M
# per-example gradient elements) 843 vs 13 ms.
TRACED_WHOLE_LOSS_MAX_ELEMENTS = 2**25
TRACED_WHOLE_LOSS_MAX_BATCH = 64


def traced_whole_loss_pays(args: tuple[Any, ...], cfg: ClipConfig) -> bool:
    """Whether ``clip_backend="auto"`` inside a compiled step takes the traced whole-loss path
    (asked where the traced path of :mod:`._traced` does not pay).

    Decided from static facts only (batch size, the differentiated tensors' sizes and device),
    so dynamo guards on it and never re-decides within a shape: ``batch * sum(numel)``
    per-example gradient elements at most :data:`TRACED_WHOLE_LOSS_MAX_ELEMENTS`, and a batch
    of at most :data:`TRACED_WHOLE_LOSS_MAX_BATCH` examples (where the rules do not pay off on
    the device, as on CUDA, any batch). Both paths are exact and certified; this picks the
    faster one by the measurements above.
    """
    batch = batch_size_of(args, cfg)
    flat = optree.tree_leaves(diff_tree(args, cfg), namespace=NAMESPACE)
    if not batch or not flat or batch * sum(x.numel() for x in flat) > TRACED_WHOLE_LOSS_MAX_ELEMENTS:
        return False
    return batch <= TRACED_WHOLE_LOSS_MAX_BATCH or not rules_pay_off(flat[0].device)


def whole_loss_backend(loss_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                       cfg: ClipConfig) -> PerExampleNorms:
    """The norm backend of ``"auto"`` with every parameter on the whole-loss path: no hooks,
    probe or taps, so ``torch.compile`` traces it (the compiled step's ``"auto"`` path)."""
    batch = batch_size_of(args, cfg)
    _, flat, treedef = tree_flatten_with_paths(diff_tree(args, cfg))
    return _whole_loss_norms(loss_fn, args, kwargs, cfg, treedef, [x.detach() for x in flat], batch)


def _whole_loss_norms(loss_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], cfg: ClipConfig,
                      treedef: Any, leaves: list[torch.Tensor], batch: int) -> PerExampleNorms:
    """Every parameter by the whole-loss path (``vmap`` of the batched loss over single examples):
    certified norms of the per-example gradients and their weighted sum. Each example's loss is
    evaluated alone, so no probe or independence check is needed; the losses (and the aux, with
    ``has_aux``: each example's, stacked) come from the same calls."""
    idx = list(range(len(leaves)))
    grads, (losses, aux) = _whole_loss_per_example(loss_fn, args, kwargs, cfg, treedef, leaves, idx, with_outputs=True)
    per_ex = [grads[i] for i in idx]
    sq = torch.stack([N.sq_norms_of(pe) for pe in per_ex]) if per_ex else torch.zeros((0, batch), dtype=torch.float64)

    def weighted_sum(leaf_weights: torch.Tensor, keep: torch.Tensor | None) -> list[torch.Tensor]:
        return [N.weighted_sum_of(pe, leaf_weights[i], keep) for i, pe in enumerate(per_ex)]

    return PerExampleNorms(sq, weighted_sum, losses, aux if cfg.has_aux else None)


def _whole_loss_per_example(loss_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], cfg: ClipConfig,
                            treedef: Any, leaves: list[torch.Tensor], idx: list[int],
                            with_outputs: bool = False) -> Any:
    """Per-example gradients of the leaves ``idx`` by ``vmap(grad)`` of the loss on one example;
    with ``with_outputs``, also ``(losses [B], aux)``: each example's loss and aux (the aux's
    tensors without the example's axis of 1), stacked."""
    base = [x.detach() for x in leaves]

    def one(sub: tuple[torch.Tensor, ...], *a: Any) -> tuple[torch.Tensor, Any]:
        loss, aux = example_outputs(loss_fn(*example_args(a, cfg, treedef, base, idx, sub), **kwargs), cfg,
                                    with_aux=with_outputs)
        return loss, ((loss.detach(),) if aux is None else (loss.detach(), aux))  # (vmap returns no None)

    in_dims = tuple(0 if i in cfg.batch_argnums else None for i in range(len(args)))
    grads, outputs = map_examples(torch.func.grad(one, has_aux=True), (None, *in_dims), (tuple(base[k] for k in idx), *args),
                                  batch_size_of(args, cfg), what="the whole-loss fallback",
                                  loop_fn=autograd_grad(one, has_aux=True))
    found = dict(zip(idx, grads))
    return (found, (outputs[0], outputs[1] if len(outputs) > 1 else None)) if with_outputs else found


def example_args(a: tuple[Any, ...], cfg: ClipConfig, treedef: Any, base: list[torch.Tensor], idx: Any,
                 sub: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
    """The loss's arguments for one example ``a`` (inputs without the batch axis, as ``vmap``
    passes them): the differentiated tree of ``base`` leaves with leaves ``idx`` replaced by
    ``sub``, and the batched arguments given back a batch axis of one."""
    ls = list(base)
    for k, t in zip(idx, sub):
        ls[k] = t
    full = with_diff(a, cfg, optree.tree_unflatten(treedef, ls))
    return tuple(optree.tree_map(lambda t: t.unsqueeze(0), x, namespace=NAMESPACE) if i in cfg.batch_argnums else x
                 for i, x in enumerate(full))


def example_outputs(out: Any, cfg: ClipConfig, with_aux: bool = True) -> tuple[torch.Tensor, Any]:
    """One example's loss (a scalar) and, with ``has_aux`` and ``with_aux``, its aux (tensors
    without the example's axis of one); ``None`` for the aux otherwise."""
    loss = (out[0] if cfg.has_aux else out).reshape(())
    if not (with_aux and cfg.has_aux):
        return loss, None
    return loss, optree.tree_map(lambda t: t.detach()[0] if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == 1
                                 else t, out[1], namespace=NAMESPACE)


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


def with_diff(args: tuple[Any, ...], cfg: ClipConfig, tree: Any) -> tuple[Any, ...]:
    out = list(args)
    if cfg.single_argnum:
        out[cfg.argnums[0]] = tree
    else:
        for a, sub in zip(cfg.argnums, tree):
            out[a] = sub
    return tuple(out)
