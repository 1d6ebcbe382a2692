"""The runtime type checker behind :func:`opake_fx.typing.typechecked`, without torch.

:mod:`opake_fx.typing` re-exports :func:`typechecked` next to its jaxtyping aliases,
which need torch. The torch-free modules (:mod:`opake_fx.accounting`,
:mod:`opake_fx.dpsgd.accounting`) import it from here, so that importing them still does
not import torch.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from beartype import BeartypeConf, beartype

from opake_fx.errors import InputTypeError

__all__ = ["typechecked"]

_F = TypeVar("_F", bound=Callable[..., Any])

# is_pep484_tower: an int is accepted where a float is annotated (batch sizes, norms).
_CONF = BeartypeConf(violation_type=InputTypeError, is_pep484_tower=True)


def typechecked(fn: _F) -> _F:
    """Checks ``fn``'s annotated argument and return types at call time (beartype).

    A violation raises :class:`~opake_fx.errors.InputTypeError` with beartype's message,
    which names the parameter, the hint and the value received.
    """
    return beartype(conf=_CONF)(fn)
