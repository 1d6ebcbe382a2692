"""register_rule: users' own layer rules for the fast clipping backends."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from opake_fx.dpsgd.clipping import _registry, _rules_fallback, clipped_grad, register_rule, unregister_rule
from opake_fx.errors import InputTypeError, InputValueError, SlowPathWarning
from opake_fx.functional import make_functional
from tests.dpsgd.test_ghost_layers import reference


class Scale(nn.Module):
    """``y = x * s + t`` elementwise over the last axis (one ``addcmul``: no broadcast of a
    parameter that the elementwise rule would take, so without a registered rule it falls back)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.randn(d))
        self.t = nn.Parameter(torch.randn(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(self.t, x, self.s)


def scale_rule(module: Scale, a: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    b, d = a.shape[0], a.shape[-1]
    return {"s": (a * g).reshape(b, -1, d).sum(1), "t": g.reshape(b, -1, d).sum(1)}


@pytest.fixture
def registered():
    register_rule(Scale, scale_rule)
    yield
    unregister_rule(Scale)


def _setup(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), Scale(4), nn.Tanh(), nn.Linear(4, 1)).to(dtype)
    fmodel, params = make_functional(model)
    x, y = torch.randn(6, 5, 3, dtype=dtype), torch.randn(6, 5, 1, dtype=dtype)

    def batched(p, xb, yb):
        return ((fmodel(p, xb) - yb) ** 2).flatten(1).sum(1)

    return fmodel, params, batched, x, y


@pytest.mark.parametrize("backend", ["ghost", "auto"])
def test_a_registered_rule_keeps_the_layer_off_the_fallback_and_is_exact(registered, backend, monkeypatch):
    calls = []
    monkeypatch.setattr(_rules_fallback, "module_per_example", lambda *a, **k: calls.append(1))  # must not run
    fmodel, params, batched, x, y = _setup()
    want, want_norms, _ = reference(batched, params, x, y, 0.5)
    fn, state = clipped_grad(batched, clipping_norm=0.5, batch_argnums=(1, 2), return_aux=True, clip_backend=backend,
                             model=fmodel)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPathWarning)
        (out, aux), _ = fn(params, x, y, state=state)
    assert not calls
    for got, ref in zip(out.pytree, want):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(aux.grad_norms, want_norms, rtol=1e-10, atol=1e-12)


def test_without_a_rule_the_module_takes_the_announced_fallback():
    fmodel, params, batched, x, y = _setup()
    fn, state = clipped_grad(batched, clipping_norm=0.5, batch_argnums=(1, 2), clip_backend="auto", model=fmodel)
    with pytest.warns(SlowPathWarning, match=r"per-module fallback.*1\.s \(Scale\)"):
        fn(params, x, y, state=state)


def test_a_wrong_rule_is_caught_on_its_first_call(registered):
    register_rule(Scale, lambda m, a, g: {k: 2 * v for k, v in scale_rule(m, a, g).items()})
    fmodel, params, batched, x, y = _setup()
    fn, state = clipped_grad(batched, clipping_norm=0.5, batch_argnums=(1, 2), clip_backend="auto", model=fmodel)
    with pytest.raises(InputValueError, match="rule registered for Scale is wrong for 's'"):
        fn(params, x, y, state=state)


def test_a_rule_returning_the_wrong_shape_is_refused(registered):
    register_rule(Scale, lambda m, a, g: {"s": (a * g).sum(), "t": g.sum()})
    fmodel, params, batched, x, y = _setup()
    fn, state = clipped_grad(batched, clipping_norm=0.5, batch_argnums=(1, 2), clip_backend="auto", model=fmodel)
    with pytest.raises(InputValueError, match=r"per-example gradients of 's' with shape \(6, 4\)"):
        fn(params, x, y, state=state)


def test_a_rule_that_misattributes_examples_still_cannot_break_the_clip_bound(registered):
    # Rolling the examples keeps the batch sum (so the autograd check passes) but gives each
    # example another's gradient: the gradient is wrong, the bound still holds, because norms
    # and the clipped sum are both taken from what the rule returned.
    register_rule(Scale, lambda m, a, g: {k: v.roll(1, 0) for k, v in scale_rule(m, a, g).items()})
    fmodel, params, batched, x, y = _setup(torch.float32, seed=3)
    x = x * 50
    fn, state = clipped_grad(batched, clipping_norm=0.1, batch_argnums=(1, 2), return_aux=True, clip_backend="auto",
                             model=fmodel)
    for i in range(x.shape[0]):
        (out, aux), _ = fn(params, x[i : i + 1], y[i : i + 1], state=state)
        total = sum(float(t.double().square().sum()) for t in out.pytree) ** 0.5
        assert total <= 0.1


def test_registration_refuses_bad_arguments():
    with pytest.raises(InputTypeError):
        register_rule(int, scale_rule)
    with pytest.raises(InputTypeError):
        register_rule(Scale, "not a function")
    with pytest.raises(InputValueError, match="built-in rule"):
        register_rule(nn.Linear, scale_rule)


def test_a_subclass_with_its_own_forward_does_not_inherit_the_rule(registered):
    class Shifted(Scale):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.s - self.t

    assert _registry.lookup(Shifted(3)).kind == "fallback"
    assert _registry.lookup(Scale(3)).kind == "registered"

    class Plain(Scale):
        pass

    assert _registry.lookup(Plain(3)).kind == "registered"
