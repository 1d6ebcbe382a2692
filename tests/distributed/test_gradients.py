"""sum_gradients / reduce_pytree / psum: metadata rules, refusals, cross-rank consensus."""

from __future__ import annotations

import math

import pytest
import torch

import opake_fx.distributed as od
from opake_fx.dpsgd import clip, noise
from opake_fx.errors import DistributedMismatchError, InputTypeError, InputValueError
from opake_fx.random import key
from opake_fx.transforms import apply_updates, chain
from opake_fx.types import (
    ClippedPytree,
    NoisedPytree,
    PerGroup,
    SecondMomentClippingOutput,
    SecondMomentNoiseOutput,
)


def _clipped(value: float = 1.0, max_norm=0.5) -> ClippedPytree:
    return ClippedPytree({"w": torch.full((2, 2), value), "b": torch.full((2,), value)}, max_norm=max_norm)


def _noised(value: float = 1.0, stddev=2.0) -> NoisedPytree:
    return NoisedPytree((torch.full((3,), value),), max_norm=0.5, noise_stddev=stddev)


# --- single process -------------------------------------------------------------------


def test_single_process_sum_is_a_copy_with_unchanged_metadata():
    g = _clipped()
    out = od.sum_gradients(g)
    assert type(out) is ClippedPytree and out.max_norm == 0.5
    assert out.pytree["w"] is not g.pytree["w"] and torch.equal(out.pytree["w"], g.pytree["w"])
    od.sum_gradients_(g)
    assert g.pytree["b"].tolist() == [1.0, 1.0]
    plain = od.reduce_pytree([torch.ones(2)], op="max")
    assert plain[0].tolist() == [1.0, 1.0]


def test_single_process_wrapper_metadata_for_w_equal_one():
    n = od.reduce_pytree(_noised(), op="sum")
    assert (type(n), n.max_norm, n.noise_stddev) == (NoisedPytree, 0.5, 2.0)
    m = od.reduce_pytree(_clipped(), op="mean")
    assert m.max_norm == 0.5


@pytest.mark.parametrize("fn", [od.sum_gradients, od.sum_gradients_])
def test_sum_gradients_refuses_noise_before_aggregation(fn):
    for bad in (_noised(), {"inner": _noised()}, SecondMomentNoiseOutput(_noised(), _noised())):
        with pytest.raises(InputTypeError, match="noise was added before the gradients were aggregated") as info:
            fn(bad)
        assert "sum_gradients" in str(info.value) and "W * sigma" in str(info.value)


def test_in_place_refuses_metadata_changes_on_any_world_size():
    with pytest.raises(InputTypeError, match="would change its max_norm"):
        od.reduce_pytree_(_clipped(), op="mean")
    with pytest.raises(InputTypeError, match="would change its noise_stddev"):
        od.reduce_pytree_(_noised(), op="sum")
    with pytest.raises(InputTypeError, match="max_norm and noise_stddev"):
        od.reduce_pytree_(_noised(), op="mean")
    od.reduce_pytree_(_clipped(), op="sum")  # metadata unchanged: allowed


@pytest.mark.parametrize("op", ["max", "min", "prod"])
def test_wrappers_refuse_reductions_without_a_sensitivity_bound(op):
    with pytest.raises(InputValueError, match="no sensitivity bound"):
        od.reduce_pytree(_clipped(), op=op)
    with pytest.raises(InputValueError, match="no sensitivity bound"):
        od.reduce_pytree_({"g": _clipped()}, op=op)


