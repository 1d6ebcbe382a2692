"""Rule for ``nn.EmbeddingBag``: each bag is one example; no ``[B, vocab, dim]`` tensor.

The output row ``b`` is a reduction over the tokens ``t`` of bag ``b``:
``sum_t c_t W[id_t]`` with a coefficient per token — its ``per_sample_weights`` entry
(mode ``"sum"``), 1 (``"sum"`` without weights) or ``1 / n_b`` with ``n_b`` the bag's
number of non-padding tokens (``"mean"``); tokens equal to ``padding_idx`` take no part.
With ``g_b`` the gradient of the batch loss w.r.t. row ``b`` (the gradient of ``L_b``
alone when no layer mixes examples), example ``b``'s gradient has one row per distinct
id ``v`` of its bag: ``(sum_{t: id_t = v} c_t) g_b``. Those rows are formed once, with
``torch.unique`` over ``bag * vocab + id`` (as :class:`~._layers.EmbeddingGrad`, whose
norms, weighted sum, per-example form and tied-table cross terms this rule inherits).

Mode ``"max"``: row ``b`` takes, in each column ``d``, the entry of the bag's token with
the largest ``W[id, d]``; example ``b``'s gradient is ``g_b[d]`` at ``(argmax_d, d)``
(the indices are the ones ``torch.embedding_bag`` itself returns for its backward), one
entry per column, so its norm is ``||g_b||`` over the non-empty bags.

Both input forms are covered: ``input [B, L]`` (each row a bag) and ``input [N]`` with
``offsets`` (``B`` bags, or ``B + 1`` offsets with ``include_last_offset=True``). The
batch axis is the output's rows, never the size of ``input``: ``N`` may equal ``B``.

Privacy contract: the clip weights are decided by certified float64 norms of the stored
rows (or entries) that the weighted sum scales and adds, so each example's contribution
is at most ``C`` as computed in floating point. ``scale_grad_by_freq=True`` (counts over
the whole batch: one example's gradient would depend on the others) and ``max_norm``
(in-place renormalisation of the table) are refused with an error.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from opake_fx.dpsgd.clipping import _certified as cert
from opake_fx.dpsgd.clipping import _layers as L
from opake_fx.errors import InputValueError

KIND = "embedding_bag"
_SIGNATURE = inspect.signature(nn.EmbeddingBag.forward)
_MAX = 2  # torch.embedding_bag's mode code for "max"


def kind(module: nn.EmbeddingBag) -> str:
    """``KIND`` for an ``nn.EmbeddingBag`` the rule can take; raises for settings that mix
    examples or modify the table."""
    if module.scale_grad_by_freq:
        raise InputValueError(
            "nn.EmbeddingBag(scale_grad_by_freq=True) divides gradients by token counts over the whole batch, so one "
            "example's gradient depends on the others and clipping it bounds nothing. Set it to False."
        )
    if module.max_norm is not None:
        raise InputValueError(
            "nn.EmbeddingBag(max_norm=...) renormalises its weight in place during the forward pass, which a "
            "functional per-example gradient cannot follow. Remove max_norm (clipping bounds updates instead)."
        )
    return KIND


def route(module: nn.EmbeddingBag, args: tuple[Any, ...], kwargs: dict[str, Any],
          output: Any) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    """What the rule needs from this call, in place of the module's inputs: ``(KIND,
    (owner, ids, coef), {})`` per kept token (bag index, id, coefficient) for modes sum and
    mean, ``(KIND, (argmax, nonempty), {})`` for mode max; ``("fallback", args, kwargs)``
    for a call it does not understand."""
    try:
        bound = _SIGNATURE.bind(module, *args, **kwargs)
    except TypeError:
        return "fallback", args, kwargs
    bound.apply_defaults()
    ids, offsets, psw = bound.arguments["input"], bound.arguments["offsets"], bound.arguments["per_sample_weights"]
    weight = module.weight
    if not isinstance(output, torch.Tensor) or output.dim() != 2 or not isinstance(ids, torch.Tensor):
        return "fallback", args, kwargs
    bags = output.shape[0]
    with torch.no_grad():
        if ids.dim() == 2:
            length = ids.shape[1]
            flat = ids.reshape(-1)
            offsets = torch.arange(0, flat.numel(), max(length, 1), device=ids.device)[:bags]
            end = flat.numel()
            if psw is not None:
                psw = psw.reshape(-1)
        elif ids.dim() == 1 and isinstance(offsets, torch.Tensor):
            flat = ids
            end = int(offsets[bags]) if module.include_last_offset else flat.numel()
            offsets = offsets[:bags]
        else:
            return "fallback", args, kwargs
        if offsets.numel() != bags:
            return "fallback", args, kwargs
        if module.mode == "max":
            _, _, bag_size, argmax = torch.embedding_bag(
                weight.detach(), flat[:end], offsets, False, _MAX, False, None, False, module.padding_idx
            )
            return KIND, (argmax, bag_size > 0), {}
        flat = flat[:end].long()
        lengths = torch.diff(offsets.long(), append=torch.tensor([end], device=offsets.device))
        owner = torch.repeat_interleave(torch.arange(bags, device=flat.device), lengths)
        dtype = L.compute_dtype(weight.dtype)
        coef = torch.ones(end, dtype=dtype, device=flat.device) if psw is None else psw.detach().reshape(-1)[:end].to(dtype)
        if module.padding_idx is not None:
            keep = flat != module.padding_idx
            owner, flat, coef = owner[keep], flat[keep], coef[keep]
        if module.mode == "mean":
            counts = torch.zeros(bags, dtype=dtype, device=flat.device).index_add_(0, owner, torch.ones_like(coef))
            coef = coef / counts.clamp_min(1.0)[owner]
    return KIND, (owner, flat, coef), {}


def bag_grad(saved: tuple[torch.Tensor, ...], g: torch.Tensor, module: nn.EmbeddingBag, dtype: torch.dtype,
             keep_tokens: bool = False) -> Any:
    """The rule for one call, from what :func:`route` saved and the output gradient ``g [B, D]``."""
    if module.mode == "max":
        return MaxBagGrad(saved[0], saved[1], g, module, dtype)
    return EmbeddingBagGrad(saved[0], saved[1], saved[2], g, module, dtype, keep_tokens=keep_tokens)


class EmbeddingBagGrad(L.EmbeddingGrad):
    """Modes sum and mean: one row ``s_bv g_b`` per bag ``b`` and distinct id ``v`` of it,
    ``s_bv = sum_{t in b: id_t = v} c_t``; norms, weighted sum and per-example gradients as
    :class:`~._layers.EmbeddingGrad` (certified float64 norms of the stored rows)."""

    def __init__(self, owner: torch.Tensor, ids: torch.Tensor, coef: torch.Tensor, g: torch.Tensor,
                 module: nn.EmbeddingBag, dtype: torch.dtype, keep_tokens: bool = False) -> None:
        batch = g.shape[0]
        vocab, dim = module.num_embeddings, module.embedding_dim
        g = g.to(dtype).reshape(batch, dim)
        coef = coef.to(dtype)
        uniq, inverse = torch.unique(owner * vocab + ids, return_inverse=True)
        scale = torch.zeros(uniq.numel(), dtype=dtype, device=g.device).index_add_(0, inverse, coef)
        self.owner, self.ids = uniq // vocab, uniq % vocab
        self.rows = scale.unsqueeze(1) * g[self.owner]
        self.batch, self.shape, self.dtype = batch, (vocab, dim), dtype
        # Token-level (ids [B, T], e [B, T, D], empty slots zero): only for a table another call
        # also uses, whose cross terms need them.
        self.tokens: tuple[torch.Tensor, torch.Tensor] | None = None
        if keep_tokens:
            counts = torch.bincount(owner, minlength=batch)
            width = max(int(counts.max()) if counts.numel() else 0, 1)
            start = counts.cumsum(0) - counts
            pos = torch.arange(owner.numel(), device=owner.device) - start[owner]
            tok_ids = torch.zeros((batch, width), dtype=torch.long, device=owner.device)
            e = torch.zeros((batch, width, dim), dtype=dtype, device=g.device)
            tok_ids[owner, pos] = ids
            e[owner, pos] = coef.unsqueeze(1) * g[owner]
            self.tokens = (tok_ids, e)
        row_sq = L.sq_norms_of(self.rows)
        sums = torch.zeros(batch, dtype=torch.float64, device=g.device).index_add_(0, self.owner, row_sq)
        self._sq = sums * (1.0 + cert.gamma(self.rows.shape[0] + 2, torch.float64))


class MaxBagGrad:
    """Mode max: example ``b``'s gradient is ``g_b[d]`` at ``(argmax_bd, d)`` for a non-empty
    bag (one entry per column, none shared), so its norm is the certified norm of the stored
    ``g_b`` and the weighted sum is one ``index_put_`` with accumulation."""

    def __init__(self, argmax: torch.Tensor, nonempty: torch.Tensor, g: torch.Tensor, module: nn.EmbeddingBag,
                 dtype: torch.dtype) -> None:
        self.batch, self.dtype = g.shape[0], dtype
        self.shape = (module.num_embeddings, module.embedding_dim)
        self.argmax = argmax.long()
        self.values = L._zero_rows(g.to(dtype).reshape(self.batch, -1), nonempty)
        self._sq = L.sq_norms_of(self.values)
        self._cols = torch.arange(self.shape[1], device=g.device).expand(self.batch, -1)

    def sq_norm(self, name: str) -> torch.Tensor:
        return self._sq

    def certified(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self._sq, torch.zeros_like(self._sq)

    def weighted(self, name: str, w: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        values = self.values if keep is None else L._zero_rows(self.values, keep)
        scaled = values * w.to(self.dtype).unsqueeze(1)
        out = torch.zeros(self.shape, dtype=self.dtype, device=values.device)
        return out.index_put_((self.argmax.reshape(-1), self._cols.reshape(-1)), scaled.reshape(-1), accumulate=True)

    def per_example(self, name: str) -> torch.Tensor:
        out = torch.zeros((self.batch, *self.shape), dtype=self.dtype, device=self.values.device)
        rows = torch.arange(self.batch, device=out.device).unsqueeze(1).expand_as(self.argmax)
        return out.index_put_((rows.reshape(-1), self.argmax.reshape(-1), self._cols.reshape(-1)),
                              self.values.reshape(-1), accumulate=True)


__all__ = ["KIND", "EmbeddingBagGrad", "MaxBagGrad", "bag_grad", "kind", "route"]
