"""Batch samplers for DP-SGD: Poisson, truncated Poisson and sequential.

Privacy amplification by subsampling, which DP-SGD accounting relies on, holds only if
every step includes every example independently with probability ``sample_rate``
(Poisson sampling). :class:`PoissonSampler` draws exactly that, from an explicit
:class:`~opake_fx.random.RngKey`: step ``t`` uses ``fold_in(key, t)``, so a run is
reproducible, resumable (``state_dict``) and never touches the global torch RNG. Batch
sizes vary (Binomial(N, q)) and a batch may be empty; steps are never skipped or
redrawn, because either would change the mechanism the accountant assumes.

Each sampler is a ``torch.utils.data.DataLoader`` ``batch_sampler`` (an iterable of lists
of indices) and exposes what accounting needs: ``sample_rate``, ``n_steps`` and
``dataset_size``. The step cursor, the key and the saved state are those of the shared
sampler base, :mod:`opake_fx.sampling_base` (as for the DP-FTRL samplers).

How a Poisson batch is drawn: the gaps between included indices of independent
Bernoulli(q) trials are i.i.d. Geometric(q), so the sampler draws gaps
``floor(log(u) / log(1 - q))`` from 53-bit uniforms ``u`` built from threefry words
(:func:`opake_fx.random.bits`) and walks through the index range
(:func:`opake_fx.sampling_base.poisson_indices`). The distribution is
that of one independent coin per example (up to float64 rounding, ~1e-16), and a step
costs about ``q * N`` draws instead of ``N``: for N = 60,000 and q = 256/60,000 under a
millisecond, where a per-example ``uniform`` costs ~30 ms. A ``torch.Generator`` seeded
from the key would be as fast but the CPU generator keeps only 32 bits of its seed, so
two steps of a long run could get identical batches.

Example:
    >>> from opake_fx.random import key
    >>> sampler = PoissonSampler(1000, sample_rate=0.01, n_steps=3, key=key(0))
    >>> len(sampler), sampler.dataset_size
    (3, 1000)
    >>> batches = list(sampler)
    >>> all(0 <= i < 1000 for b in batches for i in b)
    True
"""

from __future__ import annotations

from numbers import Real
from typing import Any, SupportsIndex

import torch

import opake_fx.validation as check
from opake_fx.distributed.state_sync import register_sync_type
from opake_fx.distributed.builtin_sync import sync_poisson_sampler, sync_sequential_sampler
from opake_fx.errors import InputValueError
from opake_fx.random import RngKey, bits, fold_in
from opake_fx.sampling_base import SAMPLE_RATE_HINT, KeyedSampler, StepSampler, dataset_length, poisson_indices
from opake_fx.typing import typechecked

__all__ = ["PoissonSampler", "TruncatedPoissonSampler", "SequentialBatchSampler"]

# Step key t = fold_in(key, t). Its Poisson gaps come from fold_in(step_key, c) for chunks
# c = 0, 1, ... (a handful), the truncation subset from this stream: never a chunk index.
_TRUNCATION_STREAM = 0xFFFFFFFF


