"""A rank that dies or hangs makes the others fail with a clear error, in bounded time."""

from __future__ import annotations

import os
import time

import pytest
import torch

import opake_fx.distributed as od
from opake_fx.dpsgd.clipping import clipped_grad
from tests.distributed._harness import RankGroup, RankTimeout


def _crash_mid_step(rank: int, world_size: int) -> dict:
    grad_fn, state = clipped_grad(lambda p, x: ((x - p) ** 2).sum(), clipping_norm=1.0)
    grads, state = grad_fn(torch.zeros(3), torch.randn(4, 3), state=state)
    if rank == 1:
        os._exit(3)  # dies between clipping and aggregation, without a word
    start = time.monotonic()
    try:
        od.sum_gradients_(grads)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return {"error": type(exc).__name__, "message": str(exc), "after": time.monotonic() - start}
    return {"error": None}


@pytest.mark.distributed
def test_crashed_rank_fails_the_others_with_a_clear_error():
    with RankGroup(2, pg_timeout=10.0) as group:
        outs = group.outcomes(_crash_mid_step, timeout=30)
    assert outs[1].status == "died" and "exit code 3" in outs[1].value
    assert outs[0].status == "ok", outs[0].value
    result = outs[0].value
    assert result["error"] == "OperationError"
    assert "failed on rank 0 of 2" in result["message"] and "crashed" in result["message"]
    assert result["after"] < 10.0 + 5.0  # within the process group timeout


def _hang(rank: int, world_size: int, sleep_s: float) -> dict:
    if rank == 1:
        time.sleep(sleep_s)  # never reaches the collective in time
        return {"slept": True}
    start = time.monotonic()
    try:
        od.all_reduce(torch.ones(1))
    except Exception as exc:  # noqa: BLE001
        return {"error": type(exc).__name__, "message": str(exc), "after": time.monotonic() - start}
    return {"error": None}


@pytest.mark.distributed
def test_hung_rank_times_out_and_the_harness_never_hangs():
    with RankGroup(2, pg_timeout=3.0) as group:
        r0, r1 = group.run(_hang, 4.0, timeout=30)
        assert r0["error"] == "OperationError" and "hung past the process group's timeout" in r0["message"]
        assert 2.5 <= r0["after"] < 8.0 and r1 == {"slept": True}
    with RankGroup(2, pg_timeout=3.0) as group:
        start = time.monotonic()
        with pytest.raises(RankTimeout, match="did not finish within 2s"):
            group.run(_hang, 120.0, timeout=2)
        assert time.monotonic() - start < 15.0  # stuck ranks are killed, not awaited
        assert group.broken
