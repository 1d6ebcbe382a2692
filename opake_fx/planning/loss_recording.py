"""A clip stage whose state also records the step's per-example losses (for logging)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["RecordedLossState", "loss_recording"]


@dataclass(frozen=True)
class RecordedLossState:
    """The state of a clip stage built by ``DPPlan.pipeline(..., record_loss=True)``.

    Attributes:
        clip_state: the clipping function's own state (``FixedClipState``,
            ``AdaptiveClipState``), as the plain stage keeps it.
        loss_sum: 0-d float64 tensor, the sum of the last step's per-example losses over
            its real examples (padding rows of a compiled step left out), from the forward
            pass the clipping itself ran: at the parameters the step was computed at.
        loss_count: 0-d float64 tensor, the number of those examples (0 for an empty batch).

    **Not private**: a training loss of the batch's examples, on this rank only (sum the
    pairs over ranks for the global mean). Read on the host (``float``) only when logging:
    the step itself never reads it.
    """

    clip_state: Any
    loss_sum: Any
    loss_count: Any


def loss_recording(factory: Callable[..., Any], maker: Callable[..., Any], loss_fn: Callable[..., Any],
                   clip_args: dict[str, Any]) -> Any:
    """The clip stage of ``factory`` whose state also records the step's per-example losses.

    ``maker`` is the clipping function's maker of the same mode (``clipped_grad`` for
    ``clip``, ...: :meth:`opake_fx.planning.clip_modes.base.ClipMode.grad_maker`). The
    clipping function is built with ``has_aux=True`` and a loss returning its own values
    (detached) as the per-example aux, which the clipping concatenates over microbatches
    without reading anything on the host; the stage strips the aux from its output.

    Privacy: the clip stage's own (its privacy statement is that of ``factory``'s stage);
    the recorded losses are NOT private (see :class:`RecordedLossState`).
    """
    import optree
    import torch

    from opake_fx.dpsgd.clipping import as_stage
    from opake_fx.pytree import NAMESPACE
    from opake_fx.transforms import Transform

    # the privacy statement of the stage this one stands for (built, not run: it draws nothing)
    privacy = factory(loss_fn, **clip_args).privacy

    def with_values(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        losses = loss_fn(*args, **kwargs)
        return losses, losses.detach()

    grad_fn, clip_state = maker(with_values, argnums=0, has_aux=True, **clip_args)

    def recording(params: Any, *batch: Any, state: RecordedLossState, example_mask: Any = None) -> tuple[Any, Any]:
        masked = {} if example_mask is None else {"example_mask": example_mask}
        (out, values), inner = grad_fn(params, *batch, state=state.clip_state, **masked)
        if values is None:  # an empty batch
            total, count = torch.zeros_like(state.loss_sum), torch.zeros_like(state.loss_count)
        else:
            values = values.detach().to(torch.float64)
            if example_mask is None:
                total, count = values.sum(), torch.tensor(float(values.shape[0]), dtype=torch.float64, device=values.device)
            else:
                real = example_mask.to(values.device)
                total = torch.where(real, values, torch.zeros((), dtype=values.dtype, device=values.device)).sum()
                count = real.to(torch.float64).sum()
        return out, RecordedLossState(inner, total, count)

    stage = as_stage(recording, None, batch_argnums=clip_args["batch_argnums"], privacy=privacy)

    def init(params: Any) -> RecordedLossState:
        leaves = optree.tree_leaves(params, namespace=NAMESPACE) if params is not None else []
        device = leaves[0].device if leaves and isinstance(leaves[0], torch.Tensor) else None
        zero = torch.zeros((), dtype=torch.float64, device=device)
        return RecordedLossState(clip_state, zero, zero.clone())

    return Transform(init, stage.update, stage.privacy)
