"""What the DP-FTRL mechanisms share: correlated noise ``C^{-1} z`` of a strategy, and its accounting."""

from __future__ import annotations

from typing import Any

from opake_fx.planning.fields import PlanFields
from opake_fx.planning.mechanisms.base import NoiseMechanism
from opake_fx.random import RngKey

__all__ = ["StrategyMechanism"]


class StrategyMechanism(NoiseMechanism):
    """DP-FTRL with a matrix-factorization strategy built over the plan's steps.

    A subclass builds the strategy (:meth:`strategy`); the noise stage, its scaling to the
    plan's participation and the accounting are shared.

    Privacy: the noise ``z`` is scaled to ``strategy.sensitivity(min_sep,
    max_participations)`` under the plan's :attr:`~opake_fx.plan.DPPlan.participation`,
    which the accounting reads too. Amplified (cyclic Poisson, at most ``bands`` bands):
    one opportunity is a Gaussian of multiplier ``sigma * noise_sensitivity /
    max column norm`` (Choquette-Choo et al. 2023, Thm. 4), subsampled by the sampling
    part. Unamplified: the whole run is one Gaussian mechanism of the strategy's
    sensitivity under the pattern (:func:`opake_fx.dpftrl.accounting.mf_gaussian`).
    """

    def noise_stage(self, plan: PlanFields, key: RngKey) -> Any:
        from opake_fx.dpftrl import noise as mf_noise

        p = plan.participation  # the same value the accounting reads
        return mf_noise(plan.strategy, noise_multiplier=plan.noise_multiplier, key=key, min_sep=p.min_sep,
                        max_participations=p.max_participations, n_steps=p.steps)

    def opportunity(self, plan: PlanFields, noise_multiplier: float) -> Any:
        import opake_fx.validation as check
        from opake_fx.dpsgd.accounting import gaussian

        p, strategy = plan.participation, plan.strategy
        noise_sensitivity = check.positive(strategy.sensitivity(p.min_sep, p.max_participations, n=p.steps),
                                           "noise_sensitivity", "poisson")
        per_participation = float(strategy.column_norms(p.steps).max())
        return gaussian(float(noise_multiplier) * noise_sensitivity / per_participation)

    def whole_run(self, plan: PlanFields, noise_multiplier: float) -> Any:
        import opake_fx.dpftrl.accounting as mf_acc

        p = plan.participation
        return mf_acc.mf_gaussian(noise_multiplier, plan.strategy, p.min_sep, p.max_participations, n_steps=p.steps)

    def step_increments(self, plan: PlanFields) -> list[Any]:
        import opake_fx.dpftrl.accounting as mf_acc

        p = plan.participation
        return mf_acc.mf_gaussian_steps(plan.noise_multiplier, plan.strategy, p.min_sep, p.max_participations,
                                        n_steps=p.steps)
