"""Benchmark: the cost of one DP-SGD step relative to the same model's non-private step.

Every variant is one full step on a fixed batch: forward, backward, (per-example
clipping at C = 1, Gaussian noise with multiplier 1), SGD update.

* ``non-private``  — ``loss.mean().backward()`` + ``torch.optim.SGD``.
* ``floor``        — the same step plus one draw of as many normals as the model has
  parameters with opake_fx's keyed generator (``flat_tree_normal``), drawn in line: what
  any DP-SGD step costs at least, since it must compute the non-private gradient and draw
  its noise. ``x floor`` separates our overhead from the noise's own cost.
* ``opake-vmap``   — ``clipped_grad`` with the default vmap backend (per-example loss).
* ``opake-auto``   — ``clipped_grad(..., clip_backend="auto", model=fmodel)`` (batched loss).
* ``opake-auto-sync`` — the same with the noise drawn in line (``prefetch=False``): the
  difference to ``opake-auto`` is what drawing the next step's noise in the background
  (by default for CPU draws of 2**18 values or more when torch's threads leave a core
  free; on 2 cores with 2 threads it draws in place, like ``-sync``) saves. ``opake-auto-ahead``
  (``prefetch=True``, not in the default list) draws ahead whatever the size or device:
  on CUDA, the side stream.
* ``opake-auto+randn`` — the same clipping, with the noise drawn by ``torch.randn`` from a
  seeded ``torch.Generator`` (as Opacus does) instead of the ``gaussian_noise`` stage: the
  difference to ``opake-auto`` is the noise stage's cost, not the clipping backend's.
* ``opake-vmap-compiled`` / ``opake-auto-compiled`` — the whole step (clip, noise, SGD update)
  from :func:`opake_fx.compiled.compile_step` on ``chain(clip, noise, sgd)``: compiled by
  ``torch.compile`` during setup (the compile time is printed after the table); the
  ``auto`` backend takes its traced path (its Linear and embedding rules inside the graph,
  exact per-example gradients for the other parameters; see ``docs/compiled.md``).
* ``opacus-hooks`` — Opacus ``GradSampleModule`` (hooks) + ``DPOptimizer``.
* ``opacus-ghost`` — Opacus ``GradSampleModuleFastGradientClipping`` (ghost clipping) +
  ``DPOptimizerFastGradientClipping`` + ``DPLossFastGradientClipping``.

opake variants add noise with ``gaussian_noise`` and update their parameter tensors
in place with one fused ``torch._foreach_add_`` (plain SGD, as ``torch.optim.SGD`` does). Times are medians over interleaved
(round-robin) rounds, so load changes hit every variant alike; in each round a variant
first makes one untimed step (``--settle 1``), which absorbs the caches and allocator state
the previous variant left, and then one timed step, the steady state of a training loop.
A workload gets as many rounds (at least 7, at most 61 with ``--quick``) as fit 25 s of
timing, so the cheap ones have tight medians. Ratios are to ``non-private`` from the
same run (``x non-private``), to ``floor`` (``x floor``), and the faster Opacus mode's time
over the variant's (``x faster than Opacus``: above 1 the variant is faster). Peak memory is the growth of the resident set during a few steps, measured
from right after setup (so buffers a variant keeps between steps, like Opacus's
``grad_sample``, count), in a fresh process per variant
(``opake_fx.profiling.peak_rss_in_subprocess``, with ``MALLOC_MMAP_THRESHOLD_=65536`` so
freed buffers leave the RSS).

Workloads (2 CPU threads):

* ``mlp``    — MLP 20-64-1, MSE; batch 64 and 1024.
* ``cnn``    — 28x28x1: conv 16 + GroupNorm + ReLU + pool, conv 32 + GroupNorm + ReLU + pool,
  linear 10; batch 64 and 256.
* ``lm``     — causal transformer LM: vocab 1000, d_model 128, 2 blocks of 4-head attention
  (written from ``nn.Linear`` + ``F.scaled_dot_product_attention``, as Opacus hooks need:
  ``nn.MultiheadAttention`` keeps a packed ``in_proj_weight`` outside any Linear) and a
  512-wide MLP, LayerNorm, learned position embeddings; seq 64, batch 16 and 64.
* ``embbag`` — text classifier: ``nn.Embedding(20000, 64)``, mean over 64 tokens, linear 4;
  batch 256. (``nn.EmbeddingBag`` fuses lookup and reduction, so neither Opacus hooks nor
  layer rules see per-token outputs; ``nn.Embedding`` + mean is the per-example-friendly
  equivalent.)

Usage::

    python benchmarks/clipping.py --quick          # < 10 minutes on 2 cores
    python benchmarks/clipping.py --workloads lm-64 --variants non-private,opake-auto
    python benchmarks/clipping.py --quick --device cuda   # on a GPU: CUDA-synchronised timing,
                                                          # peak CUDA memory beyond setup
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opake_fx import profiling  # noqa: E402
from opake_fx.dpsgd.clipping import clipped_grad  # noqa: E402
from opake_fx.dpsgd.noise import gaussian_noise  # noqa: E402
from opake_fx.functional import make_functional  # noqa: E402
from opake_fx.random import flat_tree_normal, fold_in, key  # noqa: E402

THREADS = 2
LR = 0.05
WORKLOADS: dict[str, tuple[str, int]] = {
    "mlp-64": ("mlp", 64),
    "mlp-1024": ("mlp", 1024),
    "cnn-64": ("cnn", 64),
    "cnn-256": ("cnn", 256),
    "lm-16": ("lm", 16),
    "lm-64": ("lm", 64),
    "embbag-256": ("embbag", 256),
}
VARIANTS = ["non-private", "floor", "opake-vmap", "opake-auto", "opake-auto-sync", "opake-auto+randn", "opake-vmap-compiled",
            "opake-auto-compiled", "opacus-hooks", "opacus-ghost"]
COMPILE_S: dict[tuple[str, str], float] = {}  # (workload, variant) -> seconds of its first two (compiling) steps
OPACUS = ("opacus-hooks", "opacus-ghost")
LM_VOCAB, LM_DIM, LM_HEADS, LM_LAYERS, LM_SEQ, LM_FF = 1000, 128, 4, 2, 64, 512
BAG_VOCAB, BAG_DIM, BAG_TOKENS, BAG_CLASSES = 20000, 64, 64, 4


# --- models -----------------------------------------------------------------------------


class Block(nn.Module):
    """Pre-LN transformer block from Linear/LayerNorm modules (causal self-attention + MLP)."""

    def __init__(self, d: int, heads: int, ff: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, ff), nn.Linear(ff, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(LM_VOCAB, LM_DIM)
        self.pos = nn.Embedding(LM_SEQ, LM_DIM)
        self.blocks = nn.Sequential(*[Block(LM_DIM, LM_HEADS, LM_FF) for _ in range(LM_LAYERS)])
        self.ln_f = nn.LayerNorm(LM_DIM)
        self.head = nn.Linear(LM_DIM, LM_VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        positions = torch.arange(t, device=ids.device).repeat(b, 1)  # batch-first (and contiguous, for Opacus)
        return self.head(self.ln_f(self.blocks(self.tok(ids) + self.pos(positions))))


class BagClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(BAG_VOCAB, BAG_DIM)
        self.fc = nn.Linear(BAG_DIM, BAG_CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(ids).mean(dim=1))


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 1))
    if kind == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.GroupNorm(4, 32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * 7 * 7, 10),
        )
    if kind == "lm":
        return TinyLM()
    if kind == "embbag":
        return BagClassifier()
    raise ValueError(kind)


def data(kind: str, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if kind == "mlp":
        return torch.randn(batch, 20, generator=g), torch.randn(batch, generator=g)
    if kind == "cnn":
        return torch.randn(batch, 1, 28, 28, generator=g), torch.randint(0, 10, (batch,), generator=g)
    if kind == "lm":
        ids = torch.randint(0, LM_VOCAB, (batch, LM_SEQ + 1), generator=g)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    return torch.randint(0, BAG_VOCAB, (batch, BAG_TOKENS), generator=g), torch.randint(0, BAG_CLASSES, (batch,), generator=g)


def per_example_losses(kind: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Losses of shape [B] (the LM averages its token losses within each example)."""
    if kind == "mlp":
        return (out.squeeze(-1) - y) ** 2
    if kind == "lm":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="none").view(y.shape).mean(1)
    return F.cross_entropy(out, y, reduction="none")


