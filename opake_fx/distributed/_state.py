"""``sync``: type-dispatched synchronisation of DP state objects across ranks.

This module holds the one documented piece of module-level state in opake_fx.distributed:
the sync registry, a mapping ``type -> sync function``. Clipping and noise states,
samplers and clipping diagnostics have built-in entries (loaded lazily from
``_builtin_sync`` on first use, to keep imports acyclic); users add their own types with
:func:`register_sync_type`.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, TypeVar

from opake_fx.distributed.collectives import is_distributed
from opake_fx.errors import InputTypeError

__all__ = ["sync", "register_sync_type", "registered_sync_types"]

T = TypeVar("T")
SyncFn = Callable[[Any], Any]

_SYNC_REGISTRY: dict[type, SyncFn] = {}
_BUILTINS_LOADED = False
# Outputs of additive syncs (counts that are summed over ranks), by identity, so that a
# second sync of the same object is the identity instead of summing the counts again.
_ALREADY_SYNCED: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()


def sync(*states: Any) -> Any:
    """Synchronises one or more DP state / diagnostic objects across ranks.

    Each object is dispatched on its type (exact type first, then its ``__mro__``) to the
    function registered with :func:`register_sync_type`. Built in:

    * ``FixedClipState``: checks the clip norm and step are identical on every rank.
    * ``AdaptiveClipState``: checks key, step, count noise, previous norm and
      hyperparameters are identical, sums the local ``centered_count`` over ranks and
      recomputes ``clipping_norm`` (so every rank clips the next step at the same norm).
    * ``GaussianNoiseState``: checks the noise key and step are identical on every rank.
    * ``PoissonSampler`` (and ``TruncatedPoissonSampler``), ``SequentialBatchSampler``:
      checks the sampling configuration and cursor agree, and that Poisson keys DIFFER
      across ranks (``fold_in(key, rank)``); returns the sampler itself.
    * ``ClippingStats``: sums the counts and recomputes the rates.
    * ``ClippedGradAux``: gathers the per-example tensors (rank order), sums the counts.

    In a single process every registered object is returned unchanged. Additive syncs
    (adaptive clipping, stats, aux) remember their outputs: syncing an output again
    returns it unchanged on every rank.

    Args:
        *states: the objects to synchronise. Every rank must pass the same kinds of
            objects in the same order.

    Returns:
        The synchronised object for one argument, else a tuple in the input order.

    Raises:
        InputTypeError: an object's type has no registered sync function (listing the
            registered types); nothing is ever passed through unsynchronised.
        DistributedMismatchError: ranks disagree on a value that must be identical
            (noise key or step, clip norm, sampler configuration, ...).
        OperationError: a collective failed (another rank crashed or timed out).

    Privacy:
        The checked values (keys, steps, norms, sampling rates) are public. The adaptive
        clipping count is summed before its norm update, so the released count is one
        Gaussian-noised count over the union of the ranks' batches, as accounted for by
        ``adaptive_clipping_gaussian``. ``ClippingStats`` and ``ClippedGradAux`` are
        non-private diagnostics; gathering them shares per-example values between ranks.

    Example:
        >>> from opake_fx.dpsgd.noise import GaussianNoiseState
        >>> from opake_fx.random import key
        >>> s = GaussianNoiseState(key(42))
        >>> sync(s) is s          # one process: the identity
        True
    """
    if not states:
        return ()
    out = tuple(_sync_one(s) for s in states)
    return out[0] if len(states) == 1 else out


def register_sync_type(cls: type, fn: SyncFn | None = None) -> Any:
    """Registers ``fn(obj) -> synced_obj`` as the sync function of ``cls`` (and its subclasses).

    ``fn`` is called on every rank with that rank's object, only when a process group is
    initialised; it must issue the same collectives on every rank. A later registration
    of the same class replaces the earlier one. Without ``fn`` this returns a decorator.

    Args:
        cls: the type to dispatch on (subclasses resolve through their ``__mro__``).
        fn: the sync function.

    Returns:
        ``fn`` (so it can be used as a decorator).

    Privacy:
        A sync function that sums private values across ranks releases the sum to every
        rank; only sum values that are noised or that you accept to share.

    Example:
        >>> from dataclasses import dataclass
        >>> @dataclass(frozen=True)
        ... class StepCounter:
        ...     step: int
        >>> register_sync_type(StepCounter, lambda s: s)  # doctest: +ELLIPSIS
        <function <lambda> at ...>
        >>> sync(StepCounter(3))
        StepCounter(step=3)
    """
    if not isinstance(cls, type):
        raise InputTypeError(f"register_sync_type needs a class as its first argument; got {type(cls).__name__}.")
    if fn is None:
        def decorator(f: SyncFn) -> SyncFn:
            return register_sync_type(cls, f)

        return decorator
    if not callable(fn):
        raise InputTypeError(f"register_sync_type needs a callable sync function; got {type(fn).__name__}.")
    _ensure_builtins()
    _SYNC_REGISTRY[cls] = fn
    return fn


def registered_sync_types() -> tuple[type, ...]:
    """The types :func:`sync` can handle (built-ins included), in registration order.

    Privacy: none (a query about the registry).

    Example:
        >>> "GaussianNoiseState" in [t.__name__ for t in registered_sync_types()]
        True
    """
    _ensure_builtins()
    return tuple(_SYNC_REGISTRY)


def register_builtin(cls: type, fn: SyncFn) -> None:
    """Registers a built-in sync function unless the user already registered ``cls``."""
    _SYNC_REGISTRY.setdefault(cls, fn)


def mark_synced(obj: T) -> T:
    """Records ``obj`` (by identity) as the output of an additive sync."""
    _ALREADY_SYNCED[id(obj)] = obj
    return obj


def is_marked_synced(obj: Any) -> bool:
    """Whether ``obj`` is itself the output of an additive sync."""
    return _ALREADY_SYNCED.get(id(obj)) is obj


def _sync_one(state: Any) -> Any:
    _ensure_builtins()
    fn = _resolve(type(state))
    if fn is None:
        names = sorted(t.__name__ for t in _SYNC_REGISTRY)
        raise InputTypeError(
            f"sync has no function registered for {type(state).__name__}; registered types: {names}. "
            "Pass the DP state objects themselves (clip_state, noise_state, a sampler, stats/aux), or register "
            "your type with opake_fx.distributed.register_sync_type(cls, fn). Nothing is passed through "
            "unsynchronised."
        )
    if not is_distributed():
        return state
    return fn(state)


def _resolve(cls: type) -> SyncFn | None:
    if cls in _SYNC_REGISTRY:
        return _SYNC_REGISTRY[cls]
    for base in cls.__mro__[1:]:
        if base in _SYNC_REGISTRY:
            return _SYNC_REGISTRY[base]
    return None


def _ensure_builtins() -> None:
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return
    from opake_fx.distributed import _builtin_sync

    _builtin_sync.register_all()
    _BUILTINS_LOADED = True
