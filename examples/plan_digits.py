"""Digits at epsilon 3 with a DPPlan: sampler, pipeline and accountant from one value.

The same run as `examples/demo.py` (convnet, Poisson batches of 128, clip 1, SGD with
momentum, 20 epochs, (3, 1e-5)-DP), with the wiring done by `opake_fx.plan.DPPlan`; or
DP-FTRL with a 4-band BandMF strategy, cyclic Poisson batches of 32, same budget; or
DP-FTRL with a BLT strategy under b-min-sep sampling (batches of 128, participations at
least 11 steps apart), accounted without amplification.

    python examples/plan_digits.py              # DP-SGD, 20 epochs
    python examples/plan_digits.py 20 band_mf   # DP-FTRL (BandMF, amplified by cyclic Poisson)
    python examples/plan_digits.py 20 blt       # DP-FTRL (BLT, b-min-sep, one Gaussian mechanism)
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, default_collate

from opake_fx.functional import empty_collate, make_functional
from opake_fx.optimizers import sgd
from opake_fx.plan import DPPlan
from opake_fx.random import key
from opake_fx.transforms import apply_updates


def train(train_set: TensorDataset, epsilon: float = 3.0, epochs: float = 20.0, seed: int = 0, mechanism: str = "gaussian"):
    torch.manual_seed(seed)
    fmodel, params = make_functional(nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(512, 10)))
    loss_fn = lambda p, x, y: F.cross_entropy(fmodel(p, x), y, reduction="none")  # noqa: E731  per-example losses
    plan = DPPlan(dataset_size=len(train_set), epochs=epochs, clipping_norm=1.0, target_epsilon=epsilon, delta=1e-5,
                  clip_backend="auto", **CONFIGS[mechanism])
    pipeline = plan.pipeline(loss_fn, sgd(0.1, momentum=0.9), key=key(seed), model=fmodel)
    accountant, state = plan.accountant(), pipeline.init(params)
    collate = empty_collate(default_collate)
    collate([train_set[0]])  # the template for (rare) empty Poisson batches
    batches = DataLoader(train_set, batch_sampler=plan.sampler(train_set, key(seed + 1)), collate_fn=collate)
    for step, (xb, yb) in enumerate(batches):
        accountant.step(plan.step_cost_at(step))  # refuses (before the update) a step beyond the budget
        updates, state = pipeline.update((xb, yb), state, params)
        params = apply_updates(params, updates)
    return fmodel, params, plan, accountant


CONFIGS = {
    "gaussian": {"batch_size": 128},
    "band_mf": {"mechanism": "band_mf", "bands": 4, "sampling": "cyclic_poisson", "batch_size": 32},
    "blt": {"mechanism": "blt", "sampling": "b_min_sep", "min_sep": 11, "batch_size": 128},
}


def digits(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's digits, standardised, 80/20 split (as examples/demo.py)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    x = (x - x[:1437].mean()) / x[:1437].std()
    return TensorDataset(x[:1437], y[:1437]), TensorDataset(x[1437:], y[1437:])


def main(argv: list[str] | None = None) -> float:
    epochs = float(argv[0]) if argv else 20.0
    mechanism = argv[1] if argv and len(argv) > 1 else "gaussian"
    torch.set_num_threads(min(2, torch.get_num_threads()))
    train_set, test_set = digits()
    fmodel, params, plan, accountant = train(train_set, epochs=epochs, mechanism=mechanism)
    with torch.no_grad():
        acc = (fmodel(params, test_set.tensors[0]).argmax(-1) == test_set.tensors[1]).float().mean().item()
    print(f"{plan.mechanism}: noise multiplier {plan.noise_multiplier:.4f}, {plan.steps} steps; epsilon spent "
          f"{accountant.spent_epsilon(plan.delta):.4f} of {plan.target_epsilon}; test accuracy {acc:.3f}")
    return acc


if __name__ == "__main__":
    main(sys.argv[1:])
