"""Smoke test of `make demo`'s script at a tiny budget: it calibrates, trains, accounts and reports.

The full run (epsilon 3) is `-m slow`: the recipe must reach 0.93 test accuracy there.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

pytest.importorskip("sklearn")


def _demo():
    spec = importlib.util.spec_from_file_location("demo", Path(__file__).parents[1] / "examples" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    return demo


def test_demo_runs_and_spends_at_most_its_budget(capsys):
    _demo().main(["--epochs", "2", "--epsilon", "1.0", "--recipe-epochs", "8"])
    out = capsys.readouterr().out
    finals = [float(v) for v in re.findall(r"final epsilon ([0-9.]+)", out)]
    assert len(finals) == 2  # DP-SGD and the recipe, each accounted
    assert all(0.95 <= f <= 1.0 for f in finals)
    dp_acc = float(re.search(r"DP-SGD \(epsilon=1.0, delta=1e-05\): ([0-9.]+)", out).group(1))
    recipe_acc = float(re.search(r"recipe \(epsilon=1.0, delta=1e-05\): ([0-9.]+)", out).group(1))
    assert dp_acc > 0.3  # far above chance (0.1) after 2 epochs
    assert recipe_acc > 0.3
    assert re.search(r"non-private .*inf\s+[0-9.]+", out)


@pytest.mark.slow
def test_demo_recipe_reaches_093_at_epsilon_3(capsys):
    _demo().main([])
    out = capsys.readouterr().out
    recipe_acc = float(re.search(r"recipe \(epsilon=3.0, delta=1e-05\): ([0-9.]+)", out).group(1))
    finals = [float(v) for v in re.findall(r"final epsilon ([0-9.]+)", out)]
    assert all(f <= 3.0 for f in finals)
    assert recipe_acc >= 0.93
