"""Values that carry their privacy guarantee: the types flowing between DP stages.

* :class:`ClippedPytree` — a sum of per-example gradients, each clipped to L2 norm
  ``<= C``, divided by ``normalize_by``; ``max_norm = C / normalize_by`` is its L2
  sensitivity under add-or-remove-one neighbours.
* :class:`NoisedPytree` — a ``ClippedPytree`` after the Gaussian mechanism, with the
  realised ``noise_stddev``.
* :class:`PerGroup` — per-parameter-group values (clip norms, stddevs).
* :class:`SecondMomentClippingOutput` / :class:`SecondMomentNoiseOutput` — paired
  first- and second-moment streams.

All are frozen dataclasses registered as optree nodes in the ``"opake_fx"``
namespace, so :func:`opake_fx.pytree.leaves` and friends reach their tensors. Noise
stages read ``max_norm`` from the value instead of being told it, so they cannot be
given the wrong sensitivity.

A guarantee is never inherited by accident. The values validate themselves at
construction (``max_norm`` a real number > 0, or ``inf`` for "not clipped";
``noise_stddev`` a finite real >= 0 or ``None``), and any generic map —
:func:`opake_fx.pytree.tree_map`, ``optree.tree_map(..., namespace="opake_fx")``, or
anything else that rebuilds the node from its leaves — returns the *plain* inner pytree,
which noise stages refuse. The operations that keep the guarantee prove it: ``*`` and
``/`` by a public scalar (``max_norm`` scales by ``|factor|``), and
:meth:`ClippedPytree.map` (one function for every leaf) or
:meth:`ClippedPytree.map_with_path` (a function of the leaf's path, e.g. a per-layer
scale) with a declared Lipschitz bound. On a :class:`NoisedPytree`,
``map_with_path`` needs no bound: it is post-processing.

Example:
    >>> import torch
    >>> from opake_fx.pytree import tree_map
    >>> g = ClippedPytree((torch.ones(3),), max_norm=0.25)
    >>> (2 * g).max_norm
    0.5
    >>> type(tree_map(lambda x: 10 * x, g)).__name__    # the guarantee is dropped
    'tuple'
    >>> g.map(lambda x: 10 * x, lipschitz=10.0).max_norm  # ... unless the map declares its bound
    2.5
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from numbers import Real
from types import MappingProxyType
from typing import Any, Callable, ClassVar, Mapping, Self

import optree
import torch

from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.pytree import NAMESPACE, tree_flatten_with_paths, tree_map

__all__ = [
    "PerGroup",
    "ClippedPytree",
    "NoisedPytree",
    "RowShardedClippedPytree",
    "SecondMomentClippingOutput",
    "SecondMomentNoiseOutput",
    "EmptyState",
]

ParamPath = tuple[Any, ...]


@dataclass(frozen=True)
class EmptyState:
    """The state of a stateless transform."""


@dataclass(frozen=True)
class PerGroup:
    """Per-group scalars with a fixed assignment of parameter leaves to groups.

    Attributes:
        groups: leaf path (a tuple, as :func:`opake_fx.pytree.tree_flatten_with_paths`
            gives it; a bare string ``s`` means ``(s,)``) -> group name.
        values: group name -> value (a clip norm, a noise stddev, ...).

    ``effective`` is ``sqrt(sum v**2)``: for per-group clip norms ``C_g`` it is the
    L2 sensitivity of the whole clipped gradient, which is what accounting uses.

    Example:
        >>> pg = PerGroup({"w": "dense", "b": "bias"}, {"dense": 3.0, "bias": 4.0})
        >>> pg.effective
        5.0
        >>> (pg / 2).values["bias"]
        2.0
    """

    groups: Mapping[Any, str]
    values: Mapping[str, float]

    def __post_init__(self) -> None:
        normalized = {(k,) if not isinstance(k, tuple) else k: g for k, g in self.groups.items()}
        missing = set(normalized.values()) - set(self.values)
        if missing:
            raise InputValueError(
                f"PerGroup assigns leaves to groups {sorted(missing)} that have no value; "
                f"values has {sorted(self.values)}. Give every group a value."
            )
        for name, v in self.values.items():
            if isinstance(v, bool) or not isinstance(v, Real) or math.isnan(v) or v < 0:
                raise InputValueError(f"PerGroup value for group {name!r} must be a real number >= 0; got {v!r}.")
        object.__setattr__(self, "groups", MappingProxyType(normalized))
        object.__setattr__(self, "values", MappingProxyType({k: float(v) for k, v in self.values.items()}))

    def __hash__(self) -> int:
        return hash((tuple(sorted(self.groups.items(), key=repr)), tuple(sorted(self.values.items()))))

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, PerGroup)
            and dict(self.groups) == dict(other.groups)
            and dict(self.values) == dict(other.values)
        )

    @property
    def effective(self) -> float:
        """``sqrt(sum of squared values)``: the overall L2 value."""
        return math.sqrt(sum(v * v for v in self.values.values()))

    def for_path(self, path: Any) -> float:
        """The value of the group that the leaf at ``path`` belongs to."""
        p = path if isinstance(path, tuple) else (path,)
        if p not in self.groups:
            raise InputValueError(f"leaf path {p} is not assigned to any group of this PerGroup.")
        return self.values[self.groups[p]]

    def map(self, fn: Any) -> PerGroup:
        """A ``PerGroup`` with ``fn`` applied to every value."""
        return PerGroup(dict(self.groups), {k: fn(v) for k, v in self.values.items()})

    def __mul__(self, other: Any) -> PerGroup:
        if isinstance(other, PerGroup):
            if dict(other.groups) != dict(self.groups):
                raise InputValueError("PerGroup * PerGroup needs the same group assignment on both sides.")
            return PerGroup(dict(self.groups), {k: v * other.values[k] for k, v in self.values.items()})
        s = _public_scalar(other, "PerGroup *")
        return self.map(lambda v: v * s)

    __rmul__ = __mul__

    def __truediv__(self, other: Any) -> PerGroup:
        s = _public_scalar(other, "PerGroup /")
        return self.map(lambda v: v / s)


MaxNorm = Any  # float | PerGroup


@dataclass(frozen=True)
class ClippedPytree:
    """A pytree whose dependence on any one example is bounded in L2 norm by ``max_norm``.

    Produced by :func:`opake_fx.dpsgd.clipping.clipped_grad` and the ``clip`` stage:
    the sum of per-example gradients, each clipped to norm ``<= C``, divided by
    ``normalize_by``, so ``max_norm = C / normalize_by``.

    Privacy contract: adding or removing one example changes ``pytree`` by at most
    ``max_norm`` in L2 norm (``max_norm.effective`` for :class:`PerGroup`). The only
    operations that keep the wrapper are multiplication or division by a public scalar
    (``max_norm`` scales by ``|factor|``), :meth:`map` and :meth:`map_with_path` with a
    declared Lipschitz bound, and :meth:`to` for a device move or a widening cast (a rounding cast is
    refused). Any other map (:func:`opake_fx.pytree.tree_map` included) returns the plain
    pytree, which noise stages refuse; re-wrap it only with a ``max_norm`` you can justify.

    ``max_norm`` must be a real number > 0 (``inf`` means "not clipped": noise stages
    accept it only with ``noise_multiplier=0``) or a :class:`PerGroup` with a positive
    ``effective`` value. Zero is refused: it would state that the value depends on no
    example at all, so a noise stage would add no noise; it only ever comes from a
    mistake (a hand-wrapped gradient, a scale by 0, ``normalize_by=inf``). A value that
    really depends on no example needs no DP wrapper.

    Raises:
        InputTypeError: ``max_norm`` is not a real number or a ``PerGroup`` (a tensor,
            which could depend on private data, included).
        InputValueError: ``max_norm`` is negative, zero or NaN.

    Example:
        >>> import torch
        >>> ClippedPytree((torch.ones(2),), max_norm=0.5).sensitivity
        0.5
        >>> ClippedPytree((torch.ones(2),), max_norm=-1.0)
        Traceback (most recent call last):
        ...
        opake_fx.errors.InputValueError: ClippedPytree max_norm must be > 0 (the L2 sensitivity C / normalize_by, or inf for an unclipped value); got -1.0. A negative bound is meaningless: pass the clip norm divided by the batch normalisation.
    """

    pytree: Any
    max_norm: MaxNorm

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_norm", _check_max_norm(self.max_norm, type(self).__name__))

    @property
    def sensitivity(self) -> float:
        """The scalar L2 sensitivity (``max_norm``, or its ``effective`` value)."""
        return float(self.max_norm.effective) if isinstance(self.max_norm, PerGroup) else float(self.max_norm)

    def map(self, fn: Callable[[Any], Any], *, lipschitz: float) -> ClippedPytree:
        """Applies ``fn`` to every tensor leaf; ``max_norm`` becomes ``lipschitz * max_norm``.

        Args:
            fn: a function of one tensor leaf (applied to all of them).
            lipschitz: ``L`` > 0 such that the leafwise map ``F`` satisfies
                ``||F(x) - F(y)|| <= L * ||x - y||`` (L2 over the whole tree) for all
                ``x, y``: e.g. ``L = |a|`` for ``x -> a * x + b``, ``L = 1`` for a clamp
                or a ReLU.

        Returns:
            A ``ClippedPytree`` (a :class:`NoisedPytree` for one) holding ``fn``'s output.

        Privacy: the caller declares that ``fn`` changes distances by at most
        ``lipschitz``; then the output's sensitivity is at most ``lipschitz * max_norm``
        (the map is applied to both neighbouring values). Without that declaration a
        map (:func:`opake_fx.pytree.tree_map`) returns a plain pytree, which noise
        stages refuse. A wrong declaration is the caller's privacy bug.

        Raises:
            InputValueError: ``lipschitz`` is not a finite real number > 0.

        Example:
            >>> import torch
            >>> g = ClippedPytree({"w": torch.tensor([-1.0, 2.0])}, max_norm=0.5)
            >>> out = g.map(lambda x: 3 * x.clamp(min=0), lipschitz=3.0)
            >>> out.max_norm, out.pytree["w"].tolist()
            (1.5, [0.0, 6.0])
        """
        factor = _lipschitz(lipschitz, type(self).__name__)
        return self._mapped(fn, factor)

    def map_with_path(self, fn: Callable[[ParamPath, Any], Any], *, lipschitz: float) -> ClippedPytree:
        """Applies ``fn(path, leaf)`` to every tensor leaf; ``max_norm`` becomes ``lipschitz * max_norm``.

        A per-leaf map: ``path`` is the leaf's path in ``pytree`` (the tuple of keys and
        indices, as :func:`opake_fx.pytree.tree_flatten_with_paths` gives it, e.g.
        ``("encoder", "weight")``), so each layer can get its own function (a per-layer
        scale, a per-layer clamp) without unwrapping and re-wrapping by hand.

        Args:
            fn: ``fn(path, leaf) -> new leaf``; a function of that one leaf and public
                constants (the path, hyperparameters) only.
            lipschitz: ``L`` > 0 with ``L >= L_p`` for every leaf path ``p``, where ``L_p``
                bounds the leaf's own map: ``||fn(p, x) - fn(p, y)|| <= L_p * ||x - y||``
                (L2 over the leaf) for all ``x, y``. Pass the **maximum** over leaves of
                the per-leaf bounds: e.g. ``max(|s_p|)`` for a per-layer scale
                ``x -> s_p * x``.

        Returns:
            A ``ClippedPytree`` (a :class:`NoisedPytree` for one) holding ``fn``'s outputs.

        Privacy: with ``x_p``, ``y_p`` the leaves of two neighbouring values,
        ``||F(x) - F(y)||**2 = sum_p ||fn(p, x_p) - fn(p, y_p)||**2
        <= sum_p L_p**2 ||x_p - y_p||**2 <= (max_p L_p)**2 ||x - y||**2``, so the output's
        sensitivity (add-or-remove-one) is at most ``lipschitz * max_norm`` when
        ``lipschitz >= max_p L_p``. The bound needs each leaf's output to depend on that
        leaf alone: a ``fn`` that reads other leaves (or private data) through a closure
        voids it. A wrong declaration is the caller's privacy bug, as for :meth:`map`. A
        per-group ``max_norm`` is scaled as a whole (every group by ``lipschitz``).

        Raises:
            InputValueError: ``lipschitz`` is not a finite real number > 0.

        Example:
            >>> import torch
            >>> g = ClippedPytree({"w": torch.ones(2), "b": torch.ones(1)}, max_norm=0.5)
            >>> scales = {"w": 2.0, "b": 0.5}
            >>> out = g.map_with_path(lambda path, x: scales[path[-1]] * x, lipschitz=max(scales.values()))
            >>> out.max_norm, out.pytree["w"].tolist(), out.pytree["b"].tolist()
            (1.0, [2.0, 2.0], [0.5])
        """
        factor = _lipschitz(lipschitz, type(self).__name__, "map_with_path")
        return self._mapped_with_path(fn, factor)

    def _mapped(self, fn: Callable[[Any], Any], factor: float) -> ClippedPytree:
        return replace(self, pytree=tree_map(fn, self.pytree), max_norm=factor * self.max_norm)

    def _mapped_with_path(self, fn: Callable[[ParamPath, Any], Any], factor: float | None) -> ClippedPytree:
        # factor None: no bound stated (post-processing of a NoisedPytree only), max_norm becomes inf
        paths, leaves, spec = tree_flatten_with_paths(self.pytree)
        mapped = optree.tree_unflatten(spec, [fn(path, leaf) for path, leaf in zip(paths, leaves)])
        return replace(self, pytree=mapped, max_norm=math.inf if factor is None else factor * self.max_norm)

    def _scaled(self, factor: float) -> ClippedPytree:
        if factor == 0.0:
            raise InputValueError(
                f"{type(self).__name__} * 0 would claim sensitivity 0 (a value that depends on no example), so a "
                "noise stage would add no noise. Scale by a non-zero public scalar, or drop the wrapper "
                "(`.pytree`) if the value is not released."
            )
        return replace(
            self,
            pytree=tree_map(lambda leaf: leaf * factor, self.pytree),
            max_norm=abs(factor) * self.max_norm,
        )

    def __mul__(self, scalar: Any) -> ClippedPytree:
        return self._scaled(_public_scalar(scalar, f"{type(self).__name__} *"))

    __rmul__ = __mul__

    def __truediv__(self, scalar: Any) -> ClippedPytree:
        s = _public_scalar(scalar, f"{type(self).__name__} /")
        if s == 0.0:
            raise InputValueError(f"{type(self).__name__} divided by zero.")
        return self._scaled(1.0 / s)

    def __neg__(self) -> ClippedPytree:
        return self._scaled(-1.0)

    def __add__(self, other: Any) -> Any:
        raise InputTypeError(
            f"{type(self).__name__} + ... would lose track of the sensitivity. Add the `.pytree`s "
            "and wrap the result with the max_norm you can justify."
        )

    __radd__ = __sub__ = __rsub__ = __add__

    def clone(self) -> ClippedPytree:
        """A copy with cloned tensor leaves and the same metadata."""
        return replace(self, pytree=tree_map(torch.clone, self.pytree))

    def detach(self) -> ClippedPytree:
        """A copy with detached tensor leaves and the same metadata."""
        return replace(self, pytree=tree_map(torch.Tensor.detach, self.pytree))

    def to(self, *args: Any, **kwargs: Any) -> ClippedPytree:
        """``Tensor.to`` on every leaf; metadata unchanged.

        Privacy: a move between devices and a widening cast (bfloat16 to float32, float32
        to float64) change no value, so ``max_norm`` still holds. A rounding cast (to a
        narrower float dtype, or to a non-float one) of a ``ClippedPytree`` is refused: it
        rounds every coordinate of the clipped sum, by up to ``u`` of the coordinate, so two
        neighbouring sums can end up further apart than ``max_norm`` (by an amount that
        grows with the sum, not with one example). A :class:`NoisedPytree` may be cast to
        anything: that is post-processing.

        Raises:
            InputValueError: a rounding cast of a ``ClippedPytree``.

        Example:
            >>> import torch
            >>> g = ClippedPytree((torch.ones(2, dtype=torch.bfloat16),), max_norm=0.5)
            >>> g.to(torch.float32).pytree[0].dtype, g.to(torch.float32).max_norm
            (torch.float32, 0.5)
        """
        cast = tree_map(lambda leaf: leaf.to(*args, **kwargs), self.pytree)
        if not isinstance(self, NoisedPytree):
            for before, after in zip(optree.tree_leaves(self.pytree, namespace=NAMESPACE),
                                     optree.tree_leaves(cast, namespace=NAMESPACE)):
                if isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor) and not _widens(before.dtype, after.dtype):
                    raise InputValueError(
                        f"{type(self).__name__}.to({after.dtype}) would round the clipped sum (held in {before.dtype}): two "
                        "neighbouring sums could then differ by more than max_norm. Cast after the noise stage "
                        "(NoisedPytree.to is post-processing), or clip in the narrower dtype (clipped_grad(..., dtype=...))."
                    )
        return replace(self, pytree=cast)


@dataclass(frozen=True)
class RowShardedClippedPytree:
    """This rank's rows of a clipped value that is sharded along every leaf's first axis (FSDP2).

    ``pytree`` holds this rank's shards: leaf ``i`` is rows ``rows[i] = (start, stop)`` of
    a leaf of shape ``full_shapes[i]``; the ranks' shards together are one
    :class:`ClippedPytree` of sensitivity ``max_norm``, summed over the ranks' examples
    (what :func:`opake_fx.distributed.fsdp.reduce_scatter_clipped` makes).

    Privacy contract: adding or removing one example changes the concatenation of every
    rank's shards by at most ``max_norm`` in L2 norm. The noise stages (Gaussian, and
    DP-FTRL's correlated noise) draw each rank's rows of the ONE unsharded noise
    (:func:`opake_fx.random.flat_tree_normal_rows`), so the released whole is the
    unsharded mechanism. It is deliberately not a
    :class:`ClippedPytree` and has no map or scale: a mechanism that drew the same keyed
    noise for every rank's shard would give equal noise to different coordinates (the
    difference of two shards would cancel it), so everything but a rows-aware noise
    stage refuses it.

    Raises:
        InputValueError: ``max_norm`` not a positive real, or leaves, shapes and rows
            that do not line up.

    Example:
        >>> import torch
        >>> v = RowShardedClippedPytree((torch.zeros(2, 3),), max_norm=0.5, full_shapes=((4, 3),), rows=((2, 4),))
        >>> v.sensitivity
        0.5
    """

    pytree: Any
    max_norm: float | PerGroup
    full_shapes: tuple[tuple[int, ...], ...]
    rows: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        m = self.max_norm
        if not isinstance(m, PerGroup) and (
                isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 < m < math.inf):
            raise InputValueError(f"RowShardedClippedPytree max_norm must be a finite real number > 0 or a PerGroup; "
                                  f"got {m!r}.")
        leaves = optree.tree_leaves(self.pytree, namespace=NAMESPACE)
        full = tuple(tuple(int(d) for d in s) for s in self.full_shapes)
        rows = tuple((int(a), int(b)) for a, b in self.rows)
        if not len(leaves) == len(full) == len(rows) or any(
            not 0 <= a <= b <= (s[0] if s else 0) or tuple(leaf.shape) != (b - a, *s[1:])
            for leaf, s, (a, b) in zip(leaves, full, rows)
        ):
            raise InputValueError(
                "RowShardedClippedPytree: each leaf must be rows [start, stop) of its full shape; got leaf shapes "
                f"{[tuple(leaf.shape) for leaf in leaves]}, full shapes {list(full)}, rows {list(rows)}."
            )
        object.__setattr__(self, "max_norm", m if isinstance(m, PerGroup) else float(m))
        object.__setattr__(self, "full_shapes", full)
        object.__setattr__(self, "rows", rows)

    @property
    def sensitivity(self) -> float:
        """The L2 sensitivity of the whole (all ranks' shards together): ``max_norm`` (its ``effective`` value per group)."""
        return float(self.max_norm.effective) if isinstance(self.max_norm, PerGroup) else self.max_norm


@dataclass(frozen=True)
class NoisedPytree(ClippedPytree):
    """A privatised gradient: a :class:`ClippedPytree` plus Gaussian noise.

    ``noise_stddev`` is the standard deviation of the noise that was added (a float,
    or a :class:`PerGroup` of per-group stddevs); ``max_norm`` still describes the
    sensitivity of the value before noise. Anything computed from a ``NoisedPytree``
    is post-processing of the Gaussian mechanism.
    """

    noise_stddev: Any = None

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "noise_stddev", _check_noise_stddev(self.noise_stddev))

    def map(self, fn: Callable[[Any], Any], *, lipschitz: float) -> NoisedPytree:
        """As :meth:`ClippedPytree.map`; ``noise_stddev`` becomes ``None`` (no longer known).

        After a general map the noise is no longer Gaussian with a known stddev (a
        clamp shrinks it, a nonlinear map reshapes it), so ``noise_stddev`` is dropped;
        use ``*`` or ``/`` by a public scalar to keep an exact ``noise_stddev``.

        Privacy: everything computed from a ``NoisedPytree`` is post-processing of the
        Gaussian mechanism; ``max_norm`` scales by ``lipschitz`` as for a ``ClippedPytree``.

        Example:
            >>> import torch
            >>> n = NoisedPytree((torch.ones(2),), max_norm=0.5, noise_stddev=1.0)
            >>> m = n.map(torch.tanh, lipschitz=1.0)
            >>> m.max_norm, m.noise_stddev
            (0.5, None)
        """
        factor = _lipschitz(lipschitz, type(self).__name__)
        return replace(self._mapped(fn, factor), noise_stddev=None)

    def map_with_path(self, fn: Callable[[ParamPath, Any], Any], *, lipschitz: float | None = None) -> NoisedPytree:
        """Post-processing: applies ``fn(path, leaf)`` to every leaf; the result is still a ``NoisedPytree``.

        As :meth:`ClippedPytree.map_with_path`, but no Lipschitz bound is needed: anything
        computed from a noised value (and public data) is post-processing of the Gaussian
        mechanism, so the output keeps the privacy guarantee of the noise that was added.
        ``noise_stddev`` becomes ``None`` (a per-leaf map leaves no single known stddev;
        use ``*`` or ``/`` by a public scalar to keep an exact one). ``max_norm``, the
        sensitivity of the value before noise, becomes ``lipschitz * max_norm`` when
        ``lipschitz`` (the maximum over leaves of the per-leaf bounds, as there) is given,
        and ``inf`` (no bound stated) when it is not.

        Privacy: post-processing; ``fn`` must read only its leaf, the path and public data
        (a closure over private data, the clipped gradient included, is not
        post-processing).

        Example:
            >>> import torch
            >>> n = NoisedPytree({"w": torch.ones(2), "b": torch.ones(1)}, max_norm=0.5, noise_stddev=1.0)
            >>> out = n.map_with_path(lambda path, x: x * (2.0 if path == ("w",) else 1.0))
            >>> type(out).__name__, out.noise_stddev, out.pytree["w"].tolist()
            ('NoisedPytree', None, [2.0, 2.0])
        """
        factor = None if lipschitz is None else _lipschitz(lipschitz, type(self).__name__, "map_with_path")
        return replace(self._mapped_with_path(fn, factor), noise_stddev=None)

    def _scaled(self, factor: float) -> NoisedPytree:
        out = super()._scaled(factor)
        stddev = None if self.noise_stddev is None else abs(factor) * self.noise_stddev
        return replace(out, noise_stddev=stddev)


