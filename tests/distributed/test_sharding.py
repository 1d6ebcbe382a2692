"""local_shard: disjoint, covering, deterministic, balanced; errors name the fix."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import Subset, TensorDataset

from opake_fx.distributed import local_shard, shard_bounds
from opake_fx.errors import InputTypeError, InputValueError


@given(n=st.integers(0, 5000), world_size=st.integers(1, 64))
def test_shards_partition_the_dataset(n, world_size):
    shards = [local_shard(range(n), rank=r, world_size=world_size) for r in range(world_size)]
    indices = [i for s in shards for i in s.indices]
    assert indices == list(range(n))  # disjoint, covering, in rank order
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1  # balanced: no example dropped or repeated to equalise
    again = [list(local_shard(range(n), rank=r, world_size=world_size).indices) for r in range(world_size)]
    assert again == [list(s.indices) for s in shards]  # deterministic


def test_subset_of_a_real_dataset():
    ds = TensorDataset(torch.arange(10.0), torch.arange(10))
    shard = local_shard(ds, rank=1, world_size=3)
    assert isinstance(shard, Subset) and shard.dataset is ds
    assert [int(shard[i][1]) for i in range(len(shard))] == [3, 4, 5]
    assert shard_bounds(10, 2, 3) == (6, 10)


def test_defaults_to_the_current_process():
    assert list(local_shard(list("abc")).indices) == [0, 1, 2]  # rank 0 of 1


@pytest.mark.parametrize("rank, world_size", [(-1, 2), (2, 2), (5, 3)])
def test_rank_outside_range(rank, world_size):
    with pytest.raises(InputValueError, match="0 <= rank < world_size"):
        local_shard(range(10), rank=rank, world_size=world_size)


def test_bad_arguments():
    with pytest.raises(InputValueError, match="world_size >= 1"):
        local_shard(range(10), rank=0, world_size=0)
    with pytest.raises(InputTypeError, match="int"):
        local_shard(range(10), rank=0.0, world_size=2)
    with pytest.raises(InputTypeError, match="int"):
        local_shard(range(10), rank=True, world_size=2)
    with pytest.raises(InputTypeError, match="__len__"):
        local_shard(iter(range(10)), rank=0, world_size=2)
