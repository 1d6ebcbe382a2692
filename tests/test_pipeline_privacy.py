"""A pipeline without noise is refused unless it says noise_multiplier=0; privacy_report."""

from __future__ import annotations

import math

import pytest
import torch

import opake_fx.dpsgd.accounting as dpsgd_acc
from opake_fx import dpftrl
from opake_fx.distributed import psum
from opake_fx.dpsgd import clip, noise
from opake_fx.dpsgd.clipping import adaptive_clipped_grad, as_stage, per_group
from opake_fx.errors import InputTypeError, OperationError
from opake_fx.optimizers import adam, sgd
from opake_fx.random import key
from opake_fx.transforms import apply_updates, chain, identity, named_chain, stateless


def _loss(p, x):
    return ((x - p) ** 2).sum()


def _clip(normalize_by: float = 4.0):
    return clip(_loss, clipping_norm=1.0, batch_argnums=(1,), normalize_by=normalize_by)


@pytest.mark.parametrize(
    "build",
    [
        lambda: chain(_clip(), adam(0.1)),
        lambda: chain(_clip(), psum(), sgd(0.1)),
        lambda: named_chain(("clip", _clip()), ("id", identity()), ("opt", sgd(0.1))),
        lambda: chain(_clip(), chain(psum(), adam(0.1))),  # nested chains are read through
        lambda: chain(chain(_clip(), psum()), adam(0.1)),
    ],
)
def test_a_pipeline_with_clip_but_no_noise_is_refused_at_build_time(build):
    with pytest.raises(OperationError, match="without a noise stage"):
        build()


def test_a_gradient_stage_before_clip_is_refused():
    with pytest.raises(OperationError, match="receive the data batch"):
        named_chain(("opt", sgd(0.1)), ("clip", _clip()), ("noise", noise(noise_multiplier=1.0, key=key(0))))
    with pytest.raises(OperationError, match="receive the data batch"):
        chain(noise(noise_multiplier=1.0, key=key(0)), _clip())


def test_the_explicit_zero_noise_baseline_runs_and_reports_epsilon_inf():
    pipe = named_chain(("clip", _clip()), ("psum", psum()), ("noise", noise(noise_multiplier=0.0, key=key(0))),
                       ("opt", sgd(0.1)))
    p = torch.zeros(2)
    updates, _ = pipe.update((torch.ones(4, 2),), pipe.init(p), p)
    assert apply_updates(p, updates).shape == (2,)
    report = pipe.privacy_report(sample_rate=0.01, steps=100, delta=1e-5)
    assert not report.private and report.epsilon == math.inf and report.noise_multiplier == 0.0
    assert "explicit non-private baseline" in str(report)


def test_a_clip_only_sub_chain_builds_but_its_output_cannot_reach_an_optimizer():
    sub = chain(_clip(), psum())  # no optimizer: a building block, allowed
    p = torch.zeros(2)
    clipped, _ = sub.update((torch.ones(4, 2),), sub.init(p), p)
    for opt in (sgd(0.1), adam(0.1)):
        with pytest.raises(InputTypeError, match="never noised"):
            opt.update(clipped, opt.init(p), p)
    assert not sub.privacy_report().private and sub.privacy_report().epsilon == math.inf


def test_report_of_a_private_dpsgd_pipeline_matches_the_accountant():
    pipe = named_chain(("clip", _clip(64)), ("psum", psum()), ("noise", noise(noise_multiplier=1.1, key=key(0))),
                       ("opt", adam(1e-3)))
    report = pipe.privacy_report(sample_rate=64 / 10_000, steps=500, delta=1e-5)
    assert report.private and report.mechanism == "gaussian"
    assert report.sensitivity == 1.0 / 64
    expected = (dpsgd_acc.poisson(dpsgd_acc.gaussian(1.1), 64 / 10_000) * 500).epsilon_at(1e-5)
    assert report.epsilon == expected
    names = [s.name for s in report.stages]
    assert names == ["clip", "psum", "noise", "opt"]
    noise_row = report.stages[2]
    assert noise_row.noise_stddev == pytest.approx(1.1 / 64) and noise_row.sensitivity == 1.0 / 64
    assert pipe.privacy_report().epsilon is None  # sampling unknown: not guessed


def test_report_of_per_group_adaptive_and_dpftrl_stages():
    pg = per_group({"w": torch.zeros(2)}, names=("w",), all=(3.0, "*"))  # one group
    pipe = chain(clip(_loss, clipping_norm=pg, batch_argnums=(1,), normalize_by=2), noise(noise_multiplier=1.0, key=key(0)))
    assert pipe.privacy_report().sensitivity == 1.5
    grad_fn, state = adaptive_clipped_grad(_loss, initial_clipping_norm=1.0, count_noise_multiplier=1.0, key=key(1),
                                           batch_argnums=(1,), expected_batch_size=4)
    adaptive = chain(as_stage(grad_fn, state, batch_argnums=(1,)), noise(noise_multiplier=1.0, key=key(0)), sgd(0.1))
    assert adaptive.privacy_report().sensitivity is None and adaptive.privacy_report().private
    strategy = dpftrl.band_mf_strategy(8, 2, max_iterations=5)
    mf = named_chain(("clip", _clip()), ("noise", dpftrl.noise(strategy, noise_multiplier=2.0, key=key(0))),
                     ("opt", sgd(0.1)))
    report = mf.privacy_report()
    assert report.private and report.mechanism == "mf_gaussian"
    assert report.stages[1].noise_stddev == pytest.approx(2.0 * strategy.sensitivity(1, 1) * 0.25)


def test_undescribed_stages_are_reported_and_pipelines_without_clip_are_not_private():
    plain = chain(stateless(lambda g, params=None: g), sgd(0.1))
    report = plain.privacy_report()
    assert not report.private and report.stages[0].kind == "unknown"
