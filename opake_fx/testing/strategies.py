"""Hypothesis strategies for keys and pytrees of tensors, with extreme values on purpose.

Example:
    >>> import torch
    >>> from hypothesis import find
    >>> tree = find(pytrees(dtype=torch.bfloat16, min_leaves=2), lambda t: True)
    >>> sorted({leaf.dtype for leaf in (tree.values() if isinstance(tree, dict) else tree)}, key=str)
    [torch.bfloat16]
"""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import strategies as st

from opake_fx.random import RngKey

__all__ = ["keys", "pytrees", "batched_pytrees", "EXTREME_SCALES"]

EXTREME_SCALES: dict[torch.dtype, tuple[float, float, float]] = {
    torch.float64: (1e-300, 1.0, 1e300),
    torch.float32: (1e-30, 1.0, 1e30),
    torch.bfloat16: (1e-30, 1.0, 1e30),
    torch.float16: (1e-4, 1.0, 1e4),
}
"""Per dtype: a tiny, a unit and a huge magnitude. Entries are drawn in ``[-1, 1]`` times
one of them, so subnormals (tiny times small entries) and sums of squares that overflow
(huge) are both exercised while every entry stays finite."""


def keys() -> st.SearchStrategy[RngKey]:
    """Draws :class:`~opake_fx.random.RngKey` s over the whole uint32 x uint32 range.

    Privacy: none (a test helper).

    Example:
        >>> from hypothesis import find
        >>> find(keys(), lambda k: k.words[0] > 0)
        RngKey(1, 0)
    """
    word = st.integers(0, 2**32 - 1)
    return st.tuples(word, word).map(RngKey)


def pytrees(
    *,
    max_leaves: int = 6,
    min_leaves: int = 1,
    scale: st.SearchStrategy[float] | None = None,
    dtype: torch.dtype | st.SearchStrategy[torch.dtype] = torch.float32,
    batch: int | None = None,
    max_dims: int = 3,
    max_side: int = 4,
    empty_leaves: bool = False,
    nonfinite: bool = False,
    nested: bool = False,
) -> st.SearchStrategy[Any]:
    """Draws dicts / tuples of tensors with entries in ``[-scale, scale]``.

    Args:
        max_leaves, min_leaves: how many tensor leaves a tree has.
        scale: strategy for the magnitude of the entries (default: one of the dtype's
            :data:`EXTREME_SCALES`, drawn per tree, so over- and underflow are exercised).
        dtype: the leaves' dtype, or a strategy drawing one per leaf (mixed-precision
            trees), e.g. ``st.sampled_from([torch.float32, torch.bfloat16, torch.float16])``.
        batch: if set, every leaf gets this leading batch dimension.
        max_dims, max_side: the most dimensions, and the largest side, of a leaf
            (besides the batch dimension).
        empty_leaves: sides may be 0 (leaves with no entries).
        nonfinite: a tree may hold NaN and +/-inf entries (for testing a non-finite policy).
        nested: trees may be dicts of dicts and tuples, not only flat.

    Returns:
        A strategy drawing a dict (``{"p0": ...}``) or tuple of tensors, nested if asked.

    Privacy: none (a test helper).

    Example:
        >>> from hypothesis import given, settings
        >>> @settings(max_examples=5)
        ... @given(tree=pytrees(max_leaves=3, empty_leaves=True))
        ... def test_norm_is_finite(tree): ...
        >>> test_norm_is_finite()
    """
    dtypes = dtype if isinstance(dtype, st.SearchStrategy) else st.just(dtype)
    level = st.sampled_from([0, 1, 2])

    @st.composite
    def tree(draw: Any) -> Any:
        chosen_level = draw(level)
        custom = draw(scale) if scale is not None else None
        n = draw(st.integers(min_leaves, max_leaves))
        leaves = []
        for _ in range(n):
            leaf_dtype = draw(dtypes)
            s = custom if custom is not None else EXTREME_SCALES.get(leaf_dtype, (1e-30, 1.0, 1e30))[chosen_level]
            shape = draw(_shapes(max_dims, max_side, 0 if empty_leaves else 1))
            if batch is not None:
                shape = (batch, *shape)
            leaves.append(draw(_tensor(shape, s, leaf_dtype, nonfinite)))
        return _arrange(draw, leaves, nested)

    return tree()


def batched_pytrees(batch_size: int, **kwargs: Any) -> st.SearchStrategy[Any]:
    """:func:`pytrees` whose leaves all have leading dimension ``batch_size``.

    Privacy: none (a test helper).

    Example:
        >>> from hypothesis import find
        >>> tree = find(batched_pytrees(3), lambda t: True)
        >>> {leaf.shape[0] for leaf in (tree.values() if isinstance(tree, dict) else tree)}
        {3}
    """
    return pytrees(batch=batch_size, **kwargs)


# --- private helpers ---------------------------------------------------------------


def _shapes(max_dims: int, max_side: int, min_side: int) -> st.SearchStrategy[tuple[int, ...]]:
    return st.lists(st.integers(min_side, max_side), min_size=0, max_size=max_dims).map(tuple)


@st.composite
def _tensor(draw: Any, shape: tuple[int, ...], scale: float, dtype: torch.dtype, nonfinite: bool) -> torch.Tensor:
    n = 1
    for side in shape:
        n *= side
    entry = st.floats(-1.0, 1.0, allow_nan=False)
    if nonfinite:
        entry = st.one_of(entry, st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    values = draw(st.lists(entry, min_size=n, max_size=n))
    return (torch.tensor(values, dtype=torch.float64).reshape(shape) * scale).to(dtype)


def _arrange(draw: Any, leaves: list[torch.Tensor], nested: bool) -> Any:
    if nested and len(leaves) >= 2 and draw(st.booleans()):
        cut = draw(st.integers(1, len(leaves) - 1))
        return {"a": _arrange(draw, leaves[:cut], nested), "b": _arrange(draw, leaves[cut:], nested)}
    if draw(st.booleans()):
        return {f"p{i}": leaf for i, leaf in enumerate(leaves)}
    return tuple(leaves)
