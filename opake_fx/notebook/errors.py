"""Errors of the notebook pool: a rank's exception, a rank that died, a pool that cannot run.

All derive from :class:`opake_fx.errors.OperationError` (a ``RuntimeError``).
"""

from __future__ import annotations

from opake_fx.errors import OperationError

__all__ = ["RankError", "RankDiedError", "PoolBrokenError", "PoolStartError"]


class RankError(OperationError):
    """Code run on a rank raised; carries the rank, the exception's type name and its traceback there.

    Attributes:
        rank: the (lowest) rank that raised.
        type_name: the name of the exception's class on that rank (e.g. ``"ValueError"``).
        remote_message: ``str()`` of the exception on that rank.
        remote_traceback: the formatted traceback on that rank (cell frames only).
        failed_ranks: every rank that raised in the same request.
    """

    def __init__(
        self,
        rank: int,
        type_name: str,
        remote_message: str,
        remote_traceback: str,
        failed_ranks: tuple[int, ...] = (),
    ) -> None:
        self.rank = rank
        self.type_name = type_name
        self.remote_message = remote_message
        self.remote_traceback = remote_traceback
        self.failed_ranks = failed_ranks or (rank,)
        others = [r for r in self.failed_ranks if r != rank]
        also = f" (ranks {', '.join(map(str, others))} raised too)" if others else ""
        super().__init__(
            f"rank {rank} raised {type_name}: {remote_message}{also}\n\n"
            f"Traceback on rank {rank}:\n{remote_traceback.rstrip()}"
        )

    def _render_traceback_(self) -> list[str]:
        """How IPython shows it: the rank's own traceback, not the kernel's."""
        others = [r for r in self.failed_ranks if r != self.rank]
        head = f"{self.type_name} raised on rank {self.rank}"
        if others:
            head += f" (ranks {', '.join(map(str, others))} raised too)"
        return [head, *self.remote_traceback.rstrip().splitlines()]


class RankDiedError(OperationError):
    """A rank's process ended outside of ``stop()`` (segfault, ``os._exit``, killed); the pool is broken.

    Attributes:
        rank: the first rank seen to end.
        exitcode: its exit code as torchrun reported it (negative: the signal), or None if unknown.
        log_tail: the last lines of torchrun's output.
    """

    def __init__(self, rank: int, exitcode: int | None, detail: str, log_tail: str) -> None:
        self.rank = rank
        self.exitcode = exitcode
        self.log_tail = log_tail
        super().__init__(detail + (f"\n\nLast lines of torchrun's output:\n{log_tail}" if log_tail else ""))


class PoolBrokenError(OperationError):
    """The pool cannot run cells any more (a rank died or did not answer an interrupt)."""


class PoolStartError(OperationError):
    """torchrun or a rank failed before every rank was ready."""
