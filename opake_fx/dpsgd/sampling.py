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
``dataset_size``.

How a Poisson batch is drawn: the gaps between included indices of independent
Bernoulli(q) trials are i.i.d. Geometric(q), so the sampler draws gaps
``floor(log(u) / log(1 - q))`` from 53-bit uniforms ``u`` built from threefry words
(:func:`opake_fx.random.bits`) and walks through the index range. The distribution is
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

import math
import operator
from numbers import Integral, Real
from typing import Any, Iterator, Mapping, SupportsIndex

import torch
from torch.utils.data import Sampler

from opake_fx.errors import InputTypeError, InputValueError, OperationError
from opake_fx.random import RngKey, bits, fold_in
from opake_fx.typing import typechecked

__all__ = ["PoissonSampler", "TruncatedPoissonSampler", "SequentialBatchSampler"]

# Step key t = fold_in(key, t). Its Poisson gaps come from fold_in(step_key, c) for chunks
# c = 0, 1, ... (a handful), the truncation subset from this stream: never a chunk index.
_TRUNCATION_STREAM = 0xFFFFFFFF


class PoissonSampler(Sampler[list[int]]):
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

    # Counts are SupportsIndex: ints, numpy integers and 0-dim integer tensors (the checks
    # below reject bools and non-integer tensors).
    @typechecked
    def __init__(self, dataset: Any, *, sample_rate: Real, n_steps: SupportsIndex, key: RngKey) -> None:
        name = type(self).__name__
        self.dataset_size: int = _dataset_size(dataset, name)
        self.sample_rate: float = _check_sample_rate(sample_rate, name)
        self.n_steps: int = _check_count(n_steps, "n_steps", name, minimum=1)
        self.key: RngKey = key  # type-checked by the constructor (a clear error with the fix)
        self._next_step = 0

    @property
    def next_step(self) -> int:
        """The step whose batch the next ``next()`` yields (``n_steps`` when exhausted)."""
        return self._next_step

    @property
    def expected_batch_size(self) -> float:
        """``sample_rate * dataset_size``: the mean batch size."""
        return self.sample_rate * self.dataset_size

    def __len__(self) -> int:
        return self.n_steps

    def __iter__(self) -> Iterator[list[int]]:
        if self._next_step >= self.n_steps:
            raise OperationError(
                f"{type(self).__name__} has already yielded all n_steps={self.n_steps} batches. "
                "Training longer than n_steps is not covered by the accounting made for n_steps. "
                "To run more steps, build a new sampler with a fresh key (e.g. fold_in(key, run)) "
                "and account for them; to replay a run, load_state_dict an earlier state."
            )
        return self._iterate()

    def batch(self, step: int) -> list[int]:
        """The sorted indices of step ``step``'s batch (pure: does not move the cursor).

        Privacy: see the class; the batch depends on the key, the step and the sizes only.

        Example:
            >>> from opake_fx.random import key
            >>> s = PoissonSampler(50, sample_rate=0.2, n_steps=2, key=key(3))
            >>> s.batch(1) == list(s)[1]
            True
        """
        return _poisson_indices(self._step_key(step), self.dataset_size, self.sample_rate).tolist()

    def state_dict(self) -> dict[str, Any]:
        """The key, the next step and the configuration (plain Python values).

        Save it next to the model; :meth:`load_state_dict` on a sampler built with the
        same configuration resumes with exactly the same batches. With a ``DataLoader``
        that has ``num_workers > 0``, the loader prefetches batches, so the cursor runs
        ahead of training: record the step your loop completed and restore with
        ``load_state_dict({**sd, "next_step": completed_steps})``.

        Example:
            >>> from opake_fx.random import key
            >>> s = PoissonSampler(10, sample_rate=0.5, n_steps=4, key=key(0))
            >>> it = iter(s); _ = next(it)
            >>> s.state_dict()["next_step"]
            1
        """
        return {
            "key": list(self.key.words),
            "next_step": self._next_step,
            "sample_rate": self.sample_rate,
            "n_steps": self.n_steps,
            "dataset_size": self.dataset_size,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores the key and the next step saved by :meth:`state_dict`.

        Raises :class:`~opake_fx.errors.InputValueError` if the saved configuration
        (``sample_rate``, ``n_steps``, ``dataset_size``, ...) differs from this sampler's:
        a resumed run with another configuration is a different mechanism from the one
        that was accounted for.
        """
        name = type(self).__name__
        if not isinstance(state, Mapping):
            raise InputTypeError(f"{name}.load_state_dict needs the dict from state_dict(); got {type(state).__name__}.")
        expected = self.state_dict()
        missing = sorted(set(expected) - set(state))
        if missing:
            raise InputValueError(
                f"{name}.load_state_dict: the state lacks {missing}; pass the dict returned by state_dict()."
            )
        for field in expected:
            if field in ("key", "next_step"):
                continue
            if state[field] != expected[field]:
                raise InputValueError(
                    f"{name}.load_state_dict: the saved {field}={state[field]!r} differs from this sampler's "
                    f"{field}={expected[field]!r}. Build the sampler with the saved configuration; resuming "
                    "with another one changes the mechanism the accountant assumed."
                )
        words = state["key"]
        try:
            new_key = RngKey((int(words[0]), int(words[1])))
        except (TypeError, IndexError, ValueError) as exc:
            raise InputValueError(f"{name}.load_state_dict: invalid key {words!r}; expected [hi, lo].") from exc
        next_step = _check_count(state["next_step"], "next_step", f"{name}.load_state_dict", minimum=0)
        if next_step > self.n_steps:
            raise InputValueError(
                f"{name}.load_state_dict: next_step={next_step} is beyond n_steps={self.n_steps}."
            )
        self.key = new_key
        self._next_step = next_step

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(dataset_size={self.dataset_size}, sample_rate={self.sample_rate}, "
            f"n_steps={self.n_steps}, key={self.key!r}, next_step={self._next_step})"
        )

    def _step_key(self, step: int) -> RngKey:
        step = _check_count(step, "step", f"{type(self).__name__}.batch", minimum=0)
        if step >= self.n_steps:
            raise InputValueError(
                f"{type(self).__name__}.batch(step) needs 0 <= step < n_steps={self.n_steps}; got {step}."
            )
        return fold_in(self.key, step)

    def _iterate(self) -> Iterator[list[int]]:
        while self._next_step < self.n_steps:
            step = self._next_step
            out = self.batch(step)
            # Advance before yielding: once the caller holds batch t, the state says t + 1.
            self._next_step = step + 1
            yield out


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

    @typechecked
    def __init__(
        self, dataset: Any, *, sample_rate: Real, n_steps: SupportsIndex, key: RngKey, max_batch_size: SupportsIndex
    ) -> None:
        super().__init__(dataset, sample_rate=sample_rate, n_steps=n_steps, key=key)
        self.max_batch_size: int = _check_count(max_batch_size, "max_batch_size", type(self).__name__, minimum=1)

    def batch(self, step: int) -> list[int]:
        """The sorted indices of step ``step``'s truncated batch (pure).

        Privacy: see the class; account with ``truncated_poisson``.
        """
        step_key = self._step_key(step)
        idx = _poisson_indices(step_key, self.dataset_size, self.sample_rate)
        if idx.numel() > self.max_batch_size:
            # A uniformly random subset: sort by 63 random bits (ties are ~n^2 / 2**63 likely).
            words = bits(fold_in(step_key, _TRUNCATION_STREAM), (idx.numel(), 2))
            sort_keys = (words[:, 0] << 31) ^ words[:, 1]
            keep = torch.argsort(sort_keys, stable=True)[: self.max_batch_size]
            idx = torch.sort(idx[keep]).values
        return idx.tolist()

    def state_dict(self) -> dict[str, Any]:
        """As :meth:`PoissonSampler.state_dict`, plus ``max_batch_size``."""
        return {**super().state_dict(), "max_batch_size": self.max_batch_size}

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", max_batch_size={self.max_batch_size})"


class SequentialBatchSampler(Sampler[list[int]]):
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

    @typechecked
    def __init__(
        self, dataset: Any, *, batch_size: SupportsIndex, n_steps: SupportsIndex | None = None, drop_last: bool = False
    ) -> None:
        name = type(self).__name__
        self.dataset_size: int = _dataset_size(dataset, name)
        self.batch_size: int = _check_count(batch_size, "batch_size", name, minimum=1)
        if not isinstance(drop_last, bool):
            raise InputTypeError(f"{name} needs drop_last to be a bool; got {type(drop_last).__name__}.")
        self.drop_last = drop_last
        if drop_last:
            self.steps_per_pass = self.dataset_size // self.batch_size
        else:
            self.steps_per_pass = -(-self.dataset_size // self.batch_size)
        if self.steps_per_pass == 0:
            raise InputValueError(
                f"{name} has no batches: dataset_size={self.dataset_size}, batch_size={self.batch_size}, "
                f"drop_last={drop_last}. Use a smaller batch_size or drop_last=False."
            )
        if n_steps is None:
            self.n_steps = self.steps_per_pass
        else:
            self.n_steps = _check_count(n_steps, "n_steps", name, minimum=1)
        self._next_step = 0

    @property
    def next_step(self) -> int:
        """The step whose batch the next ``next()`` yields."""
        return self._next_step

    def __len__(self) -> int:
        return self.n_steps

    def __iter__(self) -> Iterator[list[int]]:
        while self._next_step < self.n_steps:
            step = self._next_step
            out = self.batch(step)
            self._next_step = step + 1 if step + 1 < self.n_steps else 0
            yield out
            if self._next_step == 0:
                return

    def batch(self, step: int) -> list[int]:
        """The indices of step ``step``'s batch.

        Privacy: data-independent; no amplification.
        """
        step = _check_count(step, "step", f"{type(self).__name__}.batch", minimum=0)
        if step >= self.n_steps:
            raise InputValueError(
                f"{type(self).__name__}.batch(step) needs 0 <= step < n_steps={self.n_steps}; got {step}."
            )
        start = (step % self.steps_per_pass) * self.batch_size
        return list(range(start, min(start + self.batch_size, self.dataset_size)))

    def state_dict(self) -> dict[str, Any]:
        """The next step and the configuration (plain Python values)."""
        return {
            "next_step": self._next_step,
            "batch_size": self.batch_size,
            "n_steps": self.n_steps,
            "dataset_size": self.dataset_size,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores the next step saved by :meth:`state_dict` (the configuration must match)."""
        name = type(self).__name__
        if not isinstance(state, Mapping):
            raise InputTypeError(f"{name}.load_state_dict needs the dict from state_dict(); got {type(state).__name__}.")
        expected = self.state_dict()
        for field in expected:
            if field not in state:
                raise InputValueError(f"{name}.load_state_dict: the state lacks {field!r}.")
            if field != "next_step" and state[field] != expected[field]:
                raise InputValueError(
                    f"{name}.load_state_dict: the saved {field}={state[field]!r} differs from this sampler's "
                    f"{expected[field]!r}; build the sampler with the saved configuration."
                )
        next_step = _check_count(state["next_step"], "next_step", f"{name}.load_state_dict", minimum=0)
        if next_step >= self.n_steps:
            raise InputValueError(f"{name}.load_state_dict: next_step={next_step} must be below n_steps={self.n_steps}.")
        self._next_step = next_step

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(dataset_size={self.dataset_size}, batch_size={self.batch_size}, "
            f"n_steps={self.n_steps}, drop_last={self.drop_last}, next_step={self._next_step})"
        )


# --- private helpers ---------------------------------------------------------------


def _poisson_indices(k: RngKey, n: int, q: float) -> torch.Tensor:
    """Sorted int64 indices in ``[0, n)``, each included independently with probability ``q``.

    ``k`` is the step key.

    Walks the index range with i.i.d. Geometric(q) gaps (the failures before each
    success of Bernoulli(q) trials). Gaps come in chunks; chunk ``c`` uses
    ``fold_in(k, c)``, and chunk sizes depend only on ``(n, q)``, so the result is a
    function of ``(k, n, q)``.
    """
    if n == 0:
        return torch.zeros(0, dtype=torch.int64)
    if q >= 1.0:
        return torch.arange(n, dtype=torch.int64)
    log1m_q = math.log1p(-q)
    mean = q * n
    chunk = int(mean + 8.0 * math.sqrt(mean) + 16)
    found: list[torch.Tensor] = []
    start = 0  # the first index not yet decided
    c = 0
    while start < n:
        words = bits(fold_in(k, c), (chunk, 2))
        # A 53-bit uniform in (0, 1]: P(u <= x) = floor(x * 2**53) / 2**53.
        u = ((words[:, 0] >> 5) * 67108864 + (words[:, 1] >> 6) + 1).double() / 9007199254740992.0
        # P(gap >= g) = P(u <= (1 - q)**g) = (1 - q)**g; clamp so that cumsum cannot overflow.
        gaps = torch.floor(torch.log(u) / log1m_q).clamp(max=n).to(torch.int64)
        positions = start + torch.cumsum(gaps + 1, 0) - 1
        found.append(positions[positions < n])
        start = int(positions[-1]) + 1
        c += 1
    return torch.cat(found)


def _dataset_size(dataset: Any, where: str) -> int:
    if isinstance(dataset, bool):
        raise InputTypeError(f"{where} needs a dataset (anything with __len__) or its length as an int; got a bool.")
    if isinstance(dataset, Integral):
        n = int(dataset)
    else:
        try:
            n = len(dataset)
        except TypeError as exc:
            raise InputTypeError(
                f"{where} needs a dataset with __len__ or its length as an int; got {type(dataset).__name__}, "
                "which has no length. Pass len(dataset) (an int) if you know it."
            ) from exc
    if n < 0:
        raise InputValueError(f"{where} needs a dataset length >= 0; got {n}.")
    return n


def _check_sample_rate(q: Any, where: str) -> float:
    if isinstance(q, bool) or not isinstance(q, Real):
        raise InputTypeError(
            f"{where} needs sample_rate to be a float in (0, 1]; got {type(q).__name__}. "
            "It is the probability each example is in a batch: use batch_size / len(dataset)."
        )
    q = float(q)
    if not (0.0 < q <= 1.0):
        raise InputValueError(
            f"sample_rate must be in (0, 1]; got {q:g}. It is the probability each example is in a batch: "
            "use batch_size / len(dataset)."
        )
    return q


def _check_count(value: Any, name: str, where: str, *, minimum: int) -> int:
    if isinstance(value, bool):
        raise InputTypeError(f"{where} needs {name} to be an int; got the bool {value!r}.")
    if not isinstance(value, Integral):
        try:
            value = operator.index(value)  # 0-dim integer tensors
        except TypeError:
            raise InputTypeError(f"{where} needs {name} to be an int; got {type(value).__name__} {value!r}.") from None
    value = int(value)
    if value < minimum:
        raise InputValueError(f"{where} needs {name} >= {minimum}; got {value}.")
    return value
