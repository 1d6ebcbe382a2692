"""Sensitivity under b-min-sep participation against brute force on small n."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opake_fx import dpftrl
from opake_fx.dpftrl import sensitivity as sens
from opake_fx.dpftrl import _toeplitz
from opake_fx.errors import InputValueError


def _patterns(n: int, b: int, k: int) -> list[tuple[int, ...]]:
    """Every participation set with at most k steps, pairwise at least b apart."""
    out: list[tuple[int, ...]] = []

    def rec(start: int, chosen: tuple[int, ...]) -> None:
        if chosen:
            out.append(chosen)
        if len(chosen) == k:
            return
        for i in range(start, n):
            rec(i + b, chosen + (i,))

    rec(0, ())
    return out


def brute_force(c: torch.Tensor, b: int, k: int | None) -> float:
    """max over patterns pi and signs s of s^T X_pi s (scalar contributions of norm 1)."""
    n = c.shape[0]
    k = -(-n // b) if k is None else k
    x = (c.T @ c).double()
    best = 0.0
    for pi in _patterns(n, b, k):
        sub = x[list(pi)][:, list(pi)]
        for signs in itertools.product((1.0, -1.0), repeat=len(pi) - 1):
            s = torch.tensor((1.0, *signs), dtype=torch.float64)
            best = max(best, float(s @ sub @ s))
    return math.sqrt(best)


CASES = [(1, 1), (1, 3), (2, None), (3, 2), (3, None), (5, None)]


@pytest.mark.parametrize("b,k", CASES)
def test_exact_cases_equal_brute_force_and_bounds_dominate(b, k):
    n = 9
    strategies = {
        "identity": dpftrl.identity_strategy(n),
        "bsr3": dpftrl.bsr_strategy(n, 3),
        "bsr_full": dpftrl.bsr_strategy(n, n),
        "band_mf": dpftrl.band_mf_strategy(n, 3, max_iterations=20),
        "column_normalized": dpftrl.band_mf_strategy(n, 2, structure="column_normalized", max_iterations=20),
        "bisr": dpftrl.bisr_strategy(n, 3),
        "lambda_cgd": dpftrl.lambda_cgd_strategy(0.6, n),
        "blt": dpftrl.blt_strategy(n, max_buffers=2, max_iterations=40),
        "dense": dpftrl.dense_strategy(n, max_iterations=30),
    }
    for name, s in strategies.items():
        value, exact = s.sensitivity(b, k), s.sensitivity_is_exact(b, k)
        truth = brute_force(s.materialize(), b, k)
        assert value >= truth - 1e-9, (name, value, truth)
        if exact:
            assert value == pytest.approx(truth, rel=1e-9, abs=1e-12), name
        if s.bands is not None and s.bands <= b:
            assert exact, name


def test_banded_strategies_are_exact_when_bands_fit_the_separation():
    s = dpftrl.band_mf_strategy(12, 4, structure="column_normalized", max_iterations=20)
    assert s.sensitivity_is_exact(4, None)
    assert s.sensitivity(4, None) == pytest.approx(math.sqrt(3))  # 3 unit columns
    assert s.sensitivity(4, 2) == pytest.approx(math.sqrt(2))
    assert not s.sensitivity_is_exact(2, None)


def test_general_upper_bound_dominates_brute_force_on_signed_matrices():
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        c = torch.tril(torch.randn(8, 8, generator=g, dtype=torch.float64))
        c.diagonal().add_(3.0)
        value, exact = sens.minsep_sensitivity(c, 2, None)
        assert value >= brute_force(c, 2, None) - 1e-9
        assert not exact


def test_toeplitz_closed_form_matches_dense_and_majorant_bounds():
    c = torch.tensor([1.0, 0.8, 0.5, 0.2], dtype=torch.float64)
    n = 10
    for b, k in [(1, None), (2, 3), (3, None)]:
        value, exact = sens.toeplitz_sensitivity(c, n, b, k)
        assert exact
        assert value == pytest.approx(brute_force(_toeplitz.materialize(c, n), b, k))
    wiggly = torch.tensor([1.0, 0.2, 0.6, -0.3], dtype=torch.float64)
    value, exact = sens.toeplitz_sensitivity(wiggly, n, 2, None)
    assert not exact and value >= brute_force(_toeplitz.materialize(wiggly, n), 2, None)


@settings(max_examples=40)
@given(
    values=st.lists(st.floats(-5, 5, allow_nan=False), min_size=1, max_size=9),
    b=st.integers(1, 4),
    k=st.one_of(st.none(), st.integers(1, 4)),
)
def test_participation_dynamic_program_equals_enumeration(values, b, k):
    x = torch.tensor(values, dtype=torch.float64)
    n = len(values)
    kk = -(-n // b) if k is None else k
    best = max([0.0] + [sum(values[i] for i in pi) for pi in _patterns(n, b, kk)])
    assert float(sens.max_participation_sum(x, b, k)) == pytest.approx(best, abs=1e-12)


def test_fixed_epoch_sensitivity_equals_enumeration_of_epoch_classes():
    s = dpftrl.dense_strategy(12, epochs=3, max_iterations=40)
    c = s.materialize()
    x = c.T @ c
    best = 0.0
    for j in range(4):
        idx = [j, j + 4, j + 8]
        for signs in itertools.product((1.0, -1.0), repeat=3):
            v = torch.tensor(signs, dtype=torch.float64)
            best = max(best, float(v @ x[idx][:, idx] @ v))
    assert s.epoch_sensitivity(3) == pytest.approx(math.sqrt(best), rel=1e-9)
    assert s.epoch_sensitivity(3) <= s.sensitivity(4, 3) + 1e-12


def test_sensitivity_arguments_are_checked():
    s = dpftrl.identity_strategy(5)
    with pytest.raises(InputValueError):
        s.sensitivity(0)
    with pytest.raises(InputValueError, match="must divide"):
        s.epoch_sensitivity(2)
    assert sens.max_participations(10, 4) == 3 and sens.max_participations(10, 4, 2) == 2
