"""Dropout in training mode under every clipping path: each example draws its own masks (as
in a batched pass), and every clipped per-example gradient stays within the bound."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opake_fx.dpsgd.clipping import _ghost, _rules_fallback, clipped_grad
from opake_fx.functional import make_functional
from tests.dpsgd.test_ghost_clipping import count_calls

B, C = 16, 0.05


class DropoutInside(nn.Module):
    """A parameterised module with no rule that drops out internally (the module fallback)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x * self.scale, p=0.5, training=self.training)


MODELS = {
    "dropout between linears": lambda: nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Tanh(), nn.Linear(16, 1)),
    "dropout inside a fallback module": lambda: nn.Sequential(nn.Linear(4, 8), DropoutInside(8), nn.Linear(8, 1)),
    "attention dropout": lambda: Attention(),
}


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.mha = nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x.unsqueeze(1).expand(-1, 3, -1))
        return self.head(self.mha(h, h, h, need_weights=False)[0]).mean(1)


def run(name: str, backend: str) -> Any:
    torch.manual_seed(0)
    model = MODELS[name]().train()
    fmodel, params = make_functional(model)
    x = torch.randn(1, 4).expand(B, 4).contiguous()  # B copies of ONE example
    y = torch.zeros(B)
    batched = lambda p, xb, yb: (fmodel(p, xb).squeeze(-1) - yb - 1.0) ** 2  # noqa: E731
    if backend == "vmap":
        fn, state = clipped_grad(lambda p, xi, yi: batched(p, xi[None], yi[None])[0], clipping_norm=C,
                                 batch_argnums=(1, 2), return_aux=True)
    else:
        fn, state = clipped_grad(batched, clipping_norm=C, batch_argnums=(1, 2), return_aux=True,
                                 clip_backend=backend, model=fmodel)
    (out, aux), _ = fn(params, x, y, state=state)
    return out, aux


@pytest.mark.parametrize("backend", ["vmap", "ghost", "auto"])
@pytest.mark.parametrize("name", list(MODELS))
def test_each_example_draws_its_own_masks_and_stays_bounded(name: str, backend: str) -> None:
    out, aux = run(name, backend)
    assert all(bool(torch.isfinite(t).all()) for t in out.pytree)
    assert bool((aux.clipped_grad_norms <= C * (1 + 1e-6)).all())
    # Identical examples, different dropout masks: their gradients differ (one shared mask
    # would give B equal norms).
    assert len({round(float(n), 12) for n in aux.grad_norms}) > B // 2


def test_attention_dropout_keeps_the_self_attention_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    module_calls = count_calls(monkeypatch, _rules_fallback, "module_per_example")
    whole_calls = count_calls(monkeypatch, _ghost, "_whole_loss_per_example")
    run("attention dropout", "auto")
    assert module_calls[0] == 0 and whole_calls[0] == 0
