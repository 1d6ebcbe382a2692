"""Bad inputs to the clipping functions get clear OpakeErrors, not raw torch or Python errors."""

from __future__ import annotations

import math

import pytest
import torch

from opake_fx.dpsgd.clipping import adaptive_clipped_grad, auto_clipped_grad, clipped_grad
from opake_fx.errors import InputTypeError, InputValueError, OpakeError
from opake_fx.random import key


def _loss(p, x):
    return ((x - p) ** 2).sum()


def _adaptive(**kw):
    args = dict(initial_clipping_norm=1.0, count_noise_multiplier=1.0, key=key(0), expected_batch_size=4)
    args.update(kw)
    return adaptive_clipped_grad(_loss, **args)


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"learning_rate": "x"}, InputTypeError, "learning_rate must be a real number"),
        ({"learning_rate": math.nan}, InputValueError, "learning_rate must be finite and > 0; got NaN"),
        ({"learning_rate": 0.0}, InputValueError, "learning_rate must be finite and > 0"),
        ({"target_quantile": "half"}, InputTypeError, "target_quantile must be a real number"),
        ({"target_quantile": 1.0}, InputValueError, r"target_quantile must be in \(0, 1\)"),
        ({"count_noise_multiplier": None}, InputTypeError, "count_noise_multiplier must be a real number"),
        ({"expected_batch_size": math.inf}, InputValueError, "expected_batch_size must be finite and > 0"),
        ({"expected_batch_size": 0}, InputValueError, "expected_batch_size must be finite and > 0"),
        ({"expected_batch_size": "64"}, InputTypeError, "expected_batch_size must be a real number"),
    ],
)
def test_adaptive_clipping_hyperparameters_are_checked(kw, error, match):
    with pytest.raises(error, match=match):
        _adaptive(**kw)


@pytest.mark.parametrize(
    ("make", "state_name"),
    [
        (lambda: clipped_grad(_loss, clipping_norm=1.0), "FixedClipState"),
        (lambda: auto_clipped_grad(_loss, clipping_norm=1.0), "FixedClipState"),
        (lambda: _adaptive(), "AdaptiveClipState"),
    ],
    ids=["fixed", "auto", "adaptive"],
)
def test_grad_fn_without_its_state_says_what_to_pass(make, state_name):
    grad_fn, state = make()
    x = torch.ones(4)
    for bad in (None, 3, {"step": 0}):
        with pytest.raises(InputTypeError, match=f"needs state=, the {state_name}") as info:
            grad_fn(torch.tensor(0.0), x, state=bad)
        assert isinstance(info.value, OpakeError)
    with pytest.raises(InputTypeError, match="got None"):
        grad_fn(torch.tensor(0.0), x)  # state left out
    out, new_state = grad_fn(torch.tensor(0.0), x, state=state)  # the right state still works
    assert new_state.step == 1 and out.max_norm == pytest.approx(1.0)
