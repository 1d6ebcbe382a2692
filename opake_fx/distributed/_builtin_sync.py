"""Built-in sync functions for opake_fx's DP state objects.

Loaded lazily by :func:`opake_fx.distributed.sync` (importing the clipping, noise and
sampling modules from ``opake_fx.distributed`` at import time would make a cycle as soon as
any of them wants a distributed helper). Each function runs only when a process group is
initialised, and issues the same collectives on every rank.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from opake_fx.distributed._checks import check_identical, fingerprint, gather_fields
from opake_fx.distributed._state import is_marked_synced, mark_synced, register_builtin
from opake_fx.distributed._backend import collective_device
from opake_fx.distributed.collectives import all_reduce_
from opake_fx.distributed.metrics import gather_for_metrics
from opake_fx.errors import DistributedMismatchError, InputTypeError
from opake_fx.pytree import tree_map


def register_all() -> None:
    """Registers every built-in sync function (user registrations take precedence)."""
    from opake_fx.dpsgd.clipping.adaptive import AdaptiveClipState
    from opake_fx.dpsgd.clipping.types import ClippedGradAux, ClippingStats, FixedClipState
    from opake_fx.dpsgd.noise import GaussianNoiseState

    register_builtin(FixedClipState, sync_fixed_clip_state)
    register_builtin(AdaptiveClipState, sync_adaptive_clip_state)
    register_builtin(GaussianNoiseState, sync_gaussian_noise_state)
    register_builtin(ClippingStats, sync_clipping_stats)
    register_builtin(ClippedGradAux, sync_clipped_grad_aux)
    from opake_fx.dpsgd.clipping.stage import ClipStageState

    register_builtin(ClipStageState, sync_clip_stage_state)
    try:
        from opake_fx.dpsgd.sampling import PoissonSampler, SequentialBatchSampler
    except ImportError:  # pragma: no cover - samplers are optional at this layer
        return
    register_builtin(PoissonSampler, sync_poisson_sampler)
    register_builtin(SequentialBatchSampler, sync_sequential_sampler)


def sync_clip_stage_state(state: Any) -> Any:
    """Syncs a clip stage's state field by field: the clipping state, then the stats (if any)."""
    from opake_fx.distributed._state import sync

    inner = sync(state.clip_state)
    stats = None if state.stats is None else sync(state.stats)
    return replace(state, clip_state=inner, stats=stats)


def sync_fixed_clip_state(state: Any) -> Any:
    """Checks the clip norm and step agree on every rank; returns ``state``."""
    check_identical(
        "FixedClipState",
        [("clipping_norm", state.clipping_norm), ("step", state.step)],
        fix="Build clipped_grad with the same clipping_norm on every rank and call grad_fn once per step on every "
        "rank, also when the local batch is empty.",
    )
    return state


def sync_adaptive_clip_state(state: Any) -> Any:
    """Sums the local centred counts over ranks and recomputes the next clip norm."""
    from opake_fx.dpsgd.clipping.adaptive import next_clipping_norm

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
    return mark_synced(replace(summed, clipping_norm=next_clipping_norm(summed, centered)))


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
