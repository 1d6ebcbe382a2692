"""The private second moment under DDP: both streams psum'd, the pair's split checked across ranks."""

from __future__ import annotations

import pytest
import torch

import opake_fx.distributed as od
from opake_fx.dpftrl import band_mf_strategy
from opake_fx.dpftrl import noise as mf_noise
from opake_fx.dpsgd import clip, noise
from opake_fx.random import key
from opake_fx.transforms import named_chain


def _loss(p, x):
    return ((x - p) ** 2).sum()


def _run(rank: int, world_size: int, setting: str, steps: int = 2) -> dict:
    share = 1 / 3 if setting.endswith("match") else 0.2 + 0.3 * rank
    strategy = band_mf_strategy(8, 2, max_iterations=5)
    noise_stage = (
        mf_noise(strategy, noise_multiplier=1.0, key=key(7), second_moment_share=share)
        if setting.startswith("mf")
        else noise(noise_multiplier=1.0, key=key(7), second_moment_share=share)
    )
    pipeline = named_chain(
        ("clip", clip(_loss, clipping_norm=1.0, batch_argnums=(1,), normalize_by=4, second_moment=True)),
        ("psum", od.psum()),
        ("noise", noise_stage),
    )
    p = torch.zeros(3)
    state = pipeline.init(p)
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(rank))
    outs = []
    for step in range(steps):
        try:
            out, state = pipeline.update((x,), state, p)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return {"step": step, "error": type(exc).__name__, "message": str(exc)}
        outs.append((out.noisy_grads.pytree.tolist(), out.noisy_squared_grads.pytree.tolist()))
    return {"step": steps, "error": None, "values": outs}


@pytest.mark.distributed
@pytest.mark.parametrize("setting", ["gaussian share", "mf share"])
def test_a_different_split_raises_on_both_ranks_at_the_first_step(group2, setting):
    r0, r1 = group2.run(_run, setting)
    for r in (r0, r1):
        assert r["step"] == 0 and r["error"] == "DistributedMismatchError", r
        assert "second_moment_share differs" in r["message"]


@pytest.mark.distributed
@pytest.mark.parametrize("setting", ["gaussian match", "mf match"])
def test_matching_ranks_release_identical_pairs_of_the_summed_streams(group2, setting):
    r0, r1 = group2.run(_run, setting)
    assert r0["error"] is None and r1["error"] is None, (r0, r1)
    assert r0["values"] == r1["values"]
