"""Canaries (coin flips, the sampler bookkeeping, Dirac and input-space canaries) and scores."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats
import torch
from torch.func import grad

from opake_fx.auditing import (CanarySampler, canary_scores, coin_flip, dirac_canaries, gradient_scores, loss_scores,
                               mislabel, out_of_distribution)
from opake_fx.dpsgd.sampling import PoissonSampler
from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.random import key


def test_coin_flip_is_keyed_fair_and_respects_candidates():
    a, b = coin_flip(20_000, 10_000, key(0)), coin_flip(20_000, 10_000, key(0))
    assert np.array_equal(a.canary_indices, b.canary_indices) and np.array_equal(a.included, b.included)
    c = coin_flip(20_000, 10_000, key(1))
    assert not np.array_equal(a.included, c.included)
    assert np.unique(a.canary_indices).size == 10_000 and np.all(np.diff(a.canary_indices) > 0)
    # fair coins: a two-sided binomial test at 1e-4
    assert scipy.stats.binomtest(int(a.included.sum()), 10_000).pvalue > 1e-4
    cands = np.arange(100, 200)
    d = coin_flip(300, 30, key(2), candidate_indices=cands)
    assert set(d.canary_indices) <= set(cands.tolist())
    e = coin_flip(300, 100, key(2), candidate_indices=cands[::-1])
    assert np.array_equal(e.canary_indices, cands)  # exactly m candidates: those are the slots


def test_coin_flip_refuses_bad_arguments():
    with pytest.raises(InputTypeError, match="key"):
        coin_flip(10, 2, 0)
    with pytest.raises(InputValueError, match="candidate"):
        coin_flip(10, 5, key(0), candidate_indices=[1, 2])
    with pytest.raises(InputValueError, match="duplicates"):
        coin_flip(10, 2, key(0), candidate_indices=[1, 1, 2])
    with pytest.raises(InputValueError, match=r"\[0, 10\)"):
        coin_flip(10, 2, key(0), candidate_indices=[1, 12])
    with pytest.raises(InputValueError, match="num_canaries"):
        coin_flip(10, 0, key(0))


def test_train_indices_and_the_sampler_leave_out_exactly_the_excluded_canaries():
    flip = coin_flip(1000, 200, key(3))
    kept = flip.train_indices(1000)
    assert set(kept.tolist()) == set(range(1000)) - set(flip.excluded_indices.tolist())
    with pytest.raises(InputValueError, match="dataset_size"):
        flip.train_indices(999)
    inner = PoissonSampler(range(1000), sample_rate=0.3, n_steps=20, key=key(4))
    sampler = flip.sampler(inner)
    assert isinstance(sampler, CanarySampler) and len(sampler) == 20
    excluded, included = set(flip.excluded_indices.tolist()), set(flip.canary_indices[flip.included].tolist())
    seen = set()
    same = PoissonSampler(range(1000), sample_rate=0.3, n_steps=20, key=key(4))  # the batches inner draws
    for raw, batch in zip(same, sampler):
        assert batch == [i for i in raw if i not in excluded]
        seen |= set(batch)
    assert not seen & excluded and included & seen  # included canaries are sampled as usual


def test_dirac_canaries_have_the_stated_gradient_and_scores():
    d = dirac_canaries(5, key(5), norm=7.0, size=12)
    assert np.unique(d.coordinates).size == 5 and set(np.abs(d.signs).tolist()) == {1.0}
    vec = torch.randn(12, dtype=torch.float64)
    for j in range(5):
        which = torch.zeros(5, dtype=torch.float64)
        which[j] = 1.0
        g = grad(d.loss)(vec, which)
        expected = torch.zeros(12, dtype=torch.float64)
        expected[int(d.coordinates[j])] = -7.0 * d.signs[j]
        assert torch.equal(g, expected)
    assert torch.equal(grad(d.loss)(vec, torch.zeros(5, dtype=torch.float64)), torch.zeros(12, dtype=torch.float64))
    update = torch.arange(12.0)
    assert np.allclose(d.scores(update), d.signs * d.coordinates)
    with pytest.raises(InputValueError, match="entries"):
        d.scores(torch.zeros(3))
    with pytest.raises(InputValueError, match="norm"):
        dirac_canaries(3, key(0), norm=0.0)


def test_gradient_scores_are_minus_the_inner_product_with_the_update():
    gen = torch.Generator().manual_seed(0)  # fixed data, float64: the tolerance is about rounding, not luck

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    params = {"w": randn(3, 2), "b": randn(2)}
    x = randn(4, 3)

    def loss(p, xi):
        return ((xi @ p["w"] + p["b"]) ** 2).sum()

    update = {"w": randn(3, 2), "b": randn(2)}
    s = gradient_scores(loss, params, [x], update, [10, 11, 12, 13])
    for j in range(4):
        g = grad(loss)(params, x[j])
        expected = -float((g["w"] * update["w"]).sum() + (g["b"] * update["b"]).sum())
        assert s.values[j] == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert s.canary_ids.tolist() == [10, 11, 12, 13]
    with pytest.raises(InputValueError, match="structure"):
        gradient_scores(loss, params, [x], {"w": update["w"]}, [10, 11, 12, 13])


def test_loss_scores_and_canary_scores_checks():
    s = loss_scores(lambda p, x: (x - p) ** 2, torch.tensor(1.0), [torch.tensor([1.0, 3.0, 0.0])], [5, 6, 7])
    assert s.values.tolist() == [-0.0, -4.0, -1.0]
    with pytest.raises(InputValueError, match="3 scores for 2"):
        canary_scores([1.0, 2.0, 3.0], [1, 2])
    with pytest.raises(InputValueError, match="duplicates"):
        canary_scores([1.0, 2.0], [1, 1])
    with pytest.raises(InputValueError, match="NaN"):
        canary_scores([1.0, float("nan")], [1, 2])


def test_input_space_canaries_change_only_the_canary_slots():
    flip = coin_flip(100, 20, key(6))
    y = torch.randint(0, 10, (100,), generator=torch.Generator().manual_seed(0))
    y2 = mislabel(y, flip, 10, key(7))
    idx = torch.as_tensor(flip.canary_indices)
    others = torch.ones(100, dtype=torch.bool)
    others[idx] = False
    assert bool((y2[idx] != y[idx]).all()) and torch.equal(y2[others], y[others])
    assert int(y2.min()) >= 0 and int(y2.max()) < 10
    x = torch.randn(100, 4)
    x2 = out_of_distribution(x, flip, key(8), scale=50.0)
    assert torch.equal(x2[others], x[others]) and float(x2[idx].std()) > 20.0
    with pytest.raises(InputValueError, match="slots"):
        mislabel(y[:50], flip, 10, key(7))


def test_input_space_canaries_train_through_the_plan_and_are_detected_without_noise():
    # Mislabelled canaries in a non-private run (noise_multiplier=0: epsilon = inf) through the
    # plan's sampler (wrapped by the coin flip) and pipeline: the loss attack must see them.
    from opake_fx.auditing import one_run
    from opake_fx.optimizers import sgd
    from opake_fx.plan import DPPlan
    from opake_fx.transforms import apply_updates

    g = torch.Generator().manual_seed(0)
    n, d = 300, 300  # as many features as examples: a linear model can memorise a flipped label
    x = torch.randn(n, d, generator=g) / d**0.5
    y = (x[:, 0] > 0).long()
    flip = coin_flip(n, 100, key(9))
    y = mislabel(y, flip, 2, key(10))
    plan = DPPlan(dataset_size=n, batch_size=60, steps=150, clipping_norm=10.0, noise_multiplier=0.0, delta=1e-5)

    def loss(p, xi, yi):
        return torch.nn.functional.cross_entropy((xi @ p)[None], yi[None])

    pipeline = plan.pipeline(loss, sgd(30.0), key=key(11))
    params = torch.zeros(d, 2)
    state = pipeline.init(params)
    for batch in flip.sampler(plan.sampler(range(n), key(12))):
        updates, state = pipeline.update((x[batch], y[batch]), state, params)
        params = apply_updates(params, updates)
    idx = torch.as_tensor(flip.canary_indices)
    per_example = lambda p, xb, yb: torch.nn.functional.cross_entropy(xb @ p, yb, reduction="none")  # noqa: E731
    est = one_run(loss_scores(per_example, params, [x[idx], y[idx]], flip.canary_indices), flip)
    assert est.attack_auc(bootstrap=0).auc > 0.8  # measured 0.868
    assert est.epsilon_at(1e-5) > 0.5  # measured 1.02 (100 canaries: the ceiling is 2.50)
