"""Recurrent layers on the fast backends: unrolled over time, each weight a Linear.

A batch-first ``nn.RNN``/``nn.GRU``/``nn.LSTM`` call returns ``h_n`` (and ``c_n``) with the
batch on their second axis. That shape made the call undecidable, so every recurrent weight
took the whole-loss fallback (the whole model once per example). The recurrent entry now
recomputes the call step by step from tapped projections (``weight_ih`` over the whole
sequence, ``weight_hh`` over the stacked steps); where it cannot (``proj_size``, dropout
between layers in training), the module fallback splits the call along each tensor's own
batch axis (input and output first, ``hx`` and ``h_n``/``c_n`` second). Exact against a
float64 per-example loop, with every fallback made an error where the rule applies.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from opake_fx.dpsgd.clipping import _ghost, _rules_fallback
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
@pytest.mark.parametrize("b", [1, T, 4])  # T = 5 (odd); 4 = layers * directions of the (2, True) case
@pytest.mark.parametrize("backend", ["ghost", "auto"])
def test_recurrent_layers_take_the_recurrent_rule_exactly(kind: type, layers: int, bidirectional: bool, read: str,
                                                          b: int, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)

    def fail(*a: Any, **k: Any) -> None:
        raise AssertionError("a recurrent layer took a fallback")

    monkeypatch.setattr(_ghost, "_whole_loss_per_example", fail)
    monkeypatch.setattr(_rules_fallback, "module_per_example", fail)
    x = torch.randn(b, T, F_IN, dtype=torch.float64)
    slow = assert_exact(Net(kind, layers, bidirectional, read), x, backend, None)
    assert not slow, slow


def test_float32_recurrent_layers_match_the_float64_oracle() -> None:
    torch.manual_seed(1)
    model = Net(nn.GRU, 2, True, "h_n")
    x, y = torch.randn(5, T, F_IN), torch.randn(5, 2)
    fmodel, params = make_functional(model)
    want, norms = reference(mse(fmodel), [p.double() for p in params], x.double(), y.double(), 0.5)
    out, aux, slow = run("auto", model, x, y, 0.5)
    assert not slow, slow
    torch.testing.assert_close(aux.grad_norms.double(), norms, rtol=1e-4, atol=1e-6)
    for got, ref in zip(out.pytree, want):
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5)


class Projected(nn.Module):
    """An LSTM with ``proj_size`` (outside the rule's equations)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(F_IN, HID, num_layers=1, batch_first=True, proj_size=2)
        self.head = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


def test_a_call_outside_the_rule_takes_the_split_module_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(2)

    def fail(*a: Any, **k: Any) -> None:
        raise AssertionError("a recurrent layer took the whole-loss fallback")

    monkeypatch.setattr(_ghost, "_whole_loss_per_example", fail)
    slow = assert_exact(Projected(), torch.randn(5, T, F_IN, dtype=torch.float64), "auto", None)
    assert any("per-module fallback" in s and "rnn" in s for s in slow), slow


class Twice(nn.Module):
    """One GRU applied to two sequences (two calls: cross terms of the same weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(F_IN, HID, batch_first=True)
        self.head = nn.Linear(HID, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, _ = self.rnn(x)
        second, _ = self.rnn(torch.tanh(x.flip(1)))
        return self.head(first + second)


def test_a_recurrent_layer_called_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(3)
    monkeypatch.setattr(_rules_fallback, "module_per_example", lambda *a, **k: (_ for _ in ()).throw(AssertionError()))
    slow = assert_exact(Twice(), torch.randn(5, T, F_IN, dtype=torch.float64), "auto", None)
    assert not slow, slow


@pytest.mark.parametrize("kind,read", [(nn.GRU, "h_n"), (nn.LSTM, "hx")])
def test_later_steps_unroll_instead_of_running_the_module(kind: type, read: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Once a call signature is checked, the unrolled recomputation runs in place of the
    # module's forward (the recurrence is not computed twice): later steps, with new inputs and
    # batch sizes, stay exact and never run the module's own kernel.
    from opake_fx.dpsgd.clipping import clipped_grad

    torch.manual_seed(2)
    model = Net(kind, 2, True, read).double()
    fmodel, params = make_functional(model)
    runs = [0]
    original = kind.forward

    def counted(self: nn.Module, *a: Any, **k: Any) -> Any:
        runs[0] += 1
        return original(self, *a, **k)

    monkeypatch.setattr(kind, "forward", counted)
    monkeypatch.setattr(_rules_fallback, "module_per_example", lambda *a, **k: pytest.fail("module fallback"))
    from opake_fx.dpsgd.clipping import _rules_recurrent

    monkeypatch.setattr(_rules_recurrent, "_FORWARDS", (*_rules_recurrent._FORWARDS, counted))
    loss = mse(fmodel)
    xs = [torch.randn(n, T, F_IN, dtype=torch.float64) for n in (4, 4, 7)]
    with torch.no_grad():
        ys = [torch.randn_like(model(x)) for x in xs]
    runs[0] = 0
    _, first_norms = reference(loss, params, xs[0], ys[0], float("inf"))
    c = float(first_norms.median())
    fn, state = clipped_grad(loss, clipping_norm=c, batch_argnums=(1, 2), return_aux=True, clip_backend="auto",
                             model=fmodel)
    per_step = []
    for x, y in zip(xs, ys):
        want, norms = reference(loss, params, x, y, c)
        before = runs[0]
        (out, aux), state = fn(params, x, y, state=state)
        per_step.append(runs[0] - before)
        torch.testing.assert_close(aux.grad_norms, norms, rtol=1e-9, atol=1e-12)
        for got, ref in zip(out.pytree, want):
            torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-12)
    assert per_step[0] > 0 and per_step[1] == 0 and per_step[2] == 0, per_step


class Packed(nn.Module):
    """A 2-layer bidirectional RNN on packed sequences of per-example lengths (from each
    example's own data); ``reorder``: the batch is packed in reverse order and put back after."""

    def __init__(self, kind: type, reorder: bool) -> None:
        super().__init__()
        self.reorder = reorder
        self.rnn = kind(F_IN, HID, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * HID, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

        lengths = 1 + (x[:, 0, 0].abs() * 7).long() % x.shape[1]
        if self.reorder:
            x, lengths = x.flip(0), lengths.flip(0)
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = pad_packed_sequence(self.rnn(packed)[0], batch_first=True, total_length=x.shape[1])
        return self.head(out.flip(0) if self.reorder else out)


@pytest.mark.parametrize("reorder", [False, True])
@pytest.mark.parametrize("kind", [nn.GRU, nn.LSTM])
@pytest.mark.parametrize("backend", ["ghost", "auto"])
def test_packed_sequences_take_the_exact_whole_loss_path_and_say_so(kind: type, reorder: bool, backend: str) -> None:
    # A PackedSequence's flat rows do not show which example each sequence belongs to (the
    # packing may reorder the batch): the call is undecidable, so its parameters take the
    # whole-loss path, exactly, with a warning naming it; never a rule guessing the order.
    torch.manual_seed(3)
    x = torch.randn(5, T, F_IN, dtype=torch.float64)
    slow = assert_exact(Packed(kind, reorder), x, backend, None)
    assert any("whole-loss" in w and "rnn.weight_ih_l0" in w for w in slow), slow
