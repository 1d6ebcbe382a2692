"""The seed tutorial's training recipe, runnable on one rank of W or as one process over the union.

``train(rank, world_size, ...)`` inside a process group trains exactly as
``examples/distributed_dp_training.py`` does (local shard, per-rank Poisson sampler with
``fold_in(key(0), rank)``, clip -> sum_gradients_ -> noise with ``key(42)``). Outside a
process group, ``train(None, world_size, ...)`` is the single-process reference: at every
step it uses the union of the batches that the ``world_size`` ranks would sample, in rank
order, with the same noise key, so both must end with the same parameters.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import opake_fx.distributed as od
from opake_fx.dpsgd import clip, noise
from opake_fx.dpsgd.clipping import adaptive_clipped_grad, clipped_grad
from opake_fx.dpsgd.noise import gaussian_noise
from opake_fx.dpsgd.sampling import PoissonSampler
from opake_fx.functional import make_functional
from opake_fx.random import fold_in, key
from opake_fx.transforms import named_chain

DATASET_SIZE = 10_000
BATCH_SIZE = 64
LR = 0.1


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(20, 64)
        self.fc2 = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x))).squeeze(-1)


def setup() -> tuple[torch.Tensor, torch.Tensor, Any, tuple[torch.Tensor, ...]]:
    """The tutorial's data and initial parameters (same global RNG calls in the same order)."""
    torch.manual_seed(42)
    X = torch.randn(DATASET_SIZE, 20)
    y = (X[:, 0] + X[:, 1] > 0).float()
    fmodel, params = make_functional(MLP())
    return X, y, fmodel, params


def accuracy(params: Any) -> float:
    """Accuracy of ``params`` on the tutorial's whole dataset."""
    X, y, fmodel, _ = setup()
    with torch.no_grad():
        return float(((fmodel(tuple(params), X) > 0).float() == y).float().mean())


def batch_indices(rank: int | None, world_size: int, steps: int) -> list[list[int]]:
    """Global indices of each step's batch: rank ``rank``'s, or the union over ranks (``None``)."""
    ranks = range(world_size) if rank is None else [rank]
    per_rank = []
    for r in ranks:
        shard = od.local_shard(range(DATASET_SIZE), rank=r, world_size=world_size)
        sampler = PoissonSampler(
            shard, sample_rate=BATCH_SIZE / DATASET_SIZE, n_steps=steps, key=fold_in(key(0), r)
        )
        per_rank.append([[shard.indices[i] for i in sampler.batch(t)] for t in range(steps)])
    return [sum((b[t] for b in per_rank), []) for t in range(steps)]


def train(
    rank: int | None,
    world_size: int,
    *,
    steps: int,
    noise_multiplier: float,
    style: str = "function",
    adaptive: bool = False,
    sync_states: bool = True,
) -> dict[str, Any]:
    """Trains ``steps`` steps; returns the final params and the per-step clip norms."""
    X, y, fmodel, params = setup()

    def loss_fn(p: Any, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(fmodel(p, x.unsqueeze(0)).squeeze(), t)

    batches = batch_indices(rank, world_size, steps)
    norms: list[float] = []
    if style == "chain":
        pipeline = named_chain(
            ("clip", clip(loss_fn, clipping_norm=1.0, batch_argnums=(1, 2), normalize_by=BATCH_SIZE)),
            ("psum", od.psum()),
            ("noise", noise(noise_multiplier=noise_multiplier, key=key(42))),
        )
        state = pipeline.init(params)
        for idx in batches:
            out, state = pipeline.update((X[idx], y[idx]), state, params)
            params = tuple(p - LR * g for p, g in zip(params, out.pytree))
        return {"params": [p.clone() for p in params], "norms": norms}

    if adaptive:
        grad_fn, clip_state = adaptive_clipped_grad(
            loss_fn,
            argnums=0,
            batch_argnums=(1, 2),
            initial_clipping_norm=0.05,
            count_noise_multiplier=2.0,
            key=key(5),
            normalize_by=BATCH_SIZE,
            learning_rate=0.5,
        )
    else:
        grad_fn, clip_state = clipped_grad(
            loss_fn, argnums=0, batch_argnums=(1, 2), clipping_norm=1.0, normalize_by=BATCH_SIZE
        )
    noise_fn, noise_state = gaussian_noise(noise_multiplier=noise_multiplier, key=key(42))
    for idx in batches:
        grads, clip_state = grad_fn(params, X[idx], y[idx], state=clip_state)
        od.sum_gradients_(grads)
        noisy, noise_state = noise_fn(grads, noise_state)
        params = tuple(p - LR * g for p, g in zip(params, noisy.pytree))
        if sync_states:
            clip_state, noise_state = od.sync(clip_state, noise_state)
        norms.append(float(clip_state.clipping_norm) if adaptive else 1.0)
    return {"params": [p.clone() for p in params], "norms": norms}


def train_on_rank(rank: int, world_size: int, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Entry point for the harness: ``train`` on this rank of the process group."""
    return train(rank, world_size, **kwargs)


def max_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))
