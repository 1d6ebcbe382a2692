"""Augmentation multiplicity: each example's gradient is the mean over its K copies, clipped as one.

Every backend (vmap, ghost, auto) is compared, in float64, with a per-example loop over
the augmented copies (``torch.func.grad`` of each copy's loss, averaged, clipped, summed),
and each example alone contributes at most C.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad

from opake_fx.augmult import augment_copies, augmult, augmult_loss, check_per_example, random_shift
from opake_fx.errors import InputTypeError, InputValueError, SlowPathWarning
from opake_fx.functional import make_functional
from opake_fx.pytree import leaves
from opake_fx.random import fold_in, key

B, K, C = 5, 3, 0.05


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 3)).double()


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, 1, 6, 6, generator=g, dtype=torch.float64), torch.tensor([0, 1, 2, 1, 0])


def _reference(module, x, y, step_key, normalize_by=1.0):
    """Per-example loop: mean of each copy's gradient, clipped to C, summed."""
    params = {n: p.detach() for n, p in module.named_parameters()}
    copies = augment_copies(random_shift, x, K, step_key)
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    for i in range(B):
        gs = [grad(lambda p, xi: F.cross_entropy(functional_call(module, p, (xi[None],)), y[i:i + 1]))(params, copies[i, k])
              for k in range(K)]
        mean = {n: sum(g[n] for g in gs) / K for n in params}
        norm = torch.sqrt(sum((v ** 2).sum() for v in mean.values()))
        factor = torch.clamp(C / norm, max=1.0)
        for n in params:
            total[n] += mean[n] * factor
    return [total[n] / normalize_by for n in params]


def _stage(backend, fmodel):
    if backend == "vmap":
        def loss_fn(p, xi, yi):
            return F.cross_entropy(fmodel(p, xi[None]), yi[None])
    else:
        def loss_fn(p, xb, yb):
            return F.cross_entropy(fmodel(p, xb), yb, reduction="none")
    return augmult(loss_fn, augment=random_shift, multiplicity=K, key=key(3), clipping_norm=C,
                   batch_argnums=(1, 2), clip_backend=backend, model=None if backend == "vmap" else fmodel,
                   normalize_by=2.0)


@pytest.mark.parametrize("backend", ["vmap", "ghost", "auto"])
def test_augmult_equals_per_example_loop_over_copies(backend):
    module = _model()
    fmodel, params = make_functional(module)
    x, y = _data()
    stage = _stage(backend, fmodel)
    state = stage.init(params)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPathWarning)  # the fast backends take their fast path
        out, state = stage.update((x, y), state, params)
    assert state.step == 1
    assert out.max_norm == pytest.approx(C / 2.0)
    want = _reference(module, x, y, fold_in(key(3), 0), normalize_by=2.0)
    got = leaves(out.pytree)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # the second step draws new copies (the step is folded into the key)
    out2, _ = stage.update((x, y), state, params)
    want2 = _reference(module, x, y, fold_in(key(3), 1), normalize_by=2.0)
    for a, b in zip(leaves(out2.pytree), want2):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", ["vmap", "ghost", "auto"])
def test_each_example_contributes_at_most_c(backend):
    module = _model()
    fmodel, params = make_functional(module)
    x, y = _data()
    x = x * 50  # large gradients: every example is clipped
    stage = _stage(backend, fmodel)
    for i in range(B):
        out, _ = stage.update((x[i:i + 1], y[i:i + 1]), stage.init(params), params)
        norm = torch.sqrt(sum((t ** 2).sum() for t in leaves(out.pytree))) * 2.0  # undo normalize_by
        assert norm <= C * (1 + 1e-9)
        assert norm >= C * 0.999  # clipped, not vanishing


def test_augmult_loss_is_the_mean_over_copies():
    f = lambda p, x, y: ((x * p).sum(-1) - y) ** 2  # noqa: E731
    x = torch.arange(24.0).reshape(2, 3, 4)
    got = augmult_loss(f, per_example=False)(torch.ones(4), x, torch.zeros(2))
    want = torch.stack([f(torch.ones(4), x[:, k], torch.zeros(2)) for k in range(3)]).mean(0)
    torch.testing.assert_close(got, want)


def test_a_mixing_augmentation_is_refused():
    x = torch.randn(4, 1, 3, 3)
    with pytest.raises(InputValueError, match="mixes examples"):
        check_per_example(lambda keys, x: x - x.mean(0, keepdim=True), x, key(0))
    with pytest.raises(InputValueError, match="mixes examples"):  # pairs rows by position
        check_per_example(lambda keys, x: x + 0.5 * x.roll(1, 0) if x.shape[0] > 1 else x + 0.5 * x, x, key(0))
    stage = augmult(lambda p, xi, yi: (p * xi.sum()).sum() * 0 + (p ** 2).sum(), augment=lambda keys, x: x.roll(1, 0),
                    multiplicity=2, key=key(0), clipping_norm=1.0, batch_argnums=(1, 2))
    p = torch.zeros(2)
    with pytest.raises(InputValueError, match="mixes examples"):
        stage.update((x, torch.zeros(4)), stage.init(p), p)


