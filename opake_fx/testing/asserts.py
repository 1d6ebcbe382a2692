"""Tree assertions for tests: every failure names the path of the leaf that failed.

Example:
    >>> import torch
    >>> assert_trees_equal({"w": torch.ones(2)}, {"w": torch.ones(2)})
    >>> assert_tree_finite({"w": torch.tensor([1.0, float("nan")])})
    Traceback (most recent call last):
    ...
    AssertionError: leaf ('w',) has 1 non-finite value(s) of 2, the first at index (1,): nan
"""

from __future__ import annotations

import math
from typing import Any

import optree
import torch

from opake_fx.pytree import NAMESPACE, tree_flatten_with_paths
from opake_fx.types import PerGroup

__all__ = [
    "assert_trees_close",
    "assert_trees_equal",
    "assert_tree_finite",
    "assert_tree_shapes_dtypes",
    "assert_clipped",
]


def assert_trees_close(actual: Any, expected: Any, *, rtol: float = 1e-6, atol: float = 1e-6) -> None:
    """Asserts two pytrees have the same structure and leafwise-close values.

    Tensor leaves are compared with ``torch.testing.assert_close`` after casting
    ``expected`` to the dtype of ``actual`` (NaN never equals NaN); other leaves with ``==``.

    Args:
        actual, expected: the trees.
        rtol, atol: tolerances as in ``torch.testing.assert_close``.

    Raises:
        AssertionError: naming the first path where the structures differ, or the leaf
            whose values differ.

    Privacy: none (a test helper).

    Example:
        >>> import torch
        >>> assert_trees_close({"w": torch.ones(2)}, {"w": torch.ones(2) + 1e-8})
        >>> assert_trees_close({"w": torch.ones(2)}, {"w": torch.zeros(2)})
        Traceback (most recent call last):
        ...
        AssertionError: leaf ('w',) differs: Tensor-likes are not close!
        <BLANKLINE>
        Mismatched elements: 2 / 2 (100.0%)
        Greatest absolute difference: 1.0 at index (0,) (up to 1e-06 allowed)
        Greatest relative difference: inf at index (0,) (up to 1e-06 allowed)
    """
    for path, x, y in _pairs(actual, expected):
        try:
            if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
                torch.testing.assert_close(x, y.to(x.dtype), rtol=rtol, atol=atol)
            else:
                torch.testing.assert_close(x, y, rtol=rtol, atol=atol)
        except AssertionError as err:
            raise AssertionError(f"leaf {path} differs: {err}") from None


def assert_trees_equal(actual: Any, expected: Any) -> None:
    """Asserts two pytrees are identical: same structure, dtypes, shapes, devices and bits.

    Tensors are compared bit for bit (a NaN equals a NaN with the same bits, ``-0.0`` does
    not equal ``0.0``), which is what "resumes bit-identically" means. Other leaves with ``==``.

    Raises:
        AssertionError: naming the first differing path and, for tensors, the first
            differing index with both values.

    Privacy: none (a test helper).

    Example:
        >>> import torch
        >>> assert_trees_equal((torch.tensor([0.0, 1.0]),), (torch.tensor([0.0, 1.0]),))
        >>> assert_trees_equal((torch.tensor([0.0, 1.0]),), (torch.tensor([-0.0, 1.0]),))
        Traceback (most recent call last):
        ...
        AssertionError: leaf (0,) differs at index (0,): 0.0 != -0.0
    """
    for path, x, y in _pairs(actual, expected):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
                raise AssertionError(f"leaf {path}: {type(x).__name__} != {type(y).__name__}")
            for what, a, b in (("dtype", x.dtype, y.dtype), ("shape", tuple(x.shape), tuple(y.shape)), ("device", x.device, y.device)):
                if a != b:
                    raise AssertionError(f"leaf {path}: {what} {a} != {b}")
            bx, by = _bits(x), _bits(y)
            if not torch.equal(bx, by):
                idx = _first_index(bx != by, x.shape)
                raise AssertionError(f"leaf {path} differs at index {idx}: {x[idx].item()!r} != {y[idx].item()!r}")
        elif not (x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))):
            raise AssertionError(f"leaf {path}: {x!r} != {y!r}")


def assert_tree_finite(tree: Any) -> None:
    """Asserts every floating-point or complex tensor leaf of ``tree`` is finite (no NaN, no inf).

    Raises:
        AssertionError: naming the leaf, how many values are not finite and the first one.

    Privacy: none (a test helper).

    Example:
        >>> import torch
        >>> assert_tree_finite({"w": torch.ones(2), "step": 3})
    """
    paths, leaves, _ = tree_flatten_with_paths(tree)
    for path, leaf in zip(paths, leaves):
        if isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex()):
            bad = ~torch.isfinite(leaf)
            if bool(bad.any()):
                idx = _first_index(bad, leaf.shape)
                raise AssertionError(
                    f"leaf {path} has {int(bad.sum())} non-finite value(s) of {leaf.numel()}, "
                    f"the first at index {idx}: {leaf[idx].item()!r}"
                )
        elif isinstance(leaf, float) and not math.isfinite(leaf):
            raise AssertionError(f"leaf {path} is {leaf!r}")


