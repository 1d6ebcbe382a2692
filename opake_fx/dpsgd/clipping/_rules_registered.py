"""Users' own layer rules (:func:`~.rules.register_rule`) as entries of the registry.

A registered function ``rule(module, a, g) -> {parameter name: [B, *shape]}`` becomes a
:class:`UserRule`: it reads the call's first input ``a`` and its output gradient ``g``
like a built-in rule, and its per-example gradients are checked against autograd on the
first call per module type, input shape and parameter set (:func:`run_rule`).

Privacy contract: the norms that decide the clip weights are the certified norms of the
returned tensors, which the weighted sum reads, so a wrong rule can only give a wrong
gradient, never an example whose contribution exceeds ``C`` (as computed in floating point).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import nn

from opake_fx.dpsgd.clipping import _numerics as N
from opake_fx.dpsgd.clipping._rule import BuildContext, Rule
from opake_fx.errors import InputTypeError, InputValueError

#: ``(module, a, g) -> {parameter name: per-example gradients [B, *shape]}``
LayerRule = Callable[[nn.Module, torch.Tensor, torch.Tensor], Mapping[str, torch.Tensor]]


class UserRule(Rule):
    """A registered function as a registry entry; ``built_in(module)`` is the entry that would
    take the module otherwise, whose refusals of the call (a sequence-first layer on a batch-first
    input) still apply; refusals of parameter settings are left to the user's rule."""

    kind = "registered"

    def __init__(self, fn: LayerRule, built_in: Callable[[nn.Module], Rule]) -> None:
        self.fn, self.built_in = fn, built_in

    def claims(self, module: nn.Module) -> bool:
        return True  # (the registry matches users' rules by type)

    def check(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], batched: dict[int, bool],
              batch: int, differentiated: bool) -> None:
        self.built_in(module).check(module, args, kwargs, batched, batch, False)

    def build(self, module: nn.Module, saved: tuple[torch.Tensor, ...], g: torch.Tensor, names: dict[str, int],
              ctx: BuildContext) -> N.PerExampleGrad:
        return N.PerExampleGrad(run_rule(self.fn, module, saved[0], g, names, ctx.checked if ctx.checked is not None else set()))


def run_rule(rule: LayerRule, module: nn.Module, a: torch.Tensor, g: torch.Tensor, names: Mapping[str, object],
             checked: set[tuple[object, ...]]) -> dict[str, torch.Tensor]:
    """Runs a registered rule for one call and checks it (the first time for this module
    type, input shape and parameter set) against autograd's batch gradient of the call.

    Returns the per-example gradients of the parameters in ``names`` (the module's own
    parameters that are differentiated).
    """
    batch = a.shape[0]
    out = rule(module, a, g)
    if not isinstance(out, Mapping):
        raise InputTypeError(f"the rule registered for {type(module).__name__} returned {type(out).__name__}, not a dict.")
    grads = {}
    for name in names:
        pe = out.get(name)
        param = module._parameters[name]
        if not isinstance(pe, torch.Tensor) or tuple(pe.shape) != (batch, *param.shape):
            got = tuple(pe.shape) if isinstance(pe, torch.Tensor) else type(pe).__name__
            raise InputValueError(
                f"the rule registered for {type(module).__name__} must return per-example gradients of "
                f"'{name}' with shape {(batch, *tuple(param.shape))} (batch first); got {got}."
            )
        grads[name] = pe.detach()
    key = (type(module), tuple(a.shape[1:]), tuple(sorted(names)))
    if key not in checked:
        _check_against_autograd(module, a, g, grads)
        checked.add(key)
    return grads


def _check_against_autograd(module: nn.Module, a: torch.Tensor, g: torch.Tensor, grads: dict[str, torch.Tensor]) -> None:
    params = {n: module._parameters[n].detach().requires_grad_(True) for n in grads}
    saved = {n: module._parameters[n] for n in grads}
    try:
        with torch.enable_grad():
            module._parameters.update(params)
            y = type(module).forward(module, a)  # the module's own computation, without hooks
            want = torch.autograd.grad(y, list(params.values()), g, allow_unused=True)
    finally:
        module._parameters.update(saved)
    for (name, pe), ref in zip(grads.items(), want):
        total = pe.sum(dim=0).to(torch.float64)
        ref64 = torch.zeros_like(total) if ref is None else ref.to(torch.float64)
        err = float(torch.linalg.vector_norm(total - ref64))
        scale = float(torch.linalg.vector_norm(ref64)) + float(torch.linalg.vector_norm(total))
        if not err <= 1e-4 * scale + 1e-30:
            raise InputValueError(
                f"the rule registered for {type(module).__name__} is wrong for '{name}': its per-example gradients "
                f"sum to a tensor {err:.3g} away (L2) from autograd's batch gradient of the call (norm "
                f"{float(torch.linalg.vector_norm(ref64)):.3g}). Check the rule; unregister_rule removes it."
            )


__all__ = ["LayerRule", "UserRule", "run_rule"]