def test_non_tensor_leaves_and_bad_ops():
    with pytest.raises(InputTypeError, match=r"path \('lr',\) is a float"):
        od.reduce_pytree({"w": torch.ones(1), "lr": 0.1})
    with pytest.raises(InputTypeError, match="is a str"):
        od.sum_gradients_(ClippedPytree(("oops",), max_norm=1.0))
    with pytest.raises(InputTypeError, match="floating-point"):
        od.reduce_pytree([torch.ones(2, dtype=torch.int32)], op="mean")
    with pytest.raises(InputValueError, match="unknown reduction op"):
        od.reduce_pytree([torch.ones(2)], op="average")
    with pytest.raises(InputTypeError, match="do not nest"):
        od.reduce_pytree(ClippedPytree((_clipped(),), max_norm=1.0))


def test_stage_helpers_name_their_caller_and_match_reduce_pytree():
    from opake_fx.distributed.gradients import check_reduction, reduce_copy, refuse_noised

    out = reduce_copy(_clipped(2.0), "sum", where="my_stage", full_check=False)
    assert isinstance(out, ClippedPytree) and out.max_norm == 0.5 and out.pytree["w"].eq(2.0).all()
    with pytest.raises(InputValueError, match="my_stage"):
        reduce_copy(_clipped(), "max", where="my_stage")
    check_reduction(_clipped(), "sum", where="my_stage")  # nothing to refuse
    with pytest.raises(InputTypeError, match="my_stage"):
        check_reduction({"lr": 0.1}, "sum", where="my_stage")
    refuse_noised(_clipped(), "my_stage")
    with pytest.raises(InputTypeError, match="my_stage got a NoisedPytree"):
        refuse_noised({"inner": _noised()}, "my_stage")


def test_second_moment_pairs_recurse_into_both_streams():
    pair = SecondMomentClippingOutput(_clipped(1.0, 0.5), _clipped(2.0, 0.25))
    out = od.sum_gradients(pair)
    assert isinstance(out, SecondMomentClippingOutput)
    assert (out.grads.max_norm, out.squared_grads.max_norm) == (0.5, 0.25)
    assert out.squared_grads.pytree["w"][0, 0].item() == 2.0
    noised = od.reduce_pytree(SecondMomentNoiseOutput(_noised(), _noised(stddev=3.0)), op="mean")
    assert noised.noisy_squared_grads.noise_stddev == 3.0


def test_psum_stage_single_process_is_the_identity():
    stage = od.psum()
    g = _clipped()
    out, state = stage.update(g, stage.init(None))
    assert out is g
    with pytest.raises(InputTypeError, match="psum got a NoisedPytree"):
        stage.update(_noised(), state)
    with pytest.raises(InputTypeError, match="leaf"):
        stage.update({"x": "not a tensor"}, state)
    plain, _ = stage.update([torch.ones(2)], state)  # non-private use of psum is allowed
    assert plain[0].tolist() == [1.0, 1.0]


def test_pipeline_with_psum_runs_unchanged_in_one_process():
    f = lambda p, x: ((x - p) ** 2).sum()  # noqa: E731
    pipeline = chain(clip(f, clipping_norm=1.0, batch_argnums=(1,), normalize_by=4), od.psum(),
                     noise(noise_multiplier=0.0, key=key(0)))
    p = torch.zeros(2)
    out, _ = pipeline.update((torch.ones(4, 2),), pipeline.init(p), p)
    assert type(out) is NoisedPytree and out.max_norm == 0.25
    assert torch.allclose(apply_updates(p, out), torch.full((2,), -1 / math.sqrt(2)))


# --- two ranks ------------------------------------------------------------------------


