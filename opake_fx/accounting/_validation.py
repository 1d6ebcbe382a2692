"""Argument checks shared by the accounting modules (private).

Every check raises an :class:`~opake_fx.errors.InputTypeError` for a value of the wrong
type and an :class:`~opake_fx.errors.InputValueError` for a value out of range, with a
message that names the argument, the function, what was received and what to pass.
"""

from __future__ import annotations

import math
import numbers

from opake_fx.errors import InputTypeError, InputValueError


def real(value: object, name: str, where: str) -> float:
    """``value`` as a float; rejects bools, strings, complex numbers and NaN."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InputTypeError(
            f"{where}: {name} must be a real number; got {type(value).__name__} ({value!r})."
        )
    out = float(value)
    if math.isnan(out):
        raise InputValueError(f"{where}: {name} is NaN; pass a finite number.")
    return out


def positive(value: object, name: str, where: str, hint: str = "") -> float:
    """A finite float > 0."""
    out = real(value, name, where)
    if not (out > 0 and math.isfinite(out)):
        raise InputValueError(f"{where}: {name} must be finite and > 0; got {out}.{_sp(hint)}")
    return out


def non_negative(value: object, name: str, where: str, hint: str = "", allow_inf: bool = False) -> float:
    """A float >= 0 (finite unless ``allow_inf``)."""
    out = real(value, name, where)
    if out < 0 or (math.isinf(out) and not allow_inf):
        bound = "a number >= 0" if allow_inf else "finite and >= 0"
        raise InputValueError(f"{where}: {name} must be {bound}; got {out}.{_sp(hint)}")
    return out


def unit_interval(value: object, name: str, where: str, hint: str = "") -> float:
    """A float in the closed interval [0, 1]."""
    out = real(value, name, where)
    if not 0.0 <= out <= 1.0:
        raise InputValueError(f"{where}: {name} must be in [0, 1]; got {out}.{_sp(hint)}")
    return out


def delta(value: object, where: str, name: str = "delta") -> float:
    """A delta in the open interval (0, 1)."""
    out = real(value, name, where)
    if not 0.0 < out < 1.0:
        raise InputValueError(
            f"{where}: {name} must be in the open interval (0, 1); got {out}. "
            "Typical values are well below 1/dataset_size, e.g. 1e-5."
        )
    return out


def integer(value: object, name: str, where: str, minimum: int, hint: str = "") -> int:
    """An int >= ``minimum`` (numpy integers accepted, bools and floats rejected)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InputTypeError(
            f"{where}: {name} must be an int >= {minimum}; got {type(value).__name__} ({value!r})."
            f"{_sp(hint)}"
        )
    out = int(value)
    if out < minimum:
        raise InputValueError(f"{where}: {name} must be >= {minimum}; got {out}.{_sp(hint)}")
    return out


def _sp(hint: str) -> str:
    return f" {hint}" if hint else ""
