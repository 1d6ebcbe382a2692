"""Layer rules for your own modules: the extension point of the fast clipping backends.

``clip_backend="ghost"`` / ``"auto"`` read each layer's input and output gradient in one
batched backward pass and turn them into per-example norms through *rules*. Linear,
convolution, embedding, embedding-bag, normalisation (by what it computes) and attention
layers, and parameters a module broadcasts over the batch (cls tokens, position
embeddings), have built-in rules; a module of another type takes an exact but slower fallback
(with a :class:`~opake_fx.errors.SlowPathWarning`). :func:`register_rule` adds a rule for
a module type of yours, in the manner of Opacus's per-layer registry: it is an entry of
the same registry as the built-in rules (consulted before them), so the backends treat
your module's calls exactly like a built-in layer's.

A rule is a function ``rule(module, a, g) -> {parameter name: [B, *shape]}``:

* ``a``: the module's first positional input, batch first, as the forward pass saw it;
* ``g``: the gradient of the batch loss ``sum_i L_i`` with respect to the module's
  (single tensor) output; row ``i`` is example ``i``'s, since no layer mixes examples
  (the backends check that);
* it returns the per-example gradient of each of the module's own parameters (those it
  holds directly; those of its submodules have their own rules).

Privacy contract: whatever a rule returns, the clip bound holds. The per-example norms
are computed from the returned tensors (certified after rounding) and the clipped sum is
formed from exactly those tensors, so a wrong rule can only give a wrong gradient, never
an example whose contribution exceeds ``C``. To catch wrong gradients too, the first call
of each rule for a module type and input shape is checked against autograd: the sum of
the returned per-example gradients must equal the batch gradient of the module's call.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from opake_fx.dpsgd.clipping import clipped_grad, register_rule, unregister_rule
    >>> from opake_fx.functional import make_functional
    >>> class Scale(nn.Module):  # y = x * s, elementwise
    ...     def __init__(self, d):
    ...         super().__init__()
    ...         self.s = nn.Parameter(torch.ones(d))
    ...     def forward(self, x):
    ...         return x * self.s
    >>> register_rule(Scale, lambda module, a, g: {"s": (a * g).reshape(a.shape[0], -1, a.shape[-1]).sum(1)})
    >>> model = nn.Sequential(nn.Linear(3, 4), Scale(4), nn.Linear(4, 1))
    >>> fmodel, params = make_functional(model)
    >>> loss = lambda p, x, y: ((fmodel(p, x) - y) ** 2).sum(1)
    >>> fn, state = clipped_grad(loss, clipping_norm=1.0, batch_argnums=(1, 2), clip_backend="auto", model=fmodel)
    >>> out, state = fn(params, torch.randn(5, 3), torch.randn(5, 1), state=state)
    >>> unregister_rule(Scale)
"""

from __future__ import annotations

from torch import nn

from opake_fx.dpsgd.clipping import _registry
from opake_fx.dpsgd.clipping._rules_registered import LayerRule
from opake_fx.errors import InputTypeError, InputValueError

__all__ = ["LayerRule", "register_rule", "unregister_rule", "registered_rule"]


def register_rule(module_type: type, rule: LayerRule) -> None:
    """Registers ``rule`` for calls of modules of exactly ``module_type`` (and of its
    subclasses that do not override ``forward``).

    Args:
        module_type: an ``nn.Module`` subclass of yours. Built-in module types with a rule
            of the library's own cannot be overridden.
        rule: ``(module, a, g) -> {name: [B, *shape]}``, see the module docstring.

    Raises:
        InputTypeError: ``module_type`` is not an ``nn.Module`` subclass or ``rule`` is not callable.
        InputValueError: ``module_type`` is a torch module type the library has a rule for.
    """
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise InputTypeError(f"register_rule: module_type must be an nn.Module subclass; got {module_type!r}.")
    if not callable(rule):
        raise InputTypeError(f"register_rule: rule must be callable (module, a, g) -> dict; got {type(rule).__name__}.")
    if module_type.__module__.startswith("torch.nn") and module_type in _registry.built_in_types():
        raise InputValueError(
            f"register_rule: {module_type.__name__} has a built-in rule; register rules for your own module types."
        )
    _registry.add_user(module_type, rule)


def unregister_rule(module_type: type) -> None:
    """Removes the rule registered for ``module_type`` (no-op if there is none)."""
    _registry.remove_user(module_type)


def registered_rule(module: nn.Module) -> LayerRule | None:
    """The rule registered for ``module``'s type, or for the nearest registered base class
    whose ``forward`` the module still runs; None otherwise."""
    found = _registry.user_rule(module)
    return None if found is None else found.fn
