"""A persistent pool of torchrun ranks driven from the calling process (a Jupyter kernel).

:class:`DistPool` starts ``torchrun --standalone --nproc-per-node=N`` with
:mod:`opake_fx.notebook._worker` as its program. Each rank connects back to a
:class:`multiprocessing.connection.Listener` bound to ``127.0.0.1`` with a fresh random
32-byte secret (the connection is refused without it), then initialises its own process
group. The calling process never initialises a process group and never touches CUDA.

Code sent with :meth:`DistPool.run_cell` runs on the ranks in one persistent namespace per
rank; what the ranks print arrives live, each line prefixed ``[rank r]``. A rank's exception
is raised here as :class:`~opake_fx.notebook.errors.RankError`; a rank that dies is reported
as :class:`~opake_fx.notebook.errors.RankDiedError` within seconds (torchrun then ends the
others, and the pool is cleaned up and marked broken); ``KeyboardInterrupt`` while waiting
interrupts the ranks. Every pool still running when the process exits is stopped
(``atexit``), and ranks whose kernel disappears exit by themselves within a second.

Privacy: infrastructure only; runs code, changes no guarantee.
"""

from __future__ import annotations

import atexit
import os
import pickle
import queue
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from multiprocessing.connection import Connection, Listener
from multiprocessing.connection import wait as wait_for_connections
from typing import Any, Callable

from opake_fx.errors import InputValueError, OperationError
from opake_fx.notebook import _wire
from opake_fx.notebook.errors import PoolBrokenError, PoolStartError, RankDiedError, RankError

__all__ = ["DistPool", "Echo", "BACKENDS"]

#: The backends a pool may ask for; ``"auto"``: nccl if there is a GPU for every rank, else gloo.
BACKENDS = ("auto", "gloo", "nccl")

#: ``echo(rank, stream, line)``: where the ranks' output goes (``stream`` is "stdout"/"stderr").
Echo = Callable[[int, str, str], None]

_LIVE: "weakref.WeakSet[DistPool]" = weakref.WeakSet()
_LINE = re.compile(r"[^\r\n]*(?:\r\n|\n|\r)")
_EXIT_TABLE = re.compile(r"exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)")
_EXIT_LINE = re.compile(r"\(exitcode:\s*(-?\d+)\)\s*local_rank:\s*\d+\s*\(pid:\s*(\d+)\)")


def _print_line(rank: int, stream: str, line: str) -> None:
    out = sys.stderr if stream == "stderr" else sys.stdout
    out.write(f"[rank {rank}] {line}")
    out.flush()


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "an unknown exit code"
    if code < 0:
        try:
            return f"exit code {code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"exit code {code}"
    return f"exit code {code}"


