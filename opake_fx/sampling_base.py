"""The sampler base: the cursor, key and resumable state that every batch sampler shares.

The DP-SGD samplers (:mod:`opake_fx.dpsgd.sampling`) and the DP-FTRL samplers
(:mod:`opake_fx.dpftrl.sampling`) differ only in *which* indices step ``t`` holds.
Everything else lives here, once:

- **the step cursor**: a sampler is a ``DataLoader`` ``batch_sampler`` over a fixed
  number of steps ``n_steps``. Each yielded batch advances :attr:`~StepSampler.next_step`
  and a new ``iter()`` resumes where the last one stopped. A sampler made for private
  training refuses to start over once all ``n_steps`` batches have been drawn
  (:class:`~opake_fx.errors.OperationError`), because steps beyond ``n_steps`` are not
  what the accountant was told; an evaluation sampler (``wraps = True``) returns to
  step 0 instead. ``batch(t)`` gives any step's batch without moving the cursor;
- **the key** (:class:`KeyedSampler`): step ``t`` draws from ``fold_in(key, t)``, so a run
  is a function of the key and never touches the global torch RNG;
- **the saved state**: :meth:`~StepSampler.state_dict` is the cursor (the key's two words
  and ``next_step``) followed by the configuration fields a subclass lists in
  ``config_fields``; :meth:`~StepSampler.load_state_dict` refuses a state whose
  configuration differs (a resumed run with another configuration is another mechanism)
  and drops caches derived from the key when the key changes;
- **empty batches**: a random batch may be empty; it is yielded as ``[]``, never
  skipped or redrawn (either would change the mechanism the accounting assumes), so the
  collate function must accept it (``opake_fx.functional.empty_collate``).
  :func:`poisson_indices` of an empty range is empty.

A new sampler subclasses :class:`KeyedSampler` (or :class:`StepSampler` for a
data-independent order), lists its configuration in ``config_fields`` and implements
``batch(step)``, starting with ``self.step_key(step)`` (or ``self.checked_step(step)``).

Example:
    >>> from opake_fx.random import key
    >>> class EveryOther(KeyedSampler):
    ...     '''Step t: the even indices when the step key's first word is even, else the odd ones.'''
    ...     config_fields = ("n_steps", "dataset_size")
    ...     def batch(self, step):
    ...         parity = self.step_key(step).words[0] % 2
    ...         return list(range(parity, self.dataset_size, 2))
    >>> s = EveryOther(6, n_steps=2, key=key(0))
    >>> len(list(s)), s.next_step, sorted(s.state_dict())
    (2, 2, ['dataset_size', 'key', 'n_steps', 'next_step'])
"""

from __future__ import annotations

import math
from numbers import Integral
from typing import Any, ClassVar, Iterator, Mapping

import torch
from torch.utils.data import Sampler

import opake_fx.validation as check
from opake_fx.errors import InputTypeError, InputValueError, OperationError
from opake_fx.random import RngKey, bits, fold_in

__all__ = ["StepSampler", "KeyedSampler", "dataset_length", "poisson_indices", "uniform53", "SAMPLE_RATE_HINT"]

SAMPLE_RATE_HINT = "It is the probability each example is in a batch: use batch_size / len(dataset)."
"""The fix every sampler's ``sample_rate`` check names (``opake_fx.validation.probability(..., hint=...)``)."""


