"""A user-level plan on 2 gloo ranks: whole users per rank, and one user moves the summed clipped
gradient by at most the clip norm (issue 33's sensitivity test on 2 ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opake_fx.distributed import psum
from opake_fx.dpsgd import clip
from opake_fx.functional import make_functional
from opake_fx.optimizers import sgd
from opake_fx.plan import DPPlan
from opake_fx.random import key
from opake_fx.transforms import apply_updates, named_chain
from opake_fx.users import UserIndex, batched_user_loss, collate_users

N_USERS, C = 24, 0.5


def _data():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, N_USERS, (300,), generator=g)
    ids[:N_USERS] = torch.arange(N_USERS)
    x = torch.randn(300, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (300,), generator=g)
    return ids, x, y


def _model():
    torch.manual_seed(0)
    return make_functional(nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double())


def _user_plan_run(rank: int, world_size: int) -> dict:
    ids, x, y = _data()
    plan = DPPlan(dataset_size=N_USERS, batch_size=8, steps=4, clipping_norm=C, noise_multiplier=1.0, delta=1e-5,
                  privacy_unit="user", max_examples_per_user=3, clip_backend="auto")
    fmodel, params = _model()
    sampler = plan.sampler(x, key(1), user_ids=ids)
    pipeline = plan.pipeline(lambda p, xb, yb: F.cross_entropy(fmodel(p, xb), yb, reduction="none"), sgd(0.1),
                             key=key(0), model=fmodel)
    state, users_seen = pipeline.init(params), set()
    for groups in sampler:
        users_seen |= {int(ids[g[0]]) for g in groups}
        blocks, mask = collate_users((x, y), groups, max_examples=3)
        updates, state = pipeline.update((*blocks, mask), state, params)
        params = apply_updates(params, updates)
    return {"params": [p.tolist() for p in params], "users": sorted(users_seen), "n_local": sampler.dataset_size}


@pytest.mark.distributed
def test_a_user_plan_on_two_ranks_keeps_each_user_on_one_rank_and_ranks_identical(group2):
    r0, r1 = group2.run(_user_plan_run)
    assert r0["params"] == r1["params"]
    assert r0["n_local"] + r1["n_local"] == N_USERS
    assert r0["users"] and r1["users"] and not set(r0["users"]) & set(r1["users"])


def _summed_clip(rank: int, world_size: int, drop_attacker: bool) -> list:
    """Every user on both ranks at once (sample rate 1); the attacker is rank 1's first user, with every
    example made huge. Returns the clipped sum after the psum over ranks."""
    ids, x, y = _data()
    users = UserIndex(ids)
    local = users.shard(*(0, N_USERS // 2) if rank == 0 else (N_USERS // 2, N_USERS))
    attacker = local.examples_of(0) if rank == 1 else []
    x[attacker] = 1e6
    groups = [local.examples_of(u)[:3] for u in range(local.n_users)]
    if drop_attacker and rank == 1:
        groups = groups[1:]
    fmodel, params = _model()
    blocks, mask = collate_users((x, y), groups, max_examples=3)
    loss = batched_user_loss(lambda p, xb, yb: F.cross_entropy(fmodel(p, xb), yb, reduction="none"))
    chain = named_chain(("clip", clip(loss, clipping_norm=C, batch_argnums=(1, 2, 3), clip_backend="auto",
                                      model=fmodel)), ("psum", psum()))
    out, _ = chain.update((*blocks, mask), chain.init(params), params)
    return [t.tolist() for t in out.pytree]


@pytest.mark.distributed
def test_one_user_moves_the_summed_clipped_gradient_by_at_most_c_on_two_ranks(group2):
    with_attacker = group2.run(_summed_clip, False)
    without = group2.run(_summed_clip, True)
    assert with_attacker[0] == with_attacker[1] and without[0] == without[1]
    diff = sum(((torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)) ** 2).sum()
               for a, b in zip(with_attacker[0], without[0]))
    assert 0.9 * C < float(diff) ** 0.5 <= C * (1 + 1e-12)
