"""make_functional and empty_collate."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import default_collate

from opake_fx.errors import InputTypeError, OperationError
from opake_fx.functional import empty_collate, make_functional, with_batch_dim


def test_make_functional_matches_module_and_orders_params():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    fmodel, params = make_functional(model)
    assert fmodel.param_names == ("0.weight", "0.bias", "2.weight", "2.bias")
    assert all(p is not q and torch.equal(p, q) for p, q in zip(params, model.parameters()))
    x = torch.randn(5, 3)
    torch.testing.assert_close(fmodel(params, x), model(x))
    doubled = tuple(2 * p for p in params)
    assert not torch.allclose(fmodel(doubled, x), model(x))


def test_make_functional_under_vmap_and_grad_with_buffers():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    model.eval()  # running stats (buffers) are read, not updated
    fmodel, params = make_functional(model)

    def loss(params, x):
        return fmodel(params, x.unsqueeze(0)).sum()

    grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, torch.randn(4, 3))
    assert [g.shape[0] for g in grads] == [4] * len(params)


def test_make_functional_tied_weights_appear_once():
    emb = torch.nn.Embedding(5, 3)
    head = torch.nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    _, params = make_functional(model)
    assert len(params) == 1


def test_tied_and_shared_parameters_all_take_the_passed_value_and_are_restored():
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(5, 3)
            self.head = torch.nn.Linear(3, 5, bias=False)
            self.head.weight = self.emb.weight
            self.block = torch.nn.Linear(3, 3)
            self.again = self.block  # the same submodule under two names

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.again(self.block(self.emb(ids))))

    torch.manual_seed(1)
    model = Tied()
    originals = [p for p in model.parameters()]
    fmodel, params = make_functional(model)
    new = tuple(torch.randn_like(p) for p in params)
    ids = torch.tensor([[0, 3, 4]])
    w, wb, b = new[0], new[1], new[2]  # emb/head weight, block weight, block bias
    expected = torch.nn.functional.linear(w[ids] @ wb.T + b, wb) + b
    torch.testing.assert_close(fmodel(new, ids), expected @ w.T)
    # the module's own parameters are back, also after a forward that raises
    assert all(p is q for p, q in zip(model.parameters(), originals, strict=True))
    with pytest.raises(IndexError):
        fmodel(new, torch.tensor([[7]]))
    assert all(p is q for p, q in zip(model.parameters(), originals, strict=True))
    assert model.head.weight is model.emb.weight


@pytest.mark.parametrize("kind", ["lstm", "weight_norm", "attention"])
def test_modules_with_cached_or_derived_weights_see_the_passed_params(kind: str):
    torch.manual_seed(2)
    if kind == "lstm":  # keeps a flat list of its weights
        model, x = torch.nn.LSTM(3, 4, batch_first=True), torch.randn(2, 5, 3)
    elif kind == "weight_norm":  # weight computed from parametrization tensors
        model, x = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(3, 4)), torch.randn(2, 3)
    else:  # packed in_proj_weight read outside a Linear
        model, x = torch.nn.MultiheadAttention(4, 2, batch_first=True), torch.randn(2, 3, 4)
    first = (lambda out: out[0]) if kind != "weight_norm" else (lambda out: out)
    fmodel, params = make_functional(model)
    new = tuple((p + 0.1 * torch.randn_like(p)).requires_grad_() for p in params)
    args = (x,) if kind != "attention" else (x, x, x)
    ours = first(fmodel(new, *args))
    ref = first(torch.func.functional_call(model, dict(zip(fmodel.param_names, new)), args))
    torch.testing.assert_close(ours, ref)
    g_ours = torch.autograd.grad(ours.square().sum(), new)
    g_ref = torch.autograd.grad(ref.square().sum(), new)
    for a, b in zip(g_ours, g_ref):
        torch.testing.assert_close(a, b)


def test_make_functional_errors():
    with pytest.raises(InputTypeError):
        make_functional(lambda x: x)  # type: ignore[arg-type]
    fmodel, params = make_functional(torch.nn.Linear(2, 2))
    with pytest.raises(InputTypeError, match="parameters"):
        fmodel(params[:1], torch.ones(1, 2))


def test_with_batch_dim_adapts_batched_model():
    model = torch.nn.Linear(3, 2)
    fmodel, params = make_functional(model)
    per_example = with_batch_dim(lambda x: fmodel(params, x))
    assert per_example(torch.ones(3)).shape == (2,)


def test_empty_collate_after_priming():
    c = empty_collate(default_collate)
    with pytest.raises(OperationError, match="prime"):
        c([])
    full = c([(torch.zeros(2, 3), torch.tensor(4))])
    assert full[0].shape == (1, 2, 3)
    empty = c([])
    assert empty[0].shape == (0, 2, 3) and empty[1].shape == (0,) and empty[1].dtype == torch.int64
    assert c([(torch.ones(2, 3), torch.tensor(1))] * 3)[0].shape == (3, 2, 3)
