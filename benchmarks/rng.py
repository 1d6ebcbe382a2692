"""Speed of opake_fx's keyed normals against torch.randn, measured in the same run.

Prints the median time of each variant over interleaved repeats and the ratio to
``torch.randn`` (target: the default fast path within 1.5x for 10M float32). The numpy
variants (``--numpy``) are the candidate exact CPU Gaussians measured against torch's
generator: counter-based Philox and SFC64/PCG64 bits with numpy's ziggurat transform, all
filling a preallocated float32 buffer.

    python benchmarks/rng.py [--n 10000000] [--repeats 9]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from opake_fx.random import flat_tree_normal, fold_in, key, normal, tree_normal


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=10_000_000)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--numpy", action="store_true", help="also time numpy's generators (the faster-Gaussian candidates)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    n = args.n
    leaves = [torch.empty(n // 10) for _ in range(10)]
    variants = {
        "torch.randn": lambda i: torch.randn(n),
        "opake_fx normal (fast)": lambda i: normal(fold_in(key(0), i), (n,)),
        "opake_fx tree_normal, 10 leaves": lambda i: tree_normal(fold_in(key(1), i), leaves),
        "opake_fx flat_tree_normal, 10 leaves (noise stages)": lambda i: flat_tree_normal(fold_in(key(3), i), leaves),
        "opake_fx normal (exact, 1/100 size)": lambda i: normal(fold_in(key(2), i), (n // 100,), exact=True),
    }
    if args.numpy:
        import numpy as np

        out = np.empty(n, dtype=np.float32)
        for name, bitgen in (("Philox", np.random.Philox), ("SFC64", np.random.SFC64), ("PCG64", np.random.PCG64)):
            gen = np.random.Generator(bitgen(0))
            variants[f"numpy {name} standard_normal (float32, in place)"] = (
                lambda i, gen=gen: gen.standard_normal(n, dtype=np.float32, out=out)
            )
    times: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():  # warm-up
        fn(0)
    for r in range(args.repeats):  # round-robin so machine noise hits every variant alike
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn(r + 1)
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["torch.randn"])
    print(f"| variant ({n:,} float32) | median s | ratio to torch.randn |")
    print("| --- | --- | --- |")
    for name, ts in times.items():
        med = statistics.median(ts)
        scale = 100 if "exact" in name else 1
        print(f"| {name} | {med:.4f} | {med * scale / base:.2f}{' (per element)' if scale > 1 else ''} |")


if __name__ == "__main__":
    main()
