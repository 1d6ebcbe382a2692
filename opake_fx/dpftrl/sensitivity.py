"""Sensitivity of a strategy matrix ``C`` under multiple participations.

In DP-FTRL an example's gradients enter the stream at the steps where it participates;
``C x + z`` is a Gaussian mechanism whose L2 sensitivity is the largest
``||C (x - x')||_F`` over neighbouring streams. With each participation contributing a
vector of norm at most 1 (the clip norm, in units of ``max_norm``), the squared
sensitivity is ``max_pi max_u sum_{i,j in pi} X[i, j] <u_i, u_j>`` with ``X = C^T C``
and ``pi`` ranging over the allowed participation patterns.

**b-min-sep participation** (Choquette-Choo et al. 2023, "Amplified BandMF"): an
example participates at most ``k`` times, any two participations at least ``b`` steps
apart (``b = 1`` allows consecutive steps). Three cases:

* ``C`` has at most ``b`` bands: columns of distinct participations are orthogonal, so
  the squared sensitivity is the largest sum of ``k`` squared column norms at
  separation ``>= b`` (a dynamic program) — **exact**;
* ``C`` lower-triangular Toeplitz with non-negative, non-increasing coefficients: the
  worst case is ``k`` participations at ``0, b, 2b, ...`` (McMahan et al. 2024, arXiv:2405.13763, Thm. 2)
  — **exact**; other Toeplitz coefficients use their non-increasing majorant — an
  upper bound;
* anything else: ``max_pi sum_{i in pi} max_{pi'} sum_{j in pi'} |X[i, j]|``
  (Choquette-Choo et al. 2023, Alg. 4) — an **upper bound**.

**Fixed-epoch order** (``k`` epochs of ``b = n / k`` steps, the same order each epoch;
Choquette-Choo et al. 2022): ``sqrt(max_j sum_{a, c in class j} |X[a, c]|)`` — exact when
the entries within each class are non-negative or zero off the diagonal (as the dense
multi-epoch strategy's are).

Every function returns the sensitivity of ``C`` for a unit clip norm; multiply by
``max_norm`` for the sensitivity of the noised query.

Example:
    >>> import torch
    >>> minsep_sensitivity(torch.eye(4), min_sep=2, max_participations=2)
    (1.4142135623730951, True)
"""

from __future__ import annotations

import math

import numpy as np
import torch

from opake_fx.dpftrl import _toeplitz
import opake_fx.validation as check
from opake_fx.errors import InputTypeError, InputValueError

__all__ = [
    "max_participations",
    "max_participation_sum",
    "minsep_sensitivity",
    "banded_sensitivity",
    "toeplitz_sensitivity",
    "fixed_epoch_sensitivity",
]


