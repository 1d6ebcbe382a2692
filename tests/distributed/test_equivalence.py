"""2 ranks == 1 process over the union of the shards; adaptive clipping needs sync."""

from __future__ import annotations

import pytest

from tests.distributed._recipe import batch_indices, max_abs_diff, train, train_on_rank

STEPS = 20


def test_union_batches_are_a_partition_of_each_step():
    union = batch_indices(None, 2, STEPS)
    per_rank = [batch_indices(r, 2, STEPS) for r in range(2)]
    for t in range(STEPS):
        assert union[t] == per_rank[0][t] + per_rank[1][t]
        assert not set(per_rank[0][t]) & set(per_rank[1][t])
        assert all(i < 5000 for i in per_rank[0][t]) and all(i >= 5000 for i in per_rank[1][t])


@pytest.mark.distributed
@pytest.mark.parametrize("style", ["function", "chain"])
def test_two_ranks_match_one_process(group2, style):
    kwargs = {"steps": STEPS, "noise_multiplier": 0.8, "style": style}
    r0, r1 = group2.run(train_on_rank, kwargs, timeout=120)
    assert max_abs_diff(r0["params"], r1["params"]) == 0.0  # every rank applies the same update
    single = train(None, 2, **kwargs)
    diff = max_abs_diff(r0["params"], single["params"])
    print(f"\n[{style}] max |2-rank - 1-process| after {STEPS} steps: {diff:.3e}")
    assert diff <= 1e-5


def _adaptive_without_sync(rank: int, world_size: int) -> dict:
    from opake_fx.errors import DistributedMismatchError

    base = {"noise_multiplier": 0.8, "adaptive": True, "sync_states": False}
    one_step = train(rank, world_size, steps=1, **base)
    try:
        train(rank, world_size, steps=3, **base)
    except DistributedMismatchError as exc:
        return {"norms": one_step["norms"], "error": str(exc)}
    return {"norms": one_step["norms"], "error": None}


@pytest.mark.distributed
def test_adaptive_clipping_sync_keeps_norms_identical(group2):
    kwargs = {"steps": 12, "noise_multiplier": 0.8, "adaptive": True, "sync_states": True}
    synced = group2.run(train_on_rank, kwargs, timeout=120)
    single = train(None, 2, **kwargs)
    # With sync every rank clips at the norm a single process would use on the union.
    assert synced[0]["norms"] == synced[1]["norms"]
    assert len(set(synced[0]["norms"])) > 5  # the norm does move
    assert max(abs(a - b) for a, b in zip(synced[0]["norms"], single["norms"])) <= 1e-9
    assert max_abs_diff(synced[0]["params"], single["params"]) <= 1e-5


@pytest.mark.distributed
def test_adaptive_clipping_diverges_without_sync(group2):
    r0, r1 = group2.run(_adaptive_without_sync, timeout=120)
    # Each rank updated its norm from its local count only: after one step they differ ...
    assert abs(r0["norms"][0] - r1["norms"][0]) > 1e-4
    # ... and the next aggregation refuses to sum gradients clipped at different norms.
    assert r0["error"] is not None and "max_norm differs across ranks" in r0["error"]
    assert r1["error"] == r0["error"]
