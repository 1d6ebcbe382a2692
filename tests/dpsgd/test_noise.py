"""gaussian_noise: calibration (KS), keying, per-group allocation, refusals."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from opake_fx.dpsgd.noise import GaussianNoiseState, gaussian_noise, noise, noise_stddev_for
from opake_fx.errors import InputTypeError, InputValueError, NoiseInputError
from opake_fx.random import key
from opake_fx.types import ClippedPytree, NoisedPytree, PerGroup

N = 20_000


def _noise_sample(nm: float, max_norm: float, k: int = 0) -> torch.Tensor:
    fn, s = gaussian_noise(noise_multiplier=nm, key=key(k))
    out, _ = fn(ClippedPytree({"w": torch.zeros(N, dtype=torch.float64)}, max_norm=max_norm), s)
    return out.pytree["w"]


def test_noise_std_passes_ks_at_true_sigma_and_fails_off_by_a_third():
    sigma = 1.3 * 0.5
    x = _noise_sample(1.3, 0.5).numpy()
    # With N = 20000 the KS test detects a 1.5x or 2/3x scale error with overwhelming power;
    # a fixed key makes the p-values deterministic.
    assert stats.kstest(x, "norm", args=(0, sigma)).pvalue > 1e-3
    assert stats.kstest(x, "norm", args=(0, sigma * 2 / 3)).pvalue < 1e-6
    assert stats.kstest(x, "norm", args=(0, sigma * 3 / 2)).pvalue < 1e-6


def test_noise_is_keyed_per_step_and_reproducible():
    fn, s0 = gaussian_noise(noise_multiplier=1.0, key=key(3))
    g = ClippedPytree((torch.zeros(5),), max_norm=1.0)
    a, s1 = fn(g, s0)
    b, s2 = fn(g, s1)
    a_again, _ = fn(g, s0)
    assert s2.step == 2 and s2.key == key(3)
    assert torch.equal(a.pytree[0], a_again.pytree[0])
    assert not torch.equal(a.pytree[0], b.pytree[0])


def test_exact_mode_uses_threefry_normals():
    from opake_fx.random import fold_in, normal, split

    fn, s = gaussian_noise(noise_multiplier=2.0, key=key(1), exact=True)
    out, _ = fn(ClippedPytree((torch.zeros(4),), max_norm=0.5), s)
    (leaf_key,) = split(fold_in(key(1), 0), 1)
    torch.testing.assert_close(out.pytree[0], 1.0 * normal(leaf_key, (4,), exact=True))


def test_zero_noise_multiplier_adds_nothing_even_with_infinite_norm():
    fn, s = gaussian_noise(noise_multiplier=0.0, key=key(0))
    g = ClippedPytree((torch.ones(3),), max_norm=float("inf"))
    out, s = fn(g, s)
    assert isinstance(out, NoisedPytree) and torch.equal(out.pytree[0], torch.ones(3))
    assert out.noise_stddev == 0.0 and s.step == 1


def test_refuses_raw_gradients_and_double_noise():
    fn, s = gaussian_noise(noise_multiplier=1.0, key=key(0))
    with pytest.raises(NoiseInputError, match="Clip first"):
        fn((torch.ones(2),), s)
    noised = NoisedPytree((torch.ones(2),), max_norm=1.0, noise_stddev=1.0)
    with pytest.raises(NoiseInputError, match="already noised"):
        fn(noised, s)
    with pytest.raises(NoiseInputError, match="unbounded"):
        fn(ClippedPytree((torch.ones(2),), max_norm=float("inf")), s)
    with pytest.raises(InputTypeError):
        fn(ClippedPytree((torch.ones(2),), max_norm=1.0), GaussianNoiseState.__new__(object))  # type: ignore[arg-type]


@pytest.mark.parametrize("nm", [-1.0, float("nan"), float("inf")])
def test_bad_noise_multiplier(nm):
    with pytest.raises(InputValueError):
        gaussian_noise(noise_multiplier=nm, key=key(0))


def test_int_seed_instead_of_key_is_refused():
    with pytest.raises(InputTypeError, match=r"parameter key=42 .*opake_fx\.random\.key\(seed\)"):
        gaussian_noise(noise_multiplier=1.0, key=42)  # type: ignore[arg-type]


def test_unknown_allocation_is_a_value_error():
    with pytest.raises(InputValueError, match=r"allocation must be 'optimal' or 'isotropic'; got 'even'"):
        gaussian_noise(noise_multiplier=1.0, key=key(0), allocation="even")
    with pytest.raises(InputValueError, match="allocation"):
        noise_stddev_for(1.0, 1.0, "even")


def test_per_group_allocation_costs_the_same_privacy():
    pg = PerGroup({"w": "a", "b": "b"}, {"a": 1.0, "b": 0.1})
    z = 1.7
    opt = noise_stddev_for(pg, z, "optimal")
    iso = noise_stddev_for(pg, z, "isotropic")
    assert iso == pytest.approx(z * pg.effective)
    # Mahalanobis sensitivity sum_g C_g^2 / sigma_g^2 equals 1 / z^2 for both allocations.
    assert sum(pg.values[g] ** 2 / opt.values[g] ** 2 for g in pg.values) == pytest.approx(z**-2)
    assert sum(c**2 / iso**2 for c in pg.values.values()) == pytest.approx(z**-2)


def test_per_group_noise_is_applied_per_leaf():
    pg = PerGroup({"w": "a", "b": "b"}, {"a": 1.0, "b": 0.01})
    fn, s = gaussian_noise(noise_multiplier=1.0, key=key(0))
    g = ClippedPytree({"w": torch.zeros(N, dtype=torch.float64), "b": torch.zeros(N, dtype=torch.float64)}, max_norm=pg)
    out, _ = fn(g, s)
    total = 1.01
    assert float(out.pytree["w"].std()) == pytest.approx(math.sqrt(1.0 * total), rel=0.03)
    assert float(out.pytree["b"].std()) == pytest.approx(math.sqrt(0.01 * total), rel=0.03)
    assert isinstance(out.noise_stddev, PerGroup)


def test_noise_stage_matches_function():
    stage = noise(noise_multiplier=1.0, key=key(9))
    fn, s = gaussian_noise(noise_multiplier=1.0, key=key(9))
    g = ClippedPytree((torch.zeros(3),), max_norm=1.0)
    a, st = stage.update(g, stage.init(None))
    b, _ = fn(g, s)
    assert torch.equal(a.pytree[0], b.pytree[0]) and st.step == 1
