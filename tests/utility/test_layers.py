"""WeightStandardizedConv2d on the fast clipping backends (exact, no slow path) and the last-layer init."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opake_fx.dpsgd.clipping import clipped_grad
from opake_fx.errors import InputValueError, SlowPathWarning
from opake_fx.functional import make_functional
from opake_fx.layers import WeightStandardizedConv2d, scale_last_layer_
from opake_fx.pytree import leaves


def _model(groups: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(WeightStandardizedConv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Tanh(),
                         WeightStandardizedConv2d(4, 4, 3, stride=2, padding=1, groups=groups), nn.Tanh(),
                         nn.Flatten(), nn.Linear(4 * 3 * 3, 3)).double()


@pytest.mark.parametrize("backend", ["ghost", "auto"])
@pytest.mark.parametrize("groups", [1, 2])
def test_ws_conv_fast_backends_equal_vmap_without_slow_path(backend, groups):
    fmodel, params = make_functional(_model(groups))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 2, 6, 6, generator=g, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1, 2])
    per_example = lambda p, xi, yi: F.cross_entropy(fmodel(p, xi[None]), yi[None])  # noqa: E731
    batch = lambda p, xb, yb: F.cross_entropy(fmodel(p, xb), yb, reduction="none")  # noqa: E731
    ref_fn, s0 = clipped_grad(per_example, clipping_norm=0.05, batch_argnums=(1, 2))
    want, _ = ref_fn(params, x, y, state=s0)
    fast_fn, s1 = clipped_grad(batch, clipping_norm=0.05, batch_argnums=(1, 2), clip_backend=backend, model=fmodel)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPathWarning)
        got, _ = fast_fn(params, x, y, state=s1)
    for a, b in zip(leaves(got.pytree), leaves(want.pytree)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_ws_conv_standardizes_its_filters():
    conv = WeightStandardizedConv2d(3, 5, 3).double()
    w = conv.standardized_weight().flatten(1)
    torch.testing.assert_close(w.mean(1), torch.zeros(5, dtype=torch.float64), atol=1e-12, rtol=0)
    raw = conv.weight.detach().flatten(1).var(1, unbiased=False)
    torch.testing.assert_close(w.var(1, unbiased=False), raw / (raw + conv.eps), atol=1e-12, rtol=1e-9)
    with pytest.raises(InputValueError, match="padding_mode"):
        WeightStandardizedConv2d(1, 1, 3, padding_mode="reflect")


def test_scale_last_layer():
    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    before = m[2].weight.detach().clone()
    scale_last_layer_(m, 0.1)
    torch.testing.assert_close(m[2].weight, before * 0.1)
    assert torch.equal(m[2].bias, torch.zeros(3))
    with pytest.raises(InputValueError, match="no nn.Linear"):
        scale_last_layer_(nn.Tanh())
