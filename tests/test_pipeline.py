"""The DESIGN.md pipeline end to end on one device, and the seed's function-style API."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset, default_collate

from opake_fx.dpsgd import clip, noise
from opake_fx.dpsgd.clipping import clipped_grad
from opake_fx.dpsgd.noise import gaussian_noise
from opake_fx.dpsgd.sampling import PoissonSampler
from opake_fx.errors import NoiseInputError
from opake_fx.functional import empty_collate, make_functional
from opake_fx.optimizers import sgd
from opake_fx.random import fold_in, key
from opake_fx.transforms import apply_updates, chain, named_chain
from opake_fx.types import NoisedPytree


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(20, 64)
        self.fc2 = torch.nn.Linear(64, 1)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x))).squeeze(-1)


def _data(n=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 20, generator=g)
    return X, (X[:, 0] + X[:, 1] > 0).float()


def test_chain_without_noise_or_clipping_equals_plain_sgd_on_mean_loss():
    torch.manual_seed(0)
    fmodel, params = make_functional(MLP())
    X, y = _data()
    B = 32

    def per_example_loss(params, x, y):
        return F.binary_cross_entropy_with_logits(fmodel(params, x.unsqueeze(0)).squeeze(), y)

    pipeline = named_chain(
        ("clip", clip(per_example_loss, clipping_norm=float("inf"), batch_argnums=(1, 2), normalize_by=B)),
        ("noise", noise(noise_multiplier=0.0, key=key(42))),
        ("opt", sgd(0.1, momentum=0.9)),
    )
    state = pipeline.init(params)
    ref = [p.clone().requires_grad_() for p in params]
    ref_opt = torch.optim.SGD(ref, lr=0.1, momentum=0.9)
    for step in range(10):
        xb, yb = X[step * B : (step + 1) * B], y[step * B : (step + 1) * B]
        updates, state = pipeline.update((xb, yb), state, params)
        params = apply_updates(params, updates)
        ref_opt.zero_grad()
        F.binary_cross_entropy_with_logits(fmodel(ref, xb), yb).backward()
        ref_opt.step()
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r.detach(), rtol=1e-6, atol=1e-6)


def test_chain_refuses_noise_before_clip():
    pipeline = chain(noise(noise_multiplier=1.0, key=key(0)), sgd(0.1))
    with pytest.raises(NoiseInputError):
        pipeline.update((torch.ones(2),), pipeline.init(None))


def test_seed_tutorial_single_device_parts_run_as_written():
    """The tutorial's code minus torch.distributed and accounting, with opake -> opake_fx."""
    torch.manual_seed(42)
    dataset_size = 2_000
    X = torch.randn(dataset_size, 20)
    y = (X[:, 0] + X[:, 1] > 0).float()
    dataset = TensorDataset(X, y)
    model = MLP()
    fmodel, params = make_functional(model)

    BATCH_SIZE, NUM_STEPS, LR = 64, 150, 0.1
    sample_rate = BATCH_SIZE / dataset_size
    noise_multiplier = 0.8

    def loss_fn(params, x, y):
        logit = fmodel(params, x.unsqueeze(0)).squeeze()
        return F.binary_cross_entropy_with_logits(logit, y)

    grad_fn, clip_state = clipped_grad(
        loss_fn, argnums=0, batch_argnums=(1, 2), clipping_norm=1.0, normalize_by=BATCH_SIZE
    )
    noise_fn, noise_state = gaussian_noise(noise_multiplier=noise_multiplier, key=key(42))
    sampler = PoissonSampler(dataset, sample_rate=sample_rate, n_steps=NUM_STEPS, key=fold_in(key(0), 0))
    collate = empty_collate(default_collate)
    collate([dataset[0]])
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate)

    steps = 0
    for step, (xb, yb) in enumerate(loader):
        if step >= NUM_STEPS:
            break
        grads, clip_state = grad_fn(params, xb, yb, state=clip_state)
        noisy_grads, noise_state = noise_fn(grads, noise_state)
        assert isinstance(noisy_grads, NoisedPytree)
        params = tuple(p - LR * g for p, g in zip(params, noisy_grads.pytree))
        steps += 1
    assert steps == NUM_STEPS and noise_state.step == NUM_STEPS
    with torch.no_grad():
        acc = ((fmodel(params, X) > 0).float() == y).float().mean().item()
    assert acc > 0.85, acc
