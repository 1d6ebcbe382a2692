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
namespace: :func:`opake_fx.pytree.tree_map` reaches their tensors and the metadata
travels unchanged. Noise stages read ``max_norm`` from the value instead of being told
it, so they cannot be given the wrong sensitivity.

Example:
    >>> import torch
    >>> g = ClippedPytree((torch.ones(3),), max_norm=0.25)
    >>> (2 * g).max_norm
    0.5
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from numbers import Real
from types import MappingProxyType
from typing import Any, Mapping

import optree
import torch

from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.pytree import NAMESPACE, tree_map

__all__ = [
    "PerGroup",
    "ClippedPytree",
    "NoisedPytree",
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
    arithmetic allowed is multiplication or division by a public scalar, which
    scales ``max_norm`` too; anything else must be done on ``.pytree`` and re-wrapped
    with an explicit ``max_norm``.
    """

    pytree: Any
    max_norm: MaxNorm

    @property
    def sensitivity(self) -> float:
        """The scalar L2 sensitivity (``max_norm``, or its ``effective`` value)."""
        return float(self.max_norm.effective) if isinstance(self.max_norm, PerGroup) else float(self.max_norm)

    def _scaled(self, factor: float) -> ClippedPytree:
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
        """``Tensor.to`` on every leaf; metadata unchanged."""
        return replace(self, pytree=tree_map(lambda leaf: leaf.to(*args, **kwargs), self.pytree))


@dataclass(frozen=True)
class NoisedPytree(ClippedPytree):
    """A privatised gradient: a :class:`ClippedPytree` plus Gaussian noise.

    ``noise_stddev`` is the standard deviation of the noise that was added (a float,
    or a :class:`PerGroup` of per-group stddevs); ``max_norm`` still describes the
    sensitivity of the value before noise. Anything computed from a ``NoisedPytree``
    is post-processing of the Gaussian mechanism.
    """

    noise_stddev: Any = None

    def _scaled(self, factor: float) -> NoisedPytree:
        out = super()._scaled(factor)
        stddev = None if self.noise_stddev is None else abs(factor) * self.noise_stddev
        return replace(out, noise_stddev=stddev)


@dataclass(frozen=True)
class SecondMomentClippingOutput:
    """Clipped gradients paired with clipped squared gradients (two DP streams)."""

    grads: ClippedPytree
    squared_grads: ClippedPytree

    def clone(self) -> SecondMomentClippingOutput:
        return SecondMomentClippingOutput(self.grads.clone(), self.squared_grads.clone())


@dataclass(frozen=True)
class SecondMomentNoiseOutput:
    """Noised gradients paired with noised squared gradients."""

    noisy_grads: NoisedPytree
    noisy_squared_grads: NoisedPytree

    def clone(self) -> SecondMomentNoiseOutput:
        return SecondMomentNoiseOutput(self.noisy_grads.clone(), self.noisy_squared_grads.clone())


def _public_scalar(x: Any, op: str) -> float:
    if isinstance(x, bool) or not isinstance(x, Real) or not math.isfinite(float(x)):
        raise InputTypeError(
            f"{op} needs a public, finite real scalar; got {type(x).__name__}. "
            "Scaling by a tensor (which may depend on private data) would break the sensitivity bound."
        )
    return float(x)


def _register(cls: type, children: tuple[str, ...]) -> None:
    meta_names = tuple(f.name for f in fields(cls) if f.name not in children)

    def flatten(obj: Any) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[str, ...]]:
        return tuple(getattr(obj, n) for n in children), tuple(getattr(obj, n) for n in meta_names), children

    def unflatten(meta: tuple[Any, ...], kids: Any) -> Any:
        return cls(**dict(zip(children, kids)), **dict(zip(meta_names, meta)))

    optree.register_pytree_node(cls, flatten, unflatten, namespace=NAMESPACE)


_register(ClippedPytree, ("pytree",))
_register(NoisedPytree, ("pytree",))
_register(SecondMomentClippingOutput, ("grads", "squared_grads"))
_register(SecondMomentNoiseOutput, ("noisy_grads", "noisy_squared_grads"))
