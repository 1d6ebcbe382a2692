"""Clipping statistics reach chain users, in the clip stage's state, as non-private diagnostics."""

from __future__ import annotations

import pytest
import torch

import opake_fx.distributed as od
from opake_fx.dpsgd import clip, noise
from opake_fx.dpsgd.clipping import ClippingStats, ClipStageState, adaptive_clipped_grad, as_stage, clipped_grad, per_group
from opake_fx.errors import InputValueError
from opake_fx.optimizers import sgd
from opake_fx.random import key
from opake_fx.serialization import from_state_dict, state_dict
from opake_fx.transforms import named_chain


def _loss(p, x):
    return 0.5 * ((x - p) ** 2).sum()  # per-example gradient p - x, norm ||x|| at p = 0


X = torch.tensor([[0.1, 0.1], [5.0, 5.0], [3.0, 0.0], [0.0, 0.5]])  # norms 0.14, 7.1, 3, 0.5


def _pipeline(**clip_kw):
    return named_chain(
        ("clip", clip(_loss, clipping_norm=1.0, batch_argnums=(1,), **clip_kw)),
        ("noise", noise(noise_multiplier=1.0, key=key(0))),
        ("opt", sgd(0.1)),
    )


def test_stats_are_in_the_stage_state_and_the_output_is_unchanged():
    p = torch.zeros(2)
    with_stats, plain = _pipeline(return_stats=True), _pipeline()
    s0 = with_stats.init(p)
    assert isinstance(s0["clip"], ClipStageState) and s0["clip"].stats == ClippingStats(0.0, 0.0, 0, 0)
    out, s1 = with_stats.update((X,), s0, p)
    ref, _ = plain.update((X,), plain.init(p), p)
    assert torch.equal(out, ref)
    assert s1["clip"].stats == ClippingStats(num_clipped=2.0, clipping_rate=0.5, batch_size=4, num_nonfinite=0)
    assert s1["clip"].clip_state.step == 1
    # the state checkpoints against the template init() gives, and syncs (identity in one process)
    restored = from_state_dict(with_stats.init(p), state_dict(s1))
    assert restored["clip"] == s1["clip"] and od.sync(s1["clip"]) == s1["clip"]


def test_per_group_and_adaptive_clipping_report_stats_too():
    p = {"w": torch.zeros(2), "b": torch.zeros(())}
    groups = per_group(p, names=("w", "b"), weights=(1.0, "w"), biases=(0.5, "b"))
    stage = clip(lambda q, x: 0.5 * ((x - q["w"]) ** 2).sum() + q["b"] * x.sum(), clipping_norm=groups,
                 batch_argnums=(1,), return_stats=True)
    s0 = stage.init(p)
    assert s0.stats.num_clipped == {"biases": 0.0, "weights": 0.0}
    _, s1 = stage.update((X,), s0, p)
    assert set(s1.stats.num_clipped) == {"biases", "weights"} and s1.stats.batch_size == 4
    grad_fn, state = adaptive_clipped_grad(_loss, initial_clipping_norm=1.0, count_noise_multiplier=0.0, key=key(1),
                                           batch_argnums=(1,), expected_batch_size=4, return_stats=True)
    adaptive = as_stage(grad_fn, state, batch_argnums=(1,), return_stats=True)
    _, s = adaptive.update((X,), adaptive.init(torch.zeros(2)), torch.zeros(2))
    assert s.stats.num_clipped == 2.0 and s.clip_state.step == 1


def test_as_stage_needs_return_stats_on_both_sides():
    with_stats = clipped_grad(_loss, clipping_norm=1.0, batch_argnums=(1,), return_stats=True)
    without = clipped_grad(_loss, clipping_norm=1.0, batch_argnums=(1,))
    for (grad_fn, state), flag in ((with_stats, False), (without, True)):
        stage = as_stage(grad_fn, state, batch_argnums=(1,), return_stats=flag)
        with pytest.raises(InputValueError, match="return_stats=True"):
            stage.update((X,), stage.init(torch.zeros(2)), torch.zeros(2))
