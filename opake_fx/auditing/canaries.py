"""Canaries: which dataset slots hold them, which are trained on, and what they look like.

A *coin flip* picks ``num_canaries`` slots of the dataset and includes each by a fair
coin from an explicit key. The run trains on every ordinary example and on the
included canaries only; :class:`CanarySampler` (or :meth:`CoinFlip.train_indices`)
does the bookkeeping, so the normal samplers and pipeline run unchanged.

Two kinds of canaries:

* input-space: real-looking examples the model would not fit by chance, e.g.
  :func:`mislabel` (a wrong label) or :func:`out_of_distribution` (a random input);
  scored by :func:`~opake_fx.auditing.loss_scores` or
  :func:`~opake_fx.auditing.gradient_scores`;
* gradient-space (Dirac): examples whose gradient is a fixed vector ``-norm * sign *
  e_coordinate`` whatever the model (:class:`DiracCanaries`); scored by the coordinate
  of the total update. The strongest and cheapest audit of the mechanism (clipping,
  noise, sampling) itself.

Calibrate the plan on the dataset *including* the canary slots (``dataset_size`` =
examples + canaries): the sample rate and the accountant then describe the run that
the canaries are in.

Example:
    >>> from opake_fx.random import key
    >>> flip = coin_flip(10, 4, key(0))
    >>> flip.canary_indices.tolist(), int(flip.included.sum())
    ([1, 3, 7, 9], 3)
    >>> flip.train_indices(10).tolist()   # the excluded canary (slot 7) is left out
    [0, 1, 2, 3, 4, 5, 6, 8, 9]
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from opake_fx.errors import InputTypeError, InputValueError

__all__ = ["CoinFlip", "coin_flip", "CanarySampler", "DiracCanaries", "dirac_canaries", "mislabel",
           "out_of_distribution"]


@dataclass(frozen=True)
class CoinFlip:
    """The canary slots of a dataset and the coin of each (``True``: trained on).

    Attributes:
        dataset_size: the number of slots (ordinary examples + canaries).
        canary_indices: int64 ``[m]``, sorted dataset slots of the canaries.
        included: bool ``[m]``, the coins, aligned with ``canary_indices``.
    """

    dataset_size: int
    canary_indices: np.ndarray
    included: np.ndarray

    @property
    def num_canaries(self) -> int:
        return int(self.canary_indices.size)

    @property
    def excluded_indices(self) -> np.ndarray:
        """The slots of the canaries left out of training."""
        return self.canary_indices[~self.included]

    def train_indices(self, n: int) -> np.ndarray:
        """The slots in ``range(n)`` that are trained on: all but the excluded canaries.

        Args:
            n: the length of the indexable dataset (normally ``dataset_size``).
        """
        if not isinstance(n, (int, np.integer)) or n < self.dataset_size:
            raise InputValueError(
                f"CoinFlip.train_indices: n={n!r} is smaller than the dataset_size={self.dataset_size} the canaries "
                "were placed in; give the length of the dataset that holds the canary slots."
            )
        keep = np.ones(int(n), dtype=bool)
        keep[self.excluded_indices] = False
        return np.flatnonzero(keep)

    def sampler(self, inner: Any) -> "CanarySampler":
        """Wraps a batch sampler over all ``dataset_size`` slots so excluded canaries never appear."""
        return CanarySampler(inner, self)


def coin_flip(dataset_size: int, num_canaries: int, key: Any, candidate_indices: Sequence[int] | None = None) -> CoinFlip:
    """Chooses ``num_canaries`` canary slots and a fair coin for each, from ``key``.

    Args:
        dataset_size: slots in the dataset (ordinary examples + canaries).
        num_canaries: m.
        key: an :func:`opake_fx.random.key`; the slots and the coins come from two
            halves of ``split(key)``, so the same key gives the same canaries.
        candidate_indices: where canaries may go (default: every slot). When it has
            exactly ``num_canaries`` entries those are the slots.

    Privacy contract: the coins are fair and independent of each other and of the
    training randomness (use a key not used elsewhere); the one-run bounds rest on it.

    Raises:
        InputValueError: too few candidates, a candidate outside the dataset, a
            duplicate, or ``num_canaries < 1``.
    """
    from opake_fx.random import RngKey, split, uniform

    if not isinstance(key, RngKey):
        raise InputTypeError(f"coin_flip needs key=opake_fx.random.key(seed); got {type(key).__name__}.")
    if not isinstance(dataset_size, (int, np.integer)) or dataset_size < 1:
        raise InputValueError(f"coin_flip: dataset_size must be a positive int; got {dataset_size!r}.")
    if not isinstance(num_canaries, (int, np.integer)) or num_canaries < 1:
        raise InputValueError(f"coin_flip: num_canaries must be a positive int; got {num_canaries!r}.")
    cands = np.arange(dataset_size) if candidate_indices is None else np.asarray(candidate_indices, dtype=np.int64)
    if cands.ndim != 1 or (cands.size and (cands.min() < 0 or cands.max() >= dataset_size)):
        raise InputValueError(f"coin_flip: candidate_indices must be slots in [0, {dataset_size}); got values "
                              f"outside it.")
    if np.unique(cands).size != cands.size:
        raise InputValueError("coin_flip: candidate_indices has duplicates; a slot can hold one canary.")
    if cands.size < num_canaries:
        raise InputValueError(f"coin_flip: {num_canaries} canaries need at least that many candidate slots; got "
                              f"{cands.size}.")
    k_slots, k_coins = split(key)
    if cands.size == num_canaries:
        slots = np.sort(cands)
    else:
        draw = uniform(k_slots, (cands.size,), dtype=_f64()).numpy()
        slots = np.sort(cands[np.argsort(draw, kind="stable")[:num_canaries]])
    coins = uniform(k_coins, (num_canaries,), dtype=_f64()).numpy() < 0.5
    return CoinFlip(dataset_size=int(dataset_size), canary_indices=slots.astype(np.int64), included=coins)


class CanarySampler:
    """A batch sampler that drops the excluded canaries from each batch of ``inner``.

    ``inner`` samples all ``dataset_size`` slots (e.g. ``plan.sampler(range(N), key)``).
    Dropping a slot from every batch is training on the dataset without it: under
    Poisson sampling the remaining examples keep their rate, so the accountant of the
    plan describes the run for every included example and canary.
    """

    def __init__(self, inner: Any, flip: CoinFlip) -> None:
        if not isinstance(flip, CoinFlip):
            raise InputTypeError(f"CanarySampler needs a CoinFlip; got {type(flip).__name__}.")
        self.inner = inner
        self.flip = flip
        self._excluded = frozenset(int(i) for i in flip.excluded_indices)

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.inner:
            yield [int(i) for i in batch if int(i) not in self._excluded]

    def __len__(self) -> int:
        return len(self.inner)


@dataclass(frozen=True)
class DiracCanaries:
    """Gradient-space canaries: canary ``j`` has loss ``-norm * signs[j] * theta[coordinates[j]]``.

    Its gradient is ``-norm * signs[j] * e_{coordinates[j]}`` at every parameter value
    (norm ``norm``; set it above the clip norm so a correct pipeline clips it to C), and
    gradient descent moves ``theta[coordinates[j]]`` by ``+signs[j]`` times its clipped
    contribution. The canaries live in one flat parameter vector of ``size`` entries
    (an extra parameter the model does not read is best: no ordinary gradient lands on
    it, so the audit sees the mechanism's noise alone).

    Attributes:
        coordinates: int64 ``[m]``, distinct entries of the vector.
        signs: float64 ``[m]``, +1 or -1.
        norm: the canaries' gradient norm.
        size: the length of the parameter vector.
    """

    coordinates: np.ndarray
    signs: np.ndarray
    norm: float
    size: int

    def loss(self, vector: Any, which: Any) -> Any:
        """The canary loss of one example: ``which`` is its one-hot ``[m]`` row (zeros for an ordinary example).

        Works per example under ``torch.func.vmap`` (what the clipping stage runs).
        """
        import torch

        signs = torch.as_tensor(self.signs, dtype=vector.dtype, device=vector.device)
        picked = vector[torch.as_tensor(self.coordinates, device=vector.device)]
        return -self.norm * (which.to(vector.dtype) * signs * picked).sum()

    def scores(self, update: Any) -> np.ndarray:
        """``-<grad_j, update> / norm`` for each canary: ``signs * update[coordinates]`` (float64 ``[m]``)."""
        u = np.asarray(update.detach().cpu().double().numpy() if hasattr(update, "detach") else update,
                       dtype=np.float64).reshape(-1)
        if u.size != self.size:
            raise InputValueError(f"DiracCanaries.scores: the update has {u.size} entries, the canary vector {self.size}.")
        return self.signs * u[self.coordinates]


def dirac_canaries(num_canaries: int, key: Any, *, norm: float, size: int | None = None) -> DiracCanaries:
    """``num_canaries`` Dirac canaries on distinct coordinates of a vector of ``size`` (default ``num_canaries``).

    Example:
        >>> from opake_fx.random import key
        >>> d = dirac_canaries(3, key(1), norm=10.0)
        >>> sorted(d.coordinates.tolist()), d.norm
        ([0, 1, 2], 10.0)
    """
    from opake_fx.random import RngKey, split, uniform

    if not isinstance(key, RngKey):
        raise InputTypeError(f"dirac_canaries needs key=opake_fx.random.key(seed); got {type(key).__name__}.")
    size = num_canaries if size is None else size
    if not (1 <= num_canaries <= size):
        raise InputValueError(f"dirac_canaries: need 1 <= num_canaries <= size; got {num_canaries}, {size}.")
    if not (isinstance(norm, (int, float)) and norm > 0 and np.isfinite(norm)):
        raise InputValueError(f"dirac_canaries: norm must be finite and > 0 (above the clip norm); got {norm!r}.")
    k_pos, k_sign = split(key)
    coords = np.argsort(uniform(k_pos, (size,), dtype=_f64()).numpy(), kind="stable")[:num_canaries]
    signs = np.where(uniform(k_sign, (num_canaries,), dtype=_f64()).numpy() < 0.5, 1.0, -1.0)
    return DiracCanaries(coordinates=coords.astype(np.int64), signs=signs, norm=float(norm), size=int(size))


def mislabel(labels: Any, flip: CoinFlip, num_classes: int, key: Any) -> Any:
    """Input-space canaries: a copy of ``labels`` with every canary slot given a different, random class.

    Example:
        >>> import torch
        >>> from opake_fx.random import key
        >>> flip = coin_flip(6, 2, key(0), candidate_indices=[1, 4])
        >>> y = torch.zeros(6, dtype=torch.int64)
        >>> out = mislabel(y, flip, 3, key(2))
        >>> bool((out[[1, 4]] != 0).all()), out[[0, 2, 3, 5]].tolist()
        (True, [0, 0, 0, 0])
    """
    import torch

    from opake_fx.random import uniform

    _check_rows(labels, flip, "mislabel")
    if num_classes < 2:
        raise InputValueError(f"mislabel needs num_classes >= 2; got {num_classes}.")
    shift = 1 + np.floor(uniform(key, (flip.num_canaries,), dtype=_f64()).numpy() * (num_classes - 1)).astype(np.int64)
    out = labels.clone()
    idx = torch.as_tensor(flip.canary_indices)
    out[idx] = (labels[idx] + torch.as_tensor(shift, dtype=labels.dtype)) % num_classes
    return out


def out_of_distribution(inputs: Any, flip: CoinFlip, key: Any, *, scale: float | None = None) -> Any:
    """Input-space canaries: a copy of ``inputs`` with every canary slot replaced by Gaussian noise.

    ``scale`` defaults to the inputs' standard deviation.
    """
    import torch

    from opake_fx.random import normal

    _check_rows(inputs, flip, "out_of_distribution")
    s = float(inputs.float().std()) if scale is None else float(scale)
    out = inputs.clone()
    shape = (flip.num_canaries, *inputs.shape[1:])
    out[torch.as_tensor(flip.canary_indices)] = (s * normal(key, shape, dtype=torch.float32)).to(inputs.dtype)
    return out


def _check_rows(x: Any, flip: CoinFlip, where: str) -> None:
    if not isinstance(flip, CoinFlip):
        raise InputTypeError(f"{where} needs the CoinFlip of the run; got {type(flip).__name__}.")
    if len(x) != flip.dataset_size:
        raise InputValueError(f"{where}: the tensor has {len(x)} rows, the coin flip {flip.dataset_size} slots; "
                              "canary slots index the whole dataset.")


def _f64() -> Any:
    import torch

    return torch.float64
