"""Membership scores of canaries, each tagged with its canary id.

A score is any number that is larger when the canary was more likely trained on.
Scores travel with the dataset slots they belong to (:class:`CanaryScores`), so an
estimator can check that it pairs each score with the right coin.

Example:
    >>> s = canary_scores([0.3, -1.0], [7, 2])
    >>> s.canary_ids.tolist(), s.values.tolist()
    ([7, 2], [0.3, -1.0])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from opake_fx.errors import InputValueError

__all__ = ["CanaryScores", "canary_scores", "loss_scores", "gradient_scores"]


@dataclass(frozen=True)
class CanaryScores:
    """Scores (float64 ``[m]``) and the dataset slots they are for (int64 ``[m]``, distinct)."""

    values: np.ndarray
    canary_ids: np.ndarray


def canary_scores(values: Any, canary_indices: Sequence[int] | np.ndarray) -> CanaryScores:
    """Tags ``values[j]`` with the canary slot ``canary_indices[j]``.

    Raises:
        InputValueError: the lengths differ, an id repeats, or a score is NaN (a NaN
            would be ranked arbitrarily and silently change the bound).
    """
    v = np.asarray(values.detach().cpu().double().numpy() if hasattr(values, "detach") else values,
                   dtype=np.float64).reshape(-1)
    ids = np.asarray(canary_indices, dtype=np.int64).reshape(-1)
    if v.size != ids.size:
        raise InputValueError(
            f"canary_scores: {v.size} scores for {ids.size} canary ids; give exactly one score per canary, in the "
            "order of canary_indices."
        )
    if np.unique(ids).size != ids.size:
        raise InputValueError("canary_scores: canary_indices has duplicates; each canary gets one score.")
    if np.isnan(v).any():
        raise InputValueError(
            f"canary_scores: {int(np.isnan(v).sum())} scores are NaN (e.g. canary ids {ids[np.isnan(v)][:5].tolist()}); "
            "fix the scoring (a diverged model?) rather than auditing with them."
        )
    return CanaryScores(values=v, canary_ids=ids)


def loss_scores(loss_fn: Callable[..., Any], params: Any, batch: Sequence[Any],
                canary_indices: Sequence[int] | np.ndarray) -> CanaryScores:
    """``-loss`` of each canary under ``params`` (a trained-on canary tends to have a lower loss).

    Args:
        loss_fn: ``loss_fn(params, *batch)`` returning per-example losses ``[m]``.
        params: the trained parameters.
        batch: the canaries' tensors, row ``j`` for ``canary_indices[j]``.
        canary_indices: their dataset slots.

    Example:
        >>> import torch
        >>> s = loss_scores(lambda p, x: (x - p) ** 2, torch.tensor(1.0), [torch.tensor([1.0, 3.0])], [4, 9])
        >>> s.values.tolist()
        [-0.0, -4.0]
    """
    import torch

    with torch.no_grad():
        losses = loss_fn(params, *batch)
    return canary_scores(-losses.reshape(-1), canary_indices)


def gradient_scores(loss_fn: Callable[..., Any], params: Any, batch: Sequence[Any], update: Any,
                    canary_indices: Sequence[int] | np.ndarray) -> CanaryScores:
    """``-<grad loss_j(params), update>`` for each canary: how far the run moved against its gradient.

    ``update`` is the model's total update ``params_final - params_initial`` (a pytree
    like ``params``); gradient descent on a canary moves the parameters against its
    gradient, so an included canary tends to score higher (Steinke et al.'s white-box
    attack; with Dirac canaries use :meth:`DiracCanaries.scores`, the same number
    without autograd).

    Args:
        loss_fn: ``loss_fn(params, *example)`` returning the scalar loss of ONE example.
        params: where the gradients are taken (usually the initial parameters).
        batch: the canaries' tensors, row ``j`` for ``canary_indices[j]``.
        update: the total update, same structure as ``params``.
        canary_indices: their dataset slots.

    Example:
        >>> import torch
        >>> loss = lambda p, x: (p * x).sum()            # gradient x
        >>> s = gradient_scores(loss, torch.zeros(2), [torch.tensor([[1.0, 0.0], [0.0, 1.0]])],
        ...                     torch.tensor([-2.0, 0.5]), [0, 1])
        >>> s.values.tolist()
        [2.0, -0.5]
    """
    import optree
    import torch
    from torch.func import grad, vmap

    in_dims = (None,) + (0,) * len(batch)
    grads = vmap(grad(loss_fn), in_dims=in_dims)(params, *batch)
    g_leaves, g_spec = optree.tree_flatten(grads)
    u_leaves, u_spec = optree.tree_flatten(update)
    if g_spec != u_spec:
        raise InputValueError(f"gradient_scores: update's structure {u_spec} differs from the parameters' {g_spec}.")
    with torch.no_grad():
        total = sum((g.reshape(g.shape[0], -1).double() @ u.reshape(-1).double()) for g, u in zip(g_leaves, u_leaves))
    return canary_scores(-total, canary_indices)
