"""Tests of opake_fx.dpsgd.sampling: distribution, determinism, resumption, validation."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats
from torch.utils.data import DataLoader, TensorDataset

from opake_fx.dpsgd.sampling import PoissonSampler, SequentialBatchSampler, TruncatedPoissonSampler
from opake_fx.errors import InputTypeError, InputValueError, OperationError
from opake_fx.random import fold_in, key

N, Q, STEPS = 200, 0.1, 1000
P_MIN = 1e-3


@pytest.fixture(scope="module")
def batches() -> list[list[int]]:
    return list(PoissonSampler(N, sample_rate=Q, n_steps=STEPS, key=key(1234)))


def _binomial_chi_square_p(sizes: list[int], n: int, q: float) -> float:
    """Chi-square goodness-of-fit p-value of ``sizes`` against Binomial(n, q), bins of expected count >= 5."""
    pmf = stats.binom.pmf(np.arange(n + 1), n, q) * len(sizes)
    observed = np.bincount(sizes, minlength=n + 1).astype(float)
    obs_bins, exp_bins, o, e = [], [], 0.0, 0.0
    for k in range(n + 1):
        o, e = o + observed[k], e + pmf[k]
        if e >= 5.0:
            obs_bins.append(o)
            exp_bins.append(e)
            o, e = 0.0, 0.0
    obs_bins[-1] += o  # the thin upper tail joins the last bin
    exp_bins[-1] += e
    exp = np.array(exp_bins)
    return float(stats.chisquare(obs_bins, exp * (sum(obs_bins) / exp.sum())).pvalue)


def test_batch_sizes_are_binomial(batches):
    sizes = [len(b) for b in batches]
    assert _binomial_chi_square_p(sizes, N, Q) > P_MIN


def test_batch_size_test_rejects_a_wrong_rate_and_fixed_sizes(batches):
    sizes = [len(b) for b in batches]
    # The same test must fail when the rate is off by 20% ...
    assert _binomial_chi_square_p(sizes, N, 1.2 * Q) < P_MIN
    # ... and for fixed-size batches (sampling without replacement gets no Poisson amplification).
    assert _binomial_chi_square_p([round(N * Q)] * STEPS, N, Q) < P_MIN


def test_each_index_is_included_with_probability_q(batches):
    counts = np.bincount([i for b in batches for i in b], minlength=N)
    # Independent Binomial(STEPS, Q) counts: the standardised sum of squares is ~chi2(N).
    stat = float(((counts - STEPS * Q) ** 2).sum() / (STEPS * Q * (1 - Q)))
    assert stats.chi2.sf(stat, N) > P_MIN
    assert stats.chi2.sf(stat, N) < 1 - P_MIN  # not suspiciously uniform either
    # The ends of the index range (where the gap walk starts and stops) are not biased.
    for i in (0, 1, N - 2, N - 1):
        assert abs(counts[i] - STEPS * Q) < 5 * math.sqrt(STEPS * Q * (1 - Q))


def test_neighbouring_indices_are_independent(batches):
    joint = sum(sum(1 for a, b in zip(batch, batch[1:]) if b == a + 1) for batch in batches)
    mean = STEPS * (N - 1) * Q**2
    # Var of sum_i X_i X_{i+1} for iid Bernoulli(Q): overlapping pairs share one coin.
    var = STEPS * ((N - 1) * Q**2 * (1 - Q**2) + 2 * (N - 2) * (Q**3 - Q**4))
    assert abs(joint - mean) < 4.5 * math.sqrt(var)


def test_batches_are_sorted_unique_and_in_range(batches):
    for b in batches:
        assert b == sorted(set(b))
        assert all(0 <= i < N for i in b)


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(0, 3000),
    q=st.sampled_from([1e-9, 1e-4, 0.01, 0.3, 0.999999, 1.0]) | st.floats(1e-6, 1.0),
    seed=st.integers(0, 2**64 - 1),
)
def test_batches_are_valid_for_any_configuration(n, q, seed):
    s = PoissonSampler(n, sample_rate=q, n_steps=2, key=key(seed))
    for b in s:
        assert b == sorted(set(b))
        assert all(0 <= i < n for i in b)
        if q == 1.0:
            assert b == list(range(n))


def test_same_key_same_batches_different_key_different_batches():
    a = list(PoissonSampler(1000, sample_rate=0.05, n_steps=5, key=key(7)))
    b = list(PoissonSampler(1000, sample_rate=0.05, n_steps=5, key=key(7)))
    c = list(PoissonSampler(1000, sample_rate=0.05, n_steps=5, key=key(8)))
    d = list(PoissonSampler(1000, sample_rate=0.05, n_steps=5, key=fold_in(key(7), 1)))
    assert a == b
    assert a != c and a != d
    assert len({tuple(x) for x in a}) == 5  # steps differ from each other


def test_batch_is_pure_and_matches_iteration():
    s = PoissonSampler(500, sample_rate=0.02, n_steps=4, key=key(3))
    before = s.batch(2)
    got = list(s)
    assert s.batch(2) == before == got[2]
    with pytest.raises(InputValueError, match="step"):
        s.batch(4)


def test_empty_batches_are_yielded_not_skipped():
    s = PoissonSampler(100, sample_rate=1e-4, n_steps=20, key=key(0))
    out = list(s)
    assert len(out) == 20
    assert out.count([]) >= 15
    assert list(PoissonSampler(0, sample_rate=0.5, n_steps=3, key=key(0))) == [[], [], []]


def test_full_rate_takes_everything():
    assert list(PoissonSampler(7, sample_rate=1.0, n_steps=2, key=key(0))) == [list(range(7))] * 2


def test_state_dict_round_trip_resumes_exactly():
    full = list(PoissonSampler(300, sample_rate=0.05, n_steps=10, key=key(11)))
    s = PoissonSampler(300, sample_rate=0.05, n_steps=10, key=key(11))
    it = iter(s)
    head = [next(it) for _ in range(4)]
    saved = json.loads(json.dumps(s.state_dict()))  # plain values: JSON and torch.save safe
    assert saved["next_step"] == 4 and saved["key"] == [0, 11]

    # A sampler built with another key continues the saved run after loading its state.
    resumed = PoissonSampler(300, sample_rate=0.05, n_steps=10, key=key(999))
    resumed.load_state_dict(saved)
    assert head + list(resumed) == full

    # Iterating twice from the same state gives the same batches.
    resumed.load_state_dict(saved)
    again = list(resumed)
    assert again == full[4:]


def test_iteration_resumes_after_break_and_refuses_to_run_past_n_steps():
    s = PoissonSampler(100, sample_rate=0.1, n_steps=5, key=key(2))
    full = [s.batch(t) for t in range(5)]
    first = []
    for b in s:
        first.append(b)
        if len(first) == 2:
            break
    assert s.next_step == 2
    assert first + list(s) == full
    with pytest.raises(OperationError, match="n_steps"):
        iter(s)


def test_load_state_dict_rejects_another_configuration():
    s = PoissonSampler(100, sample_rate=0.1, n_steps=5, key=key(2))
    sd = s.state_dict()
    with pytest.raises(InputValueError, match="sample_rate"):
        PoissonSampler(100, sample_rate=0.2, n_steps=5, key=key(2)).load_state_dict(sd)
    with pytest.raises(InputValueError, match="dataset_size"):
        PoissonSampler(101, sample_rate=0.1, n_steps=5, key=key(2)).load_state_dict(sd)
    with pytest.raises(InputValueError, match="lacks"):
        s.load_state_dict({"key": [0, 1]})
    with pytest.raises(InputValueError, match="next_step"):
        s.load_state_dict({**sd, "next_step": 6})
    with pytest.raises(InputValueError, match="max_batch_size"):
        TruncatedPoissonSampler(100, sample_rate=0.1, n_steps=5, key=key(2), max_batch_size=3).load_state_dict(
            {**sd, "max_batch_size": 4}
        )


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(0, 2000),
    q=st.floats(1e-3, 1.0),
    max_batch_size=st.integers(1, 200),
    seed=st.integers(0, 2**32 - 1),
)
def test_truncation_bound_holds_and_keeps_a_subset_of_the_poisson_batch(n, q, max_batch_size, seed):
    t = TruncatedPoissonSampler(n, sample_rate=q, n_steps=2, key=key(seed), max_batch_size=max_batch_size)
    p = PoissonSampler(n, sample_rate=q, n_steps=2, key=key(seed))
    for step in range(2):
        tb, pb = t.batch(step), p.batch(step)
        assert len(tb) == min(len(pb), max_batch_size)
        assert tb == sorted(set(tb)) and set(tb) <= set(pb)


def test_truncation_keeps_a_uniform_subset():
    steps, n, m = 400, 20, 5
    s = TruncatedPoissonSampler(n, sample_rate=1.0, n_steps=steps, key=key(5), max_batch_size=m)
    counts = np.bincount([i for b in s for i in b], minlength=n)
    assert counts.sum() == steps * m
    assert stats.chisquare(counts).pvalue > P_MIN
    assert s.state_dict()["max_batch_size"] == m


def test_works_as_a_dataloader_batch_sampler():
    x = torch.arange(50, dtype=torch.float32).unsqueeze(1)
    y = torch.arange(50) % 3
    ds = TensorDataset(x, y)
    sampler = PoissonSampler(ds, sample_rate=0.5, n_steps=6, key=key(4))
    expected = [sampler.batch(t) for t in range(6)]
    loader = DataLoader(ds, batch_sampler=sampler)
    assert len(loader) == 6
    got = list(loader)
    assert len(got) == 6
    for (xb, yb), idx in zip(got, expected):
        assert torch.equal(xb, x[idx]) and torch.equal(yb, y[idx])


def test_accounting_attributes():
    ds = TensorDataset(torch.zeros(40, 2))
    s = TruncatedPoissonSampler(ds, sample_rate=0.25, n_steps=9, key=key(0), max_batch_size=12)
    assert (s.sample_rate, s.n_steps, s.dataset_size, s.max_batch_size) == (0.25, 9, 40, 12)
    assert s.expected_batch_size == 10.0
    assert len(s) == 9


@pytest.mark.parametrize("rate", [0, 0.0, -0.1, 1.2, float("nan"), float("inf")])
def test_bad_sample_rate_names_the_fix(rate):
    with pytest.raises(InputValueError, match=r"sample_rate must be in \(0, 1\].*batch_size / len\(dataset\)"):
        PoissonSampler(100, sample_rate=rate, n_steps=1, key=key(0))


@pytest.mark.parametrize("rate", ["0.1", None, torch.tensor(0.1)])
def test_sample_rate_of_wrong_type(rate):
    # Rejected by the signature check (beartype), which names the parameter.
    with pytest.raises(InputTypeError, match="sample_rate"):
        PoissonSampler(100, sample_rate=rate, n_steps=1, key=key(0))


def test_bool_sample_rate_names_the_fix():
    # A bool is an int to the signature check; the body's check refuses it.
    with pytest.raises(InputTypeError, match="batch_size / len"):
        PoissonSampler(100, sample_rate=True, n_steps=1, key=key(0))


@pytest.mark.parametrize(("steps", "error"), [(0, InputValueError), (-3, InputValueError), (1.5, InputTypeError), (True, InputTypeError)])
def test_bad_n_steps(steps, error):
    with pytest.raises(error, match="n_steps"):
        PoissonSampler(100, sample_rate=0.1, n_steps=steps, key=key(0))


def test_int_seed_as_key_is_a_type_error_naming_key():
    with pytest.raises(InputTypeError, match=r"parameter key=42 .*RngKey.*opake_fx\.random\.key\(seed\)"):
        PoissonSampler(100, sample_rate=0.1, n_steps=1, key=42)
    with pytest.raises(InputTypeError, match=r"parameter key=\(0, 42\) .*RngKey.*opake_fx\.random\.key\(seed\)"):
        PoissonSampler(100, sample_rate=0.1, n_steps=1, key=(0, 42))


def test_bad_dataset_and_max_batch_size():
    with pytest.raises(InputTypeError, match="len"):
        PoissonSampler(object(), sample_rate=0.1, n_steps=1, key=key(0))
    with pytest.raises(InputValueError, match=">= 0"):
        PoissonSampler(-1, sample_rate=0.1, n_steps=1, key=key(0))
    with pytest.raises(InputValueError, match="max_batch_size"):
        TruncatedPoissonSampler(10, sample_rate=0.1, n_steps=1, key=key(0), max_batch_size=0)
    with pytest.raises(TypeError):  # keyword-only configuration
        PoissonSampler(10, 0.1, 1, key(0))  # type: ignore[misc]


def test_errors_are_builtin_compatible():
    with pytest.raises(ValueError):
        PoissonSampler(10, sample_rate=2.0, n_steps=1, key=key(0))
    with pytest.raises(TypeError):
        PoissonSampler(10, sample_rate=0.1, n_steps=1, key=0)


# --- SequentialBatchSampler ----------------------------------------------------------


def test_sequential_batches():
    assert list(SequentialBatchSampler(7, batch_size=3)) == [[0, 1, 2], [3, 4, 5], [6]]
    assert list(SequentialBatchSampler(7, batch_size=3, drop_last=True)) == [[0, 1, 2], [3, 4, 5]]
    cyc = SequentialBatchSampler(5, batch_size=2, n_steps=5)
    assert list(cyc) == [[0, 1], [2, 3], [4], [0, 1], [2, 3]]
    assert len(cyc) == 5 and cyc.sample_rate == 1.0 and cyc.dataset_size == 5


def test_sequential_can_be_iterated_again_and_resumed():
    s = SequentialBatchSampler(10, batch_size=4)
    assert list(s) == list(s) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    it = iter(s)
    next(it)
    sd = s.state_dict()
    other = SequentialBatchSampler(10, batch_size=4)
    other.load_state_dict(sd)
    assert list(other) == [[4, 5, 6, 7], [8, 9]]
    with pytest.raises(InputValueError, match="batch_size"):
        SequentialBatchSampler(10, batch_size=5).load_state_dict(sd)


def test_sequential_with_dataloader_and_errors():
    ds = TensorDataset(torch.arange(6.0))
    (first, *_), *_ = list(DataLoader(ds, batch_sampler=SequentialBatchSampler(ds, batch_size=4)))
    assert first.tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(InputValueError, match="no batches"):
        SequentialBatchSampler(3, batch_size=4, drop_last=True)
    with pytest.raises(InputValueError, match="batch_size"):
        SequentialBatchSampler(3, batch_size=0)
    with pytest.raises(InputTypeError, match="drop_last"):
        SequentialBatchSampler(3, batch_size=1, drop_last=1)
