"""Rules for normalisation layers: torch's own, and any module that computes like one.

``nn.LayerNorm`` / ``nn.GroupNorm`` / ``nn.RMSNorm``: per-example affine gradients are as
small as the layer's output channels, ``dgamma_i = sum g_i * xhat_i``, ``dbeta_i = sum g_i``,
so they are computed directly (:func:`norm_grad`).

Norm-like modules recognised by what they compute, ``y = A(x) * w + B(x) + b``
(:class:`AffineNormRule`):
Hugging Face's RMSNorm classes (``LlamaRMSNorm``, ``Qwen2RMSNorm``, ``MistralRMSNorm``,
``T5LayerNorm``, ...), LayerNorm subclasses with their own ``forward``, Gemma's
``(1 + w) * x``, ``nn.PReLU`` on ``[B, *, C]``, eval-mode ``BatchNorm1d`` on ``[B, C]``:
each has one 1-D ``weight`` (and maybe a 1-D ``bias``) of the size of the input's last
dimension, and its output is elementwise affine in them. Then example ``i``'s gradients
are ``dw_i = sum_positions g_i * A_i`` and ``db_i = sum_positions g_i``: ``[B, D]``, as
small as the layer, computed directly (:class:`~._numerics.PerExampleGrad`).

No class name is trusted. A module is a *candidate* by structure (:func:`is_candidate`:
a 1-D ``weight``, an optional 1-D ``bias`` of the same shape, no other parameters, none
in submodules), and each call is *checked* in its forward hook (:func:`route_affine`):

* ``A(x)`` is the module's own ``forward`` on the same arguments with the weight replaced
  by ones and the bias by zeros (``torch.no_grad``; one extra forward of the layer);
  when the plain form does not fit, the offset form ``B(x) = f(x; w=0, b=0)``,
  ``A(x) = f(x; 1, 0) - B(x)`` is tried (one more forward);
* the call's actual output must equal ``A * w + B + b`` for the actual ``w`` and ``b`` to a
  few units of rounding of its dtype (elementwise, no extra forward; on the first call of
  each module and call signature, so that later steps make no host synchronisation: a
  signature whose first call fails keeps the fallback);
* once per module and call signature (training flag, shapes and dtypes), the same
  identity must hold at a probe ``w``, ``b`` with distinct entries: the actual ``w`` is
  often all ones (the initialisation), at which any function of ``w`` looks linear, and a
  weight broadcast along another axis of equal size would pass with a constant ``w``.

A call that fails takes the exact per-module fallback (``vmap`` of its vjp), with a
:class:`~opake_fx.errors.SlowPathWarning` that says why. A forward with side effects on
buffers (e.g. running statistics) is not re-run for good: buffer versions are compared
and restored, and such a module takes the fallback.

Privacy contract: the per-example gradients the weighted sum reads are the stored
``[B, D]`` tensors whose certified float64 norms (:func:`~._numerics.sq_norms_of`) decide
the clip weights, so each example's contribution is at most ``C`` as computed in floating
point whether or not the affinity check is right; the check only guards correctness (the
norms and the sum equal the true per-example gradients').
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from opake_fx.dpsgd.clipping import _certified as cert
from opake_fx.dpsgd.clipping import _numerics as N
from opake_fx.dpsgd.clipping._per_example import warn_slow_path
from opake_fx.dpsgd.clipping._rule import BuildContext, Rule, first_input, roles

NORM_TYPES: tuple[type, ...] = (nn.LayerNorm, nn.GroupNorm) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())


def norm_grad(module: nn.Module, a: torch.Tensor, g: torch.Tensor, names: dict[str, str], dtype: torch.dtype) -> N.PerExampleGrad:
    """Rule for LayerNorm / GroupNorm / RMSNorm: ``dgamma_i = sum g_i * xhat_i``, ``dbeta_i = sum g_i``."""
    dtype = N.compute_dtype(dtype)
    a, g = N.as_dtype(a, dtype), N.as_dtype(g, dtype)
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
    return N.PerExampleGrad(grads)



# module -> {call signature: "plain" | "offset" | None (not affine)}: the probe's verdict.
_PROBED: weakref.WeakKeyDictionary[nn.Module, dict[tuple[Any, ...], str | None]] = weakref.WeakKeyDictionary()
# Registry of the actual-output checks (one per module and call signature): whether the
# signature's first call was A(x) * w + B(x) + b at the module's own weight.
_CALL_CHECKED: weakref.WeakKeyDictionary[nn.Module, dict[tuple[Any, ...], bool]] = weakref.WeakKeyDictionary()


def is_candidate(module: nn.Module) -> bool:
    """Structure only: one 1-D ``weight``, an optional ``bias`` of the same shape, no other
    parameters in the module or its submodules."""
    params = module._parameters
    weight = params.get("weight")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or not weight.is_floating_point():
        return False
    if any(k not in ("weight", "bias") for k in params):
        return False
    bias = params.get("bias")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != weight.shape):
        return False
    return not any(p is not None for m in module.modules() if m is not module for p in m._parameters.values())


def route_affine(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> tuple[torch.Tensor, ...] | None:
    """Decides one call of a candidate: ``(A,)`` with ``A(x)`` ``[B, *, D]`` (what the rule
    needs saved for the backward pass, in place of the module's inputs), or None (the module
    fallback): with a :class:`SlowPathWarning` that says why when the call is norm-like in
    shape (one output ``[B, *, D]``, ``D`` the weight's size) but fails the check, as any
    other module without a rule otherwise."""
    weight = module._parameters["weight"]
    bias = module._parameters.get("bias")
    if not isinstance(output, torch.Tensor) or not output.is_floating_point() or output.dim() < 2 or (
        output.shape[-1] != weight.shape[0]
    ):
        return None  # not norm-like on this call (e.g. nn.PReLU(1)): the generic module fallback
    y = output.detach()
    w = weight.detach()
    b = None if bias is None else bias.detach()
    sig = _signature(module, args, kwargs, y, w, b)
    seen = _PROBED.setdefault(module, {})
    form = seen.get(sig, "unknown")
    if form is None:
        return _fallback(module, "its output is not elementwise affine in its weight (checked at a probe weight)")
    try:
        ones = _call(module, torch.ones_like(w), None if b is None else torch.zeros_like(b), args, kwargs, y)
        if form == "unknown":
            form = _probe(module, args, kwargs, y, w, b, ones)
            seen[sig] = form
            if form is None:
                return _fallback(module, "its output is not elementwise affine in its weight (checked at a probe weight)")
        if form == "plain":
            a, offset = ones, None
        else:
            offset = _call(module, torch.zeros_like(w), None if b is None else torch.zeros_like(b), args, kwargs, y)
            a = _sub(ones, offset)
    except _NotAffine as e:
        return _fallback(module, str(e))
    # Once per signature, on the first call (later calls make no host synchronisation): a
    # signature that fails keeps the fallback.
    checked = _CALL_CHECKED.setdefault(module, {})
    if sig not in checked:
        checked[sig] = _affine_at(y, a, w, offset, b)
    if not checked[sig]:
        return _fallback(module, "this call's output is not A(x) * weight + bias for the A(x) its forward gives at "
                         "weight = 1 (e.g. randomness inside the module)")
    return (a,)


def affine_norm_grad(a: torch.Tensor, g: torch.Tensor, names: dict[str, str], dtype: torch.dtype) -> N.PerExampleGrad:
    """The rule: ``dw_i = sum_positions g_i * A_i``, ``db_i = sum_positions g_i``.

    Args:
        a: ``A(x)`` ``[B, *, D]`` from :func:`route_affine`.
        g: gradient of the batch loss w.r.t. the module's output, ``[B, *, D]``.
        names: role (``"weight"`` / ``"bias"``) -> parameter name, for the differentiated ones.
        dtype: the parameters' dtype (the rule computes in :func:`~._numerics.compute_dtype` of it).

    Returns:
        A :class:`~._numerics.PerExampleGrad` of ``[B, D]`` gradients; its certified norms
        are those of these stored tensors, which its weighted sum reads.
    """
    dtype = N.compute_dtype(dtype)
    g = g.to(dtype)
    dims = tuple(range(1, g.dim() - 1))
    grads = {}
    for role, name in names.items():
        per = g * a.to(dtype) if role == "weight" else g
        grads[name] = per.sum(dim=dims) if dims else per.clone()
    return N.PerExampleGrad(grads)


# --- the checks ---------------------------------------------------------------------


class _NotAffine(Exception):
    pass


def _call(module: nn.Module, w: torch.Tensor, b: torch.Tensor | None, args: tuple[Any, ...], kwargs: dict[str, Any],
          like: torch.Tensor) -> torch.Tensor:
    """The module's own ``forward`` (no hooks) with ``weight = w`` (and ``bias = b``), under no_grad."""
    params = module._parameters
    saved = dict(params)
    buffers = [(n, t, t._version) for n, t in module.named_buffers()]
    copies = [t.clone() for _, t, _ in buffers]
    try:
        params["weight"] = w
        if b is not None:
            params["bias"] = b
        with torch.no_grad():
            out = module.forward(*args, **kwargs)
    finally:
        params.update(saved)
        changed = False
        for (_, t, version), copy in zip(buffers, copies):
            if t._version != version:
                changed = True
                with torch.no_grad():
                    t.copy_(copy)
    if changed:
        raise _NotAffine("its forward modifies its buffers (it cannot be re-run to find A(x))")
    if not isinstance(out, torch.Tensor) or out.shape != like.shape:
        raise _NotAffine("its forward at weight = 1 does not return a tensor of its output's shape")
    return out


def _probe(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], y: torch.Tensor, w: torch.Tensor,
           b: torch.Tensor | None, ones: torch.Tensor) -> str | None:
    """``"plain"`` (``y = A w + b``), ``"offset"`` (``y = A w + B + b``) or None, from the
    actual weight and a probe weight with distinct entries."""
    p, q = _probe_values(w), None if b is None else _probe_values(b, shift=0.37)
    at_probe = _call(module, p, q, args, kwargs, y)
    if _affine_at(at_probe, ones, p, None, q) and _affine_at(y, ones, w, None, b):
        return "plain"
    offset = _call(module, torch.zeros_like(w), None if b is None else torch.zeros_like(b), args, kwargs, y)
    a = _sub(ones, offset)
    if _affine_at(at_probe, a, p, offset, q) and _affine_at(y, a, w, offset, b):
        return "offset"
    return None


