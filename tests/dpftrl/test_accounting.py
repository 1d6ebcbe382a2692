"""DP-FTRL accounting: reductions vs DP-SGD and dp_accounting, prefix accounting, Monte Carlo."""

from __future__ import annotations

import math

import pytest

import opake_fx.accounting as acc
import opake_fx.dpsgd.accounting as dpsgd_acc
from opake_fx import dpftrl
from opake_fx.dpftrl import accounting as mf_acc
from opake_fx.errors import BudgetExceededError, InputTypeError, InputValueError
from opake_fx.random import key

dpa = pytest.importorskip("dp_accounting")


def _dp_accounting_epsilon(event, delta: float) -> float:
    a = dpa.pld.PLDAccountant()
    a.compose(event)
    return a.get_epsilon(delta)


# ------------------------------------------------------------ exact reductions


@pytest.mark.parametrize("nm,q,n", [(1.0, 0.01, 200), (0.7, 0.05, 64), (2.0, 0.2, 30)])
def test_bandmf_with_one_band_equals_dp_sgd_poisson_accounting(nm, q, n):
    strategy = dpftrl.band_mf_strategy(n, bands=1)
    dpsgd = (dpsgd_acc.poisson(dpsgd_acc.gaussian(nm), q) * n).epsilon_at(1e-5)
    for process in (mf_acc.poisson(nm, strategy, q), mf_acc.b_min_sep(nm, strategy, q, 1)):
        assert process.epsilon_at(1e-5) == pytest.approx(dpsgd, rel=1e-6)
    # the identity strategy through the same path
    assert mf_acc.poisson(nm, dpftrl.identity_strategy(n), q).epsilon_at(1e-5) == pytest.approx(dpsgd, rel=1e-6)


@pytest.mark.parametrize("n,bands,q,nm", [(128, 4, 0.05, 1.0), (96, 8, 0.1, 0.8), (60, 3, 0.3, 1.5)])
def test_cyclic_poisson_reduction_matches_dp_accounting_events(n, bands, q, nm):
    for structure in ("toeplitz", "column_normalized"):
        s = dpftrl.band_mf_strategy(n, bands, structure=structure, max_iterations=20)
        ours = mf_acc.poisson(nm, s, q, partitions=bands).epsilon_at(1e-5)
        event = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(nm)), math.ceil(n / bands))
        assert ours == pytest.approx(_dp_accounting_epsilon(event, 1e-5), rel=1e-6)


def test_cyclic_poisson_with_unnormalised_columns_uses_the_largest_column():
    s = dpftrl.bsr_strategy(40, 4)  # raw square-root coefficients: column norm ||c|| != 1
    nm = 1.2
    # the noise was scaled by nm * max column norm, each participation moves C x by <= that norm
    ours = mf_acc.poisson(nm, s, 0.1).epsilon_at(1e-6)
    event = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(nm)), 10)
    assert ours == pytest.approx(_dp_accounting_epsilon(event, 1e-6), rel=1e-6)
    # noise scaled by half the sensitivity: twice as little noise per unit of sensitivity
    half = mf_acc.poisson(nm, s, 0.1, noise_sensitivity=s.sensitivity() / 2).epsilon_at(1e-6)
    event = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(nm / 2)), 10)
    assert half == pytest.approx(_dp_accounting_epsilon(event, 1e-6), rel=1e-6)


def test_mf_gaussian_is_the_gaussian_mechanism_with_the_run_sensitivity():
    n, nm = 50, 8.0
    s = dpftrl.identity_strategy(n)
    # Every example in every step, noise calibrated per step: n unsampled Gaussian steps.
    run = mf_acc.mf_gaussian(nm, s, 1, None, noise_sensitivity=1.0)
    assert run.epsilon_at(1e-5) == pytest.approx((dpsgd_acc.gaussian(nm) * n).epsilon_at(1e-5), rel=1e-9)
    event = dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(nm), n)
    assert run.epsilon_at(1e-5) == pytest.approx(_dp_accounting_epsilon(event, 1e-5), rel=1e-3)
    # Noise calibrated for the same pattern: exactly gaussian(nm).
    band = dpftrl.band_mf_strategy(n, 5, max_iterations=10)
    assert mf_acc.mf_gaussian(nm, band, 5, None) == dpsgd_acc.gaussian(nm)
    dense = dpftrl.dense_strategy(20, epochs=4, max_iterations=20)
    assert mf_acc.mf_gaussian(nm, dense, epochs=4) == dpsgd_acc.gaussian(nm)


