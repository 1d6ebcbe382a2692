"""Our engines against dp_accounting (the oracle), the reference JSON, and exact values.

The default suite holds a handful of live oracle comparisons (dp_accounting's PLD costs
up to a few seconds per case); the full grid is ``@pytest.mark.slow``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

import opake_fx.accounting as acc
import opake_fx.dpsgd.accounting as dpsgd_acc
from opake_fx.accounting import _curves

CASES = json.loads((Path(__file__).parents[1] / "data" / "accounting.json").read_text())["cases"]
DELTAS = (1e-3, 1e-5, 1e-8)
PLD_RTOL = 1e-3  # required agreement with dp_accounting's PLD
RDP_RTOL = 1e-6  # required agreement with dp_accounting's RDP accountant


def _event(q: float, sigma: float) -> dp_accounting.DpEvent:
    g = dp_accounting.GaussianDpEvent(sigma)
    return g if q == 1.0 else dp_accounting.PoissonSampledDpEvent(q, g)


def dp_pld_epsilons(event: dp_accounting.DpEvent, steps: int, deltas=DELTAS) -> list[float]:
    oracle = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    oracle.compose(event, steps)
    return [oracle.get_epsilon(d) for d in deltas]


def dp_rdp_epsilon(event: dp_accounting.DpEvent, steps: int, delta: float) -> float:
    oracle = rdp_privacy_accountant.RdpAccountant()
    oracle.compose(event, steps)
    return oracle.get_epsilon(delta)


def assert_close(ours: float, ref: float, rtol: float, what: str) -> None:
    assert abs(ours - ref) <= rtol * max(abs(ref), 1e-9) + 1e-12, f"{what}: ours={ours!r} oracle={ref!r}"


def exact_gaussian_epsilon(sigma: float, steps: int, delta: float) -> float:
    """Exact epsilon of ``steps`` Gaussian releases: one Gaussian with mu = sqrt(steps)/sigma."""
    return _curves.gaussian_epsilon(math.sqrt(steps) / sigma, delta)


# ------------------------------------------------------------ reference JSON


@pytest.mark.parametrize("case", [c for c in CASES if "eps_pld" in c], ids=lambda c: f"{c.get('tag', c['mechanism'])}")
def test_reference_json_pld(case):
    q = case.get("q", 1.0)
    process = dpsgd_acc.poisson(dpsgd_acc.gaussian(case["sigma"]), q) * case["steps"]
    ours = process.epsilon_at(case["delta"])
    assert_close(ours, case["eps_pld"], PLD_RTOL, "default engine")
    discretised = process.pld().epsilon_at(case["delta"])  # the PLD path even for Gaussians
    assert_close(discretised, case["eps_pld"], PLD_RTOL, "discretised PLD")
    if "eps_exact_analytic" in case:
        exact = case["eps_exact_analytic"]
        assert ours >= exact * (1 - 1e-12)
        assert discretised >= exact * (1 - 1e-12)


@pytest.mark.parametrize("case", [c for c in CASES if "eps_rdp" in c], ids=lambda c: f"{c.get('tag', c['mechanism'])}")
def test_reference_json_rdp(case):
    q = case.get("q", 1.0)
    process = dpsgd_acc.poisson(dpsgd_acc.gaussian(case["sigma"]), q) * case["steps"]
    assert_close(process.epsilon_at(case["delta"], accountant="rdp"), case["eps_rdp"], RDP_RTOL, "rdp")


def test_reference_json_calibration():
    case = next(c for c in CASES if c.get("tag") == "seed_calibration")
    steps, q = case["steps"], case["q"]
    for accountant, ref in (("pld", case["sigma_calibrated_pld"]), ("rdp", case["sigma_calibrated_rdp"])):
        budget = acc.epsilon_budget(case["target_eps"], delta=case["delta"], accountant=accountant)
        result = acc.calibrate(budget, lambda nm: dpsgd_acc.poisson(dpsgd_acc.gaussian(nm), q) * steps, 0.1, 10.0)
        assert result.converged
        assert result.achieved <= case["target_eps"]
        assert abs(result.param - ref) < 1e-3


# --------------------------------------------------- live oracle: a handful

HANDFUL = [  # (q, sigma, steps): cheap for dp_accounting, spread over the regimes
    (0.01, 1.0, 100),
    (1e-4, 1.0, 100_000),
    (0.1, 2.0, 10),
    (1.0, 3.0, 100),
]


@pytest.mark.parametrize("q,sigma,steps", HANDFUL)
def test_pld_matches_dp_accounting(q, sigma, steps):
    refs = dp_pld_epsilons(_event(q, sigma), steps)
    process = dpsgd_acc.poisson(dpsgd_acc.gaussian(sigma), q) * steps
    for delta, ref in zip(DELTAS, refs):
        assert_close(process.epsilon_at(delta), ref, PLD_RTOL, f"delta={delta}")
        assert_close(process.pld().epsilon_at(delta), ref, PLD_RTOL, f"pld path, delta={delta}")


@pytest.mark.parametrize("q,sigma,steps", [(0.01, 1.0, 1000), (1e-3, 0.6, 10_000), (1.0, 2.0, 10)])
def test_rdp_matches_dp_accounting(q, sigma, steps):
    process = dpsgd_acc.poisson(dpsgd_acc.gaussian(sigma), q) * steps
    for delta in DELTAS:
        assert_close(process.epsilon_at(delta, accountant="rdp"), dp_rdp_epsilon(_event(q, sigma), steps, delta), RDP_RTOL, "rdp")


def test_rdp_curve_matches_dp_accounting_at_every_order():
    oracle = rdp_privacy_accountant.RdpAccountant()
    oracle.compose(_event(0.02, 0.8), 1)
    ours = (dpsgd_acc.poisson(dpsgd_acc.gaussian(0.8), 0.02)).rdp()
    np.testing.assert_allclose(ours, oracle._rdp, rtol=1e-9)
    assert tuple(acc.DEFAULT_RDP_ORDERS) == tuple(rdp_privacy_accountant.DEFAULT_RDP_ORDERS)


def test_laplace_matches_dp_accounting():
    oracle = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    oracle.compose(dp_accounting.LaplaceDpEvent(2.0), 20)
    process = dpsgd_acc.laplace(2.0) * 20
    for delta in DELTAS:
        assert_close(process.epsilon_at(delta), oracle.get_epsilon(delta), PLD_RTOL, "laplace")
    rdp_oracle = rdp_privacy_accountant.RdpAccountant()
    rdp_oracle.compose(dp_accounting.LaplaceDpEvent(2.0), 20)
    assert_close(process.epsilon_at(1e-5, accountant="rdp"), rdp_oracle.get_epsilon(1e-5), RDP_RTOL, "laplace rdp")


def test_subsampled_laplace_matches_dp_accounting():
    oracle = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    oracle.compose(dp_accounting.PoissonSampledDpEvent(0.05, dp_accounting.LaplaceDpEvent(0.5)), 50)
    process = dpsgd_acc.poisson(dpsgd_acc.laplace(0.5), 0.05) * 50
    for delta in DELTAS:
        assert_close(process.epsilon_at(delta), oracle.get_epsilon(delta), PLD_RTOL, "poisson laplace")


def test_truncated_poisson_matches_dp_accounting():
    n, q, cap, sigma, steps = 10_000, 0.01, 110, 1.0, 50
    oracle = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    oracle.compose(dp_accounting.TruncatedSubsampledGaussianDpEvent(n, q, cap, sigma), steps)
    process = dpsgd_acc.truncated_poisson(dpsgd_acc.gaussian(sigma), q, dataset_size=n, max_batch_size=cap) * steps
    plain = (dpsgd_acc.poisson(dpsgd_acc.gaussian(sigma), q) * steps).epsilon_at(1e-5)
    for delta in DELTAS:
        assert_close(process.epsilon_at(delta), oracle.get_epsilon(delta), PLD_RTOL, "truncated poisson")
    assert process.epsilon_at(1e-5) > plain


def test_eps_delta_composition_matches_dp_accounting():
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    ref = pld_lib.from_privacy_parameters(dp_accounting.pld.common.DifferentialPrivacyParameters(0.5, 1e-7))
    ref = ref.self_compose(10).compose(
        pld_lib.from_gaussian_mechanism(2.0, sampling_prob=0.05).self_compose(30)
    )
    ours = acc.eps_delta(0.5, 1e-7) * 10 | dpsgd_acc.poisson(dpsgd_acc.gaussian(2.0), 0.05) * 30
    for delta in (1e-3, 1e-5):
        assert_close(ours.epsilon_at(delta), ref.get_epsilon_for_delta(delta), PLD_RTOL, "eps_delta | poisson")


# ------------------------------------------------------ exactness (q = 1)


@pytest.mark.parametrize("sigma,steps", [(0.5, 1), (1.0, 10), (2.0, 100), (5.0, 1000), (10.0, 100_000), (0.3, 30)])
def test_discretised_pld_never_below_exact_gaussian(sigma, steps):
    pld = (dpsgd_acc.gaussian(sigma) * steps).pld()
    for delta in DELTAS:
        exact = exact_gaussian_epsilon(sigma, steps, delta)
        ours = pld.epsilon_at(delta)
        assert ours >= exact * (1 - 1e-12), (ours, exact)
        assert ours <= exact * (1 + 1e-3) + 1e-4
    for eps in (0.0, 0.5, 2.0):
        exact_delta = float(_curves.gaussian_delta(np.array([eps]), math.sqrt(steps) / sigma)[0])
        assert pld.delta_at(eps) >= exact_delta * (1 - 1e-9)


# --------------------------------------------------------------- full grid

GRID_Q = (1e-4, 1e-3, 0.01, 0.1, 1.0)
GRID_SIGMA = (0.3, 0.5, 1.0, 2.0, 10.0)
GRID_STEPS = (1, 100, 10_000, 100_000)


def _grid():
    for q in GRID_Q:
        for sigma in GRID_SIGMA:
            for steps in GRID_STEPS:
                if not (q >= 0.1 and sigma <= 0.5 and steps > 100):  # epsilons in the thousands
                    yield q, sigma, steps


@pytest.mark.slow
@pytest.mark.parametrize("q,sigma,steps", list(_grid()))
def test_pld_grid_matches_dp_accounting(q, sigma, steps):
    process = dpsgd_acc.poisson(dpsgd_acc.gaussian(sigma), q) * steps
    if process.epsilon_at(1e-8) > 200:
        pytest.skip("dp_accounting cannot hold the grid for epsilons in the hundreds")
    refs = dp_pld_epsilons(_event(q, sigma), steps)
    pld = process.pld()
    for delta, ref in zip(DELTAS, refs):
        assert_close(process.epsilon_at(delta), ref, PLD_RTOL, f"delta={delta}")
        assert_close(pld.epsilon_at(delta), ref, PLD_RTOL, f"pld path, delta={delta}")
        if q == 1.0:
            assert pld.epsilon_at(delta) >= exact_gaussian_epsilon(sigma, steps, delta) * (1 - 1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("q", GRID_Q)
@pytest.mark.parametrize("sigma", GRID_SIGMA)
def test_rdp_grid_matches_dp_accounting(q, sigma):
    for steps in GRID_STEPS:
        process = dpsgd_acc.poisson(dpsgd_acc.gaussian(sigma), q) * steps
        for delta in DELTAS:
            ref = dp_rdp_epsilon(_event(q, sigma), steps, delta)
            assert_close(process.epsilon_at(delta, accountant="rdp"), ref, RDP_RTOL, f"T={steps} delta={delta}")
