"""Backend plumbing shared by the modules of opake_fx.distributed (private).

Which device a collective's bookkeeping tensors live on, whether the backend can move a
tensor, the reduce-op table, and the wrapper that turns backend failures (a crashed or
hung peer) into :class:`~opake_fx.errors.OperationError`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from opake_fx.errors import InputValueError, OpakeError, OperationError

REDUCE_OPS: tuple[str, ...] = ("sum", "mean", "max", "min", "prod")
"""The reductions accepted by ``all_reduce`` and ``reduce_pytree``."""


def resolve_op(op: Any) -> Any:
    """The ``torch.distributed.ReduceOp`` for ``op`` (``"mean"`` maps to SUM; we divide)."""
    table = {
        "sum": dist.ReduceOp.SUM,
        "mean": dist.ReduceOp.SUM,
        "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN,
        "prod": dist.ReduceOp.PRODUCT,
    }
    if not isinstance(op, str) or op not in table:
        raise InputValueError(f"unknown reduction op {op!r}; use one of {list(REDUCE_OPS)}.")
    return table[op]


def backend_needs_cuda() -> bool:
    """``True`` if the default group can only move CUDA tensors (plain nccl)."""
    backend = str(dist.get_backend())
    # A mixed backend such as "cpu:gloo,cuda:nccl" also takes CPU tensors.
    return "nccl" in backend and "cpu:" not in backend


def collective_device(hint: torch.Tensor | None = None) -> torch.device:
    """The device for small bookkeeping tensors (metadata, sizes) in the default group.

    nccl only moves CUDA tensors: the hint's CUDA device, else the current CUDA device.
    Every other backend (gloo, mpi, mixed) takes CPU tensors.
    """
    if backend_needs_cuda():
        if hint is not None and hint.device.type == "cuda":
            return hint.device
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_device(tensor: torch.Tensor, where: str) -> None:
    """Raises a clear error when the backend cannot reduce a tensor on this device."""
    if backend_needs_cuda() and tensor.device.type != "cuda":
        raise OperationError(
            f"{where}: the process group uses nccl, which only reduces CUDA tensors, but this tensor is on "
            f"{tensor.device}. Move your parameters and batches to the rank's GPU (tensor.to(device)), or "
            "initialise the group with backend='gloo' for CPU training."
        )


def run_collective(name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Calls a ``torch.distributed`` collective, turning backend failures into OperationError."""
    try:
        return fn(*args, **kwargs)
    except OpakeError:
        raise
    except RuntimeError as exc:  # DistBackendError and gloo/nccl failures are RuntimeErrors
        raise OperationError(
            f"{name} failed on rank {_rank_and_size()[0]} of {_rank_and_size()[1]}: {exc}. Another rank probably crashed, "
            "hung past the process group's timeout, or called a different collective at this point. Check the "
            "other ranks' logs; every rank must run the same sequence of collectives (the same steps, "
            "the same sync and sum_gradients calls, also for empty batches)."
        ) from exc


def _rank_and_size() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
