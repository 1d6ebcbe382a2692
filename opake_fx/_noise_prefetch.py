"""Drawing the next step's Gaussian noise while the current step computes.

The noise of step ``t`` is a function of the key, ``t``, the leaves' shapes, dtypes and
devices and the stddev only, never of the gradient. A :class:`NoisePrefetcher` therefore
starts step ``t + 1``'s draw as soon as step ``t`` has taken its own, and the draw runs
while the caller's next forward and backward pass run: on a background thread for CPU
leaves (torch's CPU generator is serial, and its kernels release the GIL), on a side
stream for leaves on one CUDA device.

The prefetched draw is the very call the synchronous path makes
(:func:`opake_fx.random.flat_tree_normal` with the same key, leaf layout and stddev), so
the numbers are bit-identical to drawing in place. It is used only when everything that
selects the numbers matches; otherwise it is dropped and the noise is drawn now. At most
one draw is pending per prefetcher (one step ahead), and a pending draw is never part of a
state: a checkpoint holds the key and step, and a resumed run's first step draws
synchronously, the same numbers.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from opake_fx._noise_input import MAX_STEPS
from opake_fx.errors import InputValueError
from opake_fx.random import RngKey, flat_tree_normal, fold_in

__all__ = ["NoisePrefetcher", "PREFETCH_MIN_VALUES", "prefetch_by_default"]

PREFETCH_MIN_VALUES = 1 << 18
"""Below this many noise values a CPU draw takes less than a thread hand-off costs.