class PoissonSampler(KeyedSampler):
    """Poisson-subsampled batches: each step includes each index independently with probability ``sample_rate``.

    Use it as ``DataLoader(dataset, batch_sampler=sampler, collate_fn=...)``; the
    collate function must accept empty batches (``opake_fx.functional.empty_collate``).
    In distributed training give each rank its own shard and ``key=fold_in(key, rank)``.

    Iteration is a cursor over the run: each yielded batch advances ``next_step``, and a
    new ``iter()`` resumes where the last one stopped. Once all ``n_steps`` batches have
    been drawn, ``iter()`` raises :class:`~opake_fx.errors.OperationError` instead of
    starting over, because training longer than ``n_steps`` (or reusing the same
    batches) is not what the accountant was told. ``batch(t)`` gives the batch of any
    step without moving the cursor.

    Args:
        dataset: anything with ``__len__``, or the dataset length as an int.
        sample_rate: the probability ``q`` in ``(0, 1]`` that an example is in a batch
            (``expected_batch_size / len(dataset)``).
        n_steps: the number of batches (training steps) to yield.
        key: an :class:`~opake_fx.random.RngKey`; step ``t`` draws from ``fold_in(key, t)``.

    Attributes:
        sample_rate, n_steps, dataset_size, key: as given (``dataset_size = len(dataset)``).

    Privacy: realises Poisson subsampling with rate ``sample_rate``, the sampling that
    ``opake_fx.dpsgd.accounting.poisson(gaussian(nm), sample_rate) * n_steps`` assumes
    (add-or-remove-one neighbours). The batches are a function of the key only, never of
    the data, so they leak nothing beyond what the accountant counts.

    Example:
        >>> import torch
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> from opake_fx.random import key
        >>> ds = TensorDataset(torch.arange(100.0))
        >>> sampler = PoissonSampler(ds, sample_rate=0.1, n_steps=5, key=key(1))
        >>> loader = DataLoader(ds, batch_sampler=sampler)
        >>> sum(1 for _ in loader)
        5
    """

    config_fields = ("sample_rate", "n_steps", "dataset_size")
    exhausted_hint = (
        "Training longer than n_steps is not covered by the accounting made for n_steps. "
        "To run more steps, build a new sampler with a fresh key (e.g. fold_in(key, run)) "
        "and account for them; to replay a run, load_state_dict an earlier state."
    )

    # Counts are SupportsIndex: ints, numpy integers and 0-dim integer tensors (the checks
    # reject bools and non-integer tensors).
    @typechecked
    def __init__(self, dataset: Any, *, sample_rate: Real, n_steps: SupportsIndex, key: RngKey) -> None:
        super().__init__(dataset, n_steps, key)
        self.sample_rate: float = check.probability(sample_rate, "sample_rate", type(self).__name__, hint=SAMPLE_RATE_HINT)

    @property
    def expected_batch_size(self) -> float:
        """``sample_rate * dataset_size``: the mean batch size."""
        return self.sample_rate * self.dataset_size

    def batch(self, step: int) -> list[int]:
        """The sorted indices of step ``step``'s batch (pure: does not move the cursor).

        Privacy: see the class; the batch depends on the key, the step and the sizes only.

        Example:
            >>> from opake_fx.random import key
            >>> s = PoissonSampler(50, sample_rate=0.2, n_steps=2, key=key(3))
            >>> s.batch(1) == list(s)[1]
            True
        """
        return poisson_indices(self.step_key(step), self.dataset_size, self.sample_rate).tolist()


class TruncatedPoissonSampler(PoissonSampler):
    """Poisson sampling with each batch truncated to at most ``max_batch_size`` indices.

    The step first draws the same Poisson batch as :class:`PoissonSampler` with the same
    key; if it has more than ``max_batch_size`` indices, a uniformly random subset of
    ``max_batch_size`` of them (chosen from the step key) is kept. Memory per step is
    then bounded, for fixed-shape or fixed-memory training.

    Args:
        dataset, sample_rate, n_steps, key: as for :class:`PoissonSampler`.
        max_batch_size: the largest batch yielded (an int >= 1). Set it well above
            ``sample_rate * len(dataset)`` so truncation is rare.

    Privacy: truncation changes the mechanism; account for it with
    ``opake_fx.dpsgd.accounting.truncated_poisson(...)`` (it takes ``sample_rate``,
    ``dataset_size`` and ``max_batch_size`` into account), not with the plain ``poisson``
    accountant.

    Example:
        >>> from opake_fx.random import key
        >>> s = TruncatedPoissonSampler(1000, sample_rate=0.5, n_steps=3, key=key(0), max_batch_size=10)
        >>> [len(b) for b in s]
        [10, 10, 10]
    """

    config_fields = (*PoissonSampler.config_fields, "max_batch_size")

    @typechecked
    def __init__(
        self, dataset: Any, *, sample_rate: Real, n_steps: SupportsIndex, key: RngKey, max_batch_size: SupportsIndex
    ) -> None:
        super().__init__(dataset, sample_rate=sample_rate, n_steps=n_steps, key=key)
        self.max_batch_size: int = check.integer(max_batch_size, "max_batch_size", type(self).__name__, minimum=1)

    def batch(self, step: int) -> list[int]:
        """The sorted indices of step ``step``'s truncated batch (pure).

        Privacy: see the class; account with ``truncated_poisson``.
        """
        step_key = self.step_key(step)
        idx = poisson_indices(step_key, self.dataset_size, self.sample_rate)
        if idx.numel() > self.max_batch_size:
            # A uniformly random subset: sort by 63 random bits (ties are ~n^2 / 2**63 likely).
            words = bits(fold_in(step_key, _TRUNCATION_STREAM), (idx.numel(), 2))
            sort_keys = (words[:, 0] << 31) ^ words[:, 1]
            keep = torch.argsort(sort_keys, stable=True)[: self.max_batch_size]
            idx = torch.sort(idx[keep]).values
        return idx.tolist()


