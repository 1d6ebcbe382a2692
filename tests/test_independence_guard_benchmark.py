"""benchmarks/independence_guard.py runs, and the guard runs once per call signature, never per step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_guard_benchmark_runs_and_the_guard_is_not_paid_per_step():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "independence_guard.py"), "--workloads", "mlp-64,embbag-256",
                          "--steady", "2"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr  # the script asserts the guard did not run again in a steady step
    rows = [line.split() for line in out.stdout.splitlines()[1:]]
    assert [r[0] for r in rows] == ["mlp-64", "embbag-256"]
    assert all(float(r[1]) > 0 for r in rows)  # the guard ran on the first call
