"""Red team: a resumed accountant must not report less than the spent process it was saved with.

The checkpoint's digest is a checksum, not a MAC: whoever can edit the file can recompute
it. ``Accountant.from_state_dict`` therefore compares the running composition with the
one-shot composition of the saved spent process instead of trusting it.
"""

from __future__ import annotations

import pytest

import opake_fx.accounting as acc
import opake_fx.dpsgd.accounting as dpsgd_acc
from opake_fx.errors import BudgetExceededError, InputValueError

STEP = dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), 0.01)
OTHER = dpsgd_acc.poisson(dpsgd_acc.gaussian(0.8), 0.02)


def _spent(budget, steps):
    acct = acc.Accountant(budget)
    for s in steps:
        acct.step(s)
    return acct


@pytest.mark.parametrize("kind", ["pld", "rdp"])
def test_a_running_state_spliced_from_an_earlier_checkpoint_is_refused(kind: str) -> None:
    budget = acc.epsilon_budget(3.0, delta=1e-5, accountant=kind, discretization=1e-3)
    early = _spent(budget, [STEP, OTHER]).state_dict(running=True)
    uninterrupted = _spent(budget, [STEP, OTHER] + [STEP] * 20 + [OTHER])
    late = uninterrupted.state_dict(running=True)
    forged = {**late, "running": early["running"]}  # spent says 24 steps, the running state 2
    with pytest.raises(InputValueError, match="Accountant state/running"):
        acc.Accountant.from_state_dict(forged)
    honest = acc.Accountant.from_state_dict(late)  # the real one still resumes, bit for bit
    assert honest.spent_epsilon(1e-5) == uninterrupted.spent_epsilon(1e-5)


def test_a_forged_headroom_cannot_skip_the_budget_check() -> None:
    budget = acc.epsilon_budget(1.0, delta=1e-5, discretization=1e-3)
    acct = _spent(budget, [STEP, STEP, STEP])  # the second step computed a headroom
    state = acct.state_dict(running=True)
    assert state["running"]["headroom"] is not None
    state["running"]["headroom"] = [STEP.to_dict(), 10**6]  # "a million more steps fit"
    with pytest.raises(InputValueError, match="headroom"):
        acc.Accountant.from_state_dict(state)
    resumed = acc.Accountant.from_state_dict(acct.state_dict(running=True))
    with pytest.raises(BudgetExceededError):
        for _ in range(10**4):
            resumed.step(STEP)
    assert resumed.spent_epsilon(1e-5) <= 1.0


def test_a_dp_ftrl_plan_state_with_an_earlier_running_composition_is_refused() -> None:
    from opake_fx.plan import DPPlan

    plan = DPPlan(dataset_size=400, batch_size=20, steps=40, noise_multiplier=1.0, mechanism="bsr", bands=3,
                  sampling="b_min_sep", min_sep=10, delta=1e-5)
    acct = plan.accountant()
    states = []
    for t in range(20):
        acct.step(plan.step_cost_at(t))
        states.append(acct.state_dict(running=True))
    late, early = states[-1]["running"], states[1]["running"]
    with pytest.raises(InputValueError, match="RDP curve is below"):
        acc.Accountant.from_state_dict({**states[-1], "running": early})
    # the RDP side kept honest, only the PLD spliced: the PLD comparison catches it
    forged = {**states[-1], "running": {**early, "rdp_sum": late["rdp_sum"], "rdp_todo": late["rdp_todo"]}}
    with pytest.raises(InputValueError, match="does not belong to this spent process"):
        acc.Accountant.from_state_dict(forged)
    assert acc.Accountant.from_state_dict(states[-1]).spent_epsilon(1e-5) == acct.spent_epsilon(1e-5)
