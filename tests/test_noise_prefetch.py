"""Noise drawn one step ahead (opake_fx._noise_prefetch): the same numbers as the draw in
place, used only when key, layout and stddev match, one step ahead at most."""

from __future__ import annotations

import hashlib

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


def test_auto_draws_ahead_only_with_a_core_left_over_by_torch() -> None:
    import os

    large = [torch.zeros(PREFETCH_MIN_VALUES)]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(cores)  # torch's threads take every core: the draw would compete
        assert not prefetch_by_default(large)
        if cores >= 2:
            torch.set_num_threads(cores - 1)  # one core left for the background draw
            assert prefetch_by_default(large)
    finally:
        torch.set_num_threads(before)


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


def test_prefetch_next_draws_for_the_layout_and_stddev_of_the_last_draw() -> None:
    pf = NoisePrefetcher(enabled=True)
    pf.prefetch_next(key(2), 0)  # nothing drawn yet: nothing to repeat
    assert not pf.pending
    pf.draw(fold_in(key(2), 0), LEAVES, 0.7)
    pf.prefetch_next(key(2), 1)
    got, _ = pf.draw(fold_in(key(2), 1), LEAVES, 0.7)
    assert pf.hits == 1 and _same(got, flat_tree_normal(fold_in(key(2), 1), LEAVES, stddev=0.7)[0])


def test_prefetch_next_derives_no_key_when_prefetching_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    import opake_fx._noise_prefetch as module

    calls = []
    monkeypatch.setattr(module, "fold_in", lambda k, d: calls.append(d) or fold_in(k, d))
    off = NoisePrefetcher(enabled=False)
    off.draw(fold_in(key(2), 0), LEAVES, 0.7)
    off.prefetch_next(key(2), 1)
    assert calls == [] and not off.pending
    on = NoisePrefetcher(enabled=True)
    on.draw(fold_in(key(2), 0), LEAVES, 0.7)
    on.prefetch_next(key(2), 1)
    assert calls == [1] and on.pending
    on.discard()


# --- the noise stage ----------------------------------------------------------------------

from opake_fx.dpsgd.noise import gaussian_noise, noise  # noqa: E402
from opake_fx.types import ClippedPytree, PerGroup  # noqa: E402

BIG = [torch.randn(600, 500, generator=torch.Generator().manual_seed(0)), torch.ones(9)]  # above the auto threshold


def _run(prefetch, steps: int, state=None, max_norm=0.5, grads=BIG):
    noise_fn, s0 = gaussian_noise(noise_multiplier=1.3, key=key(11), prefetch=prefetch)
    state = s0 if state is None else state
    outs = []
    for _ in range(steps):
        out, state = noise_fn(ClippedPytree(grads, max_norm=max_norm), state)
        outs.append(list(out.pytree.values()) if isinstance(out.pytree, dict) else list(out.pytree))
    return outs, state


@pytest.mark.parametrize("prefetch", [True, None])
def test_noise_stage_drawing_ahead_is_bit_identical_to_drawing_in_place(prefetch) -> None:
    want, _ = _run(False, 4)
    got, _ = _run(prefetch, 4)
    assert all(_same(a, b) for a, b in zip(got, want))


def test_per_group_stddevs_drawn_ahead_are_bit_identical() -> None:
    grads = {"a": BIG[0], "b": BIG[1]}
    norms = PerGroup({"a": "w", "b": "bias"}, {"w": 0.5, "bias": 0.25})
    want, _ = _run(False, 3, max_norm=norms, grads=grads)
    got, _ = _run(True, 3, max_norm=norms, grads=grads)
    assert all(_same(a, b) for a, b in zip(got, want))


def test_a_resumed_run_continues_the_same_noise() -> None:
    whole, _ = _run(True, 5)
    first, state = _run(True, 2)
    rest, _ = _run(True, 3, state=state)  # a new stage from the saved state: its first step draws in place
    assert all(_same(a, b) for a, b in zip(first + rest, whole))