Measured inside training steps on 2 shared cores: a 1.4k-parameter MLP step went from
1.4 ms to 3.6 ms with a background draw (the hand-off and the GIL round trip cost more
than the 10 us draw). Above it the evidence is thin (docs/performance.md): one A/B at a
load of about 2 gave the 1.28M-parameter embedding-bag step 154 -> 144 ms and the
0.8M-parameter LM step 56.5 -> 56.2 ms; runs at a load of 10 were inconclusive.
"""

_AUTO_MISSES = 2  # auto gives up after this many unused draws in a row

Draw = tuple[list[torch.Tensor], list[torch.Tensor]]
_Signature = tuple[RngKey, tuple[tuple[tuple[int, ...], torch.dtype, torch.device], ...], float]


def prefetch_by_default(leaves: Sequence[torch.Tensor]) -> bool:
    """Whether ``prefetch=None`` (auto) draws ahead for these leaves.

    On when every leaf is on the CPU, the noise has at least :data:`PREFETCH_MIN_VALUES`
    values and the process may run on more cores than torch's intra-op threads use (a
    core left for the background draw). Where torch's threads take every core, the draw
    competes with the step's own kernels: on 2 cores with 2 torch threads, an idle-machine
    run measured the embedding-bag step 12.1 ms in place against 14.0 ms drawn ahead, and
    the LM step 45.1 against 46.4 ms (docs/performance.md), so auto draws in place there.
    CUDA leaves draw ahead only with ``prefetch=True`` until a GPU measurement shows the
    side stream helps (``benchmarks/gpu_check.py``).

    Example:
        >>> prefetch_by_default([torch.zeros(10)])  # too small to pay for the hand-off
        False
    """
    if not leaves or any(leaf.device.type != "cpu" for leaf in leaves):
        return False
    if sum(leaf.numel() for leaf in leaves) < PREFETCH_MIN_VALUES:
        return False
    return _usable_cores() > torch.get_num_threads()


class NoisePrefetcher:
    """Keyed normals for step ``t + 1``, drawn while step ``t + 1``'s gradient is computed.

    ``draw(step_key, leaves, stddev)`` returns exactly
    ``flat_tree_normal(step_key, leaves, stddev=stddev)``: the pending draw when it was
    started for the same key, leaf shapes, dtypes, devices and stddev, else a draw made now.
    ``prefetch(...)`` starts the next draw (replacing any pending one), ``prefetch_next(key, step)``
    one for the layout and stddev of the last ``draw``; ``discard()`` drops it;
    ``normals(key, step, ...)`` does what a noise stage needs each step: step ``step``'s
    draw under ``fold_in(key, step)``, and step ``step + 1``'s started.

    Args:
        enabled: ``True`` draws ahead whenever the leaves allow it (all on the CPU, or all
            on one CUDA device); ``False`` never does; ``None`` decides per call with
            :func:`prefetch_by_default`, and stops once two draws in a row went unused
            (a stddev that changes every step, as under adaptive clipping).

    Privacy:
        None of its own: the numbers are those of the synchronous draw for the same key and
        step, so the mechanism, its accounting and the rule that a key is never reused are
        unchanged. A draw is used at most once; one made for a step that never comes is
        dropped unused.

    Example:
        >>> from opake_fx.random import fold_in, key
        >>> leaves = [torch.zeros(3, 2), torch.zeros(4)]
        >>> pf = NoisePrefetcher(enabled=True)
        >>> pf.prefetch(fold_in(key(0), 1), leaves, 0.5)
        >>> ahead, _ = pf.draw(fold_in(key(0), 1), leaves, 0.5)
        >>> now, _ = flat_tree_normal(fold_in(key(0), 1), leaves, stddev=0.5)
        >>> all(torch.equal(a, b) for a, b in zip(ahead, now))
        True
    """

    def __init__(self, enabled: bool | None = None) -> None:
        if enabled is not None and not isinstance(enabled, bool):
            raise InputValueError(f"prefetch must be True, False or None (auto); got {enabled!r}.")
        self.enabled = enabled
        self._lock = threading.Lock()
        self._pending: tuple[_Signature, Any, int] | None = None
        self._streams: dict[torch.device, Any] = {}
        self._last: tuple[Any, float] | None = None
        self.hits = 0
        """How many draws were served from a prefetch (for tests and benchmarks)."""
        self._misses = 0  # pending draws dropped in a row (e.g. a clip norm that adapts every step)
        self._auto: tuple[Any, bool] | None = None  # ((layout, torch threads), whether auto draws ahead)

    def draw(self, step_key: RngKey, leaves: Sequence[torch.Tensor], stddev: float) -> Draw:
        """``flat_tree_normal(step_key, leaves, stddev=stddev)``, from the pending draw if it matches."""
        signature = _signature(step_key, leaves, stddev)
        with self._lock:
            pending, self._pending = self._pending, None
        self._last = signature[1:]
        if pending is not None and pending[2] != os.getpid():
            pending = None  # started before a fork: no thread of this process will finish it
        if pending is not None and pending[0] == signature:
            result = _collect(pending[1])
            self.hits += 1
            self._misses = 0
            return result
        if pending is not None:
            self._misses += 1
        _drop(pending)
        return flat_tree_normal(step_key, leaves, stddev=stddev)

    def normals(self, key: RngKey, step: int, leaves: Sequence[torch.Tensor], stddev: float) -> Draw:
        """Step ``step``'s draw (``flat_tree_normal(fold_in(key, step), ...)``); starts step ``step + 1``'s.

        The one call a noise stage makes per step: it returns the same numbers as the
        synchronous draw and leaves the next step's draw running (when prefetching applies).
        """
        result = self.draw(fold_in(key, step), leaves, stddev)
        if step + 1 < MAX_STEPS:
            self.prefetch_next(key, step + 1)
        return result

    def prefetch_next(self, key: RngKey, step: int) -> None:
        """Starts step ``step``'s draw (under ``fold_in(key, step)``) for the leaf layout and
        stddev of the last :meth:`draw`; derives no key when prefetching does not apply."""
        if self._last is None or self.enabled is False:
            return
        layout, stddev = self._last
        specs = [_LeafSpec(*spec) for spec in layout]  # type: ignore[misc]
        if self._applies(specs):
            self._start(fold_in(key, step), specs, stddev)

    def prefetch(self, step_key: RngKey, leaves: Sequence[torch.Tensor], stddev: float) -> None:
        """Starts the draw ``draw(step_key, leaves, stddev)`` will return, if prefetching applies."""
        if self._applies(leaves):
            self._start(step_key, leaves, stddev)

    def _start(self, step_key: RngKey, leaves: Sequence[Any], stddev: float) -> None:
        signature = _signature(step_key, leaves, stddev)
        specs = [_LeafSpec(s, d, dev) for s, d, dev in signature[1]]
        devices = {leaf.device for leaf in leaves}
        if next(iter(devices)).type == "cpu":
            job: Any = _executor().submit(flat_tree_normal, step_key, specs, stddev=stddev)
        else:
            job = self._on_side_stream(next(iter(devices)), step_key, specs, stddev)
        with self._lock:
            old, self._pending = self._pending, (signature, job, os.getpid())
        _drop(old)

    def discard(self) -> None:
        """Drops the pending draw (e.g. before a checkpoint, or when training ends)."""
        with self._lock:
            old, self._pending = self._pending, None
        _drop(old)

    @property
    def pending(self) -> bool:
        """Whether a draw is pending."""
        return self._pending is not None

    def _applies(self, leaves: Sequence[torch.Tensor]) -> bool:
        if self.enabled is False or not leaves:
            return False
        if self.enabled is None:
            # Auto stops drawing ahead once two draws in a row went unused: a stddev that
            # changes every step (adaptive clipping) would otherwise draw every step twice.
            # Its decision is kept per leaf layout and torch thread count.
            if self._misses >= _AUTO_MISSES:
                return False
            decided = (tuple((tuple(leaf.shape), leaf.dtype, leaf.device) for leaf in leaves), torch.get_num_threads())
            if self._auto is None or self._auto[0] != decided:
                self._auto = (decided, prefetch_by_default(leaves))
            return self._auto[1]
        devices = {leaf.device for leaf in leaves}
        return len(devices) == 1 and next(iter(devices)).type in ("cpu", "cuda")

    def _on_side_stream(self, device: torch.device, step_key: RngKey, specs: list[_LeafSpec], stddev: float) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            draws, buffers = flat_tree_normal(step_key, specs, stddev=stddev)  # type: ignore[arg-type]
            done = torch.cuda.Event()
            done.record(stream)
        return _CudaDraw((draws, buffers), done, device)


# --- private helpers ---------------------------------------------------------------


@dataclass(frozen=True)
class _LeafSpec:
    """What :func:`flat_tree_normal` reads of a leaf, without holding the leaf (or its memory)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class _CudaDraw:
    result: Draw
    done: Any
    device: torch.device


def _signature(step_key: RngKey, leaves: Sequence[torch.Tensor], stddev: float) -> _Signature:
    return step_key, tuple((tuple(leaf.shape), leaf.dtype, leaf.device) for leaf in leaves), float(stddev)


def _collect(job: Any) -> Draw:
    if isinstance(job, Future):
        return job.result()
    # Side stream: the current stream waits for the draw, and the allocator learns that
    # the buffers are now used on the current stream (not freed when the side stream moves on).
    current = torch.cuda.current_stream(job.device)
    current.wait_event(job.done)
    for buffer in job.result[1]:
        buffer.record_stream(current)
    return job.result


def _drop(pending: tuple[_Signature, Any, int] | None) -> None:
    if pending is not None and isinstance(pending[1], Future) and pending[2] == os.getpid():
        pending[1].cancel()  # a draw already running finishes and is garbage-collected unused


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    """One background thread for all prefetchers (each has at most one draw pending)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(1, thread_name_prefix="opake_fx-noise-prefetch")
        return _pool


def _forget_pool_in_child() -> None:
    # A forked child inherits the executor object but not its thread: work submitted to it
    # would never run. The child starts its own on first use.
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_in_child)


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
