"""Property tests (hypothesis): monotonicity, epsilon/delta inversion, calibration safety."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

import opake_fx.accounting as acc
import opake_fx.dpsgd.accounting as dpsgd_acc
from opake_fx.errors import CalibrationError

# Each example builds fresh single-step PLDs (~10-50 ms), so keep the counts modest.
FEW = settings(max_examples=8, deadline=None)
SOME = settings(max_examples=15, deadline=None)

sigmas = st.floats(0.7, 5.0)
rates = st.floats(1e-4, 0.2)
deltas = st.sampled_from([1e-3, 1e-5, 1e-8])


def eps(sigma: float, q: float, steps: int, delta: float, accountant: str = "pld") -> float:
    return (dpsgd_acc.poisson(dpsgd_acc.gaussian(sigma), q) * steps).epsilon_at(delta, accountant=accountant)


def not_smaller(a: float, b: float) -> bool:
    """a >= b up to floating-point noise of the engines."""
    return a >= b * (1 - 1e-9) - 1e-12


@SOME
@given(sigma=sigmas, q=rates, steps=st.integers(1, 1000), extra=st.integers(1, 1000), delta=deltas)
def test_epsilon_monotone_in_steps(sigma, q, steps, extra, delta):
    assert not_smaller(eps(sigma, q, steps + extra, delta), eps(sigma, q, steps, delta))


@FEW
@given(sigma=sigmas, q=rates, factor=st.floats(1.05, 3.0), steps=st.integers(1, 1000), delta=deltas)
def test_epsilon_monotone_in_sample_rate(sigma, q, factor, steps, delta):
    assert not_smaller(eps(sigma, min(1.0, q * factor), steps, delta), eps(sigma, q, steps, delta))


@FEW
@given(sigma=sigmas, q=rates, factor=st.floats(1.05, 3.0), steps=st.integers(1, 1000), delta=deltas)
def test_epsilon_monotone_in_inverse_noise(sigma, q, factor, steps, delta):
    assert not_smaller(eps(sigma, q, steps, delta), eps(sigma * factor, q, steps, delta))


@FEW
@given(sigma=sigmas, q=rates, steps=st.integers(1, 3000), delta=deltas)
def test_rdp_monotone_and_above_pld(sigma, q, steps, delta):
    rdp = eps(sigma, q, steps, delta, "rdp")
    assert not_smaller(eps(sigma, q, steps + 1, delta, "rdp"), rdp)
    assert rdp >= eps(sigma, q, steps, delta) * (1 - 1e-3)  # RDP is a looser bound than PLD


@SOME
@given(sigma=sigmas, q=rates, steps=st.integers(1, 2000), delta=st.floats(1e-9, 0.5))
def test_delta_of_epsilon_is_at_most_delta(sigma, q, steps, delta):
    process = dpsgd_acc.poisson(dpsgd_acc.gaussian(sigma), q) * steps
    e = process.epsilon_at(delta)
    assert math.isfinite(e)
    assert process.delta_at(e) <= delta * (1 + 1e-9) + 1e-15


@SOME
@given(sigma=st.floats(0.2, 20.0), steps=st.integers(1, 10**6), delta=st.floats(1e-12, 0.5))
def test_gaussian_epsilon_delta_inverse(sigma, steps, delta):
    process = dpsgd_acc.gaussian(sigma) * steps
    e = process.epsilon_at(delta)
    assert process.delta_at(e) <= delta * (1 + 1e-12)


@FEW
@given(target=st.floats(0.3, 8.0), q=st.floats(1e-3, 0.1), steps=st.integers(10, 2000))
def test_calibrated_noise_meets_budget(target, q, steps):
    budget = acc.epsilon_budget(target, delta=1e-5)
    make = lambda nm: dpsgd_acc.poisson(dpsgd_acc.gaussian(nm), q) * steps  # noqa: E731
    try:
        result = acc.calibrate(budget, make, 0.3, 30.0)
    except CalibrationError:
        assert not budget.is_met_by(make(30.0))  # no noise in the bracket is enough
        return
    assert budget.is_met_by(make(result.param))
    assert result.achieved <= target
    if result.param > 0.3:  # the bracket end itself may already meet the budget
        assert result.converged and result.achieved >= target * (1 - 1e-3)


@FEW
@given(target=st.floats(0.5, 5.0), sigma=st.floats(0.6, 3.0), q=st.floats(1e-3, 0.05))
def test_calibrated_steps_meet_budget(target, sigma, q):
    budget = acc.epsilon_budget(target, delta=1e-5)
    step = dpsgd_acc.poisson(dpsgd_acc.gaussian(sigma), q)
    try:
        result = acc.calibrate(budget, lambda t: step * t, 1, 200_000)
    except CalibrationError:
        assert not budget.is_met_by(step)  # even one step is over budget
        return
    assert budget.is_met_by(step * result.param)
    if result.param < 200_000:
        assert not budget.is_met_by(step * (result.param + 1))
