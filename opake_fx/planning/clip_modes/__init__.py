"""The clip modes of a plan, registered in one place (:data:`CLIP_MODES`).

Each mode is one module with one :class:`~opake_fx.planning.clip_modes.base.ClipMode`;
adding one is a new module and one line in the list below.

Example:
    >>> CLIP_MODES.names()
    ('fixed', 'auto', 'adaptive')
    >>> check_clipping_kwargs("auto", {"gamma": 0.1}, "example")
    {'gamma': 0.1}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.planning.clip_modes.adaptive import AdaptiveClipping, synced_counts
from opake_fx.planning.clip_modes.auto import AutoClipping
from opake_fx.planning.clip_modes.base import ClipMode
from opake_fx.planning.clip_modes.fixed import FixedClipping
from opake_fx.planning.registry import Registry

__all__ = ["CLIP_MODES", "ClipMode", "FixedClipping", "AutoClipping", "AdaptiveClipping", "check_clipping_kwargs",
           "synced_counts"]

CLIP_MODES: Registry[ClipMode] = Registry("clipping_mode", [
    FixedClipping(),
    AutoClipping(),
    AdaptiveClipping(),
])
"""The clip modes a plan can name, in the order error messages list them."""


def check_clipping_kwargs(mode: str, given: Any, where: str) -> Mapping[str, Any]:
    """``clipping_kwargs`` for ``mode`` (``None`` is ``{}``): a dict whose keys the mode takes
    (its :attr:`~opake_fx.planning.clip_modes.base.ClipMode.defaults`); the values are
    checked where the plan fills in the defaults.

    Raises:
        InputTypeError: not a dict.
        InputValueError: a key ``mode`` does not take.

    Example:
        >>> check_clipping_kwargs("fixed", {"gamma": 0.1}, "example")
        Traceback (most recent call last):
          ...
        opake_fx.errors.InputValueError: example: clipping_kwargs ['gamma'] do not apply to clipping_mode='fixed', which takes none.
    """
    given = {} if given is None else given
    if not isinstance(given, Mapping):
        raise InputTypeError(f"{where}: clipping_kwargs must be a dict (or None); got {type(given).__name__}.")
    allowed = CLIP_MODES.get(mode, where).defaults
    unknown = sorted(str(k) for k in set(given) - set(allowed))
    if unknown:
        takes = sorted(allowed) if allowed else "none"
        raise InputValueError(f"{where}: clipping_kwargs {unknown} do not apply to clipping_mode={mode!r}, which takes {takes}.")
    return given
