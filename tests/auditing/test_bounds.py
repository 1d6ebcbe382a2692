"""The single-hypothesis statistics of opake_fx.auditing.bounds, against scipy and dp_accounting,
and their soundness on mechanisms whose exact privacy is known (randomised response, Gaussian)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.special
import scipy.stats

from opake_fx.auditing import bounds
from opake_fx.errors import InputValueError


@pytest.mark.parametrize("k,n,alpha", [(0, 10, 0.05), (3, 50, 0.05), (49, 50, 0.01), (500, 1000, 1e-4)])
def test_clopper_pearson_is_scipys_exact_interval(k, n, alpha):
    ci = scipy.stats.binomtest(k, n).proportion_ci(confidence_level=1 - 2 * alpha, method="exact")
    assert float(bounds.clopper_pearson_upper(k, n, alpha)) == pytest.approx(ci.high, abs=1e-12)
    assert float(bounds.clopper_pearson_lower(k, n, alpha)) == pytest.approx(ci.low, abs=1e-12)
    assert float(bounds.clopper_pearson_upper(n, n, alpha)) == 1.0


@pytest.mark.parametrize("mu", [0.3, 1.0, 1.666, 3.0])
@pytest.mark.parametrize("delta", [1e-5, 1e-3])
def test_gdp_conversion_matches_dp_accounting(mu, delta):
    dp_accounting = pytest.importorskip("dp_accounting")
    eps = bounds.gdp_epsilon(mu, delta)
    # dp_accounting's smallest sigma of a sensitivity-1 Gaussian mechanism that is (eps, delta)-DP is 1 / mu
    assert 1.0 / dp_accounting.get_sigma_gaussian(eps, delta) == pytest.approx(mu, rel=1e-5)
    assert bounds.gdp_mu(eps, delta) == pytest.approx(mu, rel=1e-8)
    assert bounds.gdp_delta(mu, eps) == pytest.approx(delta, rel=1e-8)


def test_gdp_edges():
    assert bounds.gdp_epsilon(0.0, 1e-5) == 0.0 and bounds.gdp_epsilon(math.inf, 1e-5) == math.inf
    assert bounds.gdp_epsilon(0.01, 0.5) == 0.0  # delta above the whole curve
    with pytest.raises(InputValueError, match="delta"):
        bounds.gdp_epsilon(1.0, 0.0)


def test_one_run_p_value_without_delta_is_the_binomial_tail():
    for k, c, eps in [(10, 10, 0.0), (100, 80, 1.0), (500, 400, 1.2)]:
        q = scipy.special.expit(eps)
        assert bounds.one_run_p_value(1000, k, c, eps, 0.0) == pytest.approx(scipy.stats.binom.sf(c - 1, k, q))
    # delta only makes rejecting harder
    assert bounds.one_run_p_value(1000, 500, 400, 1.0, 1e-5) > bounds.one_run_p_value(1000, 500, 400, 1.0, 0.0)


def test_epsilon_one_run_is_the_p_value_inverse():
    eps = bounds.epsilon_one_run(1000, 200, 180, significance=0.05, delta=1e-6)
    assert eps > 0
    assert bounds.one_run_p_value(1000, 200, 180, eps, 1e-6) == pytest.approx(0.05, abs=1e-4)
    assert bounds.one_run_p_value(1000, 200, 180, eps * 1.01, 1e-6) > 0.05
    assert bounds.epsilon_one_run(1000, 200, 100, significance=0.05, delta=1e-6) == 0.0  # chance level
    with pytest.raises(InputValueError, match="correct <= guesses"):
        bounds.epsilon_one_run(10, 5, 6, significance=0.05, delta=0.0)


def test_one_run_test_is_sound_for_randomised_response():
    # eps-randomised response reveals each coin with probability e^eps / (1 + e^eps): the
    # worst (eps, 0)-DP mechanism for this game, whose count of right guesses IS the
    # binomial. The test must reject the true eps at most `alpha` of the time.
    rng = np.random.default_rng(0)
    eps, alpha, runs, k = 1.0, 0.1, 4000, 50
    correct = rng.binomial(k, scipy.special.expit(eps), size=runs)
    values, counts = np.unique(correct, return_counts=True)  # the bound depends on the count only
    rejected = np.array([bounds.epsilon_one_run(100, k, int(c), significance=alpha, delta=0.0) > eps for c in values])
    rejections = int(counts[rejected].sum())
    assert rejections <= scipy.stats.binom.ppf(1 - 1e-4, runs, alpha)
    assert rejections >= scipy.stats.binom.ppf(1e-4, runs, 0.5 * alpha)  # and it is not vacuous


def test_fdp_test_is_sound_for_the_gaussian_mechanism():
    # m canaries, each score ~ N(mu * s_j, 1) with s_j = +-1 a fair coin: exactly mu-GDP per canary.
    rng = np.random.default_rng(1)
    mu, m, alpha, runs = 1.0, 200, 0.1, 300
    exceed = 0
    for _ in range(runs):
        coins = rng.random(m) < 0.5
        scores = rng.normal(size=m) + mu * coins
        top = np.argsort(-scores)[:40]
        exceed += bounds.mu_one_run_fdp(m, 40, int(coins[top].sum()), significance=alpha) > mu
    assert exceed <= scipy.stats.binom.ppf(1 - 1e-4, runs, alpha)


def test_fdp_bound_agrees_with_jax_privacys_epsilon_search():
    # jax_privacy (auditing._epsilon_one_run_fdp) searches epsilon and maps it to sigma with
    # dp_accounting.get_sigma_gaussian; we search mu and map it to epsilon. Same test, other path.
    dp_accounting = pytest.importorskip("dp_accounting")
    m, k, c, alpha, delta = 1000, 300, 260, 0.05, 1e-5

    def rejects(eps: float) -> float:
        sigma = dp_accounting.get_sigma_gaussian(eps, delta)
        inv = lambda x: float(scipy.stats.norm.cdf(scipy.stats.norm.ppf(x) - 1 / sigma))  # noqa: E731
        return bounds.fdp_one_run_rejects(inv, m, k, c, alpha)

    reference = scipy.optimize.brentq(rejects, 0.1, 50.0, xtol=1e-8)
    assert bounds.epsilon_one_run_fdp(m, k, c, significance=alpha, delta=delta) == pytest.approx(reference, abs=1e-4)


def test_one_run_test_is_sound_for_an_eps_delta_mechanism():
    # With probability delta the coin is revealed outright, otherwise eps-randomised response:
    # (eps, delta)-DP per canary. The delta term must cover the extra right guesses.
    rng = np.random.default_rng(2)
    eps, delta, alpha, runs, m = 1.0, 1e-3, 0.1, 2000, 100
    p_right = delta + (1 - delta) * scipy.special.expit(eps)
    correct = rng.binomial(m, p_right, size=runs)
    values, counts = np.unique(correct, return_counts=True)
    rejected = np.array([bounds.epsilon_one_run(m, m, int(c), significance=alpha, delta=delta) > eps for c in values])
    rejections = int(counts[rejected].sum())  # measured 142 of 2000
    assert scipy.stats.binom.ppf(1e-4, runs, 0.03) <= rejections <= scipy.stats.binom.ppf(1 - 1e-4, runs, alpha)


def test_the_statistics_import_without_torch():
    import subprocess
    import sys

    code = ("import sys; from opake_fx.auditing import CanaryScoreAuditor, OneRunEstimate, bounds, "
            "perfect_attack_ceiling; CanaryScoreAuditor([1.0, 2.0], [0.0]).epsilon_clopper_pearson(); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
