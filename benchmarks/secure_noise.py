"""Cost of floating-point-attack-resistant noise: gaussian_noise(secure=True) against the default path.

    python benchmarks/secure_noise.py [--sizes 100000 1000000] [--repeats 5] [--dtype float32]

For each parameter count, noises a ClippedPytree of that many zeros (one leaf) with the
default keyed sampler and with ``secure=True`` (OS CSPRNG, four Box-Muller normals per
value, float64 add and snapping; see ``opake_fx.secure_random``), and prints a markdown
table of median wall times and the ratio secure / default. Informative only; no test
asserts the timings.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from opake_fx.dpsgd.noise import gaussian_noise  # noqa: E402
from opake_fx.random import key  # noqa: E402
from opake_fx.types import ClippedPytree  # noqa: E402


def median_time(secure: bool, numel: int, dtype: torch.dtype, repeats: int, device: str) -> float:
    fn, state = gaussian_noise(noise_multiplier=1.0, key=key(0), secure=secure)
    g = ClippedPytree((torch.zeros(numel, dtype=dtype, device=device),), max_norm=1.0)
    fn(g, state)  # warm-up
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        out, state = fn(g, state)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> list[tuple[int, float, float]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    rows = []
    print(f"| parameters | default (ms) | secure=True (ms) | secure / default |  ({args.dtype}, {args.device}, "
          f"{torch.get_num_threads()} threads)")
    print("| ---: | ---: | ---: | ---: |")
    for n in args.sizes:
        fast = median_time(False, n, dtype, args.repeats, args.device)
        slow = median_time(True, n, dtype, args.repeats, args.device)
        rows.append((n, fast, slow))
        print(f"| {n:,} | {fast * 1e3:.2f} | {slow * 1e3:.2f} | {slow / fast:.1f}x |")
    return rows


if __name__ == "__main__":
    main()
