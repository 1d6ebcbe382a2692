"""The noise mechanisms of a plan, registered in one place (:data:`MECHANISMS`).

Each mechanism is one module with one :class:`~opake_fx.planning.mechanisms.base.NoiseMechanism`;
adding one is a new module and one line in the list below. :func:`compatible_pairs`
derives which sampling schemes each goes with from their accounting kinds.

Example:
    >>> MECHANISMS.names()
    ('gaussian', 'band_mf', 'bsr', 'blt')
    >>> compatible_pairs()["blt"]
    ('b_min_sep', 'balls_in_bins')
"""

from __future__ import annotations

from opake_fx.planning.mechanisms.band_mf import BandMFMechanism
from opake_fx.planning.mechanisms.base import NoiseMechanism
from opake_fx.planning.mechanisms.blt import BLTMechanism
from opake_fx.planning.mechanisms.bsr import BSRMechanism
from opake_fx.planning.mechanisms.gaussian import GaussianMechanism
from opake_fx.planning.mechanisms.strategy import StrategyMechanism
from opake_fx.planning.registry import Registry
from opake_fx.planning.samplers import SAMPLING

__all__ = ["MECHANISMS", "NoiseMechanism", "StrategyMechanism", "GaussianMechanism", "BandMFMechanism",
           "BSRMechanism", "BLTMechanism", "compatible_pairs"]

MECHANISMS: Registry[NoiseMechanism] = Registry("mechanism", [
    GaussianMechanism(),
    BandMFMechanism(),
    BSRMechanism(),
    BLTMechanism(),
])
"""The mechanisms a plan can name, in the order error messages list them."""


def compatible_pairs() -> dict[str, tuple[str, ...]]:
    """Each mechanism's name -> the sampling schemes it has an accounting under (registry order)."""
    return {m.name: tuple(s.name for s in SAMPLING.parts() if s.accounting in m.accounts) for m in MECHANISMS.parts()}
