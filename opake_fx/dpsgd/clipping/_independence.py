"""Independence of examples, checked exactly: no example's loss or gradient reads another.

The fast backends (``ghost``/``auto``) run the loss on the whole batch and read row ``i``
of each layer's input ``a`` and output gradient ``g`` as example ``i``'s. That is sound
only if (1) example ``i``'s loss depends on example ``i`` alone, and (2) the backward pass
sends ``L_i``'s gradient to row ``i`` and nowhere else. A probe that compares a few losses
at a threshold cannot show either: a model in which example ``i`` reads example ``i - 1``
leaves examples 0 and 1 unchanged between batches of 2 and 3, and a custom
``autograd.Function`` whose forward is the identity and whose backward mixes the batch
changes no loss at all. So, once per call signature of the loss, in eval mode, on the
first ``PROBE_EXAMPLES`` examples of the batch:

* **Backward: exact structure.** The loss runs once with gradients; every tensor the
  rules read rows of is recorded: the outputs of modules that own parameters (those with
  the batch axis first, by provenance; ``k`` rows per example for ``[k B, ...]``
  outputs), the parameter broadcasts the elementwise rule taps, and the floating-point
  batch arguments. For each bit ``b`` of the example index, the backward pass is seeded
  with the indicator of the examples whose bit ``b`` is 1, then of those whose bit is 0;
  the gradient rows of every example outside the seed must be exactly zero. Two distinct
  examples differ in some bit, so every ordered pair is covered by ``2 ceil(log2 k)``
  backward passes. No threshold: a structural zero is an exact zero in floating point (a
  zero row times a finite weight is zero), so anything else is a dependence, however
  small. This covers every differentiable mixing, in the forward (``h - h.mean(0)``,
  ``h + shift(h)``) or only in the backward (a custom Function).
* **Forward: each example alone.** Mixing through a path with no gradient (a detached
  read, an index computed from another example, the batch size itself) changes values,
  not gradients. Each probe example's loss, run alone as a batch of one, must equal its
  loss in the batch within ``FORWARD_RTOL`` (``sqrt`` of float64's epsilon), in float64
  where the model runs in float64 (parameters, buffers and floating inputs are cast for
  the check and restored), else within ``sqrt`` of the loss dtype's epsilon.

The check draws from private copies of torch's random generators (``fork_rng``), so the
caller's random stream is the same with or without it. A loss that draws random numbers
from the global generator even in eval mode (two runs on the same examples differ) cannot
be compared with itself alone: :class:`Uncheckable`.

Examples whose loss is not finite are left out of both checks (their weight is 0); with
fewer than two finite examples the check is undecided, and the backend takes the exact
per-example path for that call (and checks again at the next). A loss whose probe cannot
run (it raises with gradients, or alone, e.g. an in-place edit of a tensor autograd saved)
is :class:`Uncheckable`: every call of that signature takes the exact per-example path,
with a :class:`~opake_fx.errors.SlowPathWarning` that says why.

What this does not prove: a dependence that only some data trigger (a branch on the
values of other examples) can pass on the probe's examples, and a non-differentiable
dependence smaller than ``FORWARD_RTOL`` of the loss is not seen. The ``vmap`` backend
runs each example alone and is independent by construction.
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator

import optree
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from opake_fx.dpsgd.clipping._rules_elementwise import watch
from opake_fx.dpsgd.clipping._rules_shared import OnSite, SharedTensors, expand_for_site
from opake_fx.pytree import NAMESPACE

#: Examples of the batch the check runs on (the first ones).
PROBE_EXAMPLES = 8
#: Relative tolerance of the forward (alone vs batched) comparison in float64.
FORWARD_RTOL = math.sqrt(torch.finfo(torch.float64).eps)
#: Returned when this batch cannot decide (too few examples with a finite loss): check again next call.
UNDECIDED = "undecided"


class Uncheckable(str):
    """Returned (with the reason) when the check cannot run for this call signature at all (the
    loss fails on the probe, with gradients or alone): its calls take the exact per-example path."""

#: (modules, batch size, on_site) -> (a mode following shared tensors, its seeding hooks)
Following = Callable[[list[nn.Module], int, OnSite], tuple[SharedTensors, list[Any]]]

# (k rows per example, or 0 when the tensor does not carry the batch axis first)
RowsOf = Callable[[nn.Module, list[torch.Tensor], list[torch.Tensor], int], list[int]]


def check_independence(root: nn.Module, loss_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                       batch_argnums: tuple[int, ...], has_aux: bool, batch: int, rows_of: RowsOf,
                       broadcast_candidate: Callable[[nn.Module], bool],
                       broadcast_rows: Callable[[nn.Module, int, torch.Tensor, int], int],
                       shared: Following | None = None) -> str | None:
    """None when no example reads another, an error message when one does,
    :data:`UNDECIDED` (this batch cannot tell) or an :class:`Uncheckable` reason.

    Args:
        root: the model whose modules the loss calls.
        loss_fn, args, kwargs, batch_argnums, has_aux: the loss and its call (the
            differentiated leaves in ``args`` require grad).
        batch: the batch size of ``args``.
        rows_of: ``(module, inputs, outputs, n) -> rows per example of each output`` for a
            call in a batch of ``n`` (0: not batched), from the provenance layout.
        broadcast_candidate, broadcast_rows: which modules' parameter broadcasts the
            elementwise rule may tap, and the rows per example of one (0: not batched).
        shared: the layout's ``following`` (:mod:`._rules_shared`): the sites where shared
            tensors meet the batch are watched too; None when the model has none.
    """
    n = min(batch, PROBE_EXAMPLES)
    if n < 2:
        return None
    sub = _take(args, batch_argnums, torch.arange(n))
    modes = [(m, m.training) for m in root.modules()]
    try:  # (on private random streams: the caller, probe(), runs it inside private_random_streams())
        return _check(root, loss_fn, sub, kwargs, batch_argnums, has_aux, n, rows_of, broadcast_candidate,
                      broadcast_rows, shared)
    finally:
        for m, mode in modes:
            m.training = mode


@contextmanager
def private_random_streams() -> Iterator[None]:
    """Runs the body on copies of torch's CPU generator (and the current CUDA device's, if in
    use), restored afterwards: probing a loss leaves the caller's random stream as it was."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        yield


