"""benchmarks/secure_noise.py runs and reports both paths (a smoke test; timings are not asserted)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_benchmark_prints_the_cost_ratio(capsys):
    spec = importlib.util.spec_from_file_location("secure_noise_bench", ROOT / "benchmarks" / "secure_noise.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = module.main(["--sizes", "1000", "--repeats", "1"])
    assert [n for n, _, _ in rows] == [1000] and all(fast > 0 and slow > 0 for _, fast, slow in rows)
    assert "secure / default" in capsys.readouterr().out