class _StreamPair:
    """Base of the two-stream outputs: both dataclass fields hold a ``_stream`` pytree.

    Each stream is checked on construction and cloned with the pair.
    """

    _stream: ClassVar[type]

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, self._stream):
                raise InputTypeError(
                    f"{type(self).__name__}.{f.name} must be a {self._stream.__name__}; got {type(value).__name__}. "
                    "Both streams carry their own sensitivity."
                )

    def clone(self) -> Self:
        return type(self)(*(getattr(self, f.name).clone() for f in fields(self)))


@dataclass(frozen=True)
class SecondMomentClippingOutput(_StreamPair):
    """Clipped gradients paired with clipped squared gradients (two DP streams).

    Made by ``clipped_grad(..., second_moment=True)``: ``grads`` is the usual clipped sum
    (sensitivity ``C / normalize_by``), ``squared_grads`` the sum of the clipped
    per-example gradients squared elementwise (sensitivity ``C**2 / normalize_by``: for a
    clipped ``v``, ``||v * v||_2 <= ||v||_2**2 <= C**2``). One example moves both, so the
    noise stages release the pair as ONE Gaussian mechanism (see
    :mod:`opake_fx.dpsgd.noise`) and the accounting charges it once.

    Example:
        >>> import torch
        >>> g = ClippedPytree((torch.ones(2),), max_norm=0.5)
        >>> pair = SecondMomentClippingOutput(g, ClippedPytree((torch.ones(2),), max_norm=0.25))
        >>> pair.squared_grads.max_norm
        0.25
    """

    grads: ClippedPytree
    squared_grads: ClippedPytree
    _stream: ClassVar[type] = ClippedPytree


