"""Public constructors check their signatures at call time (``opake_fx.typing.typechecked``).

A wrongly typed argument raises :class:`~opake_fx.errors.InputTypeError` naming the
parameter; ints, numpy scalars and 0-dim integer tensors stay accepted where the body
accepts them; a wrong value of the right type is still an ``InputValueError``; the
per-step functions are left unchecked.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import opake_fx.accounting as acc
import opake_fx.dpftrl as dpftrl
import opake_fx.dpftrl.accounting as mf_acc
import opake_fx.dpsgd.accounting as dpsgd_acc
from opake_fx import scheduling
from opake_fx.dpftrl.sampling import CyclicPoissonSampler, MinSepSampler
from opake_fx.dpsgd.sampling import PoissonSampler, SequentialBatchSampler, TruncatedPoissonSampler
from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.optimizers import adam, sgd
from opake_fx.random import key
from opake_fx.serialization import register_serializer
from opake_fx.transforms import apply_updates, chain, named_chain

STEP = dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), 0.01)
BUDGET = acc.epsilon_budget(3.0, delta=1e-5)

WRONG_TYPES = [
    ("n_steps", lambda: PoissonSampler(100, sample_rate=0.1, n_steps=1.5, key=key(0))),
    ("max_batch_size", lambda: TruncatedPoissonSampler(100, sample_rate=0.1, n_steps=1, key=key(0), max_batch_size="8")),
    ("batch_size", lambda: SequentialBatchSampler(10, batch_size="4")),
    ("partitions", lambda: CyclicPoissonSampler(100, sample_rate=0.1, partitions=2.0, n_steps=4, key=key(0))),
    ("warm_start", lambda: MinSepSampler(100, sample_rate=0.1, min_sep=2, n_steps=4, key=key(0), warm_start=1)),
    ("noise_multiplier", lambda: dpsgd_acc.gaussian("1.0")),
    ("inner", lambda: dpsgd_acc.poisson("gaussian", 0.1)),
    ("dataset_size", lambda: dpsgd_acc.truncated_poisson(dpsgd_acc.gaussian(1.0), 0.1, 1e4, 100)),
    ("delta", lambda: acc.epsilon_budget(3.0, delta="1e-5")),
    ("count", lambda: acc.repeat(STEP, 2.5)),
    ("processes", lambda: acc.compose(STEP, "step")),
    ("spent", lambda: acc.Accountant(BUDGET, spent="nothing")),
    ("param_min", lambda: acc.calibrate(BUDGET, lambda z: dpsgd_acc.gaussian(z), "0.1", 10.0)),
    ("bands", lambda: dpftrl.band_mf_strategy(8, 2.0)),
    ("lambda_", lambda: dpftrl.lambda_cgd_strategy("0.5")),
    ("strategy", lambda: mf_acc.mf_gaussian(1.0, "bsr")),
    ("momentum", lambda: sgd(0.1, momentum="0.9")),
    ("b1", lambda: adam(0.1, b1=None)),
    ("decay_steps", lambda: scheduling.cosine(1.0, 10.0)),
    ("transforms", lambda: chain(sgd(0.1), "adam")),
    ("named", lambda: named_chain(("opt", 0.1))),
    ("cls", lambda: register_serializer(3, to_tree=str, from_tree=lambda t, x: x)),
]


@pytest.mark.parametrize(("param", "make"), WRONG_TYPES, ids=[p for p, _ in WRONG_TYPES])
def test_wrong_type_raises_input_type_error_naming_the_parameter(param, make):
    with pytest.raises(InputTypeError, match=rf"parameter {param}="):
        make()


def test_ints_are_accepted_where_floats_are_hinted():
    assert PoissonSampler(10, sample_rate=1, n_steps=2, key=key(0)).sample_rate == 1.0
    assert dpsgd_acc.gaussian(2) == dpsgd_acc.gaussian(2.0)
    assert dpsgd_acc.poisson(dpsgd_acc.gaussian(1), 1) == dpsgd_acc.gaussian(1.0)
    assert acc.epsilon_budget(3, delta=1e-5).epsilon == 3.0
    assert acc.eps_delta(1, 0).epsilon_at(1e-5) <= 1.0
    assert mf_acc.mf_gaussian(2, dpftrl.identity_strategy(4)) == dpsgd_acc.gaussian(2.0)
    assert dpftrl.lambda_cgd_strategy(1, n_steps=2).materialize().tolist() == [[1.0, 0.0], [1.0, 1.0]]
    sgd(1, momentum=0, weight_decay=0)
    adam(1, b1=0, eps=0, dp_bias_correction=0, dp_bias_correction_gamma=1)
    assert scheduling.cosine(1, 10, alpha=0)(10) == 0.0
    assert scheduling.constant(2)(0) == 2.0
    result = acc.calibrate(BUDGET, lambda t: STEP * t, 1, 10_000)
    assert isinstance(result.param, int)


def test_numpy_scalars_and_integer_tensors_are_accepted():
    s = PoissonSampler(np.int64(100), sample_rate=np.float32(0.25), n_steps=np.int64(3), key=key(0))
    assert (s.dataset_size, s.n_steps) == (100, 3)
    assert SequentialBatchSampler(10, batch_size=torch.tensor(4), n_steps=torch.tensor(2)).n_steps == 2
    assert dpsgd_acc.gaussian(np.float32(1.0)) == dpsgd_acc.gaussian(1.0)
    assert dpsgd_acc.sampled_without_replacement(dpsgd_acc.gaussian(1.0), np.int64(100), np.int32(10)).batch_size == 10
    assert acc.repeat(STEP, np.int64(3)) == STEP * 3
    step = mf_acc.poisson(np.float32(1.0), dpftrl.identity_strategy(np.int64(4)), np.float32(0.5))
    assert step == dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), 0.5) * 4
    assert dpftrl.bsr_strategy(np.int64(8), np.int64(2)).n_steps == 8
    sgd(np.float32(0.1), momentum=np.float64(0.9))
    assert scheduling.linear(np.float32(1.0), 0, np.int64(4))(2) == 0.5


def test_a_wrong_value_of_the_right_type_is_still_a_value_error():
    with pytest.raises(InputValueError, match="reduction"):
        dpftrl.band_mf_strategy(8, 2, reduction="median")
    with pytest.raises(InputValueError, match="'auto'"):
        adam(0.1, dp_bias_correction="yes")
    with pytest.raises(InputValueError, match="sample_rate"):
        PoissonSampler(10, sample_rate=1.5, n_steps=1, key=key(0))
    # bools pass the signature (bool is an int) and are refused by the body's checks
    with pytest.raises(InputTypeError, match="real number"):
        dpsgd_acc.gaussian(True)
    with pytest.raises(InputTypeError, match="bool"):
        PoissonSampler(10, sample_rate=0.1, n_steps=True, key=key(0))


def test_per_step_functions_are_not_wrapped():
    opt = sgd(0.1)
    for fn in (acc.Accountant.step, acc.DpProcess.epsilon_at, apply_updates, opt.update):
        assert not hasattr(fn, "__wrapped__"), fn
    for fn in (acc.compose, acc.repeat, sgd, PoissonSampler.__init__):
        assert hasattr(fn, "__wrapped__"), fn


def test_a_wrong_type_error_says_how_to_fix_it():
    from opake_fx.scheduling import with_warmup

    with pytest.raises(InputTypeError, match=r"parameter schedule=0\.1 .*wrap a number as constant\(value\)"):
        with_warmup(0.1, 10)
    with pytest.raises(InputTypeError, match=r"parameter noise_multiplier='1' .*opake_fx\.accounting\.calibrate"):
        dpsgd_acc.gaussian("1")
