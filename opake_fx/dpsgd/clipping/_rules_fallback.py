"""The exact fallback for a module call no rule takes: per-example gradients by ``vmap`` of its vjp.

A module of a type without a rule (or a subclass with its own ``forward``) that owns
differentiated parameters keeps its whole call (inputs, non-tensor arguments, the
parameters and buffers it used) in the forward pass; after the backward pass, which
gives the gradient of each of its outputs, :func:`module_per_example` maps the module's
vjp over the examples (``vmap``, or an exact loop where ``vmap`` cannot run the module,
:func:`._per_example.map_examples`). The result is ``[B, *shape]`` per parameter: exact,
slower than a rule, and the backend says so with a :class:`~opake_fx.errors.SlowPathWarning`.
Which tensors of the call are split per example is decided by provenance, never by size.

Privacy contract: the engine's weights come from the certified norms of these stored
per-example gradients, which the weighted sum reads, so each example's contribution is
at most ``C`` as computed in floating point.
"""

from __future__ import annotations

from typing import Any

import optree
import torch
from torch import nn

from opake_fx.dpsgd.clipping import _numerics as N
from opake_fx.dpsgd.clipping._per_example import map_examples
from opake_fx.dpsgd.clipping._rule import Rule


def module_per_example(
    module: nn.Module,
    bound: dict[str, torch.Tensor],
    diff_names: list[str],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    grads_out: list[torch.Tensor | None],
    batch: int,
    batched: list[int],
    in_axes: list[int] | None = None,
    out_axes: list[int] | None = None,
) -> N.PerExampleGrad:
    """Fallback rule: per-example gradients of ``diff_names`` by ``vmap`` of the module's vjp.

    ``bound`` holds every parameter and buffer the call used (names relative to
    ``module``); ``grads_out`` the gradient of each tensor output (``None``: no gradient
    reached it). The tensor arguments at ``batched`` (flattened positions of ``(args,
    kwargs)``, found by provenance, never by size) are split per example along ``in_axes``
    (default: their first axis); others are broadcast. ``out_axes``: the batch axis of each
    output (default: the first; a recurrent layer's ``h_n`` carries it second).
    """
    flat, spec = optree.tree_flatten((args, kwargs))
    positions = list(batched)
    axes = list(in_axes) if in_axes is not None else [0] * len(positions)
    used = [k for k, go in enumerate(grads_out) if go is not None]
    used_axes = [out_axes[k] if out_axes is not None else 0 for k in used]
    diff = {n: bound[n].detach() for n in diff_names}
    const = {n: t.detach() for n, t in bound.items() if n not in diff}

    def call(params: dict[str, torch.Tensor], xs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        items = list(flat)
        for k, ax, x in zip(positions, axes, xs):
            items[k] = x.unsqueeze(ax)
        a, kw = optree.tree_unflatten(spec, items)
        out = torch.func.functional_call(module, {**const, **params}, tuple(a), kw)
        outs = [o for o in optree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        return tuple(outs[k] for k in used)

    def one(xs: tuple[torch.Tensor, ...], gs: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
        _, vjp_fn = torch.func.vjp(lambda p: call(p, xs), diff)
        return vjp_fn(tuple(go.unsqueeze(ax) for go, ax in zip(gs, used_axes)))[0]

    def one_by_autograd(xs: tuple[torch.Tensor, ...], gs: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
        params = {n: t.detach().requires_grad_(True) for n, t in diff.items()}
        with torch.enable_grad():
            outs = call(params, xs)
            got = torch.autograd.grad(outs, list(params.values()), [go.unsqueeze(ax) for go, ax in zip(gs, used_axes)],
                                      allow_unused=True)
        return {n: torch.zeros_like(params[n]) if g is None else g for n, g in zip(params, got)}

    if not used:
        return N.PerExampleGrad({n: torch.zeros((batch, *diff[n].shape), dtype=diff[n].dtype, device=diff[n].device) for n in diff_names})
    xs = tuple(flat[k].movedim(ax, 0) for k, ax in zip(positions, axes))
    gs = tuple(grads_out[k].movedim(ax, 0) for k, ax in zip(used, used_axes))
    return N.PerExampleGrad(dict(map_examples(one, (0, 0), (xs, gs), batch, what=f"the fallback of {type(module).__name__}",
                                              loop_fn=one_by_autograd)))



class FallbackRule(Rule):
    """Any module with parameters: the call is kept whole and handled after the backward
    pass by :func:`module_per_example` (deferred)."""

    kind, deferred = "fallback", True

    def claims(self, module: nn.Module) -> bool:
        return True

    def reads_batched(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                      batched: dict[int, bool]) -> bool:
        return any(batched.get(id(t), False) for t in optree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))

    def route(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
              output: Any) -> tuple[torch.Tensor, ...] | None:
        return None


FALLBACK = FallbackRule()

__all__ = ["FALLBACK", "FallbackRule", "module_per_example"]
