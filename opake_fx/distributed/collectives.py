"""Thin, checked wrappers over ``torch.distributed``: ranks, barriers and all-reduce.

Every function works in a single process too: :func:`is_distributed` is ``False``, the
rank is 0, the world size 1, and :func:`barrier` is a no-op. The all-reduce functions
are the exception: reducing "across ranks" without a process group is almost always a
setup bug, so they raise :class:`~opake_fx.errors.OperationError` (use
:func:`opake_fx.distributed.reduce_pytree`, which is the identity in one process, for code
that must run on 1 or N ranks).

Collectives run on the tensors' own device, so the same code works with ``gloo`` on CPU
and ``nccl`` on CUDA. A collective that fails because another rank crashed, hung past
the process-group timeout, or called a different collective is re-raised as an
``OperationError`` that says so.

Example:
    >>> get_rank(), get_world_size(), is_distributed()
    (0, 1, False)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from opake_fx.distributed._backend import REDUCE_OPS, check_device, resolve_op, run_collective
from opake_fx.errors import InputTypeError, OperationError

__all__ = [
    "is_distributed",
    "get_rank",
    "get_world_size",
    "is_main_process",
    "barrier",
    "all_reduce",
    "all_reduce_",
    "REDUCE_OPS",
]



def is_distributed() -> bool:
    """``True`` if ``torch.distributed`` is available and a process group is initialised.

    Privacy: none (a query about the runtime).

    Example:
        >>> is_distributed()
        False
    """
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """The rank of this process in the default group (0 when not distributed).

    Privacy: none.

    Example:
        >>> get_rank()
        0
    """
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    """The number of processes in the default group (1 when not distributed).

    Privacy: none.

    Example:
        >>> get_world_size()
        1
    """
    return dist.get_world_size() if is_distributed() else 1


def is_main_process() -> bool:
    """``True`` on rank 0 (and in a single process): the rank that logs and saves.

    Privacy: none. Only log values that are already private (noised parameters,
    accountant outputs) or that you accept to leak (per-rank diagnostics are not private).

    Example:
        >>> is_main_process()
        True
    """
    return get_rank() == 0


def barrier() -> None:
    """Blocks until every rank reaches this call (a no-op when not distributed).

    Privacy: none.

    Raises:
        OperationError: if another rank crashed or did not arrive within the process
            group's timeout.

    Example:
        >>> barrier()  # returns at once in a single process
    """
    if is_distributed():
        run_collective("barrier", dist.barrier)


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Returns a reduced copy of ``tensor``; the input is unchanged.

    Args:
        tensor: the local value (same shape and dtype on every rank).
        op: one of ``"sum"``, ``"mean"``, ``"max"``, ``"min"``, ``"prod"``.

    Returns:
        A new tensor on ``tensor.device`` holding the reduction over all ranks.

    Raises:
        InputValueError: if ``op`` is not one of :data:`REDUCE_OPS` (a ``ValueError``).
        OperationError: if no process group is initialised, or the collective failed.

    Privacy:
        None by itself: all-reducing raw gradients or statistics shares them between
        ranks unprotected. For DP gradients use
        :func:`opake_fx.distributed.sum_gradients` on the clipped gradient, which keeps
        and checks its sensitivity.

    Example:
        >>> import torch
        >>> all_reduce(torch.ones(2), op="sum")  # doctest: +SKIP
        tensor([2., 2.])    # with two ranks
    """
    _check_tensor(tensor, "all_reduce")
    reduced = tensor.detach().clone()
    all_reduce_(reduced, op=op)
    return reduced


def all_reduce_(tensor: torch.Tensor, op: str = "sum") -> None:
    """All-reduces ``tensor`` across ranks in place.

    ``"mean"`` is a sum followed by division by the world size (so it works on every
    backend, including gloo, which has no native average); it needs a floating-point
    or complex tensor.

    Args:
        tensor: the local value, overwritten with the reduction over all ranks.
        op: one of ``"sum"``, ``"mean"``, ``"max"``, ``"min"``, ``"prod"``.

    Raises:
        InputValueError: if ``op`` is unknown (checked first, also in one process).
        InputTypeError: if ``tensor`` is not a tensor, or ``"mean"`` of an integer tensor.
        OperationError: if no process group is initialised, if the backend cannot
            reduce tensors on this device (nccl needs CUDA tensors), or if the collective
            failed (another rank crashed or timed out).

    Privacy:
        None by itself; see :func:`all_reduce`.

    Example:
        >>> import torch
        >>> t = torch.ones(2)
        >>> all_reduce_(t, op="max")  # doctest: +SKIP
    """
    reduce_op = resolve_op(op)
    _check_tensor(tensor, "all_reduce_")
    if op == "mean" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise InputTypeError(
            f"all_reduce_(op='mean') needs a floating-point tensor to hold the average; got {tensor.dtype}. "
            "Cast it first (tensor.float()) or reduce with op='sum' and divide yourself."
        )
    if not is_distributed():
        raise OperationError(
            "all_reduce_ needs an initialised process group, but torch.distributed is not initialized. "
            "Call torch.distributed.init_process_group() first (torchrun sets the environment), or use "
            "opake_fx.distributed.reduce_pytree, which is the identity in a single process."
        )
    check_device(tensor, "all_reduce_")
    with torch.no_grad():
        run_collective(f"all_reduce(op={op!r})", dist.all_reduce, tensor, op=reduce_op)
        if op == "mean":
            tensor.div_(get_world_size())


def _check_tensor(tensor: Any, where: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise InputTypeError(
            f"{where} expects a torch.Tensor; got {type(tensor).__name__}. For a pytree of tensors "
            "(gradients, a ClippedPytree) use opake_fx.distributed.reduce_pytree or sum_gradients."
        )
