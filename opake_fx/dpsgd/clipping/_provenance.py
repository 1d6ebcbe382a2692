"""Which module inputs and outputs carry the batch axis, decided by provenance, not by size.

The fast backends read each layer's input and output gradient row by row, one row per
example. A tensor whose first dimension merely *equals* the batch size is not batched:
T5's relative-attention buckets are ``[T, T]``, and with Poisson sampling the batch size
eventually equals ``T``. So the batch axis is found by how tensors depend on the batch:
the loss is run (without gradients, in eval mode) on sub-batches of 2 and of 3
examples, every call of a module that owns parameters is recorded, and a tensor's first
axis is batched if it is 2 in the first run and 3 in the second. A constant dimension
cannot be both. The verdicts are kept per module as shape templates (batched first axis
free, every other dimension fixed) and cached per call signature of the loss; a call in
the real batch is decided by the template it matches. A call that matches no template,
or templates that disagree, is undecidable: its parameters take the exact whole-loss
fallback (with a :class:`~opake_fx.errors.SlowPathWarning`), never a guess.

The same runs record the broadcasts of parameters that modules without a rule make in
their own ``forward`` (:mod:`._rules_elementwise`), numbered within each call, so the
elementwise rule takes a broadcast only when its first axis is proven to be the batch.

Whether the model mixes examples is not decided here by comparing losses: once the
layout is known, :mod:`._independence` checks it exactly (the gradient structure of the
backward pass and each example's loss run alone), on the tensors whose rows the rules read.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import optree
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from opake_fx.dpsgd.clipping import _registry
from opake_fx.dpsgd.clipping._independence import UNDECIDED, Uncheckable, check_independence, private_random_streams
from opake_fx.dpsgd.clipping._rules_elementwise import watch
from opake_fx.dpsgd.clipping._rules_fallback import FALLBACK
from opake_fx.dpsgd.clipping._rules_shared import OnSite, OpRecord, SharedTensors, number_reached
from opake_fx.pytree import NAMESPACE

Shape = tuple[int, ...]
# One entry per tensor leaf: (k, shape). k = 1: the first axis is the batch (shape: the other
# axes); k > 1: the first axis is k per example, e.g. a [B * heads, T, S] mask (not the batch
# axis, but it matches only at k * B); k = 0: no batch dependence (shape: the whole shape);
# k = -1: depends on the batch some other way (flat token ids [N], offsets [B + 1]): not batched,
# and it matches any shape (so another template that also fits with another verdict makes the
# call undecidable, never a guess).
Template = tuple[tuple[int, Shape], ...]

# Sub-batch sizes of the two probe runs.
_SIZES = (2, 3)


@dataclass
class _Call:
    module: nn.Module
    inputs: list[Shape]  # tensor leaves of (args, kwargs), in flattening order
    outputs: list[Shape]
    use: int | None = None  # a broadcast of the module's own parameter (._rules_elementwise): its number


@dataclass
class BatchLayout:
    """The probe's verdicts for one call signature of the loss."""

    templates: dict[Any, list[tuple[Template, Template, tuple[bool, ...], tuple[bool, ...]]]] = field(default_factory=dict)
    mixing: str | None = None  # an error message, when the model mixes examples
    mixing_checked: bool = False  # False: not yet decided (the exact path runs until it is)
    exact: str | None = None  # why every call of this signature takes the exact path (no templates then)
    # leaf index -> whether its module fallback adds up to its batch gradient (._ghost; decided
    # once per signature, on the first batch where it can be told)
    adds_up: dict[int, bool] = field(default_factory=dict)
    # The ops that read shared tensors (._rules_shared), in the order a following run numbers
    # them: (func, template of its result shapes)
    shared_ops: list[tuple[Any, Template]] = field(default_factory=list)
    # Whether calls on [k B, ...] rows (a batch flattened with the positions, k > 1) are read as
    # k consecutive rows per example: proven by the independence check, which watches those
    # rows in groups; switched off (those calls take the exact path) when it cannot pass so.
    grouped: bool = True

    def shared_call(self, module: nn.Module, inputs: list[torch.Tensor], outputs: list[torch.Tensor], batch: int) -> bool:
        """Whether this call's outputs have no batch axis at all (a constant shape at every
        batch size, by provenance): a shared call (._rules_shared)."""
        return bool(outputs) and bool(self._decide(module, inputs, outputs, batch,
                                                   lambda tin, tout, vin, vout: all(k == 0 for k, _ in tout)))

    def shared_verdict(self, k: int, func: Any, shapes: list[Shape], batch: int) -> int | None:
        """For the ``k``-th op that reads a shared tensor: the rows per example of its single
        result (1: the batch first; more only while :attr:`grouped`), 0 when no result has a
        batch axis, None otherwise (or when the op is not the one the probe recorded)."""
        if k >= len(self.shared_ops):
            return None
        func_k, template = self.shared_ops[k]
        if func_k != func or not _matches_shapes(template, shapes, batch):
            return None
        rows = result_rows(template)
        return None if rows is not None and rows > 1 and not self.grouped else rows

    def following(self, modules: list[nn.Module], batch: int, on_site: OnSite | None) -> tuple[SharedTensors, list[Any]]:
        """A :class:`SharedTensors` mode that follows this layout's shared tensors in a batch of
        ``batch``, and the hooks (to remove) that seed it with the outputs of shared calls."""
        mode = SharedTensors(lambda k, func, shapes: self.shared_verdict(k, func, shapes, batch), on_site)
        return mode, _seed_hooks(modules, mode, lambda m, i, o: self.shared_call(m, i, o, batch))

    def lookup(self, module: nn.Module, inputs: list[torch.Tensor], outputs: list[torch.Tensor],
               batch: int) -> tuple[tuple[bool, ...], tuple[bool, ...]] | None:
        """``(inputs batched, outputs batched)`` for a call in a batch of ``batch``, or None if undecidable."""
        return self._decide(module, inputs, outputs, batch, lambda tin, tout, vin, vout: (vin, vout))

    def _decide(self, module: nn.Module, inputs: list[torch.Tensor], outputs: list[torch.Tensor], batch: int,
                verdict: Callable[[Template, Template, tuple[bool, ...], tuple[bool, ...]], Any]) -> Any:
        """``verdict`` of the templates of ``module`` this call matches, or None when none matches
        or two give different verdicts (no guess)."""
        found = None
        for tin, tout, vin, vout in self.templates.get(id(module), []):
            if _matches(tin, inputs, batch) and _matches(tout, outputs, batch):
                v = verdict(tin, tout, vin, vout)
                if found is not None and found != v:
                    return None  # two templates fit with different verdicts: no guess
                found = v
        return found

    def rows_per_example(self, module: nn.Module, inputs: list[torch.Tensor], outputs: list[torch.Tensor],
                         batch: int) -> list[int]:
        """For each output the rules read: 1 (batch first), ``k`` for ``k`` consecutive rows per
        example (``[k B, ...]``, read in groups while :attr:`grouped`), else 0."""
        if self.grouped:
            found = self.rows(module, inputs, outputs, batch)
            return list(found[1]) if found is not None else [0] * len(outputs)
        found_v = self.lookup(module, inputs, outputs, batch)
        return [int(v) for v in found_v[1]] if found_v is not None else [0] * len(outputs)

    def rows(self, module: nn.Module, inputs: list[torch.Tensor], outputs: list[torch.Tensor],
             batch: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """Rows per example of each input and output (``k`` of ``[k B, ...]``; 0 when the tensor
        has no batch axis first), or None if undecidable."""
        return self._decide(module, inputs, outputs, batch, lambda tin, tout, vin, vout: (
            tuple(max(k, 0) for k, _ in tin), tuple(max(k, 0) for k, _ in tout)))

    def broadcast_rows(self, module: nn.Module, use: int, expanded: torch.Tensor, batch: int) -> int:
        """1 when the elementwise rule reads the broadcast ``use`` as batched, else 0."""
        return int(self.lookup_use(module, use, expanded, batch))

    def lookup_use(self, module: nn.Module, use: int, expanded: torch.Tensor, batch: int) -> bool:
        """Whether the broadcast ``use`` (numbered within a call of ``module``) gave a tensor whose
        first axis is the batch (False where undecidable)."""
        found = None
        for _, tout, _, vout in self.templates.get((id(module), use), []):
            if _matches(tout, [expanded], batch):
                if found is not None and found != vout:
                    return False
                found = vout
        return bool(found is not None and found[0])


def probe(root: nn.Module, loss_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
          batch_argnums: tuple[int, ...], has_aux: bool, batch: int) -> BatchLayout:
    """Runs the loss on sub-batches of 2 and 3 examples and derives the batch layout.

    Returns an empty layout (every call undecidable) when the loss cannot run on the
    sub-batches or the two runs call different modules.
    """
    with private_random_streams():  # a loss that draws from torch's generators leaves the caller's stream as it was
        return _probe(root, loss_fn, args, kwargs, batch_argnums, has_aux, batch)


def _probe(root: nn.Module, loss_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
           batch_argnums: tuple[int, ...], has_aux: bool, batch: int) -> BatchLayout:
    runs: list[list[_Call]] = []
    with _in_eval(root):  # deterministic: dropout off (the shapes do not depend on it)
        for n in _SIZES:
            sub = _sub_batch(args, batch_argnums, n, batch)
            calls: list[_Call] = []
            modules = list(root.modules())
            handles = [m.register_forward_hook(_recorder(calls), with_kwargs=True)
                       for m in modules if m._parameters or isinstance(m, _BatchNorm)]
            handles += watch(modules, _broadcast_candidate, _use_recorder(calls))
            try:
                with torch.no_grad():
                    out = loss_fn(*sub, **kwargs)
            except Exception:  # noqa: BLE001 - a loss that cannot run on a sub-batch: undecidable
                return BatchLayout()
            finally:
                for h in handles:
                    h.remove()
            runs.append(calls)
    small, large = runs
    if len(small) != len(large) or any(a.module is not b.module or len(a.inputs) != len(b.inputs)
                                       or len(a.outputs) != len(b.outputs) for a, b in zip(small, large)):
        return BatchLayout()
    layout = BatchLayout()
    for a, b in zip(small, large):
        if a.use != b.use:
            return BatchLayout()
        tin, vin = _template(a.inputs, b.inputs)
        tout, vout = _template(a.outputs, b.outputs)
        entry = (tin, tout, vin, vout)
        key: Any = id(a.module) if a.use is None else (id(a.module), a.use)
        if entry not in layout.templates.setdefault(key, []):
            layout.templates[key].append(entry)
    if any(all(k == 0 for k, _ in tout) and tout and m._parameters
           for m in root.modules() for _, tout, _, _ in layout.templates.get(id(m), [])):
        layout.shared_ops = _probe_shared(root, loss_fn, args, kwargs, batch_argnums, batch, layout)
    if batch >= 2:  # with one distinct example nothing can mix
        found = check_independence(root, loss_fn, args, kwargs, batch_argnums, has_aux, batch, layout.rows_per_example,
                                   _broadcast_candidate, layout.broadcast_rows,
                                   layout.following if layout.shared_ops else None)
        if found not in (None, UNDECIDED) and not isinstance(found, Uncheckable) and _has_groups(root, layout):
            # Rows grouped per example (batch-major) is an assumption the check tests; a model that
            # flattens its batch otherwise (position-major) fails it without mixing examples: check
            # again with those calls off the rules (the exact path), and refuse only if it still fails.
            layout.grouped = False
            found = check_independence(root, loss_fn, args, kwargs, batch_argnums, has_aux, batch,
                                       layout.rows_per_example, _broadcast_candidate, layout.broadcast_rows,
                                       layout.following if layout.shared_ops else None)
        if isinstance(found, Uncheckable):
            return BatchLayout(mixing_checked=True, exact=f"independence of examples could not be checked: {found}")
        if found != UNDECIDED:  # else checked again at the next call (the exact path runs meanwhile)
            layout.mixing_checked, layout.mixing = True, found
    return layout


def _has_groups(root: nn.Module, layout: BatchLayout) -> bool:
    """Whether some call of a module with parameters, or some op on a shared tensor (a repeat over
    the batch), has a result of ``k > 1`` rows per example."""
    return (any(k > 1 for m in root.modules() for _, tout, _, _ in layout.templates.get(id(m), []) for k, _ in tout)
            or any(k > 1 for _, template in layout.shared_ops for k, _ in template))


def _probe_shared(root: nn.Module, loss_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                  batch_argnums: tuple[int, ...], batch: int, layout: BatchLayout) -> list[tuple[Any, Template]]:
    """Runs the sub-batches again, recording every op that reads a shared call's output (or
    what follows from it), and keeps the ops a following run reaches, with their templates;
    empty when the runs disagree or fail (the parameters then keep the exact fallback)."""
    runs: list[list[OpRecord]] = []
    with _in_eval(root):
        for n in _SIZES:
            sub = _sub_batch(args, batch_argnums, n, batch)
            mode = SharedTensors()
            handles = _seed_hooks(list(root.modules()), mode,
                                  lambda m, i, o, n=n: layout.shared_call(m, i, o, n))
            try:
                with torch.no_grad(), mode:
                    loss_fn(*sub, **kwargs)
            except Exception:  # noqa: BLE001 - as in _probe: undecidable
                return []
            finally:
                for h in handles:
                    h.remove()
            runs.append(mode.records)
    reached = number_reached(runs[0], runs[1], lambda a, b: result_rows(_template(a.outputs, b.outputs)[0]))
    if reached is None:
        return []
    return [(func, _template(a.outputs, b.outputs)[0]) for func, a, b in reached]


def result_rows(template: Template) -> int | None:
    """Rows per example of an op's result from its template: 0 when no result has a batch
    axis, ``k`` for a single result of ``k`` rows per example (1: the batch first), None otherwise."""
    if all(k == 0 for k, _ in template):
        return 0
    return template[0][0] if len(template) == 1 and template[0][0] >= 1 else None


@contextmanager
def _in_eval(root: nn.Module) -> Iterator[None]:
    """``root`` in eval mode for the body, every module's mode restored after."""
    modes = [(m, m.training) for m in root.modules()]
    try:
        root.eval()
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def _sub_batch(args: tuple[Any, ...], batch_argnums: tuple[int, ...], n: int, batch: int) -> tuple[Any, ...]:
    """The arguments with their batched ones cut to ``n`` examples (repeating them when ``batch < n``)."""
    index = torch.arange(n) % batch
    return tuple(optree.tree_map(lambda t: t[index.to(t.device)], a, namespace=NAMESPACE) if i in batch_argnums else a
                 for i, a in enumerate(args))


def _seed_hooks(modules: list[nn.Module], mode: SharedTensors,
                shared: Callable[[nn.Module, list[torch.Tensor], list[torch.Tensor]], bool]) -> list[Any]:
    """Forward hooks on the modules that own parameters: a shared call's outputs seed ``mode``."""
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        with mode.paused():
            outputs = tensor_leaves(output)
            if shared(module, tensor_leaves((args, kwargs)), outputs):
                mode.seed(outputs)

    return [m.register_forward_hook(hook, with_kwargs=True) for m in modules if m._parameters]


def signature(args: tuple[Any, ...], kwargs: dict[str, Any], batch_argnums: tuple[int, ...], training: bool) -> Any:
    """A hashable key: what the layout may depend on, with the batch size left out."""

    def leaf(x: Any, batched: bool) -> Any:
        if isinstance(x, torch.Tensor):
            return (tuple(x.shape[1:]) if batched else tuple(x.shape), x.dtype, x.device.type, batched)
        if x is None or isinstance(x, (bool, int, float, str)):
            return (type(x).__name__, x)
        return (type(x).__name__, id(x))

    parts = []
    for i, a in enumerate(args):
        leaves, spec = optree.tree_flatten(a, namespace=NAMESPACE)
        parts.append((_hashable(spec), tuple(leaf(x, i in batch_argnums) for x in leaves)))
    leaves, spec = optree.tree_flatten(kwargs, namespace=NAMESPACE)
    parts.append((_hashable(spec), tuple(leaf(x, False) for x in leaves)))
    return (training, tuple(parts))


def _hashable(spec: Any) -> Any:
    """The tree structure itself as a key (hashing it is ~10x cheaper than formatting it), or
    its text when a node's metadata cannot be hashed."""
    try:
        hash(spec)
    except TypeError:
        return str(spec)
    return spec


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """The tensor leaves of ``tree`` in flattening order (how calls are recorded)."""
    return [t for t in optree.tree_leaves(tree, namespace=NAMESPACE) if isinstance(t, torch.Tensor)]


# --- private helpers ---------------------------------------------------------------


def _recorder(calls: list[_Call]) -> Callable[..., None]:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        inputs = tensor_leaves((args, kwargs))
        calls.append(_Call(module, [tuple(t.shape) for t in inputs], [tuple(t.shape) for t in tensor_leaves(output)]))

    return hook


def _use_recorder(calls: list[_Call]) -> Callable[[nn.Module, int, str, torch.Tensor], torch.Tensor]:
    def on_use(module: nn.Module, use: int, name: str, expanded: torch.Tensor, call: Any = None) -> torch.Tensor:
        calls.append(_Call(module, [], [tuple(expanded.shape)], use))
        return expanded

    return on_use


def _broadcast_candidate(module: nn.Module) -> bool:
    return _registry.lookup(module) is FALLBACK


def _template(small: list[Shape], large: list[Shape]) -> tuple[Template, tuple[bool, ...]]:
    entries, verdicts = [], []
    n1, n2 = _SIZES
    for s, l in zip(small, large):
        k = s[0] // n1 if len(s) > 0 and len(l) > 0 and s[0] % n1 == 0 else 0
        if k > 0 and l[0] == k * n2 and s[1:] == l[1:]:
            entries.append((k, s[1:]))
        elif s == l:
            entries.append((0, s))
        else:  # depends on the batch some other way (e.g. flattened B * T + 1)
            entries.append((-1, s))
        verdicts.append(bool(entries[-1][0] == 1))
    return tuple(entries), tuple(verdicts)


def _matches(template: Template, tensors: list[torch.Tensor], batch: int) -> bool:
    return _matches_shapes(template, [tuple(t.shape) for t in tensors], batch)


def _matches_shapes(template: Template, shapes: list[Shape], batch: int) -> bool:
    if len(template) != len(shapes):
        return False
    for (k, shape), s in zip(template, shapes):
        if k > 0:
            if len(s) == 0 or s[0] != k * batch or tuple(s[1:]) != shape:
                return False
        elif k == 0 and tuple(s) != shape:
            return False
    return True