def _check(root: nn.Module, loss_fn: Callable[..., Any], sub: tuple[Any, ...], kwargs: dict[str, Any],
           batch_argnums: tuple[int, ...], has_aux: bool, n: int, rows_of: RowsOf,
           broadcast_candidate: Callable[[nn.Module], bool],
           broadcast_rows: Callable[[nn.Module, int, torch.Tensor, int], int], shared: Following | None) -> str | None:
    """The two checks, in eval mode (deterministic: dropout off; the caller restores the modes)."""
    root.eval()
    backward: str | None = None
    for with_inputs in (True, False):  # an input edited in place cannot require grad: watch without it
        try:
            backward = _backward_structure(root, loss_fn, sub, kwargs, batch_argnums, has_aux, n, rows_of,
                                           broadcast_candidate, broadcast_rows, with_inputs, shared)
            break
        except Exception as e:  # noqa: BLE001 - the loss cannot be differentiated on the probe
            backward = Uncheckable(f"the loss could not be differentiated on the probe ({type(e).__name__}: "
                                   f"{str(e).splitlines()[0] if str(e) else ''})")
    if backward is not None:
        return backward
    return _forward_alone(root, loss_fn, sub, kwargs, batch_argnums, has_aux, n)


# --- the backward structure ---------------------------------------------------------