def _probe_values(like: torch.Tensor, shift: float = 0.0) -> torch.Tensor:
    """Distinct entries in [0.5, 1.5) (a golden-ratio sequence), none equal to 0 or 1."""
    k = torch.arange(like.shape[0], dtype=torch.float64, device=like.device)
    frac = torch.remainder(k * 0.6180339887498949 + 0.1234 + shift, 1.0)
    return (0.5 + frac).to(like.dtype)


def _sub(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    dtype = N.compute_dtype(x.dtype)
    return x.to(dtype) - y.to(dtype)


def _affine_at(y: torch.Tensor, a: torch.Tensor, w: torch.Tensor, offset: torch.Tensor | None,
               b: torch.Tensor | None) -> bool:
    """Whether ``y == a * w + offset + b`` elementwise (``w``, ``b`` along the last axis) to
    16 units of rounding of the coarsest dtype involved, relative to the terms' magnitudes."""
    dtypes = [y.dtype, a.dtype, w.dtype] + ([] if b is None else [b.dtype]) + ([] if offset is None else [offset.dtype])
    ct = torch.float64 if all(d == torch.float64 for d in dtypes) else torch.float32
    u = max(cert.unit_roundoff(d) for d in dtypes + [ct])
    pred = a.to(ct) * w.to(ct)
    mag = pred.abs()
    for extra in (offset, b):
        if extra is not None:
            e = extra.to(ct)
            pred = pred + e
            mag += e.abs()
    yc = y.to(ct)
    mag += yc.abs()
    diff = (yc - pred).abs_()
    if bool((diff <= mag.mul_(16 * u).add_(16 * torch.finfo(ct).tiny)).all()):
        return True  # (a NaN anywhere compares False: decided below)
    # Non-finite on both sides: that example gets weight 0 anyway; on one side only: not affine.
    finite = torch.isfinite(yc) & torch.isfinite(pred)
    both = ~torch.isfinite(yc) & ~torch.isfinite(pred)
    return bool(torch.where(finite, diff <= mag, both).all())


def _signature(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], y: torch.Tensor, w: torch.Tensor,
               b: torch.Tensor | None) -> tuple[Any, ...]:
    def describe(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return ("tensor", tuple(x.shape[1:]), x.dtype)
        if isinstance(x, (int, float, bool, str, type(None))):
            return x
        return type(x).__name__

    forward = getattr(module.forward, "__func__", module.forward)
    return (forward, module.training, tuple(describe(x) for x in args), tuple(sorted((k, describe(v)) for k, v in kwargs.items())),
            tuple(y.shape[1:]), y.dtype, w.dtype, None if b is None else b.dtype)


def _fallback(module: nn.Module, reason: str) -> None:
    warn_slow_path(
        f"clip_backend 'ghost'/'auto': {type(module).__name__} has a norm-like weight (one 1-D weight of its input's last "
        f"dimension) but {reason}; its parameters take the per-module fallback (vmap of its vjp over examples: exact, "
        "slower)."
    )
    return None


# --- registry entries ---------------------------------------------------------------


class NormRule(Rule):
    """``nn.LayerNorm`` / ``nn.GroupNorm`` / ``nn.RMSNorm`` running torch's own ``forward``."""

    kind, types = "norm", NORM_TYPES

    def reads_batched(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                      batched: dict[int, bool]) -> bool:
        a = first_input(args, kwargs)
        return super().reads_batched(module, args, kwargs, batched) and a.dim() >= 2 and (
            isinstance(module, nn.GroupNorm) or a.dim() > len(module.normalized_shape))  # type: ignore[arg-type]

    def build(self, module: nn.Module, saved: tuple[torch.Tensor, ...], g: torch.Tensor, names: dict[str, int],
              ctx: BuildContext) -> N.PerExampleGrad:
        return norm_grad(module, saved[0], g, roles(names), ctx.dtype)


class AffineNormRule(Rule):
    """Any module that passes :func:`is_candidate` (structure), each call checked by
    :func:`route_affine` (what it computes); the batch axis is the output's rows."""

    kind = "affine_norm"

    def claims(self, module: nn.Module) -> bool:
        return is_candidate(module)

    def reads_batched(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                      batched: dict[int, bool]) -> bool:
        return True  # it reads A(x), computed per call with the output's rows (checked by the caller)

    def route(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
              output: Any) -> tuple[torch.Tensor, ...] | None:
        return route_affine(module, args, kwargs, output)

    def build(self, module: nn.Module, saved: tuple[torch.Tensor, ...], g: torch.Tensor, names: dict[str, int],
              ctx: BuildContext) -> N.PerExampleGrad:
        return affine_norm_grad(saved[0], g, roles(names), ctx.dtype)  # saved: A(x), from route_affine


NORM, AFFINE_NORM = NormRule(), AffineNormRule()

__all__ = ["AFFINE_NORM", "NORM", "NORM_TYPES", "AffineNormRule", "NormRule", "affine_norm_grad", "is_candidate",
           "norm_grad", "route_affine"]
