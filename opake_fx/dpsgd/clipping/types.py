"""States and diagnostic outputs of the clipping functions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from opake_fx.distributed.state_sync import register_sync_type
from opake_fx.distributed.builtin_sync import sync_clipped_grad_aux, sync_clipping_stats, sync_fixed_clip_state
from opake_fx.errors import InputTypeError
from opake_fx.types import PerGroup

__all__ = ["ClipBackend", "FixedClipState", "ClippingStats", "ClippedGradAux", "check_state"]

#: How per-example norms and the clipped sum are computed (``clip_backend=`` of every
#: clipping function; see :func:`~opake_fx.dpsgd.clipping.clipped_grad`).
ClipBackend = Literal["vmap", "ghost", "auto"]


@dataclass(frozen=True)
class FixedClipState:
    """State of fixed-norm clipping: the clip norm and the number of calls so far.

    Fixed clipping needs no state for its own sake; the state records the clip norm so
    that ``sync`` can check every rank uses the same one.
    """

    clipping_norm: float | PerGroup
    step: int = 0


@dataclass(frozen=True)
class ClippingStats:
    """Aggregate clipping statistics of one call (``return_stats=True``).

    Not private: computed from the raw per-example norms. Log them for debugging only,
    or release them through a DP mechanism of their own.

    Attributes:
        num_clipped: examples whose gradient norm exceeded the clip norm (per group
            name for per-group clipping).
        clipping_rate: ``num_clipped / batch_size`` (0 for an empty batch).
        batch_size: number of examples in the batch.
        num_nonfinite: examples whose gradient had a NaN or inf; they were zeroed.
    """

    num_clipped: float | dict[str, float]
    clipping_rate: float | dict[str, float]
    batch_size: int
    num_nonfinite: int = 0


@dataclass(frozen=True)
class ClippedGradAux:
    """Per-example diagnostics of one call (``return_aux=True``).

    Every field depends on single examples (not private): use them for debugging, or
    aggregate them with a DP mechanism before release.

    Attributes:
        loss_values: per-example losses, shape ``[B]``.
        grad_norms: per-example gradient L2 norms before clipping, ``[B]`` (over all
            groups together for per-group clipping).
        clipped_grad_norms: per-example norms after clipping, ``[B]``.
        loss_aux: the per-example auxiliary output of ``loss_fn`` when ``has_aux``.
        clipping_rate: fraction of examples that were clipped (``None`` per group).
        batch_size: number of examples.
        group_norms: group name -> per-example norms ``[B]``, for per-group clipping.
        num_nonfinite: examples zeroed because their gradient had a NaN or inf.
    """

    loss_values: torch.Tensor
    grad_norms: torch.Tensor
    clipped_grad_norms: torch.Tensor
    loss_aux: Any = None
    clipping_rate: float | None = None
    batch_size: int = 0
    group_norms: dict[str, torch.Tensor] | None = None
    num_nonfinite: int = 0


def check_state(state: Any, cls: type, maker: str) -> None:
    """Raises a clear error unless ``state`` is the ``cls`` that ``maker`` (or the last call) returned.

    Example:
        >>> check_state(None, FixedClipState, "clipped_grad")
        Traceback (most recent call last):
        ...
        opake_fx.errors.InputTypeError: grad_fn needs state=, the FixedClipState returned by clipped_grad (or by the previous grad_fn call); got None. Call grad_fn(*args, state=state) and keep the state it returns.
    """
    if not isinstance(state, cls):
        got = "None" if state is None else type(state).__name__
        raise InputTypeError(
            f"grad_fn needs state=, the {cls.__name__} returned by {maker} (or by the previous grad_fn call); "
            f"got {got}. Call grad_fn(*args, state=state) and keep the state it returns."
        )


register_sync_type(FixedClipState, sync_fixed_clip_state)  # each state type's own sync, where it is defined
register_sync_type(ClippingStats, sync_clipping_stats)
register_sync_type(ClippedGradAux, sync_clipped_grad_aux)
