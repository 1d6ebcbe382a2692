"""User-level DP on digits with a heavy-tailed number of examples per user: ULS vs ELS.

At a user-level epsilon of 3 and 8 (delta 1e-4) and a per-user cap k, trains the same
tanh MLP two ways and prints the test accuracy:

* ULS (user-level sampling): ``DPPlan(privacy_unit="user", max_examples_per_user=k)``,
  users Poisson-sampled, each user's mean gradient clipped once;
* ELS (example-level sampling with a per-user cap):
  ``DPPlan(privacy_unit="user", user_sampling="examples", max_examples_per_user=k)``, each user
  capped at k examples for the whole run, example-level DP-SGD, the noise multiplier calibrated
  so that the group-privacy epsilon for k (``group_epsilon``: the smaller of the lemma and RDP's
  group property) meets the target.

Users: 1,437 training images assigned to 400 users with probability proportional to
``1 / (u + 1)`` (a Zipf-like tail: the largest user holds 171 images, the median 2).
Both arms take the same number of steps and the same expected number of examples per
step; the test set is the held-out 360 images. One run per cell (seeded).

    python benchmarks/user_level.py             # the table
    python benchmarks/user_level.py --plot docs/img/user_level.png
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from opake_fx.errors import CalibrationError
from opake_fx.functional import make_functional
from opake_fx.optimizers import sgd
from opake_fx.plan import DPPlan
from opake_fx.random import key
from opake_fx.transforms import apply_updates
from opake_fx.users import UserIndex, collate_users

DELTA = 1e-4


def data(n_users: int, seed: int = 0):
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(y), generator=g)
    x, y = torch.tensor(x / 16.0, dtype=torch.float32)[perm], torch.tensor(y)[perm]
    ids = torch.multinomial(1.0 / torch.arange(1, n_users + 1, dtype=torch.float64), 1437, replacement=True,
                            generator=g)
    ids[:n_users] = torch.arange(n_users)  # every user holds at least one image
    return (x[:1437], y[:1437], ids), (x[1437:], y[1437:])


def model():
    torch.manual_seed(0)
    return make_functional(nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10)))


def accuracy(fmodel, params, test) -> float:
    with torch.no_grad():
        return float((fmodel(params, test[0]).argmax(-1) == test[1]).float().mean())


def uls(train, test, k: int, epsilon: float, steps: int, users_per_step: float, lr: float) -> tuple[float, float]:
    x, y, ids = train
    users = UserIndex(ids)
    plan = DPPlan(privacy_unit="user", max_examples_per_user=k, dataset_size=users.n_users,
                  batch_size=users_per_step, steps=steps, clipping_norm=1.0, target_epsilon=epsilon, delta=DELTA,
                  clip_backend="auto")
    fmodel, params = model()
    pipeline = plan.pipeline(lambda p, xb, yb: F.cross_entropy(fmodel(p, xb), yb, reduction="none"),
                             sgd(lr, momentum=0.9), key=key(0), model=fmodel)
    state = pipeline.init(params)
    for groups in plan.sampler(x, key(1), user_ids=ids):
        (xb, yb), mask = collate_users((x, y), groups, max_examples=k)
        updates, state = pipeline.update((xb, yb, mask), state, params)
        params = apply_updates(params, updates)
    return accuracy(fmodel, params, test), plan.noise_multiplier


def els(train, test, k: int, epsilon: float, steps: int, examples_per_step: float, lr: float) -> tuple[float, float]:
    x, y, ids = train
    kept = UserIndex(ids).capped_size(k)
    try:
        plan = DPPlan(privacy_unit="user", user_sampling="examples", max_examples_per_user=k, dataset_size=kept,
                      batch_size=min(examples_per_step, kept), steps=steps, clipping_norm=1.0, target_epsilon=epsilon,
                      delta=DELTA, clip_backend="auto")
    except CalibrationError:  # no noise multiplier meets the per-user target for a group of k
        return math.nan, math.inf
    fmodel, params = model()
    pipeline = plan.pipeline(lambda p, xb, yb: F.cross_entropy(fmodel(p, xb), yb, reduction="none"),
                             sgd(lr, momentum=0.9), key=key(0), model=fmodel)
    state = pipeline.init(params)
    for batch in plan.sampler(x, key(1), user_ids=ids):
        idx = torch.as_tensor(batch, dtype=torch.long)
        updates, state = pipeline.update((x[idx], y[idx]), state, params)
        params = apply_updates(params, updates)
    return accuracy(fmodel, params, test), plan.noise_multiplier


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=400)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--users-per-step", type=float, default=100.0)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[3.0, 8.0])
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--plot", default=None, help="write a PNG of the table here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    train, test = data(args.users)
    counts = UserIndex(train[2]).counts()
    print(f"{len(counts)} users, examples per user: max {max(counts)}, median {sorted(counts)[len(counts) // 2]}, "
          f"min {min(counts)}; test set {len(test[1])}")
    print(f"{'eps':>5} {'k':>4} {'ULS acc':>8} {'ULS sigma':>10} {'ELS acc':>8} {'ELS sigma':>10} {'s':>6}")
    rows = []
    for eps in args.epsilons:
        for k in args.ks:
            t0 = time.perf_counter()
            capped_sizes = sum(min(c, k) for c in counts) / len(counts)  # mean examples a sampled user brings
            u_acc, u_nm = uls(train, test, k, eps, args.steps, args.users_per_step, args.lr)
            e_acc, e_nm = els(train, test, k, eps, args.steps, args.users_per_step * capped_sizes, args.lr)
            rows.append((eps, k, u_acc, e_acc))
            print(f"{eps:5g} {k:4d} {u_acc:8.3f} {u_nm:10.3f} {e_acc:8.3f} {e_nm:10.3f} {time.perf_counter() - t0:6.1f}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(args.epsilons), figsize=(4.2 * len(args.epsilons), 3.2), sharey=True)
        for ax, eps in zip(list(axes) if len(args.epsilons) > 1 else [axes], args.epsilons):
            ks = [r[1] for r in rows if r[0] == eps]
            ax.plot(ks, [r[2] for r in rows if r[0] == eps], "o-", label="ULS (sample users)")
            ax.plot(ks, [r[3] for r in rows if r[0] == eps], "s--", label="ELS + group privacy")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("k (examples per user per step / cap)")
            ax.set_title(f"user-level epsilon {eps:g}, delta {DELTA:g}")
            ax.grid(alpha=0.3)
        (list(axes) if len(args.epsilons) > 1 else [axes])[0].set_ylabel("test accuracy")
        (list(axes) if len(args.epsilons) > 1 else [axes])[-1].legend(loc="lower left")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