def criterion(kind: str) -> nn.Module:
    return nn.MSELoss() if kind == "mlp" else nn.CrossEntropyLoss()


def model_out(kind: str, out: torch.Tensor) -> torch.Tensor:
    """What the (mean-reduced) criterion gets: squeezed for the MLP, flat tokens for the LM."""
    if kind == "mlp":
        return out.squeeze(-1)
    if kind == "lm":
        return out.reshape(-1, out.shape[-1])
    return out


# --- one step per variant -----------------------------------------------------------------


def setup_step(workload: str, variant: str, threads: int = THREADS, device: str = "cpu") -> Callable[[], None]:
    """Builds model, data and optimiser for ``variant`` on ``workload``; returns the step."""
    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore")
    kind, batch = WORKLOADS[workload]
    model = build(kind).to(device)
    x, y = (t.to(device) for t in data(kind, batch))
    y_flat = y.reshape(-1)
    if variant in ("non-private", "floor"):
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        crit = criterion(kind)
        like = [p.detach() for p in model.parameters()]
        floor_step = [0]

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            crit(model_out(kind, model(x)), y_flat).backward()
            opt.step()
            if variant == "floor":  # the noise any DP step must draw, drawn in line by our generator
                flat_tree_normal(fold_in(key(0), floor_step[0]), like)
                floor_step[0] += 1

        return step
    if variant in ("opake-vmap", "opake-auto", "opake-auto-sync", "opake-auto-ahead", "opake-auto+randn"):
        fmodel, params = make_functional(model)
        if variant == "opake-vmap":
            loss = lambda p, xi, yi: per_example_losses(kind, fmodel(p, xi[None]), yi[None])[0]  # noqa: E731
            grad_fn, cstate = clipped_grad(loss, clipping_norm=1.0, batch_argnums=(1, 2), normalize_by=batch)
        else:
            loss = lambda p, xb, yb: per_example_losses(kind, fmodel(p, xb), yb)  # noqa: E731
            grad_fn, cstate = clipped_grad(loss, clipping_norm=1.0, batch_argnums=(1, 2), normalize_by=batch,
                                           clip_backend="auto", model=fmodel)
        prefetch = {"opake-auto-sync": False, "opake-auto-ahead": True}.get(variant)  # None: the default (auto)
        noise_fn, nstate = gaussian_noise(noise_multiplier=1.0, key=key(0), prefetch=prefetch)
        state: dict[str, Any] = {"params": list(params), "clip": cstate, "noise": nstate}
        gen = torch.Generator(device=device).manual_seed(0)

        def step() -> None:
            clipped, state["clip"] = grad_fn(tuple(state["params"]), x, y, state=state["clip"])
            if variant == "opake-auto+randn":  # Opacus-style noise: torch.randn from a torch.Generator
                std = 1.0 * clipped.max_norm
                noisy = [torch.randn(g.shape, generator=gen, device=g.device).mul_(std).add_(g) for g in clipped.pytree]
            else:
                noised, state["noise"] = noise_fn(clipped, state["noise"])
                noisy = list(noised.pytree)
            # In-place SGD on our own parameter tensors, as torch.optim.SGD does for the others.
            torch._foreach_add_(state["params"], noisy, alpha=-LR)

        return step
    if variant in ("opake-vmap-compiled", "opake-auto-compiled"):
        from opake_fx.compiled import compile_step
        from opake_fx.dpsgd import clip, noise
        from opake_fx.optimizers import sgd
        from opake_fx.transforms import chain

        fmodel, params = make_functional(model)
        if variant == "opake-vmap-compiled":
            loss = lambda p, xi, yi: per_example_losses(kind, fmodel(p, xi[None]), yi[None])[0]  # noqa: E731
            clip_stage = clip(loss, clipping_norm=1.0, batch_argnums=(1, 2), normalize_by=batch)
        else:
            loss = lambda p, xb, yb: per_example_losses(kind, fmodel(p, xb), yb)  # noqa: E731
            clip_stage = clip(loss, clipping_norm=1.0, batch_argnums=(1, 2), normalize_by=batch, clip_backend="auto",
                              model=fmodel)
        compiled = compile_step(chain(clip_stage, noise(noise_multiplier=1.0, key=key(0)), sgd(LR)))
        cstate: dict[str, Any] = {"params": params, "state": compiled.init(params)}

        def step() -> None:
            cstate["params"], cstate["state"] = compiled(cstate["params"], cstate["state"], (x, y))

        t0 = time.perf_counter()
        step(), step()  # the first step compiles, the second once more with symbolic counters
        COMPILE_S[(workload, variant)] = time.perf_counter() - t0
        return step
    if variant == "opacus-hooks":
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer

        gsm = GradSampleModule(model, loss_reduction="mean")
        opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=LR), noise_multiplier=1.0, max_grad_norm=1.0,
                          expected_batch_size=batch, loss_reduction="mean")
        crit = criterion(kind)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            crit(model_out(kind, gsm(x)), y_flat).backward()
            opt.step()

        return step
    if variant == "opacus-ghost":
        from opacus.grad_sample import GradSampleModuleFastGradientClipping
        from opacus.optimizers import DPOptimizerFastGradientClipping
        from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

        gsm = GradSampleModuleFastGradientClipping(model, max_grad_norm=1.0, use_ghost_clipping=True, loss_reduction="mean")
        opt = DPOptimizerFastGradientClipping(torch.optim.SGD(gsm.parameters(), lr=LR), noise_multiplier=1.0,
                                              max_grad_norm=1.0, expected_batch_size=batch, loss_reduction="mean")
        dp_loss = DPLossFastGradientClipping(gsm, opt, criterion(kind), loss_reduction="mean")
        shape = tuple(y.shape) if kind == "lm" else None

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            dp_loss(model_out(kind, gsm(x)), y_flat, shape=shape).backward()
            opt.step()

        return step
    raise ValueError(f"unknown variant {variant!r}")


