"""Sharded checkpoints of an FSDP2 DP run on 2 gloo ranks (issue 32): kill and resume bit for bit, world sizes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opake_fx.random import key

pytestmark = pytest.mark.distributed

N, BATCH, STEPS, SAVE_AT = 96, 24, 6, 3


def _setup(world_size: int, noise_seed: int = 0, opt=None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from opake_fx.distributed.fsdp import make_functional_fsdp
    from opake_fx.optimizers import adam
    from opake_fx.plan import DPPlan

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))  # 7 and 3 rows: uneven shards
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    fmodel, params = make_functional_fsdp(model)
    plan = DPPlan(dataset_size=N, batch_size=BATCH, steps=STEPS, clipping_norm=0.7, noise_multiplier=1.0, delta=1e-5,
                  clip_backend="auto")
    loss = lambda p, xb, yb: F.cross_entropy(fmodel(p, xb), yb, reduction="none")  # noqa: E731
    pipe = plan.pipeline(loss, opt if opt is not None else adam(1e-2), key=key(noise_seed), model=fmodel)
    return plan, pipe, params


def _data():
    x = torch.randn(N, 5, generator=torch.Generator().manual_seed(3))
    y = torch.randint(0, 3, (N,), generator=torch.Generator().manual_seed(4))
    return x, y


def _train(plan, pipe, params, state, sampler, acct, start, stop, save=None):
    from opake_fx.transforms import apply_updates

    x, y = _data()
    for t in range(start, stop):
        acct.step(plan.step_cost_at(t))
        idx = torch.as_tensor(sampler.batch(t), dtype=torch.long)
        updates, state = pipe.update((x[idx], y[idx]), state, params)
        params = apply_updates(params, updates)
        if save is not None:
            plan.save_checkpoint(f"{save}/step{t + 1}", params=params, state=state, sampler=sampler, accountant=acct,
                                 meta={"step": t + 1, "note": "trainer"})
    return params, state


def _fingerprint(params, state, acct):
    return [[p.full_tensor().tolist() for p in params], _moments(state.opt), state.noise.step, acct.steps, acct.epsilon]


def _moments(opt_state) -> list:
    from opake_fx.serialization import state_dict

    leaves = [t.tolist() for t in state_dict(opt_state).values() if isinstance(t, torch.Tensor)]
    assert len(leaves) >= 4  # Adam's two moments of each of the 4 parameters (and its count)
    return leaves


def _uninterrupted(rank: int, world_size: int, directory: str) -> list:
    plan, pipe, params = _setup(world_size)
    sampler, acct = plan.sampler(range(N), key(1)), plan.accountant()
    params, state = _train(plan, pipe, params, pipe.init(params), sampler, acct, 0, STEPS, save=directory)
    return _fingerprint(params, state, acct)


def _killed_and_resumed(rank: int, world_size: int, directory: str) -> list:
    plan, pipe, params = _setup(world_size)
    sampler, acct = plan.sampler(range(N), key(1)), plan.accountant()
    _train(plan, pipe, params, pipe.init(params), sampler, acct, 0, SAVE_AT + 1, save=directory)  # "killed" after
    # a save killed half-way leaves only <name>.partial: the previous checkpoint stays whole
    if rank == 0:
        shutil.copytree(f"{directory}/step{SAVE_AT}", f"{directory}/step{SAVE_AT + 1}.partial", dirs_exist_ok=True)
        shutil.rmtree(f"{directory}/step{SAVE_AT + 1}")
    torch.distributed.barrier()
    # a new process state: a new model, pipeline, sampler and accountant, resumed from the checkpoint
    plan, pipe, fresh = _setup(world_size)
    sampler = plan.sampler(range(N), key(1))
    ckpt = plan.load_checkpoint(f"{directory}/step{SAVE_AT}", params=fresh, state=pipe.init(fresh), sampler=sampler,
                                accountant=plan.accountant(), meta={"step": 0, "note": ""})
    assert ckpt["step"] == SAVE_AT and ckpt["meta"] == {"step": SAVE_AT, "note": "trainer"}  # an extra tree
    params, state = _train(plan, pipe, ckpt["params"], ckpt["state"], ckpt["sampler"], ckpt["accountant"], SAVE_AT,
                           STEPS)
    return _fingerprint(params, state, ckpt["accountant"])


def test_a_killed_fsdp2_run_resumes_bit_for_bit(group2, tmp_path):
    whole = group2.run(_uninterrupted, str(tmp_path / "a"), timeout=240.0)
    resumed = group2.run(_killed_and_resumed, str(tmp_path / "b"), timeout=240.0)
    assert whole[0][0] == whole[1][0]  # every rank gathers the same parameters
    assert resumed[0] == whole[0] and resumed[1] == whole[1]  # parameters, Adam shards, noise step, accountant
    assert sorted(p.name for p in (tmp_path / "a" / f"step{SAVE_AT}").iterdir()) == [
        "meta.json", "run.rank0.pt", "run.rank1.pt", "tensors"]


def _resume_with(rank: int, world_size: int, directory: str, attack: str) -> list:
    from opake_fx.errors import CheckpointError

    plan, pipe, fresh = _setup(world_size, noise_seed=11 if (attack == "noise_key_rank1" and rank == 1) else 0)
    sampler = plan.sampler(range(N), key(1))
    path = Path(directory) / f"step{SAVE_AT}"
    if attack == "tensors_of_another_step" and rank == 0:  # the writer swaps in step 2's parameters and moments
        shutil.rmtree(path / "tensors")
        shutil.copytree(Path(directory) / f"step{SAVE_AT - 1}" / "tensors", path / "tensors")
    torch.distributed.barrier()
    try:
        plan.load_checkpoint(path, params=fresh, state=pipe.init(fresh), sampler=sampler, accountant=plan.accountant(),
                             meta={"step": 0, "note": ""})
    except CheckpointError as exc:
        return ["refused", type(exc).__name__, str(exc)]
    return ["loaded"]


@pytest.mark.parametrize("attack,says", [("tensors_of_another_step", "digest"), ("noise_key_rank1", "key")])
def test_a_checkpoint_that_is_not_one_step_of_this_run_is_refused_on_every_rank(group2, tmp_path, attack, says):
    group2.run(_uninterrupted, str(tmp_path), timeout=240.0)
    outs = group2.run(_resume_with, str(tmp_path), attack, timeout=240.0)
    assert all(o[0] == "refused" for o in outs), outs
    assert any(says in o[2] for o in outs), outs


def _state_on_one_rank(rank: int, world_size: int, directory: str) -> list:
    from opake_fx.distributed.fsdp_checkpoint import load_sharded_model_state
    from opake_fx.errors import CheckpointError

    plan, pipe, fresh = _setup(world_size)
    path = f"{directory}/step{STEPS}"
    try:
        plan.load_checkpoint(path, params=fresh, state=pipe.init(fresh), sampler=plan.sampler(range(N), key(1)),
                             accountant=plan.accountant(), meta={"step": 0, "note": ""})
        refusal = ""
    except CheckpointError as exc:
        refusal = str(exc)
    params, opt = load_sharded_model_state(path, params=fresh, opt_state=pipe.init(fresh).opt)
    moments = _moments(opt)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from opake_fx.distributed.fsdp import make_functional_fsdp

    other = nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 3))  # another model: 9 hidden units, not 7
    fully_shard(other, mesh=init_device_mesh("cpu", (world_size,)))
    try:
        load_sharded_model_state(path, params=make_functional_fsdp(other)[1])
        wrong_model = ""
    except CheckpointError as exc:
        wrong_model = str(exc)
    return [refusal, [p.full_tensor().tolist() for p in params], moments, wrong_model]


def test_another_world_size_refuses_the_run_and_reads_the_model_exactly(group2, tmp_path):
    from tests.distributed._harness import RankGroup

    whole = group2.run(_uninterrupted, str(tmp_path), timeout=240.0)
    one = RankGroup(1, pg_timeout=20.0)
    try:
        (refusal, params, moments, wrong_model), = one.run(_state_on_one_rank, str(tmp_path), timeout=240.0)
    finally:
        one.close()
    assert "saved by 2 ranks and is resumed by 1" in refusal and "load_sharded_model_state" in refusal
    assert "do not fit the templates" in wrong_model
    assert params == whole[0][0]  # bit for bit: DCP reads each rank's rows of the full tensors
    # the Adam moments of 1 rank are the 2 ranks' shards end to end (the step count is the same everywhere)
    full = [a + b if isinstance(a, list) else a for a, b in zip(whole[0][1], whole[1][1])]
    assert moments == full and any(isinstance(m, list) for m in moments)


def _custom_opt_state(rank: int, world_size: int, directory: str) -> list:
    from opake_fx.optimizers import sgd
    from opake_fx.transforms import Transform

    inner = sgd(0.1)
    rank_local = Transform(lambda p: (inner.init(p), torch.tensor(float(rank))),  # a leaf that differs per rank
                           lambda g, s, p=None: (inner.update(g, s[0], p)[0], s), inner.privacy)
    plan, pipe, params = _setup(world_size, opt=rank_local)
    sampler, acct = plan.sampler(range(N), key(1)), plan.accountant()
    try:
        _train(plan, pipe, params, pipe.init(params), sampler, acct, 0, 1, save=directory)
    except Exception as exc:  # noqa: BLE001 - the outcome is compared below
        return [type(exc).__name__, str(exc), (Path(directory) / "step1").exists()]
    return ["saved"]


def test_optimizer_state_that_differs_between_ranks_is_refused_before_anything_is_written(group2, tmp_path):
    outs = group2.run(_custom_opt_state, str(tmp_path), timeout=240.0)
    assert [o[0] for o in outs] == ["InputValueError", "InputValueError"], outs
    assert "differ between the ranks" in outs[0][1] and all(o[2] is False for o in outs)


def _save_into_a_file(rank: int, world_size: int, directory: str) -> list:
    plan, pipe, params = _setup(world_size)
    sampler, acct = plan.sampler(range(N), key(1)), plan.accountant()
    blocker = Path(directory) / "not_a_directory"
    if rank == 0:
        blocker.write_text("a file where the checkpoint's parent directory should be")
    torch.distributed.barrier()
    try:
        _train(plan, pipe, params, pipe.init(params), sampler, acct, 0, 1, save=str(blocker))
    except Exception as exc:  # noqa: BLE001 - the outcome is compared below
        return [type(exc).__name__, str(exc)]
    return ["saved", ""]


def test_a_save_that_fails_on_one_rank_fails_on_every_rank_and_none_hangs(group2, tmp_path):
    outs = group2.run(_save_into_a_file, str(tmp_path), timeout=120.0)
    assert outs[0][0] in ("NotADirectoryError", "FileExistsError", "OSError") and outs[1][0] == "CheckpointRanksError"
    assert "rank(s) [0] refused" in outs[1][1]
    assert [o[0] for o in group2.run(_uninterrupted, str(tmp_path / "after"), timeout=240.0)]  # the group still works
