"""Ablation of the utility techniques on scikit-learn's digits (docs/utility.md's table).

Every configuration trains on the first 1150 of the demo's 1437 training images and is
scored on the other 287 (a validation split: the test images of examples/demo.py are
never used here), at each epsilon (delta 1e-5), averaged over seeds. The rows start at
the demo's DP-SGD run and add one technique at a time:

    python benchmarks/utility_ablation.py                       # epsilon 1, 3, 8; seeds 0 1
    python benchmarks/utility_ablation.py --epsilons 3 --seeds 0 1 2 --rows recipe

Run it single-threaded on a shared machine (it sets one torch thread). Tuning on the
private training data costs privacy in principle (the chosen configuration depends on
it); the numbers here are for choosing the library's defaults, which a user then applies
without tuning on their own private data (see docs/utility.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import opake_fx.accounting as acc
import opake_fx.dpsgd.accounting as dpsgd_acc
from opake_fx.augmult import augmult, gaussian_noise, random_shift
from opake_fx.averaging import ema
from opake_fx.dpsgd import clip, noise
from opake_fx.dpsgd.sampling import PoissonSampler
from opake_fx.functional import make_functional
from opake_fx.layers import WeightStandardizedConv2d, scale_last_layer_
from opake_fx.optimizers import sgd
from opake_fx.random import key
from opake_fx.transforms import apply_updates, named_chain

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from demo import TanhMLP  # noqa: E402  (the demo's recipe model itself, not a copy)


@dataclass(frozen=True)
class Config:
    """One row: the model and the training settings."""

    model: str = "convnet"  # convnet (the demo's: relu, GroupNorm after conv1) | conv_tanh | mlp
    norm: str = "gn"  # gn | none | ws_gn  (conv_tanh only)
    batch: int = 128
    epochs: float = 20.0
    lr: float = 0.1
    clip: float = 1.0
    ema: float = 0.0
    augmult: int = 0
    last_zero: bool = False
    augment: str = "shift"  # shift (random +-1 pixel) | noise (Gaussian, std 0.3)


class ConvNet(nn.Module):
    def __init__(self, act: str = "relu", norm: str = "gn") -> None:
        super().__init__()
        conv = WeightStandardizedConv2d if norm == "ws_gn" else nn.Conv2d
        self.conv1 = conv(1, 16, 3, padding=1)
        self.norm1 = nn.GroupNorm(4, 16) if norm != "none" else nn.Identity()
        self.conv2 = conv(16, 32, 3, stride=2, padding=1)
        self.norm2 = nn.GroupNorm(4, 32) if (norm != "none" and act == "tanh") else nn.Identity()
        self.fc = nn.Linear(32 * 4 * 4, 10)
        self.act = torch.tanh if act == "tanh" else F.relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.norm1(self.conv1(x)))
        x = self.act(self.norm2(self.conv2(x)))
        return self.fc(x.flatten(1))


BASE = Config()
ROWS: dict[str, Config] = {
    "dpsgd": BASE,  # examples/demo.py's DP-SGD run
    "tanh": replace(BASE, model="conv_tanh"),
    "tanh_no_groupnorm": replace(BASE, model="conv_tanh", norm="none"),
    "tanh_weight_std": replace(BASE, model="conv_tanh", norm="ws_gn"),
    "mlp": replace(BASE, model="mlp"),
    "mlp_large_batch": replace(BASE, model="mlp", batch=512, epochs=80.0),
    "recipe": replace(BASE, model="mlp", batch=512, epochs=80.0, ema=0.99),  # examples/demo.py's recipe
    "recipe_augmult2": replace(BASE, model="mlp", batch=512, epochs=80.0, ema=0.99, augmult=2),
    "recipe_augmult4_noise": replace(BASE, model="mlp", batch=512, epochs=80.0, ema=0.99, augmult=4, augment="noise"),
    "recipe_augmult1_noise": replace(BASE, model="mlp", batch=512, epochs=80.0, ema=0.99, augmult=1, augment="noise"),
    "recipe_last_zero": replace(BASE, model="mlp", batch=512, epochs=80.0, ema=0.99, last_zero=True),
    "conv_tanh_large_batch_ema": replace(BASE, model="conv_tanh", batch=256, epochs=40.0, lr=0.05, ema=0.99),
}
DESCRIPTION = {
    "dpsgd": "DP-SGD: relu convnet + GroupNorm (after conv1), B=128, 20 epochs, lr 0.1",
    "tanh": "+ tanh activations (GroupNorm after both convs)",
    "tanh_no_groupnorm": "tanh convnet without GroupNorm",
    "tanh_weight_std": "tanh convnet, weight-standardised convs + GroupNorm",
    "mlp": "tanh MLP 64-64-10, B=128, 20 epochs",
    "mlp_large_batch": "+ B=512, 80 epochs (same 180 steps; sigma/B 0.0164 vs 0.0179 at eps 3)",
    "recipe": "+ EMA 0.99 of the parameters (the demo's recipe)",
    "recipe_augmult2": "recipe + augmult K=2 (random +-1 pixel shifts)",
    "recipe_augmult4_noise": "recipe + augmult K=4 (Gaussian input noise, std 0.3)",
    "recipe_augmult1_noise": "recipe + the same noise, one copy (K=1)",
    "recipe_last_zero": "recipe + zero-initialised last layer",
    "conv_tanh_large_batch_ema": "tanh convnet + GroupNorm, B=256, 40 epochs, lr 0.05, EMA",
}


def digits_validation() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """The demo's split (seed 0); its 1437 training images split 1150 / 287; standardised
    with the 1150's statistics. Returns train x, y, validation x, y and the background value."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[perm][:1437], y[perm][:1437]
    mean, std = x[:1150].mean(), x[:1150].std()
    x = (x - mean) / std
    return x[:1150], y[:1150], x[1150:], y[1150:], float(-mean / std)


