"""DP-FTRL: correlated noise by matrix factorisation.

A strategy ``C`` factorises the workload ``A = B C``; step ``t`` adds
``(C^{-1} z)_t`` to the clipped gradient. Pieces:

* strategies (:mod:`opake_fx.dpftrl.strategies`): ``identity_strategy``,
  ``band_mf_strategy``, ``blt_strategy``, ``bsr_strategy``, ``bisr_strategy``,
  ``lambda_cgd_strategy``, ``dense_strategy``;
* workloads (:mod:`opake_fx.dpftrl.workloads`): prefix sums, momentum / schedules;
* noise (:mod:`opake_fx.dpftrl.noise`): ``mf_gaussian_noise`` and the ``noise`` stage;
* sensitivity (:mod:`opake_fx.dpftrl.sensitivity`), streaming (:mod:`opake_fx.dpftrl.streaming`);
* samplers (:mod:`opake_fx.dpftrl.sampling`) and accounting
  (:mod:`opake_fx.dpftrl.accounting`, imported on demand).

Example:
    >>> from opake_fx.dpftrl import band_mf_strategy, noise
    >>> from opake_fx.random import key
    >>> stage = noise(band_mf_strategy(100, bands=4), noise_multiplier=1.0, key=key(0))
"""

from opake_fx.dpftrl import strategies
from opake_fx.dpftrl.noise import MfNoiseState, mf_gaussian_noise, noise
from opake_fx.dpftrl.sampling import BallsInBinsSampler, CyclicPoissonSampler, FixedEpochSampler, MinSepSampler
from opake_fx.dpftrl.strategies import (
    BandedStrategy,
    BltStrategy,
    DenseStrategy,
    IdentityStrategy,
    InverseBandedStrategy,
    InverseToeplitzStrategy,
    Strategy,
    ToeplitzStrategy,
    band_mf_strategy,
    bisr_strategy,
    blt_strategy,
    bsr_strategy,
    dense_strategy,
    identity_strategy,
    lambda_cgd_strategy,
    strategy_from_dict,
)
from opake_fx.dpftrl.workloads import Workload, matrix_workload, momentum_workload, prefix_workload

# The strategies package's names (but its base class ToeplitzLike, which stays there), then the rest.
__all__ = [
    *(name for name in strategies.__all__ if name != "ToeplitzLike"),
    "Workload",
    "prefix_workload",
    "momentum_workload",
    "matrix_workload",
    "MfNoiseState",
    "mf_gaussian_noise",
    "noise",
    "CyclicPoissonSampler",
    "MinSepSampler",
    "BallsInBinsSampler",
    "FixedEpochSampler",
]