class SequentialBatchSampler(StepSampler):
    """In-order batches ``[0, B), [B, 2B), ...`` for evaluation and non-private baselines.

    Args:
        dataset: anything with ``__len__``, or the dataset length as an int.
        batch_size: indices per batch (the last batch of a pass may be shorter).
        n_steps: number of batches; ``None`` means one pass over the data. Larger
            values cycle through the data again (step ``t`` is batch ``t % steps_per_pass``).
        drop_last: drop the short last batch of each pass.

    Iteration resumes from ``next_step`` (see :meth:`state_dict`); after the last step
    the cursor returns to 0, so the sampler can be iterated once per evaluation.

    Attributes:
        sample_rate: ``1.0``: a fixed, data-independent batch order gives no
            amplification, so an accountant reading this attribute must treat every step
            as touching the whole dataset.
        n_steps, dataset_size, batch_size, drop_last, steps_per_pass.

    Privacy: no amplification by subsampling. Training on these batches with noise is
    accounted as an unsampled Gaussian mechanism per step (``sample_rate = 1``).

    Example:
        >>> list(SequentialBatchSampler(5, batch_size=2))
        [[0, 1], [2, 3], [4]]
        >>> list(SequentialBatchSampler(5, batch_size=2, n_steps=4, drop_last=True))
        [[0, 1], [2, 3], [0, 1], [2, 3]]
    """

    sample_rate: float = 1.0
    config_fields = ("batch_size", "n_steps", "dataset_size", "drop_last")
    wraps = True

    @typechecked
    def __init__(
        self, dataset: Any, *, batch_size: SupportsIndex, n_steps: SupportsIndex | None = None, drop_last: bool = False
    ) -> None:
        name = type(self).__name__
        n = dataset_length(dataset, name)
        self.batch_size: int = check.integer(batch_size, "batch_size", name, minimum=1)
        self.drop_last: bool = check.flag(drop_last, "drop_last", name)
        self.steps_per_pass: int = n // self.batch_size if drop_last else -(-n // self.batch_size)
        if self.steps_per_pass == 0:
            raise InputValueError(
                f"{name} has no batches: dataset_size={n}, batch_size={self.batch_size}, "
                f"drop_last={drop_last}. Use a smaller batch_size or drop_last=False."
            )
        super().__init__(n, self.steps_per_pass if n_steps is None else n_steps)

    def batch(self, step: int) -> list[int]:
        """The indices of step ``step``'s batch.

        Privacy: data-independent; no amplification.
        """
        start = (self.checked_step(step) % self.steps_per_pass) * self.batch_size
        return list(range(start, min(start + self.batch_size, self.dataset_size)))


register_sync_type(PoissonSampler, sync_poisson_sampler)  # each sampler's own sync (ranks agree on key, step, rate)
register_sync_type(SequentialBatchSampler, sync_sequential_sampler)
