"""Rules for ``nn.MultiheadAttention``: attention recomputed from tapped projections.

``nn.MultiheadAttention`` used as batch-first self- or cross-attention is recomputed in
its forward hook from its projections (:meth:`AttentionRule.rewrite`): the packed input
projection (one Linear with weight ``in_proj_weight`` for self-attention; for
cross-attention a Linear on the query with its first ``d`` rows and one on the memory
with the other ``2d``, :class:`BlockRows`), the attention itself (no parameters; it mixes
positions, never examples) and ``out_proj``, each projection tapped like a Linear
(:mod:`._rules_linear`). The recomputation replaces the module's output only when it
reproduces it: checked once per module and call signature (masks' kinds, causality,
shapes, dtype, mode; the first call of each, so that later steps make no host
synchronisation), on that call's own output, or, with attention dropout in training (the
recomputation draws its own masks), with dropout off on both sides. Any other call (need_weights, key is not value, extra key/value biases,
sequence-first) takes the module fallback, and a sequence-first module on a batch-first
input is refused (it would mix examples).

Privacy contract: the projections' norms are the Linear rule's, certified after
rounding, so each example's contribution is at most ``C`` as computed in floating point.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from opake_fx.dpsgd.clipping._rule import BuildContext, refuse_sequence_first, same_output
from opake_fx.dpsgd.clipping._rules_fallback import FallbackRule
from opake_fx.dpsgd.clipping._rules_linear import LINEAR, LinearRule, MatmulGrad, Rearranged, projection_grad


class BlockRows(Rearranged):
    """A rule for rows ``lo:hi`` of a parameter with ``rows`` rows (the query or key/value
    part of ``nn.MultiheadAttention``'s packed input projection in cross-attention): norms
    are the wrapped rule's, weighted sums and per-example gradients are placed in those rows
    of zeros. Two blocks of disjoint rows have no cross term."""

    def __init__(self, rule: MatmulGrad, lo: int, hi: int, rows: int) -> None:
        super().__init__(rule)
        self.lo, self.hi, self.rows = lo, hi, rows

    def weighted(self, name: str, w: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        part = self.rule.weighted(name, w, keep)
        out = part.new_zeros((self.rows, *part.shape[1:]))
        out[self.lo : self.hi] = part
        return out

    def per_example(self, name: str) -> torch.Tensor:
        part = self.rule.per_example(name)
        out = part.new_zeros((part.shape[0], self.rows, *part.shape[2:]))
        out[:, self.lo : self.hi] = part
        return out


    def cross_form(self, name: str) -> tuple[Any, ...]:
        """("block", lo, hi): two blocks of disjoint rows have no cross term."""
        return ("block", self.lo, self.hi)


_MHA_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward)


def _attention_arguments(module: nn.MultiheadAttention, args: tuple[Any, ...],
                         kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The call's arguments when it is batch-first attention that the rule covers, else None:
    one packed input projection, no extra key/value biases or zero attention, no attention
    weights returned, and key = value (self-attention: query = key = value too)."""
    if not (module.batch_first and module._qkv_same_embed_dim and module.in_proj_weight is not None
            and module.bias_k is None and module.bias_v is None and not module.add_zero_attn):
        return None
    try:
        bound = _MHA_SIGNATURE.bind(module, *args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    call = bound.arguments
    if call["need_weights"] or call["key"] is not call["value"]:
        return None
    if not all(isinstance(call[k], torch.Tensor) for k in ("query", "key")):
        return None
    return call


def _attention_forward(module: nn.MultiheadAttention, call: dict[str, Any], dropout: float, tap: Callable[..., Any],
                       names: dict[str, int], out_names: dict[str, int]) -> torch.Tensor | None:
    """The module's output from explicit projections; ``tap(rule, owner, names, a, y, block)``
    wraps each projection's output (``rule``: the entry that builds its layer gradient) (identity when nothing is differentiated)."""
    query, memory = call["query"], call["key"]
    d = module.embed_dim
    weight, bias = module.in_proj_weight, module.in_proj_bias
    if query is memory:
        proj = tap(PROJECTION, module, names, query, F.linear(query, weight, bias), (0, 3 * d))
        q_proj, kv_proj = proj[..., :d], proj[..., d:]
    else:
        q_proj = F.linear(query, weight[:d], None if bias is None else bias[:d])
        kv_proj = F.linear(memory, weight[d:], None if bias is None else bias[d:])
        q_proj = tap(PROJECTION, module, names, query, q_proj, (0, d))
        kv_proj = tap(PROJECTION, module, names, memory, kv_proj, (d, 3 * d))
    ctx = _attention_core(q_proj, kv_proj, module.num_heads, call, dropout)
    if ctx is None:
        return None
    out = F.linear(ctx, module.out_proj.weight, module.out_proj.bias)
    return tap(LINEAR, module.out_proj, out_names, ctx, out)


def _attention_core(q_proj: torch.Tensor, kv_proj: torch.Tensor, heads: int, call: dict[str, Any],
                    dropout: float) -> torch.Tensor | None:
    """Scaled dot-product attention of projected queries ``[B, T, d]`` over projected keys and
    values ``[B, S, 2d]`` -> ``[B, T, d]``, with the masks of ``F.multi_head_attention_forward``
    (its mask logic, batch first)."""
    canonical = getattr(F, "_canonical_mask", None)
    none_or_dtype = getattr(F, "_none_or_dtype", None)
    if canonical is None or none_or_dtype is None:
        return None
    b, t, d = q_proj.shape
    s = kv_proj.shape[1]
    q = q_proj.reshape(b, t, heads, d // heads).transpose(1, 2)
    k, v = kv_proj.reshape(b, s, 2, heads, d // heads).permute(2, 0, 3, 1, 4)
    attn_mask, padding, is_causal = call["attn_mask"], call["key_padding_mask"], bool(call["is_causal"])
    padding = canonical(mask=padding, mask_name="key_padding_mask", other_type=none_or_dtype(attn_mask),
                        other_name="attn_mask", target_type=q_proj.dtype)
    if is_causal and attn_mask is None:
        return None
    if is_causal and padding is None:
        mask = None  # F.multi_head_attention_forward hands the causal hint to SDPA
    else:
        mask = canonical(mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                         target_type=q_proj.dtype, check_other=False)
        if mask is not None:
            if mask.dim() == 2:
                mask = mask.view(1, 1, t, s)
            elif mask.dim() == 3:
                mask = mask.view(b, heads, t, s)
            else:
                return None
        if padding is not None:
            if padding.shape != (b, s):
                return None
            padding = padding.view(b, 1, 1, s)
            mask = padding if mask is None else mask + padding
            is_causal = False
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal)
    return out.transpose(1, 2).reshape(b, t, d)


class ProjectionRule(LinearRule):
    """Rows ``block`` of ``nn.MultiheadAttention``'s packed input projection, tapped by
    :meth:`AttentionRule.rewrite` (never claims a module by itself)."""

    kind, types = "projection", ()

    def claims(self, module: nn.Module) -> bool:
        return False

    def build(self, module: nn.Module, saved: tuple[torch.Tensor, ...], g: torch.Tensor, names: dict[str, int],
              ctx: BuildContext) -> MatmulGrad | BlockRows:  # type: ignore[override]
        d = module.embed_dim  # type: ignore[union-attr]
        lo, hi = ctx.block or (0, 3 * d)
        roles = {role: n for role, n in (("weight", "in_proj_weight"), ("bias", "in_proj_bias")) if n in names}
        rule = projection_grad(saved[0], g, d, hi - lo, roles, ctx.mode, ctx.dtype)
        return rule if (lo, hi) == (0, 3 * d) else BlockRows(rule, lo, hi, 3 * d)


class AttentionRule(FallbackRule):
    """``nn.MultiheadAttention``: rewritten from tapped projections where it can be, the module
    fallback otherwise (deferred); a sequence-first module on a batch-first input is refused."""

    kind, types, rewrites = "attention", (nn.MultiheadAttention,), True

    def claims(self, module: nn.Module) -> bool:
        return isinstance(module, self.types)

    def check(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], batched: dict[int, bool],
              batch: int, differentiated: bool) -> None:
        refuse_sequence_first(module, args, kwargs, batched, batch)

    def rewrite(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any,
                names: dict[str, int], batched: dict[int, bool], tap: Callable[..., torch.Tensor],
                params_of: Callable[[nn.Module], dict[str, int]], cache: dict[tuple[Any, ...], bool]) -> Any:
        """``(recomputed output, None)`` through tapped projections, or None (see the module
        docstring); ``cache`` keeps the dropout-free checks across steps."""
        if type(module).forward is not nn.MultiheadAttention.forward:
            return None
        assert isinstance(module, nn.MultiheadAttention)
        out_names = params_of(module.out_proj)
        call = _attention_arguments(module, args, kwargs) if (names or out_names) else None
        if call is None or not isinstance(output, tuple) or output[1] is not None:
            return None
        query, memory = call["query"], call["key"]
        if query.dim() != 3 or memory.dim() != 3 or not (batched.get(id(query)) and batched.get(id(memory))):
            return None
        dropout = module.dropout if module.training else 0.0
        if dropout > 0 and not _matches_without_dropout(module, args, kwargs, call, cache):
            return None
        key = ("same output", *_call_signature(module, call))
        if dropout == 0 and cache.get(key) is False:
            return None
        out = _attention_forward(module, call, dropout, tap, names, out_names)
        if out is None:
            return None
        if dropout == 0 and key not in cache:  # once per module and call signature (host synchronisations)
            cache[key] = same_output(out, output[0])
            if not cache[key]:
                return None  # the caller registers the taps only for a replaced output
        return out, None


def _matches_without_dropout(module: nn.MultiheadAttention, args: tuple[Any, ...], kwargs: dict[str, Any],
                             call: dict[str, Any], cache: dict[tuple[Any, ...], bool]) -> bool:
    signature = _call_signature(module, call)
    if signature not in cache:
        rate = module.dropout
        try:
            module.dropout = 0.0
            with torch.no_grad():
                ref = module.forward(*args, **kwargs)[0]  # .forward: no hooks
                ours = _attention_forward(module, call, 0.0, lambda rule, owner, used, a, y, block=None: y, {}, {})
        finally:
            module.dropout = rate
        cache[signature] = ours is not None and same_output(ours, ref)
    return cache[signature]


def _call_signature(module: nn.MultiheadAttention, call: dict[str, Any]) -> tuple[Any, ...]:
    """What a check of the recomputation is kept for: the module, its masks' kinds, causality,
    self- or cross-attention, the shapes and dtypes (batch size left out) and the mode."""
    masks = tuple((name, None if m is None else (m.dtype, m.dim())) for name in ("attn_mask", "key_padding_mask")
                  for m in [call[name]])
    return (id(module), masks, bool(call["is_causal"]), call["query"] is call["key"],
            tuple(call["query"].shape[1:]), tuple(call["key"].shape[1:]), call["query"].dtype, module.training)


PROJECTION, ATTENTION = ProjectionRule(), AttentionRule()

__all__ = ["ATTENTION", "PROJECTION", "AttentionRule", "BlockRows", "ProjectionRule"]
