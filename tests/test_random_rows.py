"""flat_tree_normal_rows: a shard's rows of the unsharded flat draw, bit for bit (the sharded noise of issue 32)."""

from __future__ import annotations

import pytest
import torch

from opake_fx.errors import InputValueError
from opake_fx.random import flat_tree_normal, flat_tree_normal_rows, key


def _rows(full: list[torch.Tensor], world: int, rank: int) -> list[tuple[int, int]]:
    """FSDP2's dim-0 sharding: chunks of ceil(n / world) rows (the last ranks may get fewer or none)."""
    out = []
    for t in full:
        c = -(-t.shape[0] // world)
        out.append((min(rank * c, t.shape[0]), min((rank + 1) * c, t.shape[0])))
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_shards_of_every_rank_are_the_unsharded_draw_across_chunks_dtypes_and_empty_shards(world):
    full = [torch.zeros(700, 1500), torch.zeros(3), torch.zeros(5, 2, dtype=torch.float64), torch.zeros(1, 7),
            torch.zeros(2100, 999)]  # 1.05M + 2.1M float32 values: the CPU draw is cut into 2**20-value chunks
    want, _ = flat_tree_normal(key(5), full, stddev=0.5)
    seen = [torch.zeros(t.shape[0], dtype=torch.bool) for t in full]
    for rank in range(world):
        rows = _rows(full, world, rank)
        shards = [t[a:b] for t, (a, b) in zip(full, rows)]
        got, buffers = flat_tree_normal_rows(key(5), shards, [t.shape for t in full], rows, stddev=0.5)
        for i, ((a, b), g) in enumerate(zip(rows, got)):
            assert g.shape == shards[i].shape and g.dtype == full[i].dtype
            assert torch.equal(g, want[i][a:b]), (rank, i)
            seen[i][a:b] = True
        ptrs = [b.data_ptr() for b in buffers if b.numel()]
        assert len(set(ptrs)) == len(ptrs)  # each draw its own memory (noise is added in place)
    assert all(s.all() for s in seen)  # the ranks' rows cover every row once


def test_a_shard_that_is_not_its_rows_of_the_leaf_is_refused():
    with pytest.raises(InputValueError, match="not rows"):
        flat_tree_normal_rows(key(0), [torch.zeros(2, 3)], [(4, 2)], [(0, 2)])
    with pytest.raises(InputValueError, match="not rows"):
        flat_tree_normal_rows(key(0), [torch.zeros(3, 2)], [(4, 2)], [(2, 5)])
    with pytest.raises(InputValueError, match="one of each per leaf"):
        flat_tree_normal_rows(key(0), [torch.zeros(1)], [(4,), (2,)], [(0, 1)])
