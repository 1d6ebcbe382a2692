"""Automatic clipping (AUTO-S, Bu et al. 2023): :func:`auto_clipped_grad`."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch
from torch import nn

from opake_fx.dpsgd.clipping._engine import check_clipping_norm, clipped_step, make_config, package
from opake_fx.dpsgd.clipping._ghost import ClipBackend, make_backend
from opake_fx.dpsgd.clipping.types import FixedClipState, check_state
from opake_fx.functional import FunctionalModel
from opake_fx.errors import InputValueError

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
) -> tuple[Callable[..., Any], FixedClipState]:
    """Like :func:`clipped_grad`, but every gradient is normalised: ``R g / (||g|| + gamma)``.

    AUTO-S ("Automatic Clipping", Bu et al., NeurIPS 2023) removes the clip norm as a
    hyperparameter: every example contributes a vector of norm just under ``R``
    (``clipping_norm``), so the learning rate absorbs the scale. ``gamma > 0`` keeps
    small gradients from being blown up.

    ``clip_backend`` / ``model`` select the per-example norm backend exactly as in
    :func:`clipped_grad` (``"ghost"`` / ``"auto"`` take a batched ``loss_fn`` returning
    per-example losses); the weight rule does not depend on how norms are obtained.

    Privacy:
        Each scaled gradient has norm ``R ||g|| / (||g|| + gamma) < R``, so the sum has
        add-or-remove sensitivity ``max_norm = R / normalize_by``, the same as
        :func:`clipped_grad` with ``clipping_norm=R``: account for it identically.

    Example:
        >>> import torch
        >>> f = lambda p, x: ((x - p) ** 2).sum()
        >>> g, s = auto_clipped_grad(f, clipping_norm=1.0, gamma=0.0)
        >>> out, s = g(torch.tensor(0.0), torch.tensor([5.0, -2.0]), state=s)
        >>> float(out.pytree)
        0.0
    """
    check_clipping_norm(clipping_norm)
    if not math.isfinite(clipping_norm):
        raise InputValueError("auto_clipped_grad needs a finite clipping_norm R: it scales every gradient to norm ~R.")
    if not (isinstance(gamma, (int, float)) and gamma >= 0 and math.isfinite(gamma)):
        raise InputValueError(f"gamma must be a finite number >= 0; got {gamma!r} (Bu et al. use 0.01).")
    cfg = make_config(
        argnums,
        batch_argnums,
        has_aux=has_aux,
        normalize_by=normalize_by,
        microbatch_size=microbatch_size,
        dtype=dtype,
        return_aux=return_aux,
        return_stats=return_stats,
    )
    backend = make_backend(clip_backend, model)

    def weights(norms: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
        denom = norms + gamma
        w = bounds.unsqueeze(1) / denom
        # A zero gradient (with gamma = 0) contributes zero whatever its weight.
        return torch.where(denom > 0, w, torch.zeros_like(w))

    def grad_fn(*args: Any, state: FixedClipState | None = None, **kwargs: Any) -> Any:
        check_state(state, FixedClipState, "auto_clipped_grad")
        result = clipped_step(loss_fn, args, kwargs, cfg, clipping_norm=clipping_norm, weight_fn=weights, backend=backend)
        return package(result, cfg, clipping_norm, replace(state, step=state.step + 1))

    return grad_fn, FixedClipState(clipping_norm=clipping_norm)
