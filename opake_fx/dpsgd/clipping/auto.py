"""Automatic clipping (AUTO-S, Bu et al. 2023): :func:`auto_clipped_grad`."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
from torch import nn

from opake_fx.dpsgd.clipping._entry import fixed_norm_grad_fn
from opake_fx.dpsgd.clipping.options import check_clipping_norm
from opake_fx.dpsgd.clipping.types import ClipBackend, FixedClipState
from opake_fx.functional import FunctionalModel
from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.types import PerGroup

__all__ = ["auto_clipped_grad"]


def auto_clipped_grad(
    loss_fn: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    clipping_norm: float = 1.0,
    gamma: float = 0.01,
    normalize_by: float = 1.0,
    batch_argnums: int | Sequence[int] = 1,
    microbatch_size: int | None = None,
    return_stats: bool = False,
    return_aux: bool = False,
    dtype: torch.dtype | None = None,
    clip_backend: ClipBackend = "vmap",
    model: FunctionalModel | nn.Module | None = None,
    pre_clip: Callable[[Any], Any] | None = None,
    second_moment: bool = False,
) -> tuple[Callable[..., Any], FixedClipState]:
    """Like :func:`clipped_grad`, but every gradient is normalised: ``R g / (||g|| + gamma)``.

    AUTO-S ("Automatic Clipping", Bu et al., NeurIPS 2023) removes the clip norm as a
    hyperparameter: every example contributes a vector of norm just under ``R``
    (``clipping_norm``), so the learning rate absorbs the scale. ``gamma > 0`` keeps
    small gradients from being blown up.

    The other arguments (``clip_backend`` / ``model``, ``pre_clip``, ``second_moment``,
    microbatching, stats and aux) are those of :func:`clipped_grad`, with the same
    meaning (``"ghost"`` / ``"auto"`` take a batched ``loss_fn`` returning per-example
    losses); the weight rule does not depend on how norms are obtained.

    Privacy:
        Each scaled gradient has norm ``R ||g|| / (||g|| + gamma) < R``, so the sum has
        add-or-remove sensitivity ``max_norm = R / normalize_by``, the same as
        :func:`clipped_grad` with ``clipping_norm=R``: account for it identically (the
        squared stream of ``second_moment=True``: ``R**2 / normalize_by``).

    Example:
        >>> import torch
        >>> f = lambda p, x: ((x - p) ** 2).sum()
        >>> g, s = auto_clipped_grad(f, clipping_norm=1.0, gamma=0.0)
        >>> out, s = g(torch.tensor(0.0), torch.tensor([5.0, -2.0]), state=s)
        >>> float(out.pytree)
        0.0
    """
    check_clipping_norm(clipping_norm)
    if isinstance(clipping_norm, PerGroup):
        raise InputTypeError(
            "auto_clipped_grad takes one clipping_norm R (every gradient is scaled to norm ~R); per-group norms are "
            "not supported. Use clipped_grad(clipping_norm=per_group(...)) for per-group clipping."
        )
    if not math.isfinite(clipping_norm):
        raise InputValueError("auto_clipped_grad needs a finite clipping_norm R: it scales every gradient to norm ~R.")
    if not (isinstance(gamma, (int, float)) and gamma >= 0 and math.isfinite(gamma)):
        raise InputValueError(f"gamma must be a finite number >= 0; got {gamma!r} (Bu et al. use 0.01).")

    def weights(norms: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
        denom = norms + gamma
        w = bounds.unsqueeze(1) / denom
        # A zero gradient (with gamma = 0) contributes zero whatever its weight.
        return torch.where(denom > 0, w, torch.zeros_like(w))

    return fixed_norm_grad_fn("auto_clipped_grad", weights, locals())
