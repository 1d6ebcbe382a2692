"""audit_dpsgd(user_ids=...): canary USERS bound the epsilon per user from below.

A correct user-level run (ULS) audits below its claim per user; a pipeline that clips each
row instead of each user, while the accountant charges the user-level plan, audits far
above it; example-level sampling with a per-user cap (ELS) audits below its group-privacy
claim. Small runs (150 examples of 40 users, 300 canary users, 10 steps) with fixed keys.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from opake_fx.accounting import group_epsilon
from opake_fx.auditing import audit_dpsgd
from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.plan import DPPlan
from opake_fx.random import key
from opake_fx.transforms import Transform


def _data(n: int = 150, d: int = 5, users: int = 40):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g)
    y = (x @ torch.randn(d, generator=g) > 0).long()
    ids = torch.randint(0, users, (n,), generator=g).tolist()
    return (x, y), ids


def _loss(p, xi, yi):
    return F.cross_entropy((xi @ p["w"] + p["b"])[None], yi[None])


def _params(d: int = 5):
    return {"w": torch.zeros(d, 2), "b": torch.zeros(2)}


def _clip_rows(plan, loss_fn, optimizer, k):
    """The bug: the user-level batch is flattened and each ROW is clipped to C (an example-level pipeline
    with the same sample rate, normalisation and noise), while the accountant charges the user-level plan.
    A user of r rows then moves the sum by r * C, not C."""
    rows = DPPlan(dataset_size=plan.dataset_size, sample_rate=plan.sample_rate, steps=plan.steps,
                  clipping_norm=plan.clipping_norm, noise_multiplier=plan.noise_multiplier, delta=plan.delta)

    def row_loss(p, *args):
        *row, keep = args
        return torch.where(keep, loss_fn(p, *row), 0.0)

    inner = rows.pipeline(row_loss, optimizer, key=k, batch_argnums=(1, 2, 3, 4))

    def update(batch, state, params=None, **extra):  # (x, y, which, mask) blocks [U, k, ...] -> rows [U * k, ...]
        return inner.update(tuple(b.reshape(-1, *b.shape[2:]) for b in batch), state, params, **extra)

    return Transform(inner.init, update)


ULS = dict(max_examples_per_user=8, num_canaries=300, sample_rate=0.5, steps=10, noise_multiplier=2.0, delta=1e-5)


def test_a_correct_user_level_run_audits_below_its_claim_per_user():
    data, ids = _data()
    assert len(set(ids)) == 40
    r = audit_dpsgd(_loss, _params(), data, key=key(0), user_ids=ids, **ULS)
    # measured with key(0): epsilon per user >= 0.367 (f-DP), claim 3.959
    assert r.unit == "per user" and r.consistent and 0 < r.epsilon_lower < r.epsilon_accountant
    assert r.plan.privacy_unit == "user" and r.plan.dataset_size == 40 + 300 and r.plan.max_examples_per_user == 8
    assert r.epsilon_accountant == pytest.approx(r.plan.epsilon(), rel=1e-3)
    assert np.array_equal(r.estimate.canary_ids, np.arange(40, 340))  # canary j is user 40 + j
    assert "epsilon per user >=" in str(r) and "the accountant's epsilon per user" in str(r)
    assert float(r.params["w"].abs().sum()) > 0
    # a canary user with more rows than k brings a keyed subset of k identical rows: the same run; and the
    # sampler hook gets the user ids
    more = audit_dpsgd(_loss, _params(), data, key=key(0), user_ids=ids, canary_examples=20,
                       sampler=lambda plan, slots, k, user_ids: plan.sampler(slots, k, user_ids=user_ids), **ULS)
    assert np.allclose(more.estimate.scores, r.estimate.scores, atol=1e-5)


def test_clipping_each_row_instead_of_each_user_is_caught():
    data, ids = _data()
    r = audit_dpsgd(_loss, _params(), data, key=key(0), user_ids=ids, pipeline=_clip_rows, **ULS)
    # measured with key(0): GDP bound 12.18 against the claim 3.96 (mu ~3.6: each canary user's 8 rows
    # add 8 C a step, where the correct run's mu is ~0.5-0.8)
    assert r.epsilon_accountant == pytest.approx(3.959, abs=0.01)
    assert r.epsilon_lower > 2.5 * r.epsilon_accountant and not r.consistent
    assert "CONTRADICTS the accountant's epsilon per user" in str(r)


def test_example_level_sampling_with_a_cap_audits_below_the_group_privacy_claim():
    data, ids = _data()
    r = audit_dpsgd(_loss, _params(), data, key=key(0), user_ids=ids, max_examples_per_user=3, canary_examples=10,
                    user_sampling="examples", num_canaries=300, sample_rate=0.5, steps=10, noise_multiplier=4.0,
                    delta=1e-5)
    plan = r.plan
    assert r.unit == "per user" and plan.privacy_unit == "user" and plan.user_sampling == "examples"
    kept = sum(min(c, 3) for c in np.bincount(ids))
    assert plan.dataset_size == kept + 300 * 3  # each canary user: min(10, 3) rows kept by the plan's cap
    per_example = plan.epsilons()["per_example"]
    run = plan.run_cost(plan.noise_multiplier, plan.steps)
    # the claim is group privacy for k = 3 (the plan's, and the largest kept user's measured count)
    assert r.epsilon_accountant == pytest.approx(group_epsilon(run, 3, 1e-5), rel=1e-9)
    assert r.epsilon_accountant > 2 * per_example
    assert r.consistent and 0 < r.epsilon_lower < r.epsilon_accountant


def test_an_els_audit_calibrates_to_a_target_per_user():
    data, ids = _data()
    r = audit_dpsgd(_loss, _params(), data, key=key(1), user_ids=ids, max_examples_per_user=3, user_sampling="examples",
                    num_canaries=200, sample_rate=0.5, steps=8, target_epsilon=6.0, delta=1e-5)
    assert r.epsilon_accountant <= 6.0 and r.plan.target_epsilon == 6.0 and r.consistent


def test_user_level_arguments_are_checked():
    data, ids = _data(30, users=10)
    run = dict(key=key(0), num_canaries=4, batch_size=5, steps=2, noise_multiplier=1.0)
    with pytest.raises(InputValueError, match="needs max_examples_per_user=k"):
        audit_dpsgd(_loss, _params(), data, user_ids=ids, **run)
    with pytest.raises(InputValueError, match="applies to a user-level audit; give user_ids"):
        audit_dpsgd(_loss, _params(), data, max_examples_per_user=2, **run)
    with pytest.raises(InputValueError, match="canary_examples=3 applies to a user-level audit"):
        audit_dpsgd(_loss, _params(), data, canary_examples=3, **run)
    with pytest.raises(InputValueError, match="user_sampling='examples' applies to a user-level audit"):
        audit_dpsgd(_loss, _params(), data, user_sampling="examples", **run)
    with pytest.raises(InputValueError, match="29 user ids for 30 examples"):
        audit_dpsgd(_loss, _params(), data, user_ids=ids[:-1], max_examples_per_user=2, **run)
    with pytest.raises(InputValueError, match="canary_examples >= 1"):
        audit_dpsgd(_loss, _params(), data, user_ids=ids, max_examples_per_user=2, canary_examples=0, **run)
    with pytest.raises(InputTypeError, match="max_examples_per_user must be an int"):
        audit_dpsgd(_loss, _params(), data, user_ids=ids, max_examples_per_user=2.0, **run)
    with pytest.raises(InputValueError, match="user_sampling must be one of"):
        audit_dpsgd(_loss, _params(), data, user_ids=ids, max_examples_per_user=2, user_sampling="people", **run)
    with pytest.raises(InputTypeError, match="not floats"):
        audit_dpsgd(_loss, _params(), data, user_ids=[0.5] * 30, max_examples_per_user=2, **run)
