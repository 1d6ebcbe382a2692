"""Padding rows (``example_mask=False``) contribute exactly zero, whatever they hold.

An attacker who controls what fills the padding (or a bug that fills it with garbage)
must not move the release: the clipped sum, the stats and the adaptive clip's count of a
padded batch equal those of the batch without padding, and they are bit-identical
whatever the padding rows contain (NaN, 1e30, copies of a real example).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opake_fx.dpsgd import clip
from opake_fx.dpsgd.clipping import adaptive_clipped_grad, clipped_grad
from opake_fx.errors import InputValueError
from opake_fx.functional import make_functional
from opake_fx.padding import bucket_for, geometric_buckets, pad_batch
from opake_fx.pytree import leaves
from opake_fx.random import key

BACKENDS = ["vmap", "ghost", "auto"]
B, PAD, D = 5, 3, 6


def _model() -> tuple[nn.Module, object, dict]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    fmodel, params = make_functional(net)
    return net, fmodel, params


def _grad_fn(backend: str, fmodel, **kw):
    if backend == "vmap":
        def loss(p, x, y):
            return F.cross_entropy(fmodel(p, x.unsqueeze(0)), y.unsqueeze(0))
    else:
        def loss(p, x, y):
            return F.cross_entropy(fmodel(p, x), y, reduction="none")
    model = None if backend == "vmap" else fmodel
    return clipped_grad(loss, batch_argnums=(1, 2), clipping_norm=0.5, normalize_by=4.0, clip_backend=backend,
                        model=model, **kw)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, D, generator=g, dtype=torch.float64) * 3, torch.randint(0, 3, (B,), generator=g)


def _with_padding(x, y, fill: str):
    if fill == "copies":
        (xp, yp), mask = pad_batch((x, y), B + PAD)
        return xp, yp, mask
    value = {"nan": float("nan"), "huge": 1e30, "zeros": 0.0}[fill]
    xp = torch.cat([x, torch.full((PAD, D), value, dtype=x.dtype)])
    yp = torch.cat([y, torch.zeros(PAD, dtype=y.dtype)])
    return xp, yp, torch.arange(B + PAD) < B


@pytest.mark.parametrize("backend", BACKENDS)
def test_padded_batch_releases_what_the_unpadded_batch_releases(backend):
    _, fmodel, params = _model()
    grad_fn, state = _grad_fn(backend, fmodel, return_aux=True)
    x, y = _batch()
    (ref, ref_aux), _ = grad_fn(params, x, y, state=state)
    xp, yp, mask = _with_padding(x, y, "copies")
    (out, aux), _ = grad_fn(params, xp, yp, state=state, example_mask=mask)
    for got, want in zip(leaves(out.pytree), leaves(ref.pytree), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    assert out.max_norm == ref.max_norm
    assert aux.batch_size == B
    torch.testing.assert_close(aux.grad_norms[:B], ref_aux.grad_norms, rtol=1e-12, atol=0)
    assert aux.grad_norms[B:].eq(0).all() and aux.loss_values[B:].eq(0).all()  # padding reports zeros


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fill", ["nan", "huge", "zeros"])
def test_what_the_padding_holds_never_changes_the_release(backend, fill):
    _, fmodel, params = _model()
    grad_fn, state = _grad_fn(backend, fmodel, return_stats=True)
    x, y = _batch()
    xc, yc, mask = _with_padding(x, y, "copies")
    (base, base_stats), _ = grad_fn(params, xc, yc, state=state, example_mask=mask)
    xa, ya, mask = _with_padding(x, y, fill)
    (out, stats), _ = grad_fn(params, xa, ya, state=state, example_mask=mask)
    for got, want in zip(leaves(out.pytree), leaves(base.pytree), strict=True):
        assert torch.equal(got, want), (backend, fill)
    assert stats.num_nonfinite == 0 and stats.batch_size == B  # NaN padding is not a non-finite example
    assert stats.num_clipped == base_stats.num_clipped


def test_adaptive_count_ignores_padding():
    _, fmodel, params = _model()

    def loss(p, x, y):
        return F.cross_entropy(fmodel(p, x.unsqueeze(0)), y.unsqueeze(0))

    grad_fn, state = adaptive_clipped_grad(loss, batch_argnums=(1, 2), initial_clipping_norm=100.0,
                                           count_noise_multiplier=0.0, key=key(3), expected_batch_size=B)
    x, y = _batch()
    _, plain = grad_fn(params, x, y, state=state)
    xp, yp, mask = _with_padding(x, y, "copies")
    _, padded = grad_fn(params, xp, yp, state=state, example_mask=mask)
    assert padded.centered_count == plain.centered_count == B / 2  # every real example is below C = 100
    assert padded.clipping_norm == plain.clipping_norm


def test_clip_stage_passes_the_mask():
    _, fmodel, params = _model()

    def loss(p, x, y):
        return F.cross_entropy(fmodel(p, x.unsqueeze(0)), y.unsqueeze(0))

    stage = clip(loss, clipping_norm=0.5, batch_argnums=(1, 2), normalize_by=4.0)
    assert stage.privacy.takes_example_mask
    x, y = _batch()
    ref, _ = stage.update((x, y), stage.init(params), params)
    xp, yp, mask = _with_padding(x, y, "nan")
    out, _ = stage.update((xp, yp), stage.init(params), params, example_mask=mask)
    for got, want in zip(leaves(out.pytree), leaves(ref.pytree), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("mask", [torch.ones(B + 1, dtype=torch.bool), torch.ones(B), [True] * B])
def test_a_malformed_mask_is_refused(mask):
    _, fmodel, params = _model()
    grad_fn, state = _grad_fn("vmap", fmodel)
    x, y = _batch()
    with pytest.raises(InputValueError, match="example_mask must be a bool tensor"):
        grad_fn(params, x, y, state=state, example_mask=mask)


def test_buckets_pad_and_never_truncate():
    sizes = geometric_buckets(16, up_to=1000)
    assert sizes[0] == 8 and sizes[-1] == 1000 and all(b > a for a, b in zip(sizes, sizes[1:]))
    assert all(b <= 1.25 * a + 1 for a, b in zip(sizes, sizes[1:]))
    for n in range(1, 1200):
        assert bucket_for(n, sizes) >= n
    assert bucket_for(1001, sizes) == 2000
    (x,), mask = pad_batch((torch.arange(4.0),), 4)
    assert mask.all() and x.tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(InputValueError, match="never drops"):
        pad_batch((torch.arange(4.0),), 3)
    with pytest.raises(InputValueError, match="empty batch"):
        pad_batch((torch.zeros(0, 2),), 3)
