"""DP-SGD: per-example clipping, Gaussian noise, Poisson sampling and their accounting.

Function style (the seed API)::

    from opake_fx.dpsgd.clipping import clipped_grad
    from opake_fx.dpsgd.noise import gaussian_noise

Chain style::

    from opake_fx.dpsgd import clip, noise

Accounting lives in :mod:`opake_fx.dpsgd.accounting` (imported on demand: it needs no torch).
"""

from opake_fx.dpsgd.clipping import (
    adaptive_clipped_grad,
    as_stage,
    auto_clipped_grad,
    clip,
    clipped_grad,
    per_group,
)
from opake_fx.dpsgd.noise import gaussian_noise, noise
from opake_fx.dpsgd.sampling import PoissonSampler, SequentialBatchSampler, TruncatedPoissonSampler

__all__ = [
    "clipped_grad",
    "auto_clipped_grad",
    "adaptive_clipped_grad",
    "per_group",
    "clip",
    "as_stage",
    "gaussian_noise",
    "noise",
    "PoissonSampler",
    "TruncatedPoissonSampler",
    "SequentialBatchSampler",
]