def max_participations(n_steps: int, min_sep: int, max_participations: int | None = None) -> int:
    """The number of participations actually possible: ``min(k, ceil(n / b))``.

    Example:
        >>> max_participations(10, 4), max_participations(10, 4, 2)
        (3, 2)
    """
    n = check.integer(n_steps, "n_steps", "max_participations", minimum=1)
    b = check.integer(min_sep, "min_sep", "max_participations", minimum=1)
    most = -(-n // b)
    if max_participations is None:
        return most
    return min(check.integer(max_participations, "max_participations", "max_participations", minimum=1), most)


def max_participation_sum(values: torch.Tensor, min_sep: int, max_participations: int | None = None) -> torch.Tensor:
    """``max_pi sum_{i in pi} values[..., i]`` over b-min-sep patterns of at most ``k`` steps.

    A dynamic program over the last dimension (vectorised over leading dimensions):
    ``F_k[i] = max(values[i] + F_{k-1}[i + b], F_k[i + 1])``; O(n k) per row
    (Choquette-Choo et al. 2023, Alg. 3).
    """
    v = values.double()
    n = v.shape[-1]
    b = check.integer(min_sep, "min_sep", "max_participation_sum", minimum=1)
    k = max_participations_of(n, b, max_participations)
    f = torch.zeros((*v.shape[:-1], n + b), dtype=torch.float64)
    for _ in range(k):
        g = f.clone()
        g[..., :n] = v + f[..., b : b + n]
        f = torch.flip(torch.cummax(torch.flip(g, (-1,)), dim=-1).values, (-1,))
    return f[..., 0]


def minsep_sensitivity(
    matrix: torch.Tensor, min_sep: int = 1, max_participations: int | None = 1
) -> tuple[float, bool]:
    """Sensitivity of a dense lower-triangular ``C`` under b-min-sep participation.

    Returns:
        ``(value, exact)``: exact when ``C`` has at most ``min_sep`` bands, else the
        upper bound of Alg. 4 (Choquette-Choo et al. 2023).
    """
    c = _square(matrix, "minsep_sensitivity")
    n = c.shape[0]
    bands = bandwidth(c)
    if bands <= min_sep or max_participations_of(n, min_sep, max_participations) == 1:
        return banded_sensitivity((c * c).sum(0), min_sep, max_participations), True
    x = (c.T @ c).abs()
    row_best = max_participation_sum(x, min_sep, max_participations)
    total = max_participation_sum(row_best, min_sep, max_participations)
    return math.sqrt(max(float(total), 0.0)), False


def banded_sensitivity(column_norms_squared: torch.Tensor, min_sep: int, max_participations: int | None) -> float:
    """Exact sensitivity of a ``C`` whose participating columns are orthogonal (bands <= min_sep).

    Args:
        column_norms_squared: ``||C[:, i]||^2`` for every step ``i``.
    """
    return math.sqrt(max(float(max_participation_sum(column_norms_squared, min_sep, max_participations)), 0.0))


def toeplitz_sensitivity(
    coefficients: torch.Tensor, n_steps: int, min_sep: int = 1, max_participations: int | None = 1
) -> tuple[float, bool]:
    """Sensitivity of the lower-triangular Toeplitz ``C`` with first column ``coefficients``.

    Returns:
        ``(value, exact)``: exact for non-negative, non-increasing coefficients (and for
        single participation, or at most ``min_sep`` bands); otherwise the value for
        the non-increasing majorant of ``|coefficients|``, an upper bound.

    Example:
        >>> import torch
        >>> toeplitz_sensitivity(torch.tensor([1.0, 0.5]), 4, min_sep=1, max_participations=2)
        (1.8708286933869707, True)
    """
    c = torch.as_tensor(coefficients, dtype=torch.float64)[:n_steps]
    n = int(n_steps)
    k = max_participations_of(n, min_sep, max_participations)
    if k == 1:
        return float(c.norm()), True
    if c.shape[0] <= min_sep:
        full = torch.nn.functional.pad(c, (0, n - c.shape[0])) if c.shape[0] < n else c
        col = torch.flip(torch.cumsum(full * full, 0), (0,))  # ||C[:, i]||^2 = sum_{j < n - i} c_j^2
        return banded_sensitivity(col, min_sep, max_participations), True
    exact = bool((c >= 0).all()) and bool((c[1:] <= c[:-1]).all())
    used = c if exact else _toeplitz.nonincreasing_majorant(c)
    value = _toeplitz.minsep_sensitivity_squared(used, n, min_sep, max_participations)
    return math.sqrt(float(value)), exact


def fixed_epoch_sensitivity(matrix: torch.Tensor, epochs: int) -> float:
    """Sensitivity of ``C`` under fixed-epoch order: ``epochs`` passes of ``n / epochs`` steps.

    An example participates at ``j, j + b, ..., j + (k-1) b`` for one ``j < b``
    (``b = n / epochs``). Returns ``sqrt(max_j sum_{a, c in class j} |X[a, c]|)``.
    """
    c = _square(matrix, "fixed_epoch_sensitivity")
    n = c.shape[0]
    k = check.integer(epochs, "epochs", "fixed_epoch_sensitivity", minimum=1)
    if n % k:
        raise InputValueError(f"fixed_epoch_sensitivity: epochs={k} must divide n_steps={n}.")
    b = n // k
    x = (c.T @ c).abs()
    idx = torch.arange(n).reshape(k, b)  # column j = class j
    sub = x[idx.T[:, :, None], idx.T[:, None, :]]  # (b, k, k)
    return math.sqrt(float(sub.sum((1, 2)).max()))


def bandwidth(matrix: torch.Tensor) -> int:
    """Number of non-zero diagonals of a lower-triangular matrix (1 for diagonal)."""
    n = matrix.shape[0]
    nz = torch.nonzero(matrix)
    if nz.numel() == 0:
        return 1
    return int((nz[:, 0] - nz[:, 1]).max()) + 1 if n else 1


def max_participations_of(n: int, min_sep: int, max_participations: int | None) -> int:
    """Internal alias of :func:`max_participations` without argument checks on n."""
    b = check.integer(min_sep, "min_sep", "max_participations_of", minimum=1)
    most = -(-int(n) // b)
    if max_participations is None:
        return most
    return min(check.integer(max_participations, "max_participations", "max_participations_of", minimum=1), most)


def _square(matrix: torch.Tensor, where: str) -> torch.Tensor:
    if isinstance(matrix, np.ndarray):
        matrix = torch.from_numpy(matrix)
    if not isinstance(matrix, torch.Tensor):
        raise InputTypeError(f"{where}: expected a tensor; got {type(matrix).__name__}.")
    if matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1]:
        raise InputValueError(f"{where}: expected a square matrix; got shape {tuple(matrix.shape)}.")
    return matrix.double()

