"""gaussian_noise(secure=True): the same calibration (KS) as the default path, a CSPRNG source,
outputs on a grid that does not depend on the unnoised value, per-group stds, the stage."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from opake_fx.dpsgd.noise import gaussian_noise, noise
from opake_fx.errors import InputValueError
from opake_fx.random import key
from opake_fx.secure_random import add_secure_gaussian, secure_normal, secure_uniform, snap_grid
from opake_fx.types import ClippedPytree, PerGroup

N = 20_000
# The secure draws are not keyed, so p-values are random: a correct sampler fails the
# "passes" check with probability 1e-6; a 1.5x or 2/3x scale error gives p ~ 1e-100.
P_PASS = 1e-6


def _secure_sample(nm: float, max_norm: float, dtype=torch.float64, x=None) -> torch.Tensor:
    fn, s = gaussian_noise(noise_multiplier=nm, key=key(0), secure=True)
    base = torch.zeros(N, dtype=dtype) if x is None else x
    out, _ = fn(ClippedPytree({"w": base}, max_norm=max_norm), s)
    return out.pytree["w"] - base


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_secure_noise_std_passes_ks_at_true_sigma_and_fails_off_by_a_third(dtype):
    sigma = 1.3 * 0.5
    x = _secure_sample(1.3, 0.5, dtype).double().numpy()
    assert stats.kstest(x, "norm", args=(0, sigma)).pvalue > P_PASS
    assert stats.kstest(x, "norm", args=(0, sigma * 2 / 3)).pvalue < 1e-6
    assert stats.kstest(x, "norm", args=(0, sigma * 3 / 2)).pvalue < 1e-6


def test_secure_normal_is_standard_normal_and_uniform_is_uniform():
    assert stats.kstest(secure_normal((N,)).numpy(), "norm").pvalue > P_PASS
    u = secure_uniform(N)
    assert u.dtype == torch.float64 and bool((u > 0).all() and (u <= 1).all())
    assert stats.kstest(u.numpy(), "uniform").pvalue > P_PASS
    assert bool(((u * 2.0**53) == torch.round(u * 2.0**53)).all())  # on the 2**-53 grid


def test_secure_draws_are_unpredictable_and_leave_the_torch_rng_alone():
    before = torch.random.get_rng_state()
    torch.manual_seed(0)
    a = secure_normal((64,))
    torch.manual_seed(0)
    b = secure_normal((64,))
    assert not torch.equal(a, b)
    torch.random.set_rng_state(before)
    fn, s = gaussian_noise(noise_multiplier=1.0, key=key(3), secure=True)
    g = ClippedPytree((torch.zeros(64),), max_norm=1.0)
    (o1, s1), (o2, _) = fn(g, s), fn(g, s)
    assert not torch.equal(o1.pytree[0], o2.pytree[0]) and s1.step == 1  # same key and step, fresh noise


def test_outputs_lie_on_a_grid_that_does_not_depend_on_the_unnoised_value():
    std = 0.65
    grid = snap_grid(std)
    assert grid == 2.0 ** (math.floor(math.log2(std)) - 30)
    for x in (torch.zeros(N, dtype=torch.float64), torch.full((N,), 0.1234567890123, dtype=torch.float64)):
        out = add_secure_gaussian([x], [std])[0]
        assert out.dtype == torch.float64
        assert bool((torch.remainder(out, grid) == 0).all())  # multiples of the grid whatever x is
    assert float(torch.remainder(torch.tensor(0.1234567890123, dtype=torch.float64), grid)) != 0.0  # x itself is off it


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_leaves_keep_their_dtype_and_scale(dtype):
    out = add_secure_gaussian([torch.zeros(N, dtype=dtype)], [2.0])[0]
    assert out.dtype == dtype and bool(torch.isfinite(out).all())
    assert float(out.double().std()) == pytest.approx(2.0, rel=0.03)


def test_per_group_secure_noise_is_applied_per_leaf():
    pg = PerGroup({"w": "a", "b": "b"}, {"a": 1.0, "b": 0.01})
    fn, s = gaussian_noise(noise_multiplier=1.0, key=key(0), secure=True)
    g = ClippedPytree({"w": torch.zeros(N, dtype=torch.float64), "b": torch.zeros(N, dtype=torch.float64)}, max_norm=pg)
    out, _ = fn(g, s)
    total = 1.01
    assert stats.kstest(out.pytree["w"].numpy(), "norm", args=(0, math.sqrt(1.0 * total))).pvalue > P_PASS
    assert stats.kstest(out.pytree["b"].numpy(), "norm", args=(0, math.sqrt(0.01 * total))).pvalue > P_PASS
    assert isinstance(out.noise_stddev, PerGroup)


def test_secure_stage_and_refusals():
    stage = noise(noise_multiplier=1.0, key=key(9), secure=True)
    out, st = stage.update(ClippedPytree((torch.zeros(3),), max_norm=1.0), stage.init(None))
    assert st.step == 1 and out.noise_stddev == 1.0 and not torch.equal(out.pytree[0], torch.zeros(3))
    with pytest.raises(InputValueError, match="exact=True"):
        gaussian_noise(noise_multiplier=1.0, key=key(0), secure=True, exact=True)
    with pytest.raises(InputValueError, match="one stddev per leaf"):
        add_secure_gaussian([torch.zeros(2)], [1.0, 2.0])
    zero = add_secure_gaussian([torch.ones(2)], [0.0])[0]
    assert zero.tolist() == [1.0, 1.0]
