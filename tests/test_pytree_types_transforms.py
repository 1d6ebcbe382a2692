"""Tree math, DP wrapper types and the Transform/chain contract."""

from __future__ import annotations

import math

import optree
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from opake_fx import pytree as pt
from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.testing import assert_trees_close, pytrees
from opake_fx.transforms import Transform, apply_updates, chain, identity, named_chain, stateless, unwrap
from opake_fx.types import ClippedPytree, NoisedPytree, PerGroup, SecondMomentClippingOutput


def test_tree_math_basics():
    a = {"w": torch.ones(2, 2), "b": torch.full((3,), 2.0)}
    b = pt.scale(a, 2.0)
    assert_trees_close(pt.sub(b, a), a)
    assert_trees_close(pt.add(a, a), b)
    assert float(pt.vdot(a, a)) == pytest.approx(4 + 12)
    assert float(pt.global_norm(a)) == pytest.approx(4.0)
    assert_trees_close(pt.zeros_like(a), pt.scale(a, 0.0))
    assert pt.cast(a, torch.float64)["w"].dtype == torch.float64


@given(tree=pytrees())
def test_global_norm_neither_overflows_nor_underflows(tree):
    expected = math.sqrt(sum(float((leaf.double() ** 2).sum()) for leaf in pt.leaves(tree)))
    got = float(pt.global_norm(tree))
    assert got == pytest.approx(expected, rel=1e-6) or (expected == 0 and got == 0)


def test_partition_merge_roundtrip():
    t = {"enc": {"w": torch.ones(2), "b": torch.zeros(1)}, "head": (torch.ones(3),)}
    sel, rest = pt.partition(lambda path, leaf: path[-1] == "b", t)
    assert sel["enc"]["w"] is None and rest["enc"]["b"] is None
    assert_trees_close(pt.merge(sel, rest), t)


def test_flatten_with_paths_names_leaves():
    paths, leaves, _ = pt.tree_flatten_with_paths({"a": (torch.ones(1), torch.ones(1))})
    assert paths == [("a", 0), ("a", 1)]


def test_wrappers_are_tree_nodes_but_generic_maps_drop_the_guarantee():
    g = ClippedPytree({"w": torch.ones(2)}, max_norm=0.5)
    doubled = pt.tree_map(lambda x: 2 * x, g)
    assert type(doubled) is dict and doubled["w"].tolist() == [2.0, 2.0]
    n = NoisedPytree({"w": torch.ones(2)}, max_norm=0.5, noise_stddev=1.5)
    assert type(pt.tree_map(torch.neg, n)) is dict
    assert len(optree.tree_leaves(n, namespace=pt.NAMESPACE)) == 1
    # optree's own map with our namespace rebuilds through the same node: also dropped.
    assert type(optree.tree_map(torch.neg, [g], namespace=pt.NAMESPACE)[0]) is dict
    sm = SecondMomentClippingOutput(g, g)
    assert len(pt.leaves(sm)) == 2
    out = pt.tree_map(torch.neg, sm)
    assert type(out) is tuple and [type(x) for x in out] == [dict, dict]


def test_wrapper_scalar_arithmetic_scales_sensitivity():
    g = ClippedPytree((torch.ones(2),), max_norm=0.5)
    assert (g * 2).max_norm == 1.0 and (g / 2).max_norm == 0.25 and (-g).max_norm == 0.5
    n = NoisedPytree((torch.ones(2),), max_norm=0.5, noise_stddev=2.0)
    assert (n * 3).noise_stddev == 6.0 and isinstance(n * 3, NoisedPytree)
    with pytest.raises(InputTypeError):
        g * torch.tensor(2.0)
    with pytest.raises(InputTypeError):
        g + g


def test_clone_is_deep_for_tensors():
    g = ClippedPytree([torch.zeros(2)], max_norm=1.0)
    c = g.clone()
    c.pytree[0].add_(1)
    assert float(g.pytree[0].sum()) == 0.0 and c.max_norm == 1.0


def test_per_group_values():
    pg = PerGroup({"w": "a", ("enc", "b"): "b"}, {"a": 3.0, "b": 4.0})
    assert pg.effective == 5.0
    assert pg.for_path(("w",)) == 3.0 and pg.for_path(("enc", "b")) == 4.0
    assert (pg * 2).values["a"] == 6.0
    with pytest.raises(InputValueError):
        PerGroup({"w": "missing"}, {"a": 1.0})
    with pytest.raises(InputValueError):
        PerGroup({"w": "a"}, {"a": -1.0})


def test_chain_threads_state_and_ignores_unknown_extras():
    def counter() -> Transform:
        def update(x, state, params=None, **extra):
            return x + 1, state + 1

        return Transform(lambda params: 0, update)

    t = chain(counter(), identity(), counter())
    out, state = t.update(0, t.init(None), None, some_unknown_flag=True)
    assert out == 2 and state[0] == 1 and state[2] == 1
    out, state = t.update(out, state)
    assert out == 4 and state == (2, state[1], 2)


def test_named_chain_states_by_name():
    t = named_chain(("double", stateless(lambda x, params=None: 2 * x)), ("id", identity()))
    out, state = t.update(3, t.init(None))
    assert out == 6 and list(state) == ["double", "id"]
    with pytest.raises(InputValueError):
        named_chain(("a", identity()), ("a", identity()))
    with pytest.raises(InputValueError):
        t.update(3, {"wrong": None})


