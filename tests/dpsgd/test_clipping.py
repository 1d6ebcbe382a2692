"""clipped_grad, auto_clipped_grad, adaptive_clipped_grad, per_group: bounds, identities, errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opake_fx.dpsgd.clipping import (
    ClippedGradAux,
    ClippingStats,
    adaptive_clipped_grad,
    auto_clipped_grad,
    clipped_grad,
    per_group,
)
from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.pytree import leaves, safe_norm, tree_map
from opake_fx.random import key
from opake_fx.testing import assert_trees_close, pytrees
from opake_fx.types import ClippedPytree


def identity_loss(params, g):
    """A loss whose per-example gradient w.r.t. params is exactly the example's g."""
    return sum((p * x).sum() for p, x in zip(leaves(params), leaves(g)))


def per_example_norm(g, i):
    return float(safe_norm(torch.stack([safe_norm(leaf[i]) for leaf in leaves(g)])))


@settings(max_examples=40)
@given(batched=pytrees(max_leaves=4, batch=3), c=st.floats(1e-3, 1e3))
def test_clip_bound_holds_for_each_example(batched, c):
    params = tree_map(lambda leaf: torch.zeros_like(leaf[0]), batched)
    g, s = clipped_grad(identity_loss, clipping_norm=c, return_aux=True)
    for i in range(3):
        one = tree_map(lambda leaf: leaf[i : i + 1], batched)
        (out, aux), s = g(params, one, state=s)
        norm = float(safe_norm(torch.stack([safe_norm(x) for x in leaves(out.pytree)])))
        assert norm <= c * (1 + 1e-5)
        raw = per_example_norm(batched, i)
        # Clipping is the identity at or below C and lands on C above it.
        expected = min(raw, c)
        assert norm == pytest.approx(expected, rel=1e-5, abs=1e-30)
        assert float(aux.grad_norms[0]) == pytest.approx(raw, rel=1e-6)


def test_clipping_is_identity_below_c():
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0)) * 0.01
    g, s = clipped_grad(identity_loss, clipping_norm=10.0)
    out, _ = g(torch.zeros(3), x, state=s)
    torch.testing.assert_close(out.pytree, x.sum(0))


def test_sum_normalisation_and_max_norm():
    x = torch.ones(4, 2) * 3.0  # norm 3*sqrt(2) each
    g, s = clipped_grad(identity_loss, clipping_norm=1.0, normalize_by=4.0)
    out, s = g(torch.zeros(2), x, state=s)
    assert out.max_norm == 0.25
    torch.testing.assert_close(out.pytree, torch.full((2,), 1 / math.sqrt(2)))
    assert s.step == 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_gradient_is_zeroed_and_counted(bad):
    x = torch.tensor([[1.0, 0.0], [bad, 1.0], [0.0, 0.5]])
    g, s = clipped_grad(identity_loss, clipping_norm=1.0, return_stats=True)
    (out, stats), _ = g(torch.zeros(2), x, state=s)
    assert torch.isfinite(out.pytree).all()
    torch.testing.assert_close(out.pytree, torch.tensor([1.0, 0.5]))
    assert stats.num_nonfinite == 1 and stats.batch_size == 3


def test_zero_gradient_is_kept_zero():
    g, s = clipped_grad(identity_loss, clipping_norm=1.0)
    out, _ = g(torch.zeros(2), torch.zeros(3, 2), state=s)
    assert torch.equal(out.pytree, torch.zeros(2))


def test_extreme_norms_clip_correctly():
    x = torch.tensor([[1e30, 1e30], [1e-30, 0.0], [3.0, 4.0]])
    g, s = clipped_grad(identity_loss, clipping_norm=1.0, return_aux=True)
    (out, aux), _ = g(torch.zeros(2), x, state=s)
    expected = torch.tensor([1 / math.sqrt(2) + 1e-30 + 0.6, 1 / math.sqrt(2) + 0.8])
    torch.testing.assert_close(out.pytree, expected)
    assert aux.num_nonfinite == 0
    assert float(aux.grad_norms[0]) == pytest.approx(math.sqrt(2) * 1e30)


def test_microbatched_equals_unbatched():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(3, 5, generator=gen)
    x = torch.randn(11, 5, generator=gen)
    y = torch.randn(11, 3, generator=gen)

    def loss(w, x, y):
        return ((x @ w.T - y) ** 2).sum()

    full, s = clipped_grad(loss, clipping_norm=0.5, batch_argnums=(1, 2), return_aux=True)
    micro, s2 = clipped_grad(loss, clipping_norm=0.5, batch_argnums=(1, 2), microbatch_size=4, return_aux=True)
    (a, aux_a), _ = full(w, x, y, state=s)
    (b, aux_b), _ = micro(w, x, y, state=s2)
    torch.testing.assert_close(a.pytree, b.pytree, rtol=1e-6, atol=1e-6)
    # float32 per-example gradients from batches of 11 and of 4 may differ in the last bits
    # (different matmul blocking), so their norms agree to float32 precision, not float64's.
    torch.testing.assert_close(aux_a.grad_norms, aux_b.grad_norms, rtol=1e-6, atol=0)


