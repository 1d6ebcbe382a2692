"""The testing kit itself: every strategy draws what it promises, every assert fails naming the path."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

from opake_fx.dpsgd.clipping import clipped_grad
from opake_fx.pytree import leaves
from opake_fx.random import RngKey
from opake_fx.testing import (
    EXTREME_SCALES,
    assert_clipped,
    assert_tree_finite,
    assert_tree_shapes_dtypes,
    assert_trees_close,
    assert_trees_equal,
    clipping_configs,
    dp_processes,
    keys,
    poisson_batches,
    pytrees,
    small_models,
)
from opake_fx.types import PerGroup

FAST = settings(max_examples=15, database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FIND = settings(max_examples=300, database=None, deadline=None, derandomize=True, phases=[Phase.generate])

# --- strategies ----------------------------------------------------------------------


def test_keys_cover_both_words():
    assert isinstance(find(keys(), lambda k: True, settings=FIND), RngKey)
    assert find(keys(), lambda k: k.words[0] >= 2**31 and k.words[1] >= 2**31, settings=FIND).words[0] >= 2**31


@FAST
@given(tree=pytrees(dtype=st.sampled_from(list(EXTREME_SCALES)), max_leaves=4))
def test_pytrees_are_finite_at_every_dtype_and_scale(tree):
    assert_tree_finite(tree)
    for leaf in leaves(tree):
        bound = max(EXTREME_SCALES[leaf.dtype])
        assert leaf.abs().max() <= bound if leaf.numel() else True


def test_pytrees_draw_low_precision_empty_nested_and_nonfinite_trees():
    mixed = find(pytrees(dtype=st.sampled_from([torch.float16, torch.bfloat16]), min_leaves=2),
                 lambda t: {x.dtype for x in leaves(t)} == {torch.float16, torch.bfloat16}, settings=FIND)
    assert len(leaves(mixed)) >= 2
    empty = find(pytrees(empty_leaves=True), lambda t: any(x.numel() == 0 for x in leaves(t)), settings=FIND)
    assert any(0 in x.shape for x in leaves(empty))
    nested = find(pytrees(nested=True, min_leaves=3), lambda t: isinstance(t, dict) and "a" in t, settings=FIND)
    assert len(leaves(nested)) >= 3
    bad = find(pytrees(nonfinite=True), lambda t: any(bool(torch.isnan(x).any()) for x in leaves(t)), settings=FIND)
    with pytest.raises(AssertionError, match="non-finite"):
        assert_tree_finite(bad)
    huge = find(pytrees(), lambda t: any(float(x.abs().max()) > 1e29 for x in leaves(t) if x.numel()), settings=FIND)
    assert float(torch.cat([x.reshape(-1) for x in leaves(huge)]).double().pow(2).sum()) > 3.4e38  # squares overflow float32


@FAST
@given(tree=pytrees(batch=3, max_leaves=3))
def test_batched_pytrees_have_the_batch_dimension(tree):
    assert {x.shape[0] for x in leaves(tree)} == {3}


@FAST
@given(cfg=clipping_configs())
def test_clipping_configs_apply_to_any_params(cfg):
    params = {"w": torch.zeros(3), "b": torch.zeros(1), "h": (torch.zeros(2),)}
    norm = cfg.norm_for(params)
    if cfg.group_norms is None:
        assert norm == cfg.clipping_norm
    else:
        assert isinstance(norm, PerGroup) and len(norm.groups) == 3
    assert cfg.microbatch_size is None or cfg.microbatch_size >= 1
    grad_fn, state = clipped_grad(lambda p, x: (p["w"] * x).sum() + p["b"].sum() + p["h"][0].sum(), **cfg.kwargs(params))
    out, _ = grad_fn(params, torch.randn(5, 3, generator=torch.Generator().manual_seed(0)), state=state)
    assert math.isclose(out.sensitivity, cfg.sensitivity(params), rel_tol=1e-12)


@pytest.mark.parametrize("kind", ["features", "image", "tokens", "sequence"])
def test_small_models_give_a_matching_batch_and_losses(kind):
    seen: set[str] = set()

    @settings(max_examples=6, database=None, deadline=None)
    @given(m=small_models(kinds=(kind,)))
    def check(m):
        seen.update(m.description.split(": ")[1].split(" -> "))
        before = torch.random.get_rng_state()
        fmodel, params = m.functional()
        out = fmodel(params, m.x)
        assert out.shape == m.y.shape and out.shape[0] == m.batch_size >= 1
        per_example = m.batched_loss(fmodel)(params, m.x, m.y)
        assert per_example.shape == (m.batch_size,)
        one = m.example_loss(fmodel)(params, m.x[0], m.y[0])
        torch.testing.assert_close(one, per_example[0], rtol=1e-5, atol=1e-6)
        assert torch.equal(torch.random.get_rng_state(), before)

    check()
    expected = {"features": "Linear", "image": "Conv2d", "tokens": "Embedding", "sequence": "Linear"}[kind]
    assert expected in seen


def test_small_models_cover_every_layer_family():
    for name in ("GroupNorm", "LayerNorm", "SelfAttention", "Conv2d", "Embedding"):
        m = find(small_models(), lambda m: name in m.description, settings=FIND)
        assert name in m.description


def test_small_models_draw_the_same_model_for_the_same_example():
    a = find(small_models(kinds=("image",)), lambda m: m.batch_size == 3, settings=FIND)
    b = find(small_models(kinds=("image",)), lambda m: m.batch_size == 3, settings=FIND)
    assert_trees_equal(tuple(a.module.parameters()), tuple(b.module.parameters()))
    assert_trees_equal((a.x, a.y), (b.x, b.y))


def test_poisson_batches_include_empty_and_single_batches():
    assert find(poisson_batches(), lambda b: b.size == 0, settings=FIND).indices == []
    one = find(poisson_batches(), lambda b: b.size == 1, settings=FIND)
    assert one.indices == one.sampler.batch(one.step) and len(one.indices) == 1


@FAST
@given(b=poisson_batches())
def test_poisson_batches_are_the_samplers(b):
    assert b.indices == sorted(set(b.indices)) and all(0 <= i < b.sampler.dataset_size for i in b.indices)
    assert b.indices == b.sampler.batch(b.step)


@settings(max_examples=5, database=None, deadline=None)
@given(p=dp_processes(max_components=2, max_count=20))
def test_dp_processes_have_finite_epsilon_that_composition_raises(p):
    eps = p.epsilon_at(1e-5)
    assert 0 < eps < math.inf
    assert (p | p).epsilon_at(1e-5) >= eps


# --- asserts -------------------------------------------------------------------------


def test_assert_trees_equal_is_bitwise_and_names_the_leaf():
    nan = torch.tensor([float("nan"), 1.0])
    assert_trees_equal({"a": nan}, {"a": nan.clone()})
    with pytest.raises(AssertionError, match=r"leaf \('a', 'w'\) differs at index \(1, 0\): 1.0 != 1.0000001192092896"):
        assert_trees_equal({"a": {"w": torch.ones(2, 2)}}, {"a": {"w": torch.tensor([[1.0, 1.0], [1.0000001, 1.0]])}})
    with pytest.raises(AssertionError, match=r"leaf \('w',\): dtype torch.float32 != torch.float64"):
        assert_trees_equal({"w": torch.ones(2)}, {"w": torch.ones(2, dtype=torch.float64)})
    with pytest.raises(AssertionError, match=r"leaf \('w',\): shape \(2,\) != \(3,\)"):
        assert_trees_equal({"w": torch.ones(2)}, {"w": torch.ones(3)})
    with pytest.raises(AssertionError, match=r"leaves only in expected \[\('v',\)\], only in actual \[\('w',\)\]"):
        assert_trees_equal({"w": torch.ones(2)}, {"v": torch.ones(2)})
    with pytest.raises(AssertionError, match=r"leaf \('n',\): 3 != 4"):
        assert_trees_equal({"n": 3}, {"n": 4})
    assert_trees_equal({"e": torch.zeros(0, 3)}, {"e": torch.zeros(0, 3)})


def test_assert_trees_close_and_shapes_dtypes_name_the_leaf():
    assert_trees_close((torch.ones(2),), (torch.ones(2, dtype=torch.float64) + 1e-9,))
    with pytest.raises(AssertionError, match=r"leaf \(1,\) differs"):
        assert_trees_close((torch.ones(2), torch.ones(1)), (torch.ones(2), torch.zeros(1)))
    assert_tree_shapes_dtypes({"w": torch.ones(2, 3), "b": torch.ones(1)}, {"w": ((2, 3), torch.float32), "b": torch.zeros(1)})
    with pytest.raises(AssertionError, match=r"leaf \('b',\): shape \(1,\), expected \(2,\)"):
        assert_tree_shapes_dtypes({"b": torch.ones(1)}, {"b": ((2,), torch.float32)})


def test_assert_clipped_checks_each_example_and_group():
    c = 1.0
    g = torch.randn(4, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    clipped = g / g.norm(dim=1, keepdim=True).clamp(min=c) * c
    assert_clipped({"w": clipped[:, :3], "b": clipped[:, 3:]}, c)
    over = clipped.clone()
    over[2] *= 1 + 1e-9
    with pytest.raises(AssertionError, match=r"example 2 has norm .* > bound 1.0"):
        assert_clipped({"w": over[:, :3], "b": over[:, 3:]}, c)
    pg = PerGroup({"w": "big", "b": "small"}, {"big": 10.0, "small": 0.1})
    with pytest.raises(AssertionError, match=r"example 0 has norm .* > bound 0.1 in group 'small'.*\('b',\)"):
        assert_clipped({"w": torch.ones(2, 3), "b": torch.ones(2, 1)}, pg)
    assert_clipped({"w": torch.ones(3, 2)}, 2.0, batch_dim=1)
    with pytest.raises(AssertionError, match="disagree on the batch size"):
        assert_clipped({"w": torch.ones(3, 2), "b": torch.ones(2)}, 2.0)


@FAST
@given(batched=pytrees(batch=3, max_leaves=3, dtype=st.sampled_from([torch.float32, torch.float64])), c=st.floats(1e-3, 1e3))
def test_library_clipping_passes_assert_clipped_per_example(batched, c):
    # The library's invariant, checked with the kit on single-example calls.
    params = tuple(torch.zeros_like(leaf[0]) for leaf in leaves(batched))
    grad_fn, s = clipped_grad(lambda p, *xs: sum((pi * xi).sum() for pi, xi in zip(p, xs)), clipping_norm=c,
                              batch_argnums=tuple(range(1, len(params) + 1)))
    per_example = []
    for i in range(3):
        out, s = grad_fn(params, *(leaf[i : i + 1] for leaf in leaves(batched)), state=s)
        per_example.append(out.pytree)
    stacked = tuple(torch.stack([ex[j] for ex in per_example]) for j in range(len(params)))
    assert_clipped(stacked, c)
