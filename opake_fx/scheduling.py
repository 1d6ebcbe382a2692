"""Learning-rate schedules: pure functions ``step -> value`` (optax conventions).

A schedule is called with the number of updates already applied (``0`` for the first
update), which is how the optimizers of :mod:`opake_fx.optimizers` call it. Schedules
are small frozen dataclasses: pure, hashable, picklable (DataLoader workers,
checkpoints) and printed with their parameters.

Privacy: a schedule depends on the step count only, never on data; using one is
post-processing and changes no guarantee. (Steps are still steps: a warmup step with a
learning rate of 0 spends as much privacy as any other, so prefer a small nonzero
``init_value`` in :func:`with_warmup` or count the step.)

Example:
    >>> lr = with_warmup(cosine(0.1, decay_steps=900), warmup_steps=100)
    >>> [round(lr(t), 4) for t in (0, 50, 100, 550, 1000)]
    [0.0, 0.05, 0.1, 0.05, 0.0]
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

import opake_fx.validation as check
from opake_fx._typecheck import typechecked
from opake_fx.errors import InputTypeError, InputValueError

__all__ = ["Schedule", "constant", "linear", "cosine", "inverse_sqrt", "with_warmup"]

Schedule = Callable[[int], float]
"""A function from the step count (an int >= 0) to a value."""


@typechecked
def constant(value: Real) -> Schedule:
    """The schedule that is ``value`` at every step.

    Privacy: post-processing; changes no guarantee.

    Example:
        >>> constant(0.1)(1000)
        0.1
    """
    return _Constant(check.finite(value, "value", "constant"))


@typechecked
def linear(init_value: Real, end_value: Real, transition_steps: Integral) -> Schedule:
    """Linear interpolation from ``init_value`` (step 0) to ``end_value`` (step ``transition_steps`` and after).

    ``value(t) = init_value + (end_value - init_value) * min(t, transition_steps) / transition_steps``,
    as ``optax.linear_schedule``.

    Privacy: post-processing; changes no guarantee.

    Example:
        >>> s = linear(1.0, 0.0, transition_steps=4)
        >>> [s(t) for t in (0, 1, 4, 10)]
        [1.0, 0.75, 0.0, 0.0]
    """
    return _Linear(
        check.finite(init_value, "init_value", "linear"),
        check.finite(end_value, "end_value", "linear"),
        check.integer(transition_steps, "transition_steps", "linear", minimum=1),
    )


@typechecked
def cosine(init_value: Real, decay_steps: Integral, alpha: Real = 0.0) -> Schedule:
    """Cosine decay from ``init_value`` to ``alpha * init_value`` over ``decay_steps``, then constant.

    ``value(t) = init_value * ((1 - alpha) * 0.5 * (1 + cos(pi * min(t, decay_steps) / decay_steps)) + alpha)``,
    as ``optax.cosine_decay_schedule`` (Loshchilov & Hutter 2017, without restarts).

    Args:
        init_value: the value at step 0.
        decay_steps: steps until the final value is reached (>= 1).
        alpha: the final value as a fraction of ``init_value`` (in ``[0, 1]``).

    Privacy: post-processing; changes no guarantee.

    Example:
        >>> s = cosine(1.0, decay_steps=10, alpha=0.1)
        >>> [round(s(t), 3) for t in (0, 5, 10, 20)]
        [1.0, 0.55, 0.1, 0.1]
    """
    alpha = check.unit_interval(alpha, "alpha", "cosine", hint="It is the final value as a fraction of init_value.")
    return _Cosine(check.finite(init_value, "init_value", "cosine"), check.integer(decay_steps, "decay_steps", "cosine", minimum=1), alpha)


@typechecked
def inverse_sqrt(init_value: Real, warmup_steps: Integral = 1) -> Schedule:
    """Inverse-square-root decay: ``value(t) = init_value * sqrt(warmup_steps / (t + warmup_steps))``.

    The value is ``init_value`` at step 0 and decays like ``1 / sqrt(t)``, with
    ``warmup_steps`` setting the time scale (the value halves at ``t = 3 * warmup_steps``).
    Combined with a linear warmup of the same length it is the classic
    Transformer / fairseq ``inverse_sqrt`` schedule: ``with_warmup(inverse_sqrt(v, W), W)``
    rises linearly to ``v`` at step ``W`` and is exactly ``v * sqrt(W / t)`` afterwards.
    The default ``warmup_steps=1`` gives ``init_value / sqrt(t + 1)``.

    Privacy: post-processing; changes no guarantee.

    Example:
        >>> s = inverse_sqrt(1.0, warmup_steps=100)
        >>> [s(t) for t in (0, 300)]
        [1.0, 0.5]
        >>> round(with_warmup(s, warmup_steps=100)(400), 6)  # = sqrt(100 / 400)
        0.5
    """
    return _InverseSqrt(check.finite(init_value, "init_value", "inverse_sqrt"), check.integer(warmup_steps, "warmup_steps", "inverse_sqrt", minimum=1))


@typechecked
def with_warmup(schedule: Schedule, warmup_steps: Integral, init_value: Real = 0.0) -> Schedule:
    """Linear warmup from ``init_value`` to ``schedule(0)``, then ``schedule`` shifted by ``warmup_steps``.

    ``value(t) = init_value + (schedule(0) - init_value) * t / warmup_steps`` for
    ``t < warmup_steps`` and ``schedule(t - warmup_steps)`` after; ``warmup_steps=0``
    returns ``schedule`` unchanged. As ``optax.warmup_cosine_decay_schedule``, the first
    step uses ``init_value`` (0 by default).

    Args:
        schedule: any schedule (a callable ``step -> float``), e.g. :func:`cosine`.
        warmup_steps: length of the warmup (>= 0).
        init_value: the value at step 0.

    Privacy: post-processing; changes no guarantee. A step taken with learning rate 0
    still spends privacy, so set a small ``init_value`` rather than waste steps.

    Example:
        >>> s = with_warmup(constant(1.0), warmup_steps=4)
        >>> [s(t) for t in range(6)]
        [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    """
    if not callable(schedule):
        raise InputTypeError(
            f"with_warmup needs a schedule (a callable step -> float, e.g. opake_fx.scheduling.cosine(...)); "
            f"got {type(schedule).__name__}. Wrap a number with constant(value)."
        )
    warmup_steps = check.integer(warmup_steps, "warmup_steps", "with_warmup", minimum=0)
    init_value = check.finite(init_value, "init_value", "with_warmup")
    if warmup_steps == 0:
        return schedule
    return _Warmup(schedule, warmup_steps, init_value)


# --- private helpers ---------------------------------------------------------------


@dataclass(frozen=True)
class _Constant:
    value: float

    def __call__(self, step: int) -> float:
        _step(step, "constant")
        return self.value


@dataclass(frozen=True)
class _Linear:
    init_value: float
    end_value: float
    transition_steps: int

    def __call__(self, step: int) -> float:
        t = min(_step(step, "linear"), self.transition_steps)
        return self.init_value + (self.end_value - self.init_value) * (t / self.transition_steps)


@dataclass(frozen=True)
class _Cosine:
    init_value: float
    decay_steps: int
    alpha: float

    def __call__(self, step: int) -> float:
        t = min(_step(step, "cosine"), self.decay_steps)
        decay = 0.5 * (1.0 + math.cos(math.pi * t / self.decay_steps))
        return self.init_value * ((1.0 - self.alpha) * decay + self.alpha)


@dataclass(frozen=True)
class _InverseSqrt:
    init_value: float
    warmup_steps: int

    def __call__(self, step: int) -> float:
        t = _step(step, "inverse_sqrt")
        return self.init_value * math.sqrt(self.warmup_steps / (t + self.warmup_steps))


@dataclass(frozen=True)
class _Warmup:
    schedule: Schedule
    warmup_steps: int
    init_value: float

    def __call__(self, step: int) -> float:
        t = _step(step, "with_warmup")
        if t < self.warmup_steps:
            peak = float(self.schedule(0))
            return self.init_value + (peak - self.init_value) * (t / self.warmup_steps)
        return float(self.schedule(t - self.warmup_steps))


def _step(step: Any, where: str) -> int:
    """Validates a step: an int (or 0-dim integer tensor) >= 0."""
    if isinstance(step, bool):
        raise InputTypeError(f"{where} schedule needs an int step; got the bool {step!r}.")
    try:
        t = operator.index(step)
    except TypeError:
        raise InputTypeError(
            f"{where} schedule needs an int step (the number of updates applied so far); got {type(step).__name__} {step!r}."
        ) from None
    if t < 0:
        raise InputValueError(f"{where} schedule needs a step >= 0; got {t}.")
    return t