def run(cfg: Config, epsilon: float | None, seed: int, data=None) -> tuple[float, float]:
    """Validation accuracy of one configuration at ``epsilon`` (None: non-private) and its train time."""
    xtr, ytr, xva, yva, background = data or digits_validation()
    torch.manual_seed(seed)
    module = TanhMLP() if cfg.model == "mlp" else ConvNet("tanh" if cfg.model == "conv_tanh" else "relu", cfg.norm)
    if cfg.last_zero:
        scale_last_layer_(module, 0.0)
    fmodel, params = make_functional(module)
    n = len(ytr)
    q = cfg.batch / n
    steps = int(round(cfg.epochs / q))
    if epsilon is None:
        sigma = 0.0
    else:
        sigma = acc.calibrate(acc.epsilon_budget(epsilon, delta=1e-5),
                              lambda z: dpsgd_acc.poisson(dpsgd_acc.gaussian(z), q) * steps, 0.3, 200.0).param

    def loss_fn(p, xb, yb):
        return F.cross_entropy(fmodel(p, xb), yb, reduction="none")

    common = dict(clipping_norm=cfg.clip, batch_argnums=(1, 2), normalize_by=cfg.batch, clip_backend="auto",
                  model=fmodel)
    if cfg.augmult:
        if cfg.augment == "noise":
            augment = lambda keys, x: gaussian_noise(keys, x, 0.3)  # noqa: E731
        else:
            augment = lambda keys, x: random_shift(keys, x, 1, fill=background)  # noqa: E731
        stage = augmult(loss_fn, augment=augment,
                        multiplicity=cfg.augmult, key=key(seed + 7), **common)
    else:
        stage = clip(loss_fn, **common)
    pipeline = named_chain(("clip", stage), ("noise", noise(noise_multiplier=sigma, key=key(seed))),
                           ("opt", sgd(cfg.lr, momentum=0.9)))
    state = pipeline.init(params)
    averager = ema(cfg.ema) if cfg.ema else None
    avg_state = averager.init(params) if averager else None
    evaluated = params
    t0 = time.perf_counter()
    for idx in PoissonSampler(list(range(n)), sample_rate=q, n_steps=steps, key=key(seed + 1)):
        idx = torch.as_tensor(list(idx), dtype=torch.long)
        updates, state = pipeline.update((xtr[idx], ytr[idx]), state, params)
        params = apply_updates(params, updates)
        if averager:
            evaluated, avg_state = averager.update(params, avg_state)
        else:
            evaluated = params
    seconds = time.perf_counter() - t0
    with torch.no_grad():
        return (fmodel(evaluated, xva).argmax(-1) == yva).float().mean().item(), seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 3.0, 8.0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--nonprivate", action="store_true", help="add each row's non-private accuracy")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    data = digits_validation()
    cols = [f"eps {e:g}" for e in args.epsilons] + (["non-private"] if args.nonprivate else [])
    print(f"digits, validation accuracy (287 images), mean over seeds {args.seeds}; delta 1e-5")
    print("| configuration | " + " | ".join(cols) + " | s/run |")
    print("|---|" + "---|" * (len(cols) + 1))
    for name in args.rows:
        cells, times = [], []
        for eps in list(args.epsilons) + ([None] if args.nonprivate else []):
            results = [run(ROWS[name], eps, s, data) for s in args.seeds]
            cells.append(f"{statistics.mean(r[0] for r in results):.3f}")
            times += [r[1] for r in results]
        print(f"| {DESCRIPTION[name]} | " + " | ".join(cells) + f" | {statistics.mean(times):.1f} |", flush=True)


if __name__ == "__main__":
    main()
