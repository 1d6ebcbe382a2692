"""Parameter averaging (EMA and Polyak) as a post-processing transform.

Averaging the iterates of noisy SGD removes much of the noise that the last iterate
carries: De et al. (2022, section 3.3) evaluate DP-trained models with an exponential
moving average of the parameters; Polyak & Juditsky (1992) average them uniformly. The
averages are computed from the released parameters alone, so they cost no privacy.

Both are :class:`~opake_fx.transforms.Transform` s over the *parameters* (not the
gradients): after each update, ``avg_params, avg_state = averager.update(params,
avg_state)``; train with ``params``, evaluate with ``avg_params``. The state is a frozen
dataclass, so it checkpoints and resumes with :mod:`opake_fx.serialization` bit for bit.

Example:
    >>> import torch
    >>> avg = ema(0.5, warmup=False)
    >>> p = [torch.zeros(2)]
    >>> s = avg.init(p)
    >>> out, s = avg.update([torch.ones(2)], s)
    >>> out[0].tolist(), s.count
    ([0.5, 0.5], 1)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import opake_fx.validation as check
from opake_fx.errors import InputTypeError
from opake_fx.pipeline_privacy import StagePrivacy
from opake_fx.pytree import tree_map
from opake_fx.transforms import Transform
from opake_fx.typing import typechecked

__all__ = ["AverageState", "ema", "ema_decay_at", "polyak"]


@dataclass(frozen=True)
class AverageState:
    """The running average of the parameters and how many updates it has seen.

    Attributes:
        average: the averaged parameters (a pytree like the parameters).
        count: the number of ``update`` calls so far.
    """

    average: Any
    count: int = 0


_START_HINT = "It counts the updates before averaging starts."


def ema_decay_at(decay: float, count: int, warmup: bool) -> float:
    """The decay of update number ``count`` (from 0): ``decay``, or with warm-up
    ``min(decay, (1 + count) / (10 + count))`` (the schedule of De et al. 2022 and of
    TensorFlow's ``ExponentialMovingAverage(num_updates=...)``), which lets the first
    updates move the average quickly away from the initialisation.

    Example:
        >>> ema_decay_at(0.999, 0, warmup=True), ema_decay_at(0.999, 0, warmup=False)
        (0.1, 0.999)
    """
    return min(decay, (1.0 + count) / (10.0 + count)) if warmup else decay


def _copy(tree: Any) -> Any:
    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, tree)


@typechecked
def ema(decay: float, *, warmup: bool = True, start: int = 0) -> Transform:
    """An exponential moving average of the parameters.

    Update ``t`` (from 0) with parameters ``p``: for ``t < start`` the average is ``p``
    itself (a copy); after that ``avg <- d * avg + (1 - d) * p`` with ``d =
    ema_decay_at(decay, t - start, warmup)``, computed per tensor as ``avg * d + p * (1 - d)``.

    Args:
        decay: in ``[0, 1)``; e.g. 0.999 for thousands of steps, 0.99 for hundreds.
        warmup: use ``min(decay, (1 + n) / (10 + n))`` for the ``n``-th averaged update.
        start: the number of updates before averaging begins.

    Returns:
        A ``Transform``: ``init(params) -> AverageState`` (the average starts at
        ``params``), ``update(params, state) -> (average, state)``.

    Privacy: post-processing of the released parameters; no privacy cost.

    Example:
        >>> import torch
        >>> avg = ema(0.9, warmup=False)
        >>> s = avg.init({"w": torch.zeros(1)})
        >>> for _ in range(2):
        ...     out, s = avg.update({"w": torch.ones(1)}, s)
        >>> round(out["w"].item(), 6)
        0.19
    """
    d0 = check.interval(decay, "decay", "ema", 0.0, 1.0, high_open=True, hint="1 would never move the average.")
    check.integer(start, "start", "ema", minimum=0, hint=_START_HINT)

    def step(average: Any, params: Any, n: int) -> Any:
        d = ema_decay_at(d0, n, warmup)
        return tree_map(lambda a, p: a * d + p.detach() * (1.0 - d), average, params)

    return _averager("ema", start, step, f"EMA of the parameters (decay {d0:g})")


@typechecked
def polyak(*, start: int = 0) -> Transform:
    """The uniform (Polyak-Ruppert) average of the parameters from update ``start`` on.

    Update ``t`` (from 0): for ``t < start`` the average is the parameters; after that, with
    ``n = t - start`` earlier averaged updates, ``avg <- avg + (p - avg) / (n + 1)`` (the
    running mean of the ``n + 1`` parameter values since ``start``).

    Privacy: post-processing of the released parameters; no privacy cost.

    Example:
        >>> import torch
        >>> avg = polyak()
        >>> s = avg.init([torch.zeros(1)])
        >>> for v in (1.0, 2.0, 6.0):
        ...     out, s = avg.update([torch.full((1,), v)], s)
        >>> out[0].item()
        3.0
    """
    check.integer(start, "start", "polyak", minimum=0, hint=_START_HINT)

    def step(average: Any, params: Any, n: int) -> Any:
        return tree_map(lambda a, p: a + (p.detach() - a) / (n + 1), average, params)

    return _averager("polyak", start, step, "Polyak average of the parameters")


def _averager(name: str, start: int, step: Callable[[Any, Any, int], Any], description: str) -> Transform:
    """The averaging transform both averages share: the parameters themselves (a copy) for
    updates before ``start``, then ``step(average, params, n)`` with ``n`` the number of
    updates averaged so far (``t - start``)."""

    def init(params: Any) -> AverageState:
        return AverageState(_copy(params), 0)

    def update(params: Any, state: AverageState, _params: Any = None, **extra: Any) -> tuple[Any, AverageState]:
        _check_state(state, name)
        t = state.count
        average = _copy(params) if t < start else step(state.average, params, t - start)
        return average, AverageState(average, t + 1)

    return Transform(init, update, StagePrivacy("optimizer", description))


def _check_state(state: Any, name: str) -> None:
    if not isinstance(state, AverageState):
        raise InputTypeError(f"{name}.update needs the AverageState from {name}(...).init(params); got {type(state).__name__}.")
