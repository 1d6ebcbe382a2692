"""The Gaussian mechanism's one home (opake_fx._gaussian): the keyed draws both mechanisms use,
in place or prefetched, and the one check of a noise call."""

from __future__ import annotations

import pytest
import torch

from opake_fx._noise_input import check_noise_call
from opake_fx._noise_prefetch import NoisePrefetcher
from opake_fx.dpftrl.noise import MfNoiseState, mf_gaussian_noise
from opake_fx.dpftrl import identity_strategy
from opake_fx.dpsgd.noise import GaussianNoiseState, gaussian_noise
from opake_fx.errors import InputTypeError, InputValueError, NoiseInputError
from opake_fx._gaussian import add_gaussian_noise, noised_tree, step_normals
from opake_fx.random import fold_in, key
from opake_fx.types import ClippedPytree, PerGroup, SecondMomentClippingOutput

LEAVES = [torch.zeros(3, 2), torch.zeros(4, dtype=torch.float64)]


@pytest.mark.parametrize("exact", [False, True])
def test_step_normals_are_the_rows_the_release_adds(exact: bool) -> None:
    # DP-FTRL's correlated rows and DP-SGD's release come from the same draw of step t.
    rows = step_normals(key(5), 2, LEAVES, exact=exact)
    released = add_gaussian_noise(LEAVES, fold_in(key(5), 2), 1.0, exact=exact)
    assert all(torch.equal(r, z) for r, z in zip(rows, released))


def test_noised_tree_is_the_same_prefetched_or_in_place_also_per_group() -> None:
    tree = {"a": torch.ones(300, 200), "b": torch.ones(5)}
    groups = PerGroup({"a": "g1", "b": "g2"}, {"g1": 0.5, "g2": 2.0})
    for std in (0.7, groups):
        pf = NoisePrefetcher(enabled=True)
        for step in range(3):
            ahead = noised_tree(tree, key(1), step, std, prefetcher=pf)
            now = noised_tree(tree, key(1), step, std)
            assert all(torch.equal(ahead[k], now[k]) for k in tree)
        pf.discard()
    assert pf.hits >= 1


def test_the_identity_strategy_and_dp_sgd_release_the_same_pair() -> None:
    # Both mechanisms split a second-moment pair and draw both streams in the one home.
    pair = SecondMomentClippingOutput(ClippedPytree((torch.zeros(4),), max_norm=0.5),
                                      ClippedPytree((torch.zeros(4),), max_norm=0.25))
    sgd_fn, sgd_state = gaussian_noise(noise_multiplier=1.0, key=key(9))
    mf_fn, mf_state = mf_gaussian_noise(identity_strategy(3), noise_multiplier=1.0, key=key(9))
    for _ in range(3):
        a, sgd_state = sgd_fn(pair, sgd_state)
        b, mf_state = mf_fn(pair, mf_state)
        for x, y in ((a.noisy_grads, b.noisy_grads), (a.noisy_squared_grads, b.noisy_squared_grads)):
            assert torch.equal(x.pytree[0], y.pytree[0]) and x.noise_stddev == y.noise_stddev


@pytest.mark.parametrize("state_type, mechanism", [(GaussianNoiseState, "gaussian_noise"), (MfNoiseState, "mf_gaussian_noise")])
def test_one_check_of_a_noise_call_for_both_mechanisms(state_type: type, mechanism: str) -> None:
    good = ClippedPytree((torch.zeros(2),), max_norm=1.0)
    state = state_type(key(0))
    assert check_noise_call(good, state, state_type, 1.0, mechanism=mechanism) is False
    pair = SecondMomentClippingOutput(good, good)
    assert check_noise_call(pair, state, state_type, 1.0, mechanism=mechanism) is True
    with pytest.raises(InputTypeError, match=f"noise_fn needs the {state_type.__name__} it returned; got int"):
        check_noise_call(good, 3, state_type, 1.0, mechanism=mechanism)
    with pytest.raises(NoiseInputError, match=f"{mechanism} expects a ClippedPytree"):
        check_noise_call((torch.zeros(2),), state, state_type, 1.0, mechanism=mechanism)
    grouped = ClippedPytree({"a": torch.zeros(2)}, max_norm=PerGroup({"a": "g"}, {"g": 1.0}))
    with pytest.raises(InputValueError, match="second-moment pair needs a scalar max_norm"):
        check_noise_call(SecondMomentClippingOutput(grouped, good), state, state_type, 1.0, mechanism=mechanism)
