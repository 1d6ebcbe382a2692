"""Accounting benchmark: opake_fx's PLD engine against dp_accounting, measured in the same run.

    python benchmarks/accounting.py [--repeats N]

Prints a markdown table of median wall times (ours with cold caches: every lru cache is
cleared before each timed call) and the ratios the project targets:

* epsilon of ``poisson(gaussian(1.0), 0.0064) * 500`` at delta=1e-5, discretisation 1e-4:
  at least 10x faster than ``dp_accounting``'s ``PLDAccountant``;
* the seed tutorial's calibration (epsilon 3 at delta 1e-5, bracket [0.1, 10]) in under a
  tenth of the time of ``dp_accounting.calibrate_dp_mechanism`` at the same tolerance
  (1e-3), with a noise multiplier within 1e-3 of its answer;
* 100k steps at q=0.001, sigma=1 in under a second.

Timings are informative only; no test asserts them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dp_accounting  # noqa: E402
from dp_accounting import mechanism_calibration  # noqa: E402
from dp_accounting.pld import pld_privacy_accountant  # noqa: E402

import opake_fx.accounting as acc  # noqa: E402
import opake_fx.dpsgd.accounting as dpsgd_acc  # noqa: E402

Q, SIGMA, STEPS, DELTA, D = 64 / 10_000, 1.0, 500, 1e-5, 1e-4


def timed(fn: Callable[[], object], repeats: int, cold: bool = True) -> tuple[float, object]:
    """Median wall time of ``fn`` over ``repeats`` runs (caches cleared first if ``cold``)."""
    times, value = [], None
    for _ in range(repeats):
        if cold:
            acc.clear_caches()
        start = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), value


def ours_epsilon() -> float:
    return (dpsgd_acc.poisson(dpsgd_acc.gaussian(SIGMA), Q) * STEPS).epsilon_at(DELTA, discretization=D)


def dp_epsilon() -> float:
    oracle = pld_privacy_accountant.PLDAccountant(value_discretization_interval=D)
    oracle.compose(dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(SIGMA)), STEPS)
    return oracle.get_epsilon(DELTA)


def ours_calibration() -> float:
    result = acc.calibrate(
        acc.epsilon_budget(3.0, delta=DELTA),
        lambda nm: dpsgd_acc.poisson(dpsgd_acc.gaussian(nm), Q) * STEPS,
        param_min=0.1,
        param_max=10.0,
        tolerance=1e-3,
    )
    return result.param


def dp_calibration() -> float:
    return dp_accounting.calibrate_dp_mechanism(
        lambda: pld_privacy_accountant.PLDAccountant(value_discretization_interval=D),
        lambda nm: dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(nm)), STEPS
        ),
        target_epsilon=3.0,
        target_delta=DELTA,
        bracket_interval=mechanism_calibration.ExplicitBracketInterval(0.1, 10.0),
        tol=1e-3,
    )


def ours_long_run() -> float:
    return (dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), 0.001) * 100_000).epsilon_at(DELTA)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per entry (median reported)")
    parser.add_argument("--dp-calibration-repeats", type=int, default=1, help="dp_accounting calibration is slow")
    args = parser.parse_args()

    ours_epsilon(), ours_calibration(), ours_long_run()  # warm up imports and code paths

    t_ours, eps_ours = timed(ours_epsilon, args.repeats)
    t_dp, eps_dp = timed(dp_epsilon, max(1, min(args.repeats, 3)), cold=False)
    t_cal, sigma_ours = timed(ours_calibration, args.repeats)
    t_dpcal, sigma_dp = timed(dp_calibration, args.dp_calibration_repeats, cold=False)
    t_long, eps_long = timed(ours_long_run, args.repeats)

    rows = [
        ("epsilon, q=0.0064 sigma=1 T=500 (cold cache)", t_ours, t_dp, f"eps {eps_ours:.6f} vs {eps_dp:.6f}"),
        ("calibrate sigma for eps=3 (bracket [0.1, 10], tol 1e-3)", t_cal, t_dpcal, f"sigma {sigma_ours:.5f} vs {sigma_dp:.5f}"),
        ("epsilon, q=0.001 sigma=1 T=100000 (cold cache)", t_long, None, f"eps {eps_long:.6f}"),
    ]
    print("| task | opake_fx (s) | dp_accounting (s) | speed-up | values (ours vs dp) |")
    print("|---|---:|---:|---:|---|")
    for name, ours, theirs, values in rows:
        ratio = f"{theirs / ours:.1f}x" if theirs else "-"
        theirs_s = f"{theirs:.3f}" if theirs else "-"
        print(f"| {name} | {ours:.4f} | {theirs_s} | {ratio} | {values} |")
    print()
    checks = [
        ("epsilon >= 10x faster than dp_accounting", t_dp / t_ours >= 10),
        ("epsilon within 1e-3 (relative) of dp_accounting", abs(eps_ours - eps_dp) <= 1e-3 * eps_dp),
        ("calibration < 1/10 of dp_accounting's time", t_cal < t_dpcal / 10),
        ("calibrated sigma within 1e-3 of dp_accounting's", abs(sigma_ours - sigma_dp) <= 1e-3),
        ("100k steps in under a second", t_long < 1.0),
    ]
    for name, ok in checks:
        print(f"- [{'x' if ok else ' '}] {name}")


if __name__ == "__main__":
    main()
