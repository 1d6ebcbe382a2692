"""A tiny private training run that checkpoints every step and resumes from its last checkpoint.

Run as ``python -m tests.reliability._train --mode dpsgd|dpftrl --dir D [--rank r --world w
--store F] [--die-at STEP:PHASE]``. Used by ``test_kill_resume.py``, which SIGKILLs it.

Every step appends one JSON line to ``D/log.rank{r}.jsonl`` (the batch, a digest of the
noise that was added, the parameters after the step) before it saves ``D/ckpt.rank{r}.step{t}.pt``
(the last two are kept). On start it resumes from the newest step that every rank has
(ranks save in lockstep, so they differ by at most one step). At the end it writes
``D/final.rank{r}.pt``: the parameters and the spent epsilon.

``--die-at STEP:PHASE`` makes the process SIGKILL itself at step STEP, at PHASE:
``step`` (after the update, before the save), ``save`` (inside save_checkpoint, the
temporary file written, before the rename) or ``saved`` (after the save).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
from datetime import timedelta
from pathlib import Path

import torch

import opake_fx.accounting as acc
import opake_fx.dpsgd.accounting as dpsgd_acc
from opake_fx import dpftrl
from opake_fx.distributed import all_reduce, psum, sync
from opake_fx.dpftrl import accounting as mf_acc
from opake_fx.dpftrl.sampling import FixedEpochSampler
from opake_fx.dpsgd import clip, noise
from opake_fx.dpsgd.clipping import adaptive_clipped_grad, as_stage
from opake_fx.dpsgd.sampling import PoissonSampler
from opake_fx.optimizers import adam, sgd
from opake_fx.random import fold_in, key
from opake_fx.serialization import load_checkpoint, save_checkpoint
from opake_fx.transforms import apply_updates

N_STEPS = 8
N_DATA = 48
SAMPLE_RATE = 0.25
DELTA = 1e-5


def main() -> None:
    args = _args()
    torch.set_num_threads(1)
    if args.world > 1:
        store = torch.distributed.FileStore(args.store, args.world)
        torch.distributed.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world,
                                             timeout=timedelta(seconds=30))
    train(args.mode, Path(args.dir), rank=args.rank, world=args.world, die_at=args.die_at)
    if args.world > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def train(mode: str, directory: Path, *, rank: int = 0, world: int = 1, die_at: str = "") -> None:
    """Runs (or resumes) the whole run in this process; see the module docstring."""
    die_step, die_phase = _die_at(die_at)
    run = _build(mode, rank, world)

    params, state, sampler, accountant = run["params"], run["state"], run["sampler"], run["accountant"]
    start = _agreed_step(directory, rank, world)
    if start >= 0:
        ckpt = load_checkpoint(_ckpt(directory, rank, start), params=params, state=state, sampler=sampler,
                               accountant=accountant)
        params, state, sampler, accountant = ckpt["params"], ckpt["state"], ckpt["sampler"], ckpt["accountant"]

    x, y = run["data"]
    log = open(directory / f"log.rank{rank}.jsonl", "a")
    for idx in sampler:
        t = sampler.next_step - 1
        accountant.step(run["process"](t))
        batch = (x[idx], y[idx])
        clipped, clip_state = run["clip"].update(batch, state["clip"], params)
        clipped, _ = run["psum"].update(clipped, None)
        noised, noise_state = run["noise"].update(clipped, state["noise"])
        updates, opt_state = run["opt"].update(noised, state["opt"], params)
        if world > 1 and mode == "dpsgd":
            clip_state = sync(clip_state)  # the adaptive count summed over ranks
        params = apply_updates(params, updates)
        state = {"clip": clip_state, "noise": noise_state, "opt": opt_state}
        noise_drawn = {k: noised.pytree[k] - clipped.pytree[k] for k in params}
        log.write(json.dumps({"step": t, "batch": idx, "noise": _digest(noise_drawn), "params": _digest(params)}) + "\n")
        log.flush()
        if (t, "step") == (die_step, die_phase):
            os.kill(os.getpid(), signal.SIGKILL)
        if (t, "save") == (die_step, die_phase):
            _die_before_rename()
        save_checkpoint(_ckpt(directory, rank, t + 1), params=params, state=state, sampler=sampler,
                        accountant=accountant)
        for old in _steps(directory, rank):
            if old < t:  # keep the last two: the other ranks may still be one step behind
                _ckpt(directory, rank, old).unlink(missing_ok=True)
        if (t, "saved") == (die_step, die_phase):
            os.kill(os.getpid(), signal.SIGKILL)
    log.close()
    spent = json.dumps(accountant.state_dict()["spent"], sort_keys=True)
    torch.save({"params": params, "epsilon": accountant.spent_epsilon(DELTA), "spent": spent},
               directory / f"final.rank{rank}.pt")


def _build(mode: str, rank: int, world: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    x_all = torch.randn(N_DATA, 4, generator=gen)
    y_all = x_all @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(N_DATA, generator=gen)
    x, y = x_all[rank::world], y_all[rank::world]
    params = {"w": torch.zeros(4), "b": torch.zeros(1)}

    def loss(p, xi, yi):
        return (xi @ p["w"] + p["b"][0] - yi) ** 2

    budget = acc.epsilon_budget(10.0, delta=DELTA)  # tight enough that the headroom search is short
    if mode == "dpsgd":
        expected = SAMPLE_RATE * N_DATA
        grad_fn, clip_state = adaptive_clipped_grad(
            loss, initial_clipping_norm=1.0, count_noise_multiplier=1.0, key=key(1),
            expected_batch_size=expected, normalize_by=expected, batch_argnums=(1, 2),
        )
        clip_stage = as_stage(grad_fn, clip_state, batch_argnums=(1, 2))
        noise_stage = noise(noise_multiplier=1.0, key=key(2))
        opt = adam(0.05)
        sampler = PoissonSampler(len(x), sample_rate=SAMPLE_RATE, n_steps=N_STEPS, key=fold_in(key(0), rank))
        step_process = dpsgd_acc.poisson(dpsgd_acc.adaptive_clipping_gaussian(1.0, 1.0), SAMPLE_RATE)
        process = lambda t: step_process  # noqa: E731
    else:
        strategy = dpftrl.blt_strategy(N_STEPS, max_buffers=2)
        clip_stage = clip(loss, clipping_norm=1.0, batch_argnums=(1, 2), normalize_by=N_DATA / N_STEPS)
        noise_stage = dpftrl.noise(strategy, noise_multiplier=1.0, key=key(2))
        opt = sgd(0.1, momentum=0.9)
        sampler = FixedEpochSampler(len(x), steps_per_epoch=N_STEPS, epochs=1, key=fold_in(key(0), rank))
        steps = mf_acc.mf_gaussian_steps(1.0, strategy)
        process = lambda t: steps[t]  # noqa: E731
    stages = {"clip": clip_stage, "psum": psum(), "noise": noise_stage, "opt": opt}
    state = {name: stages[name].init(params) for name in ("clip", "noise", "opt")}
    return {**stages, "params": params, "state": state, "sampler": sampler, "accountant": acc.Accountant(budget),
            "process": process, "data": (x, y)}


def _agreed_step(directory: Path, rank: int, world: int) -> int:
    steps = _steps(directory, rank)
    latest = max(steps) if steps else -1
    if world > 1:
        latest = int(all_reduce(torch.tensor([latest]), "min"))
    return latest


def _steps(directory: Path, rank: int) -> list[int]:
    pattern = re.compile(rf"ckpt\.rank{rank}\.step(\d+)\.pt$")
    return sorted(int(m.group(1)) for p in directory.iterdir() if (m := pattern.match(p.name)))


def _ckpt(directory: Path, rank: int, step: int) -> Path:
    return directory / f"ckpt.rank{rank}.step{step}.pt"


def _digest(tree: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(tree):
        h.update(k.encode() + tree[k].detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _die_before_rename() -> None:
    # The next os.replace is save_checkpoint's rename of its fully written temporary file.
    def die(*a, **k):
        os.kill(os.getpid(), signal.SIGKILL)

    os.replace = die


def _die_at(spec: str | None) -> tuple[int, str]:
    if not spec:
        return -1, ""
    step, phase = spec.split(":")
    return int(step), phase


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["dpsgd", "dpftrl"], required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--store", default="")
    p.add_argument("--die-at", default="")
    return p.parse_args()


if __name__ == "__main__":
    main()
