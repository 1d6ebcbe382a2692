"""Two-sample auditing: scores of held-in and held-out canaries, threshold attacks, confidence bounds.

The attack says "in" when a score is at least a threshold ``t``. At each threshold the
true and false positives are binomial counts, so exact Clopper-Pearson bounds on the
rates give, at the stated confidence, a lower bound on epsilon (Jagielski et al. 2020;
Nasr et al. 2021), or on mu of a mu-GDP mechanism (Nasr et al. 2023). Choosing the
best threshold after looking at the scores is paid for: the significance is divided by
the number of thresholds tried (Bonferroni), or the threshold is chosen on one half of
the canaries and the bound computed on the other (``threshold="split"``).

The rates are binomial when the canaries' scores are independent given their
membership (separate training runs, or Dirac canaries on distinct coordinates of a
noisy sum). For canaries of one run whose scores share the model, use the one-run
bounds (:meth:`epsilon_one_run`, or :func:`~opake_fx.auditing.single_run`), which need
only the coin flips.

Example:
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> auditor = CanaryScoreAuditor(rng.normal(2.0, 1.0, 500), rng.normal(0.0, 1.0, 500))
    >>> round(auditor.attack_auroc(), 3)
    0.932
    >>> 0 < auditor.epsilon_clopper_pearson(0.05, 1e-5) < auditor.epsilon_from_gdp(0.05, 1e-5) < 10.0
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import scipy.stats

from opake_fx.auditing import bounds
from opake_fx.auditing._inputs import check_delta, check_significance, numpy_rng
from opake_fx.auditing.single_run import auroc
from opake_fx.errors import InputValueError

__all__ = ["CanaryScoreAuditor"]

_norm = scipy.stats.norm


class CanaryScoreAuditor:
    """Membership bounds from the scores of held-in and held-out canaries (higher = "in").

    Args:
        in_scores: scores of canaries that were trained on.
        out_scores: scores of canaries that were not.

    Raises:
        InputValueError: an empty or non-finite score array.

    Privacy contract: the bounds are lower bounds on the epsilon of the mechanism that
    produced the scores, at confidence ``1 - significance``, provided the in- and
    out-scores are independent draws given membership (see the module docstring).
    """

    def __init__(self, in_scores: Sequence[float] | np.ndarray, out_scores: Sequence[float] | np.ndarray) -> None:
        self.in_scores = _scores(in_scores, "in_scores")
        self.out_scores = _scores(out_scores, "out_scores")
        # Thresholds: every distinct score and +inf (no one "in"); "in" iff score >= t.
        self.thresholds = np.concatenate([np.union1d(self.in_scores, self.out_scores), [np.inf]])
        self.tp = _count_at_least(self.in_scores, self.thresholds)
        self.fp = _count_at_least(self.out_scores, self.thresholds)

    @property
    def n_in(self) -> int:
        return int(self.in_scores.size)

    @property
    def n_out(self) -> int:
        return int(self.out_scores.size)

    def attack_auroc(self) -> float:
        """The exact AUROC of the score: P(in > out) + P(in == out) / 2 (Mann-Whitney U / (n_in n_out))."""
        return auroc(self.in_scores, self.out_scores)

    def tpr_at_given_fpr(self, fpr: float | np.ndarray) -> float | np.ndarray:
        """The largest TPR at false positive rate ``fpr`` of a (possibly randomised) threshold attack.

        Randomising between two thresholds reaches every point of the ROC's upper
        concave hull, so this interpolates that hull (an empirical value, not a bound).
        """
        f = np.asarray(fpr, dtype=np.float64)
        if np.any((f < 0) | (f > 1)) or np.any(np.isnan(f)):
            raise InputValueError(f"tpr_at_given_fpr: fpr must be in [0, 1]; got {fpr!r}.")
        x, y = _upper_hull(self.fp[::-1] / self.n_out, self.tp[::-1] / self.n_in)
        out = np.interp(f, x, y)
        return float(out) if out.ndim == 0 else out

    def epsilon_clopper_pearson(self, significance: float = 0.05, delta: float = 0.0, *, threshold: Any = None,
                                key: Any = None) -> float:
        """Lower bound on epsilon from exact bounds on TPR and FPR: ``log((TPR_lo - delta) / FPR_hi)``.

        Args:
            significance: probability that the bound is wrong (split evenly between TPR and FPR).
            delta: the delta of the (epsilon, delta) claim.
            threshold: ``None`` (default): the best of all thresholds, Bonferroni over
                all of them; a number: that threshold alone (chosen before seeing the
                scores); ``"split"``: choose on a random half (from ``key``), bound on the other.
            key: an :func:`opake_fx.random.key` for ``"split"`` (default ``key(0)``).
        """
        check_significance(significance, "epsilon_clopper_pearson")
        check_delta(delta, "epsilon_clopper_pearson", allow_zero=True)
        return self._with_threshold(threshold, key, significance, lambda a, s, t: a._cp(s, delta, t))

    def epsilon_one_run(self, significance: float = 0.05, delta: float = 1e-5, *, threshold: Any = None,
                        key: Any = None) -> float:
        """Steinke et al.'s one-run bound, treating the in/out canaries as coin-flipped.

        Guesses "in" for the top ``k`` scores and abstains on the rest (one-sided).
        Valid when membership was decided by independent fair coins, whatever the
        dependence of the scores. ``threshold=None`` tries ``k`` = 1%, 2%, 5%, 10%, 20%,
        30%, 40%, 45%, 50% of the canaries (Bonferroni over the 9); a number guesses
        the scores >= it; ``"split"`` picks the fraction on one random half (``key``)
        and bounds on the other.

        Raises:
            InputValueError: in/out counts that fair coins give with probability below
                ``significance`` (a fixed, unbalanced design, for which guessing "in" is
                right more than half the time even for a mechanism that leaks nothing).
        """
        check_significance(significance, "epsilon_one_run")
        check_delta(delta, "epsilon_one_run", allow_zero=True)
        return self._top_k(threshold, key, significance, lambda est, s, g: est.epsilon_at(delta, s, guesses=g))

    def epsilon_one_run_fdp(self, significance: float = 0.05, delta: float = 1e-5, *, threshold: Any = None,
                            key: Any = None) -> float:
        """The f-DP one-run bound (Mahloujifar et al. 2024) with Gaussian trade-offs, as an epsilon at ``delta``.

        Guess sets as in :meth:`epsilon_one_run`. A lower bound for mechanisms with a
        Gaussian-shaped trade-off curve.
        """
        check_significance(significance, "epsilon_one_run_fdp")
        check_delta(delta, "epsilon_one_run_fdp")
        return self._top_k(threshold, key, significance, lambda est, s, g: est.epsilon_fdp_at(delta, s, guesses=g))

    def epsilon_from_gdp(self, significance: float = 0.05, delta: float = 1e-5) -> float:
        """Epsilon at ``delta`` of the largest mu that exact FPR/FNR bounds certify, if the mechanism is mu-GDP.

        At each threshold, ``mu >= Phi^-1(1 - FPR_hi) - Phi^-1(FNR_hi)`` for a mu-GDP
        mechanism (its trade-off ``FNR = Phi(Phi^-1(1 - FPR) - mu)``); the bounds are
        Bonferroni-corrected over the ``2 x thresholds`` rates (Nasr et al. 2023).
        Only the "score >= t means in" direction is used: bounding the reversed
        attack needs lower bounds on the rates, not the upper ones.
        """
        check_significance(significance, "epsilon_from_gdp")
        check_delta(delta, "epsilon_from_gdp")
        return bounds.gdp_epsilon(self.mu_from_gdp(significance), delta)

    def mu_from_gdp(self, significance: float = 0.05) -> float:
        """The lower bound on mu behind :meth:`epsilon_from_gdp`."""
        check_significance(significance, "mu_from_gdp")
        a = significance / (2 * self.thresholds.size)
        fpr_hi = bounds.clopper_pearson_upper(self.fp, self.n_out, a)
        fnr_hi = bounds.clopper_pearson_upper(self.n_in - self.tp, self.n_in, a)
        ok = (fpr_hi < 1) & (fnr_hi < 1)
        if not ok.any():
            return 0.0
        mu = _norm.isf(fpr_hi[ok]) - _norm.ppf(fnr_hi[ok])
        return float(max(0.0, mu.max()))

    # --- helpers --------------------------------------------------------------------------

    def _with_threshold(self, threshold: Any, key: Any, significance: float, at: Any) -> float:
        if threshold is None:
            value, _ = at(self, significance / self.thresholds.size, None)
            return value
        if isinstance(threshold, str):
            chooser, second = self._split(threshold, key)
            _, t = at(chooser, significance / chooser.thresholds.size, None)
            value, _ = at(second, significance, t)
            return value
        t = float(threshold)
        if np.isnan(t):
            raise InputValueError("threshold is NaN.")
        value, _ = at(self, significance, t)
        return value

    def _split(self, threshold: str, key: Any) -> tuple[CanaryScoreAuditor, CanaryScoreAuditor]:
        """``threshold="split"``: a keyed random half of each side to choose on, the other half to bound."""
        if threshold != "split":
            raise InputValueError(f"threshold must be None, a number or 'split'; got {threshold!r}.")
        rng = numpy_rng(key)
        in_a, in_b = _halves(self.in_scores, rng)
        out_a, out_b = _halves(self.out_scores, rng)
        return CanaryScoreAuditor(in_a, out_a), CanaryScoreAuditor(in_b, out_b)

    def _counts_at(self, t: float | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if t is None:
            return self.thresholds, self.tp, self.fp
        tt = np.array([t])
        return tt, _count_at_least(self.in_scores, tt), _count_at_least(self.out_scores, tt)

    def _cp(self, significance: float, delta: float, t: float | None) -> tuple[float, float]:
        ts, tp, fp = self._counts_at(t)
        tpr_lo = 1.0 - bounds.clopper_pearson_upper(self.n_in - tp, self.n_in, significance / 2)
        fpr_hi = bounds.clopper_pearson_upper(fp, self.n_out, significance / 2)
        with np.errstate(divide="ignore", invalid="ignore"):
            eps = np.where(tpr_lo > delta, np.log(np.maximum(tpr_lo - delta, 1e-300)) - np.log(fpr_hi), -np.inf)
        i = int(np.argmax(eps))
        return max(0.0, float(eps[i])), float(ts[i])

    def _estimate(self) -> Any:
        from opake_fx.auditing.single_run import OneRunEstimate

        m = self.n_in + self.n_out
        return OneRunEstimate(scores=np.concatenate([self.in_scores, self.out_scores]),
                              included=np.arange(m) < self.n_in, canary_ids=np.arange(m))

    def _top_k(self, threshold: Any, key: Any, significance: float, bound: Any) -> float:
        m = self.n_in + self.n_out
        self._check_coin_flipped(significance)
        if threshold is None:
            return bound(self._estimate(), significance, _top_grid(m))
        if isinstance(threshold, str):
            chooser_auditor, second_auditor = self._split(threshold, key)
            chooser = chooser_auditor._estimate()
            grid_a = _top_grid(chooser.num_canaries)
            values = [bound(chooser, significance / len(grid_a), [g]) for g in grid_a]
            fraction = grid_a[int(np.argmax(values))][0] / chooser.num_canaries
            second = second_auditor._estimate()
            k = min(second.num_canaries, max(1, int(round(fraction * second.num_canaries))))
            return bound(second, significance, [(k, 0)])
        t = float(threshold)
        if np.isnan(t):
            raise InputValueError("threshold is NaN.")
        k = int((self.in_scores >= t).sum() + (self.out_scores >= t).sum())
        return bound(self._estimate(), significance, [(k, 0)]) if k else 0.0


    def _check_coin_flipped(self, significance: float) -> None:
        """Refuses in/out counts that independent fair coins give with probability below ``significance``.

        The one-run bounds compare the right guesses with a ``Binomial(k, e^eps / (1 + e^eps))``:
        that needs membership decided by fair coins. With a fixed, unbalanced design (e.g. 900
        in, 100 out) guessing "in" is right 90% of the time whatever the mechanism, and a
        mechanism with epsilon 0 would audit to ~1.7. Fair coins give such counts with
        probability below ``significance``, so refusing them keeps the bound's error rate.
        """
        m = self.n_in + self.n_out
        p = float(scipy.stats.binomtest(self.n_in, m, 0.5).pvalue)
        if p < significance:
            raise InputValueError(
                f"CanaryScoreAuditor: {self.n_in} in- and {self.n_out} out-canaries are not what independent fair "
                f"coins give (two-sided binomial p = {p:.3g} < significance {significance:g}); the one-run bounds "
                "assume coin-flipped membership and would report epsilon > 0 for a mechanism that leaks nothing. "
                "Draw membership with opake_fx.auditing.coin_flip, or use epsilon_clopper_pearson / epsilon_from_gdp "
                "(valid for a fixed design)."
            )


def _top_grid(m: int) -> list[tuple[int, int]]:
    from opake_fx.auditing.single_run import default_guess_grid

    return [(kp, km) for kp, km in default_guess_grid(m) if km == 0]


def _scores(x: Any, name: str) -> np.ndarray:
    a = np.asarray(x.detach().cpu().double().numpy() if hasattr(x, "detach") else x, dtype=np.float64).reshape(-1)
    if a.size == 0:
        raise InputValueError(f"CanaryScoreAuditor: {name} is empty; each side needs at least one canary.")
    if not np.isfinite(a).all():
        raise InputValueError(f"CanaryScoreAuditor: {name} has {int((~np.isfinite(a)).sum())} non-finite scores.")
    return a


def _count_at_least(scores: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    s = np.sort(scores)
    return s.size - np.searchsorted(s, thresholds, side="left")


def _halves(x: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    if x.size < 2:
        raise InputValueError("threshold='split' needs at least 2 in- and 2 out-scores.")
    perm = rng.permutation(x.size)
    return x[perm[: x.size // 2]], x[perm[x.size // 2:]]


def _upper_hull(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The upper concave hull of ROC points sorted by x (monotone chain)."""
    hull: list[tuple[float, float]] = []
    for p in zip(x.tolist(), y.tolist()):
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if (x2 - x1) * (p[1] - y1) - (y2 - y1) * (p[0] - x1) >= 0:  # hull[-1] is not above the chord
                hull.pop()
            else:
                break
        hull.append(p)
    hx, hy = np.array(hull).T
    return hx, hy
