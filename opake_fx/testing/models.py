"""The :func:`small_models` strategy: tiny networks of every layer family the clipping rules cover.

Example:
    >>> from hypothesis import given, settings
    >>> @settings(max_examples=3, database=None)
    ... @given(m=small_models())
    ... def test_output_matches_targets(m):
    ...     assert m.module(m.x).shape == m.y.shape
    >>> test_output_matches_targets()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from hypothesis import strategies as st
from torch import nn

from opake_fx.functional import FunctionalModel, make_functional

__all__ = ["SmallModel", "SelfAttention", "small_models"]


class SelfAttention(nn.Module):
    """Batch-first self-attention as a one-input layer: ``x -> MultiheadAttention(x, x, x)[0]``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


@dataclass(frozen=True)
class SmallModel:
    """A drawn network with a matching batch.

    Attributes:
        module: the network (``nn.Sequential``, in eval mode: no dropout, deterministic).
        x: the inputs, batch first (``[B, ...]``; token ids for embedding stacks).
        y: regression targets shaped like the output.
        description: the layer stack in words, e.g. ``"image: Conv2d -> GroupNorm -> Flatten -> Linear"``.
    """

    module: nn.Module
    x: torch.Tensor
    y: torch.Tensor
    description: str

    @property
    def batch_size(self) -> int:
        """``B``, the first dimension of ``x`` and ``y``."""
        return int(self.x.shape[0])

    def functional(self) -> tuple[FunctionalModel, tuple[torch.Tensor, ...]]:
        """``make_functional(self.module)``: the model as ``fmodel(params, x)`` and its params tuple."""
        return make_functional(self.module)

    def batched_loss(self, fmodel: FunctionalModel) -> Callable[..., torch.Tensor]:
        """``loss(params, x, y) -> [B]``: per-example mean squared error (the ``"ghost"`` / ``"auto"`` contract)."""

        def loss(params: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            err = (fmodel(params, x) - y) ** 2
            return err.reshape(err.shape[0], -1).mean(1)

        return loss

    def example_loss(self, fmodel: FunctionalModel) -> Callable[..., torch.Tensor]:
        """``loss(params, x, y) -> scalar`` for ONE example (the ``"vmap"`` contract)."""
        batched = self.batched_loss(fmodel)

        def loss(params: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return batched(params, x.unsqueeze(0), y.unsqueeze(0))[0]

        return loss


def small_models(
    *,
    batch_sizes: st.SearchStrategy[int] | None = None,
    kinds: tuple[str, ...] = ("features", "image", "tokens", "sequence"),
    dtype: torch.dtype = torch.float32,
) -> st.SearchStrategy[SmallModel]:
    """Draws small networks (a few hundred parameters) with a matching batch.

    Families, each a random stack of 1-3 layers of its kind:

    * ``"features"``: ``[B, d]`` through ``Linear``, ``LayerNorm``, ``GroupNorm``, ``Tanh``;
    * ``"image"``: ``[B, C, H, W]`` through ``Conv2d``, ``GroupNorm``, ``ReLU``, then
      ``Flatten -> Linear``;
    * ``"tokens"``: ids ``[B, T]`` through ``Embedding``, then ``LayerNorm`` /
      :class:`SelfAttention` / ``Linear`` layers;
    * ``"sequence"``: ``[B, T, d]`` through ``Linear``, ``LayerNorm``, :class:`SelfAttention`.

    Weights and data come from a drawn seed through a local generator; the global torch
    RNG is left as it was.

    Args:
        batch_sizes: strategy for ``B`` (default 1..4; include 1 on purpose).
        kinds: the families to draw from.
        dtype: the floating dtype of the parameters and inputs.

    Returns:
        A strategy of :class:`SmallModel`.

    Privacy: none (a test helper).

    Example:
        >>> from hypothesis import given, settings
        >>> @settings(max_examples=3, database=None)
        ... @given(m=small_models(kinds=("image",)))
        ... def test_per_example_losses(m):
        ...     fmodel, params = m.functional()
        ...     assert m.batched_loss(fmodel)(params, m.x, m.y).shape == (m.batch_size,)
        >>> test_per_example_losses()
    """
    sizes = batch_sizes if batch_sizes is not None else st.integers(1, 4)
    return st.builds(
        _build,
        kind=st.sampled_from(kinds),
        layers=st.lists(st.integers(0, 3), min_size=1, max_size=3),
        batch=sizes,
        seed=st.integers(0, 2**31 - 1),
        dtype=st.just(dtype),
    )


# --- private helpers ---------------------------------------------------------------


def _build(kind: str, layers: list[int], batch: int, seed: int, dtype: torch.dtype) -> SmallModel:
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module, x, names = _FAMILIES[kind](layers, batch, gen)
    module = module.to(dtype).eval()
    if x.is_floating_point():
        x = x.to(dtype)
    with torch.no_grad():
        out = module(x)
    y = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(dtype)
    return SmallModel(module, x, y, f"{kind}: " + " -> ".join(names))


def _features(layers: list[int], batch: int, gen: torch.Generator) -> tuple[nn.Module, torch.Tensor, list[str]]:
    d = 4
    mods: list[nn.Module] = []
    for choice in layers:
        mods.append([nn.Linear(d, d), nn.LayerNorm(d), nn.GroupNorm(2, d), nn.Tanh()][choice])
    mods.append(nn.Linear(d, 2))
    return nn.Sequential(*mods), torch.randn(batch, d, generator=gen), [type(m).__name__ for m in mods]


def _image(layers: list[int], batch: int, gen: torch.Generator) -> tuple[nn.Module, torch.Tensor, list[str]]:
    c = 4
    mods: list[nn.Module] = [nn.Conv2d(2, c, 3, padding=1)]
    for choice in layers:
        mods.append([nn.Conv2d(c, c, 3, padding=1), nn.GroupNorm(2, c), nn.ReLU(), nn.Conv2d(c, c, 1)][choice])
    mods += [nn.Flatten(), nn.Linear(c * 5 * 5, 2)]
    return nn.Sequential(*mods), torch.randn(batch, 2, 5, 5, generator=gen), [type(m).__name__ for m in mods]


def _tokens(layers: list[int], batch: int, gen: torch.Generator) -> tuple[nn.Module, torch.Tensor, list[str]]:
    d, vocab = 4, 7
    mods: list[nn.Module] = [nn.Embedding(vocab, d)]
    for choice in layers:
        if choice == 0:
            continue  # an embedding straight into the head, too
        mods.append([None, nn.LayerNorm(d), SelfAttention(d, 2), nn.Linear(d, d)][choice])
    mods.append(nn.Linear(d, 2))
    return nn.Sequential(*mods), torch.randint(0, vocab, (batch, 3), generator=gen), [type(m).__name__ for m in mods]


def _sequence(layers: list[int], batch: int, gen: torch.Generator) -> tuple[nn.Module, torch.Tensor, list[str]]:
    d = 4
    mods: list[nn.Module] = []
    for choice in layers:
        mods.append([nn.Linear(d, d), nn.LayerNorm(d), SelfAttention(d, 2), nn.GELU()][choice])
    mods.append(nn.Linear(d, 2))
    return nn.Sequential(*mods), torch.randn(batch, 3, d, generator=gen), [type(m).__name__ for m in mods]


_FAMILIES = {"features": _features, "image": _image, "tokens": _tokens, "sequence": _sequence}
