"""Batch samplers for DP-FTRL: cyclic Poisson, b-min-sep, balls-in-bins and fixed-epoch order.

DP-FTRL's accounting depends on *how often* and *how far apart* an example can
participate, so each sampler here guarantees a participation pattern and names the
accounting that matches it:

==========================  ==========================================  ===================================
sampler                     guarantee                                   accounting (opake_fx.dpftrl.accounting)
==========================  ==========================================  ===================================
:class:`CyclicPoissonSampler`  example in group ``g`` (uniform, keyed);   ``poisson(nm, strategy, sample_rate,``
                            Poisson-sampled at steps ``t = g mod P``    ``partitions=P)``
:class:`MinSepSampler`      participates w.p. ``p`` when available,      ``b_min_sep(nm, strategy, p, b)``
                            then rests ``b - 1`` steps
:class:`BallsInBinsSampler`  example in bin ``J`` (uniform, keyed);     ``balls_in_bins(nm, strategy, b)``
                            every step ``t = J mod b``
:class:`FixedEpochSampler`  a keyed permutation split into ``b``         ``mf_gaussian(nm, strategy, b, k)``
                            batches, the same order for ``k`` epochs    (or ``epochs=k``)
==========================  ==========================================  ===================================

All are ``DataLoader`` batch samplers drawn from an explicit
:class:`~opake_fx.random.RngKey` (never the global RNG): step ``t`` uses
``fold_in(key, t)`` and the group / bin / permutation uses a reserved stream of the
key, so a run is reproducible and resumable from ``state_dict`` (a state saved with another
key is refused: the participation guarantee holds for one key over the run). Iteration is a
cursor over the run: after ``n_steps`` batches ``iter()`` raises instead of starting
over. The cursor, the key, the saved state and the Poisson draw are those of the shared
sampler base :mod:`opake_fx.sampling_base`, as for :class:`opake_fx.dpsgd.sampling.PoissonSampler`.

Example:
    >>> from opake_fx.random import key
    >>> s = CyclicPoissonSampler(100, sample_rate=0.5, partitions=4, n_steps=8, key=key(0))
    >>> len(list(s))
    8
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any, SupportsIndex

import torch
from scipy import special

import opake_fx.validation as check
from opake_fx.errors import InputValueError
from opake_fx.random import RngKey, bits, fold_in, normal
from opake_fx.sampling_base import SAMPLE_RATE_HINT, KeyedSampler, poisson_indices, uniform53
from opake_fx.typing import typechecked

__all__ = ["CyclicPoissonSampler", "MinSepSampler", "BallsInBinsSampler", "FixedEpochSampler", "uniform_groups"]

# Reserved streams of the key (step keys are fold_in(key, t) for t < n_steps < 2**31).
_MAX_STEPS = 2**31 - 1
_GROUP_STREAM = 0xFFFFFFF0
_WARM_STREAM = 0xFFFFFFF1


class _DpftrlSampler(KeyedSampler):
    """The sampler base with DP-FTRL's step limit (the key's reserved streams) and exhaustion message."""

    exhausted_hint = (
        "The strategy and the accounting cover n_steps steps; build a new sampler and strategy for a longer run, "
        "or load_state_dict an earlier state to replay."
    )

    def __init__(self, dataset: Any, n_steps: Any, key: RngKey) -> None:
        super().__init__(dataset, n_steps, key, max_steps=_MAX_STEPS)

    def _parse_cursor(self, state: Any) -> Any:
        # The participation guarantee (groups, bins, rests of min_sep - 1 steps) holds for ONE key over
        # the whole run: the steps already taken were drawn with the key this shard's sampler was built
        # with, so a state carrying another key (another rank's, another run's) would continue a pattern
        # these examples never followed (gaps below min_sep, a second group or bin).
        restore = super()._parse_cursor(state)
        words = state["key"]
        saved = RngKey((int(words[0]), int(words[1])))
        if saved != self.key:
            raise InputValueError(
                f"{type(self).__name__}.load_state_dict: the saved key {saved} differs from this sampler's key "
                f"{self.key}. Its participation guarantee holds for one key over the whole run, so a state saved "
                "with another key (another rank's shard, another run) would break the pattern the accounting "
                "charges. Build the sampler with the key the state was saved with (per rank: fold_in(key, rank), "
                "as DPPlan.sampler does) and load that rank's own state."
            )
        return restore


class _GroupedSampler(_DpftrlSampler):
    """Examples assigned to ``num_groups`` groups uniformly and independently (keyed)."""

    def __init__(self, dataset: Any, n_steps: int, key: RngKey, num_groups: int) -> None:
        super().__init__(dataset, n_steps, key)
        self._num_groups = num_groups
        self._members: list[torch.Tensor] | None = None

    def _reset(self) -> None:
        self._members = None

    def group_members(self, group: int) -> list[int]:
        """The sorted indices assigned to ``group``."""
        return self._groups()[group].tolist()

    def _groups(self) -> list[torch.Tensor]:
        if self._members is None:
            g = uniform_groups(fold_in(self.key, _GROUP_STREAM), self.dataset_size, self._num_groups)
            order = torch.argsort(g, stable=True)
            counts = torch.bincount(g, minlength=self._num_groups).tolist()
            self._members = list(torch.split(order, counts))
        return self._members


class CyclicPoissonSampler(_GroupedSampler):
    """Cyclic Poisson sampling (Choquette-Choo et al. 2023, "Amplified BandMF", Alg. 2).

    Each example is assigned to one of ``partitions`` groups, uniformly and
    independently (keyed); step ``t`` includes each member of group ``t mod partitions``
    independently with probability ``sample_rate``. An example therefore participates
    only at steps ``g, g + P, g + 2P, ...`` of its group ``g`` — at least ``P`` steps apart.

    Args:
        dataset: anything with ``__len__``, or its length.
        sample_rate: per-group inclusion probability ``q`` (expected batch size
            ``q * N / P``; for a target batch ``B`` use ``B * P / N``).
        partitions: ``P``, normally the strategy's number of bands.
        n_steps: number of batches.
        key: the sampler key (``fold_in(key, rank)`` per rank in distributed training).

    Privacy: add-or-remove-one neighbours (the group of an example does not depend on
    the others). Account with ``opake_fx.dpftrl.accounting.poisson(nm, strategy,
    sample_rate, partitions=partitions)`` for a strategy with at most ``partitions``
    bands; with ``partitions=1`` this is DP-SGD's Poisson sampling.

    Example:
        >>> from opake_fx.random import key
        >>> s = CyclicPoissonSampler(1000, sample_rate=0.1, partitions=4, n_steps=8, key=key(1))
        >>> set(s.batch(0)) <= set(s.group_members(0)) and set(s.batch(5)) <= set(s.group_members(1))
        True
    """

    config_fields = ("n_steps", "dataset_size", "sample_rate", "partitions")

    @typechecked
    def __init__(self, dataset: Any, *, sample_rate: Real, partitions: SupportsIndex, n_steps: SupportsIndex, key: RngKey) -> None:
        name = type(self).__name__
        self.sample_rate: float = check.probability(sample_rate, "sample_rate", name, hint=SAMPLE_RATE_HINT)
        self.partitions: int = check.integer(partitions, "partitions", name, minimum=1)
        super().__init__(dataset, n_steps, key, self.partitions)

    @property
    def expected_batch_size(self) -> float:
        """``sample_rate * dataset_size / partitions``."""
        return self.sample_rate * self.dataset_size / self.partitions

    def batch(self, step: int) -> list[int]:
        step = self.checked_step(step)
        members = self._groups()[step % self.partitions]
        idx = poisson_indices(fold_in(self.key, step), int(members.numel()), self.sample_rate)
        return members[idx].tolist()


class BallsInBinsSampler(_GroupedSampler):
    """Balls-in-bins (Chua et al. 2024): each example in a uniformly random bin, used every ``cycle_length`` steps.

    Step ``t`` is the whole bin ``t mod cycle_length``: every example participates at
    ``J, J + b, J + 2b, ...`` for its bin ``J`` (keyed, independent across examples), so
    batch sizes are Binomial(N, 1/b) and each example is seen once per cycle.

    Privacy: add-or-remove-one neighbours. Account with
    ``opake_fx.dpftrl.accounting.balls_in_bins(nm, strategy, cycle_length, key=...)``
    (Monte Carlo), or without amplification as fixed b-min-sep participation
    (``mf_gaussian(nm, strategy, cycle_length, None)``).

    Example:
        >>> from opake_fx.random import key
        >>> s = BallsInBinsSampler(50, cycle_length=5, n_steps=10, key=key(0))
        >>> s.batch(2) == s.batch(7)
        True
    """

    config_fields = ("n_steps", "dataset_size", "cycle_length")

    @typechecked
    def __init__(self, dataset: Any, *, cycle_length: SupportsIndex, n_steps: SupportsIndex, key: RngKey) -> None:
        self.cycle_length: int = check.integer(cycle_length, "cycle_length", type(self).__name__, minimum=1)
        super().__init__(dataset, n_steps, key, self.cycle_length)

    def batch(self, step: int) -> list[int]:
        step = self.checked_step(step)
        return self._groups()[step % self.cycle_length].tolist()


class MinSepSampler(_DpftrlSampler):
    """b-min-sep sampling: an available example joins with probability ``p``, then rests ``b - 1`` steps.

    Two participations of one example are therefore at least ``min_sep`` steps apart
    (the separation banded strategies with ``bands <= min_sep`` need), while every step
    keeps Poisson-like randomness. With ``warm_start`` the sampler starts in its
    stationary state (an example is first available at step 0 w.p. ``1/(1 + (b-1)p)``,
    else at a uniform step of ``1..b-1``), so the batch size is stationary from the
    start (mean ``N p / (1 + (b-1) p)``).

    ``batch(t)`` replays the availability of all examples from step 0 (cached at the
    cursor), so random access costs O(t N).

    Privacy: add-or-remove-one neighbours. Account with
    ``opake_fx.dpftrl.accounting.b_min_sep(nm, strategy, sample_rate, min_sep,
    warm_start=..., key=...)``.

    Example:
        >>> from opake_fx.random import key
        >>> s = MinSepSampler(200, sample_rate=0.5, min_sep=3, n_steps=9, key=key(0))
        >>> b0, b1, b2, b3 = (set(s.batch(t)) for t in range(4))
        >>> b0 & b1 == set() and b0 & b2 == set()
        True
    """

    config_fields = ("n_steps", "dataset_size", "sample_rate", "min_sep", "warm_start")

    @typechecked
    def __init__(
        self, dataset: Any, *, sample_rate: Real, min_sep: SupportsIndex, n_steps: SupportsIndex, key: RngKey, warm_start: bool = False
    ) -> None:
        name = type(self).__name__
        self.sample_rate: float = check.probability(sample_rate, "sample_rate", name, hint=SAMPLE_RATE_HINT)
        self.min_sep: int = check.integer(min_sep, "min_sep", name, minimum=1)
        self.warm_start: bool = check.flag(warm_start, "warm_start", name)
        super().__init__(dataset, n_steps, key)
        self._cache: tuple[int, torch.Tensor] | None = None  # (step, next-available step per example)

    @property
    def expected_batch_size(self) -> float:
        """Stationary mean batch size ``N p / (1 + (b - 1) p)``."""
        p, b = self.sample_rate, self.min_sep
        return self.dataset_size * p / (1.0 + (b - 1) * p)

    def _reset(self) -> None:
        self._cache = None

    def _initial(self) -> torch.Tensor:
        n, b, p = self.dataset_size, self.min_sep, self.sample_rate
        if not self.warm_start or b == 1:
            return torch.zeros(n, dtype=torch.int64)
        u = uniform53(fold_in(self.key, _WARM_STREAM), n)
        start = torch.tensor([1.0] + [p] * (b - 1), dtype=torch.float64) / (1.0 + (b - 1) * p)
        return torch.searchsorted(torch.cumsum(start, 0)[:-1].contiguous(), u, right=True)

    def batch(self, step: int) -> list[int]:
        step = self.checked_step(step)
        if self._cache is None or self._cache[0] > step:
            self._cache = (0, self._initial())
        t, avail = self._cache
        threshold = math.inf if self.sample_rate >= 1.0 else float(special.ndtri(self.sample_rate))
        while True:
            # One keyed standard normal per example: P(z < ndtri(p)) = p exactly, and keyed
            # normals cost ~1000x less than threefry words.
            z = normal(fold_in(self.key, t), (self.dataset_size,), dtype=torch.float64)
            chosen = (avail <= t) & (z < threshold)
            avail = avail.masked_fill(chosen, t + self.min_sep)
            t += 1
            if t == step + 1:
                self._cache = (t, avail)  # the availability before step t
                return torch.nonzero(chosen).reshape(-1).tolist()


class FixedEpochSampler(_DpftrlSampler):
    """Fixed-epoch order (Choquette-Choo et al. 2022): ``k`` passes over one keyed permutation.

    The permutation is split into ``steps_per_epoch`` batches (sizes differ by at most
    one); step ``t`` is batch ``t mod steps_per_epoch``, so every example participates in
    exactly ``epochs`` steps out of ``n_steps = epochs * steps_per_epoch``, exactly
    ``steps_per_epoch`` apart (k-out-of-t participation).

    Privacy: the batches depend on the key and ``N`` only; the analysis treats the
    participation pattern as fixed (zero-out / replace-one neighbours, the standard
    setting of multi-epoch MF). Account with ``mf_gaussian(nm, strategy,
    min_sep=steps_per_epoch, max_participations=epochs)`` or, for dense multi-epoch
    strategies, ``mf_gaussian(nm, strategy, epochs=epochs)`` (and the same arguments
    to ``mf_gaussian_noise``). No amplification.

    Example:
        >>> from opake_fx.random import key
        >>> s = FixedEpochSampler(10, steps_per_epoch=5, epochs=2, key=key(0))
        >>> s.n_steps, s.batch(1) == s.batch(6), sorted(sum((s.batch(t) for t in range(5)), []))
        (10, True, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    """

    config_fields = ("n_steps", "dataset_size", "steps_per_epoch", "epochs")

    @typechecked
    def __init__(self, dataset: Any, *, steps_per_epoch: SupportsIndex, epochs: SupportsIndex, key: RngKey) -> None:
        name = type(self).__name__
        self.steps_per_epoch: int = check.integer(steps_per_epoch, "steps_per_epoch", name, minimum=1)
        self.epochs: int = check.integer(epochs, "epochs", name, minimum=1)
        super().__init__(dataset, self.steps_per_epoch * self.epochs, key)
        if self.steps_per_epoch > self.dataset_size:
            raise InputValueError(
                f"{name}: steps_per_epoch={self.steps_per_epoch} exceeds the dataset size {self.dataset_size}; "
                "some batches would be empty."
            )
        self._perm: list[torch.Tensor] | None = None

    def _reset(self) -> None:
        self._perm = None

    def batch(self, step: int) -> list[int]:
        step = self.checked_step(step)
        if self._perm is None:
            words = bits(fold_in(self.key, _GROUP_STREAM), (self.dataset_size, 2))
            perm = torch.argsort((words[:, 0] << 31) ^ words[:, 1], stable=True)
            self._perm = list(torch.tensor_split(perm, self.steps_per_epoch))
        return sorted(self._perm[step % self.steps_per_epoch].tolist())


@typechecked
def uniform_groups(k: RngKey, n: Integral, num_groups: Integral) -> torch.Tensor:
    """``n`` i.i.d. uniform integers in ``[0, num_groups)`` from ``k`` (exactly uniform: rejection on 32-bit words)."""
    if num_groups == 1:
        return torch.zeros(n, dtype=torch.int64)
    limit = (2**32 // num_groups) * num_groups
    out = torch.empty(n, dtype=torch.int64)
    todo = torch.arange(n)
    round_ = 0
    while todo.numel():
        words = bits(fold_in(k, round_), (n,))[todo]
        ok = words < limit
        out[todo[ok]] = words[ok] % num_groups
        todo = todo[~ok]
        round_ += 1
    return out
