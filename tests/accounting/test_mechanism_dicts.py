"""The saved form of every mechanism is pinned: keys, their order and nesting, so that
dicts written by earlier versions (checkpoints, JSON logs) still load to the same process."""

from __future__ import annotations

import json

import pytest

import opake_fx.accounting as acc
from opake_fx.accounting.mechanisms import (
    AdaptiveClippingGaussian,
    EpsDelta,
    Gaussian,
    Laplace,
    PoissonSampled,
    SampledWithoutReplacement,
    TruncatedPoissonSampled,
)
from opake_fx.errors import InputValueError

GAUSS = {"type": "gaussian", "noise_multiplier": 1.0}

PINNED = [
    (Gaussian(1.3), {"type": "gaussian", "noise_multiplier": 1.3}),
    (Laplace(0.7), {"type": "laplace", "scale": 0.7}),
    (EpsDelta(1.0, 1e-6), {"type": "eps_delta", "epsilon": 1.0, "delta": 1e-6}),
    (
        AdaptiveClippingGaussian(1.1, 5.0),
        {"type": "adaptive_clipping_gaussian", "noise_multiplier": 1.1, "count_noise_multiplier": 5.0},
    ),
    (PoissonSampled(Gaussian(1.0), 0.01), {"type": "poisson", "inner": GAUSS, "sample_rate": 0.01}),
    (
        TruncatedPoissonSampled(Gaussian(1.0), 0.01, 1000, 15),
        {"type": "truncated_poisson", "inner": GAUSS, "sample_rate": 0.01, "dataset_size": 1000, "max_batch_size": 15},
    ),
    (
        SampledWithoutReplacement(Laplace(2.0), 1000, 10),
        {"type": "sampled_without_replacement", "inner": {"type": "laplace", "scale": 2.0}, "dataset_size": 1000, "batch_size": 10},
    ),
]


@pytest.mark.parametrize(("process", "saved"), PINNED, ids=lambda x: type(x).__name__ if isinstance(x, acc.DpProcess) else "")
def test_each_mechanism_saves_its_fields_in_order_and_loads_back(process, saved):
    data = process.to_dict()
    assert data == saved and list(data) == list(saved)
    assert json.dumps(data) == json.dumps(saved)
    assert acc.process_from_dict(json.loads(json.dumps(saved))) == process


def test_a_missing_field_of_a_sampled_mechanism_is_named():
    with pytest.raises(InputValueError, match="'truncated_poisson' is missing field 'max_batch_size'"):
        acc.process_from_dict({"type": "truncated_poisson", "inner": GAUSS, "sample_rate": 0.1, "dataset_size": 10})
    with pytest.raises(InputValueError, match="'poisson' is missing field 'inner'"):
        acc.process_from_dict({"type": "poisson", "sample_rate": 0.1})