def test_matches_per_example_autograd_loop():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    from opake_fx.functional import make_functional

    fmodel, params = make_functional(model)
    x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))

    def loss(params, x, y):
        return torch.nn.functional.cross_entropy(fmodel(params, x.unsqueeze(0)), y.unsqueeze(0))

    g, s = clipped_grad(loss, clipping_norm=0.3, batch_argnums=(1, 2), normalize_by=6)
    out, _ = g(params, x, y, state=s)
    expected = [torch.zeros_like(p) for p in params]
    for i in range(6):
        ps = [p.clone().requires_grad_() for p in params]
        grads = torch.autograd.grad(loss(ps, x[i], y[i]), ps)
        n = math.sqrt(sum(float((gr**2).sum()) for gr in grads))
        factor = min(1.0, 0.3 / n)
        expected = [e + factor * gr / 6 for e, gr in zip(expected, grads)]
    assert_trees_close(tuple(out.pytree), tuple(expected), rtol=1e-5, atol=1e-7)


def test_multiple_argnums_and_dict_batches():
    def loss(a, b, batch):
        return (a * batch["x"]).sum() + (b * batch["z"]).sum()

    g, s = clipped_grad(loss, argnums=(0, 1), batch_argnums=2, clipping_norm=float("inf"))
    batch = {"x": torch.ones(3, 2), "z": torch.full((3, 1), 2.0)}
    out, _ = g(torch.zeros(2), torch.zeros(1), batch, state=s)
    assert isinstance(out.pytree, tuple)
    torch.testing.assert_close(out.pytree[0], torch.full((2,), 3.0))
    torch.testing.assert_close(out.pytree[1], torch.full((1,), 6.0))
    assert out.max_norm == float("inf")


def test_has_aux_returns_per_example_aux():
    def loss(p, x):
        l = (p * x).sum()
        return l, {"double": 2 * l}

    g, s = clipped_grad(loss, has_aux=True, clipping_norm=1.0)
    (out, aux), _ = g(torch.ones(2), torch.ones(3, 2), state=s)
    torch.testing.assert_close(aux["double"], torch.full((3,), 4.0))


def test_empty_batch_gives_zeros_without_vmap():
    calls = []

    def loss(p, x):
        calls.append(1)
        return (p * x).sum()

    g, s = clipped_grad(loss, clipping_norm=1.0, normalize_by=2.0, return_stats=True)
    (out, stats), s = g(torch.ones(3), torch.zeros(0, 3), state=s)
    assert not calls
    assert torch.equal(out.pytree, torch.zeros(3)) and out.max_norm == 0.5
    assert stats == ClippingStats(num_clipped=0.0, clipping_rate=0.0, batch_size=0, num_nonfinite=0)


def test_stats_and_aux_report_clipping():
    x = torch.tensor([[3.0, 4.0], [0.3, 0.4], [6.0, 8.0], [0.0, 0.0]])
    g, s = clipped_grad(identity_loss, clipping_norm=1.0, return_aux=True)
    (out, aux), _ = g(torch.zeros(2), x, state=s)
    assert isinstance(aux, ClippedGradAux)
    torch.testing.assert_close(aux.grad_norms, torch.tensor([5.0, 0.5, 10.0, 0.0], dtype=torch.float64))
    # Clipped examples land just below C: the weights leave room for the output's rounding.
    torch.testing.assert_close(aux.clipped_grad_norms, torch.tensor([1.0, 0.5, 1.0, 0.0], dtype=torch.float64), rtol=1e-6, atol=0)
    assert bool((aux.clipped_grad_norms <= 1.0).all())
    assert aux.clipping_rate == 0.5 and aux.batch_size == 4


def test_per_group_bounds_each_group():
    params = {"w": torch.zeros(3), "b": torch.zeros(1)}
    pg = per_group(params, bias=(0.1, "b"), rest=(1.0, "*"))
    x = {"w": torch.full((2, 3), 10.0), "b": torch.full((2, 1), 10.0)}
    g, s = clipped_grad(identity_loss, clipping_norm=pg, return_aux=True)
    (out, aux), _ = g(params, x, state=s)
    assert float(out.pytree["b"].abs().sum()) == pytest.approx(0.2)
    assert float(torch.linalg.vector_norm(out.pytree["w"])) == pytest.approx(2.0)
    assert out.sensitivity == pytest.approx(math.sqrt(1.0 + 0.01))
    assert set(aux.group_norms) == {"bias", "rest"}


def test_per_group_errors():
    params = {"w": torch.zeros(3), "b": torch.zeros(1)}
    with pytest.raises(InputValueError, match="match no group"):
        per_group(params, bias=(0.1, "b"))
    with pytest.raises(InputValueError):
        per_group(params)


