"""The registry a plan looks its parts up in: one per kind (sampling, mechanism, clip mode).

A :class:`~opake_fx.plan.DPPlan` names its parts by string (``sampling="poisson"``,
``mechanism="band_mf"``, ``clipping_mode="auto"``) so that it stays plain, serialisable
data; the registry turns each name into the object that owns that part's behaviour (its
stage, its checks, its share of the accounting). The plan holds no table of names: the
valid values, their order in error messages and the pairs that go together are read from
the registries.

The registries are filled once, in their package's ``__init__`` (one line a part): a
closed extension point, like the per-layer clip rules' registry. A new part is one module
and one line there, reviewed with the privacy argument for its accounting.
:meth:`Registry.register` / :meth:`Registry.unregister` are public so that a research
fork or a test can try a part without editing the package (``docs/design-notes.md``
walks through one); a plan built with such a part carries only the guarantee its author
proved.

Example:
    >>> from opake_fx.planning.samplers import SAMPLING
    >>> SAMPLING.names()[:2]
    ('poisson', 'truncated_poisson')
    >>> SAMPLING.get("poisson").name
    'poisson'
    >>> SAMPLING.get("uniform", "DPPlan")
    Traceback (most recent call last):
      ...
    opake_fx.errors.InputValueError: DPPlan: sampling must be one of ('poisson', 'truncated_poisson', 'cyclic_poisson', 'b_min_sep', 'balls_in_bins'); got 'uniform'.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, Protocol, TypeVar

import opake_fx.validation as check
from opake_fx.errors import InputValueError

__all__ = ["Registry", "Named"]


class Named(Protocol):
    """What a registered part has: its ``name`` (the string a plan is given)."""

    name: str


PartT = TypeVar("PartT", bound=Named)


class Registry(Generic[PartT]):
    """Parts of one kind by name, in registration order.

    Args:
        field: the plan field that names a part of this kind (``"sampling"``), used in
            error messages.
        parts: the parts, in the order their names are listed.

    Raises:
        InputValueError: two parts with one name.
    """

    def __init__(self, field: str, parts: Iterable[PartT] = ()) -> None:
        self.field = field
        self._parts: dict[str, PartT] = {}
        for part in parts:
            self.register(part)

    def register(self, part: PartT) -> PartT:
        """Adds ``part`` under ``part.name`` (last in the listing) and returns it.

        Raises:
            InputValueError: a part of that name is registered already (unregister it first).
        """
        if part.name in self._parts:
            raise InputValueError(f"a {self.field} part named {part.name!r} is registered already; unregister it first.")
        self._parts[part.name] = part
        return part

    def unregister(self, name: str) -> None:
        """Removes the part named ``name`` (an ``InputValueError`` listing the names if there is none)."""
        self.get(name, f"{self.field} registry")
        del self._parts[name]

    def names(self) -> tuple[str, ...]:
        """The registered names, in order."""
        return tuple(self._parts)

    def parts(self) -> tuple[PartT, ...]:
        """The registered parts, in order."""
        return tuple(self._parts.values())

    def get(self, name: object, where: str = "DPPlan") -> PartT:
        """The part named ``name``; an ``InputValueError`` that lists the valid names otherwise."""
        check.choice(name, self.field, where, self.names())
        return self._parts[name]  # type: ignore[index]