# ------------------------------------------------------------ prefix accounting


def test_prefix_steps_compose_to_the_whole_run():
    s = dpftrl.band_mf_strategy(24, 4, max_iterations=10)
    for b, k in [(1, 1), (4, None), (2, 3)]:
        steps = mf_acc.mf_gaussian_steps(3.0, s, b, k)
        assert len(steps) == 24
        whole = mf_acc.mf_gaussian(3.0, s, b, k)
        assert acc.compose(*steps).epsilon_at(1e-5) == pytest.approx(whole.epsilon_at(1e-5), rel=1e-9)
        eps = mf_acc.prefix_epsilons(steps, 1e-5)
        assert all(a <= b_ + 1e-12 for a, b_ in zip(eps, eps[1:]))
    cyc = mf_acc.poisson_steps(1.0, s, 0.1, partitions=4)
    assert sum(1 for p in cyc if p != acc.identity()) == 6
    assert acc.compose(*cyc).epsilon_at(1e-5) == pytest.approx(mf_acc.poisson(1.0, s, 0.1, partitions=4).epsilon_at(1e-5), rel=1e-9)


def test_prefix_sensitivity_is_that_of_the_top_left_block():
    for s in (dpftrl.bsr_strategy(12, 12), dpftrl.band_mf_strategy(12, 3, structure="column_normalized", max_iterations=10), dpftrl.dense_strategy(12, max_iterations=10)):
        steps = mf_acc.mf_gaussian_steps(2.0, s, 2, None)
        mu2, running = 0.0, 0.0
        for t, p in enumerate(steps, start=1):
            if p != acc.identity():
                mu2 += 1.0 / p.noise_multiplier**2
            # mu_t = sens(C[:t, :t]) / (nm * sens(C)), kept non-decreasing (a running max of bounds)
            running = max(running, s.sensitivity(2, None, n=t) / (2.0 * s.sensitivity(2, None)))
            assert math.sqrt(mu2) == pytest.approx(running, rel=1e-9)


def test_accountant_stops_a_dpftrl_run_early_on_its_budget():
    s = dpftrl.bsr_strategy(40, 40)
    steps = mf_acc.mf_gaussian_steps(4.0, s, 1, None)
    eps = mf_acc.prefix_epsilons(steps, 1e-5)
    budget = (eps[24] + eps[25]) / 2  # between the 25th and the 26th step
    accountant = acc.Accountant(acc.epsilon_budget(budget, delta=1e-5))
    done = 0
    with pytest.raises(BudgetExceededError):
        for cost in steps:
            accountant.step(cost)
            done += 1
    assert done == 25
    # The accountant composes step by step; one-shot prefixes may differ by ~1e-6 (both are upper bounds).
    assert accountant.spent_epsilon(1e-5) == pytest.approx(eps[24], rel=2e-6)


# --------------------------------------------------------------- Monte Carlo


def _forced_balls_in_bins(nm: float, n: int, k, samples: int) -> mf_acc.MonteCarloProcess:
    s = dpftrl.identity_strategy(n)
    gram = mf_acc._bin_gram(s.materialize(), 1)
    return mf_acc.MonteCarloProcess("balls_in_bins", (1, tuple(gram.reshape(-1).tolist())), nm, samples, k.words, 0.99)


