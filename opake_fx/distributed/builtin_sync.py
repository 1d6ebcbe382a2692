"""The sync functions of opake_fx's own DP state objects, for their types to register.

Each state type registers its sync in the module that defines it, with the public
:func:`~opake_fx.distributed.register_sync_type`: ``GaussianNoiseState`` in
:mod:`opake_fx.dpsgd.noise` does ``register_sync_type(GaussianNoiseState,
sync_gaussian_noise_state)``. This module imports none of those types (it reads their
fields) and not the sync registry either (a state made of other states registers
:func:`~opake_fx.distributed.sync_fields` instead), so the distributed layer never imports
the layers above it. Each function runs only when a process group is initialised, and
issues the same collectives on every rank.

Privacy: the checked values (keys, steps, norms, sampling rates) are public; the sums
(adaptive clipping's count, the clipping statistics) are what :func:`~opake_fx.distributed.sync`
documents.

Example:
    >>> from opake_fx.dpsgd.noise import GaussianNoiseState
    >>> from opake_fx.distributed import registered_sync_types
    >>> GaussianNoiseState in registered_sync_types()  # registered where it is defined
    True
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

import torch

from opake_fx.distributed._checks import check_identical, fingerprint, gather_fields
from opake_fx.distributed._backend import collective_device
from opake_fx.distributed.collectives import all_reduce_
from opake_fx.distributed.metrics import gather_for_metrics
from opake_fx.errors import DistributedMismatchError, InputTypeError
from opake_fx.pytree import tree_map

__all__ = ["mark_synced", "is_marked_synced", "sync_fixed_clip_state", "sync_adaptive_clip_state",
           "sync_gaussian_noise_state", "sync_poisson_sampler", "sync_sequential_sampler", "sync_clipping_stats",
           "sync_clipped_grad_aux"]

T = TypeVar("T")

# Outputs of additive syncs (counts that are summed over ranks), by identity, so that a
# second sync of the same object is the identity instead of summing the counts again.
_ALREADY_SYNCED: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()


def mark_synced(obj: T) -> T:
    """Records ``obj`` (by identity) as the output of an additive sync."""
    _ALREADY_SYNCED[id(obj)] = obj
    return obj


def is_marked_synced(obj: Any) -> bool:
    """Whether ``obj`` is itself the output of an additive sync."""
    return _ALREADY_SYNCED.get(id(obj)) is obj


def sync_fixed_clip_state(state: Any) -> Any:
    """Checks the clip norm and step agree on every rank; returns ``state``."""
    check_identical(
        "FixedClipState",
        [("clipping_norm", state.clipping_norm), ("step", state.step)],
        fix="Build clipped_grad with the same clipping_norm on every rank and call grad_fn once per step on every "
        "rank, also when the local batch is empty.",
    )
    return state


def sync_adaptive_clip_state(state: Any, *, next_norm: Callable[[Any, float], float]) -> Any:
    """Sums the local centred counts over ranks and recomputes the next clip norm.

    ``next_norm(state, centered_count)`` is adaptive clipping's norm update
    (``opake_fx.dpsgd.clipping.adaptive.next_clipping_norm``); the state's module registers
    ``functools.partial(sync_adaptive_clip_state, next_norm=next_clipping_norm)``.
    """
    fields: list[tuple[str, Any]] = [
        ("already synced", is_marked_synced(state)),
        ("key", state.key),
        ("step", state.step),
        ("prev_clipping_norm", state.prev_clipping_norm),
        ("count_noise", state.count_noise),
        ("target_quantile", state.target_quantile),
        ("learning_rate", state.learning_rate),
        ("count_noise_multiplier", state.count_noise_multiplier),
        ("expected_batch_size", state.expected_batch_size),
    ]
    if state.prev_clipping_norm is None:
        # Before the first step there is no local count: the norm itself must agree.
        fields.append(("clipping_norm", state.clipping_norm))
    check_identical(
        "AdaptiveClipState",
        fields,
        fix="Pass the same initial_clipping_norm, key and hyperparameters to adaptive_clipped_grad on every rank, "
        "call grad_fn once per step on every rank (also for empty batches), and sync(clip_state) once after "
        "every step on every rank.",
    )
    if is_marked_synced(state) or state.prev_clipping_norm is None:
        return state
    total = torch.tensor([state.centered_count], dtype=torch.float64, device=collective_device())
    all_reduce_(total, op="sum")
    centered = float(total.item())
    summed = replace(state, centered_count=centered)
    return mark_synced(replace(summed, clipping_norm=next_norm(summed, centered)))


def sync_gaussian_noise_state(state: Any) -> Any:
    """Checks the noise key and step agree on every rank; returns ``state``."""
    check_identical(
        "GaussianNoiseState",
        [("key", state.key), ("step", state.step)],
        fix="Pass the same key (e.g. key(42)) to gaussian_noise on every rank and call noise_fn once per step on "
        "every rank: different keys or steps make ranks add different noise, so their parameters diverge and "
        "the all-reduced gradient no longer carries one Gaussian draw.",
    )
    return state


def sync_poisson_sampler(sampler: Any) -> Any:
    """Checks rate, length, cursor (and truncation) agree and keys differ; returns the sampler."""
    what = type(sampler).__name__
    rows = check_identical(
        what,
        [
            ("sample_rate", float(sampler.sample_rate)),
            ("n_steps", int(sampler.n_steps)),
            ("next_step", int(sampler.next_step)),
            ("max_batch_size", getattr(sampler, "max_batch_size", None)),
        ],
        fix="Build the sampler with the global sample_rate (expected global batch / global dataset size) and the "
        "same n_steps on every rank, and draw one batch per step on every rank.",
    )
    del rows
    keys = gather_fields(f"{what}.key", [("key", sampler.key)])
    seen: dict[Any, int] = {}
    for rank, (k,) in enumerate(keys):
        if k in seen:
            raise DistributedMismatchError(
                f"{what}.key is identical on ranks {seen[k]} and {rank} ({k!r}). Each rank must sample its shard "
                "with its own key, key=fold_in(key, rank): with one key, the ranks' batches are correlated (the "
                "same positions of every shard are drawn together), which is not the independent Poisson "
                "sampling the accountant assumes."
            )
        seen[k] = rank
    return sampler


def sync_sequential_sampler(sampler: Any) -> Any:
    """Checks batch size, length and cursor agree on every rank; returns the sampler."""
    check_identical(
        type(sampler).__name__,
        [
            ("batch_size", int(sampler.batch_size)),
            ("n_steps", int(sampler.n_steps)),
            ("next_step", int(sampler.next_step)),
            ("drop_last", bool(sampler.drop_last)),
        ],
        fix="Build the sampler with the same batch_size and n_steps on every rank and draw one batch per step on "
        "every rank.",
    )
    return sampler


def sync_clipping_stats(stats: Any) -> Any:
    """Sums ``num_clipped``, ``batch_size`` and ``num_nonfinite`` over ranks; recomputes the rates."""
    per_group = isinstance(stats.num_clipped, dict)
    names = sorted(stats.num_clipped) if per_group else []
    check_identical(
        "ClippingStats",
        [("already synced", is_marked_synced(stats)), ("groups", fingerprint(names) if per_group else None)],
        fix="Use the same clipping function (same groups) on every rank and sync the stats once per step.",
    )
    if is_marked_synced(stats):
        return stats
    clipped = [float(stats.num_clipped[n]) for n in names] if per_group else [float(stats.num_clipped)]
    totals = _sum_floats([*clipped, float(stats.batch_size), float(stats.num_nonfinite)])
    batch = int(round(totals[-2]))
    summed = totals[:-2]
    rate = [(c / batch if batch else 0.0) for c in summed]
    out = replace(
        stats,
        num_clipped=dict(zip(names, summed)) if per_group else summed[0],
        clipping_rate=dict(zip(names, rate)) if per_group else rate[0],
        batch_size=batch,
        num_nonfinite=int(round(totals[-1])),
    )
    return mark_synced(out)


def sync_clipped_grad_aux(aux: Any) -> Any:
    """Gathers the per-example tensors (rank order) and sums the counts over ranks."""
    group_names = sorted(aux.group_norms) if aux.group_norms is not None else None
    check_identical(
        "ClippedGradAux",
        [
            ("already synced", is_marked_synced(aux)),
            ("group names", None if group_names is None else fingerprint(group_names)),
            ("has loss_aux", aux.loss_aux is not None),
            ("has clipping_rate", aux.clipping_rate is not None),
        ],
        fix="Use the same clipping function (same groups, same has_aux) on every rank and sync the aux once per "
        "step.",
    )
    if is_marked_synced(aux):
        return aux
    local_clipped = float(round(aux.clipping_rate * aux.batch_size)) if aux.clipping_rate is not None else 0.0
    clipped, batch, nonfinite = _sum_floats([local_clipped, float(aux.batch_size), float(aux.num_nonfinite)])
    batch_size = int(round(batch))

    def gather(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            raise InputTypeError(
                f"sync(ClippedGradAux) gathers the per-example loss_aux, which must hold tensors; found a "
                f"{type(leaf).__name__}. Return tensors from loss_fn's aux output."
            )
        return gather_for_metrics(leaf)

    out = replace(
        aux,
        loss_values=gather_for_metrics(aux.loss_values),
        grad_norms=gather_for_metrics(aux.grad_norms),
        clipped_grad_norms=gather_for_metrics(aux.clipped_grad_norms),
        loss_aux=None if aux.loss_aux is None else tree_map(gather, aux.loss_aux),
        group_norms=None
        if group_names is None
        else {n: gather_for_metrics(aux.group_norms[n]) for n in group_names},
        clipping_rate=None if aux.clipping_rate is None else (clipped / batch_size if batch_size else 0.0),
        batch_size=batch_size,
        num_nonfinite=int(round(nonfinite)),
    )
    return mark_synced(out)


def _sum_floats(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=collective_device())
    all_reduce_(t, op="sum")
    return t.tolist()
