"""DpProcess values: algebra, normalisation, hashing, serialisation, validation."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import opake_fx.accounting as acc
import opake_fx.dpsgd.accounting as dpsgd_acc
from opake_fx.errors import InputTypeError, InputValueError, OpakeError

STEP = dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), 0.01)
OTHER = dpsgd_acc.poisson(dpsgd_acc.gaussian(2.0), 0.02)


def test_values_are_immutable_and_hashable():
    assert dpsgd_acc.gaussian(1) == dpsgd_acc.gaussian(1.0)
    assert hash(dpsgd_acc.gaussian(1)) == hash(dpsgd_acc.gaussian(1.0))
    assert len({STEP, dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), 0.01), OTHER}) == 2
    with pytest.raises(AttributeError):
        STEP.sample_rate = 0.5  # type: ignore[misc]


def test_repeat_and_compose_normalise():
    assert STEP * 3 == 3 * STEP == acc.repeat(STEP, 3)
    assert (STEP * 2) | STEP == STEP * 3
    assert (STEP * 2) * 5 == STEP * 10
    assert STEP | OTHER == OTHER | STEP == acc.compose(OTHER, STEP)
    assert (STEP | OTHER) * 2 == (STEP * 2) | (OTHER * 2)
    assert STEP * 1 == STEP
    assert isinstance(STEP * 4, acc.Repeated) and (STEP * 4).count == 4
    assert isinstance(STEP | OTHER, acc.Composed)


def test_identity_and_nonprivate():
    assert STEP | acc.identity() == STEP
    assert acc.identity() * 7 == acc.identity()
    assert acc.compose() == acc.identity()
    assert acc.identity().epsilon_at(1e-5) == 0.0
    assert acc.identity().delta_at(0.0) == 0.0
    assert acc.identity().advantage() == 0.0
    assert acc.identity().beta_at(0.1) == pytest.approx(0.9)
    assert acc.identity().epsilon_at(1e-5, accountant="rdp") == 0.0
    np_ = acc.nonprivate()
    assert np_.epsilon_at(1e-5) == math.inf
    assert np_.epsilon_at(1e-5, accountant="rdp") == math.inf
    assert np_.delta_at(10.0) == 1.0
    assert np_.beta_at(0.1) == 0.0
    assert STEP | np_ == np_
    assert dpsgd_acc.poisson(np_, 0.1) == np_
    assert dpsgd_acc.poisson(acc.identity(), 0.1) == acc.identity()


def test_poisson_special_rates():
    g = dpsgd_acc.gaussian(1.0)
    assert dpsgd_acc.poisson(g, 1.0) == g  # no subsampling
    assert dpsgd_acc.poisson(g, 0.0) == acc.identity()  # never sampled
    assert acc.eps_delta(0.0, 0.0) == acc.identity()


def test_composition_matches_manual_product():
    composed = (STEP * 300) | (OTHER * 200)
    assert composed.epsilon_at(1e-5) > (STEP * 300).epsilon_at(1e-5)
    assert composed.epsilon_at(1e-5) > (OTHER * 200).epsilon_at(1e-5)
    # RDP composes additively
    np.testing.assert_allclose(composed.rdp(), 300 * STEP.rdp() + 200 * OTHER.rdp(), rtol=1e-12)


def test_gaussian_compositions_are_exact():
    # k Gaussian releases of noise z are one Gaussian release of noise z / sqrt(k)
    assert (dpsgd_acc.gaussian(2.0) * 4).epsilon_at(1e-5) == pytest.approx(dpsgd_acc.gaussian(1.0).epsilon_at(1e-5), rel=1e-12)
    mixed = dpsgd_acc.gaussian(1.0) | dpsgd_acc.gaussian(1.0)
    assert mixed.epsilon_at(1e-5) == pytest.approx((dpsgd_acc.gaussian(2**-0.5)).epsilon_at(1e-5), rel=1e-12)


@pytest.mark.parametrize(
    "process",
    [
        STEP,
        STEP * 10,
        STEP | OTHER * 3,
        acc.identity(),
        acc.nonprivate(),
        acc.eps_delta(0.5, 1e-6),
        dpsgd_acc.laplace(2.0) * 3,
        dpsgd_acc.poisson(dpsgd_acc.laplace(1.0), 0.1),
        dpsgd_acc.adaptive_clipping_gaussian(1.0, 5.0),
        dpsgd_acc.truncated_poisson(dpsgd_acc.gaussian(1.0), 0.01, 10_000, 120) * 5,
        dpsgd_acc.sampled_without_replacement(dpsgd_acc.gaussian(1.0), 1000, 10),
    ],
    ids=repr,
)
def test_to_dict_round_trips_through_json(process):
    data = json.loads(json.dumps(process.to_dict()))
    back = acc.process_from_dict(data)
    assert back == process
    assert acc.DpProcess.from_dict(data) == process


def test_from_dict_errors():
    with pytest.raises(InputValueError, match="unknown process type"):
        acc.process_from_dict({"type": "nope"})
    with pytest.raises(InputTypeError):
        acc.process_from_dict("gaussian")  # type: ignore[arg-type]
    with pytest.raises(InputValueError, match="missing field"):
        acc.process_from_dict({"type": "gaussian"})


@pytest.mark.parametrize(
    "make, exc, words",
    [
        (lambda: dpsgd_acc.gaussian(0.0), InputValueError, "noise_multiplier"),
        (lambda: dpsgd_acc.gaussian(-1.0), InputValueError, "noise_multiplier"),
        (lambda: dpsgd_acc.gaussian(float("nan")), InputValueError, "NaN"),
        (lambda: dpsgd_acc.gaussian("1"), InputTypeError, "noise_multiplier"),
        (lambda: dpsgd_acc.laplace(0.0), InputValueError, "scale"),
        (lambda: dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), 1.5), InputValueError, "sample_rate"),
        (lambda: dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), -0.1), InputValueError, "sample_rate"),
        (lambda: dpsgd_acc.poisson(STEP, 0.1), InputValueError, "understate"),
        (lambda: dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0) * 10, 0.1), InputValueError, "understate"),
        (lambda: dpsgd_acc.poisson(STEP | OTHER, 0.1), InputValueError, "understate"),
        (lambda: dpsgd_acc.poisson("gaussian", 0.1), InputTypeError, "DpProcess"),
        (lambda: STEP * 0, InputValueError, ">= 1"),
        (lambda: STEP * 2.0, InputTypeError, "int"),
        (lambda: STEP * True, InputTypeError, "int"),
        (lambda: acc.eps_delta(-1.0), InputValueError, "epsilon"),
        (lambda: acc.eps_delta(1.0, 1.0), InputValueError, "delta"),
        (lambda: dpsgd_acc.truncated_poisson(dpsgd_acc.laplace(1.0), 0.1, 100, 10), InputValueError, "gaussian"),
        (lambda: dpsgd_acc.truncated_poisson(dpsgd_acc.gaussian(1.0), 0.1, 0, 10), InputValueError, "dataset_size"),
        (lambda: dpsgd_acc.sampled_without_replacement(dpsgd_acc.gaussian(1.0), 10, 11), InputValueError, "exceed"),
        (lambda: dpsgd_acc.adaptive_clipping_gaussian(1.0, 0.0), InputValueError, "count"),
        (lambda: dpsgd_acc.adaptive_clipping_noise_multiplier(1.0, 0.4), InputValueError, "count noise"),
        (lambda: STEP.epsilon_at(0.0), InputValueError, "delta"),
        (lambda: STEP.epsilon_at(1.0), InputValueError, "delta"),
        (lambda: STEP.epsilon_at(1e-5, accountant="moments"), InputValueError, "accountant"),
        (lambda: STEP.epsilon_at(1e-5, discretization=0.0), InputValueError, "discretization"),
        (lambda: STEP.delta_at(-0.1), InputValueError, "epsilon"),
        (lambda: STEP.beta_at(1.5), InputValueError, "alpha"),
        (lambda: STEP | 3, TypeError, None),
    ],
)
def test_bad_inputs_raise_clear_errors(make, exc, words):
    with pytest.raises(exc, match=words):
        make()


def test_errors_are_opake_errors():
    with pytest.raises(OpakeError):
        dpsgd_acc.gaussian(0.0)
    with pytest.raises(ValueError):  # builtin mixed in
        dpsgd_acc.gaussian(0.0)


def test_neighbouring_relations_cannot_be_mixed():
    swor = dpsgd_acc.sampled_without_replacement(dpsgd_acc.gaussian(1.0), 1000, 10)
    assert swor.neighboring_relation == acc.REPLACE_ONE
    assert STEP.neighboring_relation == acc.ADD_OR_REMOVE_ONE
    assert acc.eps_delta(1.0).neighboring_relation is None
    assert (swor | acc.eps_delta(1.0)).neighboring_relation == acc.REPLACE_ONE
    with pytest.raises(InputValueError, match="neighbouring relations"):
        _ = swor | STEP


def test_adaptive_clipping_effective_noise():
    z, sb = 1.2, 8.0
    p = dpsgd_acc.adaptive_clipping_gaussian(z, sb)
    expected = (z**-2 + (2 * sb) ** -2) ** -0.5
    assert p.effective_noise_multiplier == pytest.approx(expected)
    assert p.epsilon_at(1e-5) == pytest.approx(dpsgd_acc.gaussian(expected).epsilon_at(1e-5), rel=1e-12)
    q = 0.01
    wrapped = dpsgd_acc.poisson(p, q) * 100
    assert wrapped.epsilon_at(1e-5) == pytest.approx((dpsgd_acc.poisson(dpsgd_acc.gaussian(expected), q) * 100).epsilon_at(1e-5), rel=1e-9)
    z_grad = dpsgd_acc.adaptive_clipping_noise_multiplier(1.0, sb)
    assert dpsgd_acc.adaptive_clipping_gaussian(z_grad, sb).effective_noise_multiplier == pytest.approx(1.0)
    assert z_grad > 1.0


def test_rdp_unsupported_mechanisms_point_to_pld():
    for p in (
        dpsgd_acc.truncated_poisson(dpsgd_acc.gaussian(1.0), 0.01, 10_000, 110),
        dpsgd_acc.sampled_without_replacement(dpsgd_acc.gaussian(1.0), 1000, 10),
        dpsgd_acc.poisson(dpsgd_acc.laplace(1.0), 0.1),
        acc.eps_delta(1.0, 1e-6),
    ):
        with pytest.raises(InputValueError, match="pld"):
            p.epsilon_at(1e-5, accountant="rdp")
    # pure DP composes in RDP as randomized response (the order grid stops at 1024)
    eps = acc.eps_delta(0.5).epsilon_at(1e-5, accountant="rdp")
    assert isinstance(eps, float) and 0.4 < eps <= 0.5 + math.log(1e5) / 1023


def test_repr_is_readable():
    assert repr(STEP * 3) == "PoissonSampled(inner=Gaussian(noise_multiplier=1.0), sample_rate=0.01) * 3"
    assert "identity()" == repr(acc.identity())


def test_unchecked_compose_and_repeat_match_the_checked_ones():
    from opake_fx.accounting.process import compose_unchecked, repeat_unchecked

    assert repeat_unchecked(STEP, 3) == acc.repeat(STEP, 3)
    assert compose_unchecked(STEP, OTHER) == acc.compose(STEP, OTHER)
    assert compose_unchecked() == acc.identity()
    with pytest.raises(InputTypeError, match="expected a DpProcess"):
        repeat_unchecked("step", 3)  # type: ignore[arg-type]
    with pytest.raises(InputTypeError, match="expected DpProcess values"):
        compose_unchecked(STEP, 1.0)  # type: ignore[arg-type]
    with pytest.raises(InputValueError):
        repeat_unchecked(STEP, 0)


def test_subsampling_helpers_refuse_multi_step_inners_and_shortcut_trivial_ones():
    from opake_fx.accounting.mechanisms import check_step, subsample_trivial

    check_step(dpsgd_acc.gaussian(1.0), "poisson")  # one step: accepted
    with pytest.raises(InputValueError, match="one un-subsampled step"):
        check_step(dpsgd_acc.gaussian(1.0) * 2, "poisson")
    with pytest.raises(InputTypeError, match="inner must be a DpProcess"):
        check_step(1.0, "poisson")
    assert subsample_trivial(dpsgd_acc.gaussian(1.0), 0.0) == acc.identity()
    assert subsample_trivial(acc.identity(), 0.5) == acc.identity()
    assert subsample_trivial(acc.nonprivate(), 0.5) == acc.nonprivate()
    assert subsample_trivial(dpsgd_acc.gaussian(1.0), 0.5) is None
