"""Tree assertions for tests."""

from __future__ import annotations

from typing import Any

import torch

from opake_fx.pytree import tree_flatten_with_paths

__all__ = ["assert_trees_close"]


def assert_trees_close(actual: Any, expected: Any, *, rtol: float = 1e-6, atol: float = 1e-6) -> None:
    """Asserts two pytrees have the same structure and leafwise-close tensors.

    The failure message names the path of the first mismatching leaf.
    """
    pa, la, sa = tree_flatten_with_paths(actual)
    pe, le, se = tree_flatten_with_paths(expected)
    assert sa == se, f"tree structures differ:\n  actual:   {sa}\n  expected: {se}"
    for path, x, y in zip(pa, la, le):
        try:
            torch.testing.assert_close(x, y.to(x.dtype) if isinstance(y, torch.Tensor) else y, rtol=rtol, atol=atol)
        except AssertionError as err:
            raise AssertionError(f"leaf at {path} differs: {err}") from None
