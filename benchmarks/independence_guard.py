"""Benchmark: what the fast backends' exact independence guard costs.

The guard (``opake_fx/dpsgd/clipping/_independence.py``) runs once per call signature of
the loss (argument shapes without the batch size, dtypes, train/eval), together with the
batch-axis probe: ``2 ceil(log2 k)`` backward passes and ``k`` single-example forwards on
the first ``k = 8`` examples, plus one float64 forward of the ``k``. A steady training loop
with fixed shapes pays it once; a loop whose padded length changes every step pays it
once per new length (the layout cache keeps 256 signatures).

For each workload of ``benchmarks/clipping.py`` and ``benchmarks/architectures.py`` this
prints the time spent inside the guard on the first call, the first call's total time,
the median steady ``opake-auto`` step, and the guard over one steady step. The steady
step itself does not run the guard (no per-step cost).

Usage::

    python benchmarks/independence_guard.py            # every workload, 2 threads
    python benchmarks/independence_guard.py --workloads lm-64,gpt2-full
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import architectures  # noqa: E402
import clipping  # noqa: E402
from opake_fx.dpsgd.clipping import _provenance  # noqa: E402


class _Timed:
    """Wraps the guard where the probe calls it, adding up the seconds spent inside."""

    def __init__(self) -> None:
        self.inner = _provenance.check_independence
        self.seconds, self.calls = 0.0, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1


def measure(make_step: Callable[[], Callable[[], None]], steady: int, device: str = "cpu") -> dict[str, float]:
    """Guard time on the first call, the first call's time and the median steady step (seconds -> ms)."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    timed = _Timed()
    _provenance.check_independence = timed
    try:
        step = make_step()
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        first = time.perf_counter() - t0
        guard, calls = timed.seconds, timed.calls
        times = []
        for _ in range(steady):
            t0 = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t0)
    finally:
        _provenance.check_independence = timed.inner
    assert timed.calls == calls, "the guard ran again in a steady step"
    median = statistics.median(times)
    return {"guard_ms": guard * 1e3, "first_ms": first * 1e3, "step_ms": median * 1e3, "ratio": guard / median, "calls": calls}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    both = list(clipping.WORKLOADS) + list(architectures.WORKLOADS)
    ap.add_argument("--workloads", default=",".join(both))
    ap.add_argument("--steady", type=int, default=5, help="steady steps timed after the first (median)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cuda: the clipping workloads on the GPU (synchronised timing)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"{'workload':<14} {'guard ms':>9} {'first call ms':>14} {'steady step ms':>15} {'guard / step':>13}")
    for w in a.workloads.split(","):
        if w in clipping.WORKLOADS:
            make = lambda w=w: clipping.setup_step(w, "opake-auto", threads=a.threads, device=a.device)  # noqa: E731
        elif a.device != "cpu":
            print(f"{w:<14} (CPU only)")
            continue
        elif architectures.available(w):
            make = lambda w=w: architectures.setup_step(w, "opake-auto", threads=a.threads)  # noqa: E731
        else:
            print(f"{w:<14} (not available)")
            continue
        r = measure(make, a.steady, a.device)
        print(f"{w:<14} {r['guard_ms']:>9.1f} {r['first_ms']:>14.1f} {r['step_ms']:>15.1f} {r['ratio']:>12.2f}x")


if __name__ == "__main__":
    main()