@dataclass(frozen=True)
class SecondMomentNoiseOutput(_StreamPair):
    """Noised gradients paired with noised squared gradients (the noise stages' output for a pair).

    Each stream carries its own ``noise_stddev``; together they are one Gaussian release
    with the stage's noise multiplier. ``adam``/``adamw`` feed ``v`` from
    ``noisy_squared_grads``; other optimizers refuse the pair.
    """

    noisy_grads: NoisedPytree
    noisy_squared_grads: NoisedPytree
    _stream: ClassVar[type] = NoisedPytree


def _widens(before: torch.dtype, after: torch.dtype) -> bool:
    """Whether casting ``before`` to ``after`` keeps every value exactly (same or wider float)."""
    return before == after or (after.is_floating_point and torch.promote_types(before, after) == after)


def _public_scalar(x: Any, op: str) -> float:
    if isinstance(x, bool) or not isinstance(x, Real) or not math.isfinite(float(x)):
        raise InputTypeError(
            f"{op} needs a public, finite real scalar; got {type(x).__name__}. "
            "Scaling by a tensor (which may depend on private data) would break the sensitivity bound."
        )
    return float(x)


def _check_max_norm(max_norm: Any, owner: str) -> Any:
    if type(max_norm) is float and max_norm > 0:  # the common case, without the ABC checks below (inf included)
        return max_norm
    if isinstance(max_norm, PerGroup):
        if not max_norm.effective > 0:
            raise InputValueError(
                f"{owner} max_norm is a PerGroup whose values are all 0 (sensitivity 0): a noise stage would add "
                "no noise. Give each group its clip norm divided by the batch normalisation (> 0)."
            )
        return max_norm
    if isinstance(max_norm, torch.Tensor):
        raise InputTypeError(
            f"{owner} max_norm must be a Python number or a PerGroup; got a tensor of shape {tuple(max_norm.shape)}. "
            "The sensitivity must be a public constant (a tensor may depend on private data): pass float(value) "
            "if it is public."
        )
    if isinstance(max_norm, bool) or not isinstance(max_norm, Real):
        raise InputTypeError(
            f"{owner} max_norm must be a real number (C / normalize_by) or a PerGroup; got {type(max_norm).__name__} "
            f"{max_norm!r}."
        )
    value = float(max_norm)
    if math.isnan(value) or value < 0:
        raise InputValueError(
            f"{owner} max_norm must be > 0 (the L2 sensitivity C / normalize_by, or inf for an unclipped value); "
            f"got {value}. A {'NaN' if math.isnan(value) else 'negative'} bound is meaningless: pass the clip norm "
            "divided by the batch normalisation."
        )
    if value == 0.0:
        raise InputValueError(
            f"{owner} max_norm=0 would state that the value depends on no example, so a noise stage would add no "
            "noise at all. It comes from a mistake (a hand-wrapped gradient, a scale by 0, normalize_by=inf): pass "
            "C / normalize_by > 0. A value that really depends on no example needs no DP wrapper."
        )
    return value


