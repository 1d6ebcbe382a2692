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
