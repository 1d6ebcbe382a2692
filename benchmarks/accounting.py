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

Heterogeneous runs (issue 19; ``--no-heterogeneous`` skips them, ``--quick`` runs only the
smaller sizes), on the schedule ``poisson(gaussian(1 + 0.001 i), 0.005)``, step ``i``:

* an ``Accountant`` that checks the budget (``would_exceed``), steps and reads epsilon at
  every step, for 100, 1,000 and 10,000 distinct steps; the 10,000-step run in under 60 s
  and its final epsilon within 1e-6 (relative) of the one-shot composition of the same
  steps. Baselines in the same run: recomposing the whole history at every step (the
  old accountant's cost model, on today's engine) and dp_accounting's ``PLDAccountant``
  fed one event per step; each is skipped, with its extrapolated time, where that would
  exceed 10 minutes;
* ``compose`` of 200 distinct processes of 50 steps each, epsilon at delta 1e-5: at
  least 10x faster than dp_accounting, and never below its (pessimistic) value by more
  than 1e-3 relative.

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


HET_Q, HET_STEPS, SKIP_OVER = 0.005, (100, 1_000, 10_000), 600.0


def schedule(n: int) -> list[acc.DpProcess]:
    """``n`` distinct steps: a noise multiplier rising by 0.001 per step (issue 19's example)."""
    return [dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0 + 0.001 * i), HET_Q) for i in range(n)]


def ours_accountant(n: int) -> float:
    """Check, step and read epsilon at every step (what a training loop that logs epsilon does)."""
    acct = acc.Accountant(acc.epsilon_budget(10.0, delta=DELTA))
    eps = 0.0
    for step in schedule(n):
        if acct.would_exceed(step):
            raise RuntimeError("benchmark budget too small")
        acct.step(step)
        eps = acct.spent_epsilon(DELTA)
    return eps


def recompose_accountant(n: int) -> float:
    """The cost model before issue 19: every check recomposes the whole history."""
    history: list[acc.DpProcess] = []
    eps = 0.0
    for step in schedule(n):
        history.append(step)
        eps = acc.compose(*history).epsilon_at(DELTA)
    return eps


def dp_accountant(n: int) -> float:
    oracle = pld_privacy_accountant.PLDAccountant(value_discretization_interval=D)
    eps = 0.0
    for i in range(n):
        oracle.compose(dp_accounting.PoissonSampledDpEvent(HET_Q, dp_accounting.GaussianDpEvent(1.0 + 0.001 * i)))
        eps = oracle.get_epsilon(DELTA)
    return eps


def two_hundred_processes() -> list[acc.DpProcess]:
    return [dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0 + 0.001 * i), HET_Q) * 50 for i in range(200)]


def ours_two_hundred() -> float:
    return acc.compose(*two_hundred_processes()).epsilon_at(DELTA)


def dp_two_hundred() -> float:
    oracle = pld_privacy_accountant.PLDAccountant(value_discretization_interval=D)
    for i in range(200):
        oracle.compose(dp_accounting.PoissonSampledDpEvent(HET_Q, dp_accounting.GaussianDpEvent(1.0 + 0.001 * i)), 50)
    return oracle.get_epsilon(DELTA)


def heterogeneous(quick: bool) -> None:
    """The issue-19 table: distinct-step accountants and the 200-process composition."""
    sizes = HET_STEPS[:2] if quick else HET_STEPS
    rows, checks = [], []
    rate: dict[str, float] = {}  # seconds per step^k of each baseline, for extrapolation
    for n in sizes:
        cpu = time.process_time()
        t_ours, eps_ours = timed(lambda: ours_accountant(n), 1)
        cpu = time.process_time() - cpu  # both threads: above the wall time on two free cores
        cells = []
        for name, fn, power in (("recompose", recompose_accountant, 2), ("dp_accounting", dp_accountant, 1)):
            estimate = rate[name] * n**power if name in rate else 0.0
            if estimate > SKIP_OVER:
                cells.append(f"skipped (~{estimate / 60:.0f} min extrapolated)")
                continue
            t_base, eps_base = timed(lambda: fn(n), 1, cold=name != "dp_accounting")
            rate[name] = t_base / n**power
            cells.append(f"{t_base:.1f} s ({t_base / t_ours:.0f}x), eps {eps_base:.6f}")
        rows.append((f"Accountant, {n} distinct steps (check + step + epsilon each step)", f"{t_ours:.2f} (CPU {cpu:.1f})", *cells, f"{eps_ours:.6f}"))
        if n == 10_000:
            t_one, eps_one = timed(lambda: acc.compose(*schedule(n)).epsilon_at(DELTA), 1)
            rel = abs(eps_ours - eps_one) / eps_one
            rows.append((f"one-shot compose of the same {n} steps", f"{t_one:.2f}", "-", "-", f"{eps_one:.6f} (rel. diff {rel:.1e})"))
            checks.append(("10,000 distinct steps, checked and read each step, in under 60 s", t_ours < 60))
            checks.append(("its final epsilon within 1e-6 (relative) of the one-shot composition", rel <= 1e-6))
    t_200, eps_200 = timed(ours_two_hundred, 1)
    t_dp200, eps_dp200 = timed(dp_two_hundred, 1, cold=False)
    rows.append(("compose 200 distinct processes x 50 steps, epsilon", f"{t_200:.2f}", "-", f"{t_dp200:.1f} s ({t_dp200 / t_200:.0f}x), eps {eps_dp200:.6f}", f"{eps_200:.6f}"))
    checks.append(("200-process composition >= 10x faster than dp_accounting", t_dp200 >= 10 * t_200))
    checks.append(("... and not below its epsilon by more than 1e-3 relative", eps_200 >= eps_dp200 * (1 - 1e-3)))
    print("| heterogeneous task | opake_fx (s) | recompose every step | dp_accounting | epsilon (ours) |")
    print("|---|---:|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()
    for name, ok in checks:
        print(f"- [{'x' if ok else ' '}] {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per entry (median reported)")
    parser.add_argument("--dp-calibration-repeats", type=int, default=1, help="dp_accounting calibration is slow")
    parser.add_argument("--no-heterogeneous", action="store_true", help="skip the issue-19 heterogeneous runs")
    parser.add_argument("--only-heterogeneous", action="store_true", help="run only the heterogeneous runs")
    parser.add_argument("--quick", action="store_true", help="heterogeneous runs up to 1,000 steps only")
    args = parser.parse_args()
    if args.only_heterogeneous:
        heterogeneous(args.quick)
        return

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
    if not args.no_heterogeneous:
        print()
        heterogeneous(args.quick)


if __name__ == "__main__":
    main()
