"""Rules for ``nn.MultiheadAttention``: attention recomputed from tapped projections.

A batch-first ``nn.MultiheadAttention`` call is recomputed in its forward hook from its
projections (:meth:`AttentionRule.rewrite`), in every configuration of the module: the
input projections (for a packed ``in_proj_weight``, consecutive roles fed the same tensor
share one Linear over their rows, so self-attention is one call of the whole weight and
cross-attention a query block and a key/value block, :class:`BlockRows`; with
``kdim``/``vdim``, one Linear per ``q/k/v_proj_weight`` with its rows of the packed bias),
the extra key/value biases of ``add_bias_kv`` (the row appended to each example's keys or
values: its gradient is that example's, :class:`KeyValueBiasRule`), zero attention, every
mask the module takes, the attention itself (no parameters; it mixes positions, never
examples; explicit softmax weights when the call returns them, so that weights used in the
loss are differentiated too) and ``out_proj``, each projection tapped like a Linear
(:mod:`._rules_linear`). The recomputation replaces the module's outputs only when it
reproduces them: checked once per module and call signature (masks' kinds, causality,
which inputs are the same tensor, weights asked for, shapes, dtype, mode; the first call
of each, so that later steps make no host synchronisation), on that call's own outputs,
or, with attention dropout in training (the recomputation draws its own masks), with
dropout off on both sides. A subclass with its own ``forward`` takes the module fallback;
a sequence-first module on a batch-first input is refused (it would mix examples), and on
a sequence-first input (``[T, B, d]``) provenance sees no batch axis first and the whole
loss is differentiated per example (exact, slow).

Privacy contract: the projections' norms are the Linear rule's, certified after
rounding, so each example's contribution is at most ``C`` as computed in floating point.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from opake_fx.dpsgd.clipping import _numerics as N
from opake_fx.dpsgd.clipping._rule import BuildContext, Rule, checked_once, refuse_sequence_first, same_outputs
from opake_fx.dpsgd.clipping._rules_fallback import FallbackRule
from opake_fx.dpsgd.clipping._rules_linear import LINEAR, LinearRule, MatmulGrad, Rearranged, projection_grad


class BlockRows(Rearranged):
    """A rule for rows ``lo:hi`` of parameters with ``rows`` rows (a block of
    ``nn.MultiheadAttention``'s packed input projection or of its packed bias): norms are the
    wrapped rule's, weighted sums and per-example gradients of the ``blocked`` parameters are
    placed in those rows of zeros (the others pass through). Two blocks of disjoint rows have
    no cross term."""

    def __init__(self, rule: MatmulGrad, lo: int, hi: int, rows: int, blocked: frozenset[str]) -> None:
        super().__init__(rule)
        self.lo, self.hi, self.rows, self.blocked = lo, hi, rows, blocked

    def weighted(self, name: str, w: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        part = self.rule.weighted(name, w, keep)
        if name not in self.blocked:
            return part
        out = part.new_zeros((self.rows, *part.shape[1:]))
        out[self.lo : self.hi] = part
        return out

    def per_example(self, name: str) -> torch.Tensor:
        part = self.rule.per_example(name)
        if name not in self.blocked:
            return part
        out = part.new_zeros((part.shape[0], self.rows, *part.shape[2:]))
        out[:, self.lo : self.hi] = part
        return out

    def cross_form(self, name: str) -> tuple[Any, ...] | None:
        """("block", lo, hi) for a blocked parameter (disjoint rows: no cross term), else the
        wrapped rule's."""
        return ("block", self.lo, self.hi) if name in self.blocked else self.rule.cross_form(name)


_MHA_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward)
_PROJECTION_WEIGHTS = ("q_proj_weight", "k_proj_weight", "v_proj_weight")


