"""DPPlan: one value from which the sampler, the pipeline and the accountant are derived."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

import opake_fx.accounting as acc
import opake_fx.dpsgd.accounting as dpsgd_acc
from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.optimizers import sgd
from opake_fx.plan import COMPATIBLE, DPPlan, Participation
from opake_fx.random import key
from opake_fx.transforms import apply_updates

N, B, STEPS = 10_000, 64, 500


def _plan(**kw) -> DPPlan:
    args = dict(dataset_size=N, batch_size=B, steps=STEPS, target_epsilon=3.0, delta=1e-5)
    args.update(kw)
    return DPPlan(**args)


def test_the_plan_calibrates_once_and_everything_reads_it():
    plan = _plan()
    # the plan calibrates 1e-4 (relative) below its target, so the accountant's step-by-step
    # composition (within ~1e-6 of the one-shot one) never refuses the plan's last step
    direct = acc.calibrate(acc.epsilon_budget(3.0 * (1 - 1e-4), 1e-5),
                           lambda s: dpsgd_acc.poisson(dpsgd_acc.gaussian(s), B / N) * STEPS)
    assert plan.noise_multiplier == direct.param and plan.sample_rate == B / N and plan.epochs == STEPS * B / N
    assert 3.0 * (1 - 1e-3) <= plan.epsilon() <= 3.0
    assert plan.step_cost == dpsgd_acc.poisson(dpsgd_acc.gaussian(plan.noise_multiplier), B / N)
    assert plan.epsilon(STEPS // 2) < plan.epsilon()


def test_the_plan_is_a_serialisable_value_that_rebuilds_without_recalibrating():
    plan = _plan(steps=None, epochs=3.2)  # steps from epochs
    assert plan.steps == 500
    data = json.loads(json.dumps(plan.to_dict()))
    assert DPPlan(**data) == plan
    with pytest.raises(InputValueError, match="does not meet target_epsilon"):
        DPPlan(**{**data, "noise_multiplier": 0.5 * plan.noise_multiplier})
    with pytest.raises(Exception):  # frozen
        plan.noise_multiplier = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"batch_size": 64, "sample_rate": 0.01}, InputValueError, "disagree"),
        ({"steps": 500, "epochs": 1.0}, InputValueError, "disagree"),
        ({"batch_size": None}, InputValueError, "batch_size"),
        ({"steps": None}, InputValueError, "steps or epochs"),
        ({"target_epsilon": None}, InputValueError, "privacy target"),
        ({"delta": None}, InputValueError, "needs delta"),
        ({"delta": 2.0}, InputValueError, "delta must be in"),
        ({"clipping_norm": 0.0}, InputValueError, "clipping_norm"),
        ({"clipping_norm": "1"}, InputTypeError, "clipping_norm"),
        ({"steps": 1.5}, InputTypeError, "steps"),
        ({"sampling": "shuffle"}, InputValueError, "sampling must be one of"),
        ({"sampling": "truncated_poisson"}, InputValueError, "max_batch_size"),
        ({"max_batch_size": 100}, InputValueError, "'truncated_poisson' only"),
        ({"batch_size": 2 * N}, InputValueError, "batch_size must be in"),
    ],
)
def test_missing_or_contradictory_fields_are_refused(kw, error, match):
    with pytest.raises(error, match=match):
        _plan(**kw)


def test_a_zero_noise_plan_is_an_explicit_baseline_with_epsilon_inf():
    plan = _plan(target_epsilon=None, noise_multiplier=0.0)
    assert plan.epsilon() == math.inf
    with pytest.raises(InputValueError, match="non-private baseline"):
        plan.accountant()
    fixed = _plan(target_epsilon=None, noise_multiplier=1.0)
    assert fixed.accountant().budget.epsilon == pytest.approx(fixed.epsilon() * (1 + 1e-4), rel=1e-12)


def test_the_sampler_has_the_plans_rate_and_steps_and_shards_by_rank():
    plan = _plan(dataset_size=1000, batch_size=50, steps=40)
    data = list(range(1000))
    s = plan.sampler(data, key(3))
    assert (s.sample_rate, s.n_steps, len(s)) == (0.05, 40, 40)
    sizes = [len(b) for b in s]
    assert abs(sum(sizes) / 40 - 50) < 5 * math.sqrt(50 / 40)  # mean batch size ~ 50
    shards = [plan.sampler(data, key(3), rank=r, world_size=2) for r in range(2)]
    first = [set(shards[r].batch(0)) for r in range(2)]
    assert all(i < 500 for i in first[0]) and all(i >= 500 for i in first[1])
    with pytest.raises(InputValueError, match="dataset_size"):
        plan.sampler(list(range(999)), key(3))
    truncated = _plan(dataset_size=1000, batch_size=50, steps=40, sampling="truncated_poisson", max_batch_size=60)
    assert max(len(b) for b in truncated.sampler(data, key(3))) <= 60
    assert truncated.step_cost == dpsgd_acc.truncated_poisson(dpsgd_acc.gaussian(truncated.noise_multiplier), 0.05, 1000, 60)
    with pytest.raises(InputValueError, match="truncated_poisson"):
        truncated.sampler(data, key(3), rank=0, world_size=2)


def test_the_pipeline_and_accountant_match_the_plan():
    plan = _plan(dataset_size=1000, batch_size=50, steps=20, target_epsilon=2.0)
    f = lambda p, x: ((x - p) ** 2).sum()  # noqa: E731
    pipeline = plan.pipeline(f, sgd(0.1), key=key(0), batch_argnums=(1,))
    report = pipeline.privacy_report(sample_rate=plan.sample_rate, steps=plan.steps, delta=plan.delta)
    assert report.private and report.noise_multiplier == plan.noise_multiplier
    assert report.sensitivity == 1.0 / 50 and report.epsilon == plan.epsilon()
    accountant, state, p = plan.accountant(), pipeline.init(torch.zeros(3)), torch.zeros(3)
    data = torch.randn(1000, 3, generator=torch.Generator().manual_seed(0))
    for batch in plan.sampler(list(range(1000)), key(1)):
        accountant.step(plan.step_cost)
        updates, state = pipeline.update((data[batch],), state, p)
        p = apply_updates(p, updates)
    assert accountant.spent == plan.step_cost * plan.steps
    assert accountant.spent_epsilon(plan.delta) == pytest.approx(plan.epsilon(), rel=1e-9)
    assert plan.epsilon() <= 2.0
    assert state["noise"].step == plan.steps


def test_one_key_in_two_roles_is_refused_and_changes_nothing():
    plan = _plan(dataset_size=1000, batch_size=50, steps=20, target_epsilon=2.0)
    f = lambda p, x: ((x - p) ** 2).sum()  # noqa: E731
    plan.sampler(list(range(1000)), key(1))
    with pytest.raises(InputValueError, match="already this plan's sampler key"):
        plan.pipeline(f, sgd(0.1), key=key(1), batch_argnums=(1,))
    # a rank's derived sampler key is the sampler's too
    from opake_fx.random import fold_in

    plan.sampler(list(range(1000)), key(2), rank=1, world_size=2)
    with pytest.raises(InputValueError, match="sampler key"):
        plan.pipeline(f, sgd(0.1), key=fold_in(key(2), 1), batch_argnums=(1,))
    # the same key again in the same role is fine (rebuilding a pipeline to resume)
    plan.pipeline(f, sgd(0.1), key=key(0), batch_argnums=(1,))
    plan.pipeline(f, sgd(0.1), key=key(0), batch_argnums=(1,))
    with pytest.raises(InputValueError, match="already this plan's noise key"):
        plan.sampler(list(range(1000)), key(0))
    adaptive = _plan(dataset_size=1000, batch_size=50, steps=20, target_epsilon=2.0, clipping_mode="adaptive")
    with pytest.raises(InputValueError, match="noise key; the count key"):
        adaptive.pipeline(f, sgd(0.1), key=key(5), count_key=key(5), batch_argnums=(1,))
    # the refused call recorded nothing: key(5) may still be the sampler's
    adaptive.sampler(list(range(1000)), key(5))
    # the roles are not part of the plan's value
    assert plan == _plan(dataset_size=1000, batch_size=50, steps=20, target_epsilon=2.0)
    assert "_key_roles" not in plan.to_dict()


def _script():
    spec = importlib.util.spec_from_file_location("plan_digits", Path(__file__).parents[1] / "examples" / "plan_digits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_digits_script_trains_within_its_budget(capsys):
    pytest.importorskip("sklearn")
    acc_ = _script().main(["2"])
    out = capsys.readouterr().out
    assert acc_ > 0.3  # far above chance after 2 epochs at epsilon 3
    spent = float(out.split("epsilon spent ")[1].split(" ")[0])
    assert 2.99 <= spent <= 3.0


@pytest.mark.slow
def test_the_digits_script_reaches_the_demos_accuracy():
    pytest.importorskip("sklearn")
    assert _script().main([]) >= 0.85  # the demo's DP-SGD run reaches ~0.90 at epsilon 3; measured 0.900


def test_the_readme_plan_example_runs_as_written():
    import re

    readme = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    code = re.search(r"## The plan\n\n```python\n(.*?)```", readme, re.S).group(1)
    namespace: dict = {}
    torch.manual_seed(0)
    exec(code, namespace)  # noqa: S102 - the README's own code (its data and model included)
    plan, accountant = namespace["plan"], namespace["accountant"]
    steps = round(plan.epochs / plan.sample_rate)  # 5 epochs of 512 examples in batches of 64
    assert plan.steps == steps == 40 and accountant.spent == plan.step_cost * steps
    assert accountant.spent_epsilon(1e-5) <= 3.0 and accountant.epsilon == accountant.spent_epsilon(1e-5)


def _mf_plan(**kw) -> DPPlan:
    args = dict(dataset_size=1000, batch_size=25, steps=40, target_epsilon=2.0, delta=1e-5, mechanism="band_mf",
                bands=4, sampling="cyclic_poisson")
    args.update(kw)
    return DPPlan(**args)


def test_a_dpftrl_plan_trains_and_its_accountant_spends_the_whole_run_value_computed_by_hand():
    import opake_fx.dpftrl.accounting as mf_acc
    from opake_fx.dpftrl import band_mf_strategy
    from opake_fx.dpftrl.sampling import CyclicPoissonSampler

    plan = _mf_plan()
    assert plan.group_rate == pytest.approx(25 * 4 / 1000)
    by_hand = mf_acc.poisson(plan.noise_multiplier, band_mf_strategy(40, 4), 0.1, partitions=4)
    assert 2.0 * (1 - 1e-3) <= by_hand.epsilon_at(1e-5) <= 2.0
    sampler = plan.sampler(list(range(1000)), key(1))
    assert isinstance(sampler, CyclicPoissonSampler) and (sampler.partitions, sampler.n_steps) == (4, 40)
    f = lambda p, x: ((x - p) ** 2).sum()  # noqa: E731
    pipeline = plan.pipeline(f, sgd(0.1), key=key(0), batch_argnums=(1,))
    assert pipeline.privacy_report().mechanism == "mf_gaussian"
    accountant, state, p = plan.accountant(), pipeline.init(torch.zeros(3)), torch.zeros(3)
    data = torch.randn(1000, 3, generator=torch.Generator().manual_seed(0)) + 2.0
    for step, batch in enumerate(sampler):
        accountant.step(plan.step_cost_at(step))
        updates, state = pipeline.update((data[batch],), state, p)
        p = apply_updates(p, updates)
    assert accountant.spent == by_hand  # ceil(40 / 4) Poisson-subsampled Gaussian opportunities
    assert accountant.spent_epsilon(1e-5) == pytest.approx(by_hand.epsilon_at(1e-5), rel=1e-9)
    assert plan.epsilon() == by_hand.epsilon_at(1e-5) and state["noise"].step == 40
    assert float(p.norm()) > 0  # it moved toward the data
    with pytest.raises(InputValueError, match="step_cost_at"):
        plan.step_cost  # noqa: B018


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"sampling": "poisson"},
         r"mechanism='band_mf' takes sampling in \('cyclic_poisson', 'b_min_sep', 'balls_in_bins'\)"),
        ({"bands": None}, "needs bands"),
        ({"batch_size": 300}, "exceeds dataset_size"),
        ({"mechanism": "gaussian"}, "does not go with mechanism='gaussian'.*valid pairs are gaussian: poisson"),
        ({"mechanism": "gaussian", "sampling": "poisson"}, "bands applies"),
        ({"mechanism": "blt", "bands": None}, "does not go with mechanism='blt'.*'b_min_sep', 'balls_in_bins'"),
        ({"mechanism": "blt", "bands": None, "sampling": "poisson"}, "does not go with mechanism='blt'"),
        ({"min_sep": 4}, "min_sep applies"),
        ({"sampling": "b_min_sep"}, "needs min_sep"),
        ({"sampling": "b_min_sep", "min_sep": 50}, "batch_size \\* min_sep = 1250.0 exceeds"),
        ({"sampling": "balls_in_bins", "min_sep": 50, "batch_size": None}, "exceed steps=40"),
        ({"sampling": "balls_in_bins", "min_sep": 10}, "not batch_size=25"),
        ({"mechanism": "blt", "bands": 4, "sampling": "b_min_sep", "min_sep": 4}, "bands applies"),
        ({"mechanism": "bsr", "bands": None}, "needs bands"),
    ],
)
def test_dpftrl_plan_fields_must_fit_together(kw, match):
    with pytest.raises(InputValueError, match=match):
        _mf_plan(**kw)


@pytest.mark.parametrize("mechanism", ["band_mf", "blt"])
def test_the_digits_script_trains_a_dpftrl_plan(capsys, mechanism):
    pytest.importorskip("sklearn")
    acc_ = _script().main(["1", mechanism])
    out = capsys.readouterr().out
    assert acc_ > 0.2 and mechanism in out
    assert float(out.split("epsilon spent ")[1].split(" ")[0]) <= 3.0


@pytest.mark.parametrize("given", ["noise_multiplier", "target_epsilon"])
def test_the_plans_accountant_admits_every_step_of_the_plan(given):
    # The accountant composes step by step; the plan must leave it room for its own last step.
    kw = {"noise_multiplier": 1.0} if given == "noise_multiplier" else {"target_epsilon": 2.0}
    plan = DPPlan(dataset_size=40, batch_size=8, steps=6, delta=1e-5, **kw)  # refused its last step before
    accountant = plan.accountant()
    for t in range(plan.steps):
        accountant.step(plan.step_cost_at(t))
    assert accountant.spent_epsilon(1e-5) <= accountant.budget.epsilon
    if given == "target_epsilon":
        assert accountant.spent_epsilon(1e-5) <= 2.0


def _participations(batches: list[list[int]]) -> dict[int, list[int]]:
    seen: dict[int, list[int]] = {}
    for t, batch in enumerate(batches):
        for i in batch:
            seen.setdefault(i, []).append(t)
    return seen


def test_a_blt_plan_under_b_min_sep_trains_and_its_accountant_spends_the_whole_run_value_computed_by_hand():
    import opake_fx.dpftrl.accounting as mf_acc
    from opake_fx.dpftrl import blt_strategy
    from opake_fx.dpftrl.sampling import MinSepSampler

    n, b, steps, sep = 400, 20, 60, 10
    plan = DPPlan(dataset_size=n, batch_size=b, steps=steps, target_epsilon=2.0, delta=1e-5, mechanism="blt",
                  sampling="b_min_sep", min_sep=sep)
    # the one participation value: at least 10 steps apart, at most ceil(60 / 10) = 6 times, no amplification
    assert plan.participation == Participation(steps=60, min_sep=10, max_participations=6, amplified=False)
    # by hand: the BLT optimised for that pattern, its sensitivity, the whole run as one Gaussian mechanism
    strategy = blt_strategy(steps, min_sep=sep, max_participations=6)
    assert plan.strategy.buf_decay.tolist() == strategy.buf_decay.tolist()
    sens = strategy.sensitivity(sep, 6)
    assert sens > 1.5  # several participations: far above the per-participation sensitivity 1
    by_hand = mf_acc.mf_gaussian(plan.noise_multiplier, strategy, sep, 6)
    assert 2.0 * (1 - 1e-3) <= by_hand.epsilon_at(1e-5) <= 2.0 and plan.epsilon() == by_hand.epsilon_at(1e-5)

    f = lambda p, x: ((x - p) ** 2).sum()  # noqa: E731
    pipeline = plan.pipeline(f, sgd(0.1), key=key(0), batch_argnums=(1,))
    noise_report = pipeline.privacy_report().stages[2]
    # the noise stage scaled z to the same pattern's sensitivity: std = sigma * sens * C / batch_size
    assert noise_report.noise_stddev == pytest.approx(plan.noise_multiplier * sens * 1.0 / b, rel=1e-12)
    sampler = plan.sampler(list(range(n)), key(1))
    assert isinstance(sampler, MinSepSampler) and sampler.warm_start and sampler.min_sep == sep
    assert sampler.expected_batch_size == pytest.approx(b)
    accountant, state, p = plan.accountant(), pipeline.init(torch.zeros(3)), torch.zeros(3)
    data = torch.randn(n, 3, generator=torch.Generator().manual_seed(0)) + 2.0
    batches = []
    for step, batch in enumerate(sampler):
        accountant.step(plan.step_cost_at(step))
        updates, state = pipeline.update((data[batch],), state, p)
        p = apply_updates(p, updates)
        batches.append(batch)
    # the sampler kept the pattern the noise and the accounting assumed
    for times in _participations(batches).values():
        assert len(times) <= 6 and all(b2 - b1 >= sep for b1, b2 in zip(times, times[1:]))
    mean = sum(map(len, batches)) / steps
    assert abs(mean - b) < 6 * math.sqrt(b / steps)
    # the composed increments are the whole run (Gaussians compose exactly); the accountant's running
    # PLD composition of them is within its documented room (1e-4) of it
    assert accountant.spent.epsilon_at(1e-5) == pytest.approx(by_hand.epsilon_at(1e-5), rel=1e-9)
    assert accountant.spent_epsilon(1e-5) == pytest.approx(by_hand.epsilon_at(1e-5), rel=1e-5)
    # and from the raw numbers: mu = sensitivity / (noise std in units of the clip norm)
    mu = sens / (noise_report.noise_stddev * b)
    assert accountant.spent.epsilon_at(1e-5) == pytest.approx(dpsgd_acc.gaussian(1 / mu).epsilon_at(1e-5), rel=1e-9)
    assert plan.epsilon(30) < plan.epsilon() and state["noise"].step == steps
    assert float(p.norm()) > 0.5  # it moved toward the data
    with pytest.raises(InputValueError, match="step_cost_at"):
        plan.step_cost  # noqa: B018


def test_a_dpftrl_plans_noise_has_the_pattern_sensitivity():
    # one step of zero gradients: the update is the first row's noise, std sigma * sens * C / batch_size
    plan = DPPlan(dataset_size=400, batch_size=20, steps=60, noise_multiplier=1.0, delta=1e-5, mechanism="blt",
                  sampling="b_min_sep", min_sep=10)
    f = lambda p, x: (p * 0.0).sum() + (x * 0.0).sum()  # noqa: E731
    pipeline = plan.pipeline(f, sgd(1.0), key=key(5), batch_argnums=(1,))
    d = 20_000
    params = torch.zeros(d, dtype=torch.float64)
    updates, _ = pipeline.update((torch.zeros(20, 1, dtype=torch.float64),), pipeline.init(params), params)
    expected = plan.strategy.sensitivity(10, 6) / 20
    std = float(updates.std())
    assert abs(std / expected - 1) < 5 / math.sqrt(2 * d)  # the sample std's relative sd is 1/sqrt(2d)


def test_a_balls_in_bins_plan_accounts_its_cycle():
    import opake_fx.dpftrl.accounting as mf_acc
    from opake_fx.dpftrl import bsr_strategy
    from opake_fx.dpftrl.sampling import BallsInBinsSampler

    plan = DPPlan(dataset_size=300, steps=30, target_epsilon=4.0, delta=1e-5, mechanism="bsr", bands=3,
                  sampling="balls_in_bins", min_sep=10)
    assert plan.batch_size == 30 and plan.participation == Participation(30, 10, 3, amplified=False)
    by_hand = mf_acc.mf_gaussian(plan.noise_multiplier, bsr_strategy(30, 3), 10, 3)
    assert plan.epsilon() == pytest.approx(by_hand.epsilon_at(1e-5), rel=1e-12) and plan.epsilon() <= 4.0
    sampler = plan.sampler(list(range(300)), key(2))
    assert isinstance(sampler, BallsInBinsSampler) and sampler.cycle_length == 10
    batches = list(sampler)
    assert all(len(t) == 3 and t[1] - t[0] == 10 for t in _participations(batches).values())
    accountant = plan.accountant()
    for t in range(plan.steps):
        accountant.step(plan.step_cost_at(t))
    assert accountant.spent.epsilon_at(1e-5) == pytest.approx(by_hand.epsilon_at(1e-5), rel=1e-9)
    assert accountant.spent_epsilon(1e-5) == pytest.approx(by_hand.epsilon_at(1e-5), rel=1e-5)
    # across two ranks: disjoint shards, each example still in exactly one bin
    shards = [plan.sampler(list(range(300)), key(2), rank=r, world_size=2) for r in range(2)]
    union = sorted(i for r in range(2) for t in range(10) for i in shards[r].batch(t))
    assert union == list(range(300))


def test_a_bsr_plan_under_cyclic_poisson_is_amplified_bandmf():
    import opake_fx.dpftrl.accounting as mf_acc
    from opake_fx.dpftrl import bsr_strategy

    plan = DPPlan(dataset_size=1000, batch_size=25, steps=40, target_epsilon=2.0, delta=1e-5, mechanism="bsr", bands=4,
                  sampling="cyclic_poisson")
    assert plan.participation == Participation(40, 4, 1, amplified=True)
    by_hand = mf_acc.poisson(plan.noise_multiplier, bsr_strategy(40, 4), 0.1, partitions=4)
    accountant = plan.accountant()
    for t in range(plan.steps):
        accountant.step(plan.step_cost_at(t))
    assert accountant.spent == by_hand and plan.epsilon() == by_hand.epsilon_at(1e-5) <= 2.0


@pytest.mark.parametrize("mechanism", ["band_mf", "blt"])
def test_dpftrl_plans_round_trip_through_to_dict(mechanism):
    kw = {"bands": 2} if mechanism == "band_mf" else {}
    plan = DPPlan(dataset_size=200, batch_size=10, steps=20, target_epsilon=3.0, delta=1e-5, mechanism=mechanism,
                  sampling="b_min_sep", min_sep=5, **kw)
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["min_sep"] == 5 and DPPlan(**data) == plan
    assert DPPlan(**data).epsilon() == plan.epsilon()
    with pytest.raises(InputValueError, match="does not meet target_epsilon"):
        DPPlan(**{**data, "noise_multiplier": 0.5 * plan.noise_multiplier})


def test_every_sampler_has_a_mechanism_and_every_listed_pair_builds():
    from opake_fx.plan import MECHANISMS, SAMPLERS

    assert set(COMPATIBLE) == set(MECHANISMS) and {s for v in COMPATIBLE.values() for s in v} == set(SAMPLERS)
    extra = {"truncated_poisson": {"max_batch_size": 20}, "b_min_sep": {"min_sep": 4}, "balls_in_bins": {"min_sep": 4}}
    for mechanism, samplers in COMPATIBLE.items():
        for sampling in samplers:
            kw = dict(extra.get(sampling, {}))
            if mechanism in ("band_mf", "bsr"):
                kw["bands"] = 2
            if sampling != "balls_in_bins":
                kw["batch_size"] = 10
            plan = DPPlan(dataset_size=40, steps=8, noise_multiplier=2.0, delta=1e-5, mechanism=mechanism,
                          sampling=sampling, **kw)
            assert 0 < plan.epsilon() < math.inf and len(plan.sampler(list(range(40)), key(0))) == 8


@pytest.mark.parametrize("mode", ["fixed", "auto", "adaptive"])
@pytest.mark.parametrize("microbatch_size", [None, 2])
def test_record_loss_records_the_clipping_passs_losses_and_changes_no_update(mode, microbatch_size):
    plan = _plan(dataset_size=1000, batch_size=5, steps=20, target_epsilon=None, noise_multiplier=1.0, clipping_mode=mode)
    f = lambda p, x: ((x - p) ** 2).sum()  # noqa: E731
    extra = {"count_key": key(7)} if mode == "adaptive" else {}
    made = {r: plan.pipeline(f, sgd(0.1), key=key(0), batch_argnums=(1,), microbatch_size=microbatch_size,
                             record_loss=r, **extra) for r in (False, True)}
    p = torch.zeros(3)
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0)) * 3
    mask = torch.tensor([True, True, False, True, False])
    plain_state, state = made[False].init(p), made[True].init(p)
    assert float(state["clip"].loss_count) == 0.0  # before any step
    for example_mask in (None, mask, torch.zeros(5, dtype=torch.bool)):
        masked = {} if example_mask is None else {"example_mask": example_mask}
        want_updates, plain_state = made[False].update((x,), plain_state, p, **masked)
        updates, state = made[True].update((x,), state, p, **masked)
        torch.testing.assert_close(updates, want_updates, rtol=0, atol=0)  # the release is the same, bit for bit
        real = torch.ones(5, dtype=torch.bool) if example_mask is None else example_mask
        per_example = ((x - p) ** 2).sum(dim=1).double()
        assert float(state["clip"].loss_count) == float(real.sum())
        assert float(state["clip"].loss_sum) == pytest.approx(float(per_example[real].sum()), rel=1e-6)
    if mode == "adaptive":
        assert state["clip"].clip_state.clipping_norm == plain_state["clip"].clipping_norm
    _, state = made[True].update((x[:0],), state, p)  # an empty batch records nothing
    assert float(state["clip"].loss_count) == 0.0 and float(state["clip"].loss_sum) == 0.0


def test_building_from_a_plan_changes_none_of_its_attributes():
    # The plan is frozen: the keys' roles are recorded in its KeyRoles ledger (one object,
    # made with the plan), and the strategy is a cached property of its fields.
    from opake_fx.plan import KeyRoles

    plan = _plan(dataset_size=1000, batch_size=50, steps=20, target_epsilon=2.0)
    ledger = plan.key_roles
    before = dict(vars(plan))
    f = lambda p, x: ((x - p) ** 2).sum()  # noqa: E731
    plan.sampler(list(range(1000)), key(1))
    plan.pipeline(f, sgd(0.1), key=key(0), batch_argnums=(1,))
    assert dict(vars(plan)) == before and plan.key_roles is ledger and isinstance(ledger, KeyRoles)
    assert ledger.role_of(key(1)) == "sampler" and ledger.role_of(key(0)) == "noise"
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.steps = 3
