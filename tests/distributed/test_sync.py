"""sync and register_sync_type: dispatch, single-process identity, built-ins on 2 ranks."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

import opake_fx.distributed as od
from opake_fx.distributed import state_sync as _state
from opake_fx.dpsgd.clipping import (
    AdaptiveClipState,
    ClippedGradAux,
    ClippingStats,
    FixedClipState,
    adaptive_clipped_grad,
    clipped_grad,
)
from opake_fx.dpsgd.clipping.adaptive import next_clipping_norm
from opake_fx.dpsgd.noise import GaussianNoiseState
from opake_fx.dpsgd.sampling import PoissonSampler, SequentialBatchSampler, TruncatedPoissonSampler
from opake_fx.errors import DistributedMismatchError, InputTypeError
from opake_fx.random import fold_in, key


@dataclass(frozen=True)
class _Base:
    value: int


@dataclass(frozen=True)
class _Child(_Base):
    pass


@dataclass(frozen=True)
class _Unregistered:
    value: int


@pytest.fixture
def restore_registry():
    saved = dict(_state._SYNC_REGISTRY)
    yield
    _state._SYNC_REGISTRY.clear()
    _state._SYNC_REGISTRY.update(saved)


def _loss(p, x):
    return 0.5 * ((x - p) ** 2).sum()


def _states() -> list:
    _, fixed = clipped_grad(_loss, clipping_norm=1.0)
    _, adaptive = adaptive_clipped_grad(_loss, initial_clipping_norm=1.0, count_noise_multiplier=1.0, key=key(1))
    return [
        fixed,
        adaptive,
        GaussianNoiseState(key(42)),
        PoissonSampler(100, sample_rate=0.1, n_steps=3, key=key(0)),
        TruncatedPoissonSampler(100, sample_rate=0.1, n_steps=3, key=key(0), max_batch_size=20),
        SequentialBatchSampler(100, batch_size=10),
        ClippingStats(1.0, 0.5, 2),
        ClippedGradAux(torch.zeros(2), torch.ones(2), torch.ones(2), batch_size=2),
    ]


# --- single process -------------------------------------------------------------------


def test_single_process_sync_is_the_identity_for_every_builtin():
    states = _states()
    for s in states:
        assert od.sync(s) is s
    assert all(a is b for a, b in zip(od.sync(*states), states))
    assert od.sync() == ()


def test_builtins_are_registered():
    names = {t.__name__ for t in od.registered_sync_types()}
    assert {
        "FixedClipState",
        "AdaptiveClipState",
        "GaussianNoiseState",
        "PoissonSampler",
        "SequentialBatchSampler",
        "ClippingStats",
        "ClippedGradAux",
    } <= names


def test_unregistered_type_is_refused_and_never_passed_through():
    for bad in (_Unregistered(1), {"key": key(0)}, 3.0, None):
        with pytest.raises(InputTypeError, match="no function registered") as info:
            od.sync(bad)
        assert "GaussianNoiseState" in str(info.value) and "register_sync_type" in str(info.value)
    with pytest.raises(InputTypeError):
        od.sync(GaussianNoiseState(key(0)), _Unregistered(1))


def test_register_dispatches_exact_type_then_mro(restore_registry, monkeypatch):
    calls = []
    od.register_sync_type(_Base, lambda s: calls.append(("base", s)) or replace(s, value=-1))

    @od.register_sync_type(_Child)
    def child_sync(s):
        calls.append(("child", s))
        return s

    assert od.sync(_Base(1)) == _Base(1)  # one process: registered types are returned unchanged
    assert calls == []
    monkeypatch.setattr(_state, "is_distributed", lambda: True)  # exercise dispatch without a group
    assert od.sync(_Base(1)) == _Base(-1)
    assert od.sync(_Child(2)) is not None and calls[-1][0] == "child"
    del _state._SYNC_REGISTRY[_Child]
    assert od.sync(_Child(3)) == _Child(-1)  # falls back to the base class
    with pytest.raises(InputTypeError, match="class"):
        od.register_sync_type("GaussianNoiseState", lambda s: s)
    with pytest.raises(InputTypeError, match="callable"):
        od.register_sync_type(_Base, 3)


def test_user_registration_overrides_a_builtin(restore_registry, monkeypatch):
    od.register_sync_type(GaussianNoiseState, lambda s: "mine")
    monkeypatch.setattr(_state, "is_distributed", lambda: True)
    assert od.sync(GaussianNoiseState(key(0))) == "mine"


# --- two ranks ------------------------------------------------------------------------


def _error(fn, *args):
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)
    return None


def _sync_checks(rank: int, world_size: int) -> dict:
    out: dict = {}
    # FixedClipState
    _, fixed = clipped_grad(_loss, clipping_norm=1.0)
    out["fixed ok"] = od.sync(fixed) is fixed
    out["fixed norm"] = _error(od.sync, FixedClipState(1.0 + rank))
    out["fixed step"] = _error(od.sync, FixedClipState(1.0, step=rank))
    # GaussianNoiseState
    noise_state = GaussianNoiseState(key(42), step=3)
    out["noise ok"] = od.sync(noise_state) is noise_state
    out["noise key"] = _error(od.sync, GaussianNoiseState(key(42 + rank)))
    out["noise step"] = _error(od.sync, GaussianNoiseState(key(42), step=5 + rank))
    # several at once, in order
    a, b = od.sync(fixed, noise_state)
    out["tuple"] = (a is fixed, b is noise_state)
    # AdaptiveClipState: the local counts differ, the synced norm does not.
    grad_fn, state = adaptive_clipped_grad(
        _loss, initial_clipping_norm=1.0, count_noise_multiplier=1.0, key=key(9), expected_batch_size=8
    )
    out["adaptive before first step"] = od.sync(state) is state
    x = torch.tensor([0.5, 0.5, 3.0, 4.0]) if rank == 0 else torch.tensor([0.1, 5.0, 6.0, 7.0])
    _, local = grad_fn(torch.tensor(0.0), x, state=state)
    synced = od.sync(local)
    again = od.sync(synced)
    out["adaptive"] = {
        "local count": local.centered_count,
        "local norm": local.clipping_norm,
        "synced count": synced.centered_count,
        "synced norm": synced.clipping_norm,
        "expected norm": next_clipping_norm(local, synced.centered_count),
        "idempotent": again is synced,
        "count noise": local.count_noise,
    }
    out["adaptive key"] = _error(od.sync, replace(local, key=key(rank)))
    out["adaptive step"] = _error(od.sync, replace(local, step=local.step + rank))
    out["adaptive half synced"] = _error(od.sync, synced if rank == 0 else local)
    # Samplers
    poisson = PoissonSampler(100, sample_rate=0.1, n_steps=5, key=fold_in(key(0), rank))
    out["poisson ok"] = od.sync(poisson) is poisson
    out["poisson same key"] = _error(od.sync, PoissonSampler(100, sample_rate=0.1, n_steps=5, key=key(0)))
    out["poisson steps"] = _error(od.sync, PoissonSampler(100, sample_rate=0.1, n_steps=5 + rank, key=fold_in(key(0), rank)))
    moved = PoissonSampler(100 + rank, sample_rate=0.1, n_steps=5, key=fold_in(key(0), rank))
    if rank == 0:
        next(iter(moved))
    out["poisson cursor"] = _error(od.sync, moved)
    truncated = TruncatedPoissonSampler(50 + rank, sample_rate=0.1, n_steps=5, key=fold_in(key(1), rank), max_batch_size=9)
    out["truncated ok"] = od.sync(truncated) is truncated
    out["sequential"] = _error(od.sync, SequentialBatchSampler(100, batch_size=10 + rank))
    # ClippingStats / ClippedGradAux from real clipping calls on different batch sizes
    stats_fn, s0 = clipped_grad(_loss, clipping_norm=1.0, return_stats=True)
    xs = torch.tensor([0.5, 3.0, 4.0]) if rank == 0 else torch.tensor([0.1, 0.2, 5.0, 6.0, 7.0])
    (_, stats), _ = stats_fn(torch.tensor(0.0), xs, state=s0)
    synced_stats = od.sync(stats)
    out["stats"] = (synced_stats.num_clipped, synced_stats.batch_size, synced_stats.clipping_rate)
    out["stats idempotent"] = od.sync(synced_stats) is synced_stats
    per_group = ClippingStats({"a": float(rank), "b": 1.0}, {"a": 0.0, "b": 0.5}, 2 + rank)
    pg = od.sync(per_group)
    out["stats per group"] = (pg.num_clipped, pg.clipping_rate, pg.batch_size)
    aux_fn, s1 = clipped_grad(_loss, clipping_norm=1.0, return_aux=True)
    (_, aux), _ = aux_fn(torch.tensor(0.0), xs, state=s1)
    synced_aux = od.sync(aux)
    out["aux"] = (
        synced_aux.grad_norms.tolist(),
        synced_aux.loss_values.shape[0],
        synced_aux.batch_size,
        synced_aux.clipping_rate,
    )
    # Unregistered: raises before any collective, on every rank
    out["unregistered"] = _error(od.sync, _Unregistered(rank))
    out["still usable"] = od.all_reduce(torch.ones(1)).item()
    return out


@pytest.mark.distributed
def test_sync_builtins_two_ranks(group2):
    r0, r1 = group2.run(_sync_checks)
    assert r0["fixed ok"] and r0["noise ok"] and r0["tuple"] == (True, True)
    kind, msg = r0["fixed norm"]
    assert kind == "DistributedMismatchError" and "clipping_norm" in msg and "1.0" in msg and "2.0" in msg
    assert r0["fixed step"][0] == "DistributedMismatchError" and "step" in r0["fixed step"][1]
    kind, msg = r0["noise key"]
    assert kind == "DistributedMismatchError"
    assert "GaussianNoiseState.key" in msg and "RngKey(0, 42)" in msg and "RngKey(0, 43)" in msg
    kind, msg = r0["noise step"]
    assert kind == "DistributedMismatchError" and "rank 0 has 5" in msg and "rank 1 has 6" in msg
    # adaptive
    assert r0["adaptive before first step"]
    a0, a1 = r0["adaptive"], r1["adaptive"]
    assert a0["local count"] != a1["local count"] and a0["local norm"] != a1["local norm"]
    assert a0["synced count"] == a1["synced count"] == a0["local count"] + a1["local count"]
    assert a0["synced norm"] == a1["synced norm"] == a0["expected norm"]
    assert a0["count noise"] == a1["count noise"]  # identical count noise: added once to the global count
    assert a0["idempotent"] and a1["idempotent"]
    assert r0["adaptive key"][0] == "DistributedMismatchError" and ".key" in r0["adaptive key"][1]
    assert r0["adaptive step"][0] == "DistributedMismatchError"
    assert r0["adaptive half synced"][0] == "DistributedMismatchError"
    assert "already synced" in r0["adaptive half synced"][1]
    # samplers
    assert r0["poisson ok"] and r0["truncated ok"]
    kind, msg = r0["poisson same key"]
    assert kind == "DistributedMismatchError" and "fold_in(key, rank)" in msg
    assert r0["poisson steps"][0] == "DistributedMismatchError" and "n_steps" in r0["poisson steps"][1]
    assert r0["poisson cursor"][0] == "DistributedMismatchError" and "next_step" in r0["poisson cursor"][1]
    assert r0["sequential"][0] == "DistributedMismatchError" and "batch_size" in r0["sequential"][1]
    # diagnostics: norms |x| > 1 are clipped; rank 0 has 2 of 3, rank 1 has 3 of 5
    assert r0["stats"] == r1["stats"] == (5.0, 8, 5 / 8)
    assert r0["stats idempotent"]
    assert r0["stats per group"] == ({"a": 1.0, "b": 2.0}, {"a": 0.2, "b": 0.4}, 5)
    assert r0["aux"] == r1["aux"]
    norms, n, batch, rate = r0["aux"]
    assert norms == pytest.approx([0.5, 3.0, 4.0, 0.1, 0.2, 5.0, 6.0, 7.0]) and n == 8 and batch == 8
    assert rate == 5 / 8
    assert r0["unregistered"][0] == "InputTypeError"
    assert r0["still usable"] == 2.0
