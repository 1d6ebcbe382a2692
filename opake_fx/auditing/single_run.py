"""One-run auditing (Steinke, Nasr and Jagielski 2023): coin-flip canaries, one training run.

Each canary is included in training by a fair coin; after one run the attacker ranks
the canaries by score and guesses "in" for the ``k_plus`` highest, "out" for the
``k_minus`` lowest, and abstains on the rest. Under (epsilon, delta)-DP the number of
right guesses is (nearly) a ``Binomial(guesses, e^eps / (1 + e^eps))``; a count that
is too high for that binomial rejects epsilon. The guess sets tried are fixed in
advance (a grid over ``k_plus, k_minus``) and the significance is divided by their
number (Bonferroni), so the reported bound holds at the stated confidence.

Example:
    >>> import numpy as np
    >>> from opake_fx.random import key
    >>> from opake_fx.auditing import perfect_attack_ceiling
    >>> flip = coin_flip(2000, 1000, key(0))
    >>> rng = np.random.default_rng(0)
    >>> values = rng.normal(size=1000) + 4.0 * flip.included
    >>> est = one_run(canary_scores(values, flip.canary_indices), flip)
    >>> 2.0 < est.epsilon_at(1e-5) <= perfect_attack_ceiling(1000)["one_run"]    # 3.61
    True
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import scipy.special
import scipy.stats

from opake_fx.auditing import bounds
from opake_fx.auditing._inputs import check_significance, numpy_rng
from opake_fx.auditing.canaries import CoinFlip, coin_flip  # noqa: F401  (coin_flip: the docstring example)
from opake_fx.auditing.scores import CanaryScores, canary_scores  # noqa: F401
from opake_fx.errors import InputTypeError, InputValueError

__all__ = ["OneRunEstimate", "GdpFit", "AucEstimate", "one_run", "default_guess_grid"]

_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.45, 0.5)


def one_run(scores: CanaryScores, flip: CoinFlip) -> "OneRunEstimate":
    """Pairs the canaries' scores with their coins, by canary id.

    Args:
        scores: one score per canary (higher: more likely included), from
            :func:`canary_scores`, :func:`loss_scores` or :func:`gradient_scores`.
        flip: the :class:`CoinFlip` the run was trained with.

    Raises:
        InputValueError: the scores' canary ids are not exactly the coin flip's canaries
            (a missing, extra or duplicated id would pair a score with the wrong coin).

    Privacy: none spent; the estimate is a statistic of a finished run.
    """
    if not isinstance(scores, CanaryScores):
        raise InputTypeError(
            f"one_run expects CanaryScores (canary_scores(values, canary_indices)); got {type(scores).__name__}. "
            "Scores carry their canary ids so they cannot be paired with the wrong coins."
        )
    if not isinstance(flip, CoinFlip):
        raise InputTypeError(f"one_run expects the CoinFlip of the run; got {type(flip).__name__}.")
    ids = flip.canary_indices
    if scores.canary_ids.shape != ids.shape or not np.array_equal(np.sort(scores.canary_ids), ids):
        missing = np.setdiff1d(ids, scores.canary_ids)[:5].tolist()
        extra = np.setdiff1d(scores.canary_ids, ids)[:5].tolist()
        raise InputValueError(
            f"one_run: the scores are for {scores.canary_ids.size} canary ids, the coin flip has {ids.size} canaries; "
            f"ids missing from the scores (first 5): {missing}, ids that are not canaries (first 5): {extra}. "
            "Score exactly the coin flip's canaries (flip.canary_indices)."
        )
    order = np.argsort(scores.canary_ids)
    return OneRunEstimate(scores=scores.values[order], included=flip.included.copy(), canary_ids=ids.copy())


def default_guess_grid(num_canaries: int) -> tuple[tuple[int, int], ...]:
    """The ``(k_plus, k_minus)`` guess sets tried by default: 1%..50% of the canaries on each side.

    Example:
        >>> default_guess_grid(100)[:3]
        ((1, 0), (1, 1), (1, 2))
    """
    ks = sorted({max(1, int(round(f * num_canaries))) for f in _FRACTIONS})
    return tuple((kp, km) for kp in ks for km in [0, *ks] if kp + km <= num_canaries)


@dataclass(frozen=True)
class AucEstimate:
    """An attack's AUC with a percentile-bootstrap interval (a description, not a privacy bound)."""

    auc: float
    low: float
    high: float
    confidence: float


