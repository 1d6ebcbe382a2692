"""Recurrent layers (``nn.RNN`` / ``nn.LSTM`` / ``nn.GRU``): an exact routed fallback.

A recurrent layer's per-example weight gradient sums over time steps through the
recurrence, with no closed form cheaper than the gradient itself, so its calls take the
module fallback (:mod:`._rules_fallback`: the module's vjp per example, ``vmap`` or an
exact loop where ``vmap`` has no batching rule, e.g. a float64 LSTM) with a
:class:`~opake_fx.errors.SlowPathWarning`. What this entry adds is the routing: the batch
axis of every input and output (``h_n`` and ``c_n`` carry the batch second) is decided by
provenance, and ``batch_first=False`` on a batch-first input, which would run the
recurrence along the batch and mix examples, is refused with an error.

Privacy contract: as the module fallback's (certified norms of the stored per-example
gradients that the weighted sum reads): each example's contribution is at most ``C`` as
computed in floating point.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from opake_fx.dpsgd.clipping._rule import refuse_sequence_first
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


RECURRENT = RecurrentRule()

__all__ = ["RECURRENT", "RecurrentRule"]
