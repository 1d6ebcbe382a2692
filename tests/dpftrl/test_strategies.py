"""Strategies: losses (acceptance numbers), structure, closed forms, optimisation, workloads."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from opake_fx import dpftrl
from opake_fx.dpftrl import _toeplitz
from opake_fx.dpftrl.strategies._base import Strategy
from opake_fx.errors import InputTypeError, InputValueError

from .conftest import N


def _generic_per_query(strategy: Strategy, workload: dpftrl.Workload) -> torch.Tensor:
    b = workload.materialize() @ torch.linalg.inv(strategy.materialize())
    return (b * b).sum(1)


# ------------------------------------------------------------- acceptance numbers


@given(n=st.integers(1, 200))
def test_identity_losses_are_n_plus_one_over_two_and_n(n):
    s = dpftrl.identity_strategy(n)
    assert s.expected_error() == pytest.approx((n + 1) / 2, rel=1e-12)
    assert s.expected_error(reduction="max") == pytest.approx(n, rel=1e-12)


def test_closed_form_square_root_at_64_matches_jax_privacy():
    s = dpftrl.bsr_strategy(64, bandwidth=64)
    assert s.expected_error() == pytest.approx(4.9715, abs=5e-5)
    assert s.expected_error(reduction="max") == pytest.approx(5.7066, abs=5e-5)
    # It is the square root: C C = A.
    c = s.materialize()
    torch.testing.assert_close(c @ c, torch.tril(torch.ones(64, 64, dtype=torch.float64)))


def test_optimised_toeplitz_64_bands_reaches_4_75():
    s = dpftrl.band_mf_strategy(64, bands=64)
    assert s.expected_error() <= 4.75
    assert s.expected_error() < dpftrl.bsr_strategy(64, 64).expected_error()


def test_optimised_column_normalized_16_bands_reaches_jax_privacy_value():
    s = dpftrl.band_mf_strategy(64, bands=16, structure="column_normalized")
    assert isinstance(s, dpftrl.BandedStrategy) and s.bands == 16
    assert s.expected_error() <= 5.26
    torch.testing.assert_close(s.column_norms(), torch.ones(64, dtype=torch.float64))
    # At least as good as the Toeplitz optimum it starts from.
    assert s.expected_error() <= dpftrl.band_mf_strategy(64, bands=16).expected_error() + 1e-9


def test_max_error_optimisation_beats_square_root_truncation():
    for bands in (4, 16):
        opt = dpftrl.band_mf_strategy(64, bands=bands, reduction="max")
        assert opt.expected_error(reduction="max") <= dpftrl.bsr_strategy(64, bands).expected_error(reduction="max") + 1e-9


def test_dense_is_at_least_as_good_as_every_structured_strategy():
    dense = dpftrl.dense_strategy(64)
    assert dense.epoch_sensitivity(1) == pytest.approx(1.0, abs=1e-9)
    assert dense.expected_error() <= dpftrl.band_mf_strategy(64, 64).expected_error() + 1e-6
    assert dense.expected_error() == pytest.approx(4.4094, abs=1e-3)


def test_dense_multi_epoch_has_unit_epoch_sensitivity_and_orthogonal_classes():
    s = dpftrl.dense_strategy(32, epochs=4, max_iterations=80)
    x = s.materialize().T @ s.materialize()
    b = 8
    for i in range(32):
        for j in range(32):
            if i != j and i % b == j % b:
                assert abs(float(x[i, j])) < 1e-9
    assert s.epoch_sensitivity(4) == pytest.approx(1.0, abs=1e-9)
    # Beats 8-banded BandMF normalised the same way (its Gram is feasible too).
    band = dpftrl.band_mf_strategy(32, 8)
    band_err = band.expected_error() * band.epoch_sensitivity(4) ** 2 / band.sensitivity() ** 2
    assert s.expected_error() * 1.0 <= band_err * 1.0001 or s.expected_error() <= band_err


def test_blt_is_close_to_the_toeplitz_optimum():
    blt = dpftrl.blt_strategy(64, max_buffers=4)
    full = dpftrl.band_mf_strategy(64, 64).expected_error()
    assert blt.expected_error() <= 1.01 * full
    c = blt.toeplitz_coefficients()
    assert c[0] == 1 and bool((c[1:] > 0).all()) and bool((c[1:] <= c[:-1]).all())


def test_blt_min_sep_objective_uses_the_exact_sensitivity():
    s = dpftrl.blt_strategy(48, max_buffers=2, min_sep=6, max_participations=None, max_iterations=100)
    assert s.sensitivity_is_exact(6, None)
    single = dpftrl.blt_strategy(48, max_buffers=2, max_iterations=100)
    # Each is (weakly) better on the loss it was optimised for.
    assert s.expected_error(min_sep=6, max_participations=None) <= single.expected_error(min_sep=6, max_participations=None) * (1 + 1e-6)


# ------------------------------------------------------------------ structure


def test_every_strategy_is_lower_triangular_and_inverse_matches(small_strategies):
    eye = torch.eye(N, dtype=torch.float64)
    for name, s in small_strategies.items():
        c = s.materialize()
        assert c.shape == (N, N), name
        assert torch.count_nonzero(torch.triu(c, 1)) == 0, name
        torch.testing.assert_close(c @ s.materialize_inverse(), eye, atol=1e-10, rtol=0, msg=name)
        if s.bands is not None:
            assert dpftrl.sensitivity.bandwidth(c) <= s.bands, name


def test_fast_per_query_errors_equal_the_dense_computation(small_strategies):
    workloads = [
        dpftrl.prefix_workload(N),
        dpftrl.momentum_workload(N, 0.9),
        dpftrl.momentum_workload(N, 0.5, learning_rates=np.linspace(1, 0.1, N), decay=0.99),
    ]
    for name, s in small_strategies.items():
        for w in workloads:
            torch.testing.assert_close(s.per_query_error(w), _generic_per_query(s, w), rtol=1e-9, atol=1e-9, msg=name)


def test_row_and_column_norms(small_strategies):
    for name, s in small_strategies.items():
        torch.testing.assert_close(s.column_norms(), s.materialize().norm(dim=0), msg=name)
        torch.testing.assert_close(s.inverse_row_norms(), s.materialize_inverse().norm(dim=1), msg=name)


def test_coefficients_define_the_strategy(small_strategies):
    for name, s in small_strategies.items():
        rebuilt = dpftrl.strategy_from_dict(s.to_dict())
        assert type(rebuilt) is type(s)
        torch.testing.assert_close(rebuilt.materialize(), s.materialize(), msg=name)
        assert rebuilt.label == s.label


def test_optimisation_is_deterministic():
    a = dpftrl.band_mf_strategy(40, 6, structure="column_normalized", max_iterations=20)
    b = dpftrl.band_mf_strategy(40, 6, structure="column_normalized", max_iterations=20)
    assert torch.equal(a.coefficients(), b.coefficients())


# ---------------------------------------------------------------- closed forms


def test_bsr_is_the_banded_square_root_for_momentum_workloads():
    w = dpftrl.momentum_workload(30, 0.8, decay=0.95)
    full = dpftrl.bsr_strategy(30, 30, workload=w).materialize()
    torch.testing.assert_close(full @ full, w.materialize())
    band = dpftrl.bsr_strategy(30, 4, workload=w)
    assert band.bands == 4
    torch.testing.assert_close(band.materialize(), torch.tril(full) - torch.tril(full, -4))


def test_bsr_for_a_schedule_is_the_matrix_square_root():
    w = dpftrl.momentum_workload(20, 0.9, learning_rates=lambda t: 1.0 / math.sqrt(t + 1))
    full = dpftrl.bsr_strategy(20, 20, workload=w).materialize()
    torch.testing.assert_close(full @ full, w.materialize())


def test_bisr_coefficients_are_those_of_sqrt_one_minus_x():
    s = dpftrl.bisr_strategy(64, bandwidth=6)
    expected = [1.0, -0.5, -0.125, -0.0625, -0.0390625, -0.02734375]
    assert s.coefficients().tolist() == pytest.approx(expected)
    full = dpftrl.bisr_strategy(16, 16).materialize_inverse()
    torch.testing.assert_close(full @ full, torch.linalg.inv(dpftrl.prefix_workload(16).materialize()))
    assert s.sensitivity_is_exact(4, None)


def test_bisr_optimisation_lowers_the_min_sep_loss():
    closed = dpftrl.bisr_strategy(48, 4)
    opt = dpftrl.bisr_strategy(48, 4, optimize=True, min_sep=4, max_participations=None, max_iterations=60)
    kw = dict(min_sep=4, max_participations=None)
    assert opt.expected_error(**kw) <= closed.expected_error(**kw)


def test_lambda_cgd():
    s = dpftrl.lambda_cgd_strategy(0.5, n_steps=6)
    torch.testing.assert_close(s.toeplitz_coefficients(), 0.5 ** torch.arange(6, dtype=torch.float64))
    assert s.inverse_noise().memory == 0
    free = dpftrl.lambda_cgd_strategy(0.3)
    assert free.n_steps is None and free.sensitivity(n=10) == pytest.approx(math.sqrt(sum(0.09**k for k in range(10))))
    with pytest.raises(InputValueError, match="pass n="):
        free.sensitivity()
    torch.testing.assert_close(dpftrl.lambda_cgd_strategy(0.0, 5).materialize(), torch.eye(5, dtype=torch.float64))


def test_noise_bands_counts_the_diagonals_of_the_inverse():
    for s in (dpftrl.bisr_strategy(16, bandwidth=6), dpftrl.lambda_cgd_strategy(0.5, n_steps=16)):
        inverse = s.materialize_inverse()
        nonzero = [j for j in range(16) if torch.diagonal(inverse, -j).abs().max() > 0]
        assert s.noise_bands == len(nonzero) == max(nonzero) + 1
    assert dpftrl.lambda_cgd_strategy(0.5, n_steps=16).noise_bands == 2


def test_toeplitz_series_helpers():
    c = torch.tensor([2.0, 0.5, 0.25], dtype=torch.float64)
    g = _toeplitz.series_inverse(c, 200)
    torch.testing.assert_close(_toeplitz.conv(c, g, 200), torch.eye(200, dtype=torch.float64)[0])
    s = _toeplitz.series_sqrt(torch.ones(50, dtype=torch.float64), 50)
    torch.testing.assert_close(_toeplitz.conv(s, s, 50), torch.ones(50, dtype=torch.float64))


# -------------------------------------------------------------------- workloads


def test_momentum_workload_matches_simulated_sgd_with_momentum():
    n, beta, alpha = 12, 0.7, 0.9
    lrs = [0.5 + 0.1 * t for t in range(n)]
    a = dpftrl.momentum_workload(n, beta, learning_rates=lrs, decay=alpha).materialize()
    for r in range(n):
        theta, m = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        out = []
        for t in range(n):
            g = torch.tensor(1.0 if t == r else 0.0, dtype=torch.float64)
            m = beta * m + g
            theta = alpha * theta + lrs[t] * m  # parameters move by -theta
            out.append(float(theta))
        torch.testing.assert_close(a[:, r], torch.tensor(out, dtype=torch.float64))


def test_constant_momentum_workload_is_toeplitz():
    w = dpftrl.momentum_workload(10, 0.6)
    assert w.is_toeplitz
    sched = dpftrl.momentum_workload(10, 0.6, learning_rates=[1.0] * 10)
    torch.testing.assert_close(w.materialize(), sched.materialize())


# ---------------------------------------------------------------------- errors


def test_factories_refuse_bad_arguments():
    with pytest.raises(InputValueError, match="bands=9 exceeds n_steps=8"):
        dpftrl.band_mf_strategy(8, 9)
    with pytest.raises(InputValueError, match="reduction"):
        dpftrl.band_mf_strategy(8, 2, reduction="median")
    with pytest.raises(InputValueError, match="structure"):
        dpftrl.band_mf_strategy(8, 2, structure="dense")
    with pytest.raises(InputValueError, match="n_steps=10 but the strategy has n_steps=8"):
        dpftrl.band_mf_strategy(8, 2, workload=dpftrl.prefix_workload(10))
    with pytest.raises(InputValueError, match="must divide"):
        dpftrl.dense_strategy(10, epochs=3)
    with pytest.raises(InputValueError, match="mean error only"):
        dpftrl.dense_strategy(8, reduction="max")
    with pytest.raises(InputValueError, match="in \\[0, 1\\]"):
        dpftrl.lambda_cgd_strategy(1.5)
    with pytest.raises(InputTypeError):
        dpftrl.band_mf_strategy(8.0, 2)
    with pytest.raises(InputValueError, match="lower-triangular"):
        dpftrl.matrix_workload(torch.ones(3, 3))
    with pytest.raises(InputValueError, match="built for n_steps=8"):
        dpftrl.bsr_strategy(8, 2).materialize(9)


@pytest.mark.slow
def test_strategies_at_1024_reach_their_known_losses():
    """The n = 1024 configurations of benchmarks/mf.py (timings are printed there, not asserted)."""
    toeplitz = dpftrl.band_mf_strategy(1024, 1024)
    assert toeplitz.expected_error() == pytest.approx(9.3427, abs=1e-3)
    assert dpftrl.blt_strategy(1024, 6).expected_error() <= 1.01 * toeplitz.expected_error()
    dense = dpftrl.dense_strategy(1024)
    assert dense.expected_error() == pytest.approx(8.7347, abs=1e-3)
    banded = dpftrl.band_mf_strategy(1024, 16, structure="column_normalized")
    assert banded.expected_error() <= dpftrl.band_mf_strategy(1024, 16).expected_error()
