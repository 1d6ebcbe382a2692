"""collectives and gather_for_metrics: single-process semantics and real 2-rank gloo groups."""

from __future__ import annotations

import pytest
import torch

import opake_fx.distributed as od
from opake_fx.distributed.collectives import all_reduce_
from opake_fx.errors import DistributedMismatchError, InputTypeError, InputValueError, OperationError

# --- single process -------------------------------------------------------------------


def test_single_process_queries():
    assert not od.is_distributed()
    assert (od.get_rank(), od.get_world_size(), od.is_main_process()) == (0, 1, True)
    od.barrier()  # a no-op, must not raise


def test_all_reduce_needs_a_process_group():
    with pytest.raises(OperationError, match="init_process_group"):
        od.all_reduce(torch.ones(2))
    with pytest.raises(OperationError, match="not initialized"):
        all_reduce_(torch.ones(2), op="max")


@pytest.mark.parametrize("bad", ["avg", "SUM", "", None, 3])
def test_unknown_op_is_a_value_error_before_the_group_check(bad):
    with pytest.raises(InputValueError, match="unknown reduction op") as info:
        od.all_reduce_(torch.ones(1), op=bad)
    assert isinstance(info.value, ValueError)


def test_all_reduce_rejects_non_tensors_and_integer_mean():
    with pytest.raises(InputTypeError, match="reduce_pytree"):
        od.all_reduce([1.0, 2.0])
    with pytest.raises(InputTypeError, match="floating-point"):
        od.all_reduce_(torch.ones(2, dtype=torch.int64), op="mean")


def test_gather_for_metrics_single_process():
    t = torch.arange(3.0)
    assert od.gather_for_metrics(t) is t
    assert od.gather_for_metrics(torch.tensor(5.0)).tolist() == [5.0]
    tree = od.gather_for_metrics({"a": torch.ones(2), "b": (torch.zeros(1, 3),)})
    assert tree["a"].tolist() == [1.0, 1.0] and tree["b"][0].shape == (1, 3)
    with pytest.raises(InputTypeError, match="path"):
        od.gather_for_metrics({"a": 1.0})


# --- two ranks ------------------------------------------------------------------------


def _core(rank: int, world_size: int) -> dict:
    out = {
        "is_distributed": od.is_distributed(),
        "rank": od.get_rank(),
        "world_size": od.get_world_size(),
        "main": od.is_main_process(),
        "shard": list(od.local_shard(range(5)).indices),  # rank and world size from the group
    }
    od.barrier()
    return out


@pytest.mark.distributed
def test_core_queries(group2):
    assert group2.run(_core) == [
        {"is_distributed": True, "rank": 0, "world_size": 2, "main": True, "shard": [0, 1]},
        {"is_distributed": True, "rank": 1, "world_size": 2, "main": False, "shard": [2, 3, 4]},
    ]


def _reductions(rank: int, world_size: int) -> dict:
    local = torch.tensor([1.0 + rank, 10.0 - 3 * rank, -2.0])  # rank 0: [1, 10, -2], rank 1: [2, 7, -2]
    out = {op: od.all_reduce(local, op=op).tolist() for op in od.REDUCE_OPS}
    out["input unchanged"] = local.tolist() == [1.0 + rank, 10.0 - 3 * rank, -2.0]
    inplace = local.clone()
    od.all_reduce_(inplace, op="sum")
    out["in place"] = inplace.tolist()
    ints = torch.tensor([rank + 1, 5], dtype=torch.int64)
    od.all_reduce_(ints, op="prod")
    out["int prod"] = ints.tolist()
    try:
        od.all_reduce_(local.clone(), op="median")
    except InputValueError as exc:
        out["unknown op"] = str(exc)
    return out


@pytest.mark.distributed
def test_all_reduce_ops(group2):
    r0, r1 = group2.run(_reductions)
    assert r0 == r1
    assert r0["sum"] == [3.0, 17.0, -4.0]
    assert r0["mean"] == [1.5, 8.5, -2.0]
    assert r0["max"] == [2.0, 10.0, -2.0]
    assert r0["min"] == [1.0, 7.0, -2.0]
    assert r0["prod"] == [2.0, 70.0, 4.0]
    assert r0["input unchanged"] and r0["in place"] == [3.0, 17.0, -4.0]
    assert r0["int prod"] == [2, 25]
    assert "median" in r0["unknown op"]


def _gather(rank: int, world_size: int) -> dict:
    out: dict = {}
    rows = torch.arange(3.0 + 2 * rank).reshape(-1, 1).repeat(1, 2) + 100 * rank  # 3 rows, then 5 rows
    out["rows"] = od.gather_for_metrics(rows).tolist()
    out["scalar"] = od.gather_for_metrics(torch.tensor(float(rank))).tolist()
    empty_here = torch.ones(4, dtype=torch.bool) if rank == 0 else torch.zeros(0, dtype=torch.float32)
    gathered = od.gather_for_metrics(empty_here)
    out["empty rank"] = (gathered.dtype == torch.bool, gathered.tolist())
    out["tree"] = {k: v.tolist() for k, v in od.gather_for_metrics({"p": torch.full((rank + 1,), rank)}).items()}
    try:
        od.gather_for_metrics(torch.zeros(2, 3 + rank))
    except DistributedMismatchError as exc:
        out["shape mismatch"] = str(exc)
    try:
        od.gather_for_metrics(torch.zeros(2, dtype=torch.float32 if rank == 0 else torch.float64))
    except DistributedMismatchError as exc:
        out["dtype mismatch"] = str(exc)
    out["still usable"] = od.all_reduce(torch.ones(1)).item()
    return out


@pytest.mark.distributed
def test_gather_for_metrics(group2):
    r0, r1 = group2.run(_gather)
    assert r0 == r1
    expected_rows = [[float(i), float(i)] for i in range(3)] + [[100.0 + i, 100.0 + i] for i in range(5)]
    assert r0["rows"] == expected_rows
    assert r0["scalar"] == [0.0, 1.0]
    assert r0["empty rank"] == (True, [True] * 4)
    assert r0["tree"] == {"p": [0, 1, 1]}
    assert "rank 0" in r0["shape mismatch"] and "rank 1" in r0["shape mismatch"]
    assert "float64" in r0["dtype mismatch"]
    assert r0["still usable"] == 2.0