def _forced_b_min_sep(nm: float, n: int, q: float, k, samples: int) -> mf_acc.MonteCarloProcess:
    band = mf_acc._band_of(dpftrl.identity_strategy(n), n)
    spec = (n, 1, q, 1, False, tuple(band.reshape(-1).tolist()))
    return mf_acc.MonteCarloProcess("b_min_sep", spec, nm, samples, k.words, 0.99)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_monte_carlo_intervals_cover_exact_values(seed):
    # Balls-in-bins with one bin is exactly the Gaussian mechanism with mu = sqrt(n) / nm.
    mc = _forced_balls_in_bins(2.0, 16, key(seed), 40_000)
    exact = dpsgd_acc.gaussian(0.5)  # mu = 4 / 2
    for eps in (0.5, 2.0, 4.0):
        est = mc.delta_estimate(eps)
        truth = exact.delta_at(eps)
        assert est.lower <= truth <= est.upper, (eps, est, truth)
    assert mc.epsilon_at(1e-2) >= exact.epsilon_at(1e-2)
    # b-min-sep with b = 1 and one band is Poisson sampling: DP-SGD's PLD.
    mc = _forced_b_min_sep(1.0, 20, 0.1, key(seed), 20_000)
    exact = dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), 0.1) * 20
    for eps in (0.25, 0.75):
        est = mc.delta_estimate(eps)
        assert est.lower <= exact.delta_at(eps) <= est.upper, (eps, est)
    assert mc.delta_at(0.75) >= exact.delta_at(0.75)


def test_monte_carlo_is_reproducible_from_its_key():
    s = dpftrl.band_mf_strategy(32, 4, max_iterations=10)
    a = mf_acc.balls_in_bins(1.5, s, 4, key=key(3), num_samples=5000)
    b = mf_acc.balls_in_bins(1.5, s, 4, key=key(3), num_samples=5000)
    c = mf_acc.balls_in_bins(1.5, s, 4, key=key(4), num_samples=5000)
    assert a == b and a.delta_estimate(1.0) == b.delta_estimate(1.0)
    assert a.delta_estimate(1.0).estimate != c.delta_estimate(1.0).estimate
    again = acc.process_from_dict(a.to_dict())
    assert again == a and again.epsilon_at(0.05) == a.epsilon_at(0.05)


def test_amplified_monte_carlo_is_no_worse_than_no_amplification():
    s = dpftrl.band_mf_strategy(48, 4, max_iterations=10)
    nm = 2.0
    for process, plain in (
        (mf_acc.b_min_sep(nm, s, 0.25, 4, key=key(0), num_samples=10_000), mf_acc.mf_gaussian(nm, s, 4, None, noise_sensitivity=s.sensitivity())),
        (mf_acc.balls_in_bins(nm, s, 8, key=key(0), num_samples=10_000), mf_acc.mf_gaussian(nm, s, 8, None, noise_sensitivity=s.sensitivity())),
    ):
        assert isinstance(process, mf_acc.MonteCarloProcess)
        assert process.epsilon_at(0.01) <= plain.epsilon_at(0.01)
    warm = mf_acc.b_min_sep(nm, s, 0.25, 4, warm_start=True, key=key(0), num_samples=10_000)
    assert math.isfinite(warm.epsilon_at(0.01))


def test_exact_short_cuts_and_refusals():
    s = dpftrl.band_mf_strategy(32, 4, max_iterations=10)
    assert mf_acc.balls_in_bins(2.0, dpftrl.identity_strategy(9), 1) == dpsgd_acc.gaussian(2.0 / 3.0)
    with pytest.raises(InputValueError, match="bands <= min_sep"):
        mf_acc.b_min_sep(1.0, s, 0.1, 2, key=key(0))
    with pytest.raises(InputValueError, match="not banded"):
        mf_acc.poisson(1.0, dpftrl.blt_strategy(16, max_buffers=2, max_iterations=10), 0.1)
    with pytest.raises(InputTypeError, match="key"):
        mf_acc.balls_in_bins(1.0, s, 4)
    mc = mf_acc.balls_in_bins(1.0, s, 4, key=key(0), num_samples=1000)
    with pytest.raises(InputValueError, match="cannot be composed"):
        (mc | dpsgd_acc.gaussian(1.0)).epsilon_at(1e-5)
    with pytest.raises(InputValueError, match="cannot be composed"):
        (mc * 2).epsilon_at(1e-5)
    negative = dpftrl.BandedStrategy(4, [[1.0, -0.5], [1.0, -0.5], [1.0, -0.5], [1.0, 0.0]])
    with pytest.raises(InputValueError, match="negative entries"):
        mf_acc.balls_in_bins(1.0, negative, 2, key=key(0))
