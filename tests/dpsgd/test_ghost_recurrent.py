"""Recurrent layers on the fast backends: the module fallback, never the whole-loss one.

A batch-first ``nn.RNN``/``nn.GRU``/``nn.LSTM`` call returns ``h_n`` (and ``c_n``) with the
batch on their second axis. That shape made the call undecidable, so every recurrent weight
took the whole-loss fallback (the whole model once per example). The recurrent entry now
splits the call per example along each tensor's own batch axis (input and output first,
``hx`` and ``h_n``/``c_n`` second, by the module's contract): exact against a float64
per-example loop, with the whole-loss fallback made an error.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from opake_fx.dpsgd.clipping import _ghost
from opake_fx.functional import make_functional
from tests.dpsgd.test_ghost_norm_like import assert_exact, mse, reference, run

T, F_IN, HID = 5, 3, 4


class Net(nn.Module):
    def __init__(self, kind: type, layers: int, bidirectional: bool, read: str) -> None:
        super().__init__()
        self.read, self.layers, self.dirs = read, layers, 2 if bidirectional else 1
        self.rnn = kind(F_IN, HID, num_layers=layers, batch_first=True, bidirectional=bidirectional)
        self.h0 = nn.Linear(F_IN, HID)  # an initial state computed from the example
        self.head = nn.Linear(HID * self.dirs, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hx = None
        if self.read == "hx":
            h = torch.tanh(self.h0(x[:, 0]))  # [B, HID]
            h = h.unsqueeze(0).expand(self.layers * self.dirs, -1, -1).contiguous()  # [layers * dirs, B, HID]
            hx = (h, torch.zeros_like(h)) if isinstance(self.rnn, nn.LSTM) else h
        out, state = self.rnn(x, hx)
        if self.read == "h_n":
            h_n = state[0] if isinstance(self.rnn, nn.LSTM) else state  # [layers * dirs, B, HID]
            last = h_n[-self.dirs:].transpose(0, 1).reshape(x.shape[0], -1)
            return self.head(last)
        return self.head(out)


@pytest.mark.parametrize("read", ["output", "h_n", "hx"])
@pytest.mark.parametrize("layers,bidirectional", [(1, False), (2, False), (2, True)])
@pytest.mark.parametrize("kind", [nn.RNN, nn.GRU, nn.LSTM])
@pytest.mark.parametrize("b", [1, 5, T, 4])  # 4 = layers * directions of the (2, True) case
def test_recurrent_layers_take_the_module_fallback_exactly(kind: type, layers: int, bidirectional: bool, read: str,
                                                           b: int, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)

    def fail(*a: Any, **k: Any) -> None:
        raise AssertionError("a recurrent layer took the whole-loss fallback")

    monkeypatch.setattr(_ghost, "_whole_loss_per_example", fail)
    x = torch.randn(b, T, F_IN, dtype=torch.float64)
    slow = assert_exact(Net(kind, layers, bidirectional, read), x, "auto", None)
    assert all("whole-loss" not in s for s in slow), slow


def test_float32_recurrent_layers_match_the_float64_oracle() -> None:
    """float32 (vmap cannot run torch's GRU kernels per example either: the fallback loops, and says so)."""
    torch.manual_seed(1)
    model = Net(nn.GRU, 2, True, "h_n")
    x, y = torch.randn(5, T, F_IN), torch.randn(5, 2)
    fmodel, params = make_functional(model)
    want, norms = reference(mse(fmodel), [p.double() for p in params], x.double(), y.double(), 0.5)
    out, aux, slow = run("auto", model, x, y, 0.5)
    assert slow and all("whole-loss" not in s for s in slow), slow
    torch.testing.assert_close(aux.grad_norms.double(), norms, rtol=1e-4, atol=1e-6)
    for got, ref in zip(out.pytree, want):
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5)
