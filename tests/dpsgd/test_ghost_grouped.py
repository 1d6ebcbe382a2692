"""Layers called on a batch flattened with its positions: ``[B * T, d]`` rows, T per example.

OPT's decoder layers reshape ``[B, T, d]`` to ``[B * T, d]`` before their feed-forward
Linears and layer norm. Provenance finds ``T`` rows per example (``k B`` at every batch
size); that they are *consecutive* (batch-major) is what the independence check proves,
watching those rows in groups. A model that flattens position-major (``[T, B, d]`` to
``[T * B, d]``) fails that check without mixing examples: the layout is checked again with
those calls on the exact path, so it still trains, exactly, with a warning. All against a
float64 per-example loop.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from opake_fx.dpsgd.clipping import _ghost, _rules_fallback, clipped_grad
from opake_fx.errors import InputValueError
from opake_fx.functional import make_functional
from tests.dpsgd.test_ghost_norm_like import assert_exact

BACKENDS = ["ghost", "auto"]
T, D = 4, 6


class Flattened(nn.Module):
    """A feed-forward block on flattened rows, ``how`` the flattening."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.inp = nn.Linear(3, D)
        self.norm = nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)  # [B, T, D]
        b, t, d = h.shape
        if self.how == "batch-major":  # OPT: rows b * T + t
            flat = h.reshape(-1, d)
        elif self.how == "position-major":  # rows t * B + b
            flat = h.transpose(0, 1).reshape(-1, d)
        elif self.how == "mixing":  # batch-major, then each row reads the next example's rows
            flat = h.reshape(-1, d)
            flat = flat + 0.5 * flat.roll(t, 0)
        else:
            raise ValueError(self.how)
        y = flat + self.fc2(torch.relu(self.fc1(self.norm(flat))))
        if self.how == "position-major":
            y = y.reshape(t, b, d).transpose(0, 1)
        else:
            y = y.reshape(b, t, d)
        return self.head(torch.tanh(y))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("b", [1, 2, 5, T, 2 * D])  # B equal to the positions, to the hidden width
def test_batch_major_rows_take_the_rules(backend: str, b: int, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)

    def fail(*a: Any, **k: Any) -> None:
        raise AssertionError("a flattened call left the rules")

    monkeypatch.setattr(_ghost, "_whole_loss_per_example", fail)
    monkeypatch.setattr(_rules_fallback, "module_per_example", fail)
    slow = assert_exact(Flattened("batch-major"), torch.randn(b, T, 3, dtype=torch.float64), backend, None)
    assert not slow, slow


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("b", [2, 5, T])
def test_position_major_rows_take_the_exact_path_not_a_refusal(backend: str, b: int) -> None:
    torch.manual_seed(1)
    slow = assert_exact(Flattened("position-major"), torch.randn(b, T, 3, dtype=torch.float64), backend, None)
    assert any("whole-loss" in s and "fc1.weight" in s for s in slow), slow


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixing_between_flattened_rows_is_refused(backend: str) -> None:
    model = Flattened("mixing").double()
    fmodel, params = make_functional(model)
    fn, state = clipped_grad(lambda p, x: fmodel(p, x).flatten(1).sum(1), clipping_norm=1.0, batch_argnums=1,
                             clip_backend=backend, model=fmodel)
    with pytest.raises(InputValueError, match="mixes examples"):
        fn(params, torch.randn(5, T, 3, dtype=torch.float64), state=state)
