"""DP-SGD on scikit-learn's digits with opake_fx: the `make demo` job.

Trains a small convnet with Poisson sampling, per-example clipping and Gaussian noise,
the noise multiplier calibrated for a target (epsilon, delta), an Accountant that stops
training cleanly before the budget would be exceeded, and a non-private baseline with
the same model, steps and optimizer for comparison.

    python examples/demo.py                  # epsilon 3, delta 1e-5
    python examples/demo.py --epsilon 1 --epochs 10
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, default_collate

import opake_fx.accounting as acc
import opake_fx.dpsgd.accounting as dpsgd_acc
from opake_fx.distributed import psum
from opake_fx.dpsgd import clip, noise
from opake_fx.dpsgd.sampling import PoissonSampler
from opake_fx.functional import empty_collate, make_functional
from opake_fx.optimizers import sgd
from opake_fx.random import key
from opake_fx.transforms import apply_updates, named_chain


class ConvNet(nn.Module):
    """A small convnet for 8x8 digits (GroupNorm: it never mixes examples)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.norm1 = nn.GroupNorm(4, 16)
        self.conv2 = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.fc = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm1(self.conv1(x)))
        x = F.relu(self.conv2(x))
        return self.fc(x.flatten(1))


def load_digits_tensors(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """Digits (1797 8x8 images shipped with scikit-learn), standardised, 80/20 split."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    mean, std = x[:1437].mean(), x[:1437].std()
    x = (x - mean) / std
    return TensorDataset(x[:1437], y[:1437]), TensorDataset(x[1437:], y[1437:])


def accuracy(fmodel, params, data: TensorDataset) -> float:
    x, y = data.tensors
    with torch.no_grad():
        return (fmodel(params, x).argmax(-1) == y).float().mean().item()


def progress(iterable, total: int, desc: str):
    try:
        from tqdm import tqdm

        return tqdm(iterable, total=total, desc=desc, leave=False, file=sys.stdout, disable=not sys.stdout.isatty())
    except ImportError:  # tqdm is in the demo extra; the demo runs without it
        return iterable


def train_private(args: argparse.Namespace, train: TensorDataset, test: TensorDataset) -> float:
    torch.manual_seed(args.seed)
    fmodel, params = make_functional(ConvNet())
    n = len(train)
    q = args.batch_size / n
    steps = int(round(args.epochs / q))

    def per_step(nm: float) -> acc.DpProcess:
        return dpsgd_acc.poisson(dpsgd_acc.gaussian(nm), q)

    t0 = time.perf_counter()
    calibration = acc.calibrate(
        acc.epsilon_budget(args.epsilon, delta=args.delta),
        lambda nm: per_step(nm) * steps,
        param_min=0.3,
        param_max=50.0,
    )
    nm = calibration.param
    print(
        f"[dp] {steps} steps at sample rate {q:.4f}: noise multiplier {nm:.4f} for "
        f"(epsilon={args.epsilon}, delta={args.delta}) (calibrated in {time.perf_counter() - t0:.2f}s)"
    )

    if args.clip_backend == "vmap":
        def loss_fn(params, x, y):  # one example; vmapped over the batch
            return F.cross_entropy(fmodel(params, x.unsqueeze(0)), y.unsqueeze(0))
    else:
        def loss_fn(params, x, y):  # the whole batch; per-example losses [B]
            return F.cross_entropy(fmodel(params, x), y, reduction="none")

    clip_stage = clip(loss_fn, clipping_norm=args.clip, batch_argnums=(1, 2), normalize_by=args.batch_size,
                      clip_backend=args.clip_backend, model=None if args.clip_backend == "vmap" else fmodel)
    pipeline = named_chain(
        ("clip", clip_stage),
        ("psum", psum()),
        ("noise", noise(noise_multiplier=nm, key=key(args.seed))),
        ("opt", sgd(args.lr, momentum=0.9)),
    )
    state = pipeline.init(params)
    accountant = acc.Accountant(acc.epsilon_budget(args.epsilon, delta=args.delta))
    step_cost = per_step(nm)

    sampler = PoissonSampler(train, sample_rate=q, n_steps=steps, key=key(args.seed + 1))
    collate = empty_collate(default_collate)
    collate([train[0]])
    loader = DataLoader(train, batch_sampler=sampler, collate_fn=collate)
    steps_per_epoch = max(1, int(round(1 / q)))
    t0 = time.perf_counter()
    for step, (xb, yb) in enumerate(progress(loader, steps, "DP-SGD")):
        if accountant.would_exceed(step_cost):
            print(f"[dp] stopping before step {step + 1}: it would exceed the privacy budget.")
            break
        updates, state = pipeline.update((xb, yb), state, params)
        params = apply_updates(params, updates)
        accountant |= step_cost
        if (step + 1) % steps_per_epoch == 0 or step + 1 == steps:
            print(
                f"[dp] step {step + 1:4d}/{steps}  test accuracy {accuracy(fmodel, params, test):.3f}  "
                f"epsilon spent {accountant.spent_epsilon(args.delta):.3f}"
            )
    print(f"[dp] trained in {time.perf_counter() - t0:.1f}s; final epsilon {accountant.spent_epsilon(args.delta):.4f}")
    return accuracy(fmodel, params, test)


def train_nonprivate(args: argparse.Namespace, train: TensorDataset, test: TensorDataset) -> float:
    torch.manual_seed(args.seed)
    model = ConvNet()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    x, y = train.tensors
    steps = int(round(args.epochs * len(train) / args.batch_size))
    g = torch.Generator().manual_seed(args.seed)
    for _ in range(steps):
        idx = torch.randint(0, len(train), (args.batch_size,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    fmodel, params = make_functional(model)
    return accuracy(fmodel, params, test)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epsilon", type=float, default=3.0, help="target epsilon (default 3)")
    parser.add_argument("--delta", type=float, default=1e-5, help="target delta (default 1e-5)")
    parser.add_argument("--epochs", type=float, default=20.0, help="expected passes over the data")
    parser.add_argument("--batch-size", type=int, default=128, help="expected batch size")
    parser.add_argument("--clip", type=float, default=1.0, help="per-example clip norm")
    parser.add_argument("--lr", type=float, default=0.1, help="learning rate (SGD, momentum 0.9)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clip-backend", choices=("auto", "ghost", "vmap"), default="auto",
                        help="per-example clipping: norms from activations (auto/ghost) or vmap(grad)")
    args = parser.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))

    train, test = load_digits_tensors(args.seed)
    print(f"digits: {len(train)} train / {len(test)} test images (8x8, 10 classes)")
    dp_acc = train_private(args, train, test)
    base_acc = train_nonprivate(args, train, test)
    print()
    print(f"test accuracy, DP-SGD (epsilon={args.epsilon}, delta={args.delta}): {dp_acc:.3f}")
    print(f"test accuracy, non-private (same model, steps, optimizer):     {base_acc:.3f}")


if __name__ == "__main__":
    main()
