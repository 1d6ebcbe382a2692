"""Audit DP-SGD on scikit-learn's digits in one training run, and catch a broken mechanism.

A small MLP is trained at (8, 1e-5)-DP with 1000 Dirac canaries; the audit's lower bound
is compared with the accountant's epsilon. Then the same run is repeated with the noise
silently removed (the accountant still charges the plan): the audit contradicts it.

    python examples/audit_dpsgd.py
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from opake_fx.auditing import audit_dpsgd
from opake_fx.functional import make_functional
from opake_fx.random import key


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    return (x - x.mean()) / x.std(), torch.tensor(d.target, dtype=torch.int64)


def main() -> None:
    torch.set_num_threads(min(2, torch.get_num_threads()))
    torch.manual_seed(0)
    fmodel, params = make_functional(nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)))
    loss = lambda p, xi, yi: F.cross_entropy(fmodel(p, xi[None]), yi[None])  # noqa: E731  one example
    x, y = digits()
    run = dict(key=key(0), num_canaries=1000, sample_rate=0.1, steps=100, target_epsilon=8.0, delta=1e-5,
               learning_rate=0.5)
    result = audit_dpsgd(loss, params, (x, y), progress=True, **run)
    print("correct DP-SGD:   ", result)
    acc = (fmodel(result.params, x).argmax(-1) == y).float().mean().item()
    print(f"   (training accuracy {acc:.3f}; attack AUC {result.estimate.attack_auc().auc:.3f})")

    def no_noise(plan, loss_fn, optimizer, k):
        return dataclasses.replace(plan, noise_multiplier=0.0, target_epsilon=None).pipeline(
            loss_fn, optimizer, key=k, batch_argnums=(1, 2, 3))

    broken = audit_dpsgd(loss, params, (x, y), pipeline=no_noise, **run)
    print("noise removed:    ", broken)


if __name__ == "__main__":
    main()
