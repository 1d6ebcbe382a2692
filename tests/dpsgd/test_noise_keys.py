"""Noise keys are never reused: steps past 2**32 get fresh keys, negative steps are refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from opake_fx.dpftrl import identity_strategy
from opake_fx.dpftrl.noise import MfNoiseState, mf_gaussian_noise
from opake_fx.dpsgd.noise import GaussianNoiseState, gaussian_noise
from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.random import fold_in, key, split, wrap_key_data
from opake_fx.types import ClippedPytree


def _noise_at(step: int, *, exact: bool) -> torch.Tensor:
    fn, _ = gaussian_noise(noise_multiplier=1.0, key=key(5), exact=exact)
    out, state = fn(ClippedPytree((torch.zeros(64, dtype=torch.float64),), max_norm=1.0), GaussianNoiseState(key(5), step))
    assert state.step == step + 1
    return out.pytree[0]


@pytest.mark.parametrize("exact", [False, True])
def test_steps_0_2pow32_and_2pow33_draw_distinct_noise(exact):
    draws = {s: _noise_at(s, exact=exact) for s in (0, 1, 2**32, 2**32 + 1, 2**33)}
    for a in draws:
        for b in draws:
            if a < b:
                assert not torch.equal(draws[a], draws[b]), (a, b)
    # ...and the same step redraws the same noise (reproducible resumption).
    assert torch.equal(_noise_at(2**33, exact=exact), draws[2**33])


def test_fold_in_keeps_jax_below_2pow32_and_folds_the_high_word_above():
    k = key(0)
    # Below 2**32: counter (0, data), i.e. jax.random.fold_in and split(k, n)[data].
    assert fold_in(k, 7) == split(k, 8)[7]
    assert fold_in(k, 2**32 - 1) != fold_in(k, 2**32)
    keys = {fold_in(k, d) for d in (0, 1, 2**32, 2**32 + 1, 2**33, 2**63, 2**64 - 1)}
    assert len(keys) == 7


@given(seed=st.integers(0, 2**32 - 1), data=st.integers(0, 2**63 - 1))
def test_fold_in_of_a_tensor_matches_the_rngkey_path_on_64_bits(seed, data):
    k = key(seed)
    assert wrap_key_data(fold_in(k.to_tensor(), torch.tensor(data))) == fold_in(k, data)


@pytest.mark.parametrize("bad", [-1, -(2**32), 2**64])
def test_fold_in_refuses_values_that_would_alias(bad):
    with pytest.raises(InputValueError, match=r"\[0, 2\*\*64\)"):
        fold_in(key(0), bad)


def test_fold_in_refuses_non_integers():
    with pytest.raises(InputTypeError):
        fold_in(key(0), torch.tensor(1.5))


@pytest.mark.parametrize("cls", [GaussianNoiseState, MfNoiseState])
def test_noise_states_refuse_negative_or_non_integer_steps(cls):
    with pytest.raises(InputValueError, match="step must be in"):
        cls(key(0), step=-1)
    with pytest.raises(InputValueError):
        cls(key(0), step=2**64)
    with pytest.raises(InputTypeError, match="int"):
        cls(key(0), step=1.0)
    with pytest.raises(InputTypeError, match="RngKey"):
        cls(42, step=0)
    assert cls(key(0), step=torch.tensor(3)).step == 3  # a restored 0-dim counter


def test_mf_noise_state_with_a_negative_step_cannot_reach_the_noise():
    fn, state = mf_gaussian_noise(identity_strategy(4), noise_multiplier=1.0, key=key(0))
    with pytest.raises(InputValueError):
        fn(ClippedPytree((torch.zeros(2),), max_norm=1.0), MfNoiseState(state.key, -1))


def test_one_key_check_for_every_gaussian_mechanism() -> None:
    # DP-SGD's and DP-FTRL's noise states share one key check (and its message).
    from opake_fx._noise_input import check_noise_key
    from opake_fx.dpftrl.noise import MfNoiseState
    from opake_fx.dpsgd.noise import GaussianNoiseState

    with pytest.raises(InputTypeError, match="mf_gaussian_noise's key must be an RngKey .* got int"):
        check_noise_key(7, "mf_gaussian_noise's key")
    for state in (GaussianNoiseState, MfNoiseState):
        with pytest.raises(InputTypeError, match=f"{state.__name__}.key must be an RngKey"):
            state(key=7, step=0)  # type: ignore[arg-type]
