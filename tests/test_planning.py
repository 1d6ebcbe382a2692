"""The parts a DPPlan composes (opake_fx.planning): registries, derived tables, and that the
composed accounting is, to the bit, the accounting each pair had before the parts existed."""

from __future__ import annotations

import pytest

import opake_fx.dpftrl.accounting as mf_acc
import opake_fx.dpsgd.accounting as dpsgd_acc
from opake_fx.accounting import compose
from opake_fx.dpsgd import clip, noise
from opake_fx.errors import InputValueError
from opake_fx.plan import CLIPPING_KWARGS, COMPATIBLE, DPPlan
from opake_fx.planning.mechanisms import MECHANISMS
from opake_fx.planning.registry import Registry
from opake_fx.planning.samplers import SAMPLING, PoissonSampling
from opake_fx.random import key
from opake_fx.transforms import named_chain

BASE = dict(dataset_size=600, batch_size=20, steps=30, noise_multiplier=1.3, delta=1e-5)


def test_the_tables_are_derived_from_the_parts_and_are_the_published_ones():
    assert COMPATIBLE == {
        "gaussian": ("poisson", "truncated_poisson"),
        "band_mf": ("cyclic_poisson", "b_min_sep", "balls_in_bins"),
        "bsr": ("cyclic_poisson", "b_min_sep", "balls_in_bins"),
        "blt": ("b_min_sep", "balls_in_bins"),
    }
    assert CLIPPING_KWARGS == {"fixed": {}, "auto": {"gamma": 0.01},
                               "adaptive": {"target_quantile": 0.5, "learning_rate": 0.2, "count_noise_multiplier": None}}


def test_registry_refuses_unknown_and_duplicate_names_and_lists_the_valid_ones():
    with pytest.raises(InputValueError, match=r"sampling must be one of \('poisson', 'truncated_poisson'"):
        SAMPLING.get("uniform")
    with pytest.raises(InputValueError, match="registered already"):
        Registry("sampling", [PoissonSampling(), PoissonSampling()])
    registry = Registry("sampling", [PoissonSampling()])
    with pytest.raises(InputValueError, match="sampling registry: sampling must be one of"):
        registry.unregister("cyclic")
    registry.unregister("poisson")
    assert registry.names() == ()


@pytest.mark.parametrize("extra", [{}, {"clipping_mode": "auto"}, {"clipping_mode": "adaptive"},
                                   {"sampling": "truncated_poisson", "max_batch_size": 30}])
def test_gaussian_plans_cost_what_dpsgd_accounting_says(extra):
    plan = DPPlan(**BASE, **extra)
    q, nm = plan.sample_rate, plan.noise_multiplier
    release = (dpsgd_acc.adaptive_clipping_gaussian(nm, plan.clipping_kwargs["count_noise_multiplier"])
               if plan.clipping_mode == "adaptive" else dpsgd_acc.gaussian(nm))
    step = (dpsgd_acc.truncated_poisson(release, q, plan.dataset_size, 30) if plan.sampling == "truncated_poisson"
            else dpsgd_acc.poisson(release, q))
    assert plan.step_cost == step
    assert plan.run_cost(nm, 7) == step * 7
    assert plan.epsilon() == (step * plan.steps).epsilon_at(plan.delta)


@pytest.mark.parametrize("mechanism", ["band_mf", "bsr"])
def test_cyclic_plans_cost_what_amplified_bandmf_says(mechanism):
    plan = DPPlan(**BASE, mechanism=mechanism, sampling="cyclic_poisson", bands=3)
    p = plan.participation
    sens = plan.strategy.sensitivity(p.min_sep, p.max_participations, n=p.steps)
    whole = mf_acc.poisson(plan.noise_multiplier, plan.strategy, plan.group_rate, partitions=3, noise_sensitivity=sens)
    steps = mf_acc.poisson_steps(plan.noise_multiplier, plan.strategy, plan.group_rate, partitions=3,
                                 noise_sensitivity=sens)
    assert plan.run_cost(plan.noise_multiplier, plan.steps) == whole
    assert [plan.step_cost_at(t) for t in range(plan.steps)] == steps
    assert plan.epsilon() == whole.epsilon_at(plan.delta)


@pytest.mark.parametrize("extra", [
    {"mechanism": "blt", "sampling": "b_min_sep", "min_sep": 5},
    {"mechanism": "band_mf", "sampling": "balls_in_bins", "min_sep": 10, "bands": 2, "batch_size": None},
])
def test_min_separation_plans_cost_the_whole_run_as_one_gaussian(extra):
    plan = DPPlan(**{**BASE, **extra})
    p = plan.participation
    whole = mf_acc.mf_gaussian(plan.noise_multiplier, plan.strategy, p.min_sep, p.max_participations, n_steps=p.steps)
    assert plan.run_cost(plan.noise_multiplier, plan.steps) == whole
    increments = mf_acc.mf_gaussian_steps(plan.noise_multiplier, plan.strategy, p.min_sep, p.max_participations,
                                          n_steps=p.steps)
    assert [plan.step_cost_at(t) for t in range(plan.steps)] == increments
    assert plan.spent_after(7) == compose(*increments[:7])


def test_privacy_report_and_the_plan_agree_on_epsilon():
    plan = DPPlan(**BASE)
    f = lambda p, x: ((x - p) ** 2).sum()  # noqa: E731
    pipe = named_chain(("clip", clip(f, clipping_norm=1.0, batch_argnums=(1,), normalize_by=plan.batch_size)),
                       ("noise", noise(noise_multiplier=plan.noise_multiplier, key=key(0))))
    report = pipe.privacy_report(sample_rate=plan.sample_rate, steps=plan.steps, delta=plan.delta)
    assert report.epsilon == plan.epsilon()


def test_a_field_no_part_uses_is_refused_naming_the_parts_that_use_it():
    with pytest.raises(InputValueError, match=r"bands applies to mechanism='band_mf' or 'bsr' only; mechanism='blt'"):
        DPPlan(**BASE, mechanism="blt", sampling="b_min_sep", min_sep=5, bands=2)
    with pytest.raises(InputValueError, match=r"min_sep applies to sampling='b_min_sep' or 'balls_in_bins' only"):
        DPPlan(**BASE, min_sep=3)
    with pytest.raises(InputValueError, match=r"max_batch_size applies to sampling='truncated_poisson' only"):
        DPPlan(**BASE, max_batch_size=3)


def test_plan_parts_are_the_registered_objects():
    plan = DPPlan(**BASE, mechanism="bsr", sampling="cyclic_poisson", bands=2, clipping_mode="auto")
    assert plan.parts.sampling is SAMPLING.get("cyclic_poisson")
    assert plan.parts.mechanism is MECHANISMS.get("bsr")
    assert plan.parts.clip_mode.name == "auto"
