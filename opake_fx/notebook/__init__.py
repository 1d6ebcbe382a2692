"""Jupyter cells that run on real ``torchrun`` ranks (extra ``notebook``).

::

    %load_ext opake_fx.notebook
    %dist_start -n 2                # torchrun --standalone, 2 ranks, gloo (nccl with GPUs)

    %%dist
    import torch, torch.distributed as dist
    t = torch.ones(2) * (rank + 1)
    dist.all_reduce(t)
    print(t)                        # [rank 0] tensor([3., 3.])  /  [rank 1] tensor([3., 3.])

    %dist_pull t                    # rank 0's t, now in the kernel (for plots)
    %dist_stop

The kernel talks to its ranks over an authenticated loopback connection and never
initialises a process group (or CUDA) itself. Outside IPython, :class:`DistPool` is the
same pool as an object and :func:`launch` runs one function on a fresh pool.

* :mod:`opake_fx.notebook.pool`: :class:`DistPool`.
* :mod:`opake_fx.notebook.magics`: the ``%dist_*`` magics.
* :mod:`opake_fx.notebook.launch`: :func:`launch`.
* :mod:`opake_fx.notebook.errors`: :class:`RankError`, :class:`RankDiedError`,
  :class:`PoolBrokenError`, :class:`PoolStartError`.

Privacy: infrastructure only; runs code, changes no guarantee.
"""

from __future__ import annotations

from typing import Any

from opake_fx.notebook.errors import PoolBrokenError, PoolStartError, RankDiedError, RankError
from opake_fx.notebook.launch import launch
from opake_fx.notebook.pool import DistPool

__all__ = [
    "DistPool",
    "launch",
    "load_ipython_extension",
    "unload_ipython_extension",
    "RankError",
    "RankDiedError",
    "PoolBrokenError",
    "PoolStartError",
]


def load_ipython_extension(ipython: Any) -> None:
    """Registers the ``%dist_*`` magics (``%load_ext opake_fx.notebook``)."""
    from opake_fx.notebook.magics import DistMagics

    ipython.register_magics(DistMagics(ipython))


def unload_ipython_extension(ipython: Any) -> None:
    """Stops the pool, if one runs (``%unload_ext opake_fx.notebook``)."""
    from opake_fx.notebook.magics import DistMagics

    magics = ipython.magics_manager.registry.get(DistMagics.__name__)
    if magics is not None and magics.pool is not None:
        magics.pool.stop()
