"""DP-FTRL benchmark: strategy losses and optimisation time, streaming noise memory, accounting.

Prints markdown tables:

1. losses at n=64 on prefix sums (single participation) next to jax_privacy's values;
2. optimisation time and mean loss of every strategy at n=1024 (``--n`` to change);
3. streaming noise for a 1M-parameter float32 model: buffers held and time per step;
4. amplified BandMF accounting against dp_accounting events.

    python benchmarks/mf.py            # everything (a few minutes on 2 cores)
    python benchmarks/mf.py --quick    # n=256, fewer steps
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from opake_fx import dpftrl
from opake_fx.dpftrl import accounting as mf_acc
from opake_fx.random import key
from opake_fx.types import ClippedPytree


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def losses_at_64() -> None:
    print("## Prefix sums, n = 64, single participation (unit noise)\n")
    print("| strategy | mean loss | max loss | reference |")
    print("|---|---:|---:|---|")
    rows = [
        ("identity (DP-SGD)", dpftrl.identity_strategy(64), "(n+1)/2 = 32.5, n = 64"),
        ("square root (bsr, bandwidth 64)", dpftrl.bsr_strategy(64, 64), "jax_privacy: 4.9715 / 5.7066"),
        ("BandMF Toeplitz, 64 bands", dpftrl.band_mf_strategy(64, 64), "target <= 4.75"),
        ("BandMF column-normalised, 16 bands", dpftrl.band_mf_strategy(64, 16, structure="column_normalized"), "jax_privacy: 5.26"),
        ("BandMF Toeplitz, 16 bands", dpftrl.band_mf_strategy(64, 16), ""),
        ("BLT (<= 6 buffers)", dpftrl.blt_strategy(64, 6), ""),
        ("BSR, bandwidth 16", dpftrl.bsr_strategy(64, 16), ""),
        ("BISR, bandwidth 16", dpftrl.bisr_strategy(64, 16), ""),
        ("lambda-CGD, lambda = 0.5", dpftrl.lambda_cgd_strategy(0.5, 64), ""),
        ("dense (optimal)", dpftrl.dense_strategy(64), ""),
    ]
    for name, s, ref in rows:
        print(f"| {name} | {s.expected_error():.4f} | {s.expected_error(reduction='max'):.4f} | {ref} |")
    print()


def optimisation_times(n: int) -> None:
    print(f"## Optimisation at n = {n} (prefix sums, mean loss; {torch.get_num_threads()} threads)\n")
    print("| strategy | time (s) | mean loss | memory (buffers) |")
    print("|---|---:|---:|---:|")
    jobs = [
        ("identity", lambda: dpftrl.identity_strategy(n)),
        ("BandMF Toeplitz, 16 bands", lambda: dpftrl.band_mf_strategy(n, 16)),
        ("BandMF Toeplitz, 64 bands", lambda: dpftrl.band_mf_strategy(n, 64)),
        (f"BandMF Toeplitz, {n} bands", lambda: dpftrl.band_mf_strategy(n, n)),
        ("BandMF column-normalised, 16 bands", lambda: dpftrl.band_mf_strategy(n, 16, structure="column_normalized")),
        ("BLT (<= 6 buffers)", lambda: dpftrl.blt_strategy(n, 6)),
        ("BLT, min_sep 32, all participations", lambda: dpftrl.blt_strategy(n, 6, min_sep=32, max_participations=None)),
        ("BSR, bandwidth 16 (closed form)", lambda: dpftrl.bsr_strategy(n, 16)),
        ("BISR, bandwidth 16 (closed form)", lambda: dpftrl.bisr_strategy(n, 16)),
        ("BISR, bandwidth 16, optimised", lambda: dpftrl.bisr_strategy(n, 16, optimize=True)),
        ("lambda-CGD, lambda = 0.5", lambda: dpftrl.lambda_cgd_strategy(0.5, n)),
        ("dense (optimal, 1 epoch)", lambda: dpftrl.dense_strategy(n)),
        ("dense (optimal, 4 fixed-order epochs)", lambda: dpftrl.dense_strategy(n, epochs=4)),
    ]
    for name, make in jobs:
        s, secs = _timed(make)
        print(f"| {name} | {secs:.1f} | {s.expected_error():.4f} | {s.inverse_noise().memory} |", flush=True)
    print()


def streaming(n: int, steps: int) -> None:
    params = 1_000_000
    print(f"## Streaming noise, {params:,} float32 parameters (n = {n}, {steps} steps timed)\n")
    print("| strategy | buffers | state (MB) | expected (MB) | ms / step |")
    print("|---|---:|---:|---:|---:|")
    strategies = [
        ("identity", dpftrl.identity_strategy(n)),
        ("BandMF, 16 bands", dpftrl.band_mf_strategy(n, 16)),
        ("BLT", dpftrl.blt_strategy(n, 6)),
        ("BISR, bandwidth 16", dpftrl.bisr_strategy(n, 16)),
        ("BISR, bandwidth 16, replay", dpftrl.bisr_strategy(n, 16, replay=True)),
        ("lambda-CGD (replay)", dpftrl.lambda_cgd_strategy(0.5, n)),
    ]
    grad = ClippedPytree({"w": torch.zeros(params)}, max_norm=1.0)
    for name, s in strategies:
        fn, state = dpftrl.mf_gaussian_noise(s, noise_multiplier=1.0, key=key(0), inplace=True)
        _, state = fn(grad, state)
        t0 = time.perf_counter()
        for _ in range(steps):
            _, state = fn(grad, state)
        per = (time.perf_counter() - t0) / steps * 1e3
        mem = state.memory_bytes / 2**20
        expected = s.inverse_noise().memory * params * 4 / 2**20
        print(f"| {name} | {s.inverse_noise().memory} | {mem:.1f} | {expected:.1f} | {per:.1f} |", flush=True)
    print()


def accounting() -> None:
    print("## Amplified BandMF accounting vs dp_accounting (epsilon at delta = 1e-5)\n")
    try:
        import dp_accounting as dpa
    except ImportError:  # pragma: no cover
        print("dp_accounting is not installed; skipped.\n")
        return
    print("| n | bands | q | nm | opake_fx | dp_accounting | rel. diff |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n, bands, q, nm in [(1024, 1, 0.01, 1.0), (1024, 8, 0.08, 1.5), (2048, 32, 0.3, 3.0)]:
        s = dpftrl.band_mf_strategy(n, bands, max_iterations=50)
        ours = mf_acc.poisson(nm, s, q).epsilon_at(1e-5)
        a = dpa.pld.PLDAccountant()
        a.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(nm)), math.ceil(n / bands)))
        ref = a.get_epsilon(1e-5)
        print(f"| {n} | {bands} | {q} | {nm} | {ours:.6f} | {ref:.6f} | {abs(ours - ref) / ref:.1e} |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    n = 256 if args.quick else args.n
    losses_at_64()
    optimisation_times(n)
    streaming(n, 5 if args.quick else 20)
    accounting()


if __name__ == "__main__":
    main()