def _attention_arguments(module: nn.MultiheadAttention, args: tuple[Any, ...],
                         kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The call's arguments when it is batch-first attention on ``[B, T, d]`` tensors (any of
    the module's configurations: packed or separate projections, ``kdim``/``vdim``, extra
    key/value biases, zero attention, attention weights returned), else None."""
    if not module.batch_first:
        return None
    try:
        bound = _MHA_SIGNATURE.bind(module, *args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    call = bound.arguments
    if not all(isinstance(call[k], torch.Tensor) and call[k].dim() == 3 for k in ("query", "key", "value")):
        return None
    return call


def _only(names: dict[str, int], *wanted: str) -> dict[str, int]:
    return {n: i for n, i in names.items() if n in wanted}


def _input_projections(module: nn.MultiheadAttention, call: dict[str, Any], tap: Callable[..., Any],
                       names: dict[str, int]) -> list[torch.Tensor]:
    """``[q, k, v]`` projected (``[B, *, d]`` each), every projection tapped: for a packed
    weight, consecutive roles fed the same tensor share one Linear over their rows (self-attention:
    one call of the whole weight); separate weights (``kdim``/``vdim``) one Linear each, with
    their rows of the packed bias."""
    d = module.embed_dim
    inputs = [call["query"], call["key"], call["value"]]
    bias = module.in_proj_bias
    out: list[torch.Tensor] = []
    if module._qkv_same_embed_dim:
        used = _only(names, "in_proj_weight", "in_proj_bias")
        role = 0
        while role < 3:
            end = role + 1
            while end < 3 and inputs[end] is inputs[role]:
                end += 1
            lo, hi = role * d, end * d
            y = F.linear(inputs[role], module.in_proj_weight[lo:hi], None if bias is None else bias[lo:hi])
            y = tap(PROJECTION, module, used, inputs[role], y, (lo, hi))
            out.extend(y[..., i * d : (i + 1) * d] for i in range(end - role))
            role = end
        return out
    for role, weight_name in enumerate(_PROJECTION_WEIGHTS):
        lo, hi = role * d, (role + 1) * d
        y = F.linear(inputs[role], getattr(module, weight_name), None if bias is None else bias[lo:hi])
        out.append(tap(PROJECTION, module, _only(names, weight_name, "in_proj_bias"), inputs[role], y, (lo, hi)))
    return out


def _attention_forward(module: nn.MultiheadAttention, call: dict[str, Any], dropout: float, tap: Callable[..., Any],
                       names: dict[str, int], out_names: dict[str, int]) -> tuple[torch.Tensor, Any] | None:
    """The module's ``(output, attention weights or None)`` from explicit projections;
    ``tap(rule, owner, names, a, y, block)`` wraps each projection's output (``rule``: the
    entry that builds its layer gradient; identity when nothing is differentiated). The
    extra key/value biases are tapped as rows of the keys and values, one per example."""
    q, k, v = _input_projections(module, call, tap, names)
    if module.bias_k is not None and module.bias_v is not None:

        def extra_row(name: str) -> torch.Tensor:
            row = getattr(module, name).expand(q.shape[0], 1, module.embed_dim)  # [1, 1, d] -> one row per example
            return tap(KEY_VALUE_BIAS, module, _only(names, name), row, row)

        k, v = torch.cat([k, extra_row("bias_k")], dim=1), torch.cat([v, extra_row("bias_v")], dim=1)
    found = _attention_core(q, k, v, module, call, dropout)
    if found is None:
        return None
    ctx, weights = found
    out = F.linear(ctx, module.out_proj.weight, module.out_proj.bias)
    return tap(LINEAR, module.out_proj, out_names, ctx, out), weights


def _attention_core(q_proj: torch.Tensor, k_proj: torch.Tensor, v_proj: torch.Tensor, module: nn.MultiheadAttention,
                    call: dict[str, Any], dropout: float) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Scaled dot-product attention of projected queries ``[B, T, d]`` over projected keys and
    values ``[B, S, d]`` (extra biases appended) -> ``([B, T, d], weights or None)``, with the
    masks, zero attention and returned weights of ``F.multi_head_attention_forward`` (its
    logic, batch first)."""
    canonical = getattr(F, "_canonical_mask", None)
    none_or_dtype = getattr(F, "_none_or_dtype", None)
    if canonical is None or none_or_dtype is None:
        return None
    heads, need_weights = module.num_heads, bool(call["need_weights"])
    b, t, d = q_proj.shape
    s = call["key"].shape[1]
    extra = k_proj.shape[1] - s + int(module.add_zero_attn)  # key columns the module appends
    q = q_proj.reshape(b, t, heads, d // heads).transpose(1, 2)
    k = k_proj.reshape(b, -1, heads, d // heads).transpose(1, 2)
    v = v_proj.reshape(b, -1, heads, d // heads).transpose(1, 2)
    if module.add_zero_attn:
        k = torch.cat([k, k.new_zeros((b, heads, 1, d // heads))], dim=2)
        v = torch.cat([v, v.new_zeros((b, heads, 1, d // heads))], dim=2)
    attn_mask, padding, is_causal = call["attn_mask"], call["key_padding_mask"], bool(call["is_causal"])
    padding = canonical(mask=padding, mask_name="key_padding_mask", other_type=none_or_dtype(attn_mask),
                        other_name="attn_mask", target_type=q_proj.dtype)
    if is_causal and attn_mask is None:
        return None
    if is_causal and padding is None and not need_weights:
        mask = None  # F.multi_head_attention_forward hands the causal hint to SDPA
    else:
        mask = canonical(mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                         target_type=q_proj.dtype, check_other=False)
        if mask is not None:
            if mask.shape == (t, s):
                mask = mask.view(1, 1, t, s)
            elif mask.shape == (b * heads, t, s):
                mask = mask.view(b, heads, t, s)
            else:
                return None
            mask = F.pad(mask, (0, extra)) if extra else mask
        if padding is not None:
            if padding.shape != (b, s):
                return None
            padding = (F.pad(padding, (0, extra)) if extra else padding).view(b, 1, 1, s + extra)
            mask = padding if mask is None else mask + padding
        is_causal = False
    if need_weights:  # explicit weights, as the module computes them when it returns them
        scores = (q * math.sqrt(1.0 / (d // heads))) @ k.transpose(-2, -1)
        weights = torch.softmax(scores if mask is None else scores + mask, dim=-1)
        if dropout > 0:
            weights = F.dropout(weights, p=dropout)
        out = weights @ v
        returned = weights.mean(dim=1) if call["average_attn_weights"] else weights
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal)
        returned = None
    return out.transpose(1, 2).reshape(b, t, d), returned


class ProjectionRule(LinearRule):
    """Rows ``block`` of ``nn.MultiheadAttention``'s input projection, tapped by
    :meth:`AttentionRule.rewrite` (never claims a module by itself): a block of the packed
    weight and bias, or one of the separate ``q/k/v_proj_weight`` with its block of the
    packed bias."""

    kind, types = "projection", ()

    def claims(self, module: nn.Module) -> bool:
        return False

    def build(self, module: nn.Module, saved: tuple[torch.Tensor, ...], g: torch.Tensor, names: dict[str, int],
              ctx: BuildContext) -> MatmulGrad | BlockRows:  # type: ignore[override]
        d = module.embed_dim  # type: ignore[union-attr]
        lo, hi = ctx.block or (0, 3 * d)
        weight = next((n for n in ("in_proj_weight", *_PROJECTION_WEIGHTS) if n in names), None)
        roles = {role: n for role, n in (("weight", weight), ("bias", "in_proj_bias")) if n in names}
        rule = projection_grad(saved[0], g, saved[0].shape[-1], hi - lo, roles, ctx.mode, ctx.dtype)
        blocked = frozenset(n for n in roles.values() if n in ("in_proj_weight", "in_proj_bias"))  # packed: [3d, ...]
        return rule if (lo, hi) == (0, 3 * d) else BlockRows(rule, lo, hi, 3 * d, blocked)


class KeyValueBiasRule(Rule):
    """``bias_k`` / ``bias_v`` of ``nn.MultiheadAttention(add_bias_kv=True)``, tapped by
    :meth:`AttentionRule.rewrite` as the row ``[B, 1, d]`` appended to each example's keys or
    values: example ``i``'s gradient is the gradient of its own row (never claims a module)."""

    kind, types = "key_value_bias", ()

    def claims(self, module: nn.Module) -> bool:
        return False

    def build(self, module: nn.Module, saved: tuple[torch.Tensor, ...], g: torch.Tensor, names: dict[str, int],
              ctx: BuildContext) -> N.PerExampleGrad:
        return N.PerExampleGrad({n: N.as_dtype(g, N.compute_dtype(ctx.dtype)).reshape(g.shape[0], 1, 1, g.shape[-1])
                                 for n in names})


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
        """``(recomputed output, attention weights or None)`` through tapped projections, or
        None (see the module docstring); ``cache`` keeps the dropout-free checks across steps."""
        call = self._call(module, args, kwargs, names, params_of)
        if call is None or not isinstance(output, tuple) or len(output) != 2 or not _reads_batched(call, batched):
            return None
        dropout = module.dropout if module.training else 0.0
        if dropout > 0 and not _matches_without_dropout(module, args, kwargs, call, cache):
            return None
        compute = lambda: _attention_forward(module, call, dropout, tap, names, params_of(module.out_proj))  # noqa: E731
        if dropout > 0:  # checked above without dropout
            return compute()
        return checked_once(cache, ("same output", *_call_signature(module, call)), compute,
                            lambda out: same_outputs(out, output))

    def rewrite_ahead(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], names: dict[str, int],
                      tap: Callable[..., torch.Tensor], params_of: Callable[[nn.Module], dict[str, int]],
                      cache: dict[tuple[Any, ...], bool]) -> Any:
        """:meth:`rewrite`'s output without the module's forward, once this call signature has
        been checked (with dropout: checked without it)."""
        call = self._call(module, args, kwargs, names, params_of)
        if call is None:
            return None
        signature = _call_signature(module, call)
        dropout = module.dropout if module.training else 0.0
        if cache.get(signature if dropout > 0 else ("same output", *signature)) is not True:
            return None
        return _attention_forward(module, call, dropout, tap, names, params_of(module.out_proj))

    def confirms(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any,
                 batched: dict[int, bool]) -> bool:
        """Query, key and value carry the batch axis first."""
        call = _attention_arguments(module, args, kwargs)  # type: ignore[arg-type]
        return call is not None and _reads_batched(call, batched)

    @staticmethod
    def _call(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], names: dict[str, int],
              params_of: Callable[[nn.Module], dict[str, int]]) -> dict[str, Any] | None:
        """The call's arguments when the rule may recompute it: the module's own forward, with
        differentiated parameters, in a configuration :func:`_attention_arguments` takes."""
        if type(module).forward is not nn.MultiheadAttention.forward:
            return None
        assert isinstance(module, nn.MultiheadAttention)
        if not (names or params_of(module.out_proj)):
            return None
        return _attention_arguments(module, args, kwargs)


def _reads_batched(call: dict[str, Any], batched: dict[int, bool]) -> bool:
    """Whether the call's query, key and value carry the batch axis first (provenance verdicts)."""
    return all(batched.get(id(call[k]), False) for k in ("query", "key", "value"))


def _matches_without_dropout(module: nn.MultiheadAttention, args: tuple[Any, ...], kwargs: dict[str, Any],
                             call: dict[str, Any], cache: dict[tuple[Any, ...], bool]) -> bool:
    signature = _call_signature(module, call)
    if signature not in cache:
        rate = module.dropout
        try:
            module.dropout = 0.0
            with torch.no_grad():
                ref = module.forward(*args, **kwargs)  # .forward: no hooks
                ours = _attention_forward(module, call, 0.0, lambda rule, owner, used, a, y, block=None: y, {}, {})
        finally:
            module.dropout = rate
        cache[signature] = same_outputs(ours, ref)
    return cache[signature]


def _call_signature(module: nn.MultiheadAttention, call: dict[str, Any]) -> tuple[Any, ...]:
    """What a check of the recomputation is kept for: the module, its masks' kinds, causality,
    which of query, key and value are the same tensor, the weights asked for, the shapes and
    dtypes (batch size left out) and the mode."""
    masks = tuple((name, None if m is None else (m.dtype, m.dim())) for name in ("attn_mask", "key_padding_mask")
                  for m in [call[name]])
    q, k, v = call["query"], call["key"], call["value"]
    return (id(module), masks, bool(call["is_causal"]), q is k, k is v, q is v, bool(call["need_weights"]),
            bool(call["average_attn_weights"]), tuple(q.shape[1:]), tuple(k.shape[1:]), tuple(v.shape[1:]), q.dtype,
            module.training)


PROJECTION, KEY_VALUE_BIAS, ATTENTION = ProjectionRule(), KeyValueBiasRule(), AttentionRule()

__all__ = ["ATTENTION", "KEY_VALUE_BIAS", "PROJECTION", "AttentionRule", "BlockRows", "KeyValueBiasRule", "ProjectionRule"]
