"""load_checkpoint on 2 gloo ranks: per-rank files, the shared noise state checked equal."""

from __future__ import annotations

import pytest
import torch

from opake_fx.dpsgd.noise import GaussianNoiseState
from opake_fx.dpsgd.sampling import PoissonSampler
from opake_fx.errors import DistributedMismatchError
from opake_fx.random import fold_in, key
from opake_fx.serialization import load_checkpoint, save_checkpoint

pytestmark = pytest.mark.distributed


def _save_and_load(rank: int, world_size: int, directory: str, noise_step_of_rank1: int) -> list:
    sampler = PoissonSampler(40, sample_rate=0.2, n_steps=6, key=fold_in(key(3), rank))
    next(iter(sampler))
    step = noise_step_of_rank1 if rank == 1 else 4
    path = f"{directory}/ckpt.rank{rank}.pt"
    save_checkpoint(path, noise={"n": GaussianNoiseState(key(42), step=step)}, sampler=sampler)
    template_sampler = PoissonSampler(40, sample_rate=0.2, n_steps=6, key=fold_in(key(3), rank))
    try:
        out = load_checkpoint(path, noise={"n": GaussianNoiseState(key(0))}, sampler=template_sampler)
    except DistributedMismatchError as exc:
        return ["mismatch", str(exc)]
    return ["ok", out["noise"]["n"].step, out["sampler"].key.words, out["sampler"].next_step]


def test_per_rank_files_restore_their_own_sampler_and_the_shared_noise(group2, tmp_path):
    r0, r1 = group2.run(_save_and_load, str(tmp_path), 4)
    assert r0[:2] == ["ok", 4] and r1[:2] == ["ok", 4]
    assert r0[2] != r1[2] and r0[3] == r1[3] == 1  # each rank's own sampler key


def test_ranks_resuming_different_noise_steps_fail_together(group2, tmp_path):
    outs = group2.run(_save_and_load, str(tmp_path), 3)
    assert [o[0] for o in outs] == ["mismatch", "mismatch"]
    assert "noise/n.step" in outs[0][1]


def test_single_process_load_needs_no_group(tmp_path):
    save_checkpoint(tmp_path / "c.pt", noise=GaussianNoiseState(key(1), step=2))
    assert load_checkpoint(tmp_path / "c.pt", noise=GaussianNoiseState(key(0))).get("noise").step == 2
    assert not torch.distributed.is_initialized()
