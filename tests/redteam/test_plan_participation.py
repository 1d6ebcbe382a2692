"""Red team: a DP-FTRL plan's participation guarantee across a resume.

The pattern accounting of ``b_min_sep`` / ``balls_in_bins`` / ``cyclic_poisson`` plans
assumes each example's participations follow ONE keyed pattern over the whole run. A
sampler that loads a state saved with another key (ranks' checkpoints swapped, another
run's state) continues a different pattern for the same examples.
"""

from __future__ import annotations

import pytest

from opake_fx.errors import InputValueError
from opake_fx.plan import DPPlan
from opake_fx.random import key


def _plan(sampling: str, mechanism: str) -> DPPlan:
    if sampling == "cyclic_poisson":
        return DPPlan(dataset_size=400, batch_size=20, steps=40, noise_multiplier=1.0, mechanism=mechanism,
                      sampling=sampling, bands=4, delta=1e-5)
    return DPPlan(dataset_size=400, batch_size=20, steps=40, noise_multiplier=1.0, mechanism=mechanism,
                  sampling=sampling, min_sep=10 if sampling == "b_min_sep" else 20, delta=1e-5)


@pytest.mark.parametrize(
    "sampling, mechanism", [("b_min_sep", "blt"), ("balls_in_bins", "blt"), ("cyclic_poisson", "band_mf")]
)
def test_swapped_rank_state_is_refused(sampling: str, mechanism: str) -> None:
    plan = _plan(sampling, mechanism)
    rank0 = plan.sampler(range(400), key(1), rank=0, world_size=2)
    rank1 = plan.sampler(range(400), key(1), rank=1, world_size=2)
    for _ in zip(range(5), rank1):
        pass
    with pytest.raises(InputValueError, match="differs from this sampler's key"):
        rank0.load_state_dict(rank1.state_dict())  # the shards have the same size: only the key tells them apart
    assert rank0.next_step == 0  # nothing changed


def test_b_min_sep_resume_keeps_min_sep_and_participation_count() -> None:
    """Its own state resumes; the whole run then has gaps >= min_sep and <= max_participations each."""
    plan = _plan("b_min_sep", "blt")
    p = plan.participation
    s = plan.sampler(range(400), key(3))
    seen: dict[int, list[int]] = {}
    it = iter(s)
    for t in range(17):
        for i in next(it):
            seen.setdefault(i, []).append(t)
    resumed = plan.sampler(range(400), key(3))
    resumed.load_state_dict(s.state_dict())
    for t, batch in zip(range(17, plan.steps), resumed):
        for i in batch:
            seen.setdefault(i, []).append(t)
    assert resumed.next_step == plan.steps
    for ts in seen.values():
        assert len(ts) <= p.max_participations
        assert all(b - a >= p.min_sep for a, b in zip(ts, ts[1:]))


def test_a_sampler_sharded_unlike_the_process_group_is_refused(tmp_path) -> None:
    """Ranks told world_size=1 under a group of 2 would all draw the whole dataset with one key: each
    example would enter the psum once per rank. Shown in a one-process gloo group (world_size=2 asked)."""
    import torch.distributed as dist

    plan = _plan("b_min_sep", "blt")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        plan.sampler(range(400), key(1))  # the group's own sharding
        plan.sampler(range(400), key(1), rank=0, world_size=1)
        with pytest.raises(InputValueError, match="differ from the process group"):
            plan.sampler(range(400), key(1), rank=0, world_size=2)
    finally:
        dist.destroy_process_group()
