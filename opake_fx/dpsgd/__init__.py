"""DP-SGD: per-example clipping, Gaussian noise, Poisson sampling and their accounting.

Function style (the seed API)::

    from opake_fx.dpsgd.clipping import clipped_grad
    from opake_fx.dpsgd.noise import gaussian_noise

Chain style::

    from opake_fx.dpsgd import clip, noise

Accounting lives in :mod:`opake_fx.dpsgd.accounting` (it needs no torch). The names
below and the submodules are loaded on first access (PEP 562), so importing
``opake_fx.dpsgd.accounting`` does not import torch.
"""

from opake_fx import _lazy
import sys as _sys
import types as _types
from typing import TYPE_CHECKING as _TYPE_CHECKING

__all__ = [
    "clipped_grad",
    "auto_clipped_grad",
    "adaptive_clipped_grad",
    "per_group",
    "clip",
    "auto_clip",
    "adaptive_clip",
    "as_stage",
    "gaussian_noise",
    "noise",
    "PoissonSampler",
    "TruncatedPoissonSampler",
    "SequentialBatchSampler",
]

# Each re-exported name and the module that defines it.
_EXPORTS = {
    "clipped_grad": "opake_fx.dpsgd.clipping",
    "auto_clipped_grad": "opake_fx.dpsgd.clipping",
    "adaptive_clipped_grad": "opake_fx.dpsgd.clipping",
    "per_group": "opake_fx.dpsgd.clipping",
    "clip": "opake_fx.dpsgd.clipping",
    "auto_clip": "opake_fx.dpsgd.clipping",
    "adaptive_clip": "opake_fx.dpsgd.clipping",
    "as_stage": "opake_fx.dpsgd.clipping",
    "gaussian_noise": "opake_fx.dpsgd.noise",
    "noise": "opake_fx.dpsgd.noise",
    "PoissonSampler": "opake_fx.dpsgd.sampling",
    "TruncatedPoissonSampler": "opake_fx.dpsgd.sampling",
    "SequentialBatchSampler": "opake_fx.dpsgd.sampling",
}
_SUBMODULES = frozenset({"accounting", "clipping", "noise", "sampling"})

if _TYPE_CHECKING:  # static analysers see the eager imports
    from opake_fx.dpsgd.clipping import (
        adaptive_clip,
        adaptive_clipped_grad,
        as_stage,
        auto_clip,
        auto_clipped_grad,
        clip,
        clipped_grad,
        per_group,
    )
    from opake_fx.dpsgd.noise import gaussian_noise, noise
    from opake_fx.dpsgd.sampling import PoissonSampler, SequentialBatchSampler, TruncatedPoissonSampler


class _Package(_types.ModuleType):
    """Keeps ``opake_fx.dpsgd.noise`` the chain stage, not the submodule of the same name.

    Loading a submodule binds it as an attribute of its package, which would shadow the
    re-exported function ``noise`` with the module ``opake_fx.dpsgd.noise``. With the
    eager imports this package used to have, ``noise`` was rebound to the function right
    after; here the binding itself is redirected to the function.
    """

    def __setattr__(self, name: str, value: object) -> None:
        if name == "noise" and isinstance(value, _types.ModuleType) and value.__name__ == f"{__name__}.noise":
            value = value.noise
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package


__getattr__, __dir__ = _lazy.attach(__name__, globals(), _EXPORTS, _SUBMODULES)
