"""Accountant: budget enforcement, remaining steps, serialisation."""

from __future__ import annotations

import json

import pytest

import opake_fx.accounting as acc
import opake_fx.dpsgd.accounting as dpsgd_acc
from opake_fx.errors import BudgetExceededError, InputTypeError, InputValueError

STEP = dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), 0.01)


def agrees(running: float, one_shot: float) -> bool:
    """The accountant's running composition vs the one-shot one.

    Both are pessimistic; they differ by where the FFT rounding bounds and the Chernoff
    cuts (1e-16 mass a step) are paid, which moves epsilon by ~1e-8 relative. 1e-6 is the
    issue's tolerance; below by more than 1e-9 would mean a lost bound.
    """
    return one_shot * (1 - 1e-9) <= running <= one_shot * (1 + 1e-6)


def test_steps_accumulate_and_match_the_composed_process():
    acct = acc.Accountant(acc.epsilon_budget(2.0, delta=1e-5))
    for _ in range(10):
        acct.step(STEP)
    acct |= STEP * 90
    assert acct.spent == STEP * 100
    assert agrees(acct.spent_epsilon(1e-5), (STEP * 100).epsilon_at(1e-5))
    assert agrees(acct.spent_delta(1.0), (STEP * 100).delta_at(1.0))
    assert not acct.budget_exceeded


def test_exceeding_step_raises_and_changes_nothing():
    acct = acc.Accountant(acc.epsilon_budget(1.0, delta=1e-5))
    fits = acct.remaining_steps(STEP)
    assert fits > 0
    acct |= STEP * fits
    before = acct.spent
    assert acct.would_exceed(STEP)
    with pytest.raises(BudgetExceededError, match="not recorded"):
        acct.step(STEP)
    with pytest.raises(BudgetExceededError):
        acct |= STEP
    assert acct.spent == before
    assert acct.remaining_steps(STEP) == 0
    assert not acct.budget_exceeded


def test_remaining_steps_is_exact():
    budget = acc.epsilon_budget(1.5, delta=1e-5)
    acct = acc.Accountant(budget)
    acct |= STEP * 50
    k = acct.remaining_steps(STEP)
    assert budget.is_met_by(STEP * (50 + k))
    assert not budget.is_met_by(STEP * (50 + k + 1))
    assert acct.remaining_steps(STEP, limit=3) == 3
    with pytest.raises(InputValueError, match="no privacy"):
        acct.remaining_steps(acc.identity())


def test_functional_or_returns_a_new_accountant():
    acct = acc.Accountant(acc.epsilon_budget(2.0, delta=1e-5))
    new = acct | STEP
    assert acct.spent == acc.identity()
    assert new.spent == STEP


def test_budget_exceeded_when_constructed_over_budget():
    acct = acc.Accountant(acc.epsilon_budget(0.1, delta=1e-5), spent=STEP * 1000)
    assert acct.budget_exceeded


def test_state_dict_round_trips_through_json():
    acct = acc.Accountant(acc.epsilon_budget(3.0, delta=1e-5, accountant="pld", discretization=1e-4))
    acct |= STEP * 20
    acct |= dpsgd_acc.poisson(dpsgd_acc.gaussian(0.8), 0.02) * 5
    state = json.loads(json.dumps(acct.state_dict()))
    back = acc.Accountant.from_state_dict(state)
    assert back.spent == acct.spent
    assert back.budget == acct.budget
    assert back.spent_epsilon(1e-5) == pytest.approx(acct.spent_epsilon(1e-5), rel=1e-6)
    with pytest.raises(InputValueError, match="version"):
        acc.Accountant.from_state_dict({"version": 99})


def test_state_dict_with_the_running_composition_resumes_bit_for_bit():
    budget = acc.epsilon_budget(2.0, delta=1e-5, discretization=1e-3)
    other = dpsgd_acc.poisson(dpsgd_acc.gaussian(0.8), 0.02)
    acct = acc.Accountant(budget)
    for step in (STEP, STEP, STEP):  # the second one computed a headroom; a run is pending
        acct.step(step)
    state = acct.state_dict(running=True)
    assert state["version"] == 2 and state["running"]["run"] == [STEP.to_dict(), 2]
    resumed = acc.Accountant.from_state_dict(state)
    for step in (STEP, other, STEP):
        acct.step(step)
        resumed.step(step)
    assert resumed.spent == acct.spent
    for engine in ("pld", "rdp"):
        assert resumed.spent_epsilon(1e-5, accountant=engine) == acct.spent_epsilon(1e-5, accountant=engine)


