"""Values that carry a guarantee validate themselves and lose it under any undeclared map."""

from __future__ import annotations

import math

import optree
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from opake_fx import pytree as pt
from opake_fx.dpftrl import band_mf_strategy
from opake_fx.dpftrl.noise import mf_gaussian_noise
from opake_fx.dpsgd.noise import gaussian_noise, noise
from opake_fx.errors import InputTypeError, InputValueError, NoiseInputError, OpakeError
from opake_fx.random import key
from opake_fx.testing import pytrees
from opake_fx.types import ClippedPytree, NoisedPytree, PerGroup, SecondMomentClippingOutput


def _clipped(max_norm=0.5):
    return ClippedPytree({"w": torch.ones(3), "b": torch.zeros(2)}, max_norm=max_norm)


@pytest.mark.parametrize(
    "generic_map",
    [
        lambda g: pt.tree_map(lambda x: 10 * x, g),
        lambda g: pt.scale(g, 10.0),
        lambda g: pt.add(g, g),
        lambda g: pt.cast(g, torch.float64),
        lambda g: optree.tree_map(lambda x: 10 * x, g, namespace=pt.NAMESPACE),
    ],
    ids=["tree_map", "scale", "add", "cast", "optree.tree_map"],
)
def test_a_generically_mapped_clipped_gradient_is_refused_by_the_noise_stages(generic_map):
    scaled = generic_map(_clipped())
    assert not isinstance(scaled, ClippedPytree)
    noise_fn, state = gaussian_noise(noise_multiplier=1.0, key=key(0))
    with pytest.raises(NoiseInputError, match="Clip first"):
        noise_fn(scaled, state)
    stage = noise(noise_multiplier=1.0, key=key(0))
    with pytest.raises(NoiseInputError):
        stage.update(scaled, stage.init(None))
    mf_fn, mf_state = mf_gaussian_noise(band_mf_strategy(4, 2, max_iterations=5), noise_multiplier=1.0, key=key(0))
    with pytest.raises(NoiseInputError):
        mf_fn(scaled, mf_state)


def test_a_declared_lipschitz_map_scales_max_norm_and_the_noise_follows():
    g = _clipped(0.5)
    mapped = g.map(lambda x: 10 * x, lipschitz=10.0)
    assert isinstance(mapped, ClippedPytree) and mapped.max_norm == 5.0
    assert mapped.pytree["w"].tolist() == [10.0, 10.0, 10.0]
    noise_fn, state = gaussian_noise(noise_multiplier=2.0, key=key(0))
    out, _ = noise_fn(mapped, state)
    assert out.noise_stddev == pytest.approx(10.0)  # 2 * 10 * 0.5: ten times the unscaled noise
    # The realised noise is as large as stated (a 2000-coordinate sample of N(0, 10^2)).
    big = ClippedPytree({"w": torch.zeros(2000, dtype=torch.float64)}, max_norm=0.5).map(lambda x: 10 * x, lipschitz=10.0)
    drawn, _ = noise_fn(big, state)
    assert float(drawn.pytree["w"].std()) == pytest.approx(10.0, rel=0.1)


def test_lipschitz_map_of_per_group_max_norm_and_of_a_noised_value():
    pg = PerGroup({"w": "a", "b": "c"}, {"a": 3.0, "c": 4.0})
    g = ClippedPytree({"w": torch.ones(1), "b": torch.ones(1)}, max_norm=pg)
    out = g.map(torch.tanh, lipschitz=2.0)
    assert isinstance(out.max_norm, PerGroup) and out.max_norm.values == {"a": 6.0, "c": 8.0}
    n = NoisedPytree({"w": torch.ones(2)}, max_norm=0.5, noise_stddev=1.5)
    m = n.map(lambda x: x.clamp(max=0.2), lipschitz=1.0)
    assert isinstance(m, NoisedPytree) and m.max_norm == 0.5 and m.noise_stddev is None
    assert (n * 2).noise_stddev == 3.0  # an exact scale keeps an exact stddev


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf, "2", True, None])
def test_map_needs_a_finite_positive_lipschitz_bound(bad):
    with pytest.raises(InputValueError, match="lipschitz"):
        _clipped().map(torch.neg, lipschitz=bad)


@given(tree=pytrees(max_leaves=5), factor=st.floats(-1e6, 1e6, allow_nan=False))
def test_no_generic_map_returns_a_wrapper(tree, factor):
    wrapped = [ClippedPytree(tree, max_norm=1.0), NoisedPytree(tree, max_norm=1.0, noise_stddev=0.5)]
    out = pt.tree_map(lambda x: x * factor, wrapped)
    leaves_out = optree.tree_leaves(out, is_leaf=lambda x: isinstance(x, ClippedPytree), namespace=pt.NAMESPACE)
    assert not any(isinstance(x, ClippedPytree) for x in leaves_out)


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        (-1.0, InputValueError, "negative"),
        (math.nan, InputValueError, "NaN"),
        (0.0, InputValueError, "max_norm=0"),
        (0, InputValueError, "max_norm=0"),
        (torch.tensor(0.5), InputTypeError, "tensor"),
        (torch.ones(2), InputTypeError, "tensor"),
        ("0.5", InputTypeError, "real number"),
        (True, InputTypeError, "real number"),
        (None, InputTypeError, "real number"),
        ([0.5], InputTypeError, "real number"),
    ],
)
def test_max_norm_is_validated_at_construction(bad, error, match):
    for cls in (ClippedPytree, NoisedPytree):
        with pytest.raises(error, match=match) as info:
            cls({"w": torch.ones(1)}, max_norm=bad)
        assert isinstance(info.value, OpakeError)


def test_valid_max_norms_and_their_normal_form():
    import numpy as np

    assert ClippedPytree((torch.ones(1),), max_norm=2).max_norm == 2.0
    assert type(ClippedPytree((torch.ones(1),), max_norm=np.float32(0.5)).max_norm) is float
    assert ClippedPytree((torch.ones(1),), max_norm=math.inf).sensitivity == math.inf  # "not clipped"
    with pytest.raises(InputValueError, match="all 0"):
        ClippedPytree((torch.ones(1),), max_norm=PerGroup({(0,): "a"}, {"a": 0.0}))
    with pytest.raises(InputValueError, match="sensitivity 0"):
        _clipped() * 0
    with pytest.raises(InputValueError, match="divided by zero"):
        _clipped() / 0


@pytest.mark.parametrize(
    ("bad", "error"),
    [(-0.1, InputValueError), (math.nan, InputValueError), (math.inf, InputValueError),
     (torch.tensor(1.0), InputTypeError), ("1", InputTypeError)],
)
def test_noise_stddev_is_validated_at_construction(bad, error):
    with pytest.raises(error, match="noise_stddev"):
        NoisedPytree({"w": torch.ones(1)}, max_norm=1.0, noise_stddev=bad)


def test_zero_noise_stddev_is_the_baseline_and_none_is_unknown():
    assert NoisedPytree((torch.ones(1),), max_norm=1.0, noise_stddev=0).noise_stddev == 0.0
    assert NoisedPytree((torch.ones(1),), max_norm=1.0).noise_stddev is None


def test_second_moment_pairs_need_wrapped_streams():
    g = _clipped()
    with pytest.raises(InputTypeError, match="squared_grads"):
        SecondMomentClippingOutput(g, {"w": torch.ones(1)})
