"""Type aliases (jaxtyping) and the runtime type checker used on public functions.

``typechecked`` is beartype configured to raise :class:`~opake_fx.errors.InputTypeError`
(a ``TypeError``), so a wrongly typed argument gets the library's error type with
beartype's precise message (which parameter, what was expected, what came).

Example:
    >>> from opake_fx.typing import typechecked
    >>> @typechecked
    ... def twice(x: int) -> int:
    ...     return 2 * x
    >>> twice(3)
    6
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch
from beartype import BeartypeConf, beartype
from jaxtyping import Float, Int, Shaped

from opake_fx.errors import InputTypeError

__all__ = ["typechecked", "PyTree", "FloatTensor", "IntTensor", "KeyData", "Tensor"]

Tensor = torch.Tensor
PyTree = Any
"""A nested structure of tuples, lists, dicts (and opake_fx wrappers) with tensor leaves."""

FloatTensor = Float[torch.Tensor, "..."]
IntTensor = Int[torch.Tensor, "..."]
KeyData = Shaped[torch.Tensor, "*batch 2"]
"""Stacked key words: int64 tensors of shape ``(..., 2)``."""

_F = TypeVar("_F", bound=Callable[..., Any])

# is_pep484_tower: an int is accepted where a float is annotated (batch sizes, norms).
_CONF = BeartypeConf(violation_type=InputTypeError, is_pep484_tower=True)


def typechecked(fn: _F) -> _F:
    """Checks ``fn``'s annotated argument and return types at call time (beartype)."""
    return beartype(conf=_CONF)(fn)
