"""Group privacy: what an (epsilon, delta)-DP process guarantees for a group of k units.

Example-level DP with every user capped at ``k`` examples protects a user as a group of
``k`` examples: data sets that differ by one user differ by at most ``k`` examples, a path
of ``k`` add-or-remove-one steps. If a process is ``(eps, d)``-DP for one example, it is
``(k * eps, d * sum_{i<k} exp(i * eps))``-DP for ``k`` (the group privacy lemma; Vadhan,
"The Complexity of Differential Privacy", Lemma 2.2). :func:`group_epsilon` picks the
example-level ``d`` that gives the smallest group epsilon at the group's ``delta``.

The second route is Renyi DP's group property (Mironov 2017, "Renyi Differential
Privacy", Proposition 2): an ``(alpha, r)``-RDP process is ``(alpha / 2**c, 3**c * r)``-RDP
for groups of ``2**c`` when ``alpha >= 2**(c + 1)``; :func:`group_rdp` applies it with
``c = ceil(log2 k)`` to the process's RDP curve, and the result converts to
``(epsilon, delta)`` as any RDP curve does. :func:`group_epsilon` takes the smaller of the
two (``method="best"``), each valid on its own.

Both are generic conversions, valid for any process; both are loose (linear or worse in
``k``). Sampling users instead (:mod:`opake_fx.users`) usually protects a user far better
at the same noise.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

import opake_fx.validation as check
from opake_fx.accounting.rdp import DEFAULT_RDP_ORDERS, epsilon_from_rdp
from opake_fx.errors import InputValueError

__all__ = ["group_epsilon", "group_delta", "group_rdp"]

GROUP_METHODS = ("best", "lemma", "rdp")
"""How :func:`group_epsilon` converts: the smaller of the two routes, the group privacy lemma, or RDP's group property."""


def group_delta(epsilon: float, delta: float, group_size: int) -> float:
    """The delta of a group of ``group_size`` for an ``(epsilon, delta)``-DP mechanism:
    ``delta * sum_{i < k} exp(i * epsilon)`` (its epsilon is ``k * epsilon``), at most 1.

    Example:
        >>> group_delta(0.0, 1e-6, 3)
        3e-06
        >>> round(group_delta(1.0, 1e-6, 2), 12)
        3.718282e-06
        >>> group_delta(50.0, 1e-6, 32)  # exp(1550) would overflow: a delta of 1 is no guarantee
        1.0
    """
    k = check.integer(group_size, "group_size", "group_delta", minimum=1)
    eps = check.non_negative(epsilon, "epsilon", "group_delta")
    d = check.unit_interval(delta, "delta", "group_delta")
    if eps == 0.0:
        return k * d
    log_sum = (k * eps + math.log(-math.expm1(-k * eps))) - (eps + math.log(-math.expm1(-eps)))  # log((e^{k eps}-1)/(e^eps-1))
    if d == 0:
        return 0.0
    log_delta = math.log(d) + log_sum
    return 1.0 if log_delta >= 0 else math.exp(log_delta)  # a delta of 1 or more says nothing: 1


def group_rdp(process: Any, group_size: int, orders: tuple[float, ...] = DEFAULT_RDP_ORDERS,
              ) -> tuple[np.ndarray, np.ndarray]:
    """The RDP curve of ``process`` for groups of ``group_size``: ``(orders, epsilons)``.

    Mironov's Proposition 2 with ``c = ceil(log2 k)``: the process's RDP ``r(alpha)`` at
    every ``alpha >= 2**(c + 1)`` of ``orders`` gives ``3**c * r(alpha)`` at order
    ``alpha / 2**c`` for neighbours that differ by at most ``2**c >= k`` units.

    Raises:
        InputValueError: the process has no RDP curve (a mechanism accounted by PLD only),
            or no order of ``orders`` is large enough for the group.

    Privacy: valid for any process whose RDP curve is valid at ``orders``; the returned
    orders are all ``>= 2``.

    Example:
        >>> from opake_fx.dpsgd.accounting import gaussian
        >>> a, r = group_rdp(gaussian(1.0), 2, orders=(4.0, 8.0))
        >>> a.tolist(), r.tolist()  # r(4) = 4 / 2 = 2 -> 3 * 2 at order 2
        ([2.0, 4.0], [6.0, 12.0])
    """
    k = check.integer(group_size, "group_size", "group_rdp", minimum=1)
    c = (k - 1).bit_length()  # ceil(log2 k): 2**c >= k
    all_orders = np.asarray(orders, dtype=np.float64)
    if c == 0:
        return all_orders, np.asarray(process.rdp(tuple(orders)), dtype=np.float64)
    keep = all_orders >= 2.0 ** (c + 1)
    if not keep.any():
        raise InputValueError(
            f"group_rdp: a group of {k} needs RDP orders >= {2 ** (c + 1)}; the largest given is {all_orders.max():g}."
        )
    curve = np.asarray(process.rdp(tuple(float(a) for a in all_orders[keep])), dtype=np.float64)
    return all_orders[keep] / 2.0**c, curve * 3.0**c


def group_epsilon(process: Any, group_size: int, delta: float, *, accountant: str = "pld", grid: int = 97,
                  method: str = "best") -> float:
    """The epsilon at ``delta`` of ``process`` for groups of ``group_size`` units.

    ``method="lemma"``: the smallest ``k * eps(d)`` over example-level deltas ``d`` whose
    group delta (:func:`group_delta`) is at most ``delta``. ``method="rdp"``: the RDP group
    property (:func:`group_rdp`) converted at ``delta``. ``method="best"`` (default): the
    smaller of the two (the RDP route is skipped for a process without an RDP curve).

    Args:
        process: a :class:`~opake_fx.accounting.DpProcess` accounted per example.
        group_size: ``k``, the most units (examples) one group (user) has.
        delta: the group's delta.
        accountant: ``"pld"`` or ``"rdp"``, for the lemma's example-level epsilons.
        grid: the number of example-level deltas the lemma tries, log-spaced from
            ``delta / k`` down by 24 orders of magnitude (each tried value is checked
            exactly, so the grid only affects tightness, never validity).
        method: ``"best"``, ``"lemma"`` or ``"rdp"``.

    Returns:
        The group's epsilon at ``delta`` (``inf`` when no route gives a finite one).

    Privacy: each route is a valid ``(epsilon, delta)`` bound for neighbours that differ by
    at most ``k`` units whenever the process is valid for one unit; the minimum of valid
    bounds is valid.

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
    how = check.choice(method, "method", "group_epsilon", GROUP_METHODS)
    if k == 1:
        return process.epsilon_at(d, accountant=accountant)
    best = math.inf
    if how in ("best", "lemma"):
        if accountant == "rdp":  # one RDP curve, converted at every delta (not recomputed per delta)
            curve = process.rdp()
            epsilon_at = lambda delta_: epsilon_from_rdp(DEFAULT_RDP_ORDERS, curve, delta_)  # noqa: E731
        else:
            epsilon_at = lambda delta_: process.epsilon_at(delta_, accountant=accountant)  # noqa: E731
        for j in range(n):
            d_ex = (d / k) * 10.0 ** (-24.0 * j / (n - 1))
            eps = epsilon_at(d_ex)
            if math.isfinite(eps) and group_delta(eps, d_ex, k) <= d:
                best = min(best, k * eps)
    if how in ("best", "rdp"):
        try:
            orders, curve = group_rdp(process, k)
        except InputValueError:
            if how == "rdp":
                raise
        else:
            best = min(best, epsilon_from_rdp(orders.tolist(), curve, d))
    return best
