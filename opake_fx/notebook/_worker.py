"""One rank of a notebook's pool: started by ``torchrun``, driven by the kernel.

Run as ``torchrun --standalone --nproc-per-node=N -m opake_fx.notebook._worker`` by
:class:`opake_fx.notebook.DistPool` (never by hand). The rank connects to the kernel's
loopback listener with the session secret, initialises its process group, and then runs
what the kernel sends in one persistent namespace (a fresh ``__main__`` module), with its
``sys.stdout``/``sys.stderr`` streamed back to the kernel.

The pool owns the default process group: a cell's ``dist.init_process_group`` (as in a
script written for torchrun) is accepted when the group exists with the same backend, and
a cell's ``dist.destroy_process_group()`` is deferred to the pool's stop.
"""

from __future__ import annotations

import ast
import datetime
import faulthandler
import io
import linecache
import os
import signal
import sys
import threading
import time
import traceback
import types
from multiprocessing.connection import Client, Connection
from typing import Any

from opake_fx.notebook import _wire


class _Signals:
    """When SIGINT may raise: only inside cell code, never in the middle of a send."""

    def __init__(self) -> None:
        self.in_cell = False
        self.sending = 0
        self.pending = False

    def handler(self, signum: int, frame: Any) -> None:
        if not self.in_cell:
            return  # idle, or replying: an interrupt here has nothing to interrupt
        if self.sending:
            self.pending = True
            return
        raise KeyboardInterrupt

    def after_send(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread runs the cell; the interrupt is raised there
        if self.pending and self.in_cell and not self.sending:
            self.pending = False
            raise KeyboardInterrupt


class _Link:
    """The connection to the kernel; sends are serialised (cells may print from threads)."""

    def __init__(self, conn: Connection, signals: _Signals) -> None:
        self.conn = conn
        self.signals = signals
        self.lock = threading.Lock()

    def send(self, message: tuple) -> None:
        data = _wire.encode(message)
        self.signals.sending += 1
        try:
            with self.lock:
                self.conn.send_bytes(data)
        finally:
            self.signals.sending -= 1


class _RankStream(io.TextIOBase):
    """A text stream whose complete lines are sent to the kernel as they are written."""

    def __init__(self, link: _Link, name: str) -> None:
        self.link = link
        self.name = name
        self.job = 0
        self._buf = ""
        self._lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        with self._lock:
            self._buf += text
            cut = max(self._buf.rfind("\n"), self._buf.rfind("\r"))
            if cut < 0 and len(self._buf) < 8192:
                return len(text)
            if cut < 0:
                cut = len(self._buf) - 1
            out, self._buf = self._buf[: cut + 1], self._buf[cut + 1 :]
        self.link.send(("out", self.job, self.name, out))
        self.link.signals.after_send()
        return len(text)

    def flush(self) -> None:
        with self._lock:
            out, self._buf = self._buf, ""
        if out:
            self.link.send(("out", self.job, self.name, out))


def _watch_kernel(kernel_pid: int) -> None:
    """Exits this rank when the kernel is gone, even in the middle of a long cell."""
    while True:
        time.sleep(1.0)
        try:
            os.kill(kernel_pid, 0)
        except ProcessLookupError:
            os._exit(70)
        except PermissionError:  # pragma: no cover - pid reused by another user's process
            os._exit(70)


def _user_traceback(exc: BaseException) -> str:
    """The traceback of ``exc`` without this module's frames."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


class _Worker:
    def __init__(self, link: _Link, namespace: dict, signals: _Signals) -> None:
        self.link = link
        self.ns = namespace
        self.signals = signals
        self.cells = 0

    def run_cell(self, code: str, filename: str) -> None:
        linecache.cache[filename] = (len(code), None, code.splitlines(keepends=True), filename)
        tree = ast.parse(code, filename=filename, mode="exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        body = compile(tree, filename, "exec")
        self.signals.in_cell = True
        try:
            exec(body, self.ns)
            if last is not None:
                value = eval(compile(last, filename, "eval"), self.ns)
                if value is not None:
                    print(repr(value))
        finally:
            self.signals.in_cell = False

    def call(self, payload: bytes) -> Any:
        import pickle

        fn, args, kwargs = pickle.loads(payload)
        self.signals.in_cell = True
        try:
            return fn(*args, **kwargs)
        finally:
            self.signals.in_cell = False

    def serve(self, streams: tuple[_RankStream, _RankStream]) -> None:
        while True:
            try:
                message = _wire.decode(self.link.conn.recv_bytes())
            except (EOFError, OSError):
                return  # the kernel went away
            kind = message[0]
            if kind == "stop":
                return
            job = message[1]
            for s in streams:
                s.job = job
            try:
                if kind == "exec":
                    self.run_cell(message[2], message[3])
                    result = None
                elif kind == "pull":
                    name = message[2]
                    if name not in self.ns:
                        raise NameError(f"name {name!r} is not defined on this rank")
                    result = _wire.dump_value(self.ns[name])
                elif kind == "call":
                    result = _wire.dump_value(self.call(message[2]))
                else:
                    raise ValueError(f"unknown request {kind!r}")
            except BaseException as exc:  # noqa: BLE001 - every failure is reported to the kernel
                self.signals.in_cell = False
                self.signals.pending = False
                for s in streams:
                    s.flush()
                # SystemExit too: as in IPython, sys.exit() in a cell ends the cell, not the rank
                self.link.send(("error", job, type(exc).__name__, str(exc), _user_traceback(exc)))
                continue
            self.signals.pending = False
            for s in streams:
                s.flush()
            self.link.send(("done", job, result))


def _install_pool_owned_group(dist: Any, backend: str) -> Any:
    """Makes ``init_process_group``/``destroy_process_group`` in cells respect the pool's group.

    Returns the real ``destroy_process_group``, for the pool's stop.
    """
    from opake_fx.errors import OperationError

    real_init = dist.init_process_group
    real_destroy = dist.destroy_process_group

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        if not dist.is_initialized():
            return real_init(*args, **kwargs)
        asked = kwargs.get("backend", args[0] if args else None)
        if asked is not None and str(asked).split(":")[0].lower() not in {backend, "cpu", ""}:
            raise OperationError(
                f"init_process_group(backend={asked!r}) in a %%dist cell, but this pool's process "
                f"group uses {backend!r}. Restart the pool with `%dist_start --backend {asked}`."
            )
        return None  # the pool already initialised the default group on this rank

    def destroy_process_group(group: Any = None) -> None:
        if group is None:
            return None  # the pool leaves the default group when it stops (%dist_stop)
        return real_destroy(group)

    init_process_group.__doc__ = real_init.__doc__
    destroy_process_group.__doc__ = real_destroy.__doc__
    dist.init_process_group = init_process_group
    dist.destroy_process_group = destroy_process_group
    return real_destroy


def main() -> None:
    host, port = os.environ[_wire.ENV_ADDRESS].rsplit(":", 1)
    authkey = bytes.fromhex(os.environ.pop(_wire.ENV_AUTHKEY))
    kernel_pid = int(os.environ[_wire.ENV_KERNEL_PID])
    backend = os.environ.get(_wire.ENV_BACKEND, "auto")
    pg_timeout = float(os.environ.get(_wire.ENV_PG_TIMEOUT, "0") or 0)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))

    faulthandler.enable(file=sys.__stderr__)  # a segfault's stack goes to torchrun's log
    threading.Thread(target=_watch_kernel, args=(kernel_pid,), daemon=True).start()
    signals = _Signals()
    signal.signal(signal.SIGINT, signals.handler)
    link = _Link(Client((host, int(port)), family="AF_INET", authkey=authkey), signals)
    link.send(("hello", rank, world_size, local_rank, os.getpid()))

    try:
        import torch
        import torch.distributed as dist

        if backend == "auto":  # nccl needs one GPU per rank of this node
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
            backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= local_world else "gloo"
        device = torch.device("cpu")
        if backend == "nccl":
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        kwargs: dict[str, Any] = {"backend": backend}
        if pg_timeout > 0:
            kwargs["timeout"] = datetime.timedelta(seconds=pg_timeout)
        if backend == "nccl":
            kwargs["device_id"] = device
        dist.init_process_group(**kwargs)
    except BaseException as exc:  # noqa: BLE001 - reported to the kernel, then exit
        link.send(("error", 0, type(exc).__name__, str(exc), _user_traceback(exc)))
        raise SystemExit(3) from exc
    leave_group = _install_pool_owned_group(dist, backend)
    link.send(("ready", backend, str(device)))

    main_module = types.ModuleType("__main__")
    main_module.__dict__.update(
        {"__builtins__": __builtins__, "rank": rank, "world_size": world_size, "local_rank": local_rank,
         "device": device}
    )
    sys.modules["__main__"] = main_module
    streams = (_RankStream(link, "stdout"), _RankStream(link, "stderr"))
    sys.stdout, sys.stderr = streams
    try:
        _Worker(link, main_module.__dict__, signals).serve(streams)
    finally:
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            if dist.is_initialized():
                leave_group()
        finally:
            link.conn.close()


if __name__ == "__main__":
    main()
