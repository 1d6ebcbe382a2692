"""Red team: the two-sample auditor's one-run bounds on a fixed, unbalanced in/out design.

Steinke et al.'s one-run bound assumes membership by fair coins. Given 900 in- and 100
out-canaries whose scores carry no information (epsilon 0), guessing "in" for the top
scores is right 90% of the time, and the bound came out ~1.7 (f-DP: ~2.5) on every seed.
"""

from __future__ import annotations

import numpy as np
import pytest

from opake_fx.auditing import CanaryScoreAuditor
from opake_fx.errors import InputValueError


@pytest.mark.parametrize("method", ["epsilon_one_run", "epsilon_one_run_fdp"])
def test_an_unbalanced_fixed_design_is_refused_by_the_one_run_bounds(method: str) -> None:
    rng = np.random.default_rng(0)
    auditor = CanaryScoreAuditor(rng.normal(size=900), rng.normal(size=100))  # leaks nothing: epsilon 0
    with pytest.raises(InputValueError, match="fair coins"):
        getattr(auditor, method)(0.05, 1e-5)
    assert auditor.epsilon_clopper_pearson(0.05, 1e-5) == 0.0  # the fixed-design bound stays available


def test_the_one_run_bound_of_an_uninformative_balanced_design_rarely_exceeds_zero() -> None:
    # Coin-flipped counts: a wrong bound (> 0 at epsilon 0) and a refusal (counts fair coins give
    # with probability < 0.05) each happen on at most Binomial(40, 0.05)'s 99.9% quantile (7) of 40 seeds.
    exceed = refused = 0
    for seed in range(40):
        rng = np.random.default_rng(seed)
        n_in = int(rng.binomial(400, 0.5))
        auditor = CanaryScoreAuditor(rng.normal(size=n_in), rng.normal(size=400 - n_in))
        try:
            exceed += auditor.epsilon_one_run(0.05, 1e-5) > 0
        except InputValueError:
            refused += 1
    assert exceed <= 7 and refused <= 7


def test_a_reported_lower_bound_is_itself_rejected() -> None:
    """brentq's root lies within its tolerance on either side; 45 of 78 bounds were a hair above
    the largest rejected value (p-value 0.05 + 2e-8). Each returned value must be rejected."""
    from scipy.special import ndtr, ndtri

    from opake_fx.auditing import bounds

    for m, k in [(1000, 100), (200, 50)]:
        for c in range(k // 2 + 1, k + 1, max(1, k // 20)):
            eps = bounds.epsilon_one_run(m, k, c, significance=0.05, delta=1e-5)
            if eps > 0:
                assert bounds.one_run_p_value(m, k, c, eps, 1e-5) <= 0.05, (m, k, c, eps)
            mu = bounds.mu_one_run_fdp(m, k, c, significance=0.05)
            if mu > 0:
                assert bounds.fdp_one_run_rejects(lambda x: float(ndtr(ndtri(x) - mu)), m, k, c, 0.05) > 0, (m, k, c, mu)


def test_the_gdp_epsilon_of_a_lower_bound_is_not_above_the_exact_one() -> None:
    """gdp_epsilon converts a mu lower bound into the reported epsilon: delta(eps) >= delta must hold there."""
    from opake_fx.auditing import bounds

    for mu in np.linspace(0.3, 6.0, 40):
        for delta in (1e-3, 1e-5, 1e-8):
            eps = bounds.gdp_epsilon(float(mu), delta)
            assert eps == 0.0 or bounds.gdp_delta(float(mu), eps) >= delta, (mu, delta, eps)
