"""Recurrent layers (``nn.RNN`` / ``nn.LSTM`` / ``nn.GRU``): unrolled over time, each weight a Linear.

A batch-first recurrent call is recomputed in its forward hook (:meth:`RecurrentRule.rewrite`)
step by step from its own equations (torch's gate order: GRU ``r, z, n``, LSTM ``i, f, g,
o``), every layer and direction. Each weight is then a Linear over the time steps:

* ``weight_ih`` / ``bias_ih``: one projection of the layer's whole input ``[B, T, in]``,
  tapped like a Linear (ghost or per-example norms over ``T`` positions);
* ``weight_hh`` / ``bias_hh``: applied to ``h_{t-1}`` at every step. Example ``i``'s
  gradient is ``sum_t g_it h_i,t-1^T`` (``g_t`` the gradient of step ``t``'s hidden
  projection), the Linear rule on the stacked ``[B, T, hidden]`` previous states and
  ``[B, T, gates]`` gradients. The steps use the weight detached (autograd forms no weight
  gradient anyway); an identity on each step's projection keeps its gradient, and a tap on
  the initial state, whose gradient comes after every step's, builds the rule from them.

The recomputation replaces the module's output only when it reproduces it (checked once
per module and call signature). Other calls take the exact module fallback
(:mod:`._rules_fallback`: the module's vjp per example, split along each tensor's batch
axis: input and ``output`` first, ``hx`` and ``h_n``/``c_n`` second, by the module's
contract ``[layers * directions, B, hidden]``), with a
:class:`~opake_fx.errors.SlowPathWarning`: a subclass with its own ``forward``, an LSTM
with ``proj_size``, dropout between layers in training, a recomputation that does not
match. ``batch_first=False`` on a batch-first input, which would run the recurrence along
the batch and mix examples, is refused with an error. Packed sequences (flat ``data``)
are undecidable: the whole-loss fallback, exact.

Privacy contract: the weights' norms are the Linear rule's, certified after rounding, on
exactly what the weighted sum reads, so each example's contribution is at most ``C`` as
computed in floating point.
"""

from __future__ import annotations

from typing import Any, Callable

import optree
import torch
from torch import nn

from opake_fx.dpsgd.clipping._rule import BuildContext, checked_once, first_input, refuse_sequence_first, same_outputs
from opake_fx.dpsgd.clipping._rules_fallback import FallbackRule
from opake_fx.dpsgd.clipping._rules_linear import InlineLinearRule, MatmulGrad, projection_grad

_FORWARDS = (nn.RNN.forward, nn.GRU.forward, nn.LSTM.forward)


class _StepGrad(torch.autograd.Function):
    """Identity on one step's hidden projection that keeps its gradient (and the step's input)."""

    @staticmethod
    def forward(ctx: Any, hh: torch.Tensor, steps: _Steps, t: int) -> torch.Tensor:  # type: ignore[override]
        ctx.steps, ctx.t = steps, t
        return hh.view_as(hh)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        ctx.steps.grads[ctx.t] = g.detach()
        return g, None, None


class _Steps(InlineLinearRule):
    """The hidden-to-hidden weight of one layer and direction: a Linear over the time steps,
    built from the previous states and the steps' gradients once all have arrived (when the
    gradient of the initial state, on which this entry's tap sits, is computed)."""

    def __init__(self, d_in: int, d_out: int, roles: dict[str, str], steps: int) -> None:
        super().__init__(d_in, d_out, roles)
        self.inputs: list[torch.Tensor | None] = [None] * steps
        self.grads: list[torch.Tensor | None] = [None] * steps

    def build(self, module: nn.Module, saved: tuple[torch.Tensor, ...], g: torch.Tensor, names: dict[str, int],
              ctx: BuildContext) -> MatmulGrad:
        a = torch.stack([x for x in self.inputs if x is not None], dim=1)
        # (a step whose projection reached nothing has a zero gradient)
        grads = [gt if gt is not None else a.new_zeros(a.shape[0], self.d_out) for gt in self.grads]
        self.inputs, self.grads = [None] * len(self.inputs), [None] * len(self.grads)
        roles = {role: n for role, n in self.roles.items() if n in names}
        return projection_grad(a, torch.stack(grads, dim=1), self.d_in, self.d_out, roles, ctx.mode, ctx.dtype)


