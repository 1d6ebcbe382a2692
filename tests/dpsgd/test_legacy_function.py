"""A legacy ``autograd.Function`` (no ``setup_context``) holding a parameter trains on every backend.

``torch.func`` refuses such a Function under ``vmap``, ``grad`` and ``vjp`` alike, so the
exact per-example loop that replaces ``vmap`` must differentiate with plain autograd; it
used to call ``torch.func.grad`` again and fail with torch's RuntimeError on every backend.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from opake_fx.dpsgd.clipping import clipped_grad
from opake_fx.errors import SlowPathWarning
from opake_fx.functional import make_functional


class _LegacyScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 3))
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(_LegacyScale.apply(x, self.w))).pow(2).sum(1)


def _reference(model: nn.Module, x: torch.Tensor, c: float) -> list[torch.Tensor]:
    params = list(model.parameters())
    total = [torch.zeros_like(p) for p in params]
    for i in range(x.shape[0]):
        g = torch.autograd.grad(model(x[i:i + 1])[0], params)
        norm = torch.sqrt(sum((t ** 2).sum() for t in g))
        w = min(1.0, c / float(norm))
        total = [s + w * t for s, t in zip(total, g)]
    return total


@pytest.mark.parametrize("backend", ["vmap", "ghost", "auto"])
def test_a_legacy_function_with_a_parameter_is_exact_on_every_backend(backend):
    torch.manual_seed(0)
    model = Scaled().double()
    x = torch.randn(5, 3, dtype=torch.float64)
    fmodel, params = make_functional(model)
    loss = (lambda p, xb: fmodel(p, xb[None])[0]) if backend == "vmap" else (lambda p, xb: fmodel(p, xb))
    fn, state = clipped_grad(loss, clipping_norm=0.3, batch_argnums=(1,), clip_backend=backend, model=fmodel)
    with pytest.warns(SlowPathWarning, match="setup_context"):
        out, _ = fn(params, x, state=state)
    for got, want in zip(out.pytree, _reference(model, x, 0.3)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
