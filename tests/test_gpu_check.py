"""benchmarks/gpu_check.py, the script a GPU session runs, passes its checks on the CPU
(and on CUDA where there is one), and its checks can fail."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def gpu_check():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_checks_pass_on_cpu(gpu_check):
    report = gpu_check.run_checks("cpu")
    assert report.ok, "\n".join(line for line in report.lines if line.startswith("FAIL"))
    # 6 model kinds x (3 backends + microbatching + float32) + 2 layer-rule checks + 3 certified-norm checks
    # + the float32 Gram norms against float64 + 2 attacks x 2 backends refused by the independence guard
    # + noise drawn ahead + 3 noise checks + the compiled step against the eager one
    assert len(report.lines) == 6 * 5 + 2 + 3 + 1 + 4 + 1 + 3 + 1
    assert any(line.startswith("PASS") and "compiled step" in line for line in report.lines)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_checks_pass_on_cuda(gpu_check):
    report = gpu_check.run_checks("cuda")
    assert report.ok, "\n".join(line for line in report.lines if line.startswith("FAIL"))


def test_a_wrong_clipped_sum_is_reported(gpu_check, monkeypatch):
    original = gpu_check._run

    def off_by_a_little(*args, **kwargs):
        got, norms = original(*args, **kwargs)
        return [g * (1 + 1e-6) for g in got], norms

    monkeypatch.setattr(gpu_check, "_run", off_by_a_little)
    report = gpu_check.Report()
    gpu_check.check_clipping("cpu", report)
    assert not report.ok
    assert any(line.startswith("FAIL  clipping float64") for line in report.lines)


def test_an_accepted_mixing_model_is_reported(gpu_check, monkeypatch):
    from opake_fx.dpsgd.clipping import _provenance

    monkeypatch.setattr(_provenance, "check_independence", lambda *a, **k: None)  # a guard that accepts everything
    report = gpu_check.Report()
    gpu_check.check_independence("cpu", report)
    assert len(report.lines) == 4 and all(line.startswith("FAIL") for line in report.lines)


def test_the_gpt2_timing_runs_on_a_tiny_config(gpu_check):
    pytest.importorskip("transformers")
    tiny = dict(n_layer=1, n_embd=16, n_head=2, vocab_size=40, n_positions=16)
    eager = tuple(v for v in gpu_check.GPT2_VARIANTS if not v.endswith("-compiled"))
    rows = gpu_check.time_gpt2("cpu", batch=3, seq=8, config=tiny, steps=1, variants=eager)
    by = {r["variant"]: r for r in rows}
    assert list(by) == list(eager)
    for v in ("non-private", "opake-vmap", "opake-auto"):
        assert by[v]["error"] == "" and by[v]["ms"] > 0 and by[v]["launches"] == 0  # no CUDA kernels on the CPU
    assert by["non-private"]["ratio"] == 1.0
    assert "| opake-auto |" in gpu_check.gpt2_table(rows)


@pytest.mark.slow
def test_the_compiled_gpt2_variants_run_on_a_tiny_config(gpu_check):
    pytest.importorskip("transformers")
    tiny = dict(n_layer=1, n_embd=16, n_head=2, vocab_size=40, n_positions=16)
    compiled = ("non-private", "opake-vmap-compiled", "opake-auto-compiled")
    rows = gpu_check.time_gpt2("cpu", batch=3, seq=8, config=tiny, steps=1, variants=compiled)
    for r in rows:
        assert r["error"] == "" and r["ms"] > 0 and r["warmup_s"] > 0, r
    assert "first 2 steps (s)" in gpu_check.gpt2_table(rows)
