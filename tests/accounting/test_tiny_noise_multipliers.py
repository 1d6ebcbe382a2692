"""Tiny noise multipliers give an epsilon (infinite or not below the exact one) or a clear error, at once.

Before: ``noise_multiplier=1e-8`` raised ``OverflowError`` in the PLD code, 1e-300 ran for
minutes (the grid of its privacy losses doubled its spacing forever), and per-step losses
above ~709 nats were read as impossible (``expm1`` overflowed), so a Poisson-subsampled
Gaussian of multiplier 0.01 reported epsilon 705 where the exact single-step value is 5303.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import special

import opake_fx.accounting as acc
import opake_fx.dpsgd.accounting as dpsgd_acc
from opake_fx.errors import BudgetExceededError, InputValueError
from opake_fx.plan import DPPlan

TINY = [1e-8, 1e-300]


def _plan(nm: float, **kw) -> DPPlan:
    return DPPlan(dataset_size=1000, batch_size=10, steps=100, noise_multiplier=nm, delta=1e-5, **kw)


def _exact_remove_delta(eps: float, sigma: float, q: float) -> float:
    """delta(eps) of the Poisson-subsampled Gaussian's 'remove' pair, in log space (independent of the engine)."""
    mu = 1.0 / sigma
    inner = eps - math.log(q) + math.log1p(-(1.0 - q) * math.exp(-eps))  # log(1 + (e^eps - 1) / q), eps > 0
    la = special.log_ndtr(mu / 2.0 - inner / mu)
    lb = special.log_ndtr(-mu / 2.0 - inner / mu)
    return q * math.exp(la) * -math.expm1(min(inner + lb - la, 0.0))


@pytest.mark.parametrize("nm", TINY)
def test_plan_epsilon_of_a_tiny_multiplier_is_infinite_or_astronomical(nm):
    assert _plan(nm).epsilon() == math.inf  # PLD: the steps holding the example sit at +inf
    assert _plan(nm, accountant_kind="rdp").epsilon() >= 1e15  # RDP: ~100 / (2 nm**2), or inf


@pytest.mark.parametrize("nm", TINY)
def test_the_grid_of_a_tiny_multiplier_stays_small(nm):
    # What made 1e-300 run for minutes: the grid of its losses. Capped, it is small (and answers at once).
    pld = (dpsgd_acc.poisson(dpsgd_acc.gaussian(nm), 0.01) * 100).pld()
    losses, probs, inf_mass = pld.arrays()["remove"]
    assert probs.size <= 2**17 and losses.max() <= 1000.0
    assert inf_mass >= 1 - 0.99**100 - 1e-9  # every step that holds the example is at +inf


@pytest.mark.parametrize("nm", [0.03, 0.02, 0.01, 1e-3])
def test_subsampled_gaussian_epsilon_is_not_below_the_exact_one(nm):
    q, delta = 0.01, 1e-5
    eps = dpsgd_acc.poisson(dpsgd_acc.gaussian(nm), q).epsilon_at(delta)
    # a finite answer must be one at which the exact curve is already <= delta
    assert eps == math.inf or _exact_remove_delta(eps, nm, q) <= delta * (1 + 1e-6)


def test_large_losses_keep_their_mass_above_709_nats():
    # nm = 0.03: losses up to ~880 nats, below the cap: finite, and at the exact value (653.002)
    eps = dpsgd_acc.poisson(dpsgd_acc.gaussian(0.03), 0.01).epsilon_at(1e-5)
    assert eps == pytest.approx(653.002, abs=0.01)


@pytest.mark.parametrize("nm", TINY)
def test_accountant_refuses_a_tiny_multiplier_step_and_the_plan_has_no_budget(nm):
    plan = _plan(nm)
    acct = acc.Accountant(acc.epsilon_budget(10.0, delta=1e-5))
    assert acct.would_exceed(plan.step_cost)
    with pytest.raises(BudgetExceededError):
        acct.step(plan.step_cost)
    assert acct.spent == acc.identity()  # the refused step was not recorded
    with pytest.raises(InputValueError, match=r"noise_multiplier=1e-(08|300).*infinite.*noise_multiplier=0"):
        plan.accountant()


@pytest.mark.parametrize("nm", TINY)
def test_rdp_of_a_tiny_multiplier_is_infinite_without_nan(nm):
    curve = dpsgd_acc.poisson(dpsgd_acc.gaussian(nm), 0.01).rdp()
    assert not np.isnan(curve).any()
    assert dpsgd_acc.poisson(dpsgd_acc.gaussian(nm), 0.01).epsilon_at(1e-5, accountant="rdp") >= 1e15


def test_zero_noise_is_an_explicit_baseline_or_a_clear_error():
    plan = _plan(0.0)
    assert plan.epsilon() == math.inf and plan.epsilon(0) == 0.0
    with pytest.raises(InputValueError, match="noise_multiplier=0.*non-private"):
        plan.accountant()
    with pytest.raises(InputValueError, match="noise_multiplier must be finite and > 0"):
        dpsgd_acc.gaussian(0.0)
