"""Run one function on a fresh torchrun pool and return rank 0's result.

Privacy: infrastructure only; runs code, changes no guarantee.
"""

from __future__ import annotations

from typing import Any, Callable

from opake_fx.errors import InputValueError
from opake_fx.notebook.pool import DistPool

__all__ = ["launch"]


def launch(
    fn: Callable[..., Any],
    nproc: int = 2,
    *args: Any,
    backend: str = "auto",
    start_timeout: float = 300.0,
    **kwargs: Any,
) -> Any:
    """Calls ``fn(*args, **kwargs)`` on every rank of a new ``torchrun`` pool; returns rank 0's result.

    ``launch(fn, nproc, *args)``: the number of ranks comes before ``fn``'s arguments
    (``launch(train, 2, config)`` runs ``train(config)`` on 2 ranks).

    The ranks' process group is initialised before ``fn`` runs (use ``torch.distributed``
    inside it as under torchrun); the pool is stopped afterwards, also on error. ``fn``
    must be picklable: a module-level function the ranks can import (they see this
    process's ``sys.path``), or a function defined in ``__main__`` (a notebook or a script),
    which is sent by value. Results must be picklable; tensors arrive on the CPU.

    Args:
        fn: the function.
        *args: its positional arguments.
        nproc: number of ranks.
        backend: ``"gloo"``, ``"nccl"`` or ``"auto"``.
        start_timeout: seconds to wait for the ranks to start.
        **kwargs: its keyword arguments.

    Raises:
        InputValueError: ``nproc`` is not an int >= 1 (e.g. ``fn``'s first argument was
            passed where ``nproc`` goes).
        RankError: ``fn`` raised on a rank (named, with its traceback there).
        RankDiedError: a rank's process died.

    Example:
        >>> from opake_fx.notebook import launch
        >>> def total(x):
        ...     import torch, torch.distributed as dist
        ...     t = torch.tensor([x * (dist.get_rank() + 1)])
        ...     dist.all_reduce(t)
        ...     return t.item()
        >>> launch(total, 2, 10)  # doctest: +SKIP
        30
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise InputValueError(
            f"launch(fn, nproc, *args): nproc must be an int >= 1, the number of ranks; got {nproc!r}. "
            "fn's own arguments come after it: launch(fn, 2, *args)."
        )
    with DistPool(nproc, backend=backend, start_timeout=start_timeout, echo=None) as pool:
        return pool.call(fn, *args, **kwargs)[0]
