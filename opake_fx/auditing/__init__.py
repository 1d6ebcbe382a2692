"""Privacy auditing: canaries, membership scores and empirical lower bounds on epsilon.

An accountant's epsilon is an upper bound that holds only if the code does what the
analysis assumes; an audit measures a *lower* bound from an actual run, so a broken
mechanism (missing or mis-scaled noise, skipped clipping, non-Poisson batches) shows up
as a lower bound above the claim. See ``docs/auditing.md``.

* canaries: :func:`coin_flip`, :class:`CanarySampler`, :func:`dirac_canaries`,
  :func:`mislabel`, :func:`out_of_distribution`;
* scores: :func:`canary_scores`, :func:`loss_scores`, :func:`gradient_scores`;
* one run: :func:`one_run` -> :class:`OneRunEstimate` (Steinke et al. 2023; f-DP
  refinement of Mahloujifar et al. 2024; GDP fit; AUC);
* two samples: :class:`CanaryScoreAuditor` (Clopper-Pearson, one-run, GDP);
* end to end: :func:`audit_dpsgd`; :func:`perfect_attack_ceiling`; :func:`plot_audit`.

The names are loaded on first access; the statistics need only numpy and scipy.
"""

from opake_fx import _lazy
from typing import TYPE_CHECKING as _TYPE_CHECKING

__all__ = [
    "CoinFlip", "coin_flip", "CanarySampler", "DiracCanaries", "dirac_canaries", "mislabel", "out_of_distribution",
    "CanaryScores", "canary_scores", "loss_scores", "gradient_scores",
    "OneRunEstimate", "GdpFit", "AucEstimate", "one_run", "default_guess_grid",
    "CanaryScoreAuditor",
    "AuditResult", "audit_dpsgd",
    "perfect_attack_ceiling", "plot_audit",
]

_EXPORTS = {
    **{n: "opake_fx.auditing.canaries" for n in ("CoinFlip", "coin_flip", "CanarySampler", "DiracCanaries",
                                                 "dirac_canaries", "mislabel", "out_of_distribution")},
    **{n: "opake_fx.auditing.scores" for n in ("CanaryScores", "canary_scores", "loss_scores", "gradient_scores")},
    **{n: "opake_fx.auditing.single_run" for n in ("OneRunEstimate", "GdpFit", "AucEstimate", "one_run",
                                                "default_guess_grid")},
    "CanaryScoreAuditor": "opake_fx.auditing.two_sample",
    "AuditResult": "opake_fx.auditing.dpsgd",
    "audit_dpsgd": "opake_fx.auditing.dpsgd",
    "perfect_attack_ceiling": "opake_fx.auditing.ceiling",
    "plot_audit": "opake_fx.auditing.plot",
}
_SUBMODULES = frozenset({"bounds", "canaries", "scores", "single_run", "two_sample", "dpsgd", "ceiling", "plot", "users"})

if _TYPE_CHECKING:  # static analysers see the eager imports
    from opake_fx.auditing.canaries import (CanarySampler, CoinFlip, DiracCanaries, coin_flip, dirac_canaries,
                                            mislabel, out_of_distribution)
    from opake_fx.auditing.ceiling import perfect_attack_ceiling
    from opake_fx.auditing.dpsgd import AuditResult, audit_dpsgd
    from opake_fx.auditing.single_run import AucEstimate, GdpFit, OneRunEstimate, default_guess_grid, one_run
    from opake_fx.auditing.plot import plot_audit
    from opake_fx.auditing.scores import CanaryScores, canary_scores, gradient_scores, loss_scores
    from opake_fx.auditing.two_sample import CanaryScoreAuditor

__getattr__, __dir__ = _lazy.attach(__name__, globals(), _EXPORTS, _SUBMODULES)
