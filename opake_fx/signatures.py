"""A stage factory whose signature is derived from the function it wraps.

A chain stage (``clip``, ``noise``) takes its function's keywords (``clipped_grad``'s,
``gaussian_noise``'s) less a few the stage fixes. Written out twice, the two lists drift
apart; :func:`signature_of` declares them once: the decorated factory gets the function's
signature less ``drop`` (what ``help()``, ``inspect.signature`` and the API pages show),
a call is bound against it (a malformed call is a ``TypeError`` naming the factory), and
the factory receives every argument, defaults filled in, as keywords.

Example:
    >>> import inspect
    >>> def mechanism(*, scale: float, key: int, exact: bool = False) -> tuple:
    ...     return scale, key, exact
    >>> @signature_of(mechanism, drop=("exact",))
    ... def stage(**arguments):
    ...     '''The mechanism as a stage.'''
    ...     return mechanism(**arguments)
    >>> inspect.signature(stage)
    <Signature (*, scale: 'float', key: 'int') -> 'Transform'>
    >>> stage(scale=2.0, key=1), stage.__doc__
    ((2.0, 1, False), 'The mechanism as a stage.')
    >>> stage(scale=2.0)
    Traceback (most recent call last):
      ...
    TypeError: stage() missing a required argument: 'key'
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

__all__ = ["derived_signature", "signature_of"]

F = TypeVar("F", bound=Callable[..., Any])


def derived_signature(function: Callable[..., Any], drop: Sequence[str] = (),
                      return_annotation: Any = "Transform") -> inspect.Signature:
    """``function``'s signature without the parameters named in ``drop``.

    Example:
        >>> derived_signature(lambda x, *, a=1, b=2: None, drop=("b",))
        <Signature (x, *, a=1) -> 'Transform'>
    """
    kept = [p for p in inspect.signature(function).parameters.values() if p.name not in drop]
    return inspect.Signature(kept, return_annotation=return_annotation)


def signature_of(function: Callable[..., Any], drop: Sequence[str] = (),
                 return_annotation: Any = "Transform") -> Callable[[F], F]:
    """Decorates a factory ``f(**arguments)`` with ``function``'s signature less ``drop``.

    Privacy: none by itself; the factory's own contract applies (the function it calls
    checks every argument, as a direct call would).
    """
    signature = derived_signature(function, drop, return_annotation)

    def decorate(factory: F) -> F:
        @functools.wraps(factory)
        def bound(*args: Any, **kwargs: Any) -> Any:
            try:
                call = signature.bind(*args, **kwargs)
            except TypeError as error:
                raise TypeError(f"{factory.__name__}() {error}") from None
            call.apply_defaults()
            return factory(**call.arguments)

        bound.__signature__ = signature  # type: ignore[attr-defined]
        del bound.__wrapped__  # type: ignore[attr-defined]  # (the factory's own **arguments is not the API)
        return bound  # type: ignore[return-value]

    return decorate