def test_replaying_a_state_gives_its_noise_again() -> None:
    noise_fn, s0 = gaussian_noise(noise_multiplier=1.0, key=key(4), prefetch=True)
    a, s1 = noise_fn(ClippedPytree(BIG, max_norm=1.0), s0)
    b, _ = noise_fn(ClippedPytree(BIG, max_norm=1.0), s0)  # step 1's draw is pending; step 0 is drawn again
    c, _ = noise_fn(ClippedPytree(BIG, max_norm=1.0), s1)
    assert _same(list(a.pytree), list(b.pytree))
    assert not torch.equal(a.pytree[0], c.pytree[0])


@pytest.mark.parametrize("flag", ["exact", "secure"])
def test_prefetch_is_refused_with_exact_or_secure_noise(flag) -> None:
    with pytest.raises(InputValueError, match="prefetch=True"):
        gaussian_noise(noise_multiplier=1.0, key=key(0), prefetch=True, **{flag: True})
    gaussian_noise(noise_multiplier=1.0, key=key(0), **{flag: True})  # auto: drawn in place


def test_the_chain_stage_takes_the_switch() -> None:
    stage = noise(noise_multiplier=1.3, key=key(11), prefetch=True)
    state = stage.init(None)
    want, _ = _run(False, 2)
    for w in want:
        out, state = stage.update(ClippedPytree(BIG, max_norm=0.5), state)
        assert _same(list(out.pytree), w)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().numpy().tobytes()).hexdigest()  # bit-exact, no reduction order


def _noise_in_child(queue, inherited_fn, inherited_state) -> None:
    torch.set_num_threads(1)  # no OpenMP team in a forked child; the prefetch thread is ours
    # the parent's stage, whose pending draw belongs to a thread the child does not have
    out, _ = inherited_fn(ClippedPytree(BIG, max_norm=0.5), inherited_state)
    queue.put(_digest(out.pytree[0]))
    noise_fn, state = gaussian_noise(noise_multiplier=1.3, key=key(11), prefetch=True)  # a new one
    for _ in range(2):
        out, state = noise_fn(ClippedPytree(BIG, max_norm=0.5), state)
    queue.put(_digest(out.pytree[0]))


def test_a_forked_child_draws_its_own_noise_and_does_not_hang() -> None:
    import multiprocessing

    noise_fn, state = gaussian_noise(noise_multiplier=1.3, key=key(11), prefetch=True)
    out, state = noise_fn(ClippedPytree(BIG, max_norm=0.5), state)  # the parent's thread and a pending draw exist
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_noise_in_child, args=(queue, noise_fn, state))
    child.start()
    child.join(timeout=60)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive and child.exitcode == 0
    want, _ = _run(False, 2)
    assert queue.get(timeout=5) == _digest(want[1][0])  # step 1 of the inherited stage
    assert queue.get(timeout=5) == _digest(want[1][0])  # step 1 of the child's own


def test_auto_stops_drawing_ahead_when_the_stddev_changes_every_step() -> None:
    large = [torch.zeros(PREFETCH_MIN_VALUES)]
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # leave a core for the background draw, where there is one
    try:
        if not prefetch_by_default(large):
            pytest.skip("auto never draws ahead on one core")
        auto = NoisePrefetcher(enabled=None)
        for step, std in enumerate([1.0, 0.9, 0.8, 0.7, 0.6]):  # an adaptive clip norm
            got, _ = auto.normals(key(0), step, large, std)
            assert _same(got, flat_tree_normal(fold_in(key(0), step), large, stddev=std)[0])
    finally:
        torch.set_num_threads(before)
    assert auto.hits == 0 and not auto.pending  # two unused draws, then none started
    forced = NoisePrefetcher(enabled=True)
    for step, std in enumerate([1.0, 0.9, 0.8]):
        forced.normals(key(0), step, large, std)
    assert forced.pending  # True keeps drawing ahead
