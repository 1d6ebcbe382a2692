"""Type aliases (jaxtyping) and the runtime type checker used on public functions.

``typechecked`` is beartype configured to raise :class:`~opake_fx.errors.InputTypeError`
(a ``TypeError``), so a wrongly typed argument gets the library's error type with
beartype's precise message (which parameter, what was expected, what came). It is
defined in the torch-free :mod:`opake_fx._typecheck`, which the accounting modules use.

Example:
    >>> from opake_fx.typing import typechecked
    >>> @typechecked
    ... def twice(x: int) -> int:
    ...     return 2 * x
    >>> twice(3)
    6
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float, Int, Shaped

from opake_fx._typecheck import typechecked

__all__ = ["typechecked", "PyTree", "FloatTensor", "IntTensor", "KeyData", "Tensor"]

Tensor = torch.Tensor
PyTree = Any
"""A nested structure of tuples, lists, dicts (and opake_fx wrappers) with tensor leaves."""

FloatTensor = Float[torch.Tensor, "..."]
IntTensor = Int[torch.Tensor, "..."]
KeyData = Shaped[torch.Tensor, "*batch 2"]
"""Stacked key words: int64 tensors of shape ``(..., 2)``."""
