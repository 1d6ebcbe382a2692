"""Benchmark: the fixed per-step cost of a DP step, on a model too small to cost anything else.

One ``nn.Linear(8, 8)`` at batch 4: forward, backward and update take microseconds, so what
a DP variant adds over ``non-private`` is its fixed, per-call Python overhead (hook
installation, rule lookup, capture bookkeeping, checks, the noise stage), the part that
does not shrink with the model. Variants, each one full step with C = 1 and noise
multiplier 1:

* ``non-private``  — ``loss.mean().backward()`` + ``torch.optim.SGD``;
* ``opake-vmap``, ``opake-ghost``, ``opake-auto`` — ``clipped_grad`` with that backend,
  ``gaussian_noise``, one fused in-place SGD update;
* ``opake-auto (clip only)`` — the clipping call alone.

Times are medians over interleaved rounds (``opake_fx.profiling.time_interleaved``, one
settle call per turn); ``overhead`` is the median minus ``non-private``'s.
``--profile VARIANT`` prints the functions where that variant's step spends its time
(cProfile, cumulative), to see which part of the overhead is which.

    python benchmarks/step_overhead.py [--rounds 200] [--profile opake-auto]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opake_fx import profiling  # noqa: E402
from opake_fx.dpsgd.clipping import clipped_grad  # noqa: E402
from opake_fx.dpsgd.noise import gaussian_noise  # noqa: E402
from opake_fx.functional import make_functional  # noqa: E402
from opake_fx.random import key  # noqa: E402

BATCH, WIDTH, LR = 4, 8, 0.05
VARIANTS = ["non-private", "opake-vmap", "opake-ghost", "opake-auto", "opake-auto (clip only)"]


def setup_step(variant: str) -> Callable[[], None]:
    """One full step of ``variant`` on the one-Linear model, as a zero-argument callable."""
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = nn.Linear(WIDTH, WIDTH)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
    if variant == "non-private":
        opt = torch.optim.SGD(model.parameters(), lr=LR)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            ((model(x) - y) ** 2).sum(1).mean().backward()
            opt.step()

        return step
    fmodel, params = make_functional(model)
    backend = variant.split()[0].removeprefix("opake-")
    if backend == "vmap":
        loss: Any = lambda p, xi, yi: ((fmodel(p, xi[None]) - yi[None]) ** 2).sum()  # noqa: E731
        grad_fn, cstate = clipped_grad(loss, clipping_norm=1.0, batch_argnums=(1, 2), normalize_by=BATCH)
    else:
        loss = lambda p, xb, yb: ((fmodel(p, xb) - yb) ** 2).sum(1)  # noqa: E731
        grad_fn, cstate = clipped_grad(loss, clipping_norm=1.0, batch_argnums=(1, 2), normalize_by=BATCH,
                                       clip_backend=backend, model=fmodel)
    noise_fn, nstate = gaussian_noise(noise_multiplier=1.0, key=key(0))
    state: dict[str, Any] = {"params": list(params), "clip": cstate, "noise": nstate}
    clip_only = "clip only" in variant

    def dp_step() -> None:
        clipped, state["clip"] = grad_fn(tuple(state["params"]), x, y, state=state["clip"])
        if clip_only:
            return
        noised, state["noise"] = noise_fn(clipped, state["noise"])
        torch._foreach_add_(state["params"], list(noised.pytree), alpha=-LR)

    return dp_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--profile", help="print a cProfile of this variant's steps instead of timing")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.profile:
        step = setup_step(args.profile)
        for _ in range(20):
            step()
        prof = cProfile.Profile()
        prof.runcall(lambda: [step() for _ in range(args.rounds)])
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
        return
    variants = [v for v in args.variants.split(",") if v]
    steps = {v: setup_step(v) for v in variants}
    timings = profiling.time_interleaved(steps, warmup=10, repeats=args.rounds, settle=1)
    base = timings["non-private"].median if "non-private" in timings else float("nan")
    print(f"torch {torch.__version__}, 1 thread, nn.Linear({WIDTH}, {WIDTH}) at batch {BATCH}, {args.rounds} interleaved "
          "rounds (medians)\n")
    print("| variant | step (ms) | overhead over non-private (ms) |\n|---|---:|---:|")
    for v in variants:
        med = timings[v].median
        print(f"| {v} | {1e3 * med:.3f} | {1e3 * (med - base):.3f} |")


if __name__ == "__main__":
    main()