class RecurrentRule(FallbackRule):
    """Any ``nn.RNNBase``: unrolled from tapped projections where it can be, the module
    fallback otherwise (deferred); a sequence-first layer on a batch-first input is refused."""

    kind, types, rewrites = "recurrent", (nn.RNNBase,), True

    def rewrite(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any,
                names: dict[str, int], batched: dict[int, bool], tap: Callable[..., torch.Tensor],
                params_of: Callable[[nn.Module], dict[str, int]], cache: dict[tuple[Any, ...], bool]) -> Any:
        """The recomputed ``(output, h_n)`` / ``(output, (h_n, c_n))`` through tapped projections,
        or None (see the module docstring); ``cache`` keeps the output checks across steps."""
        key = self._key(module, args, kwargs, names)
        if key is None or not isinstance(output, tuple) or not self.confirms(module, args, kwargs, output, batched):
            return None
        return checked_once(cache, key, lambda: _unrolled(module, first_input(args, kwargs), _initial_state(args, kwargs),
                                                          tap, names),  # type: ignore[arg-type]
                            lambda out: same_outputs(out, output))

    def rewrite_ahead(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], names: dict[str, int],
                      tap: Callable[..., torch.Tensor], params_of: Callable[[nn.Module], dict[str, int]],
                      cache: dict[tuple[Any, ...], bool]) -> Any:
        """:meth:`rewrite`'s output without the module's forward, once this call signature has
        been checked."""
        key = self._key(module, args, kwargs, names)
        if key is None or cache.get(key) is not True:
            return None
        return _unrolled(module, first_input(args, kwargs), _initial_state(args, kwargs), tap, names)  # type: ignore[arg-type]

    def confirms(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any,
                 batched: dict[int, bool]) -> bool:
        """The input and ``output`` carry the batch axis first (:meth:`batched`)."""
        outputs = [t for t in optree.tree_leaves(output) if isinstance(t, torch.Tensor)]
        return self.batched(module, args, kwargs, outputs, batched)

    @staticmethod
    def _key(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
             names: dict[str, int]) -> tuple[Any, ...] | None:
        """The call signature the output check is kept for, when the rule may recompute the
        call (the module's own forward on a batch-first ``[B, T, features]`` input, no
        projections, no dropout in training, differentiated parameters); else None."""
        assert isinstance(module, nn.RNNBase)
        x, hx = first_input(args, kwargs), _initial_state(args, kwargs)
        if (type(module).forward not in _FORWARDS or not names or getattr(module, "proj_size", 0)
                or (module.training and module.dropout > 0) or len(args) + len(kwargs) > 2
                or not module.batch_first or not isinstance(x, torch.Tensor) or x.dim() != 3):
            return None
        return ("recurrent", id(module), tuple(x.shape[1:]), x.dtype, hx is None, module.training)

    def claims(self, module: nn.Module) -> bool:
        return isinstance(module, self.types)

    def check(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], batched: dict[int, bool],
              batch: int, differentiated: bool) -> None:
        refuse_sequence_first(module, args, kwargs, batched, batch)

    def batched(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], outputs: list[torch.Tensor],
                batched: dict[int, bool]) -> bool:
        """A batch-first call on ``[B, T, features]`` whose input and ``output`` carry the
        batch first by provenance; ``h_n`` (and ``c_n``) then carry it second, by the
        module's own contract (``[layers * directions, B, hidden]``), not by a size."""
        x = first_input(args, kwargs)
        return (bool(getattr(module, "batch_first", False)) and isinstance(x, torch.Tensor) and x.dim() == 3
                and batched.get(id(x), False) and bool(outputs) and batched.get(id(outputs[0]), False))

    def batch_axes(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], inputs: list[torch.Tensor],
                   outputs: list[torch.Tensor], batched: dict[int, bool]) -> tuple[list[int | None], list[int]]:
        """The input and ``output`` split along their first axis, the initial state ``hx``
        (``h_0``, and ``c_0`` for an LSTM) and ``h_n``/``c_n`` along their second."""
        x, hx = first_input(args, kwargs), _initial_state(args, kwargs)
        states = {id(t) for t in optree.tree_leaves(hx) if isinstance(t, torch.Tensor)} if hx is not None else set()
        ins = [0 if t is x else 1 if id(t) in states else None for t in inputs]
        return ins, [0] + [1] * (len(outputs) - 1)


