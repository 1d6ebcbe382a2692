"""Hyperparameter guidance: the rules as stated, and the sweep charges for tuning on private data."""

from __future__ import annotations

import pytest

import opake_fx.dpsgd.accounting as dpsgd_acc
from opake_fx.errors import InputValueError
from opake_fx.tuning import batch_choices, suggest, sweep


def test_at_fixed_steps_larger_batches_lower_the_noise_to_signal_ratio():
    cs = batch_choices(1437, target_epsilon=3.0, delta=1e-5, batch_sizes=[128, 256, 512], steps=225)
    ratios = [c.noise_to_signal for c in cs]
    assert ratios == sorted(ratios, reverse=True)
    assert all(c.steps == 225 for c in cs)
    s = suggest(1437, target_epsilon=3.0, delta=1e-5, steps=225, base_batch_size=128, base_learning_rate=0.1,
                batch_sizes=[128, 256, 512])
    assert (s.batch_size, s.learning_rate) == (512, 0.1)


def test_at_fixed_epochs_the_learning_rate_scales_linearly():
    s = suggest(1437, target_epsilon=3.0, delta=1e-5, epochs=20, base_batch_size=128, base_learning_rate=0.1,
                batch_sizes=[128, 256, 512], min_steps=100)
    assert s.steps >= 100
    assert s.learning_rate == pytest.approx(0.1 * s.batch_size / 128)
    best = min((c for c in s.candidates if c.steps >= 100), key=lambda c: c.noise_per_epoch)
    assert s.batch_size == best.batch_size
    with pytest.raises(InputValueError, match="min_steps"):
        suggest(1437, target_epsilon=3.0, delta=1e-5, epochs=1, batch_sizes=[256, 512])


def test_sweep_charges_every_trial_or_needs_public_data():
    step = dpsgd_acc.poisson(dpsgd_acc.gaussian(2.0), 0.1)
    with pytest.raises(InputValueError, match="costs privacy"):
        sweep(lambda c: c, [1, 2])
    r = sweep(lambda c: -abs(c - 2), [1, 2, 3], trial_cost=step * 50)
    assert r.best == 2 and len(r.scores) == 3
    assert r.privacy_cost.epsilon_at(1e-5) == pytest.approx((step * 150).epsilon_at(1e-5), rel=1e-6)
    assert sweep(lambda c: c, [1, 2], public_data=True).privacy_cost is None
