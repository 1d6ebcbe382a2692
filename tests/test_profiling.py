"""Step timing and memory helpers."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from opake_fx import profiling
from opake_fx.errors import InputValueError, OperationError


def test_time_steps_counts_warmup_and_repeats() -> None:
    calls = []
    t = profiling.time_steps(lambda: calls.append(1), warmup=2, repeats=5)
    assert len(calls) == 7 and t.repeats == 5 and t.warmup == 2
    assert t.min <= t.median <= t.max and t.stdev >= 0


def test_time_steps_measures_sleep() -> None:
    t = profiling.time_steps(lambda: time.sleep(0.01), warmup=0, repeats=3)
    assert 0.009 <= t.median < 0.5


def test_interleaved_runs_round_robin() -> None:
    order: list[str] = []
    out = profiling.time_interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, warmup=1, repeats=2)
    assert order == ["a", "b"] * 3
    assert set(out) == {"a", "b"} and out["b"].repeats == 2


def test_interleaved_settle_calls_are_untimed() -> None:
    order: list[str] = []
    slow = {"calls": 0}

    def a() -> None:  # the first call of each turn is slow; the timed one must not be
        order.append("a")
        slow["calls"] += 1
        if slow["calls"] % 2 == 1:
            time.sleep(0.05)

    out = profiling.time_interleaved({"a": a, "b": lambda: order.append("b")}, warmup=0, repeats=3, settle=1)
    assert order == ["a", "a", "b", "b"] * 3
    assert len(out["a"].samples) == 3 and out["a"].max < 0.04


@pytest.mark.parametrize("bad", [dict(warmup=-1), dict(repeats=0), dict(repeats=True), dict(settle=-1)])
def test_bad_arguments(bad: dict) -> None:
    if "settle" not in bad:
        with pytest.raises(InputValueError):
            profiling.time_steps(lambda: None, **bad)
    with pytest.raises(InputValueError):
        profiling.time_interleaved({"a": lambda: None}, **bad)
    with pytest.raises(InputValueError):
        profiling.time_interleaved({})


def test_rss_helpers_are_consistent() -> None:
    assert profiling.current_rss() > 0
    profiling.reset_peak_rss()
    before = profiling.peak_rss()
    x = torch.ones(64 * 2**20 // 4)  # 64 MiB
    x += 1
    assert profiling.peak_rss() >= before
    assert profiling.peak_rss() >= profiling.current_rss() - 2**20
    del x


def test_subprocess_peak_sees_a_step_allocation(tmp_path: Path) -> None:
    target = tmp_path / "alloc.py"
    target.write_text(
        "import torch\n"
        "def setup(mb):\n"
        "    def step():\n"
        "        x = torch.ones(mb * 2**20 // 4)\n"
        "        x += 1\n"
        "    return step\n"
    )
    big = profiling.peak_rss_in_subprocess(f"{target}:setup", {"mb": 96}, steps=2)
    small = profiling.peak_rss_in_subprocess(f"{target}:setup", {"mb": 4}, steps=2)
    assert big["delta"] >= 90 * 2**20
    assert small["delta"] < 40 * 2**20
    assert big["peak"] >= big["baseline"]


def test_subprocess_failure_is_reported(tmp_path: Path) -> None:
    target = tmp_path / "boom.py"
    target.write_text("def setup():\n    raise RuntimeError('boom')\n")
    with pytest.raises(OperationError, match="boom"):
        profiling.peak_rss_in_subprocess(f"{target}:setup")
    with pytest.raises(InputValueError):
        profiling.peak_rss_in_subprocess("no_function_here")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_memory() -> None:
    peak = profiling.cuda_peak_memory(lambda: torch.ones(2**20, device="cuda").sum())
    assert peak >= 4 * 2**20


def test_cuda_peak_memory_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(OperationError):
        profiling.cuda_peak_memory(lambda: None)


def test_subprocess_warmup_runs_before_the_baseline(tmp_path: Path) -> None:
    # A one-off allocation kept by the first call is part of the baseline after a warm-up.
    target = tmp_path / "once.py"
    target.write_text(
        "import torch\n"
        "kept = []\n"
        "def setup():\n"
        "    def step():\n"
        "        if not kept:\n"
        "            kept.append(torch.ones(64 * 2**20 // 4))\n"
        "    return step\n"
    )
    cold = profiling.peak_rss_in_subprocess(f"{target}:setup", steps=1)
    warm = profiling.peak_rss_in_subprocess(f"{target}:setup", steps=1, warmup=1)
    assert cold["delta"] >= 60 * 2**20 > warm["delta"]
