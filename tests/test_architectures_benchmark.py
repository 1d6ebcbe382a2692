"""benchmarks/architectures.py builds and steps every workload it can (a smoke test: the
timings are printed by the script, never asserted)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[1]
ISSUE_29 = ["opt", "gemma", "falcon", "distilbert", "deberta-v2", "bart", "gpt2-default-positions", "bigru", "convnext"]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("architectures", ROOT / "benchmarks" / "architectures.py")
    module = importlib.util.module_from_spec(spec)
    # Registered while the tests run: torch.compile (the compiled variant) imports the
    # module of the functions it traces by name.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_issue_29_workloads_listed(bench):
    assert bench.WORKLOADS[-len(ISSUE_29):] == ISSUE_29 == list(bench.ISSUE_29)


@pytest.mark.parametrize("workload", ["torch-encoder", "gpt2-full", "gpt2-lora", "bert-cls"] + ISSUE_29)
def test_each_workload_steps(bench, workload, monkeypatch):
    if not bench.available(workload):
        pytest.skip("needs the hf extra")
    monkeypatch.setattr(bench, "B", 4)
    monkeypatch.setattr(bench, "T", 16)
    variants = ("non-private", "floor", "opake-auto") if workload not in ISSUE_29 else ("non-private", "opake-auto")
    _step_variants(bench, workload, variants)


@pytest.mark.slow
def test_the_compiled_variant_steps(bench, monkeypatch):
    """The compiled column (torch.compile of the whole step: ~30 s of compiling on 2 cores, hence slow)."""
    monkeypatch.setattr(bench, "B", 4)
    monkeypatch.setattr(bench, "T", 16)
    _step_variants(bench, "torch-encoder", ("opake-auto-compiled",))


def _step_variants(bench, workload, variants):
    threads = torch.get_num_threads()
    try:
        for variant in variants:
            bench.setup_step(workload, variant)()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("workload, breaks", [("torch-encoder", 0), ("llama", 0)])
def test_graph_breaks_of_the_compiled_auto_step(bench, workload, breaks, monkeypatch):
    """--breaks: the compiled auto step of a torch encoder and a tiny Llama is one graph."""
    if not bench.available(workload):
        pytest.skip("needs the hf extra")
    monkeypatch.setattr(bench, "B", 4)
    monkeypatch.setattr(bench, "T", 16)
    graphs, found, reasons = bench.graph_breaks(workload)
    assert (graphs, found) == (1, breaks), reasons
