"""Per-layer rules of the fast clipping backends.

A rule sees one call of one module: its input ``a`` (batch first) and the gradient
``g`` of the batch loss ``sum_i L_i`` with respect to the module's output. When no
layer mixes examples, row ``i`` of ``g`` is the gradient of ``L_i`` alone, so example
``i``'s gradient for the module's parameters is a function of ``(a_i, g_i)``:

* Linear ``y = a W^T + b`` with ``a_i: [T, d_in]``, ``g_i: [T, d_out]`` (``T = 1``
  without a sequence axis): ``dW_i = g_i^T a_i`` and ``db_i = sum_t g_it``, so
  ``||dW_i||^2 = sum_{t,s} (a_it . a_is)(g_it . g_is)`` (the ghost norm: Goodfellow
  2015 for ``T = 1``, Li et al. 2021 for sequences), ``O(T^2 (d_in + d_out))`` instead
  of ``O(T d_in d_out)``.
* Hugging Face ``Conv1D`` (``y = a W + b``, ``W: [d_in, d_out]``): the Linear rule on
  ``W^T``, results transposed back.
* Conv1d / Conv2d: unfolded input patches turn the layer into a Linear over output
  positions, one per group (Bu et al. 2023).
* Embedding: ``||dE_i||^2 = sum_{t,s} [id_it = id_is] (g_it . g_is)``, computed by
  summing ``g`` over each example's distinct ids; no ``[B, vocab, dim]`` tensor.
* LayerNorm / GroupNorm / RMSNorm: per-example affine gradients are as small as the
  layer's output channels, so they are computed directly.

Every rule gives ``sq_norm(name)`` (float64 ``[B]``), ``weighted(name, w, keep)`` (the
sum ``sum_i w_i dP_i`` in one pass: book-keeping, Bu et al. 2023) and
``per_example(name)`` (``[B, *shape]``, for parameters shared by several calls).
``keep`` (bool ``[B]`` or ``None``) marks the examples whose gradient is finite; the
others contribute exactly zero, even when their activations hold NaN or inf.
"""

from __future__ import annotations

from typing import Any, Callable, Literal

import optree
import torch
import torch.nn.functional as F
from torch import nn

from opake_fx.dpsgd.clipping import _certified as cert
from opake_fx.dpsgd.clipping._per_example import map_examples

Method = Literal["ghost", "pe"]

