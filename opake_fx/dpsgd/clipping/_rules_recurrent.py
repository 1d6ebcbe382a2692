"""Recurrent layers (``nn.RNN`` / ``nn.LSTM`` / ``nn.GRU``): an exact routed fallback.

A recurrent layer's per-example weight gradient sums over time steps through the
recurrence, with no closed form cheaper than the gradient itself, so its calls take the
module fallback (:mod:`._rules_fallback`: the module's vjp per example, ``vmap`` or an
exact loop where ``vmap`` has no batching rule, e.g. a float64 LSTM) with a
:class:`~opake_fx.errors.SlowPathWarning`. What this entry adds is the routing: a
``batch_first`` call whose input and ``output`` carry the batch first (by provenance) is
split per example there, and its initial state and ``h_n``/``c_n`` along their second
axis, by the module's contract ``[layers * directions, B, hidden]`` (before, ``h_n``'s
shape made the call undecidable and the weights took the whole-loss fallback: the whole
model once per example). ``batch_first=False`` on a batch-first input, which would run the
recurrence along the batch and mix examples, is refused with an error. Packed sequences
(flat ``data``) stay undecidable: the whole-loss fallback, exact.

Privacy contract: as the module fallback's (certified norms of the stored per-example
gradients that the weighted sum reads): each example's contribution is at most ``C`` as
computed in floating point.
"""

from __future__ import annotations

from typing import Any

import optree
import torch
from torch import nn

from opake_fx.dpsgd.clipping._rule import first_input, refuse_sequence_first
from opake_fx.dpsgd.clipping._rules_fallback import FallbackRule


class RecurrentRule(FallbackRule):
    """Any ``nn.RNNBase`` (also subclasses with their own ``forward``): the module fallback,
    refusing a sequence-first layer on a batch-first input."""

    kind, types = "recurrent", (nn.RNNBase,)

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
        x = first_input(args, kwargs)
        hx = args[1] if len(args) > 1 else kwargs.get("hx")
        states = {id(t) for t in optree.tree_leaves(hx) if isinstance(t, torch.Tensor)} if hx is not None else set()
        ins = [0 if t is x else 1 if id(t) in states else None for t in inputs]
        return ins, [0] + [1] * (len(outputs) - 1)


RECURRENT = RecurrentRule()

__all__ = ["RECURRENT", "RecurrentRule"]
