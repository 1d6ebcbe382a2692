"""Tests of opake_fx.scheduling against closed forms and optax conventions."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.scheduling import constant, cosine, inverse_sqrt, linear, with_warmup

steps = st.integers(0, 10**7)
values = st.floats(-1e3, 1e3, allow_nan=False)


@given(v=values, t=steps)
def test_constant(v, t):
    assert constant(v)(t) == v


@given(a=values, b=values, n=st.integers(1, 10**6), t=steps)
def test_linear_closed_form(a, b, n, t):
    got = linear(a, b, n)(t)
    want = a + (b - a) * min(t, n) / n
    assert got == pytest.approx(want, rel=1e-12, abs=1e-12)
    if t >= n:
        assert got == pytest.approx(b, rel=1e-12, abs=1e-9)


def test_linear_values():
    s = linear(0.1, 0.0, transition_steps=10)
    assert s(0) == 0.1
    assert s(5) == pytest.approx(0.05)
    assert s(10) == s(1000) == 0.0


@given(v=st.floats(1e-6, 10.0), n=st.integers(1, 10**6), alpha=st.floats(0.0, 1.0), t=steps)
def test_cosine_closed_form_and_bounds(v, n, alpha, t):
    s = cosine(v, n, alpha)
    want = v * ((1 - alpha) * 0.5 * (1 + math.cos(math.pi * min(t, n) / n)) + alpha)
    assert s(t) == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert alpha * v * (1 - 1e-12) <= s(t) <= v * (1 + 1e-12)
    assert s(t) >= s(t + 1) - 1e-15  # non-increasing


def test_cosine_values():
    s = cosine(1.0, decay_steps=100)
    assert s(0) == 1.0
    assert s(50) == pytest.approx(0.5)
    assert s(100) == pytest.approx(0.0, abs=1e-15)
    assert s(1000) == s(100)
    assert cosine(2.0, 10, alpha=0.25)(10) == pytest.approx(0.5)


@given(v=st.floats(1e-6, 10.0), w=st.integers(1, 10**5), t=steps)
def test_inverse_sqrt_closed_form(v, w, t):
    assert inverse_sqrt(v, w)(t) == pytest.approx(v * math.sqrt(w / (t + w)), rel=1e-12)


def test_inverse_sqrt_with_warmup_is_the_transformer_schedule():
    w = 4000
    s = with_warmup(inverse_sqrt(1e-3, warmup_steps=w), warmup_steps=w)
    for t in (w, w + 1, 2 * w, 10**6):
        assert s(t) == pytest.approx(1e-3 * math.sqrt(w / t), rel=1e-12)
    assert s(w // 2) == pytest.approx(0.5e-3)
    assert inverse_sqrt(1.0)(3) == 0.5  # default warmup_steps=1: 1 / sqrt(t + 1)


@given(w=st.integers(1, 1000), init=st.floats(0.0, 1.0), t=st.integers(0, 5000))
def test_with_warmup_closed_form(w, init, t):
    base = cosine(2.0, decay_steps=700, alpha=0.1)
    s = with_warmup(base, warmup_steps=w, init_value=init)
    if t < w:
        want = init + (base(0) - init) * t / w
    else:
        want = base(t - w)
    assert s(t) == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_with_warmup_values_and_identity():
    s = with_warmup(constant(1.0), warmup_steps=4)
    assert [s(t) for t in range(6)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    base = linear(1.0, 0.0, 10)
    assert with_warmup(base, 0) is base
    # optax.warmup_cosine_decay_schedule(0, peak, warmup, decay_steps=warmup + d) has the same numbers.
    s = with_warmup(cosine(1.0, decay_steps=90), warmup_steps=10)
    assert s(10) == 1.0 and s(55) == pytest.approx(0.5) and s(100) == pytest.approx(0.0, abs=1e-15)
    # Works with any callable, not only our schedules.
    assert with_warmup(lambda t: 3.0, 2)(1) == 1.5


def test_schedules_are_pure_hashable_and_picklable():
    for s in (constant(1.0), linear(1.0, 0.0, 5), cosine(1.0, 5), inverse_sqrt(1.0, 5), with_warmup(cosine(1.0, 5), 3)):
        assert [s(t) for t in range(10)] == [s(t) for t in range(10)]
        assert pickle.loads(pickle.dumps(s))(7) == s(7)
        hash(s)
    assert linear(1.0, 0.0, 5) == linear(1.0, 0.0, 5)


def test_integer_tensor_steps_are_accepted():
    assert linear(1.0, 0.0, 4)(torch.tensor(2)) == 0.5


@pytest.mark.parametrize("schedule", [constant(1.0), linear(1.0, 0.0, 5), cosine(1.0, 5), inverse_sqrt(1.0), with_warmup(constant(1.0), 2)])
def test_bad_steps(schedule):
    with pytest.raises(InputValueError, match=">= 0"):
        schedule(-1)
    with pytest.raises(InputTypeError, match="int step"):
        schedule(1.5)
    with pytest.raises(InputTypeError, match="int step"):
        schedule(True)


def test_bad_arguments():
    with pytest.raises(InputValueError, match="transition_steps >= 1"):
        linear(1.0, 0.0, 0)
    with pytest.raises(InputTypeError, match="transition_steps"):
        linear(1.0, 0.0, 2.5)
    with pytest.raises(InputValueError, match="decay_steps >= 1"):
        cosine(1.0, 0)
    with pytest.raises(InputValueError, match="alpha"):
        cosine(1.0, 10, alpha=1.5)
    with pytest.raises(InputValueError, match="finite"):
        constant(float("nan"))
    with pytest.raises(InputTypeError, match="parameter value="):
        constant("0.1")
    with pytest.raises(InputValueError, match="warmup_steps >= 1"):
        inverse_sqrt(1.0, 0)
    with pytest.raises(InputValueError, match="warmup_steps >= 0"):
        with_warmup(constant(1.0), -1)
    with pytest.raises(InputTypeError, match="parameter schedule="):
        with_warmup(0.1, 10)
