"""Budgets and calibrate: direction, integers, safety, errors."""

from __future__ import annotations

import json

import pytest

import opake_fx.accounting as acc
import opake_fx.dpsgd.accounting as dpsgd_acc
from opake_fx.errors import CalibrationError, InputTypeError, InputValueError

Q, STEPS = 64 / 10_000, 500


def seed_process(nm: float) -> acc.DpProcess:
    return dpsgd_acc.poisson(dpsgd_acc.gaussian(nm), Q) * STEPS


def test_seed_tutorial_calibration():
    result = acc.calibrate(acc.epsilon_budget(3.0, delta=1e-5), seed_process, param_min=0.1, param_max=10.0)
    eps = seed_process(result.param).epsilon_at(1e-5)
    assert eps <= 3.0
    assert eps >= 3.0 * (1 - 1e-3)
    assert result.achieved == eps
    assert result.converged
    assert result.param == pytest.approx(0.6645280522102893, abs=1e-3)  # dp_accounting's PLD answer


def test_budget_objects():
    b = acc.epsilon_budget(2.0, delta=1e-6)
    assert b.value == 2.0 and b.metric == "epsilon" and b.delta == 1e-6
    assert b.is_met_by(seed_process(2.0))
    assert not b.is_met_by(seed_process(0.3))
    d = acc.delta_budget(1e-6, epsilon=2.0)
    assert d.value == 1e-6 and d.metric == "delta"
    assert d.measure(seed_process(1.0)) == seed_process(1.0).delta_at(2.0)
    for budget in (b, d, acc.epsilon_budget(1.0, 1e-5, accountant="rdp", discretization=1e-3)):
        assert acc.budget_from_dict(json.loads(json.dumps(budget.to_dict()))) == budget
    with pytest.raises(InputValueError, match="delta"):
        acc.epsilon_budget(1.0, delta=0.0)
    with pytest.raises(InputValueError, match="epsilon"):
        acc.epsilon_budget(-1.0, delta=1e-5)
    with pytest.raises(InputValueError, match="accountant"):
        acc.epsilon_budget(1.0, delta=1e-5, accountant="gdp")
    with pytest.raises(InputTypeError):
        b.is_met_by("not a process")  # type: ignore[arg-type]


def test_calibrates_steps_as_integers_on_the_safe_side():
    budget = acc.epsilon_budget(2.0, delta=1e-5)
    step = dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), 0.01)
    result = acc.calibrate(budget, lambda t: step * t, 1, 100_000)
    assert isinstance(result.param, int)
    assert result.converged
    assert budget.is_met_by(step * result.param)
    assert not budget.is_met_by(step * (result.param + 1))


def test_calibrates_sample_rate_increasing_direction():
    budget = acc.epsilon_budget(1.0, delta=1e-5)
    result = acc.calibrate(budget, lambda q: dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), q) * 1000, 1e-5, 1.0)
    assert budget.is_met_by(dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), result.param) * 1000)
    assert result.achieved >= 1.0 * (1 - 1e-3)


def test_calibrates_with_rdp_and_delta_budgets():
    rdp = acc.calibrate(acc.epsilon_budget(3.0, 1e-5, accountant="rdp"), seed_process, 0.1, 10.0)
    assert seed_process(rdp.param).epsilon_at(1e-5, accountant="rdp") <= 3.0
    assert rdp.param > 0.6645  # RDP is looser: it needs more noise
    budget = acc.delta_budget(1e-6, epsilon=2.0)
    res = acc.calibrate(budget, seed_process, 0.3, 10.0)
    assert budget.is_met_by(seed_process(res.param))
    assert res.achieved >= 1e-6 * (1 - 1e-3)


def test_whole_bracket_meets_budget_returns_the_spending_end():
    result = acc.calibrate(acc.epsilon_budget(50.0, 1e-5), seed_process, 1.0, 10.0)
    assert result.param == 1.0 and result.converged


def test_no_solution_says_which_end_to_widen():
    with pytest.raises(CalibrationError, match="increase param_max"):
        acc.calibrate(acc.epsilon_budget(0.01, 1e-5), seed_process, 0.5, 2.0)
    step = dpsgd_acc.poisson(dpsgd_acc.gaussian(0.5), 0.5)
    with pytest.raises(CalibrationError, match="decrease param_min"):
        acc.calibrate(acc.epsilon_budget(0.5, 1e-5), lambda t: step * t, 10, 100)


def test_flat_metric_is_an_error():
    with pytest.raises(CalibrationError, match="does not change"):
        acc.calibrate(acc.epsilon_budget(1.0, 1e-5), lambda x: dpsgd_acc.gaussian(2.0), 0.1, 10.0)


def test_bad_calibrate_arguments():
    budget = acc.epsilon_budget(1.0, 1e-5)
    with pytest.raises(InputValueError, match="param_min < param_max"):
        acc.calibrate(budget, seed_process, 2.0, 1.0)
    with pytest.raises(InputValueError, match="tolerance"):
        acc.calibrate(budget, seed_process, 0.5, 2.0, tolerance=0.0)
    with pytest.raises(InputTypeError, match="DpProcess"):
        acc.calibrate(budget, lambda x: 3.0, 0.5, 2.0)  # type: ignore[arg-type,return-value]
    with pytest.raises(InputTypeError, match="budget"):
        acc.calibrate(3.0, seed_process, 0.5, 2.0)  # type: ignore[arg-type]


def test_max_iterations_exhausted_still_returns_safe_side():
    budget = acc.epsilon_budget(3.0, 1e-5)
    result = acc.calibrate(budget, seed_process, 0.1, 10.0, tolerance=1e-9, max_iterations=2)
    assert not result.converged
    assert budget.is_met_by(seed_process(result.param))