def _initial_state(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The call's ``hx`` (``h_0``, or ``(h_0, c_0)`` for an LSTM), or None."""
    return args[1] if len(args) > 1 else kwargs.get("hx")


RECURRENT = RecurrentRule()

__all__ = ["RECURRENT", "RecurrentRule"]


def _unrolled(module: nn.RNNBase, x: torch.Tensor, hx: Any, tap: Callable[..., torch.Tensor],
              names: dict[str, int]) -> tuple[torch.Tensor, Any]:
    """The module's forward, step by step, every projection tapped (see the module docstring)."""
    lstm, gru = isinstance(module, nn.LSTM), isinstance(module, nn.GRU)
    dirs = 2 if module.bidirectional else 1
    b, t_len, _ = x.shape
    hidden = module.hidden_size
    if hx is None:
        zeros = x.new_zeros(module.num_layers * dirs, b, hidden)
        h0, c0 = zeros, (zeros if lstm else None)
    else:
        h0, c0 = (hx if lstm else (hx, None))
    layer_in, last_h, last_c = x, [], []
    for layer in range(module.num_layers):
        outs = []
        for d in range(dirs):
            sfx = f"_l{layer}" + ("_reverse" if d == 1 else "")
            w_ih, w_hh = getattr(module, "weight_ih" + sfx), getattr(module, "weight_hh" + sfx)
            b_ih, b_hh = (getattr(module, "bias_ih" + sfx), getattr(module, "bias_hh" + sfx)) if module.bias else (None, None)
            gates = w_ih.shape[0]
            ih_roles = {"weight": "weight_ih" + sfx, **({"bias": "bias_ih" + sfx} if module.bias else {})}
            hh_roles = {"weight": "weight_hh" + sfx, **({"bias": "bias_hh" + sfx} if module.bias else {})}
            used_ih = {n: names[n] for n in ih_roles.values() if n in names}
            used_hh = {n: names[n] for n in hh_roles.values() if n in names}
            ih = tap(InlineLinearRule(layer_in.shape[-1], gates, ih_roles), module, used_ih, layer_in,
                     torch.nn.functional.linear(layer_in, w_ih.detach(), None if b_ih is None else b_ih.detach()))
            steps = _Steps(hidden, gates, hh_roles, t_len)
            h = tap(steps, module, used_hh, h0[layer * dirs + d], h0[layer * dirs + d])
            c = c0[layer * dirs + d] if lstm else None
            w, bias = w_hh.detach(), None if b_hh is None else b_hh.detach()
            seq: list[torch.Tensor | None] = [None] * t_len
            order = range(t_len - 1, -1, -1) if d == 1 else range(t_len)
            for k, t in enumerate(order):
                steps.inputs[k] = h.detach()
                hh = _StepGrad.apply(torch.nn.functional.linear(h, w, bias), steps, k) if used_hh else \
                    torch.nn.functional.linear(h, w, bias)
                xt = ih[:, t]
                if lstm:
                    i, f, g, o = (xt + hh).chunk(4, dim=-1)
                    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                    h = torch.sigmoid(o) * torch.tanh(c)
                elif gru:
                    xr, xz, xn = xt.chunk(3, dim=-1)
                    hr, hz, hn = hh.chunk(3, dim=-1)
                    r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
                    n = torch.tanh(xn + r * hn)
                    h = (1 - z) * n + z * h
                else:
                    pre = xt + hh
                    h = torch.tanh(pre) if module.nonlinearity == "tanh" else torch.relu(pre)
                seq[t] = h
            outs.append(torch.stack(seq, dim=1))  # type: ignore[arg-type]
            last_h.append(h)
            if lstm:
                last_c.append(c)
        layer_in = outs[0] if dirs == 1 else torch.cat(outs, dim=-1)
    h_n = torch.stack(last_h, dim=0)
    return (layer_in, (h_n, torch.stack(last_c, dim=0))) if lstm else (layer_in, h_n)
