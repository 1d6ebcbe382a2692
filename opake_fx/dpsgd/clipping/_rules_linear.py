"""Rules for Linear-like layers: ``nn.Linear``, Hugging Face's ``Conv1D``, ``nn.Conv1d`` / ``nn.Conv2d``.

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
  positions, one per group (Bu et al. 2023). Where per-example weight gradients are the
  cheaper form, they are the weight gradient of one convolution whose groups are the batch's
  examples times the layer's groups (no unfolded copy of the input; for a depthwise layer
  at stride 1, one forward convolution with the output gradients as kernels), except where
  the patches are a mere view of the input (stride = kernel, no padding or dilation).

Privacy contract: the norm that decides each example's weight is certified
(:func:`._certified.gram_sq_norms` in float64 plus the rounding bound of the weighted
sum's own matmul), so each example's contribution is at most ``C`` as computed in
floating point, even for inputs crafted to cancel.
"""

from __future__ import annotations

from typing import Any, Callable, Literal

import torch
import torch.nn.functional as F
from torch import nn

from opake_fx.dpsgd.clipping import _certified as cert
from opake_fx.dpsgd.clipping import _numerics as N
from opake_fx.dpsgd.clipping._rule import BuildContext, Rule, first_input, roles

Method = Literal["ghost", "pe"]


