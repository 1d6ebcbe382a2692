"""torchrun-backed notebook cells (``opake_fx.notebook``): the pool directly, and through a real kernel.

The kernel test is the acceptance test of the ``%dist_*`` magics: a Jupyter kernel
(jupyter_client) loads the extension, starts 2 torchrun ranks, all-reduces a tensor, runs
the seed's distributed tutorial (``examples/distributed_dp_training.py``: the seed's cells
with renamed imports only) cell by cell to its final epsilon line, sees a rank's exception
re-raised with its rank, sees a killed rank reported within 10 s, interrupts the ranks,
and leaves no process behind after ``%dist_stop`` or the kernel's exit.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from opake_fx.errors import InputValueError, OperationError
from opake_fx.notebook import DistPool, PoolBrokenError, RankDiedError, RankError, launch

ROOT = Path(__file__).parents[1]
TUTORIAL = ROOT / "examples" / "distributed_dp_training.py"
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def _wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def total_times_rank(x: float) -> float:
    """Used by the launch() test: the ranks import it from this module."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([x * (dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def test_pool_rejects_bad_arguments():
    with pytest.raises(InputValueError, match="nproc >= 1"):
        DistPool(0)
    with pytest.raises(InputValueError, match="backend must be one of"):
        DistPool(2, backend="mpi")
    with pytest.raises(InputValueError, match=r"launch\(fn, 2, \*args\)"):
        launch(total_times_rank, 10.0)  # fn's argument where nproc goes


def test_magics_ignore_a_trailing_comment():
    """``%dist_start -n 2  # ...`` as docs/jupyter.md writes it: IPython passes the comment on as arguments."""
    pytest.importorskip("IPython")
    from IPython.core.error import UsageError
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "opake_fx.notebook")
    # each call gets past argument parsing (a comment taken for arguments is a UsageError)
    # and stops at the first check after it, before any process is started
    with pytest.raises(InputValueError, match="nproc >= 1"):
        shell.run_line_magic("dist_start", "-n 0   # torchrun --standalone --nproc-per-node=0")
    with pytest.raises(OperationError, match="no pool is running"):
        shell.run_line_magic("dist_pull", "t --rank 1 # from rank 1")
    with pytest.raises(OperationError, match="no pool is running"):
        shell.run_cell_magic("dist", "--rank 0 1  # two ranks", "print(rank)")
    with pytest.raises(UsageError, match="unrecognized arguments: extra"):
        shell.run_line_magic("dist_pull", "t extra")  # real extra arguments are still refused
    with pytest.raises(OperationError, match="no pool is running"):  # a quoted '#' is an argument
        shell.run_line_magic("dist_pull", "'#t'")


@pytest.mark.distributed
def test_pool_runs_cells_pulls_values_and_stops_cleanly(monkeypatch):
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    lines: list[tuple[int, str, str]] = []
    pool = DistPool(2, backend="gloo", echo=lambda r, s, line: lines.append((r, s, line)))
    pids = [pool.torchrun_pid, *pool.pids.values()]
    try:
        assert pool.state == "running" and sorted(pool.pids) == [0, 1]
        with pytest.raises(ConnectionRefusedError):  # the kernel stopped listening once the ranks joined
            socket.create_connection(pool.address, timeout=2)
        pool.run_cell("import torch, torch.distributed as dist\nt = torch.ones(2) * (rank + 1)\ndist.all_reduce(t)\nprint(t.tolist())")
        assert (0, "stdout", "[3.0, 3.0]\n") in lines and (1, "stdout", "[3.0, 3.0]\n") in lines
        pool.run_cell("import sys\nprint('to stderr', file=sys.stderr)\nrank * 10", ranks=[1])
        assert (1, "stderr", "to stderr\n") in lines and (1, "stdout", "10\n") in lines
        assert not any(r == 0 and "to stderr" in line for r, _, line in lines)
        assert pool.pull("t").tolist() == [3.0, 3.0]
        assert pool.pull("rank", rank=1) == 1
        with pytest.raises(RankError, match="rank 1 raised ZeroDivisionError") as info:
            pool.run_cell("x = 1 / (1 - rank)")
        assert info.value.rank == 1 and "<dist-cell-" in info.value.remote_traceback
        with pytest.raises(RankError, match="rank 0 raised SystemExit"):  # ends the cell, not the rank
            pool.run_cell("import sys\nsys.exit(3)", ranks=[0])
        assert pool.call(total_times_rank, 2.0) == {0: 6.0, 1: 6.0}
        # a script written for torchrun: init and destroy of the default group are the pool's
        pool.run_cell("dist.init_process_group(backend='gloo')\ndist.destroy_process_group()\nprint(dist.is_initialized())")
        assert (0, "stdout", "True\n") in lines
    finally:
        pool.stop()
    assert pool.state == "stopped"
    assert _wait_gone(pids) == []
    assert "torch.distributed" not in sys.modules or not __import__("torch").distributed.is_initialized()


