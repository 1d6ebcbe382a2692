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
from opake_fx.errors import InputTypeError, InputValueError, NoiseInputError, OperationError
from opake_fx.optimizers import adam, sgd
from opake_fx.pytree import tree_map
from opake_fx.random import key
from opake_fx.transforms import apply_updates, chain, identity, named_chain, postprocess, stateless
from opake_fx.types import ClippedPytree, NoisedPytree


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


def test_the_reported_noise_stddev_is_the_one_in_the_output_through_postprocess_stages():
    n = 20_000
    pipe = named_chain(("clip", _clip(64)), ("noise", noise(noise_multiplier=1.0, key=key(3))),
                       ("double", postprocess(lambda g: 2 * g, scale=2.0)),
                       ("cast", postprocess(lambda g: g.to(torch.float64), scale=1.0)))
    p = torch.zeros(n)
    out, _ = pipe.update((torch.zeros(8, n),), pipe.init(p), p)  # zero gradients: the output is the noise alone
    report = pipe.privacy_report(sample_rate=0.01, steps=100, delta=1e-5)
    assert [row.noise_stddev for row in report.stages] == [None, 1 / 64, 2 / 64, 2 / 64]
    assert report.noise_stddev == out.noise_stddev == 2 / 64  # the user's case: 0.03125, not the noise row's 0.01562
    assert [row.kind for row in report.stages[2:]] == ["postprocess", "postprocess"]
    assert "post-processing of the noised value" in report.stages[2].note and report.private
    # the sample stddev of n normals is off by ~1/sqrt(2n) relative; 6 of those
    assert abs(float(out.pytree.std()) / report.noise_stddev - 1) < 6 / math.sqrt(2 * n)


def test_a_stage_the_report_cannot_see_through_makes_it_say_unknown():
    scales = {(): 2.0}
    per_layer = stateless(lambda g, params=None: g.map_with_path(lambda path, x: scales[path] * x))
    pipe = named_chain(("clip", _clip(64)), ("noise", noise(noise_multiplier=1.0, key=key(0))),
                       ("per_layer", per_layer), ("opt", sgd(0.1)))
    report = pipe.privacy_report(sample_rate=0.01, steps=100, delta=1e-5)
    row = report.stages[2]
    assert (row.kind, row.sensitivity, row.noise_stddev) == ("unknown", "unknown", "unknown")
    assert report.noise_stddev == "unknown" and "unknown" in str(report).splitlines()[3]
    assert report.private and report.epsilon > 0  # the epsilon does not depend on what is tracked
    undescribed_postprocess = chain(_clip(64), noise(noise_multiplier=1.0, key=key(0)),
                                    postprocess(lambda g: g.map_with_path(lambda path, x: scales[path] * x)))
    assert undescribed_postprocess.privacy_report().stages[2].noise_stddev == "unknown"
    before_noise = chain(_clip(64), stateless(lambda g, params=None: g.map(lambda x: 2 * x, lipschitz=2.0)),
                         noise(noise_multiplier=1.0, key=key(0)))
    assert before_noise.privacy_report().stages[2].noise_stddev == "unknown"  # 2/64 at run time, not the clip's 1/64
    uneven = per_group({"w": torch.zeros(2), "b": torch.zeros(1)}, names=("w", "b"), big=(3.0, "w"), small=(1.0, "*"))
    grouped = chain(clip(_loss, clipping_norm=uneven, batch_argnums=(1,)), noise(noise_multiplier=1.0, key=key(0)))
    assert grouped.privacy_report().stages[1].noise_stddev == "unknown"  # per group, allocated by the noise stage


