"""Layers and initialisations that suit DP training.

* :class:`WeightStandardizedConv2d`: a convolution whose filters are standardised (zero
  mean, unit variance over each output channel's fan-in) before every use (Qiao et al.
  2019, "Micro-Batch Training with Batch-Channel Normalization and Weight
  Standardization"); with GroupNorm it replaces BatchNorm, which mixes the examples of a
  batch and cannot be used under per-example clipping. De et al. (2022, section 3.2) use
  it in their DP WideResNets. Its layer rule (registered when this module is imported)
  gives the fast clipping backends (``"ghost"``/``"auto"``) exact per-example gradients
  without the slow fallback.
* :func:`scale_last_layer_`: scales down the initial weights of the classifier, so the
  first, noisiest steps start from nearly uniform predictions (De et al. 2022 initialise
  the last layer to zero).

Privacy: model choices change no guarantee; the clip bound holds whatever the layer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from opake_fx.dpsgd.clipping.rules import register_rule
from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.typing import typechecked

__all__ = ["WeightStandardizedConv2d", "scale_last_layer_"]


class WeightStandardizedConv2d(nn.Conv2d):
    """``nn.Conv2d`` whose weight is standardised per output channel before the convolution.

    ``w_hat[o] = (w[o] - mean(w[o])) / sqrt(var(w[o]) + eps)`` over the ``in_channels / groups
    * kh * kw`` entries of filter ``o`` (biased variance), then ``conv2d(x, w_hat, bias)``.
    Arguments as ``nn.Conv2d`` (``padding_mode="zeros"``), plus ``eps``.

    With ``clip_backend="ghost"``/``"auto"`` its calls go through a layer rule (per-example
    weight gradients from the unfolded input, mapped back through the standardisation),
    checked against autograd on first use like every rule.

    Example:
        >>> conv = WeightStandardizedConv2d(1, 4, 3, padding=1)
        >>> conv(torch.randn(2, 1, 5, 5)).shape
        torch.Size([2, 4, 5, 5])
        >>> w = conv.standardized_weight()
        >>> bool(w.flatten(1).mean(1).abs().max() < 1e-6)
        True
    """

    def __init__(self, *args: Any, eps: float = 1e-5, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.padding_mode != "zeros":
            raise InputValueError(
                f"WeightStandardizedConv2d supports padding_mode='zeros' only; got {self.padding_mode!r}."
            )
        self.eps = float(eps)

    def standardized_weight(self) -> torch.Tensor:
        """The standardised filters ``[out, in / groups, kh, kw]`` used by ``forward``."""
        return _standardize(self.weight, self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.standardized_weight(), self.bias, self.stride, self.padding, self.dilation, self.groups)


def _standardize(w: torch.Tensor, eps: float) -> torch.Tensor:
    flat = w.flatten(1)
    mean = flat.mean(1, keepdim=True)
    var = flat.var(1, unbiased=False, keepdim=True)
    return ((flat - mean) / torch.sqrt(var + eps)).reshape(w.shape)


def _ws_rule(module: WeightStandardizedConv2d, a: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-example gradients of a weight-standardised convolution (the layer rule)."""
    b = a.shape[0]
    out_c, in_per_group, kh, kw = module.weight.shape
    groups = module.groups
    cols = F.unfold(a, (kh, kw), dilation=module.dilation, padding=module.padding, stride=module.stride)  # [B, Cin*kh*kw, L]
    gg = g.reshape(b, out_c, -1)  # [B, Cout, L]
    if groups == 1:
        dw_hat = torch.bmm(gg, cols.transpose(1, 2))  # [B, Cout, Cin*kh*kw]
    else:
        cols_g = cols.reshape(b, groups, in_per_group * kh * kw, -1)
        gg_g = gg.reshape(b, groups, out_c // groups, -1)
        dw_hat = torch.einsum("bgol,bgkl->bgok", gg_g, cols_g).reshape(b, out_c, -1)
    # back through the standardisation, per example (a linear map of dw_hat)
    flat = module.weight.flatten(1)
    mean = flat.mean(1, keepdim=True)
    std = torch.sqrt(flat.var(1, unbiased=False, keepdim=True) + module.eps)
    w_hat = (flat - mean) / std  # [Cout, n]
    dv = (dw_hat - dw_hat.mean(-1, keepdim=True) - w_hat * (dw_hat * w_hat).mean(-1, keepdim=True)) / std
    grads = {"weight": dv.reshape(b, *module.weight.shape)}
    if module.bias is not None:
        grads["bias"] = gg.sum(-1)
    return grads


register_rule(WeightStandardizedConv2d, _ws_rule)


@typechecked
def scale_last_layer_(model: nn.Module, scale: float = 0.0) -> nn.Linear:
    """Multiplies the weight of ``model``'s last ``nn.Linear`` (in module order) by ``scale``
    and zeroes its bias, in place; returns that layer.

    ``scale=0`` is De et al.'s zero initialisation of the classifier: the first updates
    start from uniform predictions instead of a random bias that the noisy first steps must
    undo. (On digits with a tanh MLP it neither helped nor hurt measurably: docs/utility.md.)

    Raises:
        InputValueError: the model has no ``nn.Linear`` or ``scale`` is negative.

    Example:
        >>> m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        >>> scale_last_layer_(m, 0.0) is m[2], bool(m[2].weight.abs().sum() == 0)
        (True, True)
    """
    if not isinstance(model, nn.Module):
        raise InputTypeError(f"scale_last_layer_ needs an nn.Module; got {type(model).__name__}.")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale >= 0:
        raise InputValueError(f"scale_last_layer_ needs a scale >= 0; got {scale!r}.")
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise InputValueError("scale_last_layer_ found no nn.Linear in the model; pass the classifier's parent module.")
    last = linears[-1]
    with torch.no_grad():
        last.weight.mul_(float(scale))
        if last.bias is not None:
            last.bias.zero_()
    return last