def _check_noise_stddev(stddev: Any) -> Any:
    if type(stddev) is float and 0 <= stddev < math.inf:  # the common case, without the ABC checks below
        return stddev
    if stddev is None or isinstance(stddev, PerGroup):
        return stddev  # PerGroup validates its values (real, >= 0, not NaN) itself
    if isinstance(stddev, bool) or isinstance(stddev, torch.Tensor) or not isinstance(stddev, Real):
        raise InputTypeError(
            f"NoisedPytree noise_stddev must be a real number, a PerGroup or None (unknown); got "
            f"{type(stddev).__name__}. It is a public parameter of the mechanism: pass float(value)."
        )
    value = float(stddev)
    if not math.isfinite(value) or value < 0:
        raise InputValueError(
            f"NoisedPytree noise_stddev must be finite and >= 0 (0: a noise_multiplier=0 baseline); got {value}."
        )
    return value


def _lipschitz(lipschitz: Any, owner: str, method: str = "map") -> float:
    if isinstance(lipschitz, bool) or not isinstance(lipschitz, Real) or not (0 < float(lipschitz) < math.inf):
        raise InputValueError(
            f"{owner}.{method} needs lipschitz, a finite real number > 0 bounding how much fn can stretch distances "
            f"(|a| for x -> a * x + b, 1 for a clamp); got {lipschitz!r}. Without a bound, map `.pytree` yourself: "
            "the result is then a plain pytree, which noise stages refuse."
        )
    return float(lipschitz)


def _register(cls: type, children: tuple[str, ...]) -> None:
    meta_names = tuple(f.name for f in fields(cls) if f.name not in children)

    def flatten(obj: Any) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[str, ...]]:
        # The metadata stays in the tree structure (wrappers with different max_norm have
        # different structures), but it is not given back on a rebuild.
        return tuple(getattr(obj, n) for n in children), tuple(getattr(obj, n) for n in meta_names), children

    def unflatten(meta: tuple[Any, ...], kids: Any) -> Any:
        # A rebuild from leaves is a generic map that may have changed the values: the
        # guarantee is dropped (see the module docstring). Wrappers give their plain
        # pytree; the second-moment pairs give a plain tuple of their (plain) streams.
        kids = tuple(kids)
        return kids[0] if len(kids) == 1 else kids

    optree.register_pytree_node(cls, flatten, unflatten, namespace=NAMESPACE)


_register(ClippedPytree, ("pytree",))
_register(NoisedPytree, ("pytree",))
_register(SecondMomentClippingOutput, ("grads", "squared_grads"))
_register(SecondMomentNoiseOutput, ("noisy_grads", "noisy_squared_grads"))
