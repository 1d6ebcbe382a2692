"""Noise drawn one step ahead (opake_fx._noise_prefetch): the same numbers as the draw in
place, used only when key, layout and stddev match, one step ahead at most."""

from __future__ import annotations

import pytest
import torch

from opake_fx._noise_prefetch import PREFETCH_MIN_VALUES, NoisePrefetcher, prefetch_by_default
from opake_fx.errors import InputValueError
from opake_fx.random import flat_tree_normal, fold_in, key

LEAVES = [torch.zeros(300, 7), torch.zeros(5), torch.zeros(2, 3, dtype=torch.float64)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def test_steps_drawn_ahead_equal_the_draws_in_place_bit_for_bit() -> None:
    pf = NoisePrefetcher(enabled=True)
    k = key(7)
    for step in range(4):
        got, _ = pf.normals(k, step, LEAVES, 0.3)
        want, _ = flat_tree_normal(fold_in(k, step), LEAVES, stddev=0.3)
        assert _same(got, want)
        assert pf.pending  # the next step's draw is running, and only that one
    assert pf.hits == 3  # step 0 had nothing pending


@pytest.mark.parametrize(
    "change",
    [
        dict(step_key=fold_in(key(7), 2)),  # another step
        dict(step_key=fold_in(key(8), 1)),  # another key
        dict(stddev=0.31),
        dict(leaves=[torch.zeros(7, 300), torch.zeros(5), torch.zeros(2, 3, dtype=torch.float64)]),  # same sizes, other shapes
        dict(leaves=[torch.zeros(300, 7), torch.zeros(5), torch.zeros(2, 3)]),  # another dtype
    ],
)
def test_a_draw_made_for_anything_else_is_dropped_and_the_noise_drawn_now(change: dict) -> None:
    pf = NoisePrefetcher(enabled=True)
    pf.prefetch(fold_in(key(7), 1), LEAVES, 0.3)
    asked = dict(step_key=fold_in(key(7), 1), leaves=LEAVES, stddev=0.3) | change
    got, _ = pf.draw(asked["step_key"], asked["leaves"], asked["stddev"])
    want, _ = flat_tree_normal(asked["step_key"], asked["leaves"], stddev=asked["stddev"])
    assert _same(got, want)
    assert pf.hits == 0 and not pf.pending


def test_a_draw_is_used_once() -> None:
    pf = NoisePrefetcher(enabled=True)
    pf.prefetch(fold_in(key(1), 0), LEAVES, 1.0)
    first, _ = pf.draw(fold_in(key(1), 0), LEAVES, 1.0)
    again, _ = pf.draw(fold_in(key(1), 0), LEAVES, 1.0)
    assert pf.hits == 1
    assert _same(first, again)  # the same key gives the same numbers, but from a fresh draw
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(first, again))


def test_disabled_never_draws_ahead_and_discard_drops_the_pending_draw() -> None:
    off = NoisePrefetcher(enabled=False)
    off.normals(key(0), 0, LEAVES, 1.0)
    assert not off.pending
    on = NoisePrefetcher(enabled=True)
    on.normals(key(0), 0, LEAVES, 1.0)
    on.discard()
    assert not on.pending
    got, _ = on.normals(key(0), 1, LEAVES, 1.0)
    assert on.hits == 0 and _same(got, flat_tree_normal(fold_in(key(0), 1), LEAVES)[0])


def test_the_last_step_starts_no_draw() -> None:
    pf = NoisePrefetcher(enabled=True)
    pf.normals(key(0), 2**64 - 1, LEAVES, 1.0)
    assert not pf.pending


def test_auto_draws_ahead_only_for_large_cpu_draws() -> None:
    small = [torch.zeros(PREFETCH_MIN_VALUES - 1)]
    large = [torch.zeros(PREFETCH_MIN_VALUES // 2), torch.zeros(PREFETCH_MIN_VALUES // 2)]
    assert not prefetch_by_default(small)
    assert not prefetch_by_default([])
    assert not prefetch_by_default([torch.zeros(PREFETCH_MIN_VALUES, device="meta")])
    auto = NoisePrefetcher(enabled=None)
    auto.normals(key(0), 0, small, 1.0)
    assert not auto.pending
    auto.normals(key(0), 0, large, 1.0)
    assert auto.pending == prefetch_by_default(large)


def test_enabled_must_be_a_bool_or_none() -> None:
    with pytest.raises(InputValueError, match="prefetch must be True, False or None"):
        NoisePrefetcher(enabled=1)  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_side_stream_draws_equal_the_draws_in_place_on_cuda() -> None:
    leaves = [torch.zeros(1000, 33, device="cuda"), torch.zeros(7, device="cuda")]
    pf = NoisePrefetcher(enabled=True)
    for step in range(3):
        got, _ = pf.normals(key(3), step, leaves, 0.5)
        want, _ = flat_tree_normal(fold_in(key(3), step), leaves, stddev=0.5)
        assert _same(got, want)
    assert pf.hits == 2
