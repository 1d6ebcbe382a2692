"""How much epsilon a canary count can certify at best: the perfect-attack ceiling.

A lower bound is limited by the number of canaries, however good the attack: with
``m`` canaries and a perfect attack, each estimator certifies at most the value that
:func:`perfect_attack_ceiling` computes by running that estimator on perfectly
separated scores (half the canaries in). An audit that reports its ceiling has found
the most it could; a claim above the ceiling cannot be refuted with that many canaries.

Example:
    >>> c = perfect_attack_ceiling(1000, significance=0.05, delta=1e-5)
    >>> {k: round(v, 1) for k, v in c.items()}
    {'one_run': 3.6, 'one_run_fdp': 7.2, 'clopper_pearson': 4.6, 'gdp': 30.3}
"""

from __future__ import annotations

import numpy as np

from opake_fx.errors import InputValueError

__all__ = ["perfect_attack_ceiling"]


def perfect_attack_ceiling(num_canaries: int, *, significance: float = 0.05, delta: float = 1e-5) -> dict[str, float]:
    """The bound each estimator reports for a perfect attack on ``num_canaries`` canaries (half of them in).

    Returns:
        ``{"one_run": ..., "one_run_fdp": ..., "clopper_pearson": ..., "gdp": ...}``:
        :meth:`OneRunEstimate.epsilon_at`, :meth:`OneRunEstimate.epsilon_fdp_at`,
        :meth:`CanaryScoreAuditor.epsilon_clopper_pearson` and
        :meth:`CanaryScoreAuditor.epsilon_from_gdp`, with their default threshold or
        guess choices and the same significance.
    """
    from opake_fx.auditing.single_run import OneRunEstimate
    from opake_fx.auditing.two_sample import CanaryScoreAuditor

    if not isinstance(num_canaries, (int, np.integer)) or num_canaries < 2:
        raise InputValueError(f"perfect_attack_ceiling: num_canaries must be an int >= 2; got {num_canaries!r}.")
    m = int(num_canaries)
    included = np.arange(m) < m // 2
    scores = included.astype(np.float64)
    est = OneRunEstimate(scores=scores, included=included, canary_ids=np.arange(m))
    auditor = CanaryScoreAuditor(scores[included], scores[~included])
    return {
        "one_run": est.epsilon_at(delta, significance),
        "one_run_fdp": est.epsilon_fdp_at(delta, significance),
        "clopper_pearson": auditor.epsilon_clopper_pearson(significance, delta),
        "gdp": auditor.epsilon_from_gdp(significance, delta),
    }
