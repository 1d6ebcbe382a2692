"""Parameters used by several calls: a tied embedding and output layer, a layer applied twice.

``||sum_k P_k||^2 = sum_k ||P_k||^2 + 2 sum_{k<l} <P_k, P_l>``: each call's own certified
norm (its rule's :meth:`certified`), plus cross terms from the calls' stored inputs and
output gradients where there is a formula (each call's ``cross_form``, see
:mod:`._numerics`), evaluated in float64 with a certified rounding bound. Where a pair
has no formula the caller sums per-example gradients instead.

Privacy contract: the squared norm used is the upper end of the certified interval of
the exact value, capped by the triangle inequality, with the rounding of adding the
calls' weighted sums on top, so each example's contribution is at most ``C`` as computed
in floating point.
"""

from __future__ import annotations

from typing import Any

import torch

from opake_fx.dpsgd.clipping import _certified as cert
from opake_fx.dpsgd.clipping import _numerics as N


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
    forms = [rule.cross_form(name) for rule, name in parts]
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
        step = max(1, N.CHUNK_ELEMS // max(1, t1 * t2))
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
        step = max(1, N.CHUNK_ELEMS // max(1, th * max(te, e.shape[-1])))
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


__all__ = ["SumOfUses", "sum_of_uses"]
