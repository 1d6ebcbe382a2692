"""Tree math over pytrees of tensors, backed by optree.

Every function here flattens with the ``"opake_fx"`` optree namespace, so the DP
wrappers of :mod:`opake_fx.types` (``ClippedPytree``, ``NoisedPytree``, ...) are
traversed to their tensors. ``None`` is an empty subtree, as in JAX.

Privacy: a map cannot know whether it keeps a sensitivity bound, so every function
here that builds a new tree (:func:`tree_map`, :func:`add`, :func:`scale`,
:func:`zeros_like`, ...) returns a DP wrapper's *plain* pytree, without ``max_norm`` or
``noise_stddev``; noise stages refuse it. To keep the guarantee, use the wrapper's own
``*``/``/`` by a public scalar or ``ClippedPytree.map(fn, lipschitz=L)``.

Example:
    >>> import torch
    >>> t = {"w": torch.ones(2, 2), "b": torch.zeros(2)}
    >>> float(global_norm(t))
    2.0
    >>> scale(t, 0.5)["w"].tolist()
    [[0.5, 0.5], [0.5, 0.5]]
"""

from __future__ import annotations

from typing import Any, Callable

import optree
import torch

from opake_fx.errors import InputTypeError, InputValueError

__all__ = [
    "NAMESPACE",
    "tree_map",
    "leaves",
    "structure",
    "tree_flatten_with_paths",
    "add",
    "sub",
    "scale",
    "vdot",
    "global_norm",
    "safe_norm",
    "zeros_like",
    "ones_like",
    "cast",
    "partition",
    "merge",
    "assert_tensor_leaves",
]

NAMESPACE = "opake_fx"
"""The optree namespace that opake_fx's wrapper types are registered in."""

PyTree = Any


def tree_map(fn: Callable[..., Any], tree: PyTree, *rest: PyTree) -> PyTree:
    """Applies ``fn`` to corresponding leaves of ``tree`` and ``rest``.

    Privacy: a DP wrapper (``ClippedPytree``, ``NoisedPytree``) in the output is
    replaced by its plain pytree: ``fn`` could change values by any amount, so the
    wrapper's ``max_norm`` would no longer bound the sensitivity. Use
    ``ClippedPytree.map(fn, lipschitz=L)`` to keep it with a declared bound.

    Example:
        >>> import torch
        >>> from opake_fx.types import ClippedPytree
        >>> tree_map(torch.neg, {"w": torch.ones(2)})["w"].tolist()
        [-1.0, -1.0]
        >>> g = ClippedPytree({"w": torch.ones(2)}, max_norm=0.5)
        >>> sorted(tree_map(lambda x: 10 * x, g))    # a plain dict: the noise stage refuses it
        ['w']
    """
    return optree.tree_map(fn, tree, *rest, namespace=NAMESPACE)


def leaves(tree: PyTree) -> list[Any]:
    """The leaves of ``tree`` in flattening order."""
    return optree.tree_leaves(tree, namespace=NAMESPACE)


def structure(tree: PyTree) -> optree.PyTreeSpec:
    """The tree structure (a ``PyTreeSpec``) of ``tree``."""
    return optree.tree_structure(tree, namespace=NAMESPACE)


def tree_flatten_with_paths(tree: PyTree) -> tuple[list[tuple[Any, ...]], list[Any], optree.PyTreeSpec]:
    """Flattens ``tree`` into ``(paths, leaves, treespec)``.

    A path is the tuple of keys/indices from the root to the leaf, e.g.
    ``("encoder", "weight")`` or ``(0,)``.
    """
    return optree.tree_flatten_with_path(tree, namespace=NAMESPACE)


def add(a: PyTree, b: PyTree) -> PyTree:
    """Leafwise ``a + b``."""
    return tree_map(torch.add, a, b)


def sub(a: PyTree, b: PyTree) -> PyTree:
    """Leafwise ``a - b``."""
    return tree_map(torch.sub, a, b)


def scale(tree: PyTree, factor: float | torch.Tensor) -> PyTree:
    """Leafwise ``factor * leaf``."""
    return tree_map(lambda leaf: leaf * factor, tree)


def vdot(a: PyTree, b: PyTree) -> torch.Tensor:
    """Sum over leaves of the inner products ``<a_leaf, b_leaf>`` (a 0-dim tensor)."""
    parts = [torch.sum(x * y) for x, y in zip(leaves(a), leaves(b), strict=True)]
    if not parts:
        return torch.zeros(())
    return torch.stack([p.to(parts[0].dtype) for p in parts]).sum()