def test_auto_clipping_normalises():
    x = torch.tensor([[3.0, 4.0], [0.0, 0.5]])
    g, s = auto_clipped_grad(identity_loss, clipping_norm=2.0, gamma=0.0, return_aux=True)
    (out, aux), _ = g(torch.zeros(2), x, state=s)
    torch.testing.assert_close(out.pytree, torch.tensor([1.2, 1.6 + 2.0]))
    assert out.max_norm == 2.0
    g, s = auto_clipped_grad(identity_loss, clipping_norm=1.0, gamma=0.01)
    out, _ = g(torch.zeros(2), torch.zeros(2, 2), state=s)
    assert torch.equal(out.pytree, torch.zeros(2))


def test_adaptive_clipping_tracks_quantile_without_noise():
    g, s = adaptive_clipped_grad(
        identity_loss,
        initial_clipping_norm=0.1,
        count_noise_multiplier=0.0,
        key=key(0),
        target_quantile=0.5,
        learning_rate=0.2,
        expected_batch_size=100,
    )
    norms = torch.linspace(0.5, 1.5, 100)
    x = torch.stack([norms, torch.zeros(100)], dim=1)
    for _ in range(200):
        out, s = g(torch.zeros(2), x, state=s)
    assert s.clipping_norm == pytest.approx(1.0, abs=0.05)  # the median of the norms
    assert s.step == 200


def test_adaptive_clipping_noise_is_keyed():
    def run(k):
        g, s = adaptive_clipped_grad(
            identity_loss, initial_clipping_norm=1.0, count_noise_multiplier=5.0, key=k, expected_batch_size=10
        )
        for _ in range(3):
            _, s = g(torch.zeros(2), torch.ones(10, 2), state=s)
        return s.clipping_norm

    assert run(key(1)) == run(key(1)) != run(key(2))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(clipping_norm=-1.0), "clipping_norm must be > 0"),
        (dict(clipping_norm=float("nan")), "clipping_norm must be > 0"),
        (dict(clipping_norm=1.0, argnums=1, batch_argnums=1), "overlap"),
        (dict(clipping_norm=1.0, normalize_by=0.0), "normalize_by"),
        (dict(clipping_norm=1.0, microbatch_size=0), "microbatch_size"),
        (dict(clipping_norm=1.0, return_aux=True, return_stats=True), "cannot both"),
    ],
)
def test_bad_configuration_errors(kwargs, match):
    with pytest.raises(InputValueError, match=match):
        clipped_grad(identity_loss, **kwargs)


def test_bad_call_errors():
    g, s = clipped_grad(lambda p, x, y: (p * x).sum() + y.sum(), clipping_norm=1.0, batch_argnums=(1, 2))
    with pytest.raises(InputValueError, match="disagree on the batch size"):
        g(torch.zeros(2), torch.ones(3, 2), torch.ones(4), state=s)
    with pytest.raises(InputTypeError, match="non-tensor leaf"):
        g({"w": torch.zeros(2), "n": 3}, torch.ones(3, 2), torch.ones(3), state=s)
    g2, s2 = clipped_grad(lambda p, x: p * x, clipping_norm=1.0)
    with pytest.raises(InputValueError, match="scalar"):
        g2(torch.zeros(2), torch.ones(3, 2), state=s2)


def test_output_is_clipped_pytree_with_float32_accumulation():
    g, s = clipped_grad(identity_loss, clipping_norm=1.0)
    out, _ = g(torch.zeros(2, dtype=torch.bfloat16), torch.ones(4, 2, dtype=torch.bfloat16), state=s)
    assert isinstance(out, ClippedPytree) and out.pytree.dtype == torch.float32


@settings(max_examples=60)
@given(
    norms=st.lists(st.one_of(st.floats(0.0, 1e250), st.sampled_from([0.0, 5e-324, 1.0, 1e250])), min_size=1, max_size=8),
    c=st.one_of(st.floats(1e-30, 1e30), st.just(math.inf)),
)
def test_clip_weights_are_min_of_one_and_bound_over_norm(norms, c):
    # Finite norms only (the engine zeroes the weights of non-finite ones itself), and
    # C / norm above the subnormal range (a clip norm of 1e-30 against a norm of 1e300 is absurd).
    from opake_fx.dpsgd.clipping.fixed import clip_weights

    n = torch.tensor([norms], dtype=torch.float64)
    w = clip_weights(n, torch.tensor([c], dtype=torch.float64))[0].tolist()
    for norm, weight in zip(norms, w):
        if norm <= c:
            assert weight == 1.0  # exactly: at or below the bound an example is untouched
        else:
            assert weight == pytest.approx(c / norm, rel=1e-15, abs=0.0)
            assert weight * norm <= c * (1 + 1e-15)
