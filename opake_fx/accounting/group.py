"""Group privacy: what an (epsilon, delta)-DP process guarantees for a group of k units.

Example-level DP with every user capped at ``k`` examples protects a user as a group of
``k`` examples: data sets that differ by one user differ by at most ``k`` examples, a path
of ``k`` add-or-remove-one steps. If a process is ``(eps, d)``-DP for one example, it is
``(k * eps, d * sum_{i<k} exp(i * eps))``-DP for ``k`` (the group privacy lemma; Vadhan,
"The Complexity of Differential Privacy", Lemma 2.2). :func:`group_epsilon` picks the
example-level ``d`` that gives the smallest group epsilon at the group's ``delta``.

This is the generic conversion, valid for any process; it is loose (linear in ``k`` in
epsilon, exponential in delta). Sampling users instead (:mod:`opake_fx.users`) usually
protects a user far better at the same noise.
"""

from __future__ import annotations

import math
from typing import Any

import opake_fx.validation as check

__all__ = ["group_epsilon", "group_delta"]


def group_delta(epsilon: float, delta: float, group_size: int) -> float:
    """The delta of a group of ``group_size`` for an ``(epsilon, delta)``-DP mechanism:
    ``delta * sum_{i < k} exp(i * epsilon)`` (its epsilon is ``k * epsilon``).

    Example:
        >>> group_delta(0.0, 1e-6, 3)
        3e-06
        >>> round(group_delta(1.0, 1e-6, 2), 12)
        3.718282e-06
    """
    k = check.integer(group_size, "group_size", "group_delta", minimum=1)
    eps = check.non_negative(epsilon, "epsilon", "group_delta")
    d = check.unit_interval(delta, "delta", "group_delta")
    if eps == 0.0:
        return k * d
    log_sum = (k * eps + math.log(-math.expm1(-k * eps))) - (eps + math.log(-math.expm1(-eps)))  # log((e^{k eps}-1)/(e^eps-1))
    return math.exp(math.log(d) + log_sum) if d > 0 else 0.0


def group_epsilon(process: Any, group_size: int, delta: float, *, accountant: str = "pld", grid: int = 97) -> float:
    """The smallest ``k * eps(d)`` over example-level deltas ``d`` whose group delta is at most ``delta``.

    Args:
        process: a :class:`~opake_fx.accounting.DpProcess` accounted per example.
        group_size: ``k``, the most units (examples) one group (user) has.
        delta: the group's delta.
        accountant: ``"pld"`` or ``"rdp"``, for the example-level epsilons.
        grid: the number of example-level deltas tried, log-spaced from ``delta / k`` down
            by 24 orders of magnitude (each tried value is checked exactly, so the grid
            only affects tightness, never validity).

    Returns:
        The group's epsilon at ``delta`` (``inf`` when no tried ``d`` gives a finite one).

    Privacy: the group privacy lemma applied to a valid ``(eps(d), d)`` of the process,
    for every ``d`` tried; the minimum over valid pairs is valid.

    Example:
        >>> from opake_fx.dpsgd.accounting import gaussian
        >>> one = gaussian(4.0).epsilon_at(1e-6)
        >>> g = group_epsilon(gaussian(4.0), 1, 1e-6)
        >>> g == one, group_epsilon(gaussian(4.0), 3, 1e-6) > 3 * one
        (True, True)
    """
    k = check.integer(group_size, "group_size", "group_epsilon", minimum=1)
    d = check.delta(delta, "group_epsilon")
    n = check.integer(grid, "grid", "group_epsilon", minimum=2)
    if k == 1:
        return process.epsilon_at(d, accountant=accountant)
    best = math.inf
    for j in range(n):
        d_ex = (d / k) * 10.0 ** (-24.0 * j / (n - 1))
        eps = process.epsilon_at(d_ex, accountant=accountant)
        if math.isfinite(eps) and group_delta(eps, d_ex, k) <= d:
            best = min(best, k * eps)
    return best
