"""The Gaussian mechanism's one home: keyed draws, the release, and the joint split of a pair.

DP-SGD's :func:`~opake_fx.dpsgd.noise.gaussian_noise` and DP-FTRL's
:func:`~opake_fx.dpftrl.noise.mf_gaussian_noise` draw their noise here and nowhere else:

* :func:`step_normals`: step ``t``'s standard normals, from ``fold_in(key, t)`` (never the
  global torch RNG): one flat draw per device and dtype, or JAX-identical Threefry normals
  (``exact=True``). DP-FTRL correlates these rows.
* :func:`add_gaussian_noise`: one release, ``leaf + std * z``: keyed (the same draw, scaled
  inside the generator's kernel), exact, or ``secure`` (the OS's cryptographic source,
  :mod:`opake_fx.secure_random`).
* :func:`noised_tree`: the release of a whole pytree at step ``t``, with a scalar or a
  per-group stddev, drawn in place or by a :class:`~opake_fx._noise_prefetch.NoisePrefetcher`
  that started it during the previous step (the same numbers).
* :func:`second_moment_stddevs`, :func:`joint_noise_multiplier`, :func:`squared_stream_key`:
  a gradient and its squares released as ONE Gaussian mechanism (below).

The checks a mechanism makes before drawing (the key, the step, the noise multiplier,
the input and the state) live in :mod:`opake_fx._noise_input`.

The private second moment: stream ``k`` (the gradient, its square) has sensitivity ``D_k``
(``C / n`` and ``C**2 / n``) and gets stddev ``s_k``; stacking the whitened streams
``(x_1 / s_1, x_2 / s_2)`` gives a vector with identity-covariance noise and L2
sensitivity ``sqrt((D_1 / s_1)**2 + (D_2 / s_2)**2)`` (one example changes both streams at
once), i.e. a Gaussian mechanism with noise multiplier
``z_joint = ((D_1 / s_1)**2 + (D_2 / s_2)**2) ** -0.5``. Giving the squared stream the share
``a`` of the budget, ``s_1 = z D_1 / sqrt(1 - a)`` and ``s_2 = z D_2 / sqrt(a)``, makes
``z_joint = z`` exactly: the pair costs what the gradient alone costs at
``noise_multiplier=z``, and the gradient stream pays for the squares with
``1 / sqrt(1 - a)`` times more noise (``a = 1/3``, the default, is the ``sqrt(3/2)``
overhead of Kalinin, Upadhyay and Lampert, "Continual Release Moment Estimation with
Differential Privacy", 2025). The squared stream draws from its own root key,
:func:`squared_stream_key`, so the two streams never share a draw.

Privacy: every function here adds (or draws) ``N(0, std**2)`` per coordinate; the
guarantee is the caller's calibration (``std = noise_multiplier * sensitivity``), which
the mechanisms document and the accountants charge. Keyed noise is reproducible by
design: the key must stay secret, and a step's key is never reused.

Example:
    >>> import torch
    >>> from opake_fx.random import key
    >>> out = noised_tree({"w": torch.zeros(2)}, key(0), 0, 0.0)
    >>> out["w"].tolist()
    [0.0, 0.0]
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from opake_fx._noise_input import MAX_STEPS, SQUARED_STREAM_COUNTER, check_second_moment_share
from opake_fx._noise_prefetch import NoisePrefetcher
from opake_fx.errors import InputValueError
from opake_fx.pytree import NAMESPACE, tree_flatten_with_paths
from opake_fx.random import RngKey, flat_normal_group, flat_tree_normal, flat_tree_normal_rows, fold_in, tree_normal
from opake_fx.secure_random import add_secure_gaussian
from opake_fx.types import PerGroup

__all__ = [
    "step_normals",
    "add_gaussian_noise",
    "noised_tree",
    "drawn_between_graphs",
    "second_moment_stddevs",
    "joint_noise_multiplier",
    "squared_stream_key",
    "DEFAULT_SECOND_MOMENT_SHARE",
]

DEFAULT_SECOND_MOMENT_SHARE = 1.0 / 3.0
"""The share of the budget the squared-gradient stream gets by default (first-stream overhead ``sqrt(3/2)``)."""


def step_normals(key: RngKey, step: int, like: Sequence[torch.Tensor], *, exact: bool = False,
                 rows: tuple[Any, Any] | None = None) -> list[torch.Tensor]:
    """Step ``step``'s standard normals under ``key``: one tensor shaped like each of ``like``.

    Drawn from ``fold_in(key, step)`` as :func:`add_gaussian_noise` draws them: one flat
    draw per device and dtype (:func:`~opake_fx.random.flat_tree_normal`), or with
    ``exact=True`` JAX-identical Threefry normals, one subkey per leaf. Only the shapes,
    dtypes and devices of ``like`` are read. With ``rows = (full_shapes, row_ranges)``
    the ``like`` are row shards of leaves of ``full_shapes`` and get exactly their rows of
    the unsharded draw (:func:`~opake_fx.random.flat_tree_normal_rows`; not with ``exact``).

    Privacy: none by itself (the caller scales and adds them); the same key and step give
    the same numbers, so a step's key must never be reused.

    Example:
        >>> import torch
        >>> from opake_fx.random import key
        >>> a = step_normals(key(0), 3, [torch.zeros(2)])
        >>> b = step_normals(key(0), 3, [torch.zeros(2)])
        >>> torch.equal(a[0], b[0]), a[0].shape
        (True, torch.Size([2]))
    """
    if rows is not None:
        if exact:
            raise InputValueError("step_normals: row shards take the keyed draw only (not exact=True).")
        return flat_tree_normal_rows(fold_in(key, step), like, full_shapes=rows[0], rows=rows[1])[0]
    if exact:
        return list(tree_normal(fold_in(key, step), list(like), exact=True))
    return flat_tree_normal(fold_in(key, step), like)[0]


def add_gaussian_noise(
    leaves: list[torch.Tensor],
    step_key: RngKey,
    std: float | list[float],
    *,
    exact: bool = False,
    secure: bool = False,
    draw: Callable[..., tuple[list[torch.Tensor], list[torch.Tensor]]] = flat_tree_normal,
) -> list[torch.Tensor]:
    """One release of the Gaussian mechanism: ``leaf + std * z`` for every leaf.

    The library's one implementation of the draw and the add, used by DP-SGD's noise
    stage and by DP-FTRL's identity strategy. ``z`` is drawn from ``step_key`` (never from
    the global RNG): one flat draw per device and dtype scaled inside the generator's
    kernel (``exact=True``: JAX-identical Threefry normals, one subkey per leaf;
    ``secure=True``: the OS's cryptographic source, see :mod:`opake_fx.secure_random`).
    ``std`` is one stddev, or one per leaf. The inputs are not modified. ``draw`` makes the
    fast path's normals (``(step_key, leaves, *, stddev)``, as
    :func:`~opake_fx.random.flat_tree_normal`); :func:`noised_tree` passes its prefetcher's,
    which returns the same numbers.

    Privacy: adds ``N(0, std**2)`` to every coordinate; the guarantee is that of the
    caller's calibration (``std = noise_multiplier * sensitivity``).

    Example:
        >>> import torch
        >>> from opake_fx.random import key
        >>> out = add_gaussian_noise([torch.zeros(2), torch.ones(3)], key(0), 0.0)
        >>> [t.tolist() for t in out]
        [[0.0, 0.0], [1.0, 1.0, 1.0]]
    """
    per_leaf = isinstance(std, (list, tuple))
    if secure:
        return add_secure_gaussian(leaves, list(std) if per_leaf else [float(std)] * len(leaves))
    if exact:
        draws = tree_normal(step_key, leaves, exact=True)
        return [torch.add(leaf, z, alpha=std[i] if per_leaf else std) for i, (leaf, z) in enumerate(zip(leaves, draws))]
    # One draw per device and dtype, scaled by the generator's kernel, then one fused add
    # per leaf: the outputs are views into the draw buffers (no parameter-sized temporaries).
    noised, _ = draw(step_key, leaves, stddev=1.0 if per_leaf else float(std))
    if per_leaf and noised:
        torch._foreach_mul_(noised, list(std))
    if noised:
        torch._foreach_add_(noised, leaves)
    return noised


def noised_tree(
    pytree: Any,
    key: RngKey,
    step: int,
    std: float | PerGroup,
    *,
    exact: bool = False,
    secure: bool = False,
    prefetcher: NoisePrefetcher | None = None,
    rows: tuple[Any, Any] | None = None,
) -> Any:
    """``pytree`` plus step ``step``'s Gaussian noise under ``key`` (the tree itself for std 0).

    With ``rows = (full_shapes, row_ranges)`` the leaves are row shards of leaves of
    ``full_shapes`` and get exactly their rows of the unsharded draw
    (:func:`~opake_fx.random.flat_tree_normal_rows`); not with ``exact``, ``secure`` or a
    ``prefetcher``.

    The noise of every leaf comes from ``fold_in(key, step)`` (:func:`add_gaussian_noise`);
    a :class:`~opake_fx.types.PerGroup` ``std`` gives each leaf its group's stddev. With a
    ``prefetcher`` (keyed draws only), the draw is the one it started last step when that
    matches, and step ``step + 1``'s draw is started before returning: the same numbers as
    drawing in place.

    Traced by ``torch.compile`` (a compiled step), the keyed draw with one stddev runs inside
    the graph: :func:`~opake_fx.random.flat_normal_group`, an operator that derives the key
    and runs the generator when the graph runs, then ``z + leaf`` in the graph (the eager
    path's one rounding), so the numbers are the eager ones, bit for bit. Exact, secure,
    per-group, row-sharded and drawn-ahead (``prefetcher.enabled is True``) releases run
    eagerly between two graphs instead; an automatic prefetcher draws in place there.

    Privacy: adds ``N(0, std**2)`` per coordinate (as :func:`add_gaussian_noise`).

    Example:
        >>> import torch
        >>> from opake_fx.random import key
        >>> a = noised_tree([torch.zeros(3)], key(1), 0, 0.5)
        >>> b = noised_tree([torch.zeros(3)], key(1), 0, 0.5, prefetcher=NoisePrefetcher(enabled=True))
        >>> torch.equal(a[0], b[0])
        True
    """
    if not isinstance(std, PerGroup) and std == 0.0:
        return pytree
    if (torch.compiler.is_compiling() and draw_in_graph and rows is None and not (exact or secure)
            and not isinstance(std, PerGroup) and (prefetcher is None or prefetcher.enabled is not True)):
        leaves, spec = optree.tree_flatten(pytree, namespace=NAMESPACE)
        return spec.unflatten(_noised_in_graph(leaves, key, step, float(std)))
    return _noised_tree_eagerly(pytree, key, step, std, exact=exact, secure=secure, prefetcher=prefetcher, rows=rows)


#: Whether a traced keyed draw runs inside the graph (:func:`noised_tree`). Dynamo guards on it, so a
#: graph traced with one value is never run under the other. :func:`drawn_between_graphs` clears it
#: while a compiled step records CUDA graphs.
draw_in_graph = True


@contextlib.contextmanager
def drawn_between_graphs(on: bool = True) -> Any:
    """While on, a traced :func:`noised_tree` draws eagerly between two graphs, as before the draw
    became an operator in the graph: what a compiled step records as CUDA graphs
    (``mode="reduce-overhead"``) keeps, the design measured on a GPU. (The operator is tagged
    ``cudagraph_unsafe`` as well, so inductor would run it outside a captured graph; that path
    has not been measured on a device.)

    Example:
        >>> import opake_fx._gaussian as gaussian
        >>> with drawn_between_graphs():
        ...     print(gaussian.draw_in_graph)
        False
        >>> gaussian.draw_in_graph
        True
    """
    global draw_in_graph
    previous, draw_in_graph = draw_in_graph, draw_in_graph and not on
    try:
        yield
    finally:
        draw_in_graph = previous


def _noised_in_graph(leaves: list[torch.Tensor], key: RngKey, step: int, std: float) -> list[torch.Tensor]:
    """:func:`add_gaussian_noise`'s keyed release with one stddev, as traceable code: the leaves'
    (device, dtype) groups in order of first appearance, each group's flat draw by
    :func:`~opake_fx.random.flat_normal_group`, the values handed out in leaf order."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, leaf in enumerate(leaves):
        groups.setdefault((leaf.device, leaf.dtype), []).append(i)
    out: list[Any] = [None] * len(leaves)
    for j, ((device, dtype), members) in enumerate(groups.items()):
        sizes = [leaves[i].numel() for i in members]
        flat = flat_normal_group(list(key.words), step, len(groups), j, sum(sizes), dtype, device, std)
        for i, part in zip(members, flat.split(sizes)):
            out[i] = part.view(leaves[i].shape) + leaves[i]  # z + leaf, as the eager in-place add
    return out


@torch.compiler.disable
def _noised_tree_eagerly(pytree: Any, key: RngKey, step: int, std: float | PerGroup, *, exact: bool, secure: bool,
                         prefetcher: NoisePrefetcher | None, rows: tuple[Any, Any] | None) -> Any:
    """:func:`noised_tree` run eagerly (between two graphs when traced)."""
    if isinstance(std, PerGroup):
        paths, leaves, spec = tree_flatten_with_paths(pytree)
        stds: Any = [std.for_path(p) for p in paths]
    else:
        leaves, spec = optree.tree_flatten(pytree, namespace=NAMESPACE)
        stds = float(std)
    if rows is not None:
        if exact or secure or prefetcher is not None:
            raise InputValueError("noised_tree: row shards take the keyed draw only (no exact, secure or prefetcher).")
        draw = functools.partial(flat_tree_normal_rows, full_shapes=rows[0], rows=rows[1])
        return spec.unflatten(add_gaussian_noise(leaves, fold_in(key, step), stds, draw=draw))
    if prefetcher is None:
        return spec.unflatten(add_gaussian_noise(leaves, fold_in(key, step), stds, exact=exact, secure=secure))
    noised = add_gaussian_noise(leaves, fold_in(key, step), stds, draw=prefetcher.draw)
    if step + 1 < MAX_STEPS:
        prefetcher.prefetch_next(key, step + 1)
    return spec.unflatten(noised)


def second_moment_stddevs(
    noise_multiplier: float, sensitivity: float, squared_sensitivity: float, share: float = DEFAULT_SECOND_MOMENT_SHARE
) -> tuple[float, float]:
    """The stddevs ``(s_1, s_2)`` of the gradient and squared-gradient streams under one budget.

    ``s_1 = z * D_1 / sqrt(1 - share)`` and ``s_2 = z * D_2 / sqrt(share)``, so that
    ``(D_1 / s_1)**2 + (D_2 / s_2)**2 = z**-2``: the pair is one Gaussian mechanism with
    noise multiplier ``z`` (see the module docstring; :func:`joint_noise_multiplier`).

    Privacy: exactly the cost of ``gaussian(noise_multiplier)``.

    Example:
        >>> s1, s2 = second_moment_stddevs(2.0, 0.5, 0.25, share=0.5)
        >>> round(s1, 6), round(s2, 6), round(joint_noise_multiplier(0.5, s1, 0.25, s2), 12)
        (1.414214, 0.707107, 2.0)
    """
    share = check_second_moment_share(share)
    if noise_multiplier == 0.0:
        return 0.0, 0.0
    return noise_multiplier * sensitivity / math.sqrt(1.0 - share), noise_multiplier * squared_sensitivity / math.sqrt(share)


def joint_noise_multiplier(sensitivity: float, stddev: float, squared_sensitivity: float, squared_stddev: float) -> float:
    """The noise multiplier of two streams released together: ``((D_1/s_1)**2 + (D_2/s_2)**2) ** -0.5``.

    The whitened concatenation ``(x_1 / s_1, x_2 / s_2)`` has unit-variance noise and
    L2 sensitivity ``sqrt((D_1/s_1)**2 + (D_2/s_2)**2)``; its Gaussian-mechanism cost is
    that of ``gaussian(joint_noise_multiplier(...))``. For the per-step stddevs of a
    matrix-factorisation stream, pass the strategy's sensitivity times ``max_norm`` as
    ``D`` and ``noise_multiplier * D`` of the split as ``s``.

    Privacy: none by itself (a calibration formula).

    Example:
        >>> round(joint_noise_multiplier(1.0, 3.0, 1.0, 4.0), 6)
        2.4
    """
    if stddev <= 0 or squared_stddev <= 0:
        return 0.0
    return ((sensitivity / stddev) ** 2 + (squared_sensitivity / squared_stddev) ** 2) ** -0.5


def squared_stream_key(key: RngKey) -> RngKey:
    """The root key of the squared-gradient stream: ``fold_in(key, 2**64 - 1)``.

    The gradient stream's step ``t`` draws from ``fold_in(key, t)``; the counter
    ``2**64 - 1`` is reserved for this root (a paired release refuses that step), so the
    two streams never share a key. Step ``t`` of the squared stream draws from
    ``fold_in(squared_stream_key(key), t)``.

    Privacy: keeps the two streams' noise independent (no key is used twice).

    Example:
        >>> from opake_fx.random import fold_in, key
        >>> squared_stream_key(key(5)) == fold_in(key(5), 2**64 - 1)
        True
    """
    return fold_in(key, SQUARED_STREAM_COUNTER)
