"""Ranks agree on the noise key, step, multiplier and max_norm, or every rank raises at once."""

from __future__ import annotations

import pytest
import torch

import opake_fx.distributed as od
from opake_fx.distributed.agreement import AgreementCheck, agree
from opake_fx.dpftrl import band_mf_strategy
from opake_fx.dpftrl import noise as mf_noise
from opake_fx.dpsgd import clip, noise
from opake_fx.dpsgd.noise import GaussianNoiseState
from opake_fx.random import key
from opake_fx.transforms import named_chain


def _loss(p, x):
    return ((x - p) ** 2).sum()


def _pipeline(rank: int, *, key_seed: int = 7, nm: float = 1.0, clip_norm: float = 1.0, mf: bool = False):
    noise_stage = (
        mf_noise(band_mf_strategy(8, 2, max_iterations=5), noise_multiplier=nm, key=key(key_seed))
        if mf
        else noise(noise_multiplier=nm, key=key(key_seed))
    )
    return named_chain(
        ("clip", clip(_loss, clipping_norm=clip_norm, batch_argnums=(1,), normalize_by=4)),
        ("psum", od.psum()),
        ("noise", noise_stage),
    )


def _run(rank: int, world_size: int, setting: str, steps: int = 3) -> dict:
    kw = {
        "match": {},
        "noise key": {"key_seed": 7 + rank},
        "noise multiplier": {"nm": 1.0 - 0.25 * rank},  # rank 1 under-noised
        "clip norm": {"clip_norm": 1.0 + rank},
        "mf noise key": {"mf": True, "key_seed": 7 + rank},
        "mf match": {"mf": True},
    }[setting]
    pipeline = _pipeline(rank, **kw)
    p = torch.zeros(3)
    state = pipeline.init(p)
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(rank))
    outs = []
    for step in range(steps):
        try:
            out, state = pipeline.update((x,), state, p)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return {"step": step, "error": type(exc).__name__, "message": str(exc)}
        outs.append(out.pytree.tolist())
    return {"step": steps, "error": None, "values": outs}


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("setting", "field"),
    [
        ("noise key", "gaussian_noise.key differs"),
        ("noise multiplier", "gaussian_noise.noise_multiplier differs"),
        ("clip norm", "max_norm differs"),
        ("mf noise key", "mf_gaussian_noise.key differs"),
    ],
)
def test_a_mismatch_in_a_chain_raises_on_both_ranks_at_the_first_step(group2, setting, field):
    r0, r1 = group2.run(_run, setting)
    for r in (r0, r1):
        assert r["step"] == 0 and r["error"] == "DistributedMismatchError", r
        assert field in r["message"] and "rank 0 has" in r["message"] and "rank 1 has" in r["message"]
    assert r0["message"] == r1["message"]


@pytest.mark.distributed
@pytest.mark.parametrize("setting", ["match", "mf match"])
def test_matching_ranks_run_and_hold_identical_updates(group2, setting):
    r0, r1 = group2.run(_run, setting)
    assert r0["error"] is None and r1["error"] is None
    assert r0["values"] == r1["values"] and len(r0["values"]) == 3


def _later_step_divergence(rank: int, world_size: int) -> dict:
    pipeline = _pipeline(rank)
    p = torch.zeros(3)
    state = pipeline.init(p)
    x = torch.ones(2, 3)
    out, state = pipeline.update((x,), state, p)
    out, state = pipeline.update((x,), state, p)  # digest checks from here on
    if rank == 1:  # rank 1 resumes from another checkpoint: it would redraw step 1's noise
        state = {**state, "noise": GaussianNoiseState(state["noise"].key, step=1)}
    try:
        pipeline.update((x,), state, p)
    except Exception as exc:  # noqa: BLE001
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}


@pytest.mark.distributed
def test_a_later_divergence_is_caught_by_the_digest_on_both_ranks(group2):
    r0, r1 = group2.run(_later_step_divergence)
    for r in (r0, r1):
        assert r["error"] == "DistributedMismatchError"
        assert "gaussian_noise.step differs" in r["message"] and "rank 0 has 2" in r["message"]
        assert "rank 1 has 1" in r["message"]


def _agreement_collectives(rank: int, world_size: int, n: int) -> dict:
    """Counts the collectives (and the numbers they move) of n digest checks and of n full checks."""
    import torch.distributed as dist

    fields = [("key", key(7)), ("step", 5), ("noise_multiplier", 1.1), ("max_norm", 0.25), ("allocation", 0)]
    calls: list[tuple[str, int]] = []
    real = {name: getattr(dist, name) for name in ("all_reduce", "all_gather", "broadcast", "all_gather_object")}

    def counting(name):
        def call(*args, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            calls.append((name, sum(t.numel() for t in tensors)))
            return real[name](*args, **kwargs)
        return call

    check = AgreementCheck("bench", fix="")
    check(fields)  # the full first check
    od.barrier()
    counts = {}
    try:
        for name in real:
            setattr(dist, name, counting(name))
        for mode, full in (("digest", False), ("full", True)):
            calls.clear()
            for i in range(n):
                agree("bench", [*fields[:1], ("step", i), *fields[2:]], full=full, fix="")
            counts[mode] = list(calls)
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    return counts


@pytest.mark.distributed
def test_the_digest_check_is_one_small_collective(group2):
    # What a wall-clock bound used to stand for (benchmarks/agreement.py times it): a later step's
    # check is ONE all-reduce of 4 numbers, where the full check needs at least two all-gathers.
    # Counted, not timed, so a loaded machine cannot fail it.
    n = 20
    r0, r1 = group2.run(_agreement_collectives, n)
    for r in (r0, r1):
        assert r["digest"] == [("all_reduce", 4)] * n
        assert len(r["full"]) >= 2 * n and all(name == "all_gather" for name, _ in r["full"])


def test_single_process_agreement_is_a_no_op():
    check = AgreementCheck("noise", fix="")
    for step in range(3):
        check([("key", key(0)), ("step", step)])
    assert check.checked == 3