def _backward_structure(root: nn.Module, loss_fn: Callable[..., Any], sub: tuple[Any, ...], kwargs: dict[str, Any],
                        batch_argnums: tuple[int, ...], has_aux: bool, n: int, rows_of: RowsOf,
                        broadcast_candidate: Callable[[nn.Module], bool],
                        broadcast_rows: Callable[[nn.Module, int, torch.Tensor, int], int], with_inputs: bool,
                        shared: Following | None = None) -> str | None:
    watched: list[tuple[str, torch.Tensor, int]] = []  # (where, tensor, rows per example)
    names = {id(m): p or type(m).__name__ for p, m in root.named_modules()}

    def on_call(module: nn.Module, args: tuple[Any, ...], kw: dict[str, Any], output: Any) -> None:
        outputs = _tensors(output)
        per = rows_of(module, _tensors((args, kw)), outputs, n)
        for t, k in zip(outputs, per):
            if k > 0 and t.requires_grad and t.is_floating_point():
                watched.append((f"the output of module '{names.get(id(module), '?')}'", t, k))

    def on_use(module: nn.Module, use: int, name: str, expanded: torch.Tensor, call: Any = None) -> torch.Tensor:
        k = broadcast_rows(module, use, expanded, n)
        if k > 0 and expanded.requires_grad:
            # a new view, so that the op is recomputed from it (the broadcast's own value is not
            # in the graph) and its rows are the ones the rule reads
            expanded = expanded.view_as(expanded)
            watched.append((f"the broadcast of '{names.get(id(module), '?')}.{name}'", expanded, k))
        return expanded

    inputs: list[tuple[str, torch.Tensor, int]] = []
    run = list(sub)
    for i in batch_argnums if with_inputs else ():
        def grad_input(t: Any) -> Any:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not t.requires_grad and t.dim() > 0:
                t = t.detach().requires_grad_(True)
                inputs.append(("a floating-point batch argument", t, 1))
            return t

        run[i] = optree.tree_map(grad_input, run[i], namespace=NAMESPACE)
    modules = list(root.modules())
    handles = [m.register_forward_hook(on_call, with_kwargs=True)
               for m in modules if m._parameters or isinstance(m, _BatchNorm)]
    handles += watch(modules, broadcast_candidate, on_use)

    def on_site(k: int, d: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        e = expand_for_site(d, shape, detach=False)
        if e is None:
            return d
        if e.requires_grad:
            watched.append((f"a shared tensor where it meets the batch (op {k})", e, 1))
        return e

    following = nullcontext()
    if shared is not None:
        following, seeds = shared(modules, n, on_site)
        handles += seeds
    try:
        with torch.enable_grad(), following:
            losses = _losses(loss_fn(*run, **kwargs), has_aux)
    finally:
        for h in handles:
            h.remove()
    if losses is None or tuple(losses.shape) != (n,):
        return UNDECIDED  # not per-example losses: the backend reports that itself
    watched = inputs + watched
    finite = torch.isfinite(losses.detach())
    if int(finite.sum()) < 2:
        return UNDECIDED
    tensors = [t for _, t, _ in watched]
    if not losses.requires_grad or not tensors:
        return None  # nothing is differentiated through the batch: no rows to mix
    groups = _seed_groups(n)
    for j, members in enumerate(groups):
        seed = torch.zeros(n, dtype=losses.dtype, device=losses.device)
        seed[members] = 1.0
        seed = seed * finite  # a non-finite example's backward may be NaN everywhere in its rows
        # a scalar (not grad_outputs=seed): the same gradients, without autograd's shape checks for
        # grad_outputs (whose first use imports sympy, ~0.4 s)
        grads = torch.autograd.grad((losses * seed).sum(), tensors, retain_graph=j < len(groups) - 1, allow_unused=True)
        outside = [i for i in range(n) if i not in members and bool(finite[i])]
        last = after = None
        for (where, _, k), g in zip(watched, grads):
            if g is None:
                continue
            rows = g.reshape(n, -1)
            if bool((rows[outside] != 0).any()):
                last, after = where, None  # the mixing happens after the last such tensor in forward order
            elif last is not None and after is None:
                after = where
        if last is not None:
            between = f" and gone at {after}" if after else ""
            return (
                "the model mixes examples: in the backward pass, the gradient of some examples' losses reaches "
                f"other examples' rows (exactly, on the first {n} examples of the batch, seeded with examples "
                f"{members}), last seen at {last}{between}: the mixing happens after it in the forward pass (or in "
                "a custom backward). " + _FIX
            )
    return None


def _seed_groups(n: int) -> list[list[int]]:
    """For each bit of the example index, the examples with that bit set and those with it clear."""
    groups = []
    for b in range(max(1, math.ceil(math.log2(n)))):
        ones = [i for i in range(n) if (i >> b) & 1]
        zeros = [i for i in range(n) if not (i >> b) & 1]
        groups += [g for g in (ones, zeros) if g]
    return groups


# --- the forward values ---------------------------------------------------------------


def _forward_alone(root: nn.Module, loss_fn: Callable[..., Any], sub: tuple[Any, ...], kwargs: dict[str, Any],
                   batch_argnums: tuple[int, ...], has_aux: bool, n: int) -> str | None:
    failure = ""
    for wide in (True, False):
        try:
            with torch.no_grad(), (_in_float64(root) if wide else nullcontext()):
                run = _to_float64(sub) if wide else sub
                kw = _to_float64(kwargs) if wide else kwargs
                torch.manual_seed(1)
                together = _losses(loss_fn(*run, **kw), has_aux)
                torch.manual_seed(2)
                again = _losses(loss_fn(*run, **kw), has_aux)
                alone = [_losses(loss_fn(*_take(run, batch_argnums, torch.tensor([i])), **kw), has_aux) for i in range(n)]
        except Exception as e:  # noqa: BLE001 - e.g. a model that builds float32 tensors itself: try its own dtype
            failure = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            continue
        if together is None or tuple(together.shape) != (n,) or any(a is None or a.numel() != 1 for a in alone):
            return UNDECIDED
        if wide and together.dtype != torch.float64:
            continue  # the loss did not run in float64 after all
        if again is None or not torch.equal(torch.nan_to_num(together), torch.nan_to_num(again)):
            return Uncheckable(
                "the loss draws random numbers from torch's global generator in eval mode (two runs on the same "
                "examples differ), so an example alone cannot be compared with the example in the batch; draw "
                "augmentation from keys (opake_fx.augmult) or module dropout to keep the fast path")
        single = torch.stack([a.reshape(()) for a in alone]).double()
        together = together.double()
        rtol = FORWARD_RTOL if wide else math.sqrt(torch.finfo(_dtype_of(sub, together)).eps)
        finite = torch.isfinite(together) & torch.isfinite(single)
        if int(finite.sum()) < 2:
            return UNDECIDED
        scale = torch.maximum(together.abs(), single.abs())
        bad = finite & ((together - single).abs() > rtol * scale + torch.finfo(torch.float64).tiny)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            return (
                f"the model mixes examples: example {i}'s loss is {float(single[i]):.17g} when it runs alone and "
                f"{float(together[i]):.17g} next to the first {n} examples of the batch (relative tolerance "
                f"{rtol:.1e}, {'float64' if wide else 'the model dtype'}, eval mode). Something in the model or "
                "the loss reads other examples, or the batch size, through a path without gradients (a detached "
                "or integer read, a division by the batch size). " + _FIX
            )
        return None
    return Uncheckable(f"the loss could not run on one example alone ({failure})")


_FIX = (
    "The fast clipping backends ('ghost', 'auto') take row i of each layer's input and output gradient as "
    "example i's, which holds only if no computation combines examples (batch statistics such as h - h.mean(0), "
    "BatchNorm in training, a read of a neighbouring example, a backward that mixes rows). Remove the mixing, or "
    "use clip_backend='vmap', which runs each example alone."
)


@contextmanager
def _in_float64(root: nn.Module) -> Iterator[None]:
    """The module's floating-point parameters and buffers as float64 for the duration (restored)."""
    saved: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for m in root.modules():
            for store in (m._parameters, m._buffers):
                for name, t in store.items():
                    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64:
                        saved.append((store, name, t))
                        wide = t.detach().double()
                        store[name] = nn.Parameter(wide, requires_grad=False) if isinstance(t, nn.Parameter) else wide
        yield
    finally:
        for store, name, t in reversed(saved):
            store[name] = t


def _to_float64(tree: Any) -> Any:
    return optree.tree_map(lambda t: t.detach().double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                           tree, namespace=NAMESPACE)


def _dtype_of(sub: tuple[Any, ...], losses: torch.Tensor) -> torch.dtype:
    floats = [t.dtype for t in optree.tree_leaves(sub, namespace=NAMESPACE)
              if isinstance(t, torch.Tensor) and t.is_floating_point()]
    # the widest epsilon among the dtypes the loss saw (a bfloat16 model rounds at bfloat16)
    return max(floats + [losses.dtype], key=lambda d: torch.finfo(d).eps)


# --- helpers --------------------------------------------------------------------------------


def _take(args: tuple[Any, ...], batch_argnums: tuple[int, ...], index: torch.Tensor) -> tuple[Any, ...]:
    return tuple(
        optree.tree_map(lambda t: t[index.to(t.device)] if isinstance(t, torch.Tensor) else t, a, namespace=NAMESPACE)
        if i in batch_argnums else a
        for i, a in enumerate(args)
    )


def _losses(out: Any, has_aux: bool) -> torch.Tensor | None:
    losses = out[0] if has_aux and isinstance(out, tuple) else out
    return losses if isinstance(losses, torch.Tensor) else None


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in optree.tree_leaves(tree, namespace=NAMESPACE) if isinstance(t, torch.Tensor)]