class MatmulGrad:
    """Linear and (unfolded) convolution layers: ``dW_i = sum_t g_it a_it^T`` per group.

    ``patches(lo, hi)`` gives the inputs of examples ``lo:hi`` as ``[b, groups, T, d_in]``
    (a slice of the stored input for Linear, freshly unfolded patches for convolutions);
    ``g`` is ``[B, groups, T, d_out]``. ``method="pe"`` forms the per-example weight
    gradients at once (memory ``B d_in d_out``; from the patches, or by
    ``weight_per_example(dtype)`` where the layer has a cheaper way) and drops ``a`` and
    ``g``; ``"ghost"``
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
        weight_per_example: Callable[[torch.dtype], torch.Tensor] | None = None,
    ) -> None:
        self.batch, self.groups, self.t, self.d_out = g.shape
        self.d_in, self.dtype = d_in, dtype
        self.names = names  # role ("weight" / "bias") -> parameter name
        self.weight_shape = weight_shape
        g = N.as_dtype(g, dtype)
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
            sq_g = N.sq_norms_of(self._g2)  # small [B, d] rows: float64 costs nothing here
            if bias_shape is not None:
                self._bias_pe, self._bias_sq = self._g2.reshape(self.batch, *bias_shape), sq_g
            if weight_shape is not None:  # ||g a^T|| = ||a|| ||g||
                self._a2 = N.as_dtype(patches(0, self.batch).reshape(self.batch, d_in), dtype)
                self._sq = N.sq_norms_of(self._a2) * sq_g * (1.0 + cert.gamma(2, torch.float64))
                # (|a| |g| = sqrt of it: taken only if a tied use asks, in cross_form)
            return
        if bias_shape is not None:
            self._bias_pe = g.sum(dim=2).reshape(self.batch, *bias_shape)
        if weight_shape is None:
            return
        if method == "pe" and weight_per_example is not None:
            self._pe = weight_per_example(dtype).reshape(self.batch, *weight_shape)
            self._sq = N.sq_norms_of(self._pe)
        elif method == "pe":
            self._pe, self._sq = self._weight_per_example(patches, g)
        else:
            self.patches, self.g = patches, g
            exact = torch.zeros(self.batch, dtype=torch.float64, device=g.device)
            self._abs = torch.zeros(self.batch, dtype=torch.float64, device=g.device)
            for lo, hi in self._chunks(self.groups * self.t * max(self.t, d_in, self.d_out)):
                exact[lo:hi], self._abs[lo:hi] = cert.gram_sq_norms(N.as_dtype(patches(lo, hi), dtype), g[lo:hi])
            # The weighted sum adds sum_t w g_t a_t^T in `dtype`: its rounding, up to
            # gamma_{T+2} sum_t |g_t| |a_t|, is part of what this example contributes.
            self._exact_sq = exact
            self._ws_err = self._abs * cert.matmul_rounding(self.t, dtype)
            self._sq = (exact.sqrt() + self._ws_err).square()

    def sq_norm(self, name: str) -> torch.Tensor:
        if self._role(name) == "bias":
            if self._bias_sq is None:
                self._bias_sq = N.sq_norms_of(self._bias_pe)
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
            return N.weighted_sum_of(self._bias_pe, w, keep)
        if self._pe is not None:
            return N.weighted_sum_of(self._pe, w, keep)
        w = N.as_dtype(w, self.dtype)
        if self._a2 is not None and self._g2 is not None:
            a, g = self._a2, self._g2
            if keep is not None:
                a, g = N.zero_rows(a, keep), N.zero_rows(g, keep)
            # sum_i w_i g_i a_i^T as one matmul, scaling the narrower side
            if self.d_out <= self.d_in:
                return (g * w.unsqueeze(1)).t().mm(a).reshape(self.weight_shape)
            return g.t().mm(a * w.unsqueeze(1)).reshape(self.weight_shape)
        assert self.patches is not None and self.g is not None
        total: torch.Tensor | None = None
        for lo, hi in self._chunks(self.groups * self.t * self.d_in):
            a, g = N.as_dtype(self.patches(lo, hi), self.dtype), self.g[lo:hi]
            if keep is not None:
                a, g = N.zero_rows(a, keep[lo:hi]), N.zero_rows(g, keep[lo:hi])
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

    def cross_form(self, name: str) -> tuple[Any, ...] | None:
        """("pe", [B, ...], s = norm) for a bias or per-example weights; ("linear", a(lo, hi)
        [b, T, d_in], g [B, T, d_out], weight shape, s = sum_t |a_t| |g_t|) for ghost operands
        of one group; None otherwise (no cross-term formula here)."""
        if self._role(name) == "bias" or self._pe is not None:
            return ("pe", self.per_example(name), self.sq_norm(name).sqrt())
        if self._a2 is not None and self._g2 is not None:
            a2, g2 = self._a2, self._g2
            assert self._sq is not None
            return ("linear", lambda lo, hi: a2[lo:hi].unsqueeze(1), g2.unsqueeze(1), self.weight_shape, self._sq.sqrt())
        if self.patches is not None and self.g is not None and self.groups == 1:
            patches, g = self.patches, self.g
            return ("linear", lambda lo, hi: patches(lo, hi)[:, 0], g[:, 0], self.weight_shape, self._abs)
        return None

    def _weight_per_example(self, patches: Callable[[int, int], torch.Tensor], g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Chunks small enough that each chunk's norms are taken while it is still in cache.
        assert self.weight_shape is not None
        pe = torch.empty((self.batch, self.groups, self.d_out, self.d_in), dtype=self.dtype, device=g.device)
        sq = torch.empty(self.batch, dtype=torch.float64, device=g.device)
        per_ex = self.groups * self.d_out * self.d_in
        step = max(1, min(N.CHUNK_ELEMS // max(1, self.groups * self.t * self.d_in), N.CACHE_ELEMS // max(1, per_ex)))
        for lo in range(0, self.batch, step):
            hi = min(lo + step, self.batch)
            a, gc = N.as_dtype(patches(lo, hi), self.dtype), g[lo:hi]
            if self.groups == 1:
                torch.bmm(gc[:, 0].transpose(1, 2), a[:, 0], out=pe[lo:hi, 0])
            else:
                pe[lo:hi] = torch.einsum("bgto,bgti->bgoi", gc, a)
            sq[lo:hi] = N.sq_norms_of(pe[lo:hi])
        return pe.reshape(self.batch, *self.weight_shape), sq

    def _chunks(self, per_example_elems: int) -> list[tuple[int, int]]:
        step = max(1, N.CHUNK_ELEMS // max(1, per_example_elems))
        return [(lo, min(lo + step, self.batch)) for lo in range(0, self.batch, step)]

    def _role(self, name: str) -> str:
        return "bias" if self.names.get("bias") == name else "weight"



class Rearranged:
    """A rule whose norms are the wrapped rule's (a transpose or a zero padding keeps them);
    subclasses rearrange its weighted sums and per-example gradients."""

    def __init__(self, rule: MatmulGrad) -> None:
        self.rule = rule

    def sq_norm(self, name: str) -> torch.Tensor:
        return self.rule.sq_norm(name)

    def certified(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rule.certified(name)


    def cross_form(self, name: str) -> tuple[Any, ...] | None:
        return None  # (a transposed weight: no cross-term formula here)


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
    dtype = N.compute_dtype(dtype)
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


class TransposedWeight(Rearranged):
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

    def weight_per_example(compute: torch.dtype) -> torch.Tensor:
        gc, ac = N.as_dtype(g, compute), N.as_dtype(a, compute)
        h, w = g.shape[2:]
        if module.in_channels == groups and stride == (1, 1):
            # One input channel per group (depthwise): the gradient is the correlation of each
            # example's channel with its output gradient, one forward convolution with the
            # output gradients as kernels, several times faster than the backward kernel here.
            out = F.conv2d(ac.reshape(1, batch * groups, *a.shape[2:]), gc.reshape(batch * module.out_channels, 1, h, w),
                           padding=padding, dilation=stride, stride=dilation, groups=batch * groups)
            return out[0, :, : kernel[0], : kernel[1]].reshape(batch, groups, d_out, d_in)
        # The weight gradient of one convolution with B x groups groups over the batch laid
        # side by side along the channels: group (i, j) sees example i's channels of group j only.
        grad = torch.ops.aten.convolution_backward(
            gc.reshape(1, batch * module.out_channels, h, w),
            ac.reshape(1, batch * module.in_channels, *a.shape[2:]),
            torch.empty((), dtype=compute, device=a.device).expand(batch * module.out_channels, module.in_channels // groups,
                                                                  *kernel),
            None, list(stride), list(padding), list(dilation), False, [0, 0], batch * groups, [False, True, False])[1]
        return grad.view(batch, groups, d_out, d_in)

    relayout = stride == kernel and dilation == (1, 1) and not any(padding)  # patches are a view of the input
    return MatmulGrad(
        patches,
        g.reshape(batch, groups, d_out, t).transpose(2, 3),
        d_in=d_in,
        weight_shape=tuple(module.weight.shape) if "weight" in names else None,
        bias_shape=(module.out_channels,) if "bias" in names else None,
        names=names,
        method=choose_method(mode, t, d_in, d_out),
        dtype=N.compute_dtype(dtype),
        weight_per_example=None if relayout else weight_per_example,
    )



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



def is_transformers_conv1d(t: type) -> bool:
    """Whether ``t`` runs the ``forward`` of Hugging Face's ``transformers.pytorch_utils.Conv1D``
    (GPT-2's projections: ``y = x @ W + b`` with ``W: [d_in, d_out]``), recognised by the
    function's home, not by a class name a user might reuse; transformers is not imported."""
    forward = getattr(t, "forward", None)
    return getattr(forward, "__module__", None) == "transformers.pytorch_utils" and (
        getattr(forward, "__qualname__", None) == "Conv1D.forward"
    )


# --- registry entries ---------------------------------------------------------------


class LinearRule(Rule):
    """``nn.Linear`` on ``[B, *, d_in]``."""

    kind, types = "linear", (nn.Linear,)

    def reads_batched(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                      batched: dict[int, bool]) -> bool:
        a = first_input(args, kwargs)
        return super().reads_batched(module, args, kwargs, batched) and a.dim() >= 2

    def build(self, module: nn.Module, saved: tuple[torch.Tensor, ...], g: torch.Tensor, names: dict[str, int],
              ctx: BuildContext) -> MatmulGrad:
        return linear_grad(module, saved[0], g, roles(names), ctx.mode, ctx.dtype)  # type: ignore[arg-type]


class TransposedLinearRule(LinearRule):
    """Hugging Face's ``Conv1D`` (by the home of its ``forward``, see :func:`is_transformers_conv1d`)."""

    kind, types = "linear_t", ()

    def claims(self, module: nn.Module) -> bool:
        return is_transformers_conv1d(type(module))

    def build(self, module: nn.Module, saved: tuple[torch.Tensor, ...], g: torch.Tensor, names: dict[str, int],
              ctx: BuildContext) -> TransposedWeight:  # type: ignore[override]
        return transposed_linear_grad(module, saved[0], g, roles(names), ctx.mode, ctx.dtype)


class ConvRule(Rule):
    """``nn.Conv1d`` / ``nn.Conv2d`` running torch's own ``forward`` and ``_conv_forward``."""

    kind, types = "conv", (nn.Conv1d, nn.Conv2d)

    def claims(self, module: nn.Module) -> bool:
        return super().claims(module) and type(module)._conv_forward in (nn.Conv1d._conv_forward,
                                                                       nn.Conv2d._conv_forward)

    def reads_batched(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                      batched: dict[int, bool]) -> bool:
        a = first_input(args, kwargs)
        return super().reads_batched(module, args, kwargs, batched) and (
            a.dim() == (3 if isinstance(module, nn.Conv1d) else 4))

    def build(self, module: nn.Module, saved: tuple[torch.Tensor, ...], g: torch.Tensor, names: dict[str, int],
              ctx: BuildContext) -> MatmulGrad:
        return conv_grad(module, saved[0], g, roles(names), ctx.mode, ctx.dtype)  # type: ignore[arg-type]


class InlineLinearRule(Rule):
    """A Linear layer written inline in the ``forward`` of a module without a rule, on the
    module's own parameters: ``F.linear(x, W[, b])`` or ``x @ W.T`` (Falcon's ``FalconLinear``,
    layers that call ``super().forward``), found by :class:`._rules_elementwise.Broadcasts`
    and taken when its first axis is proven to be the batch: the Linear rule on ``x``. One
    instance per call (its sizes and which parameter plays which role); claims no module."""

    kind = "inline_linear"

    def __init__(self, d_in: int, d_out: int, roles: dict[str, str]) -> None:
        self.d_in, self.d_out, self.roles = d_in, d_out, roles

    def claims(self, module: nn.Module) -> bool:
        return False

    def build(self, module: nn.Module, saved: tuple[torch.Tensor, ...], g: torch.Tensor, names: dict[str, int],
              ctx: BuildContext) -> MatmulGrad:
        roles = {role: n for role, n in self.roles.items() if n in names}
        return projection_grad(saved[0], g, self.d_in, self.d_out, roles, ctx.mode, ctx.dtype)


LINEAR, TRANSPOSED_LINEAR, CONV = LinearRule(), TransposedLinearRule(), ConvRule()

__all__ = ["CONV", "LINEAR", "TRANSPOSED_LINEAR", "InlineLinearRule", "MatmulGrad", "Rearranged", "TransposedWeight", "choose_method",
           "conv_grad", "is_transformers_conv1d", "linear_grad", "projection_grad", "transposed_linear_grad"]