def _is_our_worker(pid: int) -> bool:
    """True if ``pid`` is alive and runs this package's worker (guards against pid reuse)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return False
    return state != b"Z" and _wire.WORKER_MODULE.encode() in cmdline


class DistPool:
    """``nproc`` torchrun ranks that run this process's code on request, keeping their state.

    Args:
        nproc: number of ranks (``torchrun --nproc-per-node``), >= 1.
        backend: ``"gloo"``, ``"nccl"`` or ``"auto"`` (nccl if there is a GPU for every rank,
            else gloo). With nccl, rank ``r`` uses ``cuda:r``.
        start_timeout: seconds to wait for every rank to be ready.
        collective_timeout: process-group timeout in seconds (None: torch's default).
        echo: receives each line the ranks print, ``echo(rank, stream, line)``; by default
            written to this process's ``sys.stdout``/``sys.stderr`` as ``[rank r] line``.
        interrupt_grace: seconds the ranks get to stop after ``KeyboardInterrupt`` before
            the pool is declared broken (a rank blocked inside a collective cannot be
            interrupted).

    Each rank's namespace starts with ``rank``, ``world_size``, ``local_rank`` and
    ``device``. The pool owns the default process group: a cell's
    ``dist.init_process_group(...)`` is accepted (same backend) and its
    ``dist.destroy_process_group()`` is deferred to :meth:`stop`, so scripts written for
    torchrun run unchanged. Ranks see this process's ``sys.path`` and working directory.

    Privacy: infrastructure only; runs code, changes no guarantee.

    Example:
        >>> from opake_fx.notebook import DistPool
        >>> with DistPool(2) as pool:  # doctest: +SKIP
        ...     pool.run_cell("import torch.distributed as dist; t = torch.ones(1) * (rank + 1)")
        ...     pool.run_cell("import torch; dist.all_reduce(t); print(t.item())")
        [rank 0] 3.0
        [rank 1] 3.0
    """

    def __init__(
        self,
        nproc: int = 2,
        *,
        backend: str = "auto",
        start_timeout: float = 300.0,
        collective_timeout: float | None = None,
        echo: Echo | None = None,
        interrupt_grace: float = 5.0,
    ) -> None:
        if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
            raise InputValueError(f"DistPool needs nproc >= 1 ranks (an int); got {nproc!r}.")
        if backend not in BACKENDS:
            raise InputValueError(f"DistPool backend must be one of {BACKENDS}; got {backend!r}.")
        if collective_timeout is not None and not collective_timeout > 0:
            raise InputValueError(f"collective_timeout must be > 0 seconds or None; got {collective_timeout!r}.")
        self.nproc = nproc
        self.requested_backend = backend
        self.backend: str | None = None
        self.devices: dict[int, str] = {}
        self.pids: dict[int, int] = {}
        self._echo = echo or _print_line
        self._grace = float(interrupt_grace)
        self._state = "starting"
        self._reason = ""
        self._closing = False
        self._job = 0
        self._conns: dict[int, Connection] = {}
        self._events: "queue.Queue[tuple[str, int, Any]]" = queue.Queue()
        self._partial: dict[tuple[int, str], str] = {}
        self._reader: threading.Thread | None = None
        self._accepter: threading.Thread | None = None
        self._tmp = tempfile.mkdtemp(prefix="opake_fx_pool_")
        self._log_path = os.path.join(self._tmp, "torchrun.log")
        self._log = open(self._log_path, "wb")
        self._secret = secrets.token_bytes(32)
        self._listener = Listener(("127.0.0.1", 0), family="AF_INET", authkey=self._secret)
        self.address: tuple[str, int] = self._listener.address  # where the kernel listens until all ranks joined
        self._proc: subprocess.Popen | None = None
        _LIVE.add(self)
        try:
            self._start(start_timeout, collective_timeout)
        except BaseException:
            self._shutdown(timeout=2.0)
            self._state = "stopped"
            raise

    # ------------------------------------------------------------------ lifecycle
    def _worker_env(self, collective_timeout: float | None) -> dict[str, str]:
        host, port = self.address
        env = dict(os.environ)
        env[_wire.ENV_ADDRESS] = f"{host}:{port}"
        env[_wire.ENV_AUTHKEY] = self._secret.hex()
        env[_wire.ENV_KERNEL_PID] = str(os.getpid())
        env[_wire.ENV_BACKEND] = self.requested_backend
        env[_wire.ENV_PG_TIMEOUT] = str(collective_timeout or 0)
        env["PYTHONUNBUFFERED"] = "1"
        paths = [os.path.abspath(p) for p in sys.path if p and os.path.isdir(p)]
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(paths)
        interfaces = {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
        if "lo" in interfaces:  # keep the ranks' own traffic on loopback too (single node)
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
            env.setdefault("NCCL_SOCKET_IFNAME", "lo")
        return env

    def _start(self, start_timeout: float, collective_timeout: float | None) -> None:
        cmd = [
            sys.executable, "-m", "torch.distributed.run",  # the torchrun entry point
            "--standalone", f"--nproc-per-node={self.nproc}",
            "--max-restarts=0", "--monitor-interval=0.1",
            "-m", _wire.WORKER_MODULE,
        ]
        self._proc = subprocess.Popen(
            cmd, env=self._worker_env(collective_timeout), stdin=subprocess.DEVNULL,
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, cwd=os.getcwd(),
        )
        hellos: "queue.Queue[tuple[Connection, tuple]]" = queue.Queue()
        self._accepter = threading.Thread(target=self._accept_loop, args=(hellos,), daemon=True)
        self._accepter.start()
        deadline = time.monotonic() + start_timeout
        while len(self._conns) < self.nproc:
            self._check_start(deadline, "connect")
            try:
                conn, hello = hellos.get(timeout=0.1)
            except queue.Empty:
                continue
            _, rank, world_size, _local_rank, pid = hello
            if world_size != self.nproc or rank in self._conns:
                conn.close()
                raise PoolStartError(f"unexpected rank {rank} of {world_size} (expected {self.nproc} ranks).")
            self._conns[rank] = conn
            self.pids[rank] = pid
        self._listener.close()  # every rank is connected: nothing listens any more
        self._reader = threading.Thread(target=self._read_loop, daemon=True)
        self._reader.start()
        while len(self.devices) < self.nproc:
            self._check_start(deadline, "initialise its process group")
            try:
                kind, rank, message = self._events.get(timeout=0.1)
            except queue.Empty:
                continue
            if kind == "eof":
                continue  # the torchrun exit check above reports it with the log
            if message[0] == "ready":
                self.backend, self.devices[rank] = message[1], message[2]
            elif message[0] == "error":
                raise PoolStartError(
                    f"rank {rank} could not initialise its process group: {message[2]}: {message[3]}\n"
                    f"{message[4]}"
                )
            elif message[0] == "out":
                self._emit(rank, message[2], message[3])
        self._state = "running"

    def _check_start(self, deadline: float, what: str) -> None:
        assert self._proc is not None
        if self._proc.poll() is not None:
            raise PoolStartError(
                f"torchrun exited with code {self._proc.returncode} before every rank could {what}.\n"
                f"{self._log_tail()}"
            )
        if time.monotonic() > deadline:
            raise PoolStartError(
                f"not every rank could {what} within the start timeout; ranks connected: "
                f"{sorted(self._conns)}.\n{self._log_tail()}"
            )

    def _accept_loop(self, hellos: "queue.Queue[tuple[Connection, tuple]]") -> None:
        accepted = 0
        while accepted < self.nproc and not self._closing:
            try:
                conn = self._listener.accept()  # refuses (raises) without the secret
            except Exception:  # noqa: BLE001 - a failed handshake; keep listening
                if self._closing:
                    return
                continue
            try:
                if not conn.poll(60):
                    raise EOFError
                hello = _wire.decode(conn.recv_bytes())
                if hello[0] != "hello":
                    raise EOFError
            except Exception:  # noqa: BLE001
                conn.close()
                continue
            accepted += 1
            hellos.put((conn, hello))

    def _read_loop(self) -> None:
        rank_of = {id(c): r for r, c in self._conns.items()}
        live = dict(self._conns)
        while live and not self._closing:
            try:
                ready = wait_for_connections(list(live.values()), timeout=0.25)
            except OSError:
                return
            for conn in ready:
                rank = rank_of[id(conn)]
                try:
                    message = _wire.decode(conn.recv_bytes())
                except (EOFError, OSError):
                    live.pop(rank, None)
                    self._events.put(("eof", rank, None))
                    continue
                self._events.put(("msg", rank, message))

    def stop(self, timeout: float = 15.0) -> None:
        """Ends the ranks (each leaves its process group) and torchrun; kills what does not end.

        Safe to call twice, and on a broken pool.
        """
        if self._state == "stopped":
            return
        self._shutdown(timeout=timeout)
        self._state = "stopped"

    def _shutdown(self, timeout: float) -> None:
        if self._closing:
            return
        self._closing = True
        for conn in self._conns.values():
            try:
                conn.send_bytes(_wire.encode(("stop",)))
            except OSError:
                pass
        proc = self._proc
        if proc is not None:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(proc, signal.SIGTERM)
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self._signal_group(proc, signal.SIGKILL)
                    proc.wait(timeout=5)
        for pid in self.pids.values():  # ranks run in sessions of their own (torchrun's choice)
            if _is_our_worker(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        for conn in self._conns.values():
            conn.close()
        if self._accepter is not None and self._accepter.is_alive():
            try:  # wake the accept() call; the handshake fails and the thread sees _closing
                socket.create_connection(self.address, timeout=1).close()
            except OSError:
                pass
            self._accepter.join(timeout=2)
        self._listener.close()
        if self._reader is not None:
            self._reader.join(timeout=2)
        self._log.close()
        shutil.rmtree(self._tmp, ignore_errors=True)
        _LIVE.discard(self)

    @staticmethod
    def _signal_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
        try:
            os.killpg(proc.pid, sig)
        except OSError:
            pass

    def __enter__(self) -> "DistPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> str:
        """``"running"``, ``"broken"`` (see :attr:`reason`) or ``"stopped"``."""
        return self._state

    @property
    def reason(self) -> str:
        """Why the pool is broken ("" when it is not)."""
        return self._reason

    @property
    def torchrun_pid(self) -> int | None:
        """The pid of the torchrun process (None before it started)."""
        return self._proc.pid if self._proc is not None else None

    def status(self) -> str:
        """A few lines: state, backend, ranks with their pids and devices, torchrun's pid."""
        lines = [f"opake_fx pool: {self._state}" + (f" ({self._reason})" if self._reason else "")]
        if self._state != "stopped":
            lines.append(f"  torchrun pid {self.torchrun_pid}, backend {self.backend}, {self.nproc} ranks")
            for rank in sorted(self.pids):
                alive = "alive" if _is_our_worker(self.pids[rank]) else "gone"
                lines.append(f"  rank {rank}: pid {self.pids[rank]} on {self.devices.get(rank, '?')} ({alive})")
        return "\n".join(lines)

    def _ensure_running(self) -> None:
        if self._state == "broken":
            raise PoolBrokenError(f"the pool is broken: {self._reason}. Start a new one (%dist_start).")
        if self._state != "running":
            raise OperationError(f"the pool is {self._state}; start one with %dist_start (or DistPool(...)).")

    def _log_tail(self, lines: int = 25) -> str:
        try:
            self._log.flush()
            with open(self._log_path, "rb") as f:
                text = f.read().decode("utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.rstrip().splitlines()[-lines:])

    # ------------------------------------------------------------------ requests
    def run_cell(self, code: str, ranks: list[int] | None = None) -> None:
        """Runs ``code`` on ``ranks`` (default: all) in their persistent namespaces.

        Output arrives live through ``echo``. A trailing expression's ``repr`` is printed,
        as in a notebook cell.

        Raises:
            RankError: the code raised on a rank (the lowest such rank is named).
            RankDiedError: a rank's process ended; the pool is broken and cleaned up.
            KeyboardInterrupt: interrupted (the ranks were interrupted too).
        """
        self._ensure_running()
        targets = self._targets(ranks)
        job = self._next_job()
        filename = f"<dist-cell-{job}>"
        self._collect(job, targets, ("exec", job, code, filename))

    def pull(self, name: str, rank: int = 0) -> Any:
        """The value bound to ``name`` on ``rank`` (pickled there; tensors arrive on the CPU)."""
        self._ensure_running()
        (target,) = self._targets([rank])
        job = self._next_job()
        replies = self._collect(job, [target], ("pull", job, name))
        return self._load(replies[target][2], f"the value of {name!r} on rank {rank}")

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[int, Any]:
        """Calls ``fn(*args, **kwargs)`` on every rank; returns ``{rank: result}``."""
        self._ensure_running()
        try:
            payload = _wire.dump_call(fn, args, kwargs)
        except Exception as exc:
            raise InputValueError(
                f"cannot send {fn!r} and its arguments to the ranks: {exc}. Use a module-level "
                "function with picklable arguments."
            ) from exc
        job = self._next_job()
        targets = list(range(self.nproc))
        replies = self._collect(job, targets, ("call", job, payload))
        return {r: self._load(replies[r][2], f"rank {r}'s result") for r in targets}

    @staticmethod
    def _load(payload: bytes, what: str) -> Any:
        try:
            return pickle.loads(payload)
        except Exception as exc:
            raise OperationError(
                f"{what} arrived but cannot be unpickled here ({type(exc).__name__}: {exc}); classes "
                "defined inside %%dist cells exist only on the ranks: pull plain values (tensors, numbers, "
                "lists, dicts)."
            ) from exc

    def _targets(self, ranks: list[int] | None) -> list[int]:
        if ranks is None:
            return list(range(self.nproc))
        bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self.nproc]
        if bad or not ranks:
            raise InputValueError(f"ranks must be in 0..{self.nproc - 1}; got {ranks!r}.")
        return sorted(set(ranks))

    def _next_job(self) -> int:
        self._job += 1
        return self._job

    def _collect(self, job: int, targets: list[int], request: tuple) -> dict[int, tuple]:
        data = _wire.encode(request)
        for rank in targets:
            try:
                self._conns[rank].send_bytes(data)
            except OSError:
                self._on_death(rank)
        pending, replies = set(targets), {}
        interrupted_at: float | None = None
        first_error_at: float | None = None
        waiting_notice = False
        try:
            while pending:
                try:
                    try:
                        kind, rank, message = self._events.get(timeout=0.1)
                    except queue.Empty:
                        kind = "idle"
                    if kind == "eof":
                        self._on_death(rank)
                    elif kind == "msg":
                        tag = message[0]
                        if tag == "out":
                            self._emit(rank, message[2], message[3])
                        elif tag in ("done", "error") and message[1] == job:
                            replies[rank] = message
                            pending.discard(rank)
                            if tag == "error" and first_error_at is None:
                                first_error_at = time.monotonic()
                    if self._proc is not None and self._proc.poll() is not None:
                        self._on_death(None)
                    now = time.monotonic()
                    if interrupted_at is not None and now - interrupted_at > self._grace:
                        self._break(
                            f"ranks {sorted(pending)} did not stop within {self._grace:g} s of an interrupt "
                            "(a rank blocked in a collective cannot be interrupted)"
                        )
                        raise PoolBrokenError(
                            f"interrupted, but ranks {sorted(pending)} did not stop within {self._grace:g} s "
                            "(probably waiting in a collective for a rank that was interrupted first); the "
                            "pool was stopped. Start a new one with %dist_start."
                        ) from KeyboardInterrupt()
                    if first_error_at is not None and not waiting_notice and now - first_error_at > 5.0:
                        waiting_notice = True
                        failed = sorted(r for r, m in replies.items() if m[0] == "error")
                        sys.stderr.write(
                            f"[opake_fx] rank(s) {failed} raised; still waiting for ranks {sorted(pending)}. "
                            "If they wait in a collective for the failed rank, interrupt the kernel.\n"
                        )
                except KeyboardInterrupt:
                    if interrupted_at is not None:
                        self._break("interrupted twice while waiting for the ranks")
                        raise
                    interrupted_at = time.monotonic()
                    for rank in pending:
                        try:
                            os.kill(self.pids[rank], signal.SIGINT)
                        except OSError:
                            pass
        finally:
            self._flush_partial()
        if interrupted_at is not None:
            raise KeyboardInterrupt(f"interrupted ranks {targets}")
        errors = sorted(r for r, m in replies.items() if m[0] == "error")
        if errors:
            _, _, type_name, text, tb = replies[errors[0]]
            raise RankError(errors[0], type_name, text, tb, tuple(errors))
        return replies

    def _emit(self, rank: int, stream: str, text: str) -> None:
        key = (rank, stream)
        text = self._partial.pop(key, "") + text
        end = 0
        for match in _LINE.finditer(text):
            self._echo(rank, stream, match.group(0))
            end = match.end()
        if end < len(text):
            self._partial[key] = text[end:]

    def _flush_partial(self) -> None:
        for (rank, stream), text in sorted(self._partial.items()):
            self._echo(rank, stream, text + "\n")
        self._partial.clear()

    def _break(self, reason: str) -> None:
        self._reason = reason
        self._shutdown(timeout=2.0)
        self._state = "broken"

    def _on_death(self, rank: int | None) -> None:
        """A rank (or torchrun) ended: find its exit code in torchrun's report, clean up, raise."""
        proc = self._proc
        assert proc is not None
        self._flush_partial()
        try:
            proc.wait(timeout=5.0)  # torchrun notices within 0.1 s, ends the others, reports
        except subprocess.TimeoutExpired:
            pass
        log = self._log_tail(lines=400)
        codes = {int(pid): int(code) for code, pid in _EXIT_TABLE.findall(log) + _EXIT_LINE.findall(log)}
        by_rank = {r: codes.get(pid) for r, pid in self.pids.items()}
        if rank is None:  # torchrun exited before we saw a rank's connection drop
            failed = [r for r, c in sorted(by_rank.items()) if c not in (None, 0)]
            rank = failed[0] if failed else 0
        code = by_rank.get(rank)
        detail = f"rank {rank} (pid {self.pids.get(rank)}) died with {_describe_exit(code)}"
        others = [f"rank {r}: {_describe_exit(c)}" for r, c in sorted(by_rank.items()) if r != rank and c is not None]
        if others:
            detail += "; torchrun then ended the others (" + ", ".join(others) + ")"
        tail = self._log_tail(lines=20)
        self._break(detail)
        raise RankDiedError(rank, code, f"{detail}. The pool is stopped; start a new one with %dist_start.", tail)


def _stop_all() -> None:
    for pool in list(_LIVE):
        try:
            pool.stop(timeout=5.0)
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass


atexit.register(_stop_all)