# --- driver ---------------------------------------------------------------------------------


def rounds_for(steps: dict[str, Callable[[], None]], warmup: int, settle: int, least: int, most: int,
               budget_s: float) -> int:
    """Rounds that fit ``budget_s`` of timing: ``least`` at minimum, ``most`` at most.

    The warm-up rounds are run here and timed to size the rest, so a cheap workload gets
    many rounds (a tighter median) and an expensive one stays within the budget.
    """
    sync = torch.cuda.synchronize if torch.cuda.is_available() and torch.cuda.is_initialized() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(max(1, warmup)):
        for fn in steps.values():
            fn()
    sync()
    per_round = (time.perf_counter() - t0) / max(1, warmup) * (1 + settle)
    return max(least, min(most, int(budget_s / max(per_round, 1e-9))))


def cuda_step_memory(workload: str, variant: str, steps: int, device: str) -> int:
    """Peak CUDA memory of ``steps`` steps beyond what setup allocated (fresh setup, in this process)."""
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    step = setup_step(workload, variant, THREADS, device)
    peak = profiling.cuda_peak_memory(lambda: [step() for _ in range(steps)], device)
    del step
    gc.collect()
    torch.cuda.empty_cache()
    return peak


def run(workloads: list[str], variants: list[str], warmup: int, repeats: int, mem_steps: int, memory: bool,
        threads: int = THREADS, settle: int = 1, most: int | None = None, budget_s: float = 0.0,
        device: str = "cpu") -> list[dict[str, Any]]:
    """Times (and measures) every variant of every workload; ``repeats`` rounds at least,
    up to ``most`` while they fit ``budget_s`` seconds per workload."""
    rows = []
    for w in workloads:
        t0 = time.perf_counter()
        steps = {v: setup_step(w, v, threads, device) for v in variants}
        n = rounds_for(steps, warmup, settle, repeats, most or repeats, budget_s)
        timings = profiling.time_interleaved(steps, warmup=0, repeats=n, settle=settle)
        del steps
        base = timings["non-private"].median if "non-private" in timings else math.nan
        floor = timings["floor"].median if "floor" in timings else math.nan
        opacus = min((timings[v].median for v in OPACUS if v in timings), default=math.nan)
        mems: dict[str, float] = {}
        if memory and device != "cpu":
            for v in variants:
                mems[v] = cuda_step_memory(w, v, mem_steps, device) / 2**20
        elif memory:
            for v in variants:
                r = profiling.peak_rss_in_subprocess(
                    f"{Path(__file__).resolve()}:setup_step", {"workload": w, "variant": v, "threads": threads},
                    steps=mem_steps, env={"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": str(threads)},
                )
                mems[v] = r["delta"] / 2**20
        mem_base = mems.get("non-private", math.nan)
        for v in variants:
            rows.append(dict(
                workload=w, variant=v, rounds=n, ms=1e3 * timings[v].median, ratio=timings[v].median / base,
                floor=timings[v].median / floor, vs_opacus=opacus / timings[v].median,
                mem=mems.get(v, math.nan), mem_ratio=mems.get(v, math.nan) / mem_base if mem_base else math.nan,
            ))
        print(f"# {w}: {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict[str, Any]], memory_label: str = "peak RSS growth (MiB)") -> str:
    out = [f"| workload | variant | rounds | step (ms) | x non-private | x floor | x faster than Opacus | {memory_label} "
           "| memory / non-private |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['workload']} | {r['variant']} | {r['rounds']} | {r['ms']:.2f} | {r['ratio']:.2f}x | "
                   f"{r['floor']:.2f}x | {r['vs_opacus']:.2f}x | {r['mem']:.1f} | {r['mem_ratio']:.2f}x |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats (the < 10 minute run)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--repeats", type=int, help="least rounds per workload (default 7 quick, 25 full)")
    ap.add_argument("--max-repeats", type=int, help="most rounds per workload (default 61 quick, 201 full)")
    ap.add_argument("--budget", type=float, help="seconds of timing per workload that set the rounds (25 quick, 90 full)")
    ap.add_argument("--settle", type=int, default=1,
                    help="untimed calls at the start of each variant's turn (default 1; 0 = time the first call)")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--threads", type=int, default=THREADS, help=f"torch threads (default {THREADS})")
    ap.add_argument("--device", default="cpu",
                    help="cpu (default) or cuda[:i]; on CUDA, memory is the peak allocated by the steps beyond setup")
    args = ap.parse_args()
    if args.device != "cpu":
        torch.backends.cuda.matmul.allow_tf32 = False  # the same float32 arithmetic as on the CPU
        torch.backends.cudnn.allow_tf32 = False
    torch.set_num_threads(args.threads)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 5)
    repeats = args.repeats if args.repeats is not None else (7 if args.quick else 25)
    most = max(repeats, args.max_repeats if args.max_repeats is not None else (61 if args.quick else 201))
    budget = args.budget if args.budget is not None else (25.0 if args.quick else 90.0)
    workloads = [w for w in args.workloads.split(",") if w]
    variants = [v for v in args.variants.split(",") if v]
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    t0 = time.perf_counter()
    rows = run(workloads, variants, warmup, repeats, mem_steps=2 if args.quick else 3, memory=not args.no_memory,
               threads=args.threads, settle=args.settle, most=most, budget_s=budget, device=args.device)
    where = torch.cuda.get_device_name(args.device) if args.device != "cpu" else f"{args.threads} threads"
    print(f"torch {torch.__version__}, {args.device} ({where}), warmup {warmup}, rounds {repeats}-{most} within "
          f"{budget:.0f} s of timing per workload, settle {args.settle} (medians); "
          f"load average before {load}, after {os.getloadavg() if load else None}; {time.perf_counter() - t0:.0f}s\n")
    print(table(rows, "peak RSS growth (MiB)" if args.device == "cpu" else "peak CUDA memory beyond setup (MiB)"))
    if COMPILE_S:
        print("\ncompile time (the first two steps of a compiled variant, in the timing process): "
              + ", ".join(f"{w} {v}: {t:.1f} s" for (w, v), t in COMPILE_S.items()))
    cores = os.cpu_count() or 1
    if load is not None and max(load[0], os.getloadavg()[0]) > cores:
        print(f"\nWARNING: the load average ({max(load[0], os.getloadavg()[0]):.1f}) was above the {cores} cores: other "
              "processes shared them during the run, so these times and ratios do not describe this code.")


if __name__ == "__main__":
    main()