@dataclass(frozen=True)
class GdpFit:
    """A mu-GDP description of a run.

    Attributes:
        mu_lower: the largest mu for which mu-GDP is rejected at ``significance`` (the
            f-DP one-run test over the guess grid): a lower bound on the run's mu,
            *if* its trade-off curve is Gaussian.
        mu_estimate: the point estimate ``(mean_in - mean_out) / pooled std`` (not a bound).
        significance: the test's significance.
    """

    mu_lower: float
    mu_estimate: float
    significance: float

    def epsilon_lower(self, delta: float) -> float:
        """The epsilon at ``delta`` of :attr:`mu_lower`-GDP."""
        return bounds.gdp_epsilon(self.mu_lower, delta)

    def epsilon_estimate(self, delta: float) -> float:
        """The epsilon at ``delta`` of :attr:`mu_estimate`-GDP (a point estimate, not a bound)."""
        return bounds.gdp_epsilon(self.mu_estimate, delta)


@dataclass(frozen=True)
class OneRunEstimate:
    """Scores and coins of the canaries of one run, aligned by canary id.

    Attributes:
        scores: float64 ``[m]``, higher = more likely included.
        included: bool ``[m]``, the coins.
        canary_ids: int64 ``[m]``, the dataset slots (sorted).

    Privacy contract: the bounds assume the coins were fair and independent of
    everything else in the run (as :func:`coin_flip` draws them) and that the guess
    sets were fixed before looking at the coins (the grid, Bonferroni-corrected).
    """

    scores: np.ndarray
    included: np.ndarray
    canary_ids: np.ndarray
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_canaries(self) -> int:
        return int(self.scores.size)

    def guesses(self, k_plus: int, k_minus: int) -> tuple[int, int]:
        """``(guesses, correct)`` when guessing "in" for the ``k_plus`` top and "out" for the ``k_minus`` bottom scores.

        Ties are broken by canary id (a fixed rule that does not look at the coins).
        """
        m = self.num_canaries
        if not (0 <= k_plus and 0 <= k_minus and k_plus + k_minus <= m and k_plus + k_minus > 0):
            raise InputValueError(f"guesses: need k_plus, k_minus >= 0 with 0 < k_plus + k_minus <= {m}; got "
                                  f"({k_plus}, {k_minus}).")
        order = self._order()
        top = self.included[order[m - k_plus:]].sum() if k_plus else 0
        bottom = (~self.included[order[:k_minus]]).sum() if k_minus else 0
        return k_plus + k_minus, int(top + bottom)

    def epsilon_at(self, delta: float, significance: float = 0.05, *, guesses: Any = None) -> float:
        """Steinke et al.'s lower bound on epsilon: holds for any (epsilon, delta)-DP mechanism.

        Args:
            delta: the delta of the claim being tested (the accountant's delta).
            significance: the probability that the returned bound is wrong.
            guesses: the ``(k_plus, k_minus)`` pairs to try (default
                :func:`default_guess_grid`); the significance is split among them.

        Returns:
            The largest epsilon rejected by the best guess set (0: none rejected).
        """
        return self._best(guesses, significance, lambda k, c, a, b: bounds.epsilon_one_run(
            self.num_canaries, k, c, significance=a, delta=delta, at_least=b))

    def epsilon_fdp_at(self, delta: float, significance: float = 0.05, *, guesses: Any = None) -> float:
        """The f-DP refinement (Mahloujifar et al. 2024) with Gaussian trade-off curves.

        The epsilon at ``delta`` of the largest mu-GDP claim rejected. Much tighter
        than :meth:`epsilon_at`, but a lower bound on epsilon only for mechanisms whose
        trade-off curve is Gaussian-shaped (DP-SGD approximately, by the CLT).
        """
        return bounds.gdp_epsilon(self.gdp(significance, guesses=guesses).mu_lower, delta)

    def gdp(self, significance: float = 0.05, *, guesses: Any = None) -> GdpFit:
        """A mu-GDP fit: the f-DP lower bound on mu and a normal-fit point estimate."""
        mu_lower = self._best(guesses, significance, lambda k, c, a, b: bounds.mu_one_run_fdp(
            self.num_canaries, k, c, significance=a, at_least=b), kind="mu")
        inside, outside = self.scores[self.included], self.scores[~self.included]
        if inside.size < 2 or outside.size < 2:
            mu_hat = float("nan")
        else:
            pooled = np.sqrt(((inside.size - 1) * inside.var(ddof=1) + (outside.size - 1) * outside.var(ddof=1))
                             / (inside.size + outside.size - 2))
            mu_hat = float((inside.mean() - outside.mean()) / pooled) if pooled > 0 else float("inf")
        return GdpFit(mu_lower=mu_lower, mu_estimate=mu_hat, significance=significance)

    def attack_auc(self, *, bootstrap: int = 1000, confidence: float = 0.95, key: Any = None) -> AucEstimate:
        """The AUC of the score attack (exact Mann-Whitney) and a percentile bootstrap interval.

        Args:
            bootstrap: resamples (in- and out-canaries resampled separately).
            confidence: of the interval.
            key: an :func:`opake_fx.random.key` for the resampling (default ``key(0)``).
        """
        if not 0 < confidence < 1:
            raise InputValueError(f"attack_auc: confidence must be in (0, 1); got {confidence}.")
        inside, outside = self.scores[self.included], self.scores[~self.included]
        if inside.size == 0 or outside.size == 0:
            raise InputValueError("attack_auc needs at least one included and one excluded canary.")
        rng = numpy_rng(key)
        auc = auroc(inside, outside)
        boots = np.empty(bootstrap)
        for b in range(bootstrap):
            boots[b] = auroc(rng.choice(inside, inside.size), rng.choice(outside, outside.size))
        tail = (1 - confidence) / 2
        low, high = np.quantile(boots, [tail, 1 - tail]) if bootstrap else (auc, auc)
        return AucEstimate(auc=auc, low=float(low), high=float(high), confidence=confidence)

    # --- helpers --------------------------------------------------------------------------

    def _order(self) -> np.ndarray:
        if "order" not in self._cache:
            self._cache["order"] = np.lexsort((self.canary_ids, self.scores))
        return self._cache["order"]

    def _best(self, guesses: Any, significance: float, bound: Any, kind: str = "eps") -> float:
        check_significance(significance, "OneRunEstimate")
        grid = default_guess_grid(self.num_canaries) if guesses is None else tuple(tuple(g) for g in guesses)
        if not grid:
            raise InputValueError("OneRunEstimate: guesses is empty; give (k_plus, k_minus) pairs or None.")
        alpha = significance / len(grid)
        counts = sorted({self.guesses(kp, km) for kp, km in grid}, key=lambda kc: -kc[1] / kc[0])
        best, best_precision = 0.0, 0.5
        for k, c in counts:
            # A guess set whose raw precision is no better than what the best bound already
            # implies cannot beat it (the bound is below log(precision / (1 - precision))).
            if c / k <= best_precision:
                continue
            value = bound(k, c, alpha, best)
            if value > best:
                best = value
                best_precision = max(best_precision, _implied_precision(value, kind))
        return best


def auroc(inside: np.ndarray, outside: np.ndarray) -> float:
    """Exact AUROC: P(in > out) + P(in == out) / 2 (the Mann-Whitney U statistic over n_in * n_out)."""
    ranks = scipy.stats.rankdata(np.concatenate([inside, outside]))
    u = ranks[: inside.size].sum() - inside.size * (inside.size + 1) / 2
    return float(u / (inside.size * outside.size))


def _implied_precision(value: float, kind: str) -> float:
    if kind == "eps":
        return float(scipy.special.expit(value))
    # a mu bound implies no simple precision cap; keep the raw-precision pruning off
    return 0.5
