"""``clip_backend="auto"`` on a CUDA device takes the exact whole-loss ``vmap`` path.

On CUDA the layer rules are slower than ``vmap`` today (GPT-2 small on an H200: 1,445 ms
per step against 210 ms), so ``"auto"`` does not pick them there: every parameter takes
the whole-loss path (``vmap`` of the batched loss over single examples), with no probe;
``"ghost"`` still forces the rules. The decision reads the device type of the
parameters (``_ghost.rules_pay_off``); here a CPU run is made to look like CUDA at that
point (no GPU is needed), and the results must equal the ``vmap`` backend's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opake_fx.dpsgd.clipping import _ghost, clipped_grad
from opake_fx.functional import make_functional
from tests.dpsgd.test_certified_sync_free import SyncCounter
from tests.dpsgd.test_ghost_clipping import count_calls

B, T, V, D = 5, 6, 20, 8


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.ln = nn.LayerNorm(D)
        self.mix = nn.Linear(D, 2 * D)
        self.head = nn.Linear(2 * D, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.ln(self.tok(ids)))))


@pytest.fixture
def on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decision point sees a CUDA device (its own logic runs on the faked device type)."""
    real = _ghost.rules_pay_off
    monkeypatch.setattr(_ghost, "rules_pay_off", lambda device: real(torch.device("cuda", 0)))


def test_the_rules_pay_off_on_cpu_but_not_on_cuda():
    assert _ghost.rules_pay_off(torch.device("cpu"))
    assert not _ghost.rules_pay_off(torch.device("cuda", 0))


def _run(backend: str, has_aux: bool = False):
    torch.manual_seed(0)
    model = TinyLM().double()
    fmodel, params = make_functional(model)
    ids = torch.randint(0, V, (B, T))

    def batched(p, x, y):
        losses = F.cross_entropy(fmodel(p, x).transpose(1, 2), y, reduction="none").mean(1)
        return (losses, {"double": 2 * losses}) if has_aux else losses

    def single(p, x, y):
        out = batched(p, x[None], y[None])
        return (out[0][0], {"double": out[1]["double"][0]}) if has_aux else out[0]

    if backend == "vmap":
        fn, state = clipped_grad(single, has_aux=has_aux, clipping_norm=0.05, batch_argnums=(1, 2), return_aux=True)
    else:
        fn, state = clipped_grad(batched, has_aux=has_aux, clipping_norm=0.05, batch_argnums=(1, 2), return_aux=True,
                                 clip_backend=backend, model=fmodel)
    ((out, aux), _) = fn(params, ids, ids, state=state)
    return out, aux, (fn, params, ids, state)


def test_auto_on_cuda_takes_the_whole_loss_path_for_every_parameter(on_cuda, monkeypatch):
    whole = count_calls(monkeypatch, _ghost, "_whole_loss_per_example")
    probes = count_calls(monkeypatch, _ghost, "probe")
    got, got_aux, _ = _run("auto")
    assert whole[0] == 1 and probes[0] == 0  # one vmap over the examples, no probe, no rule
    want, want_aux, _ = _run("vmap")
    for a, b in zip(got.pytree, want.pytree):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(got_aux.grad_norms, want_aux.grad_norms, rtol=1e-10, atol=0.0)
    torch.testing.assert_close(got_aux.loss_values, want_aux.loss_values, rtol=1e-12, atol=0.0)


def test_auto_on_cuda_keeps_the_per_example_aux(on_cuda):
    got, got_aux, _ = _run("auto", has_aux=True)
    want, want_aux, _ = _run("vmap", has_aux=True)
    torch.testing.assert_close(got_aux.loss_aux["double"], want_aux.loss_aux["double"], rtol=1e-12, atol=0.0)
    for a, b in zip(got.pytree, want.pytree):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)


def test_ghost_on_cuda_still_takes_the_rules(on_cuda, monkeypatch):
    whole = count_calls(monkeypatch, _ghost, "_whole_loss_per_example")
    got, _, _ = _run("ghost")
    assert whole[0] == 0
    want, _, _ = _run("vmap")
    for a, b in zip(got.pytree, want.pytree):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-14)


def test_auto_on_cpu_takes_the_rules(monkeypatch):
    whole = count_calls(monkeypatch, _ghost, "_whole_loss_per_example")
    _run("auto")
    assert whole[0] == 0


def test_auto_on_cuda_makes_no_host_synchronisation_in_a_steady_step(on_cuda):
    torch.manual_seed(0)
    fmodel, params = make_functional(TinyLM())
    ids = torch.randint(0, V, (B, T))
    fn, state = clipped_grad(lambda p, x, y: F.cross_entropy(fmodel(p, x).transpose(1, 2), y, reduction="none").mean(1),
                             clipping_norm=0.05, batch_argnums=(1, 2), clip_backend="auto", model=fmodel)
    for _ in range(2):
        fn(params, ids, ids, state=state)
    with SyncCounter() as syncs:
        fn(params, ids, ids, state=state)
    assert syncs.count == 0
