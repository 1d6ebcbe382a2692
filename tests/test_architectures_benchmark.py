"""benchmarks/architectures.py builds and steps every workload it can (a smoke test: the
timings are printed by the script, never asserted)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("architectures", ROOT / "benchmarks" / "architectures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("workload", ["torch-encoder", "gpt2-full", "gpt2-lora", "bert-cls"])
def test_each_workload_steps(bench, workload, monkeypatch):
    if not bench.available(workload):
        pytest.skip("needs the hf extra")
    monkeypatch.setattr(bench, "B", 4)
    monkeypatch.setattr(bench, "T", 16)
    threads = torch.get_num_threads()
    try:
        for variant in ("non-private", "floor", "opake-auto") + (("opake-auto-compiled",) if workload == "torch-encoder" else ()):
            bench.setup_step(workload, variant)()
    finally:
        torch.set_num_threads(threads)
