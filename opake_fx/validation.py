"""Argument checks shared by the whole library: the one home of "is this a valid number?".

Every checker takes the value, the argument's ``name`` and ``where`` (the public function
or class the user called), and returns the value converted to a plain Python ``float``,
``int`` or ``bool``. A value of the wrong type raises
:class:`~opake_fx.errors.InputTypeError`, a value out of range
:class:`~opake_fx.errors.InputValueError` (both are :class:`~opake_fx.errors.OpakeError`
and also a ``TypeError`` / ``ValueError``). The message names the function, the
argument, the bad value and what to pass instead; ``hint`` appends the fix that only
the caller knows (e.g. "use batch_size / len(dataset)")::

    PoissonSampler: sample_rate must be in (0, 1]; got 1.5. It is the probability ...

Conventions every checker follows:

- bools are never numbers (``True`` is rejected where an int or a float is expected),
  and NaN is never a valid real;
- integers may be Python ints, numpy integers or anything with ``__index__`` (a 0-dim
  integer tensor), never floats, bools or bool tensors;
- infinity is rejected unless the checker says otherwise (``allow_inf``);
- a NaN fails every range, so its message names the range expected (``real`` alone
  says "is NaN").

The module imports neither torch nor numpy, so the torch-free accounting modules use it
too.

Privacy: these checks guard public parameters (sample rates, noise multipliers, step
counts). A privacy-relevant value that fails one is an error, never a warning or a
silent correction, because a corrected value is not the one the accountant was told.

Example:
    >>> from opake_fx import validation as check
    >>> check.positive(0.5, "noise_multiplier", "gaussian")
    0.5
    >>> check.integer(3, "n_steps", "PoissonSampler", minimum=1)
    3
    >>> check.probability(0.0, "sample_rate", "poisson", hint="Use batch_size / len(dataset).")
    Traceback (most recent call last):
    ...
    opake_fx.errors.InputValueError: poisson: sample_rate must be in (0, 1]; got 0. Use batch_size / len(dataset).
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Collection
from typing import Any

from opake_fx.errors import InputTypeError, InputValueError

__all__ = [
    "real",
    "finite",
    "positive",
    "non_negative",
    "interval",
    "unit_interval",
    "probability",
    "delta",
    "integer",
    "flag",
    "choice",
]


def real(value: object, name: str, where: str, hint: str = "") -> float:
    """``value`` as a float; rejects bools, non-numbers (strings, complex, tensors) and NaN.

    Infinity passes: use :func:`finite`, :func:`positive` or :func:`non_negative` where it
    must not.

    Args:
        value: the argument to check.
        name: the argument's name, as the user wrote it.
        where: the public function or class that received it.
        hint: what to pass instead (appended to the message).

    Returns:
        ``float(value)``.

    Raises:
        InputTypeError: ``value`` is not a real number (or is a bool).
        InputValueError: ``value`` is NaN.

    Example:
        >>> real(2, "alpha", "cosine")
        2.0
        >>> real("x", "alpha", "cosine")
        Traceback (most recent call last):
        ...
        opake_fx.errors.InputTypeError: cosine: alpha must be a real number; got str ('x').
    """
    out = _number(value, name, where, hint)
    if math.isnan(out):
        raise InputValueError(f"{where}: {name} is NaN; pass a finite number.{_sp(hint)}")
    return out


def finite(value: object, name: str, where: str, hint: str = "") -> float:
    """A finite float (any sign).

    Example:
        >>> finite(-1, "end_value", "linear")
        -1.0
        >>> finite(float("inf"), "end_value", "linear")
        Traceback (most recent call last):
        ...
        opake_fx.errors.InputValueError: linear: end_value must be finite; got inf.
    """
    out = _number(value, name, where, hint)
    if not math.isfinite(out):
        raise InputValueError(f"{where}: {name} must be finite; got {_shown(out)}.{_sp(hint)}")
    return out


def positive(value: object, name: str, where: str, hint: str = "", *, allow_inf: bool = False) -> float:
    """A float > 0 (finite unless ``allow_inf``).

    Example:
        >>> positive(0, "noise_multiplier", "gaussian", hint="Calibrate it with calibrate().")
        Traceback (most recent call last):
        ...
        opake_fx.errors.InputValueError: gaussian: noise_multiplier must be finite and > 0; got 0.0. Calibrate it with calibrate().
    """
    out = _number(value, name, where, hint)
    if not (out > 0 and (allow_inf or out < math.inf)):
        bound = "> 0" if allow_inf else "finite and > 0"
        raise InputValueError(f"{where}: {name} must be {bound}; got {_shown(out)}.{_sp(hint)}")
    return out


def non_negative(value: object, name: str, where: str, hint: str = "", allow_inf: bool = False) -> float:
    """A float >= 0 (finite unless ``allow_inf``).

    Example:
        >>> non_negative(0.0, "weight_decay", "adamw")
        0.0
    """
    out = _number(value, name, where, hint)
    if not (out >= 0 and (allow_inf or out < math.inf)):
        bound = "a number >= 0" if allow_inf else "finite and >= 0"
        raise InputValueError(f"{where}: {name} must be {bound}; got {_shown(out)}.{_sp(hint)}")
    return out


def interval(
    value: object,
    name: str,
    where: str,
    low: float,
    high: float,
    *,
    low_open: bool = False,
    high_open: bool = False,
    hint: str = "",
) -> float:
    """A float in the interval from ``low`` to ``high`` (each end closed unless ``*_open``).

    Example:
        >>> interval(0.5, "confidence", "monte_carlo", 0.0, 1.0, low_open=True, high_open=True)
        0.5
        >>> interval(1.0, "confidence", "monte_carlo", 0.0, 1.0, low_open=True, high_open=True)
        Traceback (most recent call last):
        ...
        opake_fx.errors.InputValueError: monte_carlo: confidence must be in (0, 1); got 1.
    """
    out = _number(value, name, where, hint)
    above = out > low if low_open else out >= low
    below = out < high if high_open else out <= high
    if not (above and below):
        left, right = "(" if low_open else "[", ")" if high_open else "]"
        raise InputValueError(
            f"{where}: {name} must be in {left}{low:g}, {high:g}{right}; got {_shown(out, 'g')}.{_sp(hint)}"
        )
    return out


def unit_interval(value: object, name: str, where: str, hint: str = "") -> float:
    """A float in the closed interval [0, 1].

    Example:
        >>> unit_interval(1, "lambda_", "lambda_cgd_strategy")
        1.0
    """
    return interval(value, name, where, 0.0, 1.0, hint=hint)


def probability(value: object, name: str, where: str, hint: str = "") -> float:
    """A probability in (0, 1]: a sample rate, which 0 would make a run without data.

    Example:
        >>> probability(1, "sample_rate", "PoissonSampler")
        1.0
    """
    return interval(value, name, where, 0.0, 1.0, low_open=True, hint=hint)


def delta(value: object, where: str, name: str = "delta") -> float:
    """A delta in the open interval (0, 1), with the usual scale in the message.

    Example:
        >>> delta(1e-5, "epsilon_budget")
        1e-05
    """
    out = _number(value, name, where)
    if not 0.0 < out < 1.0:
        raise InputValueError(
            f"{where}: {name} must be in the open interval (0, 1); got {_shown(out)}. "
            "Typical values are well below 1/dataset_size, e.g. 1e-5."
        )
    return out


def integer(
    value: object, name: str, where: str, minimum: int | None = None, hint: str = "", *, maximum: int | None = None
) -> int:
    """An int, at least ``minimum`` and at most ``maximum`` where given.

    Python and numpy integers and anything with ``__index__`` (a 0-dim integer tensor)
    pass; bools, bool tensors and floats (even ``2.0``) are rejected.

    Example:
        >>> integer(0, "next_step", "PoissonSampler.load_state_dict", minimum=0)
        0
        >>> integer(2.0, "n_steps", "PoissonSampler", minimum=1)
        Traceback (most recent call last):
        ...
        opake_fx.errors.InputTypeError: PoissonSampler: n_steps must be an int >= 1; got float (2.0).
    """
    out = _as_index(value)
    if out is None:
        kind = "an int" if minimum is None else f"an int >= {minimum}"
        raise InputTypeError(f"{where}: {name} must be {kind}; got {type(value).__name__} ({value!r}).{_sp(hint)}")
    if minimum is not None and out < minimum:
        raise InputValueError(f"{where}: needs {name} >= {minimum}; got {out}.{_sp(hint)}")
    if maximum is not None and out > maximum:
        raise InputValueError(f"{where}: needs {name} <= {maximum}; got {out}.{_sp(hint)}")
    return out


def flag(value: object, name: str, where: str) -> bool:
    """A bool (``0``/``1`` and other truthy values are rejected: a switch is said explicitly).

    Example:
        >>> flag(True, "drop_last", "SequentialBatchSampler")
        True
    """
    if not isinstance(value, bool):
        raise InputTypeError(f"{where}: {name} must be a bool (True or False); got {type(value).__name__} ({value!r}).")
    return value


def choice(value: Any, name: str, where: str, options: Collection[Any], hint: str = "") -> Any:
    """``value`` if it is one of ``options``.

    Example:
        >>> choice("sum", "reduction", "blt_strategy", ("sum", "max"))
        'sum'
        >>> choice("mean", "reduction", "blt_strategy", ("sum", "max"))
        Traceback (most recent call last):
        ...
        opake_fx.errors.InputValueError: blt_strategy: reduction must be one of ('sum', 'max'); got 'mean'.
    """
    try:
        ok = value in options
    except TypeError:  # an unhashable value looked up in a set
        ok = False
    if not ok:
        raise InputValueError(f"{where}: {name} must be one of {tuple(options)}; got {value!r}.{_sp(hint)}")
    return value


def _number(value: object, name: str, where: str, hint: str = "") -> float:
    # The type check of every real-valued checker; NaN passes here and fails each range.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InputTypeError(
            f"{where}: {name} must be a real number; got {type(value).__name__} ({value!r}).{_sp(hint)}"
        )
    return float(value)


def _shown(value: float, spec: str = "") -> str:
    # NaN is spelled as such, so that the message says plainly what went wrong.
    return "NaN" if math.isnan(value) else format(value, spec)


def _as_index(value: object) -> int | None:
    if isinstance(value, bool) or "bool" in str(getattr(value, "dtype", "")):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def _sp(hint: str) -> str:
    return f" {hint}" if hint else ""
