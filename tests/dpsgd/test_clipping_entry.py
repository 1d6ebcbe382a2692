"""The one clipping entry: stages of every mode, ``pre_clip`` and the squared-gradient stream."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from opake_fx.dpsgd.clipping import (
    adaptive_clip,
    adaptive_clipped_grad,
    auto_clip,
    auto_clipped_grad,
    clip,
    clipped_grad,
    per_group,
)
from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.functional import make_functional
from opake_fx.pytree import tree_map
from opake_fx.random import key
from opake_fx.types import ClippedPytree, SecondMomentClippingOutput


def _data(batch=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(3, 2, generator=gen), "b": torch.randn(2, generator=gen)}
    x = torch.randn(batch, 3, generator=gen) * 3.0
    y = torch.randn(batch, 2, generator=gen)
    return params, x, y


def _loss(p, x, y):  # one example
    return ((x @ p["w"] + p["b"] - y) ** 2).sum()


def _per_example_grads(params, x, y):
    out = []
    for i in range(x.shape[0]):
        out.append(torch.func.grad(_loss)(params, x[i], y[i]))
    return out


def _norm(tree):
    return float(torch.sqrt(sum((v.double() ** 2).sum() for v in tree.values())))


def _scale_hook(g):
    # A non-isotropic per-example map: stretches w, shrinks b.
    return {"w": 4.0 * g["w"], "b": 0.25 * g["b"]}


# --- one entry: every mode has its chain stage and the shared options ----------------


def test_auto_and_adaptive_stages_equal_their_functions():
    params, x, y = _data()
    g, s = auto_clipped_grad(_loss, clipping_norm=0.5, gamma=0.1, batch_argnums=(1, 2), normalize_by=6)
    want, _ = g(params, x, y, state=s)
    stage = auto_clip(_loss, clipping_norm=0.5, gamma=0.1, batch_argnums=(1, 2), normalize_by=6)
    got, _ = stage.update((x, y), stage.init(params), params)
    assert got.max_norm == want.max_norm == 0.5 / 6
    for k in params:
        assert torch.equal(got.pytree[k], want.pytree[k])

    kw = dict(initial_clipping_norm=1.0, count_noise_multiplier=1.0, key=key(3), batch_argnums=(1, 2), expected_batch_size=6)
    g, s = adaptive_clipped_grad(_loss, **kw)
    stage = adaptive_clip(_loss, **kw)
    st = stage.init(params)
    for _ in range(3):
        want, s = g(params, x, y, state=s)
        got, st = stage.update((x, y), st, params)
        assert got.max_norm == want.max_norm
        assert torch.equal(got.pytree["w"], want.pytree["w"])
    assert st == s  # same count noise, same norm trajectory
    assert stage.privacy.kind == "clip" and auto_clip(_loss, batch_argnums=(1, 2)).privacy.max_norm == 1.0


def test_every_mode_validates_the_shared_options_the_same_way():
    makers = [
        lambda **kw: clipped_grad(_loss, clipping_norm=1.0, **kw),
        lambda **kw: auto_clipped_grad(_loss, **kw),
        lambda **kw: adaptive_clipped_grad(_loss, initial_clipping_norm=1.0, count_noise_multiplier=1.0, key=key(0), **kw),
    ]
    for make in makers:
        with pytest.raises(InputValueError, match="overlap"):
            make(argnums=1, batch_argnums=1)
        with pytest.raises(InputValueError, match="normalize_by"):
            make(normalize_by=0.0)
        with pytest.raises(InputTypeError, match="pre_clip"):
            make(pre_clip="scale")
        with pytest.raises(InputTypeError, match="second_moment"):
            make(second_moment="yes")
    with pytest.raises(InputTypeError, match="per-group"):
        auto_clipped_grad(_loss, clipping_norm=per_group(_data()[0], all=(1.0, "*")))


# --- pre_clip -------------------------------------------------------------------------


@pytest.mark.parametrize("c", [0.3, 5.0, 1e3])
def test_pre_clip_equals_a_per_example_loop(c):
    params, x, y = _data()
    g, s = clipped_grad(_loss, clipping_norm=c, batch_argnums=(1, 2), pre_clip=_scale_hook, normalize_by=2.0,
                        dtype=torch.float64)
    out, _ = g(params, x, y, state=s)
    want = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in params.items()}
    for gi in _per_example_grads(params, x, y):
        hooked = _scale_hook(gi)
        scale = min(1.0, c / _norm(hooked))
        for k in want:
            want[k] += scale * hooked[k].double() / 2.0
    for k in params:
        torch.testing.assert_close(out.pytree[k], want[k], rtol=1e-6, atol=1e-9)
    assert out.max_norm == c / 2.0


def test_clip_bound_holds_after_the_hook():
    params, x, y = _data(batch=1)
    c = 0.7
    for hook in (_scale_hook, lambda g: tree_map(lambda v: 1e6 * v, g)):
        g, s = clipped_grad(_loss, clipping_norm=c, batch_argnums=(1, 2), pre_clip=hook, return_aux=True)
        (out, aux), _ = g(params, x, y, state=s)
        # One example: the sum IS its clipped contribution; its norm is the hooked gradient's, clipped.
        assert _norm(out.pytree) <= c * (1 + 1e-6)
        assert _norm(out.pytree) == pytest.approx(c, rel=1e-5)  # both hooks push the norm above c
        assert float(aux.grad_norms[0]) == pytest.approx(_norm(hook(_per_example_grads(params, x, y)[0])), rel=1e-5)


def test_pre_clip_in_auto_and_adaptive_and_microbatches():
    params, x, y = _data(batch=8)
    g, s = auto_clipped_grad(_loss, clipping_norm=1.0, batch_argnums=(1, 2), pre_clip=_scale_hook)
    full, _ = g(params, x, y, state=s)
    g, s = auto_clipped_grad(_loss, clipping_norm=1.0, batch_argnums=(1, 2), pre_clip=_scale_hook, microbatch_size=3)
    micro, _ = g(params, x, y, state=s)
    torch.testing.assert_close(micro.pytree, full.pytree)
    g, s = adaptive_clipped_grad(_loss, initial_clipping_norm=1.0, count_noise_multiplier=0.0, key=key(0),
                                 batch_argnums=(1, 2), pre_clip=lambda t: tree_map(lambda v: 0.0 * v, t),
                                 expected_batch_size=8)
    out, s = g(params, x, y, state=s)
    assert float(out.pytree["w"].abs().sum()) == 0.0
    assert s.clipping_norm < 1.0  # every hooked norm (0) was below C: the norm shrinks


def test_pre_clip_refuses_a_different_structure_and_the_fast_backends():
    params, x, y = _data()
    g, s = clipped_grad(_loss, clipping_norm=1.0, batch_argnums=(1, 2), pre_clip=lambda t: [t["w"], t["b"]])
    with pytest.raises(InputValueError, match="same structure"):
        g(params, x, y, state=s)
    g, s = clipped_grad(_loss, clipping_norm=1.0, batch_argnums=(1, 2), pre_clip=lambda t: {"w": t["w"][0], "b": t["b"]})
    with pytest.raises(InputValueError, match="parameter's shape"):
        g(params, x, y, state=s)
    net = nn.Linear(3, 2)
    fmodel, _ = make_functional(net)
    for backend in ("ghost", "auto"):
        for kw in ({"pre_clip": _scale_hook}, {"second_moment": True}):
            with pytest.raises(InputValueError, match='clip_backend="vmap"'):
                clipped_grad(lambda p, x, y: ((fmodel(p, x) - y) ** 2).sum(1), clipping_norm=1.0,
                             batch_argnums=(1, 2), clip_backend=backend, model=fmodel, **kw)


# --- second moment ------------------------------------------------------------------


@pytest.mark.parametrize("c", [0.5, 1e3])
def test_second_moment_is_the_sum_of_clipped_squares(c):
    params, x, y = _data()
    g, s = clipped_grad(_loss, clipping_norm=c, batch_argnums=(1, 2), normalize_by=4.0, second_moment=True,
                        dtype=torch.float64)
    out, _ = g(params, x, y, state=s)
    assert isinstance(out, SecondMomentClippingOutput)
    assert out.grads.max_norm == c / 4.0 and out.squared_grads.max_norm == c**2 / 4.0
    first = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in params.items()}
    second = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in params.items()}
    for gi in _per_example_grads(params, x, y):
        scale = min(1.0, c / _norm(gi))
        for k in first:
            first[k] += scale * gi[k].double() / 4.0
            second[k] += (scale * gi[k].double()) ** 2 / 4.0
    for k in params:
        torch.testing.assert_close(out.grads.pytree[k], first[k], rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(out.squared_grads.pytree[k], second[k], rtol=1e-6, atol=1e-9)
    # The gradient stream is the one clipped_grad releases without the squares.
    g, s = clipped_grad(_loss, clipping_norm=c, batch_argnums=(1, 2), normalize_by=4.0, dtype=torch.float64)
    alone, _ = g(params, x, y, state=s)
    for k in params:
        assert torch.equal(alone.pytree[k], out.grads.pytree[k])


def test_second_moment_per_example_bound_and_modes():
    params, x, y = _data(batch=1)
    for make in (
        lambda: clipped_grad(_loss, clipping_norm=0.3, batch_argnums=(1, 2), second_moment=True),
        lambda: auto_clipped_grad(_loss, clipping_norm=0.3, batch_argnums=(1, 2), second_moment=True),
        lambda: adaptive_clipped_grad(_loss, initial_clipping_norm=0.3, count_noise_multiplier=0.0, key=key(0),
                                      batch_argnums=(1, 2), second_moment=True),
    ):
        g, s = make()
        out, _ = g(params, x, y, state=s)
        assert _norm(out.squared_grads.pytree) <= 0.3**2 * (1 + 1e-6)
        assert float(min(v.min() for v in out.squared_grads.pytree.values())) >= 0.0


def test_second_moment_microbatches_empty_batch_stage_and_refusals():
    params, x, y = _data(batch=7)
    g, s = clipped_grad(_loss, clipping_norm=1.0, batch_argnums=(1, 2), second_moment=True)
    full, _ = g(params, x, y, state=s)
    g, s = clipped_grad(_loss, clipping_norm=1.0, batch_argnums=(1, 2), second_moment=True, microbatch_size=3)
    micro, _ = g(params, x, y, state=s)
    torch.testing.assert_close(micro.squared_grads.pytree, full.squared_grads.pytree)
    empty, _ = g(params, x[:0], y[:0], state=s)
    assert all(float(v.abs().sum()) == 0.0 for v in empty.squared_grads.pytree.values())
    stage = clip(_loss, clipping_norm=1.0, batch_argnums=(1, 2), second_moment=True)
    out, _ = stage.update((x, y), stage.init(params), params)
    assert isinstance(out, SecondMomentClippingOutput) and isinstance(out.grads, ClippedPytree)
    with pytest.raises(InputValueError, match="per-group"):
        clipped_grad(_loss, clipping_norm=per_group(params, all=(1.0, "*")), batch_argnums=(1, 2), second_moment=True)


@settings(max_examples=60, deadline=None)
@given(
    d=st.sampled_from([1, 2, 7, 300]),
    scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e19, 1e30]),
    c=st.floats(1e-3, 1e3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_squared_stream_bound_holds_in_floating_point(d, scale, c, dtype, seed):
    # Gradients whose squares overflow float32 (1e19, 1e30) must not reach the squared sum:
    # the square is taken of the clipped contribution, never of the raw gradient.
    x = (torch.randn(2, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale).to(dtype)
    g, s = clipped_grad(lambda p, xi: (p * xi).sum(), clipping_norm=c, second_moment=True)
    for i in range(2):
        out, _ = g(torch.zeros(d, dtype=dtype), x[i : i + 1], state=s)
        sq = out.squared_grads.pytree.double()
        assert bool(torch.isfinite(sq).all()) and float(sq.min()) >= 0.0
        assert float(sq.norm()) <= c**2
