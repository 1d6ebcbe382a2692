"""Keyed bulk normals in a forked child: the parallel chunk pool of the parent is not
inherited (its threads do not exist in the child), so the child's large draws finish and
give the same numbers as the parent's."""

from __future__ import annotations

import hashlib
import multiprocessing

import torch

from opake_fx.random import flat_tree_normal, key

LIKE = [torch.empty(5 << 20)]  # 5 chunks of 2**20 values: drawn on the thread pool


def _digest(z: torch.Tensor) -> str:
    return hashlib.sha256(z.numpy().tobytes()).hexdigest()  # bit-exact, no reduction order


def _draw_in_child(queue) -> None:
    torch.set_num_threads(2)  # the chunks go to the thread pool
    (z,), _ = flat_tree_normal(key(1), LIKE)
    queue.put(_digest(z))


def test_a_forked_child_draws_large_noise_without_hanging() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the pool is used from 2 threads on
    try:
        flat_tree_normal(key(0), LIKE)  # the parent's pool exists
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_draw_in_child, args=(queue,))
        child.start()
        child.join(timeout=60)
        alive = child.is_alive()
        if alive:
            child.kill()
        assert not alive and child.exitcode == 0
        (want,), _ = flat_tree_normal(key(1), LIKE)
        assert queue.get(timeout=5) == _digest(want)
    finally:
        torch.set_num_threads(threads)
