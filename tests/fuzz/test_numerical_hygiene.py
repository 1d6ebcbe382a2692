"""Numerical hygiene on every clipping backend: low precision, extreme and non-finite
gradients, empty batches from every sampler, a batch of one, parameters without gradient,
frozen and tied parameters."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from opake_fx.dpftrl.sampling import BallsInBinsSampler, CyclicPoissonSampler, FixedEpochSampler, MinSepSampler
from opake_fx.dpsgd.clipping import clipped_grad
from opake_fx.dpsgd.sampling import PoissonSampler, SequentialBatchSampler, TruncatedPoissonSampler
from opake_fx.errors import InputValueError, SlowPathWarning
from opake_fx.functional import make_functional
from opake_fx.random import key
from opake_fx.testing import SmallModel, assert_clipped, assert_tree_finite, assert_trees_close, assert_trees_equal

BACKENDS = ["vmap", "ghost", "auto"]


def _model(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> SmallModel:
    return SmallModel(module.eval(), x, y, "hand-built")


def _clip(backend: str, m: SmallModel, c: float = 1.0, **kw):
    fmodel, params = m.functional()
    if backend == "vmap":
        loss, extra = m.example_loss(fmodel), {}
    else:
        loss, extra = m.batched_loss(fmodel), {"clip_backend": backend, "model": fmodel}
    grad_fn, state = clipped_grad(loss, batch_argnums=(1, 2), clipping_norm=c, return_aux=True, **extra, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowPathWarning)
        (out, aux), _ = grad_fn(params, m.x, m.y, state=state)
    return out, aux, params


def _linear(dtype=torch.float32, batch=4, seed=0) -> SmallModel:
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2)).to(dtype)
    return _model(module, torch.randn(batch, 3, generator=gen).to(dtype), torch.randn(batch, 2, generator=gen).to(dtype))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_models_accumulate_in_float32(backend, dtype):
    m = _linear(dtype)
    out, aux, params = _clip(backend, m, c=0.5)
    assert all(leaf.dtype == torch.float32 for leaf in out.pytree)  # the sum is accumulated in float32
    assert_tree_finite(out.pytree)
    ref, _, _ = _clip("vmap", _linear(torch.float32), c=0.5)
    assert_trees_close(tuple(out.pytree), tuple(ref.pytree), rtol=0.1, atol=0.05)  # the same sum, to low precision
    assert float(aux.clipped_grad_norms.max()) <= 0.5 * (1 + 1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [1e-40, 1e30])
def test_subnormal_and_huge_gradients(backend, scale):
    # A loss scaled by `scale` scales every per-example gradient: 1e-40 makes them
    # subnormal in float32, 1e30 makes their squared norms overflow float32.
    m = _linear()
    fmodel, params = m.functional()
    base, _, _ = _clip(backend, m, c=1.0)
    loss = (lambda p, x, y: scale * m.example_loss(fmodel)(p, x, y)) if backend == "vmap" else (
        lambda p, x, y: scale * m.batched_loss(fmodel)(p, x, y))
    extra = {} if backend == "vmap" else {"clip_backend": backend, "model": fmodel}
    grad_fn, state = clipped_grad(loss, batch_argnums=(1, 2), clipping_norm=1.0, return_aux=True, **extra)
    (out, aux), _ = grad_fn(params, m.x, m.y, state=state)
    assert_tree_finite(out.pytree)
    assert aux.num_nonfinite == 0
    if scale > 1:  # every example is clipped to norm C: the sum equals the unscaled run's clipped sum
        assert_trees_close(tuple(out.pytree), tuple(base.pytree), rtol=1e-4, atol=1e-6)
        assert float(aux.clipped_grad_norms.min()) == pytest.approx(1.0, rel=1e-5)
    else:  # nothing is clipped: the tiny gradients come through unchanged (not flushed to 0 or NaN)
        assert 0.0 < float(aux.clipped_grad_norms.max()) <= 1e-30
        torch.testing.assert_close(aux.clipped_grad_norms, aux.grad_norms)


@pytest.mark.parametrize("backend", ["vmap", "ghost", "auto"])
def test_nan_and_inf_examples_are_zeroed_and_counted(backend):
    m = _linear(batch=5)
    x = m.x.clone()
    x[1, 0], x[3, 2] = float("nan"), float("inf")
    bad = _model(m.module, x, m.y)
    out, aux, _ = _clip(backend, bad)
    assert aux.num_nonfinite == 2
    assert_tree_finite(out.pytree)
    keep = torch.tensor([0, 2, 4])
    good, _, _ = _clip(backend, _model(m.module, m.x[keep], m.y[keep]))
    assert_trees_close(tuple(out.pytree), tuple(good.pytree), rtol=1e-5, atol=1e-7)  # the policy: weight 0


SAMPLERS = {
    "poisson": lambda: PoissonSampler(5, sample_rate=1e-9, n_steps=3, key=key(0)),
    "truncated": lambda: TruncatedPoissonSampler(5, sample_rate=1e-9, n_steps=3, key=key(0), max_batch_size=2),
    "cyclic": lambda: CyclicPoissonSampler(5, sample_rate=1e-9, partitions=1, n_steps=3, key=key(0)),
    "minsep": lambda: MinSepSampler(5, sample_rate=1e-9, min_sep=1, n_steps=3, key=key(0)),
    "bins": lambda: BallsInBinsSampler(2, cycle_length=3, n_steps=3, key=key(0)),
}


def test_the_samplers_that_cannot_be_empty_refuse_configurations_that_would_be():
    with pytest.raises(InputValueError, match="some batches would be empty"):
        FixedEpochSampler(2, steps_per_epoch=3, epochs=1, key=key(0))
    with pytest.raises(InputValueError, match="has no batches"):
        SequentialBatchSampler(2, batch_size=3, drop_last=True)


@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batches_from_every_sampler(sampler, backend):
    m = _linear(batch=5)
    empty = [b for b in SAMPLERS[sampler]() if not b]
    assert empty, f"{sampler} drew no empty batch; the test needs one"
    idx = torch.tensor(empty[0], dtype=torch.int64)
    out, aux, params = _clip(backend, _model(m.module, m.x[idx], m.y[idx]))
    assert aux.batch_size == 0
    assert_trees_equal(tuple(out.pytree), tuple(torch.zeros_like(p, dtype=torch.float32) for p in params))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_batch_of_one_is_that_example_clipped(backend):
    m = _linear(batch=1)
    out, aux, _ = _clip(backend, m, c=0.1)
    ref, _, _ = _clip("vmap", m, c=0.1)
    assert_trees_close(tuple(out.pytree), tuple(ref.pytree), rtol=1e-5, atol=1e-8)
    assert_clipped(tuple(leaf.unsqueeze(0) for leaf in out.pytree), 0.1 * (1 + 1e-6))


class _Partial(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(3, 2)
        self.unused = nn.Linear(3, 2)
        self.frozen = nn.Linear(2, 2)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(self.used(x))


@pytest.mark.parametrize("backend", BACKENDS)
def test_unused_and_frozen_parameters(backend):
    gen = torch.Generator().manual_seed(3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        module = _Partial().double()
    m = _model(module, torch.randn(4, 3, generator=gen, dtype=torch.float64), torch.randn(4, 2, generator=gen, dtype=torch.float64))
    out, aux, params = _clip(backend, m)
    names = m.functional()[0].param_names
    grads = dict(zip(names, out.pytree))
    assert float(grads["unused.weight"].abs().max()) == 0.0 and float(grads["unused.bias"].abs().max()) == 0.0
    ref, ref_aux, _ = _clip("vmap", m)
    assert_trees_close(tuple(out.pytree), tuple(ref.pytree), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(aux.grad_norms, ref_aux.grad_norms, rtol=1e-9, atol=1e-12)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))


@pytest.mark.parametrize("backend", BACKENDS)
def test_tied_weights(backend):
    gen = torch.Generator().manual_seed(4)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(4)
        module = _Tied().double()
    m = _model(module, torch.randint(0, 7, (4, 3), generator=gen), torch.randn(4, 3, 7, generator=gen, dtype=torch.float64))
    out, aux, params = _clip(backend, m, c=0.3)
    assert len(params) == 1  # one tensor, used twice
    ref, ref_aux, _ = _clip("vmap", m, c=0.3)
    assert_trees_close(tuple(out.pytree), tuple(ref.pytree), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(aux.grad_norms, ref_aux.grad_norms, rtol=1e-9, atol=1e-12)