def test_postprocess_before_noise_is_refused_at_build_time_and_at_run_time():
    with pytest.raises(OperationError, match=r"g.map_with_path\(fn, lipschitz=L\)"):
        named_chain(("clip", _clip()), ("pp", postprocess(torch.neg)), ("noise", noise(noise_multiplier=1.0, key=key(0))))
    with pytest.raises(OperationError, match="receive the data batch"):
        chain(postprocess(torch.neg), _clip(), noise(noise_multiplier=1.0, key=key(0)))
    stage = postprocess(torch.neg)
    with pytest.raises(NoiseInputError, match="never noised"):
        stage.update(ClippedPytree((torch.ones(2),), max_norm=1.0), stage.init(None))
    lying = postprocess(lambda g: 3 * g, scale=2.0)
    with pytest.raises(InputValueError, match="declared scale=2"):
        lying.update(NoisedPytree((torch.ones(2),), max_norm=1.0, noise_stddev=1.0), lying.init(None))


def test_a_map_between_clip_and_noise_names_the_stage_and_the_map_that_keeps_the_bound():
    pipe = named_chain(("clip", _clip()), ("double", stateless(lambda g, params=None: tree_map(lambda x: 2 * x, g))),
                       ("noise", noise(noise_multiplier=1.0, key=key(0))), ("opt", sgd(0.1)))
    p = torch.zeros(2)
    with pytest.raises(NoiseInputError, match=r"stage 'double' received the clipped gradient.*map_with_path"):
        pipe.update((torch.ones(4, 2),), pipe.init(p), p)
    kept = named_chain(("clip", _clip()), ("double", stateless(lambda g, params=None: g.map(lambda x: 2 * x, lipschitz=2.0))),
                       ("noise", noise(noise_multiplier=0.0, key=key(0))))
    out, _ = kept.update((torch.ones(4, 2),), kept.init(p), p)
    assert out.max_norm == 0.5


@pytest.mark.parametrize(
    "pre, change",
    [
        (lambda b, params=None: tuple(x.double() for x in b), r"dtype of leaf \(0,\) \(torch.float32 -> torch.float64\)"),
        (lambda b, params=None: tuple(x.reshape(-1) for x in b), r"shape of leaf \(0,\) \(\(4, 2\) -> \(8,\)\)"),
    ],
)
def test_a_stage_before_clip_that_breaks_the_batch_is_named_when_clip_fails(pre, change):
    matmul = lambda p, x: (x @ p).sum()  # noqa: E731 -- fails on a float64 batch with float32 params
    pipe = named_chain(("prep", stateless(pre)), ("clip", clip(matmul, clipping_norm=1.0, batch_argnums=(1,))),
                       ("noise", noise(noise_multiplier=1.0, key=key(0))), ("opt", sgd(0.1)))
    p = torch.zeros(2, 3)
    with pytest.raises(OperationError, match=r"clip stage 'clip' failed .* stage 'prep' changed the " + change):
        pipe.update((torch.ones(4, 2),), pipe.init(p), p)


def test_a_second_moment_release_reports_its_noise_stddev_as_unknown():
    """The gradient stream's stddev is sigma * s / sqrt(1 - share), not sigma * s: never print the latter."""
    import torch

    from opake_fx.dpsgd import clip, noise
    from opake_fx.pipeline_privacy import UNKNOWN
    from opake_fx.random import key
    from opake_fx.transforms import named_chain

    loss = lambda p, x: (p * x).sum()  # noqa: E731
    pipe = named_chain(("clip", clip(loss, clipping_norm=1.0, normalize_by=4.0, second_moment=True)),
                       ("noise", noise(noise_multiplier=2.0, key=key(0))))
    report = pipe.privacy_report()
    assert report.noise_stddev == UNKNOWN
    out, _ = pipe.update((torch.ones(3, 2),), pipe.init(torch.zeros(2)), torch.zeros(2))
    assert out.noisy_grads.noise_stddev != 2.0 * 1.0 / 4.0  # what the report would have said
    plain = named_chain(("clip", clip(loss, clipping_norm=1.0, normalize_by=4.0)), ("noise", noise(noise_multiplier=2.0, key=key(0))))
    assert plain.privacy_report().noise_stddev == 0.5
