"""Parameters a module broadcasts over the batch in its own ``forward``: cls tokens, position embeddings.

ViT's embeddings module holds ``cls_token`` ``[1, 1, D]`` and ``position_embeddings``
``[1, T, D]`` and uses them outside any submodule call: ``cls_token.expand(B, -1, -1)``
(then concatenated to the patch embeddings) and ``embeddings + position_embeddings``;
a ConvNeXt block scales its branch by a layer-scale vector, ``gamma * y``. Such a use is a
*broadcast* of the parameter ``P`` to a tensor ``E`` whose first axis is the batch:
``E = P.expand(B, ...)``, or ``x op P`` = ``x op P.expand(out.shape)`` for ``op`` one of
``+ - * /``. Example ``i``'s gradient of ``P`` is then ``g_i`` (the gradient of the batch
loss w.r.t. ``E``'s row ``i``, e.g. ``dL/dout_i * x_i`` for a product) summed over the axes
``P`` was broadcast along: ``[B, *P.shape]``, as small as the parameter, computed directly.

While a module without a rule runs its ``forward``, a torch function mode
(:class:`Broadcasts`) watches the calls whose operand *is* one of the parameters the
module holds directly: ``Tensor.expand`` / ``expand_as``, and ``add``, ``sub``, ``mul``,
``div`` with the parameter as one of two operands (no keyword arguments). Each such use is numbered within the
call; whether ``E``'s first axis is the batch is decided by provenance (the probe of
:mod:`._provenance` records the same uses at sub-batches of 2 and 3), never by a size.
A use that passes is replaced by the same value through a tap, and the parameter leaves
the module's fallback; any other use of it (another op, a use the probe cannot decide)
is seen by the graph-use count and takes an exact fallback with a
:class:`~opake_fx.errors.SlowPathWarning`, as before.

Privacy contract: the engine's weights come from certified norms of the stored
``[B, *P.shape]`` per-example gradients that the weighted sum reads, so each example's
contribution is at most ``C`` as computed in floating point.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from opake_fx.dpsgd.clipping import _numerics as N
from opake_fx.dpsgd.clipping._rule import BuildContext, Rule

_EXPAND = (torch.Tensor.expand, torch.Tensor.expand_as)
#: Two-operand elementwise ops with broadcasting: a parameter broadcast through one (``x + P``, a
#: layer scale ``x * gamma``) is tapped; the tap's gradient is then the parameter's own (``g * x``
#: for a product), summed over the broadcast axes. Also the shared-tensor rule's sites.
BINARY_OPS = frozenset({
    torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__,
    torch.sub, torch.Tensor.sub, torch.Tensor.__sub__, torch.Tensor.__rsub__,
    torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__,
    torch.div, torch.Tensor.div, torch.Tensor.__truediv__, torch.Tensor.__rtruediv__,
})

#: ``(module, use number, parameter name, E, call) -> replacement for E`` (or E itself); ``call`` is
#: None for a broadcast, ``("lookup", ids, padding_idx)`` for a table lookup (``E = F.embedding(ids,
#: P)``), ``("linear", x, roles, d_in, d_out)`` for an inline Linear (``F.linear(x, W, b)``, ``x @ W.T``)
OnUse = Callable[[nn.Module, int, str, torch.Tensor, "tuple[Any, ...] | None"], torch.Tensor]


def direct_parameters(module: nn.Module) -> dict[int, str]:
    """``id(tensor) -> name`` of the parameters ``module`` holds directly and no submodule also holds."""
    held = {id(p) for child in module.children() for m in child.modules() for p in m._parameters.values()
            if p is not None}
    return {id(p): n for n, p in module._parameters.items() if p is not None and id(p) not in held}


class Broadcasts(TorchFunctionMode):
    """Watches one module call's forward for broadcasts of its own parameters (see the module docstring)."""

    def __init__(self, module: nn.Module, params: dict[int, str], on_use: OnUse) -> None:
        super().__init__()
        self.module, self.params, self.on_use = module, params, on_use
        self.count = 0
        self.transposed: dict[int, tuple[str, torch.Tensor]] = {}  # id(W.T) -> (W's name, W.T)

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is F.embedding:
            found = lookup_of(args, kwargs, self.params)
            if found is not None and isinstance(out, torch.Tensor) and out.dim() > 0:
                k, self.count = self.count, self.count + 1
                name, ids, padding_idx = found
                return self.on_use(self.module, k, name, out, ("lookup", ids, padding_idx))
            return out
        if any(func == t for t in _TRANSPOSE) and args and self.params.get(id(args[0])) and args[0].dim() == 2:
            self.transposed[id(out)] = (self.params[id(args[0])], out)  # W.T / W.t() of our weight, kept alive
            return out
        projection = self._projection_of(func, args, kwargs, out)
        if projection is not None:
            k, self.count = self.count, self.count + 1
            x, roles, d_in, d_out = projection
            return self.on_use(self.module, k, roles["weight"], out, ("linear", x, roles, d_in, d_out))
        name = self._broadcast_of(func, args, kwargs, out)
        if name is None:
            return out
        k, self.count = self.count, self.count + 1
        param = next(a for a in args if isinstance(a, torch.Tensor) and self.params.get(id(a)) == name)
        if func in _EXPAND:
            return self.on_use(self.module, k, name, out, None)
        expanded = param.expand(out.shape)
        tapped = self.on_use(self.module, k, name, expanded, None)
        if tapped is expanded:
            return out
        return func(*(tapped if a is param else a for a in args))

    def _projection_of(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                       out: Any) -> tuple[torch.Tensor, dict[str, str], int, int] | None:
        """``(x, roles, d_in, d_out)`` for ``F.linear(x, W[, b])`` or ``x @ W.T`` with ``W`` (and
        ``b``, when it is ours) our parameters and ``x`` not: a Linear layer written inline."""
        if not isinstance(out, torch.Tensor) or out.dim() < 2:
            return None
        if func is F.linear:
            x = args[0] if args else kwargs.get("input")
            w = args[1] if len(args) > 1 else kwargs.get("weight")
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor) or w.dim() != 2:
                return None
            name = self.params.get(id(w))
            if name is None or self.params.get(id(x)) is not None:
                return None
            roles = {"weight": name}
            if isinstance(b, torch.Tensor) and self.params.get(id(b)) is not None:
                roles["bias"] = self.params[id(b)]
            d_out, d_in = w.shape
        elif func in _MATMUL and len(args) == 2 and not kwargs and isinstance(args[0], torch.Tensor):
            found = self.transposed.get(id(args[1]))
            if found is None or found[1] is not args[1] or self.params.get(id(args[0])) is not None:
                return None
            x, roles = args[0], {"weight": found[0]}
            d_in, d_out = args[1].shape
        else:
            return None
        if x.dim() < 2 or tuple(x.shape[:-1]) != tuple(out.shape[:-1]) or x.dtype != out.dtype:
            return None
        return x, roles, d_in, d_out

    def _broadcast_of(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> str | None:
        """The parameter's name when the call broadcasts one of ours to a new leading axis."""
        if not isinstance(out, torch.Tensor) or out.dim() == 0 or not args or not isinstance(args[0], torch.Tensor):
            return None
        if func in _EXPAND:
            name = self.params.get(id(args[0]))
            param = args[0]
        elif func in BINARY_OPS and len(args) == 2 and not kwargs and isinstance(args[1], torch.Tensor):
            a, b = self.params.get(id(args[0])), self.params.get(id(args[1]))
            if (a is None) == (b is None):
                return None  # no parameter of ours, or two
            name = a or b
            param = args[0] if a is not None else args[1]
            if out.dtype != param.dtype:
                return None  # a type promotion would make the result not `op(other, P)`
        else:
            return None
        if name is None:
            return None
        shape = (1,) * (out.dim() - param.dim()) + tuple(param.shape)
        if len(shape) != out.dim() or shape[0] != 1:
            return None  # the parameter must not have a size along the example axis
        return name


def lookup_of(args: tuple[Any, ...], kwargs: dict[str, Any], params: dict[int, str]) -> tuple[str, torch.Tensor, int | None] | None:
    """``(name, ids, padding_idx)`` when an ``F.embedding`` call looks ids up in one of
    ``params`` (``id -> name``) with none of the options that mix examples or write the
    table (``max_norm``, ``scale_grad_by_freq``, ``sparse``); else None."""
    try:
        bound = _EMBEDDING.bind(*args, **kwargs)
    except TypeError:
        return None
    a = bound.arguments
    weight, ids = a.get("weight"), a.get("input")
    if not isinstance(weight, torch.Tensor) or not isinstance(ids, torch.Tensor) or weight.dim() != 2:
        return None
    name = params.get(id(weight))
    if name is None or a.get("max_norm") is not None or a.get("scale_grad_by_freq") or a.get("sparse"):
        return None
    pad = a.get("padding_idx")
    if pad is not None and pad < 0:
        pad += weight.shape[0]
    return name, ids, pad


_EMBEDDING = inspect.signature(F.embedding)
_TRANSPOSE = (torch.Tensor.T.__get__, torch.Tensor.t, torch.t)  # compared with == (a property's getter is rebuilt)
_MATMUL = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)


