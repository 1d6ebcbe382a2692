"""Collecting evaluation values from every rank: :func:`gather_for_metrics`."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from opake_fx.distributed._checks import gather_float_rows
from opake_fx.distributed._backend import collective_device, run_collective
from opake_fx.distributed.collectives import get_world_size, is_distributed
from opake_fx.errors import DistributedMismatchError, InputTypeError
from opake_fx.pytree import assert_tensor_leaves, tree_map

__all__ = ["gather_for_metrics"]

_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)


def gather_for_metrics(tensors: Any) -> Any:
    """All-gathers tensors whose first dimension may differ across ranks, concatenated in rank order.

    Each rank passes its local tensor (e.g. predictions of shape ``[n_rank, ...]``, with
    ``n_rank`` possibly 0); every rank receives ``torch.cat([t_0, t_1, ...])`` on the
    input's device. The trailing dimensions and dtype must agree across the ranks that
    hold rows (a rank with zero rows may send an empty tensor of any dtype). A 0-dim
    tensor counts as one row. A pytree of tensors is gathered leaf by leaf. In a single
    process the input is returned (0-dim tensors as shape ``[1]``).

    Args:
        tensors: a tensor or a pytree of tensors.

    Returns:
        The gathered tensor(s), on the same device(s) as the input.

    Raises:
        InputTypeError: a non-tensor leaf or an unsupported dtype.
        DistributedMismatchError: trailing shapes or dtypes differ across ranks.
        OperationError: a collective failed.

    Privacy:
        None: this shares per-example values between ranks. Use it for evaluation on
        public or held-out data, or release its result through a DP mechanism.

    Example:
        >>> import torch
        >>> gather_for_metrics(torch.tensor([1.0, 2.0])).tolist()   # one process
        [1.0, 2.0]
    """
    if isinstance(tensors, torch.Tensor):
        return _gather_one(tensors)
    assert_tensor_leaves(tensors, what="gather_for_metrics input")
    return tree_map(_gather_one, tensors)


def _gather_one(t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 0:
        t = t.unsqueeze(0)
    if t.dtype not in _DTYPES:
        raise InputTypeError(f"gather_for_metrics cannot gather {t.dtype} tensors; cast to one of {list(_DTYPES)}.")
    if not is_distributed():
        return t
    t = t.detach()  # the gathered values are data, not part of any graph
    device = collective_device(t)
    rows = gather_float_rows([float(t.shape[0]), float(_DTYPES.index(t.dtype)), *map(float, t.shape[1:])], device=device)
    filled = [(r, row) for r, row in enumerate(rows) if row[0] > 0]
    if not filled:
        return t
    ref_rank, ref = filled[0]
    for r, row in filled[1:]:
        if row[1:] != ref[1:]:
            raise DistributedMismatchError(
                f"gather_for_metrics: rank {ref_rank} sends rows of shape {_describe(ref)} but rank {r} sends "
                f"{_describe(row)}. Every rank must gather tensors with the same trailing shape and dtype."
            )
    dtype = _DTYPES[int(ref[1])]
    trailing = tuple(int(x) for x in ref[2:])
    longest = int(max(row[0] for row in rows))
    wire_dtype = torch.uint8 if dtype == torch.bool else dtype  # bool is not a wire type everywhere
    buf = torch.zeros((longest, *trailing), dtype=wire_dtype, device=device)
    if t.shape[0] > 0:
        buf[: t.shape[0]] = t.to(device=device, dtype=wire_dtype)
    out = [torch.empty_like(buf) for _ in range(get_world_size())]
    run_collective("gather_for_metrics", dist.all_gather, out, buf)
    parts = [o[: int(row[0])] for o, row in zip(out, rows)]
    return torch.cat(parts).to(device=t.device, dtype=dtype)


def _describe(row: list[float]) -> str:
    return f"[n, {', '.join(str(int(x)) for x in row[2:])}] of {_DTYPES[int(row[1])]}"
