"""Batch-mixing constructions shared by the independence tests (clipping and DPTrainer)."""

from __future__ import annotations

import torch


def shift(h: torch.Tensor) -> torch.Tensor:
    """Row i becomes row i - 1 (row 0 becomes zeros): example i reads its predecessor only,
    so examples 0 and 1 see the same neighbours in batches of 2 and 3 (the old probe's blind spot)."""
    return torch.cat([torch.zeros_like(h[:1]), h[:-1]])


class MixingBackward(torch.autograd.Function):
    """The identity forward; a backward that adds each example's gradient to its successor's row."""

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        return g + torch.roll(g, 1, 0)
