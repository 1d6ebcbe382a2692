"""The batch axis by provenance, mixing detection and the exact per-example loop."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from opake_fx.dpsgd.clipping import clipped_grad
from opake_fx.dpsgd.clipping._provenance import probe
from opake_fx.errors import InputValueError, SlowPathWarning
from opake_fx.functional import make_functional
from tests.dpsgd.test_ghost_layers import reference

T = 6


class RelativeBias(nn.Module):
    """Token embedding plus a learned bias looked up with a [T, T] position tensor (as T5's
    relative attention bias): the bias table's lookup is NOT batched, whatever B is."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(11, 4)
        self.rel = nn.Embedding(2 * T, 1)
        self.head = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        pos = torch.arange(t)
        buckets = (pos[None, :] - pos[:, None]) + t  # [T, T]
        bias = self.rel(buckets)[..., 0]  # [T, T]
        h = self.tok(ids)  # [B, T, 4]
        mixed = torch.softmax(bias, dim=-1) @ h  # positions mixed within each example
        return self.head(mixed)[..., 0]


def _run(model, ids, y, backend, c=0.3):
    fmodel, params = make_functional(model)

    def batched(p, xb, yb):
        return ((fmodel(p, xb) - yb) ** 2).sum(1)

    fn, state = clipped_grad(batched, clipping_norm=c, batch_argnums=(1, 2), return_aux=True, clip_backend=backend,
                             model=fmodel)
    (out, aux), _ = fn(params, ids, y, state=state)
    return out, aux, batched, params


@pytest.mark.parametrize("backend", ["ghost", "auto"])
@pytest.mark.parametrize("b", [3, T])  # B == T: the [T, T] lookup has the batch size as first dimension
def test_a_size_coincidence_is_never_taken_for_the_batch_axis(backend, b):
    torch.manual_seed(0)
    model = RelativeBias().double()
    ids = torch.randint(0, 11, (b, T))
    y = torch.randn(b, T, dtype=torch.float64)
    with pytest.warns(SlowPathWarning, match=r"rel\.weight"):  # exact, and announced
        out, aux, batched, params = _run(model, ids, y, backend)
    want, norms, _ = reference(batched, params, ids, y, 0.3)
    for got, ref in zip(out.pytree, want):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(aux.grad_norms, norms, rtol=1e-10, atol=1e-12)


def test_probe_verdicts():
    model = RelativeBias()
    fmodel, params = make_functional(model)
    ids = torch.randint(0, 11, (T, T))
    layout = probe(model, lambda p, x: fmodel(p, x).sum(1), (params, ids), {}, (1,), False, T)
    assert layout.mixing is None and layout.mixing_checked
    buckets = torch.zeros(T, T, dtype=torch.long)
    out = torch.zeros(T, T, 1)
    assert layout.lookup(model.rel, [buckets], [out], T) == ((False,), (False,))
    assert layout.lookup(model.tok, [ids], [torch.zeros(T, T, 4)], T) == ((True,), (True,))
    assert layout.lookup(model.tok, [ids[:, :3]], [torch.zeros(T, 3, 4)], T) is None  # an unseen shape: undecidable


class Centered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h - h.mean(0))  # mixes examples, with no parameter of its own


@pytest.mark.parametrize("backend", ["ghost", "auto"])
def test_a_model_that_mixes_examples_is_refused_naming_where(backend):
    fmodel, params = make_functional(Centered())
    fn, state = clipped_grad(lambda p, x: fmodel(p, x)[:, 0], clipping_norm=1.0, batch_argnums=(1,),
                             clip_backend=backend, model=fmodel)
    with pytest.raises(InputValueError, match="mixes examples.*module 'b'"):
        fn(params, torch.randn(5, 3), state=state)


def test_nan_examples_are_not_taken_for_mixing():
    fmodel, params = make_functional(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)))
    x = torch.randn(5, 3)
    x[2, 1] = float("nan")
    fn, state = clipped_grad(lambda p, xb: fmodel(p, xb)[:, 0], clipping_norm=1.0, batch_argnums=(1,),
                             clip_backend="auto", model=fmodel, return_aux=True)
    (out, aux), _ = fn(params, x, state=state)
    assert aux.num_nonfinite == 1 and all(bool(torch.isfinite(t).all()) for t in out.pytree)


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x > 0).all()):  # data-dependent control flow: vmap cannot run it
            x = x * 2
        return self.lin(x)


def test_vmap_backend_falls_back_to_an_exact_loop_with_a_warning():
    torch.manual_seed(1)
    model = DataDependent().double()
    fmodel, params = make_functional(model)
    x = torch.randn(4, 3, dtype=torch.float64)
    x[1] = x[1].abs() + 0.1  # one example takes the other branch
    y = torch.randn(4, 1, dtype=torch.float64)
    per_example = lambda p, xi, yi: ((fmodel(p, xi[None]) - yi[None]) ** 2).sum()  # noqa: E731
    fn, state = clipped_grad(per_example, clipping_norm=0.5, batch_argnums=(1, 2), return_aux=True)
    with pytest.warns(SlowPathWarning, match="vmap cannot run loss_fn"):
        (out, aux), _ = fn(params, x, y, state=state)
    want, norms, _ = reference(lambda p, xb, yb: ((fmodel(p, xb) - yb) ** 2).sum(1), params, x, y, 0.5)
    for got, ref in zip(out.pytree, want):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(aux.grad_norms, norms, rtol=1e-10, atol=1e-12)


def test_user_errors_in_the_loss_are_not_swallowed_by_the_loop():
    fmodel, params = make_functional(nn.Linear(3, 1))

    def broken(p, xi):
        raise ValueError("my loss is broken")

    fn, state = clipped_grad(broken, clipping_norm=1.0, batch_argnums=(1,))
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPathWarning)  # no warning for an error that is the user's
        with pytest.raises(ValueError, match="my loss is broken"):
            fn(params, torch.randn(3, 3), state=state)
