"""Step timing and peak memory, for benchmarks and for sizing a training run.

* :func:`time_steps` — warm up, then time ``repeats`` calls; medians are robust to a
  busy machine.
* :func:`time_interleaved` — the same for several variants, round-robin, so slow drifts
  in machine load hit every variant alike (compare ratios from one call).
* :func:`current_rss`, :func:`peak_rss`, :func:`reset_peak_rss` — resident memory of
  this process (Linux ``/proc``; ``ru_maxrss`` elsewhere).
* :func:`peak_rss_in_subprocess` — peak RSS growth of a step run in a fresh Python
  process, so allocations of earlier work cannot hide or inflate it.
* :func:`cuda_peak_memory` — peak CUDA memory allocated by a call.

Privacy: none; these measure time and memory only.

Example:
    >>> t = time_steps(lambda: sum(range(1000)), warmup=1, repeats=5)
    >>> t.repeats, t.median > 0
    (5, True)
"""

from __future__ import annotations

import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from opake_fx.errors import InputValueError, OperationError

__all__ = [
    "Timing",
    "time_steps",
    "time_interleaved",
    "current_rss",
    "peak_rss",
    "reset_peak_rss",
    "peak_rss_in_subprocess",
    "cuda_peak_memory",
]


@dataclass(frozen=True)
class Timing:
    """Wall-clock times of repeated calls, in seconds.

    Attributes:
        samples: every timed call, in order.
        median, mean, min, max, stdev: summaries of ``samples`` (``stdev`` is 0 for one sample).
        warmup: untimed calls made first.
    """

    samples: tuple[float, ...]
    warmup: int

    @property
    def repeats(self) -> int:
        return len(self.samples)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def max(self) -> float:
        return max(self.samples)

    @property
    def stdev(self) -> float:
        return statistics.stdev(self.samples) if len(self.samples) > 1 else 0.0


def time_steps(fn: Callable[[], Any], warmup: int = 3, repeats: int = 10, *, sync: Callable[[], None] | None = None) -> Timing:
    """Times ``repeats`` calls of ``fn`` after ``warmup`` untimed ones.

    Args:
        fn: the step, called without arguments.
        warmup: untimed calls first (caches, allocator, lazy initialisation).
        repeats: timed calls (>= 1).
        sync: called before each clock read, e.g. ``torch.cuda.synchronize`` for GPU
            work (defaults to it when CUDA is initialised).

    Returns:
        a :class:`Timing`; use ``.median``.
    """
    return time_interleaved({"step": fn}, warmup=warmup, repeats=repeats, sync=sync)["step"]