def global_norm(tree: PyTree) -> torch.Tensor:
    """The L2 norm of all leaves taken together (a float64 0-dim tensor).

    Computed in float64 from per-leaf norms (see :func:`safe_norm`), so float32 leaves
    of 1e30 or 1e-30 give the right answer instead of inf or 0.
    """
    norms = [safe_norm(leaf) for leaf in leaves(tree)]
    if not norms:
        return torch.zeros((), dtype=torch.float64)
    device = norms[0].device
    return safe_norm(torch.stack([n.to(device) for n in norms]))


def safe_norm(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """L2 norm in float64 (over ``dim``, or all entries) that neither over- nor underflows.

    Squares are taken in float64, which holds the square of any float32 value; for
    float64 inputs whose squares overflow, the affected rows are rescaled by their
    largest entry. A NaN or inf entry gives a NaN or inf norm.
    """
    if not x.is_floating_point():
        x = x.double()
    n = torch.linalg.vector_norm(x, dim=dim, dtype=torch.float64)
    if x.dtype == torch.float64:
        overflow = torch.isinf(n) & (torch.isfinite(x).all() if dim is None else torch.isfinite(x).all(dim=dim))
        # Traced (torch.compile): both branches, selected on the device (no host sync).
        if torch.compiler.is_compiling() or bool(overflow.any()):
            amax = x.abs().amax(dim=dim, keepdim=dim is not None).clamp_min(torch.finfo(torch.float64).tiny)
            rescaled = torch.linalg.vector_norm(x / amax, dim=dim) * (amax.squeeze(dim) if dim is not None else amax)
            n = torch.where(overflow, rescaled, n)
    return n


def zeros_like(tree: PyTree) -> PyTree:
    """A tree of zeros with the shapes, dtypes and devices of ``tree``."""
    return tree_map(torch.zeros_like, tree)


def ones_like(tree: PyTree) -> PyTree:
    """A tree of ones with the shapes, dtypes and devices of ``tree``."""
    return tree_map(torch.ones_like, tree)


def cast(tree: PyTree, dtype: torch.dtype) -> PyTree:
    """Casts floating-point leaves to ``dtype``; integer and bool leaves are kept."""
    return tree_map(lambda leaf: leaf.to(dtype) if leaf.is_floating_point() else leaf, tree)


def partition(predicate: Callable[[tuple[Any, ...], Any], bool], tree: PyTree) -> tuple[PyTree, PyTree]:
    """Splits ``tree`` into ``(selected, rest)`` by ``predicate(path, leaf)``.

    Both outputs keep the full structure; a leaf absent from one side is ``None``
    there. :func:`merge` puts them back together.

    Example:
        >>> import torch
        >>> t = {"w": torch.ones(2), "b": torch.zeros(1)}
        >>> biases, others = partition(lambda path, leaf: path[-1] == "b", t)
        >>> sorted(k for k, v in biases.items() if v is not None)
        ['b']
    """
    paths, flat, spec = tree_flatten_with_paths(tree)
    chosen = [bool(predicate(p, leaf)) for p, leaf in zip(paths, flat)]
    selected = [leaf if c else None for leaf, c in zip(flat, chosen)]
    rest = [None if c else leaf for leaf, c in zip(flat, chosen)]
    return _unflatten_with_none(spec, selected), _unflatten_with_none(spec, rest)


def merge(a: PyTree, b: PyTree) -> PyTree:
    """Inverse of :func:`partition`: takes each leaf from whichever side is not ``None``."""
    fa = optree.tree_leaves(a, none_is_leaf=True, namespace=NAMESPACE)
    fb, spec = optree.tree_flatten(b, none_is_leaf=True, namespace=NAMESPACE)
    if len(fa) != len(fb):
        raise InputValueError(
            "merge needs two halves of the same tree (the outputs of partition); "
            f"got {len(fa)} and {len(fb)} leaves."
        )
    merged = []
    for x, y in zip(fa, fb):
        if x is not None and y is not None:
            raise InputValueError("merge found a leaf present in both halves; partition gives disjoint halves.")
        merged.append(x if x is not None else y)
    return optree.tree_unflatten(spec, merged)


def assert_tensor_leaves(tree: PyTree, *, what: str) -> None:
    """Raises a clear error if any leaf of ``tree`` is not a tensor."""
    paths, flat, _ = tree_flatten_with_paths(tree)
    for path, leaf in zip(paths, flat):
        if not isinstance(leaf, torch.Tensor):
            raise InputTypeError(
                f"{what} must be a pytree of tensors; the leaf at path {path} is a "
                f"{type(leaf).__name__}. Convert it with torch.as_tensor or remove it from the tree."
            )


def _unflatten_with_none(spec: optree.PyTreeSpec, flat: list[Any]) -> PyTree:
    # Rebuild with None in place of missing leaves (None is a leaf on this side).
    none_spec = optree.tree_structure(
        optree.tree_unflatten(spec, [0] * spec.num_leaves), none_is_leaf=True, namespace=NAMESPACE
    )
    return optree.tree_unflatten(none_spec, flat)
