"""benchmarks/sharded.py runs on 2 gloo ranks and FSDP2 holds about half of what data parallel holds per rank."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.mark.slow
def test_the_sharded_benchmark_prints_half_the_bytes_per_rank():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sharded.py")], capture_output=True, text=True,
                         timeout=600, check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["0", "1"]
    for row in rows:
        ratio = float(row[3])  # bytes of params + gradient + Adam state, counted from the tensors
        assert 0.45 <= ratio <= 0.55, row
