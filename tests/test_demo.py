"""Smoke test of `make demo`'s script at a tiny budget: it calibrates, trains, accounts and reports."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

pytest.importorskip("sklearn")


def test_demo_runs_and_spends_at_most_its_budget(capsys):
    spec = importlib.util.spec_from_file_location("demo", Path(__file__).parents[1] / "examples" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    demo.main(["--epochs", "2", "--epsilon", "1.0"])
    out = capsys.readouterr().out
    final = float(re.search(r"final epsilon ([0-9.]+)", out).group(1))
    assert 0.95 <= final <= 1.0
    dp_acc = float(re.search(r"DP-SGD \(epsilon=1.0, delta=1e-05\): ([0-9.]+)", out).group(1))
    assert dp_acc > 0.3  # far above chance (0.1) after 2 epochs