def test_state_dict_refuses_a_malformed_running_state():
    acct = acc.Accountant(acc.epsilon_budget(2.0, delta=1e-5, discretization=1e-3))
    acct |= STEP
    good = acct.state_dict(running=True)

    def running(**change):
        return {**good, "running": {**good["running"], **change}}

    cases = [
        (running(pld=None), r"running/pld: a PLD budget keeps a running PLD"),
        (running(run=[STEP.to_dict(), 0]), r"running/run: the count must be an int >= 1"),
        (running(run=[dpsgd_acc.gaussian(3.0).to_dict(), 2]), r"running/run: its process is not the last step"),
        (running(rdp_sum=[0.0]), r"running/rdp_sum: expected None or a float64 array"),
        (running(rdp_todo=[None]), r"running/rdp_todo/0: expected \[process, count\]"),
        ({k: v for k, v in good.items() if k != "running"} | {"version": 2}, r"version 1 or 2"),
    ]
    for state, message in cases:
        with pytest.raises(InputValueError, match=message):
            acc.Accountant.from_state_dict(state)


def test_rdp_budget_accountant():
    acct = acc.Accountant(acc.epsilon_budget(2.0, delta=1e-5, accountant="rdp"))
    acct |= STEP * 100
    assert acct.spent_epsilon(1e-5) == pytest.approx((STEP * 100).epsilon_at(1e-5, accountant="rdp"), rel=1e-12)
    assert agrees(acct.spent_epsilon(1e-5, accountant="pld"), (STEP * 100).epsilon_at(1e-5))


def test_accountant_type_errors():
    with pytest.raises(InputTypeError):
        acc.Accountant(3.0)  # type: ignore[arg-type]
    acct = acc.Accountant(acc.epsilon_budget(1.0, 1e-5))
    with pytest.raises(InputTypeError):
        acct.step("step")  # type: ignore[arg-type]


def test_long_runs_count_down_a_precomputed_headroom():
    budget = acc.epsilon_budget(1.0, delta=1e-5)
    acct = acc.Accountant(budget)
    fits = acct.remaining_steps(STEP)
    taken = 0
    with pytest.raises(BudgetExceededError):
        while True:
            acct.step(STEP)
            taken += 1
    assert taken == fits
    assert acct.spent == STEP * fits
    assert budget.is_met_by(acct.spent) and not budget.is_met_by(acct.spent | STEP)
    assert acct.would_exceed(STEP)
    other = dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), 0.001)
    assert acct.would_exceed(other) == (not budget.is_met_by(acct.spent | other))


def test_epsilon_is_reported_at_the_budgets_delta_and_the_repr_shows_it_with_the_step_count():
    acct = acc.Accountant(acc.epsilon_budget(3.0, delta=1e-5))
    for _ in range(140):
        acct.step(STEP)
    assert acct.delta == 1e-5 and acct.epsilon == acct.spent_epsilon(1e-5)
    assert repr(acct) == str(acct) == (
        f"Accountant(epsilon={acct.epsilon:.4g} per example at delta=1e-05, steps=140, budget: epsilon <= 3 per example "
        "at delta=1e-05, pld)"
    )
    by_delta = acc.Accountant(acc.delta_budget(1e-6, epsilon=2.0), spent=STEP * 10)
    assert by_delta.delta == 1e-6 and by_delta.epsilon == by_delta.spent_epsilon(1e-6)
    assert "steps=unknown" in repr(by_delta) and "budget: delta <= 1e-06 per example at epsilon=2" in repr(by_delta)


def test_a_budget_per_user_names_its_unit_in_every_report_and_survives_its_state():
    budget = acc.epsilon_budget(3.0, delta=1e-5, unit="user")
    acct = acc.Accountant(budget)
    acct.step(STEP)
    assert f"epsilon={acct.epsilon:.4g} per user at delta" in repr(acct) and "epsilon <= 3 per user" in repr(acct)
    assert budget.to_dict()["unit"] == "user" and "unit" not in acc.epsilon_budget(3.0, delta=1e-5).to_dict()
    resumed = acc.Accountant.from_state_dict(acct.state_dict(running=True))
    assert resumed.budget == budget and "per user" in repr(resumed)
    assert acc.budget_from_dict(budget.to_dict()) != acc.epsilon_budget(3.0, delta=1e-5)  # the unit is part of it
    with pytest.raises(InputValueError, match="unit"):
        acc.epsilon_budget(3.0, delta=1e-5, unit="household")


def test_epsilon_without_a_known_delta_says_to_call_spent_epsilon():
    class NoDeltaBudget(acc.Budget):  # a budget kind of the user's, with no delta of its own
        metric = "epsilon"

        @property
        def value(self):
            return 3.0

        def measure_profile(self, profile):
            return float(profile.epsilon_at(1e-5))

    acct = acc.Accountant(NoDeltaBudget())
    acct.step(STEP)
    assert acct.delta is None
    with pytest.raises(InputValueError, match=r"call accountant.spent_epsilon\(delta\)"):
        acct.epsilon


def test_a_plans_accountant_reports_epsilon_at_the_plans_delta():
    from opake_fx.plan import DPPlan

    plan = DPPlan(dataset_size=1000, batch_size=10, steps=20, noise_multiplier=1.0, delta=1e-6)
    acct = plan.accountant()
    for _ in range(20):
        acct.step(plan.step_cost)
    assert acct.delta == plan.delta
    assert agrees(acct.epsilon, plan.epsilon())
