"""DP training on scikit-learn's digits with opake_fx: the `make demo` job.

Three runs from one seed, side by side, each with its epsilon:

* non-private: a small convnet, plain SGD with momentum;
* DP-SGD: the same convnet with Poisson sampling, per-example clipping and Gaussian
  noise, the noise multiplier calibrated for (epsilon, delta), an Accountant that stops
  training cleanly before the budget would be exceeded;
* the opake_fx recipe (docs/utility.md): a DP-friendly model (tanh activations), large
  Poisson batches with proportionally more epochs at the same epsilon (the noise-to-signal
  ratio sigma / B falls), and an exponential moving average of the parameters
  (post-processing, free), wired through a DPPlan. Its settings were chosen on a
  validation split of the training data (benchmarks/utility_ablation.py), never on the
  test set.

    python examples/demo.py                  # epsilon 3, delta 1e-5
    python examples/demo.py --epsilon 1 --epochs 10 --recipe-epochs 40
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
from opake_fx.averaging import ema
from opake_fx.optimizers import sgd
from opake_fx.plan import DPPlan
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


class TanhMLP(nn.Module):
    """64 -> 64 -> 10 with tanh: bounded activations keep per-example gradients small and
    even, so clipping distorts them less (Papernot et al. 2021, tempered sigmoids)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x.flatten(1))))


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


def train_private(args: argparse.Namespace, train: TensorDataset, test: TensorDataset) -> tuple[float, float]:
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
    spent = accountant.spent_epsilon(args.delta)
    print(f"[dp] trained in {time.perf_counter() - t0:.1f}s; final epsilon {spent:.4f}")
    return accuracy(fmodel, params, test), spent


def train_recipe(args: argparse.Namespace, train: TensorDataset, test: TensorDataset) -> tuple[float, float]:
    """The recipe: tanh MLP, batch 512 for 80 epochs at the same epsilon, EMA of the parameters."""
    torch.manual_seed(args.seed)
    fmodel, params = make_functional(TanhMLP())
    plan = DPPlan(dataset_size=len(train), batch_size=args.recipe_batch_size, epochs=args.recipe_epochs,
                  clipping_norm=args.clip, target_epsilon=args.epsilon, delta=args.delta, clip_backend="auto")
    print(f"[recipe] {plan.steps} steps at sample rate {plan.sample_rate:.4f}: noise multiplier "
          f"{plan.noise_multiplier:.4f} (noise std / batch {plan.noise_multiplier / plan.batch_size:.4f}; DP-SGD above: "
          f"batch {args.batch_size})")

    def loss_fn(params, x, y):  # the whole batch; per-example losses [B]
        return F.cross_entropy(fmodel(params, x), y, reduction="none")

    pipeline = plan.pipeline(loss_fn, sgd(args.recipe_lr, momentum=0.9), key=key(args.seed), model=fmodel)
    averager = ema(args.ema_decay)  # post-processing of the released parameters: no privacy cost
    accountant, state, avg_state = plan.accountant(), pipeline.init(params), averager.init(params)
    collate = empty_collate(default_collate)
    collate([train[0]])
    loader = DataLoader(train, batch_sampler=plan.sampler(train, key(args.seed + 1)), collate_fn=collate)
    averaged = params
    t0 = time.perf_counter()
    for xb, yb in progress(loader, plan.steps, "recipe"):
        accountant.step(plan.step_cost)  # refuses (before the update) a step beyond the budget
        updates, state = pipeline.update((xb, yb), state, params)
        params = apply_updates(params, updates)
        averaged, avg_state = averager.update(params, avg_state)
    spent = accountant.spent_epsilon(args.delta)
    print(f"[recipe] trained in {time.perf_counter() - t0:.1f}s; final epsilon {spent:.4f}; test accuracy "
          f"{accuracy(fmodel, averaged, test):.3f} with the EMA, {accuracy(fmodel, params, test):.3f} without")
    return accuracy(fmodel, averaged, test), spent


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
    parser.add_argument("--recipe-epochs", type=float, default=80.0, help="the recipe's expected passes")
    parser.add_argument("--recipe-batch-size", type=int, default=512, help="the recipe's expected batch size")
    parser.add_argument("--recipe-lr", type=float, default=0.1, help="the recipe's learning rate (momentum 0.9)")
    parser.add_argument("--ema-decay", type=float, default=0.99, help="the recipe's EMA decay (with warm-up)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clip-backend", choices=("auto", "ghost", "vmap"), default="auto",
                        help="per-example clipping: norms from activations (auto/ghost) or vmap(grad)")
    args = parser.parse_args(argv)
    # One thread: these models are tiny, so intra-op threads gain little, and on a busy machine two
    # threads per process thrash (the demo measured 25 s with one thread, 232 s with two, under load 5-8).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _run(args)
    finally:
        torch.set_num_threads(threads)  # the caller's setting (the test imports main)


def _run(args: argparse.Namespace) -> None:
    """The three runs and the side-by-side table."""
    train, test = load_digits_tensors(args.seed)
    print(f"digits: {len(train)} train / {len(test)} test images (8x8, 10 classes)")
    t0 = time.perf_counter()
    dp_acc, dp_eps = train_private(args, train, test)
    recipe_acc, recipe_eps = train_recipe(args, train, test)
    base_acc = train_nonprivate(args, train, test)
    print()
    print(f"{'run':58s} {'epsilon':>8s}  test accuracy")
    print(f"{'non-private (convnet, same steps and optimizer as DP-SGD)':58s} {'inf':>8s}  {base_acc:.3f}")
    print(f"{f'DP-SGD (convnet, batch {args.batch_size}, {args.epochs:g} epochs)':58s} {dp_eps:8.3f}  {dp_acc:.3f}")
    print(f"{f'opake_fx recipe (tanh MLP, batch {args.recipe_batch_size}, {args.recipe_epochs:g} epochs, EMA)':58s} "
          f"{recipe_eps:8.3f}  {recipe_acc:.3f}")
    print(f"(delta={args.delta}; the whole demo ran in {time.perf_counter() - t0:.0f}s)")
    print(f"test accuracy, DP-SGD (epsilon={args.epsilon}, delta={args.delta}): {dp_acc:.3f}")
    print(f"test accuracy, recipe (epsilon={args.epsilon}, delta={args.delta}): {recipe_acc:.3f}")


if __name__ == "__main__":
    main()
