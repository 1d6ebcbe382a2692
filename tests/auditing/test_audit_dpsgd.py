"""audit_dpsgd end to end: a correct DP-SGD run audits below its claim; the same run with the
noise silently removed, or the clipping skipped, while the accountant charges the correct
plan, audits far above it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from opake_fx.auditing import AuditResult, audit_dpsgd, perfect_attack_ceiling, plot_audit
from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.random import key


def _data(n: int = 500, d: int = 10):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g)
    y = (x @ torch.randn(d, generator=g) > 0).long()
    return x, y


def _loss(p, xi, yi):
    return F.cross_entropy((xi @ p["w"] + p["b"])[None], yi[None])


def _params(d: int = 10):
    return {"w": torch.zeros(d, 2), "b": torch.zeros(2)}


def _no_noise(plan, loss_fn, optimizer, k):
    """The bug: the pipeline adds no noise, the accountant still charges the plan's sigma."""
    broken = dataclasses.replace(plan, noise_multiplier=0.0, target_epsilon=None)
    return broken.pipeline(loss_fn, optimizer, key=k, batch_argnums=(1, 2, 3))


def _no_clipping(plan, loss_fn, optimizer, k):
    """The bug: examples are not clipped (C = 1e6); the noise keeps its absolute scale sigma * C."""
    big = 1e6
    broken = dataclasses.replace(plan, clipping_norm=big, target_epsilon=None,
                                 noise_multiplier=plan.noise_multiplier * plan.clipping_norm / big)
    return broken.pipeline(loss_fn, optimizer, key=k, batch_argnums=(1, 2, 3))


def _rate_too_high(plan, slots, k):
    """The bug: the sampler draws at 5x the rate the plan (and so the accountant) assumes."""
    from opake_fx.dpsgd.sampling import PoissonSampler

    return PoissonSampler(slots, sample_rate=5 * plan.sample_rate, n_steps=plan.steps, key=k)


RUN = dict(num_canaries=1000, sample_rate=0.1, steps=100, target_epsilon=8.0, delta=1e-5)


@pytest.mark.slow
def test_a_correct_run_at_epsilon_8_audits_below_8_and_above_0():
    r = audit_dpsgd(_loss, _params(), _data(), key=key(1), **RUN)
    assert r.epsilon_accountant == pytest.approx(8.0, abs=1e-2)
    assert 0.5 < r.epsilon_lower < 8.0 and r.consistent
    assert 0 < r.epsilon_any_mechanism <= r.epsilon_lower
    # the sum attack on Dirac canaries sees mu ~ q T / sqrt(sigma^2 T + q (1 - q) T) (~1.0 here)
    sigma = r.plan.noise_multiplier
    mu_expected = 0.1 * 100 / np.sqrt(sigma**2 * 100 + 0.09 * 100)
    assert r.estimate.gdp().mu_estimate == pytest.approx(mu_expected, rel=0.2)


@pytest.mark.slow
@pytest.mark.parametrize("broken", [{"pipeline": _no_noise}, {"pipeline": _no_clipping}, {"sampler": _rate_too_high}],
                         ids=["noise_removed", "clipping_skipped", "sample_rate_5x"])
def test_a_broken_mechanism_accounted_as_correct_audits_far_above_8(broken):
    r = audit_dpsgd(_loss, _params(), _data(), key=key(1), **broken, **RUN)
    assert r.epsilon_accountant == pytest.approx(8.0, abs=1e-2)
    assert r.epsilon_lower > 16.0 and not r.consistent
    assert "CONTRADICTS" in str(r)


def test_a_small_audit_runs_the_plan_and_reports_every_bound(capsys):
    r = audit_dpsgd(_loss, _params(), _data(200), key=key(2), num_canaries=100, batch_size=30, steps=15,
                    noise_multiplier=1.0, delta=1e-5, progress=True)
    assert isinstance(r, AuditResult) and r.plan.dataset_size == 300 and r.plan.steps == 15
    assert r.epsilon_lower == max(r.epsilon_any_mechanism, r.epsilon_fdp, r.epsilon_gdp)
    assert r.epsilon_lower <= r.epsilon_accountant and r.epsilon_accountant == pytest.approx(r.plan.epsilon(), rel=1e-3)
    assert r.estimate.num_canaries == 100 and np.array_equal(r.estimate.canary_ids, np.arange(200, 300))
    assert float(r.params["w"].abs().sum()) > 0  # the model trained on the ordinary data
    ceiling = perfect_attack_ceiling(100, significance=0.05 / 3, delta=1e-5)
    assert r.epsilon_any_mechanism <= ceiling["one_run"] + 1e-9
    assert "audit at 95% confidence" in str(r)
    assert r.unit == "per example" and "epsilon per example >=" in str(r)


def test_plot_audit_draws_the_roc_and_the_bounds():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    r = audit_dpsgd(_loss, _params(), _data(100), key=key(3), num_canaries=50, batch_size=30, steps=5,
                    noise_multiplier=1.0, delta=1e-5)
    fig = plot_audit(r)
    roc, bars = fig.axes
    assert roc.get_xscale() == "log" and len(bars.patches) == 4
    assert bars.patches[3].get_height() == pytest.approx(r.epsilon_accountant)
    fig2 = plot_audit(r.auditor)
    assert len(fig2.axes) == 2
    with pytest.raises(InputTypeError, match="AuditResult"):
        plot_audit(3.0)


def test_audit_dpsgd_refuses_bad_inputs():
    with pytest.raises(InputTypeError, match="key"):
        audit_dpsgd(_loss, _params(), _data(50), key=1, steps=2, batch_size=5, noise_multiplier=1.0)
    with pytest.raises(InputValueError, match="lengths"):
        x, y = _data(50)
        audit_dpsgd(_loss, _params(), (x, y[:40]), key=key(0), steps=2, batch_size=5, noise_multiplier=1.0)
    with pytest.raises(InputValueError, match="num_canaries"):
        audit_dpsgd(_loss, _params(), _data(50), key=key(0), steps=2, batch_size=5, noise_multiplier=1.0,
                    num_canaries=1)
