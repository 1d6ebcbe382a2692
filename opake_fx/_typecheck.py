"""The runtime type checker behind :func:`opake_fx.typing.typechecked`, without torch.

:mod:`opake_fx.typing` re-exports :func:`typechecked` next to its jaxtyping aliases,
which need torch. The torch-free modules (:mod:`opake_fx.accounting`,
:mod:`opake_fx.dpsgd.accounting`) import it from here, so that importing them still does
not import torch.
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any, Callable, TypeVar

from beartype import BeartypeConf, beartype

from opake_fx.errors import InputTypeError

__all__ = ["typechecked"]

_F = TypeVar("_F", bound=Callable[..., Any])


class _ParameterTypeError(InputTypeError):
    """A beartype parameter violation (re-raised as a plain InputTypeError with its fix)."""


# is_pep484_tower: an int is accepted where a float is annotated (batch sizes, norms).
_CONF = BeartypeConf(
    violation_type=InputTypeError, violation_param_type=_ParameterTypeError, is_pep484_tower=True, is_color=False
)

# How to fix a wrongly typed argument, by parameter name (library-wide conventions).
FIXES = {
    "key": "Make keys with opake_fx.random.key(seed); derive more with split(key) or fold_in(key, i).",
    "sample_rate": "Pass a number in [0, 1], e.g. expected_batch_size / len(dataset).",
    "learning_rate": "Pass a number or a schedule from opake_fx.scheduling, e.g. cosine(0.1, n_steps).",
    "schedule": "Pass a schedule from opake_fx.scheduling; wrap a number as constant(value).",
    "noise_multiplier": "Pass a number >= 0; calibrate it for a target epsilon with opake_fx.accounting.calibrate.",
    "clipping_norm": "Pass a number > 0, or a PerGroup from opake_fx.dpsgd.clipping.per_group.",
    "budget": "Build it with opake_fx.accounting.epsilon_budget(eps, delta=...) or delta_budget(delta, eps=...).",
    "inner": "Build the per-step process with opake_fx.dpsgd.accounting, e.g. gaussian(noise_multiplier).",
    "strategy": "Build it with an opake_fx.dpftrl strategy factory, e.g. band_mf_strategy(n_steps, bands).",
    "dataset": "Pass the dataset (anything with len()) or its size as an int.",
}
_PARAM = re.compile(r"parameter (\w+)=")


def typechecked(fn: _F) -> _F:
    """Checks ``fn``'s annotated argument and return types at call time (beartype).

    A violation raises :class:`~opake_fx.errors.InputTypeError` with beartype's message,
    which names the parameter, the hint and the value received, followed by how to fix
    it for the parameters the library knows (:data:`FIXES`).
    """
    checked = beartype(conf=_CONF)(fn)
    if inspect.isclass(fn):
        return checked

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return checked(*args, **kwargs)
        except _ParameterTypeError as e:
            message = str(e)
            match = _PARAM.search(message)
            fix = FIXES.get(match.group(1)) if match else None
            raise InputTypeError(f"{message} {fix}" if fix else message) from None

    return call  # type: ignore[return-value]