@pytest.mark.slow
@pytest.mark.distributed
def test_launch_returns_rank_zeros_result(monkeypatch):
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    assert launch(total_times_rank, 2, 10.0, backend="gloo") == 30.0


# --------------------------------------------------------------------- the kernel test
class _Kernel:
    """A Jupyter kernel (jupyter_client) and a helper that runs one cell and gathers its output."""

    def __init__(self) -> None:
        from jupyter_client.manager import KernelManager

        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(cwd=str(ROOT), env={**os.environ, **ENV})
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def submit(self, code: str) -> str:
        return self.kc.execute(code)

    def collect(self, msg_id: str, timeout: float) -> dict:
        out = {"stdout": "", "stderr": "", "error": None, "result": ""}
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"cell did not finish within {timeout} s; output so far: {out}")
            try:
                msg = self.kc.get_iopub_msg(timeout=left)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out[content["name"]] += content["text"]
            elif kind == "error":
                out["error"] = content
            elif kind == "execute_result":
                out["result"] += content["data"].get("text/plain", "")
            elif kind == "status" and content["execution_state"] == "idle":
                return out

    def run(self, code: str, timeout: float = 120.0) -> dict:
        return self.collect(self.submit(code), timeout)

    def ok(self, code: str, timeout: float = 120.0) -> dict:
        out = self.run(code, timeout)
        assert out["error"] is None, "\n".join(out["error"]["traceback"]) + out["stderr"]
        return out

    def pool_pids(self) -> list[int]:
        status = self.ok("%dist_status")["stdout"]
        return [int(p) for p in re.findall(r"pid (\d+)", status)]

    def close(self) -> None:
        self.kc.stop_channels()
        if self.km.is_alive():
            self.km.shutdown_kernel(now=True)


def _tutorial_cells() -> list[str]:
    """The seed tutorial's four code cells before its cleanup cell, and the cleanup cell."""
    text = TUTORIAL.read_text(encoding="utf-8")
    marks = ["torch.manual_seed(42)", "BATCH_SIZE = 64", "for step, (xb, yb) in enumerate(loader):",
             "if rank == 0:\n    eps_final"]
    cuts = [0, *(text.index(m) for m in marks), len(text)]
    return [text[a:b] for a, b in zip(cuts, cuts[1:])]


