"""A DPPlan on 2 gloo ranks: disjoint sharded batches, one noise draw, identical parameters."""

from __future__ import annotations

import pytest
import torch

from opake_fx.optimizers import sgd
from opake_fx.plan import DPPlan
from opake_fx.random import key
from opake_fx.transforms import apply_updates


def _plan_run(rank: int, world_size: int) -> dict:
    plan = DPPlan(dataset_size=400, batch_size=40, steps=5, target_epsilon=5.0, delta=1e-5)
    data = torch.randn(400, 3, generator=torch.Generator().manual_seed(0)) + 1.0  # the same dataset everywhere
    sampler = plan.sampler(list(range(400)), key(1))  # this rank's shard, fold_in(key, rank)
    pipeline = plan.pipeline(lambda p, x: ((x - p) ** 2).sum(), sgd(0.1), key=key(0), batch_argnums=(1,))
    p, state, seen = torch.zeros(3), pipeline.init(torch.zeros(3)), []
    for batch in sampler:
        seen.extend(batch)
        updates, state = pipeline.update((data[batch],), state, p)
        p = apply_updates(p, updates)
    return {"params": p.tolist(), "seen": sorted(set(seen)), "epsilon": plan.epsilon()}


@pytest.mark.distributed
def test_a_plan_on_two_ranks_samples_disjoint_shards_and_keeps_ranks_identical(group2):
    r0, r1 = group2.run(_plan_run)
    assert r0["params"] == r1["params"] and r0["params"] != [0.0, 0.0, 0.0]
    assert r0["seen"] and r1["seen"] and max(r0["seen"]) < 200 <= min(r1["seen"])
    assert r0["epsilon"] == r1["epsilon"] <= 5.0


def _blt_plan_run(rank: int, world_size: int, min_sep_of_rank_1: int) -> dict:
    min_sep = 5 if rank == 0 else min_sep_of_rank_1
    plan = DPPlan(dataset_size=400, batch_size=40, steps=10, noise_multiplier=1.0, delta=1e-5, mechanism="blt",
                  sampling="b_min_sep", min_sep=min_sep)
    data = torch.randn(400, 3, generator=torch.Generator().manual_seed(0)) + 1.0
    sampler = plan.sampler(list(range(400)), key(1))
    pipeline = plan.pipeline(lambda p, x: ((x - p) ** 2).sum(), sgd(0.1), key=key(0), batch_argnums=(1,))
    p, state, batches = torch.zeros(3), pipeline.init(torch.zeros(3)), []
    for step, batch in enumerate(sampler):
        try:
            updates, state = pipeline.update((data[batch],), state, p)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return {"step": step, "error": type(exc).__name__, "message": str(exc)}
        p = apply_updates(p, updates)
        batches.append(batch)
    return {"params": p.tolist(), "batches": batches, "error": None}


@pytest.mark.distributed
def test_a_blt_plan_on_two_ranks_keeps_the_pattern_and_identical_parameters(group2):
    r0, r1 = group2.run(_blt_plan_run, 5)
    assert r0["error"] is None and r0["params"] == r1["params"] != [0.0, 0.0, 0.0]
    seen: dict[int, list[int]] = {}
    for t in range(10):
        assert not set(r0["batches"][t]) & set(r1["batches"][t])
        for i in r0["batches"][t] + r1["batches"][t]:
            seen.setdefault(i, []).append(t)
    assert max(i for b in r0["batches"] for i in b) < 200 <= min(i for b in r1["batches"] for i in b)
    assert all(b - a >= 5 for times in seen.values() for a, b in zip(times, times[1:]))


@pytest.mark.distributed
def test_ranks_whose_plans_differ_in_the_participation_pattern_stop_at_the_first_step(group2):
    # rank 1's plan promises min_sep=2: its noise is scaled to another sensitivity
    for r in group2.run(_blt_plan_run, 2):
        assert r["step"] == 0 and r["error"] == "DistributedMismatchError" and ("sensitivity differs" in r["message"] or "DPPlan.pipeline.min_sep differs" in r["message"]), r


def _plan_differs_in(rank: int, world_size: int, field: str) -> dict:
    from opake_fx.errors import DistributedMismatchError
    from opake_fx.optimizers import sgd
    from opake_fx.plan import DPPlan
    from opake_fx.transforms import apply_updates

    # rank 1's plan: twice the data at the same batch size (half the sample rate; normalize_by, hence the
    # sensitivity, unchanged) or another delta: the noise stage sees nothing different, the accountants charge
    # different runs
    n, b, delta = 100, 10, 1e-5
    if rank == 1 and field == "dataset_size":
        n = 200
    if rank == 1 and field == "delta":
        delta = 1e-6
    plan = DPPlan(dataset_size=n, batch_size=b, steps=3, clipping_norm=1.0, noise_multiplier=1.0, delta=delta)
    pipe = plan.pipeline(lambda p, x: ((x - p) ** 2).sum(), sgd(0.1), key=key(0), batch_argnums=(1,))
    params = torch.zeros(2)
    state = pipe.init(params)
    try:
        updates, state = pipe.update((torch.ones(4, 2),), state, params)
        params = apply_updates(params, updates)
    except DistributedMismatchError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}


@pytest.mark.distributed
@pytest.mark.parametrize("field", ["dataset_size", "delta"])
def test_ranks_whose_plans_differ_where_the_noise_stage_cannot_see_stop_at_the_first_step(group2, field):
    for r in group2.run(_plan_differs_in, field):
        assert r["error"] == "DistributedMismatchError" and f"DPPlan.pipeline.{field} differs" in r["message"], r
