"""The serializer registry: :func:`register_serializer` and :func:`serializer_for`.

A mapping ``type -> Serializer`` that :func:`~opake_fx.serialization.state_dict` and
:func:`~opake_fx.serialization.from_state_dict` consult for a type that needs more than
its fields. It imports none of the types it holds: users register theirs, and the
library's own (keys, ``PerGroup``, samplers, clip states, the ``Accountant``) are
registered by ``opake_fx.serialization._builtin``, which the package
``opake_fx.serialization`` imports, so they are registered before any function of the
package can run (importing ``opake_fx.serialization.tree`` runs the package first).

Privacy: none by itself; a serializer must save every value that decides future
randomness (keys, step counters), or a resumed run would repeat noise.

Example:
    >>> from opake_fx.random import RngKey
    >>> serializer_for(RngKey) is not None
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from opake_fx.typing import typechecked

__all__ = ["Serializer", "register_serializer", "serializer_for"]


class Serializer(NamedTuple):
    """What :func:`register_serializer` records for a type (see its arguments)."""

    to_tree: Callable[[Any], Any]
    from_tree: Callable[[Any, Any], Any]
    variable_shapes: bool = False
    from_leaf: Callable[[Any, Any], Any] | None = None


# The serializer registry: the one documented piece of module-level state here. Users add
# their types with register_serializer; the library's own are registered by
# opake_fx.serialization._builtin, which the package imports.
_SERIALIZERS: dict[type, Serializer] = {}


@typechecked
def register_serializer(
    cls: type,
    *,
    to_tree: Callable[[Any], Any],
    from_tree: Callable[[Any, Any], Any],
    variable_shapes: bool = False,
    from_leaf: Callable[[Any, Any], Any] | None = None,
) -> type:
    """Teaches :func:`~opake_fx.serialization.state_dict` and ``from_state_dict`` a type of your own.

    ``to_tree(obj)`` returns what to save for ``obj``: any tree that ``state_dict``
    already handles (tensors, plain values, tuples, lists, dicts, dataclasses, other
    registered types). On load, ``to_tree(template)`` gives the structure to read, and
    ``from_tree(template, tree)`` builds the object from the loaded ``tree`` (same
    structure, values from the checkpoint). Subclasses of ``cls`` use its serializer
    unless they have their own; a later registration replaces an earlier one.

    Frozen dataclasses, ``NamedTuple`` states and plain containers need no registration.

    Args:
        cls: the type to serialize.
        to_tree: ``obj -> tree``. With ``variable_shapes``, the structure (which entries
            there are) must not depend on the object's state: give an absent part empty
            tensors and ``None`` values rather than leaving its entries out.
        from_tree: ``(template, tree) -> obj``; raise an ``OpakeError`` (or ``ValueError``)
            for a value that does not fit: it is reported as a :class:`CheckpointError`
            naming the entry.
        variable_shapes: ``True`` for a state whose arrays grow with the run (the
            ``Accountant``'s running composition): a tensor in this type's tree may then
            have any size, with the template's number of dimensions, and must have
            exactly the template's dtype (no precision change on load); a tensor of
            another dtype or rank, or a value that is not a tensor, is still refused with
            its path. ``False`` (default): the template's shapes, as everywhere else.
        from_leaf: ``(template, value) -> obj`` for files written when this type was
            saved as one plain leaf at its path (an earlier format); ``None`` refuses
            such a file (its entry is reported as unknown).

    Returns:
        ``cls``.

    Privacy: none by itself; a serializer must save every value that decides future
    randomness (keys, step counters), or a resumed run would repeat noise.

    Example:
        >>> import torch
        >>> from opake_fx.serialization import from_state_dict, state_dict
        >>> class Ema:
        ...     def __init__(self, avg): self.avg = avg
        >>> _ = register_serializer(Ema, to_tree=lambda e: {"avg": e.avg},
        ...                         from_tree=lambda template, tree: Ema(tree["avg"]))
        >>> flat = state_dict(Ema(torch.ones(2)))
        >>> flat
        {'avg': tensor([1., 1.])}
        >>> from_state_dict(Ema(torch.zeros(2)), flat).avg
        tensor([1., 1.])
    """
    _SERIALIZERS[cls] = Serializer(to_tree, from_tree, variable_shapes, from_leaf)
    return cls


def serializer_for(cls: type) -> Serializer | None:
    """The serializer registered for ``cls`` or its nearest base class, if any.

    Privacy: none (a registry lookup).

    Example:
        >>> from opake_fx.dpsgd.sampling import TruncatedPoissonSampler
        >>> serializer_for(TruncatedPoissonSampler) is serializer_for(TruncatedPoissonSampler.__mro__[1])
        True
        >>> serializer_for(dict) is None
        True
    """
    for base in cls.__mro__:
        if base in _SERIALIZERS:
            return _SERIALIZERS[base]
    return None