@pytest.mark.slow
@pytest.mark.distributed
def test_kernel_runs_the_distributed_tutorial_on_two_torchrun_ranks():
    pytest.importorskip("jupyter_client")
    pytest.importorskip("ipykernel")
    kernel = _Kernel()
    try:
        kernel.ok("%load_ext opake_fx.notebook")
        started = kernel.ok("%dist_start -n 2 --backend gloo", timeout=300)["stdout"]
        assert "Started 2 ranks under torchrun" in started

        out = kernel.ok("%%dist\nimport torch, torch.distributed as dist\n"
                        "t = torch.ones(3) * (rank + 1)\ndist.all_reduce(t)\nprint(t.tolist())")
        assert "[rank 0] [3.0, 3.0, 3.0]" in out["stdout"] and "[rank 1] [3.0, 3.0, 3.0]" in out["stdout"]
        assert kernel.ok("import sys\nprint('torch.distributed' in sys.modules)")["stdout"].strip() == "False"

        # the seed's tutorial, cell by cell (its imports renamed, nothing else changed)
        cells = _tutorial_cells()
        assert len(cells) == 5
        log = "".join(kernel.ok("%%dist\n" + cell, timeout=600)["stdout"] for cell in cells)
        assert "[rank 0] Rank 0/2 on cpu" in log and "[rank 1] Rank 1/2 on cpu" in log
        assert re.search(r"\[rank 0\] Noise multiplier: \d+\.\d{4}", log)
        assert "[rank 0] Step  500" in log and "[rank 1] Step" not in log
        final = re.search(r"\[rank 0\] Final epsilon: (\d+\.\d+)", log)
        assert final and abs(float(final.group(1)) - 3.0) <= 0.01, log[-2000:]
        # the pool still works after the tutorial's own destroy_process_group()
        kernel.ok("%%dist\ndist.all_reduce(t)\nassert t.tolist() == [6.0, 6.0, 6.0]")
        kernel.ok("%dist_pull t --as t_from_rank0")
        assert kernel.ok("t_from_rank0.tolist()")["result"] == "[6.0, 6.0, 6.0]"

        # an exception on rank 1, re-raised in the kernel naming its rank
        out = kernel.run("%%dist\nif rank == 1:\n    raise ValueError('only rank one fails')\nprint('passed')")
        assert out["error"] is not None and out["error"]["ename"] == "RankError"
        assert "rank 1 raised ValueError: only rank one fails" in out["error"]["evalue"]
        shown = "\n".join(out["error"]["traceback"])
        assert "raised on rank 1" in shown and "only rank one fails" in shown
        assert "[rank 0] passed" in out["stdout"]

        # KeyboardInterrupt interrupts the ranks; the pool keeps working
        msg_id = kernel.submit("%%dist\nimport time\nfor _ in range(600):\n    time.sleep(0.1)")
        time.sleep(2.0)
        kernel.km.interrupt_kernel()
        out = kernel.collect(msg_id, timeout=30)
        assert out["error"] is not None and out["error"]["ename"] == "KeyboardInterrupt"
        assert "[rank 1] done" in kernel.ok("%%dist\nprint('done')")["stdout"]

        # killing rank 1 in the middle of a cell: reported within 10 s with its exit code
        rank1 = int(kernel.ok("%%dist --rank 1\nimport os\nprint(os.getpid())")["stdout"].split()[-1])
        msg_id = kernel.submit("%%dist\nimport time\ntime.sleep(120)")
        time.sleep(2.0)
        killed_at = time.monotonic()
        os.kill(rank1, signal.SIGKILL)
        out = kernel.collect(msg_id, timeout=60)
        took = time.monotonic() - killed_at
        assert out["error"] is not None and out["error"]["ename"] == "RankDiedError", out
        assert "rank 1" in out["error"]["evalue"] and "-9 (SIGKILL)" in out["error"]["evalue"]
        assert took < 10.0, f"the dead rank was reported after {took:.1f} s"
        out = kernel.run("%%dist\nprint(1)")
        assert out["error"] is not None and out["error"]["ename"] == "PoolBrokenError"

        # %dist_stop leaves no process behind
        kernel.ok("%dist_start -n 2 --backend gloo", timeout=300)
        pids = kernel.pool_pids()
        assert len(pids) == 3  # torchrun and two ranks
        kernel.ok("%dist_stop")
        assert _wait_gone(pids, timeout=10) == []

        # neither does a kernel that exits with a pool running
        kernel.ok("%dist_start -n 2 --backend gloo", timeout=300)
        pids = kernel.pool_pids()
        kernel.km.shutdown_kernel(now=False)
        assert _wait_gone(pids, timeout=20) == []
    finally:
        kernel.close()


def test_broken_pool_refuses_cells_with_the_reason():
    pool = DistPool.__new__(DistPool)  # a pool object in the broken state, without processes
    pool._state, pool._reason = "broken", "rank 1 (pid 1) died with exit code -9 (SIGKILL)"
    with pytest.raises(PoolBrokenError, match="rank 1 .* died with exit code -9"):
        pool.run_cell("print(1)")


def test_rank_died_error_names_rank_and_code():
    err = RankDiedError(1, -9, "rank 1 (pid 5) died with exit code -9 (SIGKILL)", "tail")
    assert err.rank == 1 and err.exitcode == -9 and "tail" in str(err)


@pytest.mark.slow
@pytest.mark.distributed
def test_ranks_exit_when_their_kernel_is_killed(tmp_path):
    """A kernel killed outright (no atexit) leaves no rank and no torchrun behind."""
    import subprocess

    script = tmp_path / "kernel.py"
    script.write_text(
        "import sys, time\n"
        "from opake_fx.notebook import DistPool\n"
        "pool = DistPool(2, backend='gloo')\n"
        "print(pool.torchrun_pid, *pool.pids.values(), flush=True)\n"
        "time.sleep(600)\n",
        encoding="utf-8",
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, **ENV})
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 3 and all(_alive(p) for p in pids)
        proc.kill()
        proc.wait(timeout=10)
        assert _wait_gone(pids, timeout=15) == []
    finally:
        proc.kill()