def _error(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the test inspects the type and message
        return type(exc).__name__, str(exc)
    return None


def _aggregation(rank: int, world_size: int) -> dict:
    out: dict = {}
    g = _clipped(1.0 + rank)  # rank 0 holds ones, rank 1 twos
    summed = od.sum_gradients(g)
    out["sum"] = (summed.max_norm, summed.pytree["w"].tolist(), g.pytree["w"][0, 0].item() == 1.0 + rank)
    od.sum_gradients_(g)
    out["sum_"] = (g.max_norm, g.pytree["b"].tolist())
    mean = od.reduce_pytree(_clipped(1.0 + rank), op="mean")
    out["mean"] = (mean.max_norm, mean.pytree["b"].tolist())
    noised = od.reduce_pytree(_noised(1.0 + rank), op="sum")
    out["noised sum"] = (noised.max_norm, noised.noise_stddev, noised.pytree[0].tolist())
    noised_mean = od.reduce_pytree(_noised(1.0 + rank), op="mean")
    out["noised mean"] = (noised_mean.max_norm, noised_mean.noise_stddev)
    groups = {"w": "dense", "b": "bias"}
    pg = od.sum_gradients(_clipped(1.0, PerGroup(groups, {"dense": 3.0, "bias": 4.0})))
    out["per group"] = dict(pg.max_norm.values)
    pg_noise = od.reduce_pytree(
        NoisedPytree((torch.ones(1),), max_norm=1.0, noise_stddev=PerGroup({"a": "g"}, {"g": 2.0})), op="mean"
    )
    out["per group noise"] = dict(pg_noise.noise_stddev.values)
    pair = od.sum_gradients(SecondMomentClippingOutput(_clipped(1.0), _clipped(float(rank), 0.25)))
    out["pair"] = (pair.grads.pytree["b"].tolist(), pair.squared_grads.pytree["b"].tolist(), pair.squared_grads.max_norm)
    nested = od.sum_gradients({"model": _clipped(1.0), "extra": [torch.tensor([rank + 1.0])]})
    out["nested"] = (nested["model"].max_norm, nested["extra"][0].tolist())
    many = [torch.full((i + 1,), float(rank), dtype=torch.float64 if i % 2 else torch.float32) for i in range(7)]
    many.append(torch.arange(6.0).reshape(2, 3).t() * (rank + 1))  # non-contiguous leaf
    reduced = od.reduce_pytree(many, op="max")
    out["buckets"] = [t.tolist() for t in reduced]
    # Mismatches: every rank raises the same error and the group stays usable.
    out["max_norm mismatch"] = _error(od.sum_gradients, _clipped(1.0, 0.5 if rank == 0 else 0.25))
    out["per-group mismatch"] = _error(
        od.sum_gradients, _clipped(1.0, PerGroup(groups, {"dense": 3.0, "bias": 4.0 + rank}))
    )
    out["stddev mismatch"] = _error(od.reduce_pytree, _noised(stddev=2.0 + rank), op="sum")
    out["shape mismatch"] = _error(od.sum_gradients, [torch.ones(2 + rank)])
    out["wrapper mismatch"] = _error(od.sum_gradients, _clipped() if rank == 0 else _clipped().pytree)
    out["dtype mismatch"] = _error(od.sum_gradients, [torch.ones(2, dtype=torch.float32 if rank else torch.float64)])
    out["still usable"] = od.sum_gradients([torch.ones(1)])[0].item()
    return out


@pytest.mark.distributed
def test_aggregation_two_ranks(group2):
    r0, r1 = group2.run(_aggregation)
    wrapper_errors = r0.pop("wrapper mismatch"), r1.pop("wrapper mismatch")
    assert r0 == r1  # both ranks end with identical values and identical errors
    assert r0["sum"] == (0.5, [[3.0, 3.0], [3.0, 3.0]], True)  # max_norm unchanged; input untouched
    assert r0["sum_"] == (0.5, [3.0, 3.0])
    assert r0["mean"] == (0.25, [1.5, 1.5])
    max_norm, stddev, values = r0["noised sum"]
    assert max_norm == 0.5 and stddev == pytest.approx(2.0 * math.sqrt(2)) and values == [3.0] * 3
    assert r0["noised mean"][0] == 0.25 and r0["noised mean"][1] == pytest.approx(2.0 / math.sqrt(2))
    assert r0["per group"] == {"dense": 3.0, "bias": 4.0}
    assert r0["per group noise"]["g"] == pytest.approx(math.sqrt(2))
    assert r0["pair"] == ([2.0, 2.0], [1.0, 1.0], 0.25)
    assert r0["nested"] == (0.5, [3.0])
    assert r0["buckets"][:7] == [[1.0] * (i + 1) for i in range(7)]
    assert r0["buckets"][7] == [[0.0, 6.0], [2.0, 8.0], [4.0, 10.0]]
    kind, msg = r0["max_norm mismatch"]
    assert kind == "DistributedMismatchError"
    assert "max_norm differs across ranks" in msg and "rank 0 has 0.5" in msg and "rank 1 has 0.25" in msg
    kind, msg = r0["per-group mismatch"]
    assert kind == "DistributedMismatchError" and "'bias': 4.0" in msg and "'bias': 5.0" in msg
    kind, msg = r0["stddev mismatch"]
    assert kind == "DistributedMismatchError" and "noise_stddev" in msg and "2.0" in msg and "3.0" in msg
    assert r0["shape mismatch"][0] == "DistributedMismatchError" and "tree structure" in r0["shape mismatch"][1]
    for kind, msg in wrapper_errors:
        assert kind == "DistributedMismatchError" and "ClippedPytree on every rank or on none" in msg
    assert r0["dtype mismatch"][0] == "DistributedMismatchError"
    assert r0["still usable"] == 2.0


def _psum_pipeline(rank: int, world_size: int) -> dict:
    f = lambda p, x: ((x - p) ** 2).sum()  # noqa: E731
    clip_stage = clip(f, clipping_norm=1.0, batch_argnums=(1,), normalize_by=4)
    pipeline = chain(clip_stage, od.psum(), noise(noise_multiplier=1.0, key=key(7)))
    p = torch.zeros(3)
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(rank)) * 5  # different local data per rank
    out, _ = pipeline.update((x,), pipeline.init(p), p)
    local, _ = clip_stage.update((x,), clip_stage.init(p), p)
    psum_err = _error(od.psum().update, NoisedPytree((torch.ones(1),), 1.0, noise_stddev=1.0), None)
    return {
        "type": type(out).__name__,
        "max_norm": out.max_norm,
        "values": out.pytree.tolist(),
        "local": local.pytree.tolist(),
        "psum noised": psum_err,
    }


