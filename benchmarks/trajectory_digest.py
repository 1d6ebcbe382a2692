"""Digests of short training trajectories: a refactoring check, not a speed benchmark.

Runs the demo's two private trainings (shortened) and a short run of every sampler x
mechanism x clipping-mode pair a ``DPPlan`` can build, and prints, per run, the sha256 of
the final parameters' bytes, the noise multiplier and the epsilons spent, as JSON. Run it
on two commits and compare the outputs: a refactoring that keeps behaviour prints the same
lines (issue 31's acceptance: bit-identical trajectories before and after).

    python benchmarks/trajectory_digest.py > after.json
    PYTHONPATH=/path/to/old/checkout python benchmarks/trajectory_digest.py > before.json
    diff before.json after.json

Only APIs that predate issue 31 are used, so the script runs on older commits too.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import pathlib
import sys

import torch
import torch.nn.functional as F
from torch import nn

import opake_fx
from opake_fx.functional import make_functional
from opake_fx.optimizers import adam, adamw, sgd
from opake_fx.plan import DPPlan
from opake_fx.random import key
from opake_fx.transforms import apply_updates

ROOT = pathlib.Path(__file__).resolve().parent.parent

PLANS: dict[str, dict] = {
    "gaussian-poisson-fixed": {},
    "gaussian-poisson-fixed-target": {"target_epsilon": 4.0, "noise_multiplier": None},
    "gaussian-truncated": {"sampling": "truncated_poisson", "max_batch_size": 40},
    "gaussian-poisson-auto": {"clipping_mode": "auto"},
    "gaussian-poisson-adaptive": {"clipping_mode": "adaptive"},
    "gaussian-poisson-adaptive-target": {"clipping_mode": "adaptive", "target_epsilon": 6.0,
                                         "noise_multiplier": None},
    "band_mf-cyclic": {"mechanism": "band_mf", "sampling": "cyclic_poisson", "bands": 3},
    "bsr-cyclic-rdp": {"mechanism": "bsr", "sampling": "cyclic_poisson", "bands": 2, "accountant_kind": "rdp"},
    "band_mf-min_sep": {"mechanism": "band_mf", "sampling": "b_min_sep", "bands": 2, "min_sep": 3},
    "bsr-balls": {"mechanism": "bsr", "sampling": "balls_in_bins", "bands": 2, "min_sep": 10, "batch_size": None},
    "blt-min_sep": {"mechanism": "blt", "sampling": "b_min_sep", "min_sep": 4},
    "blt-balls-target": {"mechanism": "blt", "sampling": "balls_in_bins", "min_sep": 10, "batch_size": None,
                         "target_epsilon": 8.0, "noise_multiplier": None},
    "nonprivate": {"noise_multiplier": 0.0},
}
OPTIMIZERS = {"sgd": lambda: sgd(0.1, momentum=0.9), "adam": lambda: adam(0.01), "adamw": lambda: adamw(0.01, weight_decay=0.1)}


def digest(params) -> str:
    h = hashlib.sha256()
    for p in params.values() if isinstance(params, dict) else params:
        h.update(p.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def digits(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return torch.tensor(x[:n] / 16.0, dtype=torch.float32), torch.tensor(y[:n])


def plan_runs(steps: int) -> dict[str, dict]:
    x, y = digits(300)
    out = {}
    for name, extra in PLANS.items():
        fields = dict(dataset_size=300, batch_size=30, steps=steps, clipping_norm=1.0, noise_multiplier=1.1,
                      delta=1e-5, clip_backend="auto")
        fields.update(extra)
        plan = DPPlan(**fields)
        for opt_name, make_opt in OPTIMIZERS.items():
            if opt_name != "sgd" and name not in ("gaussian-poisson-fixed", "band_mf-cyclic"):
                continue
            torch.manual_seed(0)
            fmodel, params = make_functional(nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10)))

            def loss_fn(p, xb, yb):
                return F.cross_entropy(fmodel(p, xb), yb, reduction="none")

            extra_keys = {"count_key": key(7)} if plan.clipping_mode == "adaptive" else {}
            pipeline = plan.pipeline(loss_fn, make_opt(), key=key(5), model=fmodel, **extra_keys)
            state = pipeline.init(params)
            accountant = plan.accountant() if plan.noise_multiplier > 0 else None
            spent = []
            for t, batch in enumerate(plan.sampler(range(300), key(6))):
                if accountant is not None:
                    accountant.step(plan.step_cost_at(t))
                    spent.append(repr(accountant.spent_epsilon(1e-5)))
                idx = torch.tensor(batch, dtype=torch.long)
                updates, state = pipeline.update((x[idx], y[idx]), state, params)
                params = apply_updates(params, updates)
            out[f"{name}/{opt_name}"] = {
                "params": digest(params), "noise_multiplier": repr(plan.noise_multiplier),
                "epsilon": repr(plan.epsilon()) if plan.noise_multiplier > 0 else "inf", "spent": spent,
            }
    return out


def demo_runs() -> dict[str, dict]:
    """The demo's DP-SGD (hand-built chain: the seed tutorial's pipeline) and recipe (DPPlan) runs, shortened."""
    spec = importlib.util.spec_from_file_location("opake_demo", ROOT / "examples" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    finals: list[str] = []
    real_accuracy = demo.accuracy

    def recording(fmodel, params, data):
        finals.append(digest(params))
        return real_accuracy(fmodel, params, data)

    demo.accuracy = recording
    args = argparse.Namespace(epsilon=3.0, delta=1e-5, epochs=1.0, batch_size=128, clip=1.0, lr=0.1,
                              recipe_epochs=2.0, recipe_batch_size=512, recipe_lr=0.1, ema_decay=0.99, seed=0,
                              clip_backend="auto")
    train, test = demo.load_digits_tensors(0)
    out = {}
    for name, fn in (("demo-dpsgd", demo.train_private), ("demo-recipe", demo.train_recipe)):
        finals.clear()
        _, eps = fn(args, train, test)
        out[name] = {"params": finals[-1], "all": list(finals), "epsilon": repr(eps)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"# opake_fx from {pathlib.Path(opake_fx.__file__).parent}", file=sys.stderr)
    results = {**plan_runs(args.steps), **demo_runs()}
    for name, r in results.items():
        print(json.dumps({name: r}, sort_keys=True))


if __name__ == "__main__":
    main()