def test_bad_multiplicity_is_refused():
    with pytest.raises(InputValueError, match="multiplicity"):
        augmult(lambda p, x: x, augment=random_shift, multiplicity=0, key=key(0), clipping_norm=1.0)
    with pytest.raises(InputTypeError, match="multiplicity"):
        augmult(lambda p, x: x, augment=random_shift, multiplicity=2.5, key=key(0), clipping_norm=1.0)


def test_random_shift_is_row_wise_and_keyed():
    x = torch.randn(6, 1, 5, 5)
    check_per_example(random_shift, x, key(1))
    a = augment_copies(random_shift, x, 2, key(1))
    b = augment_copies(random_shift, x, 2, key(1))
    assert torch.equal(a, b)
    assert not torch.equal(a, augment_copies(random_shift, x, 2, key(2)))


def test_plan_augmult_builds_the_augmult_clip_stage():
    from opake_fx.optimizers import sgd
    from opake_fx.plan import DPPlan

    module = _model()
    fmodel, params = make_functional(module)
    x, y = _data()
    plan = DPPlan(dataset_size=100, batch_size=5, steps=10, clipping_norm=C, noise_multiplier=0.0, clip_backend="auto",
                  augmult=K)
    assert DPPlan(**plan.to_dict()) == plan
    loss_fn = lambda p, xb, yb: F.cross_entropy(fmodel(p, xb), yb, reduction="none")  # noqa: E731
    with pytest.raises(InputValueError, match="augment_key"):
        plan.pipeline(loss_fn, sgd(0.1), key=key(0), model=fmodel)
    pipeline = plan.pipeline(loss_fn, sgd(1.0), key=key(0), model=fmodel, augment=random_shift, augment_key=key(3))
    updates, state = pipeline.update((x, y), pipeline.init(params), params)
    want = _reference(module, x, y, fold_in(key(3), 0), normalize_by=5.0)  # sigma 0: the update is -clipped mean
    for a, b in zip(leaves(updates), want):
        torch.testing.assert_close(a, -b, rtol=1e-10, atol=1e-12)
    with pytest.raises(InputValueError, match="augmult"):
        DPPlan(dataset_size=100, batch_size=5, steps=10, noise_multiplier=0.0).pipeline(
            loss_fn, sgd(0.1), key=key(0), model=fmodel, augment=random_shift, augment_key=key(3))


@pytest.mark.parametrize("backend", ["vmap", "auto"])
def test_microbatched_augmult_is_the_same_and_an_empty_batch_works(backend):
    module = _model()
    fmodel, params = make_functional(module)
    x, y = _data()
    stage = _stage(backend, fmodel)
    if backend == "vmap":
        loss_fn = lambda p, xi, yi: F.cross_entropy(fmodel(p, xi[None]), yi[None])  # noqa: E731
    else:
        loss_fn = lambda p, xb, yb: F.cross_entropy(fmodel(p, xb), yb, reduction="none")  # noqa: E731
    micro = augmult(loss_fn, augment=random_shift, multiplicity=K, key=key(3), clipping_norm=C, batch_argnums=(1, 2),
                    clip_backend=backend, model=None if backend == "vmap" else fmodel, normalize_by=2.0,
                    microbatch_size=2)
    a, _ = stage.update((x, y), stage.init(params), params)
    b, _ = micro.update((x, y), micro.init(params), params)
    for u, v in zip(leaves(a.pytree), leaves(b.pytree)):
        torch.testing.assert_close(u, v, rtol=1e-10, atol=1e-12)
    empty, state = micro.update((x[:0], y[:0]), micro.init(params), params)
    assert state.step == 1 and all(float(t.abs().sum()) == 0.0 for t in leaves(empty.pytree))


def test_augmult_state_checkpoints_and_resumes(tmp_path):
    from opake_fx.serialization import load_checkpoint, save_checkpoint

    module = _model()
    fmodel, params = make_functional(module)
    x, y = _data()
    stage = _stage("auto", fmodel)
    _, state = stage.update((x, y), stage.init(params), params)
    save_checkpoint(tmp_path / "s.pt", state=state)
    resumed = load_checkpoint(tmp_path / "s.pt", state=stage.init(params))["state"]
    assert resumed.step == 1 and resumed.key == state.key
    a, _ = stage.update((x, y), state, params)
    b, _ = stage.update((x, y), resumed, params)
    for u, v in zip(leaves(a.pytree), leaves(b.pytree)):
        assert torch.equal(u, v)
