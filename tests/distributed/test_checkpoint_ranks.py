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


# --- run checkpoints (DPPlan.save_checkpoint / load_checkpoint) on 2 ranks ---------------


def _run_and_save(directory: str, rank: int, load_step: int):
    from opake_fx.optimizers import sgd
    from opake_fx.plan import DPPlan
    from opake_fx.transforms import apply_updates

    data = torch.linspace(-2.0, 2.0, 80).reshape(40, 2)
    plan = DPPlan(dataset_size=40, batch_size=8, steps=5, noise_multiplier=1.0, delta=1e-5)
    pipeline = plan.pipeline(lambda p, x: ((x - p) ** 2).sum(), sgd(0.1), key=key(0), batch_argnums=(1,))
    sampler, accountant = plan.sampler(range(40), key(1)), plan.accountant()
    params, state = torch.zeros(2), pipeline.init(torch.zeros(2))
    for t in range(2):  # both ranks take the same steps (the psum is a collective), saving each one
        accountant.step(plan.step_cost_at(t))
        updates, state = pipeline.update((data[sampler.batch(t)],), state, params)
        params = apply_updates(params, updates)
        plan.save_checkpoint(f"{directory}/run{t + 1}.rank{rank}.pt", params=params, state=state, sampler=sampler,
                             accountant=accountant)
    path = f"{directory}/run{load_step}.rank{rank}.pt"
    templates = dict(params=torch.zeros(2), state=pipeline.init(torch.zeros(2)), sampler=sampler,
                     accountant=plan.accountant())
    return plan, path, templates


def _resume(rank: int, world_size: int, directory: str, attack: str) -> list:
    from opake_fx.errors import CheckpointError, CheckpointRanksError

    plan, path, templates = _run_and_save(directory, rank, 1 if (attack == "stale_rank1" and rank == 1) else 2)
    if attack == "rewound_sampler_rank1" and rank == 1:  # its writer rewinds rank 1's sampler, checksum recomputed
        shard = {**templates, "sampler": getattr(templates["sampler"], "inner", templates["sampler"])}
        trees = load_checkpoint(path, check_ranks=False, **shard, run={"plan": "", "step": 0})
        trees["sampler"] = {**trees["sampler"].state_dict(), "next_step": 0}
        save_checkpoint(path, **trees)
    try:
        out = plan.load_checkpoint(path, **templates)
    except CheckpointError as exc:
        return [type(exc).__name__, isinstance(exc, CheckpointRanksError), str(exc)]
    return ["ok", out["step"], out["sampler"].next_step, out["accountant"].steps]


def test_run_checkpoints_resume_on_two_ranks(group2, tmp_path):
    r0, r1 = group2.run(_resume, str(tmp_path), "none")
    assert r0 == r1 == ["ok", 2, 2, 2]


def test_one_rank_with_a_rewound_sampler_is_refused_on_every_rank(group2, tmp_path):
    # Rank 1 alone would redraw its batches of steps 0-1 (more participations than accounted);
    # the other rank must not go on alone either (it would wait forever in the next collective).
    r0, r1 = group2.run(_resume, str(tmp_path), "rewound_sampler_rank1")
    assert r1[0] == "CheckpointError" and "sampler's position (next_step) is 0, the run's step is 2" in r1[2]
    assert r0[:2] == ["CheckpointRanksError", True] and "rank(s) [1] refused their checkpoint" in r0[2]


def test_ranks_resuming_different_steps_are_refused_with_a_checkpoint_error(group2, tmp_path):
    # each file is one consistent step of the run, but not the same step
    outs = group2.run(_resume, str(tmp_path), "stale_rank1")
    for kind, both, message in outs:
        assert (kind, both) == ("CheckpointRanksError", True)
        assert "state/noise.step" in message