# Largest transient (in elements) that a rule builds at once: unfolded patches and
# Gram matrices are formed for slices of the batch under this bound. 2 MiB of float32:
# transients stay in cache and are reused by the allocator instead of being faulted in
# fresh each step (cnn-256 step, 2 threads: 61-84 ms at 2**23, 55-59 ms at 2**19).
_CHUNK_ELEMS = 1 << 19
# Per-example weight gradients are formed this many elements at a time (about L2 size),
# so their norms are read back from cache.
_CACHE_ELEMS = 1 << 18


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype rules compute in: at least float32, so low-precision models sum exactly enough."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class PerExampleGrad:
    """A rule from explicit per-example gradients ``{name: [B, *shape]}`` (norm layers, fallbacks)."""

    def __init__(self, grads: dict[str, torch.Tensor]) -> None:
        self.grads = grads
        self._sq: dict[str, torch.Tensor] = {}

    def sq_norm(self, name: str) -> torch.Tensor:
        if name not in self._sq:
            self._sq[name] = sq_norms_of(self.grads[name])
        return self._sq[name]

    def certified(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sq_norm(name), torch.zeros_like(self.sq_norm(name))

    def weighted(self, name: str, w: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        return weighted_sum_of(self.grads[name], w, keep)

    def per_example(self, name: str) -> torch.Tensor:
        return self.grads[name]


class MatmulGrad:
    """Linear and (unfolded) convolution layers: ``dW_i = sum_t g_it a_it^T`` per group.

    ``patches(lo, hi)`` gives the inputs of examples ``lo:hi`` as ``[b, groups, T, d_in]``
    (a slice of the stored input for Linear, freshly unfolded patches for convolutions);
    ``g`` is ``[B, groups, T, d_out]``. ``method="pe"`` forms the per-example weight
    gradients at once (memory ``B d_in d_out``) and drops ``a`` and ``g``; ``"ghost"``
    keeps ``a`` and ``g`` and takes norms from Gram matrices. Norms are computed when the
    rule is built (in the backward pass, while ``a`` and ``g`` are in cache).
    """

    def __init__(
        self,
        patches: Callable[[int, int], torch.Tensor],
        g: torch.Tensor,
        *,
        d_in: int,
        weight_shape: tuple[int, ...] | None,
        bias_shape: tuple[int, ...] | None,
        names: dict[str, str],
        method: Method,
        dtype: torch.dtype,
    ) -> None:
        self.batch, self.groups, self.t, self.d_out = g.shape
        self.d_in, self.dtype = d_in, dtype
        self.names = names  # role ("weight" / "bias") -> parameter name
        self.weight_shape = weight_shape
        g = _as_dtype(g, dtype)
        self.patches: Callable[[int, int], torch.Tensor] | None = None
        self.g: torch.Tensor | None = None
        self._pe: torch.Tensor | None = None
        self._a2: torch.Tensor | None = None  # T = 1, one group: a and g as [B, d]
        self._g2: torch.Tensor | None = None
        self._bias_pe: torch.Tensor | None = None
        self._bias_sq: torch.Tensor | None = None
        # Certified squared norm of the exact per-example weight gradient of the stored a and g;
        # the rounding bound of this rule's weighted sum (ghost method, T > 1); the squared
        # norm that decides the weight, (sqrt(exact) + rounding)^2; and sum_t |a_t| |g_t|.
        self._exact_sq: torch.Tensor | None = None
        self._ws_err: torch.Tensor | None = None
        self._sq: torch.Tensor | None = None
        self._abs: torch.Tensor | None = None
        if self.t == 1 and self.groups == 1:
            self._g2 = g.reshape(self.batch, self.d_out)
            sq_g = sq_norms_of(self._g2)  # small [B, d] rows: float64 costs nothing here
            if bias_shape is not None:
                self._bias_pe, self._bias_sq = self._g2.reshape(self.batch, *bias_shape), sq_g
            if weight_shape is not None:  # ||g a^T|| = ||a|| ||g||
                self._a2 = _as_dtype(patches(0, self.batch).reshape(self.batch, d_in), dtype)
                self._sq = sq_norms_of(self._a2) * sq_g * (1.0 + cert.gamma(2, torch.float64))
                self._abs = self._sq.sqrt()
            return
        if bias_shape is not None:
            self._bias_pe = g.sum(dim=2).reshape(self.batch, *bias_shape)
        if weight_shape is None:
            return
        if method == "pe":
            self._pe, self._sq = self._weight_per_example(patches, g)
        else:
            self.patches, self.g = patches, g
            exact = torch.zeros(self.batch, dtype=torch.float64, device=g.device)
            self._abs = torch.zeros(self.batch, dtype=torch.float64, device=g.device)
            for lo, hi in self._chunks(self.groups * self.t * max(self.t, d_in, self.d_out)):
                exact[lo:hi], self._abs[lo:hi] = cert.gram_sq_norms(_as_dtype(patches(lo, hi), dtype), g[lo:hi])
            # The weighted sum adds sum_t w g_t a_t^T in `dtype`: its rounding, up to
            # gamma_{T+2} sum_t |g_t| |a_t|, is part of what this example contributes.
            self._exact_sq = exact
            self._ws_err = self._abs * cert.matmul_rounding(self.t, dtype)
            self._sq = (exact.sqrt() + self._ws_err).square()

    def sq_norm(self, name: str) -> torch.Tensor:
        if self._role(name) == "bias":
            if self._bias_sq is None:
                self._bias_sq = sq_norms_of(self._bias_pe)
            return self._bias_sq
        assert self._sq is not None
        return self._sq

    def certified(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(certified squared norm of the exact gradient, rounding bound of the weighted sum)."""
        if self._role(name) == "bias" or self._exact_sq is None or self._ws_err is None:
            sq = self.sq_norm(name)
            return sq, torch.zeros_like(sq)
        return self._exact_sq, self._ws_err

    def weighted(self, name: str, w: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        if self._role(name) == "bias":
            return weighted_sum_of(self._bias_pe, w, keep)
        if self._pe is not None:
            return weighted_sum_of(self._pe, w, keep)
        w = _as_dtype(w, self.dtype)
        if self._a2 is not None and self._g2 is not None:
            a, g = self._a2, self._g2
            if keep is not None:
                a, g = _zero_rows(a, keep), _zero_rows(g, keep)
            # sum_i w_i g_i a_i^T as one matmul, scaling the narrower side
            if self.d_out <= self.d_in:
                return (g * w.unsqueeze(1)).t().mm(a).reshape(self.weight_shape)
            return g.t().mm(a * w.unsqueeze(1)).reshape(self.weight_shape)
        assert self.patches is not None and self.g is not None
        total: torch.Tensor | None = None
        for lo, hi in self._chunks(self.groups * self.t * self.d_in):
            a, g = _as_dtype(self.patches(lo, hi), self.dtype), self.g[lo:hi]
            if keep is not None:
                a, g = _zero_rows(a, keep[lo:hi]), _zero_rows(g, keep[lo:hi])
            # Scale the narrower of a and g by the weights (fewer multiplies), then one matmul.
            if self.d_out <= self.d_in:
                g = g * w[lo:hi].view(-1, 1, 1, 1)
            else:
                a = a * w[lo:hi].view(-1, 1, 1, 1)
            if self.groups == 1:  # one large matmul, as the non-private backward does
                part = g.reshape(-1, self.d_out).t().mm(a.reshape(-1, self.d_in)).unsqueeze(0)
            else:
                part = torch.einsum("bgto,bgti->goi", g, a)
            total = part if total is None else total.add_(part)
        assert total is not None
        return total.reshape(self.weight_shape)

    def per_example(self, name: str) -> torch.Tensor:
        if self._role(name) == "bias":
            return self._bias_pe
        if self._pe is not None:
            return self._pe
        if self._a2 is not None and self._g2 is not None:
            return (self._g2.unsqueeze(2) * self._a2.unsqueeze(1)).reshape(self.batch, *self.weight_shape)
        assert self.patches is not None and self.g is not None
        return self._weight_per_example(self.patches, self.g)[0]

    def _weight_per_example(self, patches: Callable[[int, int], torch.Tensor], g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Chunks small enough that each chunk's norms are taken while it is still in cache.
        assert self.weight_shape is not None
        pe = torch.empty((self.batch, self.groups, self.d_out, self.d_in), dtype=self.dtype, device=g.device)
        sq = torch.empty(self.batch, dtype=torch.float64, device=g.device)
        per_ex = self.groups * self.d_out * self.d_in
        step = max(1, min(_CHUNK_ELEMS // max(1, self.groups * self.t * self.d_in), _CACHE_ELEMS // max(1, per_ex)))
        for lo in range(0, self.batch, step):
            hi = min(lo + step, self.batch)
            a, gc = _as_dtype(patches(lo, hi), self.dtype), g[lo:hi]
            if self.groups == 1:
                torch.bmm(gc[:, 0].transpose(1, 2), a[:, 0], out=pe[lo:hi, 0])
            else:
                pe[lo:hi] = torch.einsum("bgto,bgti->bgoi", gc, a)
            sq[lo:hi] = sq_norms_of(pe[lo:hi])
        return pe.reshape(self.batch, *self.weight_shape), sq

    def _chunks(self, per_example_elems: int) -> list[tuple[int, int]]:
        step = max(1, _CHUNK_ELEMS // max(1, per_example_elems))
        return [(lo, min(lo + step, self.batch)) for lo in range(0, self.batch, step)]

    def _role(self, name: str) -> str:
        return "bias" if self.names.get("bias") == name else "weight"


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
        g = _as_dtype(g.reshape(batch, -1, dim), dtype)
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
        row_sq = sq_norms_of(self.rows)
        sums = torch.zeros(batch, dtype=torch.float64, device=g.device).index_add_(0, self.owner, row_sq)
        self._sq = sums * (1.0 + cert.gamma(self.rows.shape[0] + 2, torch.float64))

    def sq_norm(self, name: str) -> torch.Tensor:
        return self._sq

    def certified(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self._sq, torch.zeros_like(self._sq)

    def weighted(self, name: str, w: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        coeff = _as_dtype(w, self.dtype)[self.owner].unsqueeze(1)
        if keep is not None:
            coeff = torch.where(keep[self.owner].unsqueeze(1), coeff, torch.zeros_like(coeff))
            rows = _zero_rows(self.rows, keep[self.owner])
        else:
            rows = self.rows
        out = torch.zeros(self.shape, dtype=self.dtype, device=self.rows.device)
        # The weighted sum is the rule's last use of its rows: scale them in place (no copy).
        return out.index_add_(0, self.ids, rows.mul_(coeff))

    def per_example(self, name: str) -> torch.Tensor:
        # Only for an embedding table shared with another call (e.g. tied to an output layer).
        out = torch.zeros((self.batch, *self.shape), dtype=self.dtype, device=self.rows.device)
        return out.index_put_((self.owner, self.ids), self.rows, accumulate=True)


class _Rearranged:
    """A rule whose norms are the wrapped rule's (a transpose or a zero padding keeps them);
    subclasses rearrange its weighted sums and per-example gradients."""

    def __init__(self, rule: MatmulGrad) -> None:
        self.rule = rule

    def sq_norm(self, name: str) -> torch.Tensor:
        return self.rule.sq_norm(name)

    def certified(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rule.certified(name)


class BlockRows(_Rearranged):
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


class SumOfUses:
    """A parameter used by several calls (a tied embedding and output layer, a layer applied
    twice), without per-example gradients: ``||sum_k P_k||^2 = sum_k ||P_k||^2 + 2 sum_{k<l}
    <P_k, P_l>``, the cross terms from the calls' stored inputs and output gradients
    (:func:`sum_of_uses`); the weighted sum is the sum of the calls' weighted sums."""

    def __init__(self, parts: list[tuple[Any, str]], exact_sq: torch.Tensor, ws_err: torch.Tensor,
                 dtype: torch.dtype) -> None:
        self.parts, self._exact_sq, self._ws_err = parts, exact_sq, ws_err
        # The parts' weighted sums are added in `dtype`: one more rounding each.
        self._sq = ((exact_sq.sqrt() + ws_err) * (1.0 + cert.gamma(len(parts) + 1, dtype))).square()

    def sq_norm(self, name: str) -> torch.Tensor:
        return self._sq

    def certified(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self._exact_sq, self._ws_err

    def weighted(self, name: str, w: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        total = None
        for rule, n in self.parts:
            part = rule.weighted(n, w, keep)
            total = part if total is None else total.add_(part)
        return total

    def per_example(self, name: str) -> torch.Tensor:
        pe = [rule.per_example(n) for rule, n in self.parts]
        return sum(pe[1:], pe[0])


def sum_of_uses(parts: list[tuple[Any, str]], dtype: torch.dtype) -> SumOfUses | None:
    """The rule of a parameter from the rules of its calls, or None where a cross term has no
    formula here (the caller then sums per-example gradients).

    Cross terms ``<P_k, P_l>_i`` per example, all exact up to a certified rounding bound
    (evaluated in float64; the bound is ``c * S_k * S_l`` with ``S`` the sum of absolute
    terms of each form, see :func:`_cross_term`):

    * two Linear calls of the same weight (inputs ``a``, ``a'``, output gradients ``g``, ``g'``):
      ``sum_{t,s} (a_t . a'_s)(g_t . g'_s)``, a cross Gram product (Li et al.'s ghost norm
      between two calls);
    * an embedding table and a Linear using it as weight (a tied output layer): with the
      lookup's token gradients ``e_s`` and ids ``v_s``, ``sum_{s,t} g_t[v_s] (e_s . a_t)``;
    * the same table looked up twice: ``sum_{s,t} [v_s = v'_t] (e_s . e'_t)``;
    * calls with small per-example gradients at hand (norm layers, biases, per-example
      Linear weights): their inner product.

    The squared norm is capped at ``(sum_k ||P_k||)^2`` (triangle inequality) and never
    negative; ``dtype`` is the one the weighted sums are added in.
    """
    forms = [_cross_form(rule, name) for rule, name in parts]
    if any(f is None for f in forms):
        return None
    certified = [rule.certified(n) for rule, n in parts]
    own = sum(c[0] for c in certified)
    total_err = sum(c[1] for c in certified)
    try:
        cross = torch.zeros_like(own)
        for k in range(len(forms)):
            for l in range(k + 1, len(forms)):
                f, h = forms[k], forms[l]
                if f[0] == "block" or h[0] == "block":
                    if f[0] == h[0] == "block" and (f[2] <= h[1] or h[2] <= f[1]):
                        continue  # disjoint rows: orthogonal
                    raise _NoCrossFormula
                value, bound = _cross_term(f, h)
                cross += value + bound  # |computed - exact| <= bound: the upper end of the interval
    except _NoCrossFormula:
        return None
    triangle = sum(c[0].sqrt() for c in certified).square()
    exact_sq = torch.minimum((own + 2 * cross).clamp_min(0.0), triangle)
    return SumOfUses(parts, exact_sq, total_err, dtype)


class _NoCrossFormula(Exception):
    pass


def _cross_form(rule: Any, name: str) -> tuple[Any, ...] | None:
    """What a call offers for cross terms, with ``s`` [B], an upper bound of the sum of
    absolute terms behind the call's gradient: ("pe", [B, ...], s = norm), ("linear",
    a(lo, hi) [b, T, d_in], g [B, T, d_out], weight shape, s = sum_t |a_t| |g_t|), or
    ("tokens", ids [B, T], e [B, T, D], s = sum_t |e_t|)."""
    if isinstance(rule, BlockRows):
        return ("block", rule.lo, rule.hi)
    if isinstance(rule, PerExampleGrad):
        return ("pe", rule.per_example(name), rule.sq_norm(name).sqrt())
    if isinstance(rule, EmbeddingGrad):
        if rule.tokens is None:
            return None
        ids, e = rule.tokens
        s = torch.linalg.vector_norm(e.to(torch.float64), dim=2).sum(dim=1) * (1.0 + cert.gamma(e.shape[1] + e.shape[2] + 4, torch.float64))
        return ("tokens", ids, e, s)
    if isinstance(rule, MatmulGrad):
        if rule._role(name) == "bias" or rule._pe is not None:
            return ("pe", rule.per_example(name), rule.sq_norm(name).sqrt())
        if rule._a2 is not None and rule._g2 is not None:
            a2, g2 = rule._a2, rule._g2
            return ("linear", lambda lo, hi: a2[lo:hi].unsqueeze(1), g2.unsqueeze(1), rule.weight_shape, rule._abs)
        if rule.patches is not None and rule.g is not None and rule.groups == 1:
            patches, g = rule.patches, rule.g
            return ("linear", lambda lo, hi: patches(lo, hi)[:, 0], g[:, 0], rule.weight_shape, rule._abs)
    return None  # e.g. a transposed weight: no formula here


def _cross_term(f: tuple[Any, ...], h: tuple[Any, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(<P_f, P_h>`` per example evaluated in float64, a bound on its rounding error``)``.

    Each form's terms are bounded by its ``s`` (last item): e.g. for two Linear calls the
    computed ``sum_ts (a_t . a'_s)(g_t . g'_s)`` is off by at most ``(gamma_{d_in} +
    gamma_{d_out} + gamma_{T T'}) s s'``, since ``sum_ts |a_t||a'_s||g_t||g'_s| = s s'``.
    """
    if f[0] == "tokens" and h[0] != "tokens":
        f, h = h, f
    if f[0] == "linear" and h[0] == "pe":
        f, h = h, f
    if f[0] == "pe" and h[0] == "linear":
        raise _NoCrossFormula  # (a per-example weight against ghost operands: no formula here)
    f64 = torch.float64
    kind = (f[0], h[0])
    s_f, s_h = f[-1], h[-1]
    if kind == ("pe", "pe"):
        a, b = f[1], h[1]
        a, b = a.reshape(a.shape[0], -1).to(f64), b.reshape(b.shape[0], -1).to(f64)
        return torch.linalg.vecdot(a, b), cert.gamma(a.shape[1] + 2, f64) * s_f * s_h
    if kind == ("linear", "linear"):
        (_, a1, g1, shape1, _), (_, a2, g2, shape2, _) = f, h
        if shape1 != shape2:
            raise _NoCrossFormula
        out = []
        batch, t1, t2 = g1.shape[0], g1.shape[1], g2.shape[1]
        step = max(1, _CHUNK_ELEMS // max(1, t1 * t2))
        for lo in range(0, batch, step):
            hi = min(lo + step, batch)
            aa = torch.bmm(a1(lo, hi).to(f64), a2(lo, hi).to(f64).transpose(1, 2))
            gg = torch.bmm(g1[lo:hi].to(f64), g2[lo:hi].to(f64).transpose(1, 2))
            out.append(torch.linalg.vecdot(aa.flatten(1), gg.flatten(1)))
        c = cert.gamma(shape1[1] + 2, f64) + cert.gamma(shape1[0] + 2, f64) + cert.gamma(t1 * t2 + 2, f64)
        return torch.cat(out), 1.01 * c * s_f * s_h
    if kind == ("linear", "tokens"):
        (_, a_of, g, shape, _), (_, ids, e, _) = f, h
        if tuple(shape) != (g.shape[-1], e.shape[-1]):
            raise _NoCrossFormula
        out = []
        batch, th, te = g.shape[0], g.shape[1], ids.shape[1]
        step = max(1, _CHUNK_ELEMS // max(1, th * max(te, e.shape[-1])))
        for lo in range(0, batch, step):
            hi = min(lo + step, batch)
            dots = torch.bmm(e[lo:hi].to(f64), a_of(lo, hi).to(f64).transpose(1, 2))  # [b, Te, Th]: e_s . a_t
            picked = torch.gather(g[lo:hi], 2, ids[lo:hi].unsqueeze(1).expand(-1, th, -1))  # [b, Th, Te]: g_t[v_s]
            out.append((dots * picked.to(f64).transpose(1, 2)).flatten(1).sum(1))
        # sum_{s,t} |g_t[v_s]| |e_s| |a_t| <= (sum_t |g_t| |a_t|) (sum_s |e_s|)
        c = cert.gamma(e.shape[-1] + 2, f64) + cert.gamma(th * te + 2, f64)
        return torch.cat(out), 1.01 * c * s_f * s_h
    if kind == ("pe", "tokens"):  # a tied output layer with per-example weight gradients [B, V, D]
        (_, pe, _), (_, ids, e, _) = f, h
        if pe.dim() != 3 or pe.shape[-1] != e.shape[-1]:
            raise _NoCrossFormula
        rows = torch.gather(pe, 1, ids.unsqueeze(-1).expand(-1, -1, pe.shape[-1]))  # [B, Te, D]: pe_i[v_s]
        # sum_s |pe[v_s]| |e_s| <= ||pe|| sum_s |e_s|
        return (rows.to(f64) * e.to(f64)).flatten(1).sum(1), cert.gamma(e.shape[1] * e.shape[2] + 2, f64) * s_f * s_h
    if kind == ("tokens", "tokens"):
        (_, ids1, e1, _), (_, ids2, e2, _) = f, h
        same = (ids1.unsqueeze(2) == ids2.unsqueeze(1)).to(f64)
        value = (torch.bmm(e1.to(f64), e2.to(f64).transpose(1, 2)) * same).flatten(1).sum(1)
        c = cert.gamma(e1.shape[-1] + 2, f64) + cert.gamma(e1.shape[1] * e2.shape[1] + 2, f64)
        return value, 1.01 * c * s_f * s_h
    raise _NoCrossFormula


# --- constructors -------------------------------------------------------------------


def linear_grad(
    module: nn.Linear, a: torch.Tensor, g: torch.Tensor, names: dict[str, str], mode: str, dtype: torch.dtype
) -> MatmulGrad:
    """Rule for ``nn.Linear`` on input ``[B, *, d_in]``; ``dtype``: the parameters' dtype."""
    return projection_grad(a, g, module.in_features, module.out_features, names, mode, dtype)


def projection_grad(
    a: torch.Tensor, g: torch.Tensor, d_in: int, d_out: int, names: dict[str, str], mode: str, dtype: torch.dtype
) -> MatmulGrad:
    """Rule for ``y = a W^T + b`` with ``W: [d_out, d_in]`` (``names``: role "weight"/"bias" ->
    parameter name), on input ``[B, *, d_in]``: ``nn.Linear``, and the packed input projection
    of ``nn.MultiheadAttention``."""
    batch = a.shape[0]
    dtype = compute_dtype(dtype)
    a3 = a.reshape(batch, 1, -1, d_in)
    t = a3.shape[2]
    return MatmulGrad(
        lambda lo, hi: a3[lo:hi],
        g.reshape(batch, 1, t, d_out),
        d_in=d_in,
        weight_shape=(d_out, d_in) if "weight" in names else None,
        bias_shape=(d_out,) if "bias" in names else None,
        names=names,
        method=choose_method(mode, t, d_in, d_out),
        dtype=dtype,
    )


def transposed_linear_grad(
    module: nn.Module, a: torch.Tensor, g: torch.Tensor, names: dict[str, str], mode: str, dtype: torch.dtype
) -> TransposedWeight:
    """Rule for a Linear whose weight is stored as ``[d_in, d_out]`` (``y = a W + b``):
    Hugging Face's ``Conv1D`` (GPT-2). The Linear rule on ``W^T``; norms are unchanged by
    the transpose, weighted sums and per-example weights are transposed back."""
    d_in, d_out = module.weight.shape
    return TransposedWeight(projection_grad(a, g, d_in, d_out, names, mode, dtype), names.get("weight"))


class TransposedWeight(_Rearranged):
    """A rule whose weight parameter is the transpose of the wrapped rule's ``[d_out, d_in]`` weight."""

    def __init__(self, rule: MatmulGrad, weight_name: str | None) -> None:
        super().__init__(rule)
        self.weight_name = weight_name

    def weighted(self, name: str, w: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        out = self.rule.weighted(name, w, keep)
        return out.t().contiguous() if name == self.weight_name else out

    def per_example(self, name: str) -> torch.Tensor:
        pe = self.rule.per_example(name)
        return pe.transpose(1, 2).contiguous() if name == self.weight_name else pe


def conv_grad(
    module: nn.Conv1d | nn.Conv2d, a: torch.Tensor, g: torch.Tensor, names: dict[str, str], mode: str, dtype: torch.dtype
) -> MatmulGrad:
    """Rule for ``nn.Conv1d`` / ``nn.Conv2d``: im2col patches, then a Linear per group."""
    is_1d = isinstance(module, nn.Conv1d)
    padding: tuple[int, ...]
    if module.padding_mode != "zeros" or isinstance(module.padding, str):
        # torch pads explicitly for these modes ('same' may be asymmetric); do the same.
        pad = list(module._reversed_padding_repeated_twice)
        if any(pad):
            a = F.pad(a, pad, mode="constant" if module.padding_mode == "zeros" else module.padding_mode)
        padding = (0, 0)
    else:
        padding = (0, *module.padding) if is_1d else tuple(module.padding)
    if is_1d:  # a [B, C, L] is a [B, C, 1, L] image under a (1, k) kernel
        a, g = a.unsqueeze(2), g.unsqueeze(2)
    kernel = (1, *module.kernel_size) if is_1d else tuple(module.kernel_size)
    stride = (1, *module.stride) if is_1d else tuple(module.stride)
    dilation = (1, *module.dilation) if is_1d else tuple(module.dilation)
    batch, groups = a.shape[0], module.groups
    d_in = module.in_channels // groups * kernel[0] * kernel[1]
    d_out = module.out_channels // groups
    t = g.shape[2] * g.shape[3]

    def patches(lo: int, hi: int) -> torch.Tensor:
        cols = _im2col(a[lo:hi], kernel, stride, dilation, padding)  # [b, C*k, T]
        return cols.view(hi - lo, groups, d_in, t).transpose(2, 3)

    return MatmulGrad(
        patches,
        g.reshape(batch, groups, d_out, t).transpose(2, 3),
        d_in=d_in,
        weight_shape=tuple(module.weight.shape) if "weight" in names else None,
        bias_shape=(module.out_channels,) if "bias" in names else None,
        names=names,
        method=choose_method(mode, t, d_in, d_out),
        dtype=compute_dtype(dtype),
    )


def norm_grad(module: nn.Module, a: torch.Tensor, g: torch.Tensor, names: dict[str, str], dtype: torch.dtype) -> PerExampleGrad:
    """Rule for LayerNorm / GroupNorm / RMSNorm: ``dgamma_i = sum g_i * xhat_i``, ``dbeta_i = sum g_i``."""
    dtype = compute_dtype(dtype)
    a, g = _as_dtype(a, dtype), _as_dtype(g, dtype)
    if isinstance(module, nn.GroupNorm):
        xhat = F.group_norm(a, module.num_groups, None, None, module.eps)
        dims = tuple(range(2, a.dim()))  # reduce spatial positions; keep [B, C]
    else:
        shape = tuple(module.normalized_shape)
        if isinstance(module, nn.LayerNorm):
            xhat = F.layer_norm(a, shape, None, None, module.eps)
        else:
            xhat = F.rms_norm(a, shape, None, module.eps)
        dims = tuple(range(1, a.dim() - len(shape)))  # reduce positions; keep [B, *normalized_shape]
    grads = {}
    for role, name in names.items():
        per = xhat.mul_(g) if role == "weight" else g  # xhat is ours: reuse its buffer
        grads[name] = per.sum(dim=dims) if dims else per
    return PerExampleGrad(grads)


def module_per_example(
    module: nn.Module,
    bound: dict[str, torch.Tensor],
    diff_names: list[str],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    grads_out: list[torch.Tensor | None],
    batch: int,
    batched: list[int],
) -> PerExampleGrad:
    """Fallback rule: per-example gradients of ``diff_names`` by ``vmap`` of the module's vjp.

    ``bound`` holds every parameter and buffer the call used (names relative to
    ``module``); ``grads_out`` the gradient of each tensor output (``None``: no gradient
    reached it). The tensor arguments at ``batched`` (flattened positions of ``(args,
    kwargs)``, found by provenance, never by size) are split per example; others are
    broadcast.
    """
    flat, spec = optree.tree_flatten((args, kwargs))
    positions = list(batched)
    used = [k for k, go in enumerate(grads_out) if go is not None]
    diff = {n: bound[n].detach() for n in diff_names}
    const = {n: t.detach() for n, t in bound.items() if n not in diff}

    def call(params: dict[str, torch.Tensor], xs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        items = list(flat)
        for k, x in zip(positions, xs):
            items[k] = x.unsqueeze(0)
        a, kw = optree.tree_unflatten(spec, items)
        out = torch.func.functional_call(module, {**const, **params}, tuple(a), kw)
        outs = [o for o in optree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        return tuple(outs[k] for k in used)

    def one(xs: tuple[torch.Tensor, ...], gs: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
        _, vjp_fn = torch.func.vjp(lambda p: call(p, xs), diff)
        return vjp_fn(tuple(go.unsqueeze(0) for go in gs))[0]

    if not used:
        return PerExampleGrad({n: torch.zeros((batch, *diff[n].shape), dtype=diff[n].dtype, device=diff[n].device) for n in diff_names})
    xs = tuple(flat[k] for k in positions)
    gs = tuple(grads_out[k] for k in used)
    return PerExampleGrad(dict(map_examples(one, (0, 0), (xs, gs), batch, what=f"the fallback of {type(module).__name__}")))


def choose_method(mode: str, t: int, d_in: int, d_out: int) -> Method:
    """How a Linear / convolution layer forms its norms and its share of the weighted sum.

    Both variants are book-keeping (one backward pass). Per-example weight gradients
    (``"pe"``) cost ``T d_in d_out`` multiply-adds per example, written out as
    ``d_in d_out`` numbers that the weighted sum then reads back; ghost norms cost
    ``T^2 (d_in + d_out)`` for the two Gram matrices, keep only ``a`` and ``g``
    (``T (d_in + d_out)`` numbers), and the weighted sum is one large matmul like the
    non-private weight gradient. The ratio of the two costs is the same in flops and in
    memory: ``T (d_in + d_out)`` vs ``d_in d_out``. ``"auto"`` takes the smaller
    (per-example gradients at a tie), which is the rule of Bu et al. (2023) for mixed
    ghost clipping; ``"ghost"`` always takes ghost norms. ``T = 1`` is always ghost: its
    norm ``||a|| ||g||`` is free.
    """
    if mode == "ghost" or t == 1:
        return "ghost"
    return "pe" if d_in * d_out <= t * (d_in + d_out) else "ghost"


# --- small tensor helpers -----------------------------------------------------------


def sq_norms_of(pe: torch.Tensor) -> torch.Tensor:
    """Certified squared L2 norm of each row of ``[B, ...]`` as stored, float64 ``[B]``
    (:func:`opake_fx.dpsgd.clipping._certified.sq_norms`)."""
    return cert.sq_norms(pe)


def weighted_sum_of(pe: torch.Tensor, w: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """``sum_i w_i pe_i``; rows with ``keep = False`` contribute exactly zero."""
    if keep is not None:
        pe = _zero_rows(pe, keep)
    return torch.matmul(_as_dtype(w, pe.dtype), pe.reshape(pe.shape[0], -1)).reshape(pe.shape[1:])


def _im2col(
    a: torch.Tensor, kernel: tuple[int, ...], stride: tuple[int, ...], dilation: tuple[int, ...], padding: tuple[int, ...]
) -> torch.Tensor:
    """``F.unfold`` (same layout: channel, then kernel row, kernel column), from one strided
    view and one copy; several times faster than ``F.unfold`` on CPU."""
    if any(padding):
        a = F.pad(a, (padding[1], padding[1], padding[0], padding[0]))
    b, c, h, w = a.shape
    (kh, kw), (sh, sw), (dh, dw) = kernel, stride, dilation
    ho, wo = (h - dh * (kh - 1) - 1) // sh + 1, (w - dw * (kw - 1) - 1) // sw + 1
    s0, s1, s2, s3 = a.stride()
    view = a.as_strided((b, c, kh, kw, ho, wo), (s0, s1, s2 * dh, s3 * dw, s2 * sh, s3 * sw))
    return view.reshape(b, c * kh * kw, ho * wo)


def _as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)


def _zero_rows(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return torch.where(keep.view(-1, *([1] * (x.dim() - 1))), x, torch.zeros((), dtype=x.dtype, device=x.device))
