"""Distributed (DDP-style) differentially private training.

Each rank clips the gradients of its own shard, the clipped sums are all-reduced, and
every rank adds the SAME noise (same key) to the sum, so all ranks hold identical
parameters and the run is one DP-SGD mechanism over the union of the ranks' batches::

    grads, clip_state = grad_fn(params, x, y, state=clip_state)   # 1. clip (local data)
    sum_gradients_(grads)                                          # 2. aggregate
    noisy, noise_state = noise_fn(grads, noise_state)              # 3. noise (same key)

or, as a chain: ``clip -> psum() -> noise -> optimizer``.

* Core: :func:`is_distributed`, :func:`get_rank`, :func:`get_world_size`,
  :func:`is_main_process`, :func:`barrier`.
* Collectives: :func:`all_reduce`, :func:`all_reduce_`, :func:`gather_for_metrics`.
* Gradient aggregation: :func:`sum_gradients`, :func:`sum_gradients_`,
  :func:`reduce_pytree`, :func:`reduce_pytree_`, the chain stage :func:`psum`.
* State sync: :func:`sync`, :func:`register_sync_type`, :func:`registered_sync_types`,
  :func:`sync_fields`.
* Sharding: :func:`local_shard`, :func:`shard_bounds`.

Everything runs unchanged in a single process (``sync`` and ``psum`` are the identity
there). Works with gloo on CPU and nccl on CUDA. See ``docs/distributed.md``.
"""

from opake_fx.distributed import collectives
from opake_fx.distributed.state_sync import register_sync_type, registered_sync_types, sync, sync_fields
from opake_fx.distributed.collectives import (
    REDUCE_OPS,
    all_reduce,
    all_reduce_,
    barrier,
    get_rank,
    get_world_size,
    is_distributed,
    is_main_process,
)
from opake_fx.distributed.gradients import reduce_pytree, reduce_pytree_, sum_gradients, sum_gradients_
from opake_fx.distributed.metrics import gather_for_metrics
from opake_fx.distributed.sharding import local_shard, shard_bounds
from opake_fx.distributed.stage import psum

# The core (ranks, barrier, all-reduce) is collectives' public API, listed once there.
__all__ = collectives.__all__ + [
    "sum_gradients",
    "sum_gradients_",
    "reduce_pytree",
    "reduce_pytree_",
    "psum",
    "sync",
    "register_sync_type",
    "registered_sync_types",
    "sync_fields",
    "local_shard",
    "shard_bounds",
    "gather_for_metrics",
]
