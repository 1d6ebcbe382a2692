"""DP-FTRL (amplified BandMF) vs DP-SGD on scikit-learn's digits, at equal epsilon.

Both runs train the same small MLP with the same steps, expected batch size, clip norm,
learning rate and momentum; only the noise differs:

* DP-SGD: Poisson sampling at rate ``B / N`` and independent Gaussian noise, accounted as
  ``poisson(gaussian(nm), B / N) * steps``;
* BandMF: the data split into ``bands`` groups, cyclic Poisson sampling at rate
  ``B * bands / N`` within the active group, and noise ``(C^{-1} z)_t`` from a
  ``bands``-banded strategy optimised for SGD with momentum (the workload), accounted by
  the amplified-BandMF reduction ``poisson(gaussian(nm), B * bands / N) * ceil(steps / bands)``.

Each noise multiplier is calibrated to the same (epsilon, delta). The number of bands is
chosen before training (no data touched) by minimising ``nm_b * sqrt(loss_b)``, the noise
each choice puts on the momentum-SGD iterates (``bands = 1`` is DP-SGD). BandMF reports its
epsilon after every step (prefix accounting) through an Accountant that would stop the run
before the budget is exceeded.

    python examples/dpftrl_digits.py                   # epsilon 8, 3 seeds
    python examples/dpftrl_digits.py --epsilon 2 --seeds 5
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, default_collate

import opake_fx.accounting as acc
import opake_fx.dpsgd.accounting as dpsgd_acc
from opake_fx import dpftrl
from opake_fx.dpftrl import accounting as mf_acc
from opake_fx.dpsgd import clip
from opake_fx.dpsgd import noise as dpsgd_noise
from opake_fx.dpsgd.sampling import PoissonSampler
from opake_fx.functional import empty_collate, make_functional
from opake_fx.optimizers import sgd
from opake_fx.random import key
from opake_fx.transforms import apply_updates, named_chain


class MLP(nn.Module):
    """64 -> 64 -> 10 with tanh (bounded activations suit DP training)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def load_digits_tensors(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """Digits (1797 8x8 images), standardised with training statistics, 80/20 split."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    mean, std = x[:1437].mean(0), x[:1437].std(0).clamp(min=1.0)
    x = (x - mean) / std
    return TensorDataset(x[:1437], y[:1437]), TensorDataset(x[1437:], y[1437:])


def accuracy(fmodel, params, data: TensorDataset) -> float:
    x, y = data.tensors
    with torch.no_grad():
        return (fmodel(params, x).argmax(-1) == y).float().mean().item()


def choose_bands(args: argparse.Namespace, n_steps: int, dataset_size: int) -> list[dict]:
    """Calibrates the noise for each candidate number of bands and scores it (no data used)."""
    workload = dpftrl.momentum_workload(n_steps, args.momentum)
    budget = acc.epsilon_budget(args.epsilon, delta=args.delta)
    rows = []
    for bands in args.bands:
        rate = args.batch_size * bands / dataset_size
        if rate > 1.0:
            continue
        strategy = dpftrl.band_mf_strategy(n_steps, bands, workload=workload)
        nm = acc.calibrate(budget, lambda z: mf_acc.poisson(z, strategy, rate), 0.1, 100.0).param
        loss = strategy.expected_error(workload)
        rows.append({"bands": bands, "strategy": strategy, "rate": rate, "nm": nm, "loss": loss, "score": nm * math.sqrt(loss)})
    return rows


def train(args, fmodel, params0, train_set, test_set, seed: int, *, strategy=None, rate: float, nm: float) -> tuple[float, float]:
    """One private run; ``strategy=None`` is DP-SGD. Returns (test accuracy, final epsilon)."""
    n_steps = args.steps

    def loss_fn(params, x, y):
        return F.cross_entropy(fmodel(params, x.unsqueeze(0)), y.unsqueeze(0))

    clip_stage = clip(loss_fn, clipping_norm=args.clip, batch_argnums=(1, 2), normalize_by=args.batch_size)
    if strategy is None:
        noise_stage = dpsgd_noise(noise_multiplier=nm, key=key(seed))
        sampler = PoissonSampler(train_set, sample_rate=rate, n_steps=n_steps, key=key(seed + 1))
        costs = [dpsgd_acc.poisson(dpsgd_acc.gaussian(nm), rate)] * n_steps
    else:
        noise_stage = dpftrl.noise(strategy, noise_multiplier=nm, key=key(seed))
        sampler = dpftrl.CyclicPoissonSampler(train_set, sample_rate=rate, partitions=strategy.bands, n_steps=n_steps, key=key(seed + 1))
        costs = mf_acc.poisson_steps(nm, strategy, rate)
    pipeline = named_chain(("clip", clip_stage), ("noise", noise_stage), ("opt", sgd(args.lr, momentum=args.momentum)))
    params = params0
    state = pipeline.init(params)
    accountant = acc.Accountant(acc.epsilon_budget(args.epsilon, delta=args.delta))
    collate = empty_collate(default_collate)
    collate([train_set[0]])
    loader = DataLoader(train_set, batch_sampler=sampler, collate_fn=collate)
    for step, (xb, yb) in enumerate(loader):
        accountant.step(costs[step])  # raises BudgetExceededError before an over-budget release
        updates, state = pipeline.update((xb, yb), state, params)
        params = apply_updates(params, updates)
    return accuracy(fmodel, params, test_set), accountant.spent_epsilon(args.delta)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--epochs", type=float, default=20.0, help="expected passes over the data")
    parser.add_argument("--batch-size", type=int, default=64, help="expected batch size B")
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--bands", type=int, nargs="+", default=[2, 4, 8, 16], help="candidate numbers of bands")
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))

    train_set, test_set = load_digits_tensors(0)
    n_data = len(train_set)
    steps = int(round(args.epochs * n_data / args.batch_size))
    steps -= steps % 16  # a multiple of every candidate number of bands
    args.steps = steps
    print(f"digits: {n_data} train / {len(test_set)} test; {steps} steps, expected batch {args.batch_size}, "
          f"(epsilon={args.epsilon}, delta={args.delta})")

    t0 = time.perf_counter()
    q = args.batch_size / n_data
    budget = acc.epsilon_budget(args.epsilon, delta=args.delta)
    nm_sgd = acc.calibrate(budget, lambda z: dpsgd_acc.poisson(dpsgd_acc.gaussian(z), q) * steps, 0.1, 100.0).param
    sgd_loss = dpftrl.identity_strategy(steps).expected_error(dpftrl.momentum_workload(steps, args.momentum))
    rows = choose_bands(args, steps, n_data)
    best = min(rows, key=lambda r: r["score"])
    print(f"[plan] DP-SGD   bands=1  nm={nm_sgd:.3f}  noise on iterates nm*sqrt(loss)={nm_sgd * math.sqrt(sgd_loss):8.1f}")
    for r in rows:
        mark = "  <- chosen" if r is best else ""
        print(f"[plan] BandMF   bands={r['bands']:<2d} nm={r['nm']:.3f}  noise on iterates nm*sqrt(loss)={r['score']:8.1f}{mark}")
    print(f"[plan] strategies optimised and calibrated in {time.perf_counter() - t0:.1f}s")

    results: dict[str, list[float]] = {"dpsgd": [], "bandmf": [], "epsilon_dpsgd": [], "epsilon_bandmf": []}
    for seed in range(args.seeds):
        torch.manual_seed(seed)
        fmodel, params0 = make_functional(MLP())
        t1 = time.perf_counter()
        acc_sgd, eps_sgd = train(args, fmodel, params0, train_set, test_set, 100 * seed, rate=q, nm=nm_sgd)
        acc_mf, eps_mf = train(args, fmodel, params0, train_set, test_set, 100 * seed, strategy=best["strategy"], rate=best["rate"], nm=best["nm"])
        results["dpsgd"].append(acc_sgd)
        results["bandmf"].append(acc_mf)
        results["epsilon_dpsgd"].append(eps_sgd)
        results["epsilon_bandmf"].append(eps_mf)
        print(f"[seed {seed}] DP-SGD {acc_sgd:.3f} (eps {eps_sgd:.3f})   BandMF(b={best['bands']}) {acc_mf:.3f} (eps {eps_mf:.3f})"
              f"   [{time.perf_counter() - t1:.1f}s]")
        sys.stdout.flush()
    for name in ("dpsgd", "bandmf"):
        vals = results[name]
        sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
        print(f"test accuracy {name:7s}: {statistics.mean(vals):.3f} +- {sd:.3f} over {len(vals)} seeds")
    return results


if __name__ == "__main__":
    main()
