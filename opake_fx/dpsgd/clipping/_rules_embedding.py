"""Rules for embeddings: ``nn.Embedding`` and ``nn.EmbeddingBag``; no ``[B, vocab, dim]`` tensor.

``nn.Embedding``: ``||dE_i||^2 = sum_{t,s} [id_it = id_is] (g_it . g_is)``, computed by
summing ``g`` over each example's distinct ids (:class:`EmbeddingGrad`).

``nn.EmbeddingBag``: each bag is one example.
The output row ``b`` is a reduction over the tokens ``t`` of bag ``b``:
``sum_t c_t W[id_t]`` with a coefficient per token — its ``per_sample_weights`` entry
(mode ``"sum"``), 1 (``"sum"`` without weights) or ``1 / n_b`` with ``n_b`` the bag's
number of non-padding tokens (``"mean"``); tokens equal to ``padding_idx`` take no part.
With ``g_b`` the gradient of the batch loss w.r.t. row ``b`` (the gradient of ``L_b``
alone when no layer mixes examples), example ``b``'s gradient has one row per distinct
id ``v`` of its bag: ``(sum_{t: id_t = v} c_t) g_b``. Those rows are formed once, with
``torch.unique`` over ``bag * vocab + id`` (as :class:`EmbeddingGrad`, whose
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
from opake_fx.dpsgd.clipping import _numerics as N
from opake_fx.dpsgd.clipping._rule import BuildContext, Rule
from opake_fx.errors import InputValueError

_BAG_SIGNATURE = inspect.signature(nn.EmbeddingBag.forward)
_MAX = 2  # torch.embedding_bag's mode code for "max"


class EmbeddingGrad:
    """``nn.Embedding``: gradients summed per (example, distinct id); rows only where ids occur.

    The per-example gradient has a row ``sum_{t: id_it = v} g_it`` for each distinct id
    ``v`` of example ``i`` (none for ``padding_idx``). Those rows are formed once, with
    ``torch.unique`` over ``example * vocab + id``; the norm is the sum of their squares
    and the weighted sum is one ``index_add`` of the scaled rows into the table.
    """

    def __init__(self, ids: torch.Tensor, g: torch.Tensor, module: nn.Embedding, dtype: torch.dtype,
                 keep_tokens: bool = False) -> None:
        batch = ids.shape[0]
        vocab, dim = module.num_embeddings, module.embedding_dim
        ids = ids.reshape(batch, -1).long()
        g = N.as_dtype(g.reshape(batch, -1, dim), dtype)
        # Token-level (ids [B, T], g [B, T, D], padding rows zeroed): kept only for a table
        # that another call also uses, whose cross terms need them (:func:`sum_of_uses`).
        self.tokens: tuple[torch.Tensor, torch.Tensor] | None = None
        if keep_tokens:
            kept = g if module.padding_idx is None else g * (ids != module.padding_idx).unsqueeze(-1).to(dtype)
            self.tokens = (ids, kept)
        owner = torch.arange(batch, device=ids.device).unsqueeze(1)
        keys = owner * vocab + ids
        if module.padding_idx is not None:
            mask = ids != module.padding_idx
            keys, g_rows = keys[mask], g[mask]
        else:
            keys, g_rows = keys.reshape(-1), g.reshape(-1, dim)
        uniq, inverse = torch.unique(keys, return_inverse=True)
        self.rows = torch.zeros((uniq.numel(), dim), dtype=dtype, device=g.device).index_add_(0, inverse, g_rows)
        self.ids = uniq % vocab
        self.owner = uniq // vocab
        self.batch, self.shape, self.dtype = batch, (vocab, dim), dtype
        # The rows as stored are what the weighted sum scales and adds (one row per example
        # and id), so their float64 norms certify the contribution.
        row_sq = N.sq_norms_of(self.rows)
        sums = torch.zeros(batch, dtype=torch.float64, device=g.device).index_add_(0, self.owner, row_sq)
        self._sq = sums * (1.0 + cert.gamma(self.rows.shape[0] + 2, torch.float64))

    def sq_norm(self, name: str) -> torch.Tensor:
        return self._sq

    def certified(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self._sq, torch.zeros_like(self._sq)

    def weighted(self, name: str, w: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        coeff = N.as_dtype(w, self.dtype)[self.owner].unsqueeze(1)
        if keep is not None:
            coeff = torch.where(keep[self.owner].unsqueeze(1), coeff, torch.zeros_like(coeff))
            rows = N.zero_rows(self.rows, keep[self.owner])
        else:
            rows = self.rows
        out = torch.zeros(self.shape, dtype=self.dtype, device=self.rows.device)
        # The weighted sum is the rule's last use of its rows: scale them in place (no copy).
        return out.index_add_(0, self.ids, rows.mul_(coeff))

    def per_example(self, name: str) -> torch.Tensor:
        # Only for an embedding table shared with another call (e.g. tied to an output layer).
        out = torch.zeros((self.batch, *self.shape), dtype=self.dtype, device=self.rows.device)
        return out.index_put_((self.owner, self.ids), self.rows, accumulate=True)

    def cross_form(self, name: str) -> tuple[Any, ...] | None:
        """("tokens", ids [B, T], e [B, T, D], s = sum_t |e_t|) when the token-level terms were
        kept (a table another call also uses), else None."""
        if self.tokens is None:
            return None
        ids, e = self.tokens
        s = torch.linalg.vector_norm(e.to(torch.float64), dim=2).sum(dim=1) * (1.0 + cert.gamma(e.shape[1] + e.shape[2] + 4, torch.float64))
        return ("tokens", ids, e, s)



class StaticEmbeddingGrad:
    """``nn.Embedding`` in a traced graph: :class:`EmbeddingGrad`'s rows with shapes that do
    not depend on the ids (``torch.unique`` does), for :mod:`._traced`.

    Each example's ids are sorted (stable), runs of equal ids are numbered, and ``g`` is
    summed into row ``run`` of a ``[B, T, D]`` buffer: example ``i``'s row ``r`` is
    ``sum_{t: id_it = v_r} g_it`` for its ``r``-th distinct id ``v_r``; its rows past its
    number of distinct ids are zero (and carry id 0, to which they add nothing). Tokens
    equal to ``padding_idx`` have their ``g`` zeroed first, so their row is zero. The norm
    is the certified float64 norm of the example's stored rows (what the weighted sum scales
    and adds, as in :class:`EmbeddingGrad`); the weighted sum is one ``index_add`` of the
    scaled rows into the table. Cost ``O(T log T + T D)`` per example, memory that of ``g``.

    Example:
        >>> emb = nn.Embedding(5, 2)
        >>> ids = torch.tensor([[3, 1, 3]])
        >>> g = torch.tensor([[[1.0, 0.0], [0.0, 2.0], [1.0, 0.0]]])
        >>> rule = StaticEmbeddingGrad(ids, g, emb, torch.float32)
        >>> round(float(rule.sq_norm("weight")[0]), 4)  # rows: id 1 -> (0, 2), id 3 -> (2, 0)
        8.0
    """

    def __init__(self, ids: torch.Tensor, g: torch.Tensor, module: nn.Embedding, dtype: torch.dtype) -> None:
        batch = ids.shape[0]
        vocab, dim = module.num_embeddings, module.embedding_dim
        ids = ids.reshape(batch, -1).long()
        g = N.as_dtype(g.reshape(batch, -1, dim), dtype)
        if module.padding_idx is not None:
            g = g * (ids != module.padding_idx).unsqueeze(-1).to(dtype)
        sorted_ids, order = torch.sort(ids, dim=1, stable=True)
        first = torch.ones_like(sorted_ids[:, :1], dtype=torch.bool)
        starts = torch.cat([first, sorted_ids[:, 1:] != sorted_ids[:, :-1]], dim=1)
        run = starts.long().cumsum(dim=1) - 1  # [B, T]: the row of each sorted token
        t = ids.shape[1]
        slot = (run + torch.arange(batch, device=ids.device).unsqueeze(1) * t).reshape(-1)  # its row of [B * T]
        g_sorted = g.gather(1, order.unsqueeze(-1).expand_as(g)).reshape(batch * t, dim)
        self.rows = N.rows_summed_by_index(batch * t, slot, g_sorted).view(batch, t, dim)
        self.ids = torch.zeros_like(sorted_ids).scatter_(1, run, sorted_ids)  # equal writes for a run
        self.batch, self.shape, self.dtype = batch, (vocab, dim), dtype
        self._sq = N.sq_norms_of(self.rows)

    def sq_norm(self, name: str) -> torch.Tensor:
        return self._sq

    def certified(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self._sq, torch.zeros_like(self._sq)

    def weighted(self, name: str, w: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        scaled = self.rows * N.as_dtype(w, self.dtype).view(-1, 1, 1)
        if keep is not None:  # exactly zero, whatever the dropped example's rows or weight hold
            scaled = N.zero_rows(scaled, keep)
        return N.rows_summed_by_index(self.shape[0], self.ids.reshape(-1), scaled.reshape(-1, self.shape[1]))

    def per_example(self, name: str) -> torch.Tensor:
        out = torch.zeros((self.batch, *self.shape), dtype=self.dtype, device=self.rows.device)
        owner = torch.arange(self.batch, device=out.device).unsqueeze(1).expand_as(self.ids)
        return out.index_put_((owner.reshape(-1), self.ids.reshape(-1)), self.rows.reshape(-1, self.shape[1]),
                              accumulate=True)

    def cross_form(self, name: str) -> tuple[Any, ...] | None:
        return None  # (a traced table is never shared with another call: the plan sends those to the exact path)


def bag_grad(saved: tuple[torch.Tensor, ...], g: torch.Tensor, module: nn.EmbeddingBag, dtype: torch.dtype,
             keep_tokens: bool = False) -> Any:
    """The rule for one call, from what :func:`route` saved and the output gradient ``g [B, D]``."""
    if module.mode == "max":
        return MaxBagGrad(saved[0], saved[1], g, module, dtype)
    return EmbeddingBagGrad(saved[0], saved[1], saved[2], g, module, dtype, keep_tokens=keep_tokens)


class EmbeddingBagGrad(EmbeddingGrad):
    """Modes sum and mean: one row ``s_bv g_b`` per bag ``b`` and distinct id ``v`` of it,
    ``s_bv = sum_{t in b: id_t = v} c_t``; norms, weighted sum and per-example gradients as
    :class:`EmbeddingGrad` (certified float64 norms of the stored rows)."""

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
        row_sq = N.sq_norms_of(self.rows)
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
        self.values = N.zero_rows(g.to(dtype).reshape(self.batch, -1), nonempty)
        self._sq = N.sq_norms_of(self.values)
        self._cols = torch.arange(self.shape[1], device=g.device).expand(self.batch, -1)

    def sq_norm(self, name: str) -> torch.Tensor:
        return self._sq

    def certified(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self._sq, torch.zeros_like(self._sq)

    def weighted(self, name: str, w: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        values = self.values if keep is None else N.zero_rows(self.values, keep)
        scaled = values * w.to(self.dtype).unsqueeze(1)
        out = torch.zeros(self.shape, dtype=self.dtype, device=values.device)
        return out.index_put_((self.argmax.reshape(-1), self._cols.reshape(-1)), scaled.reshape(-1), accumulate=True)

    def cross_form(self, name: str) -> tuple[Any, ...] | None:
        return None  # (no cross-term formula here: a table shared with another call sums per-example gradients)

    def per_example(self, name: str) -> torch.Tensor:
        out = torch.zeros((self.batch, *self.shape), dtype=self.dtype, device=self.values.device)
        rows = torch.arange(self.batch, device=out.device).unsqueeze(1).expand_as(self.argmax)
        return out.index_put_((rows.reshape(-1), self.argmax.reshape(-1), self._cols.reshape(-1)),
                              self.values.reshape(-1), accumulate=True)


# --- registry entries ---------------------------------------------------------------


def _refuse_settings(module: nn.Embedding | nn.EmbeddingBag) -> None:
    name = type(module).__name__
    if module.scale_grad_by_freq:
        raise InputValueError(
            f"nn.{name}(scale_grad_by_freq=True) divides gradients by token counts over the whole batch, so "
            "one example's gradient depends on the others and clipping it bounds nothing. Set it to False."
        )
    if module.max_norm is not None:
        raise InputValueError(
            f"nn.{name}(max_norm=...) renormalises its weight in place during the forward pass, which a "
            "functional per-example gradient cannot follow. Remove max_norm (clipping bounds updates instead)."
        )


class EmbeddingRule(Rule):
    """``nn.Embedding`` (ids ``[B, *]``): :class:`EmbeddingGrad`."""

    kind, types = "embedding", (nn.Embedding,)

    def check(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], batched: dict[int, bool],
              batch: int, differentiated: bool) -> None:
        if differentiated:
            _refuse_settings(module)  # type: ignore[arg-type]

    def build(self, module: nn.Module, saved: tuple[torch.Tensor, ...], g: torch.Tensor, names: dict[str, int],
              ctx: BuildContext) -> EmbeddingGrad | StaticEmbeddingGrad:
        if ctx.static:
            return StaticEmbeddingGrad(saved[0], g, module, N.compute_dtype(ctx.dtype))  # type: ignore[arg-type]
        return EmbeddingGrad(saved[0], g, module, N.compute_dtype(ctx.dtype), keep_tokens=ctx.shared)  # type: ignore[arg-type]


class _Table:
    """What :class:`EmbeddingGrad` reads of a table: its sizes and its padding row."""

    def __init__(self, weight: torch.Tensor, padding_idx: int | None) -> None:
        self.num_embeddings, self.embedding_dim = weight.shape
        self.padding_idx = padding_idx


class LookupRule(Rule):
    """A lookup ``F.embedding(ids, P)`` of a parameter ``P`` that a module without a rule holds
    directly, made in its own ``forward`` (Hugging Face's scaled word embeddings and learned
    positional embeddings: ``nn.Embedding`` subclasses whose ``forward`` calls
    ``super().forward(...)`` and scales or offsets around it), found by
    :class:`._rules_elementwise.Broadcasts` and taken when the lookup's first axis is proven
    to be the batch: :class:`EmbeddingGrad` of that lookup, as for an ``nn.Embedding`` call.
    One instance per lookup (its ``padding_idx``); claims no module."""

    kind = "lookup"

    def __init__(self, padding_idx: int | None) -> None:
        self.padding_idx = padding_idx

    def claims(self, module: nn.Module) -> bool:
        return False

    def build(self, module: nn.Module, saved: tuple[torch.Tensor, ...], g: torch.Tensor, names: dict[str, int],
              ctx: BuildContext) -> EmbeddingGrad:
        (name,) = names
        weight = module._parameters[name]
        assert weight is not None
        return EmbeddingGrad(saved[0], g, _Table(weight, self.padding_idx), N.compute_dtype(ctx.dtype),  # type: ignore[arg-type]
                             keep_tokens=ctx.shared)


class EmbeddingBagRule(EmbeddingRule):
    """``nn.EmbeddingBag``: the batch axis is the output's rows (the input may be ``[N]`` ids)."""

    kind, types = "embedding_bag", (nn.EmbeddingBag,)

    def reads_batched(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                      batched: dict[int, bool]) -> bool:
        return True  # it reads only the output's rows (checked by the caller)

    def route(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
              output: Any) -> tuple[torch.Tensor, ...] | None:
        """What the rule needs from this call, in place of the module's inputs: ``(owner, ids,
        coef)`` per kept token (bag index, id, coefficient) for modes sum and mean, ``(argmax,
        nonempty)`` for mode max; None for a call it does not understand (module fallback)."""
        try:
            bound = _BAG_SIGNATURE.bind(module, *args, **kwargs)
        except TypeError:
            return None
        bound.apply_defaults()
        ids, offsets, psw = bound.arguments["input"], bound.arguments["offsets"], bound.arguments["per_sample_weights"]
        weight = module.weight
        if not isinstance(output, torch.Tensor) or output.dim() != 2 or not isinstance(ids, torch.Tensor):
            return None
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
                return None
            if offsets.numel() != bags:
                return None
            if module.mode == "max":
                _, _, bag_size, argmax = torch.embedding_bag(
                    weight.detach(), flat[:end], offsets, False, _MAX, False, None, False, module.padding_idx
                )
                return argmax, bag_size > 0
            flat = flat[:end].long()
            lengths = torch.diff(offsets.long(), append=torch.tensor([end], device=offsets.device))
            owner = torch.repeat_interleave(torch.arange(bags, device=flat.device), lengths)
            dtype = N.compute_dtype(weight.dtype)
            coef = torch.ones(end, dtype=dtype, device=flat.device) if psw is None else psw.detach().reshape(-1)[:end].to(dtype)
            if module.padding_idx is not None:
                keep = flat != module.padding_idx
                owner, flat, coef = owner[keep], flat[keep], coef[keep]
            if module.mode == "mean":
                counts = torch.zeros(bags, dtype=dtype, device=flat.device).index_add_(0, owner, torch.ones_like(coef))
                coef = coef / counts.clamp_min(1.0)[owner]
        return owner, flat, coef

    def build(self, module: nn.Module, saved: tuple[torch.Tensor, ...], g: torch.Tensor, names: dict[str, int],
              ctx: BuildContext) -> Any:
        return bag_grad(saved, g, module, N.compute_dtype(ctx.dtype), keep_tokens=ctx.shared)  # type: ignore[arg-type]


EMBEDDING, EMBEDDING_BAG = EmbeddingRule(), EmbeddingBagRule()

__all__ = ["EMBEDDING", "EMBEDDING_BAG", "EmbeddingBagGrad", "EmbeddingBagRule", "EmbeddingGrad", "EmbeddingRule",
           "MaxBagGrad", "StaticEmbeddingGrad", "bag_grad"]