def assert_tree_shapes_dtypes(actual: Any, expected: Any) -> None:
    """Asserts ``actual`` has ``expected``'s structure and, leaf for leaf, its shapes and dtypes.

    Args:
        actual: the tree to check.
        expected: a tree of tensors (values are ignored) or of ``(shape, dtype)`` pairs.

    Raises:
        AssertionError: naming the first leaf whose shape or dtype differs.

    Privacy: none (a test helper).

    Example:
        >>> import torch
        >>> assert_tree_shapes_dtypes({"w": torch.ones(2, 3)}, {"w": ((2, 3), torch.float32)})
        >>> assert_tree_shapes_dtypes({"w": torch.ones(2)}, {"w": torch.zeros(2, dtype=torch.bfloat16)})
        Traceback (most recent call last):
        ...
        AssertionError: leaf ('w',): dtype torch.float32, expected torch.bfloat16
    """
    for path, x, spec in _pairs(actual, expected, is_leaf=_is_spec):
        shape, dtype = (tuple(spec[0]), spec[1]) if _is_spec(spec) else (tuple(spec.shape), spec.dtype)
        if not isinstance(x, torch.Tensor):
            raise AssertionError(f"leaf {path} is a {type(x).__name__}, expected a tensor of shape {shape}")
        if tuple(x.shape) != shape:
            raise AssertionError(f"leaf {path}: shape {tuple(x.shape)}, expected {shape}")
        if x.dtype != dtype:
            raise AssertionError(f"leaf {path}: dtype {x.dtype}, expected {dtype}")


def assert_clipped(tree: Any, per_example_bound: float | PerGroup, *, batch_dim: int = 0, rtol: float = 1e-12) -> None:
    """Asserts every example's slice of ``tree`` has L2 norm at most ``per_example_bound``.

    ``tree`` holds per-example values (every tensor leaf has the batch on ``batch_dim``),
    e.g. clipped per-example gradients. The norm of example ``i`` is taken over all
    leaves together, in float64. With a :class:`~opake_fx.types.PerGroup` bound (leaf
    path -> group), each group's norm is checked against its own value.

    Args:
        tree: per-example values.
        per_example_bound: the bound ``C`` (or per-group bounds).
        batch_dim: the batch dimension of every leaf.
        rtol: relative slack for the float64 norm computation itself.

    Raises:
        AssertionError: naming the example, its norm, the bound (and group), and the leaf
            that contributes most to that example's norm.

    Privacy: checks the invariant DP-SGD's sensitivity rests on: one example moves the
    clipped sum by at most ``C``.

    Example:
        >>> import torch
        >>> assert_clipped({"w": torch.tensor([[3.0, 4.0], [0.6, 0.8]])}, 5.0)
        >>> assert_clipped({"w": torch.tensor([[3.0, 4.0], [0.6, 0.8]])}, 1.0)
        Traceback (most recent call last):
        ...
        AssertionError: example 0 has norm 5.0 > bound 1.0 (most of it from leaf ('w',))
    """
    paths, leaves, _ = tree_flatten_with_paths(tree)
    tensors = [(p, t) for p, t in zip(paths, leaves) if isinstance(t, torch.Tensor)]
    if not tensors:
        return
    sizes = {t.shape[batch_dim] for _, t in tensors}
    if len(sizes) != 1:
        raise AssertionError(f"assert_clipped: the leaves disagree on the batch size (dim {batch_dim}): {sorted(sizes)}")
    groups: dict[str, list[tuple[Any, torch.Tensor]]] = {}
    for p, t in tensors:
        g = per_example_bound.groups.get(tuple(p)) if isinstance(per_example_bound, PerGroup) else ""
        if g is None:
            raise AssertionError(f"assert_clipped: leaf {p} is in no group of the PerGroup bound")
        sq = t.detach().to(torch.float64).movedim(batch_dim, 0).reshape(t.shape[batch_dim], -1).pow(2).sum(1)
        groups.setdefault(g, []).append((p, sq))
    for g, parts in groups.items():
        bound = per_example_bound.values[g] if isinstance(per_example_bound, PerGroup) else float(per_example_bound)
        norms = torch.stack([sq for _, sq in parts]).sum(0).sqrt()
        over = norms > bound * (1 + rtol)
        if bool(over.any()):
            i = int(torch.nonzero(over)[0])
            worst = max(parts, key=lambda part: float(part[1][i]))[0]
            where = f" in group {g!r}" if g else ""
            raise AssertionError(
                f"example {i} has norm {float(norms[i])!r} > bound {bound!r}{where} (most of it from leaf {worst})"
            )


# --- private helpers ---------------------------------------------------------------


def _pairs(actual: Any, expected: Any, is_leaf: Any = None) -> list[tuple[Any, Any, Any]]:
    pa, la, sa = tree_flatten_with_paths(actual)
    pe, le, se = optree.tree_flatten_with_path(expected, is_leaf=is_leaf, namespace=NAMESPACE)
    if pa != pe:
        missing = [p for p in pe if p not in set(pa)]
        extra = [p for p in pa if p not in set(pe)]
        raise AssertionError(
            f"tree structures differ: leaves only in expected {missing[:5]}, only in actual {extra[:5]}"
            + ("" if missing or extra else " (the same leaves in another order)")
        )
    if is_leaf is None and sa != se:
        raise AssertionError(f"tree structures differ:\n  actual:   {sa}\n  expected: {se}")
    return list(zip(pa, la, le))


def _is_spec(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], torch.dtype)


def _bits(x: torch.Tensor) -> torch.Tensor:
    flat = x.detach().cpu().contiguous().reshape(-1)
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return flat.view(torch.uint8)


def _first_index(mask: torch.Tensor, shape: torch.Size) -> tuple[int, ...]:
    flat = int(torch.nonzero(mask.reshape(-1))[0])
    if mask.numel() != math.prod(shape):  # a byte mask: map the byte back to its element
        flat //= mask.numel() // max(1, math.prod(shape))
    idx = []
    for side in reversed(tuple(shape)):
        idx.append(flat % side)
        flat //= side
    return tuple(reversed(idx))
