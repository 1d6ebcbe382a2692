"""IPython magics over one :class:`~opake_fx.notebook.pool.DistPool` per kernel.

::

    %load_ext opake_fx.notebook
    %dist_start -n 2 [--backend gloo|nccl|auto] [--timeout SECONDS]
    %%dist [--rank R [R ...]]      run the cell on every rank (or on the given ranks)
    %dist_pull name [--rank R] [--as NEW_NAME]
    %dist_status
    %dist_stop

Cells run as plain Python on the ranks (no IPython syntax inside a ``%%dist`` cell). A
magic's line may end with a comment (``%dist_start -n 2  # two ranks``): IPython passes it
to the magic as arguments, and the magics drop it.

Privacy: infrastructure only; runs code, changes no guarantee.
"""

from __future__ import annotations

from typing import Any

from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from opake_fx.errors import OperationError
from opake_fx.notebook.pool import BACKENDS, DistPool

__all__ = ["DistMagics"]


@magics_class
class DistMagics(Magics):
    """The ``%dist_*`` magics; holds the kernel's pool (at most one at a time)."""

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.pool: DistPool | None = None

    def _pool(self) -> DistPool:
        if self.pool is None:
            raise OperationError("no pool is running; start one with `%dist_start -n 2`.")
        return self.pool

    @magic_arguments()
    @argument("-n", "--nproc", type=int, default=2, help="number of ranks (torchrun --nproc-per-node)")
    @argument("--backend", default="auto", choices=BACKENDS, help="process-group backend (auto: nccl with a GPU per rank, else gloo)")
    @argument("--timeout", type=float, default=None, help="collective timeout in seconds (default: torch's)")
    @argument("--start-timeout", type=float, default=300.0, help="seconds to wait for the ranks to be ready")
    @line_magic
    def dist_start(self, line: str) -> None:
        """Starts ``-n`` ranks under ``torchrun --standalone``; each initialises its process group."""
        args = parse_argstring(self.dist_start, _without_comment(line))
        if self.pool is not None and self.pool.state == "running":
            raise OperationError(
                f"a pool of {self.pool.nproc} ranks is already running; `%dist_stop` it first."
            )
        if self.pool is not None:
            self.pool.stop()
        self.pool = DistPool(
            args.nproc, backend=args.backend, collective_timeout=args.timeout, start_timeout=args.start_timeout
        )
        pids = ", ".join(f"rank {r}: pid {p}" for r, p in sorted(self.pool.pids.items()))
        print(f"Started {args.nproc} ranks under torchrun (pid {self.pool.torchrun_pid}), "
              f"backend {self.pool.backend}; {pids}")

    @magic_arguments()
    @argument("--rank", type=int, nargs="+", default=None, help="run on these ranks only")
    @cell_magic
    def dist(self, line: str, cell: str) -> None:
        """Runs the cell on every rank (or ``--rank R ...``) with live ``[rank r]`` output."""
        args = parse_argstring(self.dist, _without_comment(line))
        self._pool().run_cell(cell, ranks=args.rank)

    @magic_arguments()
    @argument("name", help="the variable on the rank")
    @argument("--rank", type=int, default=0, help="the rank to pull from (default 0)")
    @argument("--as", dest="as_name", default=None, help="bind it under this name in the kernel")
    @line_magic
    def dist_pull(self, line: str) -> Any:
        """Copies a picklable value from a rank (default 0) into the kernel's namespace."""
        args = parse_argstring(self.dist_pull, _without_comment(line))
        value = self._pool().pull(args.name, rank=args.rank)
        self.shell.user_ns[args.as_name or args.name] = value

    @line_magic
    def dist_status(self, line: str) -> None:
        """Shows the pool: state, backend, ranks and their pids."""
        print(self.pool.status() if self.pool is not None else "opake_fx pool: none started")

    @line_magic
    def dist_stop(self, line: str) -> None:
        """Stops the pool: every rank leaves its process group and exits."""
        if self.pool is None:
            print("opake_fx pool: none started")
            return
        self.pool.stop()
        print("Stopped the pool.")


def _without_comment(line: str) -> str:
    """``line`` up to the first ``#`` that starts a word outside quotes.

    IPython hands a line magic everything after its name, a trailing ``# comment``
    included, and ``parse_argstring`` would take the comment's words for arguments.
    """
    quote = None
    for i, ch in enumerate(line):
        if quote is not None:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line
