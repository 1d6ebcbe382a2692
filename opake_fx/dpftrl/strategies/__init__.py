"""DP-FTRL strategies: factorisations ``A = B C`` and the noise ``C^{-1} z`` they add.

Factories (each returns an immutable :class:`Strategy`):

* :func:`identity_strategy` — DP-SGD;
* :func:`band_mf_strategy` — optimised banded ``C`` (Toeplitz or column-normalised);
* :func:`blt_strategy` — optimised buffered linear Toeplitz ``C``;
* :func:`bsr_strategy` / :func:`bisr_strategy` — banded (inverse) square roots;
* :func:`lambda_cgd_strategy` — anti-correlated noise;
* :func:`dense_strategy` — the optimal dense multi-epoch ``C``.
"""

from opake_fx.dpftrl.strategies._base import Strategy, ToeplitzLike, strategy_from_dict
from opake_fx.dpftrl.strategies.banded import (
    BandedStrategy,
    IdentityStrategy,
    ToeplitzStrategy,
    band_mf_strategy,
    bsr_strategy,
    identity_strategy,
)
from opake_fx.dpftrl.strategies.blt import BltStrategy, blt_strategy
from opake_fx.dpftrl.strategies.dense import DenseStrategy, dense_strategy
from opake_fx.dpftrl.strategies.inverse import (
    InverseBandedStrategy,
    InverseToeplitzStrategy,
    bisr_strategy,
    lambda_cgd_strategy,
)

__all__ = [
    "Strategy",
    "ToeplitzLike",
    "IdentityStrategy",
    "ToeplitzStrategy",
    "BandedStrategy",
    "BltStrategy",
    "InverseToeplitzStrategy",
    "InverseBandedStrategy",
    "DenseStrategy",
    "identity_strategy",
    "band_mf_strategy",
    "blt_strategy",
    "bsr_strategy",
    "bisr_strategy",
    "lambda_cgd_strategy",
    "dense_strategy",
    "strategy_from_dict",
]
