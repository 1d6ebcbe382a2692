"""Incremental composition: IncrementalPld, the Accountant's running PLD, many distinct steps."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import pld_privacy_accountant
from hypothesis import example, given, settings
from hypothesis import strategies as st
from scipy import fft as sfft

import opake_fx.accounting as acc
import opake_fx.dpsgd.accounting as dpsgd_acc
from opake_fx.accounting import _pmf, pld
from opake_fx.errors import BudgetExceededError, InputTypeError, InputValueError


def agrees(running: float, one_shot: float) -> bool:
    """Running (incremental) vs one-shot composition of the same steps.

    Both bound the same exact discrete composition from above (checked against an
    extended-precision reference in ``test_both_paths_bound_...``); they differ in where
    the FFT rounding bounds and the tail cuts are paid. The running one is looser than the
    one-shot by at most a few 1e-6 on short random sequences (3.0e-6 found at delta 1e-8
    for a Laplace then a Gaussian step; hypothesis found 1.02e-5 and 2.38e-5 at delta 1e-8 for
    poisson(0.75, q) then many poisson(4.0, 1/32), the two examples below; 9.5e-6 the worst of
    360 random sequences; 5e-5 allowed, half the plan's 1e-4 slack; looser is the safe direction; the
    issue's 1e-6 is met on the 10,000-step schedule, 4e-9, tested at -m slow). It may be *tighter*:
    the one-shot Fourier product adds one uniform rounding bound to every bin, which at
    delta 1e-8 makes it looser than the exact value (by 2.0e-5 for poisson(1.0, 1/64) then
    poisson(0.625, 1/64): one-shot 4.424286, running 4.4241970, dp_accounting at a 1e-5
    grid 4.4241968), while the running one pays a bound of each bin's own order; 6.0e-5 was
    found for poisson(2.0, 1/64) then poisson(0.625, 1e-3) at delta 1e-8 (running 1.1107012,
    one-shot 1.1107617, extended-precision reference 1.1107008, dp_accounting 1.1107009:
    the running bound is the tight one), so 1e-4 is allowed.
    """
    return one_shot * (1 - 1e-4) - 1e-12 <= running <= one_shot * (1 + 5e-5) + 1e-12


def poisson(sigma: float, q: float) -> acc.DpProcess:
    return dpsgd_acc.poisson(dpsgd_acc.gaussian(sigma), q)


steps_strategy = st.one_of(
    st.builds(poisson, st.floats(0.6, 4.0), st.floats(1e-3, 0.2)),
    st.builds(lambda s, q, k: poisson(s, q) * k, st.floats(0.8, 4.0), st.floats(1e-3, 0.05), st.integers(2, 200)),
    st.builds(lambda b: dpsgd_acc.poisson(dpsgd_acc.laplace(b), 0.05), st.floats(1.0, 5.0)),
    st.builds(lambda s: dpsgd_acc.gaussian(s), st.floats(2.0, 10.0)),
    st.builds(lambda e: acc.eps_delta(e, 1e-9), st.floats(0.01, 0.3)),
)


@settings(max_examples=10, deadline=None)
@given(steps=st.lists(steps_strategy, min_size=2, max_size=12), delta=st.sampled_from([1e-3, 1e-5, 1e-8]))
@example(steps=[poisson(0.75, 0.015625), poisson(4.0, 0.03125) * 66], delta=1e-8)  # running 1.02e-5 looser
@example(steps=[poisson(0.75, 0.00390625), poisson(4.0, 0.03125) * 71], delta=1e-8)  # running 2.38e-5 looser
@example(steps=[poisson(2.0, 0.015625), poisson(0.625, 0.001)], delta=1e-8)  # one-shot 5.4e-5 looser
def test_incremental_and_one_shot_agree_on_random_heterogeneous_sequences(steps, delta):
    running = acc.IncrementalPld()
    for step in steps:
        running = running.then(step)
    one_shot = acc.compose(*steps)
    assert agrees(running.epsilon_at(delta), one_shot.epsilon_at(delta))
    eps = one_shot.epsilon_at(delta)
    if math.isfinite(eps):
        # delta moves ~20-50x more than epsilon (relative) at these slopes
        assert running.delta_at(eps) <= one_shot.delta_at(eps) * (1 + 5e-4) + 1e-15  # 5.1e-5 found
        assert running.delta_at(eps) >= one_shot.delta_at(eps) * (1 - 1e-3) - 1e-15


@pytest.mark.parametrize("delta", [1e-5, 1e-8])
@pytest.mark.parametrize("second", [dpsgd_acc.poisson(dpsgd_acc.laplace(1.0), 0.05), poisson(1.0, 0.0625)], ids=repr)
def test_both_paths_bound_the_extended_precision_composition(delta, second):
    first = poisson(1.0, 0.0625)
    running = acc.IncrementalPld().then(first).then(second)
    one_shot = (first | second).epsilon_at(delta)
    references = []
    for pair in (0, 1):
        a, b = pld._single(first, 1e-4)[pair], pld._single(second, 1e-4)[pair]
        n = sfft.next_fast_len(a.size + b.size - 1, real=True)
        spectrum = sfft.rfft(a.probs.astype(np.longdouble), n) * sfft.rfft(b.probs.astype(np.longdouble), n)
        exact = np.maximum(sfft.irfft(spectrum, n)[: a.size + b.size - 1], 0.0).astype(np.float64)
        references.append(_pmf.Pmf(1e-4, a.lo + b.lo, exact, a.inf + b.inf - a.inf * b.inf))
    reference = max(p.epsilon_at(delta) for p in references)
    assert running.epsilon_at(delta) >= reference * (1 - 1e-12)
    assert one_shot >= reference * (1 - 1e-12)
    assert running.epsilon_at(delta) <= reference * (1 + 1e-7)  # the running bound is tight
    assert agrees(running.epsilon_at(delta), one_shot)


def test_many_distinct_processes_match_dp_accounting():
    """More than 8 distinct processes take the grouped tree; dp_accounting is the oracle."""
    parts = [poisson(0.9 + 0.05 * i, 0.01) * 20 for i in range(12)]
    ours = acc.compose(*parts).epsilon_at(1e-5)
    oracle = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    for i in range(12):
        oracle.compose(dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(0.9 + 0.05 * i)), 20)
    theirs = oracle.get_epsilon(1e-5)
    assert theirs * (1 - 1e-6) <= ours <= theirs * (1 + 1e-5)
    # the same steps folded one group at a time
    running = acc.IncrementalPld()
    for part in parts:
        running = running.then(part)
    assert agrees(running.epsilon_at(1e-5), ours)


def test_few_and_many_distinct_paths_agree():
    """The Fourier product (<= 8 distinct steps) and the grouped tree give the same epsilon."""
    parts = [poisson(1.0 + 0.1 * i, 0.02) * 10 for i in range(9)]
    tree = acc.compose(*parts).epsilon_at(1e-6)
    product = pld._compose([(pld._single(p._components()[0][0], 1e-4)[0], 10) for p in parts])
    add = pld._compose([(pld._single(p._components()[0][0], 1e-4)[1], 10) for p in parts])
    fourier = max(product.epsilon_at(1e-6), add.epsilon_at(1e-6))
    assert fourier * (1 - 1e-7) <= tree <= fourier * (1 + 1e-6)


def test_convolve_dominates_the_exact_convolution():
    step = poisson(0.8, 0.1)
    a = pld._compose([(pld._single(step, 1e-3)[0], 7)])
    b = pld._single(poisson(1.3, 0.05), 1e-3)[0]
    out = _pmf.convolve(a, b)
    exact = np.convolve(a.probs.astype(np.longdouble), b.probs.astype(np.longdouble))
    window = exact[out.lo - (a.lo + b.lo) : out.lo - (a.lo + b.lo) + out.size]
    # every kept bin at least its exact value, except the lowest, which also holds the rounded-up mass
    assert np.all(out.probs[1:] >= window[1:].astype(np.float64) * (1 - 1e-15))
    cut_above = float(exact[out.lo - (a.lo + b.lo) + out.size :].sum())
    assert out.inf >= a.inf + b.inf - a.inf * b.inf + cut_above
    exact_pmf = _pmf.Pmf(1e-3, a.lo + b.lo, exact.astype(np.float64), a.inf + b.inf - a.inf * b.inf)
    for eps in np.linspace(0.0, 4.0, 41):
        assert out.delta_at(eps) >= exact_pmf.delta_at(eps) * (1 - 1e-12)


def test_rounding_bound_covers_the_error_and_stays_relative_in_the_tail():
    """Against an extended-precision FFT on a realistic composition (q=0.005, sigma=1, d=1e-4)."""
    single = pld._single(poisson(1.0, 0.005), 1e-4)[0]
    running = _pmf.unit(1e-4)
    for _ in range(30):
        running = _pmf.convolve(running, single)
    out = _pmf.convolve(running, single)
    width = running.size + single.size - 1
    n = sfft.next_fast_len(width, real=True)
    ref = sfft.irfft(
        sfft.rfft(running.probs.astype(np.longdouble), n) * sfft.rfft(single.probs.astype(np.longdouble), n), n
    )[:width]
    lo = out.lo - (running.lo + single.lo)
    ref = ref[lo : lo + out.size]
    ld_floor = 40 * float(np.finfo(np.longdouble).eps) * float(ref.max())
    assert np.all(out.probs[1:] >= (ref[1:] - ld_floor).astype(np.float64))
    # where delta at 1e-5 is decided (entries ~1e-6 of the peak), the added bound is tiny
    tail = (ref > 1e-7 * ref.max()) & (ref < 1e-5 * ref.max()) & (out.losses() > 0)
    assert tail.sum() > 100
    assert np.all(out.probs[tail] <= ref[tail].astype(np.float64) * (1 + 1e-9))


def test_chernoff_cut_keeps_the_support_bounded():
    single_remove, single_add = pld._single(poisson(1.0, 0.01), 1e-4)
    running = _pmf.unit(1e-4)
    sizes = []
    for _ in range(200):
        running = _pmf.convolve(running, single_remove)
        sizes.append(running.size)
    assert max(sizes[100:]) < 2 * sizes[50]  # grows like the composed spread, not by the step width
    assert running.inf <= 200 * (single_remove.inf + 1.5 * _pmf.FOLD_TAIL)


def test_incremental_pld_errors_and_identity():
    running = acc.IncrementalPld()
    assert running.then(acc.identity()) is running
    with pytest.raises(InputTypeError):
        running.then(3.0)  # type: ignore[arg-type]
    mixed = running.then(poisson(1.0, 0.01))
    with pytest.raises(InputValueError, match="neighbouring relation"):
        mixed.then(dpsgd_acc.sampled_without_replacement(dpsgd_acc.gaussian(1.0), 1000, 10))
    with pytest.raises(InputValueError, match="discretization"):
        acc.IncrementalPld(2.0)
    assert running.then(acc.nonprivate()).epsilon_at(1e-5) == math.inf
    assert acc.IncrementalPld().epsilon_at(1e-5) == 0.0


def test_state_dict_continues_the_composition_bit_for_bit():
    first, second = poisson(1.0, 0.05), dpsgd_acc.poisson(dpsgd_acc.laplace(2.0), 0.05)
    symmetric = acc.IncrementalPld(1e-3).then(dpsgd_acc.gaussian(3.0))
    assert symmetric.state_dict()["add"] is None
    back = acc.IncrementalPld.from_state_dict(symmetric.state_dict())
    assert back.then(first).epsilon_at(1e-5) == symmetric.then(first).epsilon_at(1e-5)
    running = symmetric.then(first * 3)
    state = running.state_dict()
    assert state["add"] is not None and state["remove"]["probs"].dtype == np.float64
    back = acc.IncrementalPld.from_state_dict(state)
    assert repr(back) == repr(running)
    for a, b in [(running.then(second), back.then(second)), (running.then(first), back.then(first))]:
        assert a.epsilon_at(1e-5) == b.epsilon_at(1e-5) and a.delta_at(0.5) == b.delta_at(0.5)
        sa, sb = a.state_dict(), b.state_dict()
        for pair in ("remove", "add"):
            if sa[pair] is not None:
                assert np.array_equal(sa[pair]["probs"], sb[pair]["probs"]) and sa[pair]["lo"] == sb[pair]["lo"]
    state["remove"]["probs"][0] = 1.0  # the saved arrays are copies
    assert running.state_dict()["remove"]["probs"][0] != 1.0


def test_from_state_dict_refuses_a_malformed_state_naming_the_field():
    good = acc.IncrementalPld(1e-3).then(poisson(1.0, 0.05)).state_dict()

    def changed(pair, field, value):
        state = {**good, pair: {**good[pair], field: value}}
        return state

    cases = [
        (changed("remove", "probs", good["remove"]["probs"].astype(np.float32)), r"remove/probs: expected a 1-D float64"),
        (changed("remove", "probs", np.zeros(0)), r"remove/probs: expected a non-empty array"),
        (changed("remove", "probs", -good["remove"]["probs"]), r"remove/probs: .*non-negative"),
        (changed("add", "log_mgfs", np.zeros(3)), r"add/log_mgfs: expected 30 values"),
        (changed("add", "inf", 1.5), r"add/inf: the mass at infinity must be in \[0, 1\]"),
        (changed("add", "d", -1e-3), r"add/d: the grid spacing must be a positive"),
        (changed("remove", "lo", 1.5), r"remove/lo: the grid offset must be an int"),
        ({**good, "relation": "any"}, r"relation: expected None"),
        ({**good, "folds": -1}, r"folds: expected an int >= 0"),
        ({k: v for k, v in good.items() if k != "add"}, r"expected the fields"),
    ]
    for state, message in cases:
        with pytest.raises(InputValueError, match=message):
            acc.IncrementalPld.from_state_dict(state)


# ----------------------------------------------------------------- accountant


def count_convolutions(monkeypatch) -> list[int]:
    calls = [0]
    original = _pmf.convolve

    def counting(a, b, tail=_pmf.FOLD_TAIL):
        calls[0] += 1
        return original(a, b, tail)

    monkeypatch.setattr(_pmf, "convolve", counting)
    return calls


def test_accountant_with_a_schedule_matches_one_shot_at_every_step():
    acct = acc.Accountant(acc.epsilon_budget(5.0, delta=1e-5))
    schedule = [poisson(0.9 + 0.02 * i, 0.02) for i in range(25)]
    for i, step in enumerate(schedule):
        acct.step(step)
        if i % 6 == 5:
            assert agrees(acct.spent_epsilon(1e-5), acc.compose(*schedule[: i + 1]).epsilon_at(1e-5))
    assert acct.spent == acc.compose(*schedule)


def test_check_then_step_costs_one_convolution_per_pair(monkeypatch):
    acct = acc.Accountant(acc.epsilon_budget(5.0, delta=1e-5))
    acct.step(poisson(1.0, 0.01))
    calls = count_convolutions(monkeypatch)
    nxt = poisson(1.1, 0.01)
    assert not acct.would_exceed(nxt)
    acct.step(nxt)
    acct.spent_epsilon(1e-5)
    assert calls[0] == 2  # remove and add pairs, once: the check is reused by the step


def test_identical_steps_are_grouped(monkeypatch):
    acct = acc.Accountant(acc.epsilon_budget(3.0, delta=1e-5))
    step = poisson(1.0, 0.01)
    calls = count_convolutions(monkeypatch)
    for _ in range(2000):
        acct.step(step)
    eps = acct.spent_epsilon(1e-5)
    assert calls[0] < 100  # the headroom search and one fold of the run, not 2000 folds
    assert agrees(eps, (step * 2000).epsilon_at(1e-5))


def test_refused_distinct_step_changes_nothing():
    acct = acc.Accountant(acc.epsilon_budget(1.0, delta=1e-5))
    for i in range(30):
        acct.step(poisson(1.0 + 0.01 * i, 0.01))
    before, eps_before = acct.spent, acct.spent_epsilon(1e-5)
    big = poisson(0.5, 0.5) * 50
    assert acct.would_exceed(big)
    with pytest.raises(BudgetExceededError, match="not recorded"):
        acct.step(big)
    assert acct.spent == before
    assert acct.spent_epsilon(1e-5) == eps_before


def test_accountant_reports_both_engines():
    acct = acc.Accountant(acc.epsilon_budget(5.0, delta=1e-5))
    steps = [poisson(1.0 + 0.05 * i, 0.01) * 10 for i in range(5)]
    for step in steps:
        acct |= step
    spent = acc.compose(*steps)
    rdp = acct.spent_epsilon(1e-5, accountant="rdp")
    assert rdp == pytest.approx(spent.epsilon_at(1e-5, accountant="rdp"), rel=1e-12)
    assert acct.spent_epsilon(1e-5) <= rdp
    with pytest.raises(InputValueError, match="accountant"):
        acct.spent_epsilon(1e-5, accountant="moments")
    rdp_budget = acc.Accountant(acc.epsilon_budget(5.0, delta=1e-5, accountant="rdp"))
    for step in steps:
        rdp_budget |= step
    assert rdp_budget.spent_epsilon(1e-5) == pytest.approx(rdp, rel=1e-12)
    assert rdp_budget.spent_epsilon(1e-5, accountant="pld") == spent.epsilon_at(1e-5)


@pytest.mark.slow
def test_ten_thousand_distinct_steps_match_one_shot():
    """The issue's acceptance run: a noise schedule of 10,000 distinct steps, checked and read each step."""
    schedule = [poisson(1.0 + 0.001 * i, 0.005) for i in range(10_000)]
    acct = acc.Accountant(acc.epsilon_budget(10.0, delta=1e-5))
    for step in schedule:
        assert not acct.would_exceed(step)
        acct.step(step)
        acct.spent_epsilon(1e-5)
    assert agrees(acct.spent_epsilon(1e-5), acc.compose(*schedule).epsilon_at(1e-5))


def test_folding_onto_a_coarser_grid_stays_pessimistic(monkeypatch):
    monkeypatch.setattr(_pmf, "MAX_GRID", 2**14)
    acc.clear_caches()
    try:
        running = acc.IncrementalPld().then(dpsgd_acc.gaussian(3.0))  # fits the fine grid
        running = running.then(dpsgd_acc.gaussian(1.0) * 50)  # only fits a coarser one
        assert running.discretization > 1e-4
        exact = acc.DpProcess.epsilon_at(dpsgd_acc.gaussian(1.0) * 50 | dpsgd_acc.gaussian(3.0), 1e-5)
        assert exact <= running.epsilon_at(1e-5) <= exact + 10 * running.discretization
    finally:
        acc.clear_caches()
