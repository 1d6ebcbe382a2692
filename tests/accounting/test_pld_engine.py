"""The PLD engine's numerics: discretisation, composition, queries, caching, coarsening."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting import NeighboringRelation
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import special

import opake_fx.accounting as acc
import opake_fx.dpsgd.accounting as dpsgd_acc
from opake_fx.accounting import _curves, _pmf, pld

MECHANISMS = [
    dpsgd_acc.gaussian(0.7),
    dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), 0.01),
    dpsgd_acc.poisson(dpsgd_acc.gaussian(0.5), 0.3),
    dpsgd_acc.laplace(0.8),
    dpsgd_acc.poisson(dpsgd_acc.laplace(1.5), 0.05),
    acc.eps_delta(0.7, 1e-6),
    dpsgd_acc.truncated_poisson(dpsgd_acc.gaussian(1.0), 0.02, 5_000, 110),
    dpsgd_acc.sampled_without_replacement(dpsgd_acc.gaussian(2.0), 1000, 20),
]


@pytest.mark.parametrize("mechanism", MECHANISMS, ids=repr)
def test_connect_the_dots_reproduces_the_curve_at_grid_points(mechanism):
    d = 1e-3
    directions = mechanism._directions()
    pmfs = pld._single(mechanism, d)
    for direction, pmf in zip(directions, pmfs):
        assert pmf is not None
        assert pmf.probs.min() >= 0
        # rounding noise in second differences is clipped at 0: mass is never lost
        assert 1.0 - 1e-12 <= pmf.probs.sum() + pmf.inf <= 1.0 + 1e-9
        losses = pmf.losses()
        exact = direction.fn(losses)
        _, grid_deltas = pmf.tails()
        big = exact > 1e-12
        np.testing.assert_allclose(grid_deltas[big], exact[big], rtol=1e-9)
        # between grid points the discrete curve interpolates from above (pessimistic)
        mids = losses[:-1][big[:-1]] + d / 2
        for eps in mids[:: max(1, mids.size // 50)]:
            assert pmf.delta_at(eps) >= float(direction.fn(np.array([eps]))[0]) * (1 - 1e-9)


def test_excess_split_keeps_small_tail_masses():
    """The 'add' pair of a subsampled Gaussian has losses far below 0 with tiny masses."""
    step = dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), 0.0064)
    _, add = pld._single(step, 1e-4)
    assert add.probs.sum() + add.inf == pytest.approx(1.0, abs=1e-13)


def test_composition_matches_direct_convolution():
    step = dpsgd_acc.poisson(dpsgd_acc.laplace(1.0), 0.2)
    remove, add = pld._single(step, 1e-2)
    for pmf in (remove, add):
        direct = pmf.probs
        for _ in range(4):
            direct = np.convolve(direct, pmf.probs)
        composed = pld._compose([(pmf, 5)])
        assert composed.lo == 5 * pmf.lo
        np.testing.assert_allclose(composed.probs, direct, atol=1e-12)


def test_windowed_composition_agrees_with_full_convolution(monkeypatch):
    step = dpsgd_acc.poisson(dpsgd_acc.gaussian(0.8), 0.05)
    pmf, _ = pld._single(step, 1e-3)
    monkeypatch.setattr(pld, "_FULL_CONV_LIMIT", 2**23)
    full = pld._compose([(pmf, 200)])
    assert full.size == 200 * (pmf.size - 1) + 1
    monkeypatch.setattr(pld, "_FULL_CONV_LIMIT", 1000)
    windowed = pld._compose([(pmf, 200)])
    assert windowed.size < full.size
    for eps in (0.0, 1.0, 3.0, 5.0):
        assert windowed.delta_at(eps) == pytest.approx(full.delta_at(eps), rel=1e-6, abs=1e-13)


def test_heterogeneous_composition_is_one_fft_product():
    a = dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), 0.01)
    b = dpsgd_acc.poisson(dpsgd_acc.gaussian(0.7), 0.02)
    ra, _ = pld._single(a, 1e-3)
    rb, _ = pld._single(b, 1e-3)
    both = pld._compose([(ra, 30), (rb, 20)])
    staged = pld._compose([(pld._compose([(ra, 30)]), 1), (pld._compose([(rb, 20)]), 1)])
    for eps in (0.0, 0.5, 1.5):
        assert both.delta_at(eps) == pytest.approx(staged.delta_at(eps), rel=1e-7, abs=1e-13)


@pytest.mark.parametrize("process", [dpsgd_acc.poisson(dpsgd_acc.gaussian(0.9), 0.02) * 300, acc.eps_delta(1.0, 1e-7) * 4 | dpsgd_acc.laplace(3.0) * 5])
def test_epsilon_and_delta_are_inverse(process):
    pld_ = process.pld()
    for delta in (1e-2, 1e-4, 1e-6):
        eps = pld_.epsilon_at(delta)
        assert pld_.delta_at(eps) <= delta * (1 + 1e-9)
        assert pld_.delta_at(max(0.0, eps - 1e-6)) >= delta * (1 - 1e-9) or eps == 0.0


def test_gaussian_trade_off_and_advantage():
    sigma, steps = 1.5, 9
    mu = math.sqrt(steps) / sigma
    process = dpsgd_acc.gaussian(sigma) * steps
    pld_ = process.pld()
    assert process.advantage() == pytest.approx(2 * special.ndtr(mu / 2) - 1, rel=1e-12)
    assert pld_.advantage() == pytest.approx(2 * special.ndtr(mu / 2) - 1, rel=1e-6)
    for alpha in (1e-4, 0.01, 0.1, 0.5, 0.9):
        exact = special.ndtr(special.ndtri(1 - alpha) - mu)
        assert process.beta_at(alpha) == pytest.approx(exact, rel=1e-12)
        assert pld_.beta_at(alpha) <= exact + 1e-12  # pessimistic: never more private
        assert pld_.beta_at(alpha) == pytest.approx(exact, abs=2e-4)
    assert pld_.beta_at(0.0) == pytest.approx(1.0)
    assert pld_.beta_at(1.0) == 0.0


def test_subsampled_trade_off_is_a_trade_off_curve():
    process = dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), 0.01) * 1000
    alphas = np.linspace(0.0, 1.0, 21)
    betas = [process.beta_at(a) for a in alphas]
    assert all(b1 >= b2 - 1e-12 for b1, b2 in zip(betas, betas[1:]))  # non-increasing
    assert all(b <= 1 - a + 1e-12 for a, b in zip(alphas, betas))  # below the perfect-privacy line
    assert 0 < process.advantage() < 1


def test_coarsening_keeps_results_pessimistic(monkeypatch):
    monkeypatch.setattr(_pmf, "MAX_GRID", 2**14)
    acc.clear_caches()
    try:
        process = dpsgd_acc.gaussian(1.0) * 50
        coarse = process.pld()
        assert coarse.discretization > 1e-4
        exact = _curves.gaussian_epsilon(math.sqrt(50), 1e-5)
        assert exact <= coarse.epsilon_at(1e-5) <= exact + 10 * coarse.discretization
    finally:
        acc.clear_caches()


def test_single_step_pld_is_cached():
    acc.clear_caches()
    sigma = 1.2345
    before = pld._single.cache_info()
    for steps in (10, 20, 30):
        (dpsgd_acc.poisson(dpsgd_acc.gaussian(sigma), 0.01) * steps).epsilon_at(1e-5)
    after = pld._single.cache_info()
    assert after.misses - before.misses == 1
    assert after.hits - before.hits == 2
    process = dpsgd_acc.poisson(dpsgd_acc.gaussian(sigma), 0.01) * 10
    assert process.pld() is process.pld()


def test_truncated_poisson_reduces_to_poisson_without_truncation():
    g = dpsgd_acc.gaussian(1.0)
    never = dpsgd_acc.truncated_poisson(g, 0.01, dataset_size=1000, max_batch_size=1000)
    assert never.truncation_probability == 0.0
    plain = dpsgd_acc.poisson(g, 0.01)
    assert (never * 50).epsilon_at(1e-5) == pytest.approx((plain * 50).epsilon_at(1e-5), rel=1e-12)
    assert (never * 50).epsilon_at(1e-5, accountant="rdp") == pytest.approx((plain * 50).epsilon_at(1e-5, accountant="rdp"))
    eps = [(dpsgd_acc.truncated_poisson(g, 0.01, 10_000, cap) * 50).epsilon_at(1e-5) for cap in (95, 105, 120, 200)]
    assert eps == sorted(eps, reverse=True)  # a tighter cap costs more privacy
    assert eps[-1] == pytest.approx((plain * 50).epsilon_at(1e-5), rel=1e-6)


def test_sampling_without_replacement():
    g = dpsgd_acc.gaussian(2.0)
    full = dpsgd_acc.sampled_without_replacement(g, 500, 500)
    # the whole dataset each step: one Gaussian release with replace-one sensitivity 2C
    assert (full * 3).epsilon_at(1e-5) == pytest.approx(dpsgd_acc.gaussian(1.0 / math.sqrt(3)).epsilon_at(1e-5), rel=1e-12)
    eps = [(dpsgd_acc.sampled_without_replacement(g, 1000, b) * 100).epsilon_at(1e-5) for b in (5, 10, 50, 200)]
    assert eps == sorted(eps)
    # tighter than dp_accounting's RDP bound for the same mechanism (its noise multiplier
    # is relative to the replace-one sensitivity 2C, i.e. half of ours)
    oracle = rdp_privacy_accountant.RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)
    oracle.compose(dp_accounting.SampledWithoutReplacementDpEvent(1000, 10, dp_accounting.GaussianDpEvent(1.0)), 100)
    ours = (dpsgd_acc.sampled_without_replacement(g, 1000, 10) * 100).epsilon_at(1e-5)
    assert 0.2 * oracle.get_epsilon(1e-5) < ours <= oracle.get_epsilon(1e-5)


def test_eps_delta_alone_is_its_own_guarantee():
    p = acc.eps_delta(1.0, 1e-6)
    assert p.delta_at(1.0) == pytest.approx(1e-6, rel=1e-6)
    assert p.epsilon_at(1e-6) == pytest.approx(1.0, abs=1e-3)
    assert p.epsilon_at(1e-7) == math.inf  # the delta part is unbounded loss
    two = p * 2
    assert two.epsilon_at(3e-6) <= 2.0 + 1e-3  # basic composition holds


def test_laplace_pure_dp():
    p = dpsgd_acc.laplace(0.5)  # 2-DP
    assert p.epsilon_at(1e-9) <= 2.0 + 1e-3
    assert p.delta_at(2.0 + 1e-3) <= 1e-12
