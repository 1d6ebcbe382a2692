"""Per-group clipping norms: :func:`per_group`."""

from __future__ import annotations

import fnmatch
from typing import Any, Callable, Sequence

from opake_fx.errors import InputValueError
from opake_fx.pytree import tree_flatten_with_paths
from opake_fx.types import PerGroup

__all__ = ["per_group"]

Selector = str | Callable[[str, Any], bool]


def per_group(
    params: Any,
    *,
    names: Sequence[str] | None = None,
    **groups: tuple[float, Selector],
) -> PerGroup:
    """Assigns every parameter leaf to a named group with its own clip norm.

    Each keyword is a group: ``name=(clipping_norm, selector)``. A selector is a glob
    pattern matched against the leaf's name, or a callable ``(name, leaf) -> bool``.
    A leaf's name is ``names[i]`` when ``names`` is given (e.g. ``fmodel.param_names``
    for the tuple that :func:`~opake_fx.functional.make_functional` returns), else its
    dotted tree path (``"encoder.weight"``, ``"0"``). Groups are tried in the order
    given; the first match wins; every leaf must match one.

    Privacy:
        Clipping group g to ``C_g`` bounds one example's whole gradient by
        ``sqrt(sum_g C_g**2)`` (``PerGroup.effective``), which is the sensitivity the
        noise stage and the accountant use; Gaussian noise allocated per group as in
        :func:`opake_fx.dpsgd.noise.gaussian_noise` costs the same epsilon as
        ``gaussian(noise_multiplier)``.

    Example:
        >>> import torch
        >>> params = {"w": torch.ones(3), "b": torch.ones(1)}
        >>> pg = per_group(params, bias=(0.1, "b"), rest=(1.0, "*"))
        >>> pg.for_path("w"), pg.for_path("b")
        (1.0, 0.1)
    """
    if not groups:
        raise InputValueError("per_group needs at least one group, e.g. per_group(params, all=(1.0, '*')).")
    paths, leaves, _ = tree_flatten_with_paths(params)
    if names is not None and len(names) != len(leaves):
        raise InputValueError(f"per_group got {len(names)} names for {len(leaves)} parameter leaves.")
    leaf_names = list(names) if names is not None else [".".join(str(k) for k in p) for p in paths]
    assignment: dict[tuple[Any, ...], str] = {}
    unmatched = []
    for path, name, leaf in zip(paths, leaf_names, leaves):
        for group, spec in groups.items():
            if not (isinstance(spec, tuple) and len(spec) == 2):
                raise InputValueError(f"group {group!r} must be (clipping_norm, selector); got {spec!r}.")
            selector = spec[1]
            hit = selector(name, leaf) if callable(selector) else fnmatch.fnmatchcase(name, selector)
            if hit:
                assignment[path] = group
                break
        else:
            unmatched.append(name)
    if unmatched:
        raise InputValueError(
            f"per_group: parameters {unmatched} match no group selector. Add a group for them or a "
            "catch-all, e.g. rest=(1.0, '*')."
        )
    used = set(assignment.values())
    return PerGroup(assignment, {g: float(spec[0]) for g, spec in groups.items() if g in used})
