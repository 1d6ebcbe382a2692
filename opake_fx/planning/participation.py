"""How one example can take part in a run: the one value the noise and the accounting read."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Participation"]


@dataclass(frozen=True)
class Participation:
    """How one example can take part in a plan's run: the ONE value the noise and the accounting read.

    The DP-FTRL noise stage scales its noise to ``strategy.sensitivity(min_sep,
    max_participations)`` over ``steps`` steps, and the plan's accounting charges the
    same pattern, so the two cannot disagree. The plan's sampling part computes it
    (:meth:`opake_fx.planning.samplers.SamplingScheme.participation`).

    Attributes:
        steps: the run's length (the strategy's horizon).
        min_sep: the fewest steps between two participations of one example.
        max_participations: the most participations of one example that the noise is
            scaled to (1 for the amplified samplers: one opportunity at a time).
        amplified: True when the accounting composes per-opportunity sampling
            amplification (``poisson``, ``truncated_poisson``, ``cyclic_poisson``); False
            when the whole run is one Gaussian mechanism over this pattern.

    Example:
        >>> Participation(steps=100, min_sep=10, max_participations=10, amplified=False).max_participations
        10
    """

    steps: int
    min_sep: int
    max_participations: int
    amplified: bool