def watch(modules: Iterable[nn.Module], candidate: Callable[[nn.Module], bool], on_use: OnUse) -> list[Any]:
    """Hooks that run :class:`Broadcasts` during the ``forward`` of every module of ``modules``
    (a model's ``modules()``) for which ``candidate`` holds and that holds parameters
    directly; returns the handles."""
    handles: list[Any] = []
    for m in modules:
        if not m._parameters or not candidate(m):
            continue
        active: list[Broadcasts] = []

        def enter(module: nn.Module, args: Any, active: list[Broadcasts] = active) -> None:
            params = direct_parameters(module)
            if params:
                mode = Broadcasts(module, params, on_use)
                mode.__enter__()
                active.append(mode)
            else:
                active.append(None)  # type: ignore[arg-type]

        def leave(module: nn.Module, args: Any, output: Any, active: list[Broadcasts] = active) -> None:
            mode = active.pop() if active else None
            if mode is not None:
                mode.__exit__(None, None, None)

        handles.append(m.register_forward_pre_hook(enter))
        handles.append(m.register_forward_hook(leave, always_call=True))
    return handles


class ElementwiseRule(Rule):
    """One broadcast use of a parameter (tapped by :class:`Broadcasts`; claims no module)."""

    kind = "elementwise"

    def claims(self, module: nn.Module) -> bool:
        return False

    def build(self, module: nn.Module, saved: tuple[torch.Tensor, ...], g: torch.Tensor, names: dict[str, int],
              ctx: BuildContext) -> N.PerExampleGrad:
        (name,) = names
        param = module._parameters[name]
        assert param is not None
        shape = (1,) * (g.dim() - param.dim()) + tuple(param.shape)
        g = N.as_dtype(g, N.compute_dtype(ctx.dtype))
        dims = [j for j in range(1, g.dim()) if shape[j] == 1 and g.shape[j] != 1]
        per = g.sum(dim=dims, keepdim=True) if dims else g
        return N.PerExampleGrad({name: per.reshape(g.shape[0], *param.shape)})


ELEMENTWISE = ElementwiseRule()

__all__ = ["BINARY_OPS", "ELEMENTWISE", "Broadcasts", "ElementwiseRule", "direct_parameters", "watch"]