def test_output_is_split_into_rank_prefixed_lines():
    """Partial writes are held until their line ends; \\r (progress bars) ends a line too."""
    seen: list[tuple[int, str, str]] = []
    pool = DistPool.__new__(DistPool)  # only the output path, without processes
    pool._echo, pool._partial = (lambda r, s, line: seen.append((r, s, line))), {}
    pool._emit(1, "stdout", "step 1 ")
    pool._emit(0, "stdout", "a\nb")
    assert seen == [(0, "stdout", "a\n")]
    pool._emit(1, "stdout", "done\n10%\r20%\r")
    pool._emit(1, "stderr", "warning")
    pool._flush_partial()
    assert seen[1:] == [(1, "stdout", "step 1 done\n"), (1, "stdout", "10%\r"), (1, "stdout", "20%\r"),
                        (0, "stdout", "b\n"), (1, "stderr", "warning\n")]


def test_listener_refuses_connections_without_the_secret():
    """Only a client holding the pool's secret gets through the handshake; others are dropped."""
    import queue as queue_mod
    import threading
    from multiprocessing import AuthenticationError
    from multiprocessing.connection import Client, Listener

    from opake_fx.notebook import _wire

    pool = DistPool.__new__(DistPool)  # only the accept loop, without torchrun
    secret = os.urandom(32)
    pool._listener = Listener(("127.0.0.1", 0), family="AF_INET", authkey=secret)
    pool.nproc, pool._closing = 1, False
    hellos: queue_mod.Queue = queue_mod.Queue()
    thread = threading.Thread(target=pool._accept_loop, args=(hellos,), daemon=True)
    thread.start()
    try:
        assert pool._listener.address[0] == "127.0.0.1"
        with pytest.raises(AuthenticationError):
            Client(pool._listener.address, family="AF_INET", authkey=os.urandom(32))
        assert hellos.empty()
        good = Client(pool._listener.address, family="AF_INET", authkey=secret)
        good.send_bytes(_wire.encode(("hello", 0, 1, 0, os.getpid())))
        conn, hello = hellos.get(timeout=10)
        assert hello == ("hello", 0, 1, 0, os.getpid())
        thread.join(timeout=5)
        assert not thread.is_alive()  # it stops accepting once every rank joined
        conn.close()
        good.close()
    finally:
        pool._closing = True
        pool._listener.close()


@pytest.mark.slow
@pytest.mark.distributed
def test_interrupt_with_a_rank_blocked_in_a_collective_breaks_the_pool_instead_of_hanging(monkeypatch):
    """Rank 1 waits in all_reduce for rank 0, which is interrupted first: no hang, the pool is stopped.

    The interrupt is sent once rank 1 says it enters the collective (not after a fixed delay,
    which a busy machine outran: the cell had not started yet), and rank 1 ignores SIGINT from
    then on, so it stays blocked whatever the timing."""
    import threading

    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    entered = threading.Event()

    def echo(rank, stream, line):
        if rank == 1 and "entering all_reduce" in line:
            entered.set()

    pool = DistPool(2, backend="gloo", interrupt_grace=3.0, echo=echo)
    pids = [pool.torchrun_pid, *pool.pids.values()]

    def interrupt():
        entered.wait(300)
        time.sleep(0.5)  # (rank 1 is in all_reduce by now, or about to be: it ignores SIGINT either way)
        os.kill(os.getpid(), signal.SIGINT)

    sender = threading.Thread(target=interrupt, daemon=True)
    # SIGINT raises KeyboardInterrupt here, as in a Jupyter kernel, whatever handler an earlier
    # test or library left installed in this process (the full slow suite ran this test with
    # one that did not interrupt: the cell then finished after rank 0's sleep).
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        sender.start()
        with pytest.raises(PoolBrokenError, match="did not stop within 3 s"):
            pool.run_cell("import signal, time, torch, torch.distributed as dist\n"
                          "if rank == 0:\n    time.sleep(600)\n"
                          "else:\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                          "    print('entering all_reduce', flush=True)\n"
                          "dist.all_reduce(torch.ones(1))")
        assert entered.is_set()
        assert pool.state == "broken" and "did not stop" in pool.reason
    finally:
        signal.signal(signal.SIGINT, handler)
        pool.stop()
    assert _wait_gone(pids) == []


@pytest.mark.slow
@pytest.mark.distributed
def test_launch_sends_functions_defined_in_main_by_value(tmp_path):
    """A function defined in a script or notebook (``__main__``) runs on the ranks too."""
    import subprocess

    script = tmp_path / "script.py"
    script.write_text(
        "from opake_fx.notebook import launch\n"
        "def f(x):\n"
        "    import torch, torch.distributed as dist\n"
        "    t = torch.tensor([float(x + dist.get_rank())])\n"
        "    dist.all_reduce(t)\n"
        "    return t.item()\n"
        "if __name__ == '__main__':\n"
        "    print('result', launch(f, 2, 5, backend='gloo'))\n",
        encoding="utf-8",
    )
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, **ENV})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "result 11.0" in run.stdout
