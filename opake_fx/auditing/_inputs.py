"""Argument checks and conversions shared by the auditing modules (their one home).

Private to :mod:`opake_fx.auditing`: :mod:`~opake_fx.auditing.bounds`,
:mod:`~opake_fx.auditing.single_run` and :mod:`~opake_fx.auditing.two_sample` import
these, so that a bound's ``significance``, its ``delta`` and a resampling ``key`` are
checked, and refused with the same message, wherever they are given.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from opake_fx.errors import InputTypeError, InputValueError

__all__ = ["check_significance", "check_delta", "numpy_rng"]


def check_significance(significance: float, where: str) -> None:
    """Raises InputValueError, naming ``where``, unless ``significance`` is a number in (0, 1).

    ``significance`` is the allowed probability that a lower bound is wrong.
    """
    if not (isinstance(significance, (int, float)) and 0 < significance < 1):
        raise InputValueError(
            f"{where}: significance must be in (0, 1) (the allowed probability that the bound is wrong, e.g. 0.05); "
            f"got {significance!r}."
        )


def check_delta(delta: float, where: str, allow_zero: bool = False) -> None:
    """Raises InputValueError, naming ``where``, unless ``delta`` is a number in (0, 1) ([0, 1) with ``allow_zero``)."""
    ok = isinstance(delta, (int, float)) and (0 <= delta < 1 if allow_zero else 0 < delta < 1)
    if not ok:
        interval = "[0, 1)" if allow_zero else "(0, 1)"
        raise InputValueError(f"{where}: delta must be in {interval} (e.g. 1e-5, the delta you claim); got {delta!r}.")


def numpy_rng(key: Any) -> np.random.Generator:
    """A numpy Generator seeded by the two words of an :func:`opake_fx.random.key` (``None``: ``key(0)``).

    The same key gives the same resampling, so an audit's bootstrap or split is
    reproducible. Raises InputTypeError for anything but an ``RngKey`` or ``None``.
    """
    from opake_fx.random import RngKey, key as make_key

    k = make_key(0) if key is None else key
    if not isinstance(k, RngKey):
        raise InputTypeError(f"key must be an opake_fx.random.key(...); got {type(k).__name__}.")
    return np.random.default_rng(list(k.words))