def test_chain_rejects_non_transforms_and_wrong_state():
    with pytest.raises(InputTypeError):
        chain(identity(), lambda x: x)  # type: ignore[arg-type]
    with pytest.raises(InputValueError):
        chain(identity()).update(1, ())


def test_apply_updates_is_pure_and_unwraps():
    params = (torch.ones(2),)
    new = apply_updates(params, NoisedPytree((torch.full((2,), 0.5),), 1.0, noise_stddev=0.0))
    assert torch.equal(params[0], torch.ones(2))
    assert torch.equal(new[0], torch.full((2,), 1.5))
    assert unwrap(3) == 3


def test_clipped_pytree_to_refuses_a_rounding_cast_but_not_a_widening_one():
    import torch

    from opake_fx.errors import InputValueError
    from opake_fx.types import ClippedPytree, NoisedPytree

    g = ClippedPytree({"w": torch.ones(3), "b": torch.ones(1, dtype=torch.bfloat16)}, max_norm=0.25)
    wide = g.to(torch.float64)
    assert wide.max_norm == 0.25 and all(t.dtype == torch.float64 for t in wide.pytree.values())
    assert g.to("cpu").max_norm == 0.25
    for narrow in (torch.bfloat16, torch.float16, torch.int32):
        with pytest.raises(InputValueError, match="round the clipped sum"):
            g.to(narrow)
    half = ClippedPytree((torch.ones(2, dtype=torch.float16),), max_norm=1.0)
    with pytest.raises(InputValueError):
        half.to(torch.bfloat16)  # neither holds the other's values
    noised = NoisedPytree((torch.ones(2),), max_norm=0.25, noise_stddev=1.0)
    out = noised.to(torch.bfloat16)  # post-processing
    assert out.pytree[0].dtype == torch.bfloat16 and out.noise_stddev == 1.0


@given(tree=pytrees(max_leaves=5, nested=True), seed=st.integers(0, 2**16))
def test_map_with_path_applies_each_leaf_its_own_map_and_scales_max_norm_by_the_declared_max(tree, seed):
    paths, leaves, _ = pt.tree_flatten_with_paths(tree)
    gen = torch.Generator().manual_seed(seed)
    scales = {p: float(torch.empty(()).uniform_(-3, 3, generator=gen)) or 1.0 for p in paths}
    bound = max(abs(v) for v in scales.values())
    g = ClippedPytree(tree, max_norm=0.5)
    out = g.map_with_path(lambda path, x: scales[path] * x, lipschitz=bound)
    assert type(out) is ClippedPytree and out.max_norm == pytest.approx(0.5 * bound)
    out_paths, out_leaves, _ = pt.tree_flatten_with_paths(out.pytree)
    assert out_paths == paths
    for p, before, after in zip(paths, leaves, out_leaves):
        assert torch.equal(after, scales[p] * before)
    # the declared bound holds for this map: ||F(x) - F(y)|| <= bound * ||x - y|| for a neighbour y,
    # checked in float64 (float32 rounding of leaves near 200 moved a difference by 2e-5 relative:
    # the arithmetic's, not the map's)
    wide = pt.tree_map(lambda x: x.double(), tree)
    other = pt.tree_map(lambda x: x + torch.randn(x.shape, generator=gen, dtype=torch.float64), wide)
    moved = ClippedPytree(wide, max_norm=0.5).map_with_path(lambda path, x: scales[path] * x, lipschitz=bound)
    moved_other = ClippedPytree(other, max_norm=0.5).map_with_path(lambda path, x: scales[path] * x, lipschitz=bound)
    dist = float(pt.global_norm(pt.sub(moved.pytree, moved_other.pytree)))
    assert dist <= bound * float(pt.global_norm(pt.sub(wide, other))) * (1 + 1e-12) + 1e-12


def test_map_with_path_on_clipped_needs_a_bound_and_on_noised_is_post_processing():
    g = ClippedPytree({"w": torch.ones(2), "b": torch.ones(1)}, max_norm=0.5)
    for bad in (0.0, -1.0, math.inf, math.nan, True):
        with pytest.raises(InputValueError, match="map_with_path needs lipschitz"):
            g.map_with_path(lambda path, x: x, lipschitz=bad)
    with pytest.raises(TypeError):
        g.map_with_path(lambda path, x: x)  # no bound: a ClippedPytree cannot be mapped freely
    pg = ClippedPytree({"w": torch.ones(2)}, max_norm=PerGroup({"w": "all"}, {"all": 2.0}))
    assert pg.map_with_path(lambda path, x: 3 * x, lipschitz=3.0).max_norm.values["all"] == 6.0
    n = NoisedPytree({"w": torch.ones(2), "b": torch.ones(1)}, max_norm=0.5, noise_stddev=1.0)
    free = n.map_with_path(lambda path, x: x.clamp(max=0.5) if path == ("b",) else 4 * x)
    assert type(free) is NoisedPytree and free.noise_stddev is None and free.max_norm == math.inf
    assert free.pytree["w"].tolist() == [4.0, 4.0] and free.pytree["b"].tolist() == [0.5]
    bounded = n.map_with_path(lambda path, x: 4 * x, lipschitz=4.0)
    assert type(bounded) is NoisedPytree and bounded.max_norm == 2.0 and bounded.noise_stddev is None
