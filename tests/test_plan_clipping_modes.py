"""DPPlan clipping modes: per-group norms, AUTO-S and adaptive clipping, each with its sensitivity and accounting."""

from __future__ import annotations

import json
import math

import pytest
import torch

import opake_fx.accounting as acc
import opake_fx.dpsgd.accounting as dpsgd_acc
from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.optimizers import sgd
from opake_fx.plan import DPPlan, per_group_by_regex
from opake_fx.random import key
from opake_fx.types import PerGroup

D = 20_000  # coordinates per group: the measured noise stddev is within ~0.5% (1 / sqrt(2 D)) of the true one
C_W, C_B = 3.0, 4.0  # total sensitivity sqrt(3**2 + 4**2) = 5


def _groups() -> PerGroup:
    return per_group_by_regex((torch.zeros(D), torch.zeros(D)), ["layer.weight", "head.bias"],
                              {"weight": C_W, "fallback": C_B})


def _plan(**kw) -> DPPlan:
    args = dict(dataset_size=1000, batch_size=10, steps=20, noise_multiplier=1.3, delta=1e-5)
    args.update(kw)
    return DPPlan(**args)


def _linear(p, x):  # one example: the gradient w.r.t. (w, b) is (x[:D], x[D:])
    return (p[0] * x[:D]).sum() + (p[1] * x[D:]).sum()


def _zero(p, x):  # a zero gradient: the pipeline's output is its noise alone
    return 0.0 * (p[0].sum() + p[1].sum() + x.sum())


def _released(plan, loss, batch, **kw):
    """The noised, normalised gradient of one step (sgd(1.0) moves by minus it)."""
    params = (torch.zeros(D), torch.zeros(D))
    pipe = plan.pipeline(loss, sgd(1.0), key=key(7), batch_argnums=(1,), **kw)
    updates, state = pipe.update((batch,), pipe.init(params), params)
    return tuple(-u for u in updates), state


# --- per-group ------------------------------------------------------------------------------


