"""What a plan's sampling part owns: its batches, its participation pattern, its amplification.

A sampling part is the object behind ``DPPlan(sampling=...)``. It checks the plan fields
it uses (and is the one to name when a field is given that it does not use), builds the
batch sampler of a rank's shard, states the :class:`~opake_fx.planning.participation.Participation`
pattern the noise is scaled to, and, for the amplified schemes, turns one unamplified
opportunity (the mechanism's Gaussian) into its subsampled :class:`~opake_fx.accounting.DpProcess`.

Three kinds of accounting (:attr:`SamplingScheme.accounting`) tell which mechanisms a
scheme goes with:

* :data:`EVERY_STEP`: every step is one amplified opportunity (Poisson, truncated
  Poisson): DP-SGD's per-step composition.
* :data:`CYCLIC`: the data split into ``bands`` groups, one amplified opportunity every
  ``bands`` steps (Amplified BandMF): a banded strategy with at most ``bands`` bands.
* :data:`MIN_SEPARATION`: no amplification; participations at least ``min_sep`` steps
  apart, so the whole run is one Gaussian mechanism over that pattern.
"""

from __future__ import annotations

from typing import Any, ClassVar

from opake_fx.errors import InputValueError
from opake_fx.planning.fields import PlanFields
from opake_fx.planning.participation import Participation
from opake_fx.random import RngKey

__all__ = ["SamplingScheme", "EVERY_STEP", "CYCLIC", "MIN_SEPARATION", "OffsetSampler", "shard_sampler"]

EVERY_STEP = "every_step"
"""Accounting kind: one amplified opportunity per step."""
CYCLIC = "cyclic"
"""Accounting kind: one amplified opportunity every ``bands`` steps."""
MIN_SEPARATION = "min_separation"
"""Accounting kind: unamplified, participations ``min_sep`` apart (the whole run is one mechanism)."""


class SamplingScheme:
    """The base of a plan's sampling parts (closed: the library's parts are registered in
    :mod:`opake_fx.planning.samplers`).

    A subclass sets :attr:`name` and :attr:`accounting`, and overrides :meth:`build`
    and, for an amplified kind, :meth:`amplify`; the defaults are those of one
    opportunity every step from the whole dataset.

    Privacy contract: :meth:`build` must draw batches whose participation pattern is
    :meth:`participation` and whose subsampling is the one :meth:`amplify` charges, each
    example's draws depending only on its own keyed randomness (so the union of the ranks'
    shards is the scheme over the whole dataset).
    """

    name: ClassVar[str]
    accounting: ClassVar[str]
    uses_min_sep: ClassVar[bool] = False
    uses_max_batch_size: ClassVar[bool] = False
    needs_bands: ClassVar[bool] = False

    def min_sep_message(self) -> str:
        """The error when a plan with this scheme is given no ``min_sep`` (schemes that use it)."""
        return (f"DPPlan(sampling={self.name!r}) needs min_sep: the fewest steps between two participations of one "
                "example (for balls_in_bins: the number of bins, dataset_size / batch_size).")

    def default_batch_size(self, dataset_size: int, min_sep: int | None) -> float | None:
        """The expected batch size when the plan gives neither it nor the sample rate (None: required)."""
        return None

    def check(self, plan: PlanFields, batch_size: float) -> None:
        """Checks the plan's resolved sizes against this scheme (e.g. ``min_sep`` or ``bands``
        against the dataset); raises ``InputValueError`` naming the fields."""

    def participation(self, plan: PlanFields) -> Participation:
        """The pattern the noise is scaled to and the accounting charges: by default one
        participation per step, amplified."""
        return Participation(plan.steps, 1, 1, amplified=True)

    def build(self, plan: PlanFields, shard: range, key: RngKey, world_size: int) -> Any:
        """The batch sampler of one rank's ``shard`` (indices into the shard), keyed by ``key``."""
        raise NotImplementedError

    def amplify(self, plan: PlanFields, opportunity: Any) -> Any:
        """The subsampled :class:`~opake_fx.accounting.DpProcess` of one ``opportunity`` (an
        unamplified mechanism) under this scheme (amplified kinds only)."""
        raise InputValueError(f"DPPlan: sampling={self.name!r} has no per-opportunity amplification.")

    def has_opportunity(self, plan: PlanFields, step: int) -> bool:
        """Whether ``step`` is an opportunity of the worst-placed example (amplified kinds)."""
        return True

    def opportunities(self, plan: PlanFields, steps: int) -> int:
        """The opportunities among the first ``steps`` steps (amplified kinds)."""
        return steps

    def largest_batch(self, plan: PlanFields) -> int:
        """The largest batch the sampler can draw (what padding buckets must reach)."""
        return plan.dataset_size

    def join_rate(self, plan: PlanFields) -> float:
        """The probability that an available example joins a batch (b-min-sep only)."""
        raise InputValueError("DPPlan.participation_rate: only a sampling='b_min_sep' plan has one.")


class OffsetSampler:
    """A batch sampler over a shard ``range(start, stop)``, yielding indices of the whole dataset.

    What :meth:`DPPlan.sampler <opake_fx.plan.DPPlan.sampler>` returns on a rank whose
    shard does not start at 0, and for ``user_sampling="examples"`` (``indices``: the
    examples kept by the per-user cap, so position ``i`` of the kept examples is
    ``indices[i]`` of the dataset); every other attribute (``state_dict``, ``key``,
    ``n_steps``, ...) is the shard's sampler's.

    Example:
        >>> sampler = OffsetSampler([[0, 2], [1]], start=10)
        >>> list(sampler), len(sampler)
        ([[10, 12], [11]], 2)
        >>> list(OffsetSampler([[0, 1]], start=1, indices=[3, 5, 8]))
        [[5, 8]]
    """

    def __init__(self, inner: Any, start: int, indices: Any = None) -> None:
        self.inner, self.start, self.indices = inner, start, indices

    def __iter__(self) -> Any:
        for batch in self.inner:
            yield self._whole(batch)

    def __len__(self) -> int:
        return len(self.inner)

    def batch(self, step: int) -> list[int]:
        """Step ``step``'s batch, as indices of the whole dataset."""
        return self._whole(self.inner.batch(step))

    def _whole(self, batch: Any) -> list[int]:
        if self.indices is None:
            return [self.start + i for i in batch]
        return [self.indices[self.start + i] for i in batch]

    def __getattr__(self, name: str) -> Any:  # state_dict, key, n_steps, ... of the shard's sampler
        if name in ("inner", "start", "indices"):  # not set yet (e.g. while unpickling): not the shard's
            raise AttributeError(name)
        return getattr(self.inner, name)


def shard_sampler(sampler: Any) -> Any:
    """The shard's own sampler of one ``DPPlan.sampler`` (which offsets it on ranks > 0).

    Example:
        >>> shard_sampler(OffsetSampler([[0]], start=5))
        [[0]]
    """
    return sampler.inner if isinstance(sampler, OffsetSampler) else sampler