@pytest.mark.distributed
def test_psum_pipeline_two_ranks(group2):
    r0, r1 = group2.run(_psum_pipeline)
    assert r0["type"] == "NoisedPytree" and r0["max_norm"] == 0.25
    assert r0["values"] == r1["values"]  # summed + identical noise: both ranks hold the same update
    assert r0["local"] != r1["local"]
    noise_stage = noise(noise_multiplier=1.0, key=key(7))
    zero = ClippedPytree(torch.zeros(3), max_norm=0.25)
    drawn, _ = noise_stage.update(zero, noise_stage.init(None))
    expected = torch.tensor(r0["local"]) + torch.tensor(r1["local"]) + drawn.pytree
    torch.testing.assert_close(torch.tensor(r0["values"]), expected)
    assert r0["psum noised"][0] == "InputTypeError"


def _grad_leaves(rank: int, world_size: int) -> dict:
    w = torch.ones(2, requires_grad=True)
    summed = od.sum_gradients([w * (rank + 1)])
    gathered = od.gather_for_metrics(w * 2)
    inplace = torch.ones(2, requires_grad=True)
    od.sum_gradients_([inplace])  # a leaf that requires grad: reduced without autograd
    return {"sum": summed[0].tolist(), "grad": summed[0].requires_grad, "gathered": gathered.tolist(),
            "inplace": inplace.detach().tolist()}


@pytest.mark.distributed
def test_leaves_that_require_grad(group2):
    r0, r1 = group2.run(_grad_leaves)
    assert r0 == r1 == {"sum": [3.0, 3.0], "grad": False, "gathered": [2.0] * 4, "inplace": [2.0, 2.0]}