def test_per_group_noise_is_scaled_to_the_total_sensitivity():
    plan = _plan(clipping_norm=_groups())
    assert plan.sensitivity == 5.0
    noise, _ = _released(plan, _zero, torch.zeros(3, 2 * D))
    expected = plan.noise_multiplier * math.sqrt(C_W**2 + C_B**2) / plan.batch_size  # 0.65
    tol = 5 / math.sqrt(2 * D)  # five standard errors of a stddev estimated from D normal draws
    for group in noise:  # every coordinate, in both groups, at the total sensitivity (isotropic)
        assert float(group.std()) == pytest.approx(expected, rel=tol)
        assert abs(float(group.mean())) < 5 * expected / math.sqrt(D)
    # exactly the noise of a fixed plan clipping to the total sensitivity, with the same key
    fixed, _ = _released(_plan(clipping_norm=5.0), _zero, torch.zeros(3, 2 * D))
    for a, b in zip(noise, fixed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # and the accounting is that of the noise multiplier alone, as for one norm
    assert plan.step_cost == _plan().step_cost and plan.epsilon() == _plan().epsilon()


def test_per_group_clipping_bounds_each_group_by_its_own_norm():
    x = torch.zeros(2, 2 * D)
    x[0, :D] = 1e6  # an adversarial example: a huge gradient in the weight group ...
    x[0, D] = 0.5  # ... and a small one in the bias group
    x[1, D + 1] = 100.0  # another example, huge in the bias group only
    plan = _plan(clipping_norm=_groups(), noise_multiplier=0.0)
    (w, b), _ = _released(plan, _linear, x)
    # float64 norms of the released float32 values: the float32 norm of 20,000 equal values is itself 1e-5 off
    assert C_W * (1 - 1e-6) < float(w.double().norm()) * plan.batch_size <= C_W  # clipped to C_w, not to 5
    assert float(b[0]) * plan.batch_size == pytest.approx(0.5, rel=1e-6)  # untouched: below C_b
    assert C_B * (1 - 1e-6) < float(b[1]) * plan.batch_size <= C_B  # clipped to C_b
    # one global norm of 5 would have scaled example 0's bias gradient to ~0
    (_, b_global), _ = _released(_plan(clipping_norm=5.0, noise_multiplier=0.0), _linear, x)
    assert float(b_global[0]) * plan.batch_size < 1e-5


def test_a_per_group_plan_round_trips_through_json_and_stays_a_hashable_value():
    plan = _plan(clipping_norm=_groups(), noise_multiplier=None, target_epsilon=2.0)
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["clipping_norm"] == {"groups": [[[0], "weight"], [[1], "fallback"]],
                                     "values": {"fallback": 4.0, "weight": 3.0}}
    again = DPPlan(**data)
    assert again == plan and hash(again) == hash(plan) and isinstance(again.clipping_norm, PerGroup)
    assert plan.noise_multiplier == _plan(noise_multiplier=None, target_epsilon=2.0).noise_multiplier


def test_a_dpftrl_plan_takes_per_group_norms_at_their_total_sensitivity():
    mf = dict(dataset_size=1000, batch_size=25, steps=40, noise_multiplier=1.0, delta=1e-5, mechanism="band_mf",
              bands=4, sampling="cyclic_poisson")
    grouped, single = DPPlan(**mf, clipping_norm=_groups()), DPPlan(**mf, clipping_norm=5.0)
    assert grouped.epsilon() == single.epsilon()
    a, _ = _released(grouped, _zero, torch.zeros(2, 2 * D))
    b, _ = _released(single, _zero, torch.zeros(2, 2 * D))
    for x, y in zip(a, b):  # the same correlated noise: z scaled to the strategy's sensitivity times 5
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert float(a[0].std()) > 0


def test_auto_s_goes_with_dpftrl_at_fixed_clippings_noise_and_epsilon():
    mf = dict(dataset_size=1000, batch_size=25, steps=40, noise_multiplier=1.0, delta=1e-5, mechanism="band_mf",
              bands=4, sampling="cyclic_poisson", clipping_norm=2.0)
    auto, fixed = DPPlan(**mf, clipping_mode="auto"), DPPlan(**mf)
    assert auto.epsilon() == fixed.epsilon() and auto.step_cost_at(0) == fixed.step_cost_at(0)
    a, _ = _released(auto, _zero, torch.zeros(2, 2 * D))  # AUTO-S maps a zero gradient to zero (gamma > 0)
    b, _ = _released(fixed, _zero, torch.zeros(2, 2 * D))
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_augmult_plans_take_the_clipping_modes_too():
    def shift(keys, x):  # a per-example augmentation that leaves the example as it is
        return x

    x = torch.zeros(2, 2 * D)
    x[0, :D] = 1e6
    x[0, D] = 0.5
    plan = _plan(clipping_norm=_groups(), noise_multiplier=0.0, augmult=2)
    (w, b), _ = _released(plan, _linear, x, augment=shift, augment_key=key(9))
    assert C_W * (1 - 1e-6) < float(w.double().norm()) * plan.batch_size <= C_W
    assert float(b[0]) * plan.batch_size == pytest.approx(0.5, rel=1e-6)
    adaptive = _plan(clipping_mode="adaptive", augmult=2)
    (_, _), state = _released(adaptive, _linear, x, augment=shift, augment_key=key(9), count_key=key(8))
    assert state["clip"].clip_state.clipping_norm != 1.0  # the adaptive state inside augmult's moved


def test_per_group_by_regex_matches_names_first_regex_wins_and_names_its_errors():
    params = (torch.zeros(1), torch.zeros(1), torch.zeros(1))
    names = ["h.0.attn.weight", "h.0.attn.bias", "lm_head.weight"]
    pg = per_group_by_regex(params, names, {r"attn\.bias": 0.1, "attn": 1.0, "fallback": 2.0})
    assert [pg.for_path((i,)) for i in range(3)] == [1.0, 0.1, 2.0]
    assert per_group_by_regex(params, names, {"attn": 1.0, "head": 2.0, "fallback": 9.0}).effective == math.sqrt(5)
    with pytest.raises(InputValueError, match=r"'mlp' matches no trainable parameter.*h\.0\.attn\.weight"):
        per_group_by_regex(params, names, {"mlp": 1.0, "fallback": 1.0})
    with pytest.raises(InputValueError, match=r"'attn\\\\.bias' matches only parameters an earlier regex took"):
        per_group_by_regex(params, names, {"attn": 1.0, r"attn\.bias": 0.1, "fallback": 1.0})
    with pytest.raises(InputValueError, match=r"\['lm_head.weight'\] match no regex.*no 'fallback' entry"):
        per_group_by_regex(params, names, {"attn": 1.0})
    with pytest.raises(InputValueError, match="not a valid regular expression"):
        per_group_by_regex(params, names, {"(": 1.0, "fallback": 1.0})
    with pytest.raises(InputValueError, match=r"clipping_norm\['attn'\] must be finite and > 0"):
        per_group_by_regex(params, names, {"attn": math.inf, "fallback": 1.0})


# --- AUTO-S -----------------------------------------------------------------------------------


def test_auto_s_bounds_every_contribution_and_costs_what_fixed_clipping_costs():
    plan = _plan(clipping_mode="auto", clipping_kwargs={"gamma": 0.01}, noise_multiplier=0.0)
    x = torch.zeros(2, 2 * D)
    x[0, :D] = 1e6  # huge: scaled to just under C = 1
    x[1, 0] = 0.02  # small: scaled up to C * 0.02 / (0.02 + gamma), not left at 0.02 as fixed clipping would
    (w, b), _ = _released(plan, _linear, x[:1])
    assert 1.0 - 1e-6 < float(torch.cat([w, b]).double().norm()) * plan.batch_size <= 1.0
    (w, _), _ = _released(plan, _linear, x[1:])
    assert float(w[0]) * plan.batch_size == pytest.approx(0.02 / 0.03, rel=1e-6)
    fixed_t, auto_t = (DPPlan(dataset_size=1000, batch_size=10, steps=20, target_epsilon=2.0, delta=1e-5, **kw)
                       for kw in ({}, {"clipping_mode": "auto"}))
    assert auto_t.noise_multiplier == fixed_t.noise_multiplier and auto_t.epsilon() == fixed_t.epsilon() <= 2.0
    assert auto_t.step_cost == fixed_t.step_cost and dict(auto_t.clipping_kwargs) == {"gamma": 0.01}
    noise, _ = _released(_plan(clipping_mode="auto", clipping_norm=2.0), _zero, torch.zeros(3, 2 * D))
    assert float(noise[0].std()) == pytest.approx(1.3 * 2.0 / 10, rel=5 / math.sqrt(2 * D))


# --- adaptive ---------------------------------------------------------------------------------


def test_adaptive_accounting_charges_the_count_as_computed_by_hand():
    plan = _plan(clipping_mode="adaptive", clipping_kwargs={"count_noise_multiplier": 2.0})
    z, sb, q, t = plan.noise_multiplier, 2.0, plan.sample_rate, plan.steps
    by_hand = dpsgd_acc.poisson(dpsgd_acc.adaptive_clipping_gaussian(z, sb), q) * t
    accountant = plan.accountant()
    for step in range(t):
        accountant.step(plan.step_cost_at(step))
    assert accountant.spent_epsilon(1e-5) == pytest.approx(by_hand.epsilon_at(1e-5), rel=1e-4)
    assert plan.epsilon() == pytest.approx(by_hand.epsilon_at(1e-5), rel=1e-12)
    z_eff = (z**-2 + (2 * sb) ** -2) ** -0.5  # Andrew et al.'s effective noise multiplier, 1.2476
    same = (dpsgd_acc.poisson(dpsgd_acc.gaussian(z_eff), q) * t).epsilon_at(1e-5)
    assert plan.epsilon() == pytest.approx(same, rel=1e-9)
    assert plan.epsilon() > _plan().epsilon()  # the count costs something


def test_adaptive_calibration_targets_the_combined_mechanism():
    fixed = _plan(noise_multiplier=None, target_epsilon=2.0)
    plan = _plan(noise_multiplier=None, target_epsilon=2.0, clipping_mode="adaptive",
                 clipping_kwargs={"count_noise_multiplier": 2.0})
    assert 2.0 * (1 - 1e-3) <= plan.epsilon() <= 2.0
    assert plan.noise_multiplier > fixed.noise_multiplier  # more gradient noise pays for the count
    z_eff = (plan.noise_multiplier**-2 + 4.0**-2) ** -0.5
    assert z_eff == pytest.approx(fixed.noise_multiplier, rel=1e-3)
    assert DPPlan(**json.loads(json.dumps(plan.to_dict()))) == plan
    with pytest.raises(InputValueError, match=r"count_noise_multiplier'\]=0.05 is too small for target_epsilon"):
        _plan(noise_multiplier=None, target_epsilon=2.0, clipping_mode="adaptive",
              clipping_kwargs={"count_noise_multiplier": 0.05})


def test_adaptive_clip_norm_moves_and_the_noise_follows_it():
    plan = _plan(clipping_mode="adaptive", clipping_kwargs={"count_noise_multiplier": 0.5, "learning_rate": 0.5})
    assert dict(plan.clipping_kwargs) == {"count_noise_multiplier": 0.5, "learning_rate": 0.5, "target_quantile": 0.5}
    params = (torch.zeros(D), torch.zeros(D))
    pipe = plan.pipeline(_linear, sgd(1.0), key=key(7), count_key=key(8), batch_argnums=(1,))
    state = pipe.init(params)
    x = torch.full((10, 2 * D), 10.0)  # every gradient far above the initial norm 1: the norm grows
    norms = [state["clip"].clipping_norm]
    for _ in range(3):
        _, state = pipe.update((x,), state, params)
        norms.append(state["clip"].clipping_norm)
    assert norms[0] == 1.0 and all(b > a for a, b in zip(norms, norms[1:]))
    # step t's noise is scaled to that step's norm: measured on a zero gradient
    zero = plan.pipeline(_zero, sgd(1.0), key=key(7), count_key=key(8), batch_argnums=(1,))
    zstate = {**zero.init(params), "clip": state["clip"]}
    updates, _ = zero.update((torch.zeros(3, 2 * D),), zstate, params)
    expected = plan.noise_multiplier * norms[-1] / plan.batch_size
    assert float(torch.cat(updates).std()) == pytest.approx(expected, rel=5 / math.sqrt(4 * D))
    # the pipeline's own report does not give the gradient-only epsilon, which would leave the count out
    report = pipe.privacy_report(sample_rate=plan.sample_rate, steps=plan.steps, delta=plan.delta)
    assert report.private and report.epsilon is None and plan.epsilon() > _plan().epsilon()
    with pytest.raises(InputValueError, match="needs count_key"):
        plan.pipeline(_linear, sgd(1.0), key=key(7), batch_argnums=(1,))
    with pytest.raises(InputValueError, match="count_key=...\\) applies to clipping_mode='adaptive' only"):
        _plan().pipeline(_linear, sgd(1.0), key=key(7), count_key=key(8), batch_argnums=(1,))


# --- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("kw", "error", "match"), [
    ({"clipping_mode": "adaptive", "mechanism": "band_mf", "bands": 4, "sampling": "cyclic_poisson"},
     InputValueError, "clipping_mode='adaptive' needs mechanism='gaussian'.*Use clipping_mode='fixed' or 'auto'"),
    ({"clipping_mode": "adaptive", "clipping_norm": "groups"}, InputValueError,
     "clipping_mode='adaptive' takes one clipping_norm.*Use clipping_mode='fixed' for per-group"),
    ({"clipping_mode": "auto", "clipping_norm": "groups"}, InputValueError, "clipping_mode='auto' takes one"),
    ({"clipping_mode": "adaptive", "clipping_kwargs": {"count_noise_multiplier": 0.0}}, InputValueError,
     "count_noise_multiplier'\\]=0 releases the exact clipped count"),
    ({"clipping_mode": "fixed", "clipping_kwargs": {"gamma": 0.1}}, InputValueError,
     r"clipping_kwargs \['gamma'\] do not apply to clipping_mode='fixed', which takes none"),
    ({"clipping_mode": "auto", "clipping_kwargs": {"target_quantile": 0.5}}, InputValueError,
     r"\['target_quantile'\] do not apply to clipping_mode='auto', which takes \['gamma'\]"),
    ({"clipping_mode": "adaptive", "clipping_kwargs": {"target_quantile": 1.5}}, InputValueError,
     r"clipping_kwargs\['target_quantile'\] must be in \(0, 1\)"),
    ({"clipping_mode": "AUTO"}, InputValueError, "clipping_mode"),
    ({"clipping_kwargs": [("gamma", 1.0)]}, InputTypeError, "clipping_kwargs must be a dict"),
    ({"clipping_norm": {"attn": 1.0, "fallback": 1.0}}, InputValueError, "per_group_by_regex"),
    ({"clipping_norm": PerGroup({(0,): "a"}, {"a": math.inf})}, InputValueError, "finite and > 0"),
])
def test_unsound_or_malformed_clipping_settings_are_refused_naming_the_fix(kw, error, match):
    if kw.get("clipping_norm") == "groups":
        kw = {**kw, "clipping_norm": _groups()}
    with pytest.raises(error, match=match):
        _plan(**kw)


def test_a_non_private_adaptive_baseline_may_release_the_exact_count():
    plan = _plan(noise_multiplier=0.0, clipping_mode="adaptive", clipping_kwargs={"count_noise_multiplier": 0.0})
    assert plan.epsilon() == math.inf and plan.step_cost == acc.nonprivate()
