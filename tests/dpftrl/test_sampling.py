"""DP-FTRL samplers: participation guarantees, rates, keying, resume."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from opake_fx.dpftrl.sampling import (
    BallsInBinsSampler,
    CyclicPoissonSampler,
    FixedEpochSampler,
    MinSepSampler,
    uniform_groups,
)
from opake_fx.dpsgd.sampling import PoissonSampler
from opake_fx.errors import InputValueError, OperationError
from opake_fx.random import key


def _participations(sampler) -> dict[int, list[int]]:
    seen: dict[int, list[int]] = {}
    for t, batch in enumerate(sampler):
        for i in batch:
            seen.setdefault(i, []).append(t)
    return seen


def test_uniform_groups_are_uniform():
    g = uniform_groups(key(0), 60_000, 7)
    counts = torch.bincount(g, minlength=7).numpy()
    assert stats.chisquare(counts).pvalue > 1e-4
    assert torch.equal(g, uniform_groups(key(0), 60_000, 7))
    assert not torch.equal(g, uniform_groups(key(1), 60_000, 7))


def test_cyclic_poisson_only_uses_the_current_group_at_its_rate():
    n, parts, q = 4000, 4, 0.1
    s = CyclicPoissonSampler(n, sample_rate=q, partitions=parts, n_steps=40, key=key(2))
    groups = [set(s.group_members(g)) for g in range(parts)]
    assert sum(len(g) for g in groups) == n and set().union(*groups) == set(range(n))
    sizes = []
    for t, batch in enumerate(s):
        assert set(batch) <= groups[t % parts]
        assert batch == sorted(batch)
        sizes.append(len(batch) / len(groups[t % parts]))
    # 40 steps of ~1000 Bernoulli(0.1): the mean rate is within 5 standard errors.
    assert abs(np.mean(sizes) - q) < 5 * math.sqrt(q * (1 - q) / (40 * n / parts))
    for i, ts in _participations(CyclicPoissonSampler(n, sample_rate=q, partitions=parts, n_steps=40, key=key(2))).items():
        assert all(b - a >= parts for a, b in zip(ts, ts[1:]))


def test_cyclic_poisson_with_one_partition_is_poisson_sampling():
    a = CyclicPoissonSampler(500, sample_rate=0.05, partitions=1, n_steps=6, key=key(9))
    b = PoissonSampler(500, sample_rate=0.05, n_steps=6, key=key(9))
    assert list(a) == list(b)


def test_min_sep_sampler_respects_the_separation_and_rate():
    n, p, b = 3000, 0.2, 3
    s = MinSepSampler(n, sample_rate=p, min_sep=b, n_steps=30, key=key(4))
    seen = _participations(s)
    assert all(y - x >= b for ts in seen.values() for x, y in zip(ts, ts[1:]))
    # Without warm start everyone is available at step 0: Binomial(n, p).
    first = len(MinSepSampler(n, sample_rate=p, min_sep=b, n_steps=30, key=key(4)).batch(0))
    assert abs(first - n * p) < 5 * math.sqrt(n * p * (1 - p))
    # Stationary mean N p / (1 + (b-1) p) from the first step with warm start.
    warm = MinSepSampler(n, sample_rate=p, min_sep=b, n_steps=30, key=key(4), warm_start=True)
    sizes = [len(x) for x in warm]
    assert abs(np.mean(sizes) - warm.expected_batch_size) < 0.05 * warm.expected_batch_size
    assert abs(sizes[0] - warm.expected_batch_size) < 5 * math.sqrt(warm.expected_batch_size)


def test_min_sep_random_access_equals_iteration():
    s = MinSepSampler(200, sample_rate=0.3, min_sep=2, n_steps=12, key=key(1))
    batches = list(MinSepSampler(200, sample_rate=0.3, min_sep=2, n_steps=12, key=key(1)))
    assert [s.batch(t) for t in (5, 2, 11, 0)] == [batches[t] for t in (5, 2, 11, 0)]


def test_balls_in_bins_uses_one_bin_per_cycle():
    s = BallsInBinsSampler(1000, cycle_length=5, n_steps=15, key=key(3))
    seen = _participations(s)
    assert set(seen) == set(range(1000))
    for ts in seen.values():
        assert ts == list(range(ts[0], 15, 5))
    counts = [len(s.batch(t)) for t in range(5)]
    assert stats.chisquare(counts).pvalue > 1e-4


def test_fixed_epoch_sampler_gives_k_participations_exactly_b_apart():
    s = FixedEpochSampler(103, steps_per_epoch=10, epochs=3, key=key(5))
    assert s.n_steps == 30
    sizes = {len(s.batch(t)) for t in range(10)}
    assert sizes <= {10, 11}
    for ts in _participations(s).values():
        assert len(ts) == 3 and ts[1] - ts[0] == 10 and ts[2] - ts[1] == 10
    with pytest.raises(InputValueError, match="exceeds the dataset size"):
        FixedEpochSampler(5, steps_per_epoch=10, epochs=1, key=key(0))


@pytest.mark.parametrize(
    "make",
    [
        lambda: CyclicPoissonSampler(300, sample_rate=0.2, partitions=3, n_steps=9, key=key(8)),
        lambda: MinSepSampler(300, sample_rate=0.2, min_sep=3, n_steps=9, key=key(8), warm_start=True),
        lambda: BallsInBinsSampler(300, cycle_length=3, n_steps=9, key=key(8)),
        lambda: FixedEpochSampler(300, steps_per_epoch=3, epochs=3, key=key(8)),
    ],
)
def test_resume_from_state_dict_and_exhaustion(make):
    full = list(make())
    s = make()
    it = iter(s)
    for _ in range(4):
        next(it)
    saved = s.state_dict()
    resumed = make()
    resumed.load_state_dict(saved)
    assert list(resumed) == full[4:]
    with pytest.raises(OperationError, match="already yielded"):
        iter(resumed)
    bad = dict(saved)
    bad["n_steps"] = 99
    with pytest.raises(InputValueError, match="differs"):
        make().load_state_dict(bad)
    assert repr(s).startswith(type(s).__name__)