class StepSampler(Sampler[list[int]]):
    """A batch sampler that is a cursor over ``n_steps`` steps of a dataset of ``dataset_size`` examples.

    Subclasses set ``config_fields`` (the attributes saved after the cursor in
    :meth:`state_dict` and compared on :meth:`load_state_dict`, in that order) and
    implement :meth:`batch`.

    Args:
        dataset: anything with ``__len__``, or the dataset length as an int.
        n_steps: the number of batches (an int >= 1).
        max_steps: the largest ``n_steps`` the subclass supports (``None``: no limit).

    Attributes:
        dataset_size, n_steps: as given (``dataset_size = len(dataset)``).
        wraps: class attribute. ``False`` (the default, for private training): after
            ``n_steps`` batches ``iter()`` raises. ``True``: the cursor returns to 0.
        exhausted_hint: class attribute, the end of the message ``iter()`` raises with
            once all batches were drawn (what to do instead).

    Privacy: the base draws nothing; it guarantees that a sampler yields exactly the
    ``n_steps`` batches it was configured for, once (unless ``wraps``), and that a
    resumed sampler has the configuration it was saved with.
    """

    config_fields: ClassVar[tuple[str, ...]] = ("n_steps", "dataset_size")
    wraps: ClassVar[bool] = False
    exhausted_hint: ClassVar[str] = (
        "Training longer than n_steps is not covered by the accounting made for n_steps. "
        "Build a new sampler and account for the extra steps, or load_state_dict an earlier state to replay."
    )

    def __init__(self, dataset: Any, n_steps: Any, *, max_steps: int | None = None) -> None:
        name = type(self).__name__
        self.dataset_size: int = dataset_length(dataset, name)
        hint = "" if max_steps is None else "Larger runs would reach the streams the sampler reserves in its key."
        self.n_steps: int = check.integer(n_steps, "n_steps", name, minimum=1, maximum=max_steps, hint=hint)
        self._next_step = 0

    @property
    def next_step(self) -> int:
        """The step whose batch the next ``next()`` yields (``n_steps`` once exhausted, unless ``wraps``)."""
        return self._next_step

    def __len__(self) -> int:
        return self.n_steps

    def __iter__(self) -> Iterator[list[int]]:
        if self._next_step >= self.n_steps:
            raise OperationError(
                f"{type(self).__name__} has already yielded all n_steps={self.n_steps} batches. {self.exhausted_hint}"
            )
        return self._iterate()

    def _iterate(self) -> Iterator[list[int]]:
        while self._next_step < self.n_steps:
            step = self._next_step
            out = self.batch(step)
            last = step + 1 == self.n_steps
            # Advance before yielding: once the caller holds batch t, the state says t + 1.
            self._next_step = 0 if (last and self.wraps) else step + 1
            yield out
            if last:
                return

    def batch(self, step: int) -> list[int]:
        """The indices of step ``step``'s batch (pure: does not move the cursor)."""
        raise NotImplementedError(f"{type(self).__name__} must implement batch(step)")

    def checked_step(self, step: Any) -> int:
        """``step`` as an int in ``[0, n_steps)``; raises an :class:`~opake_fx.errors.OpakeError` otherwise.

        Example:
            >>> from opake_fx.dpsgd.sampling import SequentialBatchSampler
            >>> SequentialBatchSampler(4, batch_size=2).checked_step(2)
            Traceback (most recent call last):
            ...
            opake_fx.errors.InputValueError: SequentialBatchSampler.batch(step) needs 0 <= step < n_steps=2; got 2.
        """
        name = type(self).__name__
        step = check.integer(step, "step", f"{name}.batch", minimum=0)
        if step >= self.n_steps:
            raise InputValueError(f"{name}.batch(step) needs 0 <= step < n_steps={self.n_steps}; got {step}.")
        return step

    def state_dict(self) -> dict[str, Any]:
        """The cursor and the configuration (plain Python values).

        Save it next to the model; :meth:`load_state_dict` on a sampler built with the
        same configuration resumes with exactly the same batches. With a ``DataLoader``
        that has ``num_workers > 0``, the loader prefetches batches, so the cursor runs
        ahead of training: record the step your loop completed and restore with
        ``load_state_dict({**sd, "next_step": completed_steps})``.
        """
        return {**self._cursor_state(), **{f: getattr(self, f) for f in self.config_fields}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores the cursor saved by :meth:`state_dict`.

        Raises :class:`~opake_fx.errors.InputValueError` if a field is missing or the
        saved configuration differs from this sampler's: a resumed run with another
        configuration is a different mechanism from the one that was accounted for.
        Nothing changes when it raises.
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
        for field in self.config_fields:
            if state[field] != expected[field]:
                raise InputValueError(
                    f"{name}.load_state_dict: the saved {field}={state[field]!r} differs from this sampler's "
                    f"{field}={expected[field]!r}. Build the sampler with the saved configuration; resuming "
                    "with another one changes the mechanism the accountant assumed."
                )
        restore = self._parse_cursor(state)
        last = self.n_steps - 1 if self.wraps else self.n_steps
        next_step = check.integer(state["next_step"], "next_step", f"{name}.load_state_dict", minimum=0)
        if next_step > last:
            raise InputValueError(
                f"{name}.load_state_dict: next_step={next_step} is beyond "
                f"{'the last step ' + str(last) if self.wraps else 'n_steps=' + str(self.n_steps)}."
            )
        restore()
        self._next_step = next_step

    def __repr__(self) -> str:
        fields = [f"{f}={getattr(self, f)!r}" for f in self.config_fields if f != "dataset_size"]
        cursor = [f"{k}={v!r}" for k, v in self._repr_cursor()]
        return f"{type(self).__name__}(dataset_size={self.dataset_size}, {', '.join(fields + cursor)})"

    # --- what KeyedSampler extends ---

    def _cursor_state(self) -> dict[str, Any]:
        return {"next_step": self._next_step}

    def _parse_cursor(self, state: Mapping[str, Any]) -> Any:
        """Validates the saved cursor beyond ``next_step``; returns the function that applies it."""
        return lambda: None

    def _repr_cursor(self) -> list[tuple[str, Any]]:
        return [("next_step", self._next_step)]


class KeyedSampler(StepSampler):
    """A :class:`StepSampler` whose batches are drawn from an :class:`~opake_fx.random.RngKey`.

    Step ``t`` draws from ``step_key(t) = fold_in(key, t)``; a subclass that derives
    more from the key (a permutation, group assignments) caches it and drops the cache
    in :meth:`_reset`, which :meth:`load_state_dict` calls when the saved key differs.

    Args:
        dataset, n_steps, max_steps: as for :class:`StepSampler`.
        key: the sampler's key (``fold_in(key, rank)`` per rank in distributed training).

    Privacy: the batches are a function of the key, the step and public sizes only,
    never of the data, so they leak nothing beyond what the accountant counts.
    """

    def __init__(self, dataset: Any, n_steps: Any, key: RngKey, *, max_steps: int | None = None) -> None:
        super().__init__(dataset, n_steps, max_steps=max_steps)
        if not isinstance(key, RngKey):
            raise InputTypeError(
                f"{type(self).__name__} needs key to be an RngKey (opake_fx.random.key(seed)); got {type(key).__name__}."
            )
        self.key: RngKey = key

    def step_key(self, step: Any) -> RngKey:
        """``fold_in(key, step)`` for a valid step (checked as :meth:`checked_step`)."""
        return fold_in(self.key, self.checked_step(step))

    def _reset(self) -> None:
        """Drops caches derived from the key (nothing here)."""

    def _cursor_state(self) -> dict[str, Any]:
        return {"key": list(self.key.words), "next_step": self._next_step}

    def _parse_cursor(self, state: Mapping[str, Any]) -> Any:
        words = state["key"]
        try:
            new_key = RngKey((int(words[0]), int(words[1])))
        except (TypeError, IndexError, ValueError) as exc:
            raise InputValueError(
                f"{type(self).__name__}.load_state_dict: invalid key {words!r}; expected [hi, lo]."
            ) from exc

        def restore() -> None:
            if new_key != self.key:
                self.key = new_key
                self._reset()

        return restore

    def _repr_cursor(self) -> list[tuple[str, Any]]:
        return [("key", self.key), ("next_step", self._next_step)]


def dataset_length(dataset: Any, where: str) -> int:
    """``len(dataset)``, or ``dataset`` itself when it is an int (a length >= 0).

    Example:
        >>> dataset_length(range(5), "PoissonSampler"), dataset_length(7, "PoissonSampler")
        (5, 7)
    """
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


def poisson_indices(k: RngKey, n: int, q: float) -> torch.Tensor:
    """Sorted int64 indices in ``[0, n)``, each included independently with probability ``q``.

    ``k`` is the step key. Walks the index range with i.i.d. Geometric(q) gaps (the
    failures before each success of Bernoulli(q) trials): the distribution is that of one
    independent coin per example (up to float64 rounding, ~1e-16), at a cost of about
    ``q * n`` draws instead of ``n``. Gaps come in chunks; chunk ``c`` uses
    ``fold_in(k, c)``, and chunk sizes depend only on ``(n, q)``, so the result is a
    function of ``(k, n, q)``. An empty range gives an empty batch.

    Privacy: Poisson subsampling with rate ``q``; the indices depend on the key and the
    sizes only.

    Example:
        >>> from opake_fx.random import key
        >>> poisson_indices(key(0), 0, 0.5).tolist(), poisson_indices(key(0), 3, 1.0).tolist()
        ([], [0, 1, 2])
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
        # A 53-bit uniform in (0, 1]: P(u <= x) = floor(x * 2**53) / 2**53.
        u = uniform53(fold_in(k, c), chunk, open_at_zero=True)
        # P(gap >= g) = P(u <= (1 - q)**g) = (1 - q)**g; clamp so that cumsum cannot overflow.
        gaps = torch.floor(torch.log(u) / log1m_q).clamp(max=n).to(torch.int64)
        positions = start + torch.cumsum(gaps + 1, 0) - 1
        found.append(positions[positions < n])
        start = int(positions[-1]) + 1
        c += 1
    return torch.cat(found)


def uniform53(k: RngKey, n: int, *, open_at_zero: bool = False) -> torch.Tensor:
    """``n`` float64 uniforms with 53 random bits each, in ``[0, 1)`` (or ``(0, 1]`` with ``open_at_zero``).

    Example:
        >>> from opake_fx.random import key
        >>> u = uniform53(key(0), 1000)
        >>> bool(((u >= 0) & (u < 1)).all())
        True
    """
    words = bits(k, (n, 2))
    ints = (words[:, 0] >> 5) * 67108864 + (words[:, 1] >> 6)
    if open_at_zero:
        ints = ints + 1
    return ints.double() / 9007199254740992.0
