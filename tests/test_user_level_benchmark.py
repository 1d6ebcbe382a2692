"""benchmarks/user_level.py runs both arms end to end (a smoke test: accuracies are printed, never asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.mark.slow
def test_the_user_level_benchmark_runs_both_arms(tmp_path):
    plot = tmp_path / "user_level.png"
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "user_level.py"), "--steps", "3", "--ks", "1", "4", "--epsilons", "8",
         "--plot", str(plot)],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("8 ")]
    assert [r[1] for r in rows] == ["1", "4"] and all(len(r) == 7 for r in rows)
    assert float(rows[1][5]) > float(rows[1][3])  # ELS pays the group conversion: more noise than ULS at k = 4
    assert plot.stat().st_size > 0
