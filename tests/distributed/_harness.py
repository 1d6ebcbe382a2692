"""A small harness that runs functions on real multi-rank gloo process groups.

:class:`RankGroup` spawns ``world_size`` worker processes on 127.0.0.1 that join one gloo
process group (store served by the parent on a free port, gloo bound to the loopback
interface) and then serve calls: ``group.run(fn, *args)`` runs ``fn(rank, world_size,
*args)`` on every rank and returns the per-rank results. ``fn`` must be a module-level
function (it is pickled by reference); results travel back pickled.

Everything is bounded in time: the process group has a timeout (a rank stuck in a
collective fails after ``pg_timeout`` seconds), every call has a timeout (ranks that do
not answer are killed and the call raises :class:`RankTimeout`), and a worker that dies is
noticed within a second. Workers exit when the parent goes away.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_mod
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailure(AssertionError):
    """At least one rank raised or died; the message holds every rank's outcome."""


class RankTimeout(AssertionError):
    """At least one rank did not answer within the call's timeout (it was killed)."""


@dataclass
class Outcome:
    rank: int
    status: str  # "ok", "error", "died", "timeout"
    value: Any = None  # the result for "ok", the traceback text for "error"
    elapsed: float = 0.0


class RankGroup:
    """``world_size`` spawned workers in one gloo process group on 127.0.0.1."""

    def __init__(self, world_size: int = 2, *, pg_timeout: float = 20.0, start_timeout: float = 60.0) -> None:
        self.world_size = world_size
        self.pg_timeout = pg_timeout
        ctx = mp.get_context("spawn")
        self._store = dist.TCPStore(
            "127.0.0.1",
            0,
            world_size + 1,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=start_timeout),
        )
        self._inboxes = [ctx.Queue() for _ in range(world_size)]
        self._outbox = ctx.Queue()
        self._seq = 0
        self._procs = [
            ctx.Process(
                target=_serve,
                args=(r, world_size, self._store.port, pg_timeout, self._inboxes[r], self._outbox, os.getpid()),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.broken = False
        ready = self.outcomes(_ready, timeout=start_timeout)
        if any(o.status != "ok" for o in ready):
            self.close()
            raise RankFailure("process group did not start:\n" + _report(ready))

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0) -> list[Any]:
        """Runs ``fn(rank, world_size, *args)`` on every rank; returns the results in rank order."""
        outs = self.outcomes(fn, *args, timeout=timeout)
        if any(o.status == "timeout" for o in outs):
            raise RankTimeout(f"{fn.__name__} did not finish within {timeout:.0f}s:\n" + _report(outs))
        if any(o.status != "ok" for o in outs):
            raise RankFailure(f"{fn.__name__} failed:\n" + _report(outs))
        return [o.value for o in outs]

    def outcomes(self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0) -> list[Outcome]:
        """Like :meth:`run` but returns every rank's :class:`Outcome` instead of raising."""
        if self.broken:
            raise RankFailure("this RankGroup is broken (a rank failed or timed out earlier); start a new one.")
        self._seq += 1
        seq = self._seq
        payload = pickle.dumps((seq, fn, args))
        for inbox in self._inboxes:
            inbox.put(payload)
        start = time.monotonic()
        got: dict[int, Outcome] = {}
        dead_since: dict[int, float] = {}
        while len(got) < self.world_size:
            now = time.monotonic()
            if now - start > timeout:
                break
            try:
                msg_seq, rank, status, value, elapsed = self._outbox.get(timeout=0.1)
            except queue_mod.Empty:
                for r, p in enumerate(self._procs):
                    if r not in got and not p.is_alive():
                        # Give a message already on its way a moment to arrive.
                        if now - dead_since.setdefault(r, now) > 1.0:
                            got[r] = Outcome(r, "died", f"exit code {p.exitcode}", now - start)
                continue
            if msg_seq != seq:
                continue  # a late answer to an earlier, timed-out call
            got[rank] = Outcome(rank, status, pickle.loads(value) if status == "ok" else value, elapsed)
        outs = [got.get(r, Outcome(r, "timeout", None, time.monotonic() - start)) for r in range(self.world_size)]
        if any(o.status != "ok" for o in outs):
            self.broken = True
            self.close(force=any(o.status == "timeout" for o in outs))
        return outs

    def close(self, *, force: bool = False) -> None:
        """Stops the workers (politely, then by force; at once with ``force``); idempotent."""
        for inbox, p in zip(self._inboxes, self._procs):
            if p.is_alive():
                try:
                    inbox.put(None)
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + (0.0 if force else 5.0)
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        self.broken = True

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _ready(rank: int, world_size: int) -> int:
    return rank


def _serve(rank: int, world_size: int, port: int, pg_timeout: float, inbox: Any, outbox: Any, parent: int) -> None:
    import torch

    if os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False, timeout=timedelta(seconds=pg_timeout))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout)
    )
    try:
        while True:
            try:
                msg = inbox.get(timeout=1.0)
            except queue_mod.Empty:
                if os.getppid() != parent:
                    return  # the parent is gone: do not linger
                continue
            if msg is None:
                return
            seq, fn, args = pickle.loads(msg)
            start = time.monotonic()
            try:
                result = fn(rank, world_size, *args)
                outbox.put((seq, rank, "ok", pickle.dumps(result), time.monotonic() - start))
            except BaseException:  # noqa: BLE001 - report everything to the parent
                outbox.put((seq, rank, "error", traceback.format_exc(), time.monotonic() - start))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort on shutdown
            pass


def _report(outs: list[Outcome]) -> str:
    lines = []
    for o in outs:
        body = o.value if o.status != "ok" else "ok"
        lines.append(f"--- rank {o.rank}: {o.status} after {o.elapsed:.1f}s ---\n{body}")
    return "\n".join(lines)
