"""Hypothesis strategies that draw pytrees of tensors, with extreme scales on purpose."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import strategies as st

__all__ = ["pytrees", "batched_pytrees"]


def _shapes(max_dims: int = 3, max_side: int = 4) -> st.SearchStrategy[tuple[int, ...]]:
    return st.lists(st.integers(1, max_side), min_size=0, max_size=max_dims).map(tuple)


@st.composite
def _tensor(draw: Any, shape: tuple[int, ...], scale: float, dtype: torch.dtype) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    values = draw(st.lists(st.floats(-1.0, 1.0, allow_nan=False), min_size=n, max_size=n))
    return (torch.tensor(values, dtype=torch.float64).reshape(shape) * scale).to(dtype)


def pytrees(
    *,
    max_leaves: int = 6,
    scale: st.SearchStrategy[float] | None = None,
    dtype: torch.dtype = torch.float32,
    batch: int | None = None,
) -> st.SearchStrategy[Any]:
    """Draws dicts/tuples of tensors (1..max_leaves leaves) with entries in ``[-scale, scale]``.

    Args:
        max_leaves: the most leaves a tree may have.
        scale: strategy for the magnitude of the entries (default: 1e-30, 1 or 1e30,
            so over/underflow is exercised).
        dtype: leaf dtype.
        batch: if set, every leaf gets this leading batch dimension.
    """
    scale = scale if scale is not None else st.sampled_from([1e-30, 1.0, 1e30])

    @st.composite
    def tree(draw: Any) -> Any:
        s = draw(scale)
        n = draw(st.integers(1, max_leaves))
        leaves = []
        for _ in range(n):
            shape = draw(_shapes())
            if batch is not None:
                shape = (batch, *shape)
            leaves.append(draw(_tensor(shape, s, dtype)))
        if draw(st.booleans()):
            return {f"p{i}": leaf for i, leaf in enumerate(leaves)}
        return tuple(leaves)

    return tree()


def batched_pytrees(batch_size: int, **kwargs: Any) -> st.SearchStrategy[Any]:
    """:func:`pytrees` whose leaves all have leading dimension ``batch_size``."""
    return pytrees(batch=batch_size, **kwargs)
