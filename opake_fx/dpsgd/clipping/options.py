"""The clipping functions' shared keyword arguments, validated once: :class:`ClipConfig`.

:func:`~opake_fx.dpsgd.clipping.clipped_grad`, ``auto_clipped_grad`` and
``adaptive_clipped_grad`` (and their chain stages, which pass their keywords on) share
twelve keyword arguments. Their one entry (``_entry.make_grad_fn``) turns them into one
:class:`ClipConfig` with :meth:`ClipConfig.of`, which checks them all; everything after
that (the engine, the backends, the packaging of the result) reads that value only.
:func:`check_clipping_norm` is the clip-norm check the three functions share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch

from opake_fx.dpsgd.clipping.types import ClipBackend
from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.types import PerGroup

if TYPE_CHECKING:
    from torch import nn

    from opake_fx.functional import FunctionalModel

__all__ = ["ClipConfig", "check_clipping_norm"]


@dataclass(frozen=True)
class ClipConfig:
    """The validated shared options of one clipped-gradient function (made by :meth:`of`).

    The fields are the keyword arguments of :func:`~opake_fx.dpsgd.clipping.clipped_grad`
    (documented there), with the argument positions as tuples.

    Attributes:
        argnums: positions of the differentiated arguments.
        single_argnum: ``argnums`` was one int (the gradient is that argument's pytree,
            not a tuple of them).
        batch_argnums: positions of the arguments with the batch axis.
        has_aux, normalize_by, microbatch_size, dtype, return_aux, return_stats,
            pre_clip, second_moment, clip_backend, model: as given (``normalize_by`` as
            a float).

    Privacy: ``normalize_by`` divides the clipped sum, hence its sensitivity
    (``C / normalize_by``); :meth:`of` accepts only a finite value ``> 0``, so the bound the
    output reports is the one that holds.
    """

    argnums: tuple[int, ...]
    single_argnum: bool
    batch_argnums: tuple[int, ...]
    has_aux: bool
    normalize_by: float
    microbatch_size: int | None
    dtype: torch.dtype | None
    return_aux: bool
    return_stats: bool
    # A per-example map applied to each example's gradient before its norm (vmap backend only).
    pre_clip: Callable[[Any], Any] | None = None
    # Also sum the clipped per-example squared gradients (vmap backend only).
    second_moment: bool = False
    clip_backend: ClipBackend = "vmap"
    model: FunctionalModel | nn.Module | None = None

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> ClipConfig:
        """Checks the shared keywords among a clipping function's ``arguments`` (its ``locals()``).

        ``clip_backend`` and ``model`` are checked where the backend is made
        (``_ghost.make_backend``), since the choice of backend is made there.

        Example:
            >>> shared = dict(argnums=0, has_aux=False, normalize_by=4, batch_argnums=(1, 2), microbatch_size=None,
            ...               return_stats=False, return_aux=False, dtype=None, clip_backend="vmap", model=None,
            ...               pre_clip=None, second_moment=False)
            >>> cfg = ClipConfig.of(shared)
            >>> cfg.argnums, cfg.single_argnum, cfg.batch_argnums, cfg.normalize_by
            ((0,), True, (1, 2), 4.0)
            >>> ClipConfig.of({**shared, "batch_argnums": 0})
            Traceback (most recent call last):
            ...
            opake_fx.errors.InputValueError: argnums=(0,) and batch_argnums=(0,) overlap at [0]: an argument cannot be both differentiated (parameters, no batch axis) and batched (data). Usually argnums=0 (params) and batch_argnums=(1, 2) (inputs, labels).
        """
        given = {f.name: arguments[f.name] for f in fields(cls) if f.name != "single_argnum"}
        arg_t = _as_index_tuple(given["argnums"], "argnums")
        batch_t = _as_index_tuple(given["batch_argnums"], "batch_argnums")
        if not arg_t:
            raise InputValueError("argnums must name at least one argument to differentiate.")
        if not batch_t:
            raise InputValueError("batch_argnums must name at least one argument with a batch axis.")
        overlap = sorted(set(arg_t) & set(batch_t))
        if overlap:
            raise InputValueError(
                f"argnums={arg_t} and batch_argnums={batch_t} overlap at {overlap}: an argument cannot be both "
                "differentiated (parameters, no batch axis) and batched (data). Usually argnums=0 (params) "
                "and batch_argnums=(1, 2) (inputs, labels)."
            )
        normalize_by = given["normalize_by"]
        if isinstance(normalize_by, bool) or not isinstance(normalize_by, (int, float)) or not (
            math.isfinite(normalize_by) and normalize_by > 0
        ):
            raise InputValueError(
                f"normalize_by must be a finite number > 0; got {normalize_by!r}. Use the expected batch size "
                "(sample_rate * dataset_size) to get a mean gradient, or 1.0 for a sum."
            )
        microbatch_size = given["microbatch_size"]
        if microbatch_size is not None and (isinstance(microbatch_size, bool) or not isinstance(microbatch_size, int)
                                            or microbatch_size < 1):
            raise InputValueError(f"microbatch_size must be a positive int or None; got {microbatch_size!r}.")
        if given["return_aux"] and given["return_stats"]:
            raise InputValueError("return_aux and return_stats cannot both be set; ClippedGradAux has the stats fields.")
        pre_clip = given["pre_clip"]
        if pre_clip is not None and not callable(pre_clip):
            raise InputTypeError(
                f"pre_clip must be a function of one example's gradient pytree (returning a pytree of the same "
                f"structure and shapes); got {type(pre_clip).__name__}."
            )
        second_moment = given["second_moment"]
        if not isinstance(second_moment, bool):
            raise InputTypeError(f"second_moment must be a bool; got {type(second_moment).__name__} {second_moment!r}.")
        checked = dict(argnums=arg_t, batch_argnums=batch_t, normalize_by=float(normalize_by))
        return cls(**{**given, **checked}, single_argnum=isinstance(given["argnums"], int))


def check_clipping_norm(clipping_norm: Any, name: str = "clipping_norm") -> None:
    """Rejects negative, NaN and non-numeric clip norms (inf is allowed: no clipping).

    Privacy: the clip norm is the sensitivity's numerator; one that is not ``> 0`` (or a
    ``PerGroup`` with such a group) bounds nothing.

    Example:
        >>> check_clipping_norm(float("inf"))
        >>> check_clipping_norm(-1.0)
        Traceback (most recent call last):
        ...
        opake_fx.errors.InputValueError: clipping_norm must be > 0 (or inf for no clipping); got -1.0. It is the largest L2 norm one example's gradient may have: typical values are 0.1 to 10.
    """
    if isinstance(clipping_norm, PerGroup):
        bad = {g: v for g, v in clipping_norm.values.items() if not v > 0}
        if bad:
            raise InputValueError(f"{name}: per-group clip norms must be > 0; got {bad}.")
        return
    if isinstance(clipping_norm, bool) or not isinstance(clipping_norm, (int, float)):
        raise InputTypeError(f"{name} must be a float or a PerGroup; got {type(clipping_norm).__name__}.")
    if math.isnan(clipping_norm) or clipping_norm <= 0:
        raise InputValueError(
            f"{name} must be > 0 (or inf for no clipping); got {clipping_norm}. It is the largest L2 norm "
            "one example's gradient may have: typical values are 0.1 to 10."
        )


def _as_index_tuple(v: int | Sequence[int], name: str) -> tuple[int, ...]:
    t = (v,) if isinstance(v, int) else tuple(v)
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in t):
        raise InputValueError(f"{name} must be non-negative argument positions; got {v!r}.")
    if len(set(t)) != len(t):
        raise InputValueError(f"{name} has repeated positions: {v!r}.")
    return t
