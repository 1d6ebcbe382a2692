"""The sampling parts of a plan, registered in one place (:data:`SAMPLING`).

Each scheme is one module with one :class:`~opake_fx.planning.samplers.base.SamplingScheme`;
adding a scheme is a new module and one line in the list below (its accounting kind
decides which mechanisms it goes with).

Example:
    >>> SAMPLING.names()
    ('poisson', 'truncated_poisson', 'cyclic_poisson', 'b_min_sep', 'balls_in_bins')
"""

from __future__ import annotations

from opake_fx.planning.registry import Registry
from opake_fx.planning.samplers.b_min_sep import MinSepSampling
from opake_fx.planning.samplers.balls_in_bins import BallsInBinsSampling
from opake_fx.planning.samplers.base import (CYCLIC, EVERY_STEP, MIN_SEPARATION, OffsetSampler, SamplingScheme,
                                             shard_sampler)
from opake_fx.planning.samplers.cyclic_poisson import CyclicPoissonSampling
from opake_fx.planning.samplers.poisson import PoissonSampling
from opake_fx.planning.samplers.truncated_poisson import TruncatedPoissonSampling

__all__ = ["SAMPLING", "SamplingScheme", "EVERY_STEP", "CYCLIC", "MIN_SEPARATION", "OffsetSampler", "shard_sampler",
           "PoissonSampling", "TruncatedPoissonSampling", "CyclicPoissonSampling", "MinSepSampling",
           "BallsInBinsSampling"]

SAMPLING: Registry[SamplingScheme] = Registry("sampling", [
    PoissonSampling(),
    TruncatedPoissonSampling(),
    CyclicPoissonSampling(),
    MinSepSampling(),
    BallsInBinsSampling(),
])
"""The sampling schemes a plan can name, in the order error messages list them."""
