"""Smoke test of examples/dpftrl_digits.py at a tiny budget: plans, calibrates, trains both, accounts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("sklearn")


def test_dpftrl_example_runs_and_spends_at_most_its_budget(capsys):
    spec = importlib.util.spec_from_file_location("dpftrl_digits", Path(__file__).parents[2] / "examples" / "dpftrl_digits.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    results = example.main(["--epochs", "1", "--seeds", "1", "--bands", "2", "4", "--epsilon", "4"])
    out = capsys.readouterr().out
    assert "chosen" in out and "test accuracy bandmf" in out
    assert len(results["dpsgd"]) == 1 and len(results["bandmf"]) == 1
    assert max(results["epsilon_dpsgd"] + results["epsilon_bandmf"]) <= 4.0