def time_interleaved(
    fns: Mapping[str, Callable[[], Any]],
    warmup: int = 3,
    repeats: int = 10,
    *,
    settle: int = 0,
    sync: Callable[[], None] | None = None,
) -> dict[str, Timing]:
    """Times several variants round-robin: a turn of each, then another turn of each, ...

    Interleaving makes a change of machine load during the run hit every variant alike,
    so ratios between variants from one call are fair even on a shared machine. Each turn
    makes ``settle`` untimed calls and then one timed call: the untimed calls absorb what
    the previous variant left behind (evicted caches, memory the allocator handed back to
    the system and must fault in again), so the timed call sees the steady state of a
    training loop, which repeats one step. ``settle=0`` times the first call of each turn.

    Example:
        >>> out = time_interleaved({"a": lambda: None, "b": lambda: None}, warmup=0, repeats=3, settle=1)
        >>> sorted(out), out["a"].repeats
        (['a', 'b'], 3)
    """
    for name, value, least in (("warmup", warmup, 0), ("repeats", repeats, 1), ("settle", settle, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise InputValueError(f"{name} must be an int >= {least}; got {value!r}.")
    if not fns:
        raise InputValueError("time_interleaved needs at least one function to time.")
    if sync is None and torch.cuda.is_available() and torch.cuda.is_initialized():
        sync = torch.cuda.synchronize
    tick = sync or (lambda: None)
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            for _ in range(settle):
                fn()
            tick()
            t0 = time.perf_counter()
            fn()
            tick()
            samples[name].append(time.perf_counter() - t0)
    return {name: Timing(tuple(s), warmup) for name, s in samples.items()}


def current_rss() -> int:
    """Resident set size of this process now, in bytes (Linux; ``peak_rss`` elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss()


def peak_rss() -> int:
    """Peak resident set size of this process, in bytes (since start or the last
    successful :func:`reset_peak_rss`)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux


def reset_peak_rss() -> bool:
    """Resets the peak RSS to the current RSS (Linux >= 4.0); returns whether it could."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_in_subprocess(
    target: str,
    kwargs: Mapping[str, Any] | None = None,
    *,
    steps: int = 3,
    warmup: int = 0,
    env: Mapping[str, str] | None = None,
    timeout: float = 600.0,
) -> dict[str, Any]:
    """Peak RSS growth of a step, measured in a fresh Python process.

    The child imports ``target`` (``"package.module:function"`` or
    ``"path/to/file.py:function"``), calls ``function(**kwargs)`` to build everything
    (model, data, optimizer) and get back a zero-argument ``step``, calls it ``warmup``
    times (one-off lazy initialisation: imports, caches), collects garbage, records its
    RSS (``baseline``), resets the peak, calls ``step`` ``steps`` times and records the
    peak. The growth ``peak - baseline`` is what the steps needed beyond the
    setup: activations, gradients, per-example buffers, optimizer temporaries. (Only
    memory the allocator returns to the OS shows up as freed; set
    ``MALLOC_MMAP_THRESHOLD_`` in ``env`` to make large buffers count exactly.)

    Returns:
        ``{"baseline": bytes, "peak": bytes, "delta": bytes, "peak_reset": bool}``
        (``peak_reset`` False: the peak includes the setup, as on non-Linux systems).
    """
    if ":" not in target:
        raise InputValueError(f"target must be 'module:function' or 'file.py:function'; got {target!r}.")
    payload = json.dumps({"target": target, "kwargs": dict(kwargs or {}), "steps": int(steps), "warmup": int(warmup)})
    child_env = {**os.environ, **(env or {})}
    # The child sees the same import path as this process (an uninstalled checkout, a benchmark dir).
    inherited = [p for p in sys.path if p and os.path.isdir(p)]
    child_env["PYTHONPATH"] = os.pathsep.join(inherited + [child_env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, payload], capture_output=True, text=True, env=child_env, timeout=timeout
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@rss ")]
    if proc.returncode != 0 or not lines:
        raise OperationError(f"the memory-measuring subprocess for {target} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("@@rss "):])


def cuda_peak_memory(fn: Callable[[], Any], device: torch.device | str | int | None = None) -> int:
    """Peak CUDA memory allocated while ``fn()`` runs, in bytes (beyond what was allocated before)."""
    if not torch.cuda.is_available():
        raise OperationError("cuda_peak_memory needs a CUDA device; use peak_rss_in_subprocess on CPU.")
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


_CHILD = r"""
import gc, importlib, importlib.util, json, sys
from opake_fx import profiling
spec = json.loads(sys.argv[1])
where, name = spec["target"].rsplit(":", 1)
if where.endswith(".py"):
    s = importlib.util.spec_from_file_location("_opake_profiled", where)
    module = importlib.util.module_from_spec(s)
    sys.modules["_opake_profiled"] = module
    s.loader.exec_module(module)
else:
    module = importlib.import_module(where)
step = getattr(module, name)(**spec["kwargs"])
for _ in range(spec["warmup"]):
    step()
gc.collect()
baseline = profiling.current_rss()
reset = profiling.reset_peak_rss()
for _ in range(spec["steps"]):
    step()
peak = max(profiling.peak_rss(), profiling.current_rss())
print("@@rss " + json.dumps({"baseline": baseline, "peak": peak, "delta": peak - baseline, "peak_reset": reset}))
"""
