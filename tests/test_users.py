"""User-level sampling (opake_fx.users): the user is the unit that is sampled, clipped and accounted."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opake_fx.dpsgd import clip
from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.functional import make_functional
from opake_fx.random import key, split
from opake_fx.users import UserIndex, UserPoissonSampler, batched_user_loss, collate_users, user_loss


def test_user_index_numbers_users_by_first_example_and_refuses_ambiguous_ids():
    users = UserIndex(torch.tensor([5, 5, 2, 9, 2]))
    assert users.users == (5, 2, 9) and [users.examples_of(u) for u in range(3)] == [[0, 1], [2, 4], [3]]
    with pytest.raises(InputTypeError, match="not floats"):
        UserIndex([1.0, 2.0])
    with pytest.raises(InputTypeError, match="hashable"):
        UserIndex([[1], [2]])
    with pytest.raises(InputValueError, match="empty"):
        UserIndex([])


def test_each_user_joins_with_the_sample_rate_and_brings_at_most_k_of_their_own_examples():
    counts = [1, 3, 12, 40] * 5
    ids = [u for u, c in enumerate(counts) for _ in range(c)]
    users = UserIndex(ids)
    q, k, steps = 0.3, 4, 400
    sampler = UserPoissonSampler(users, sample_rate=q, max_examples=k, n_steps=steps, key=key(3))
    joined = torch.zeros(users.n_users)
    used = torch.zeros(len(ids))
    for groups in sampler:
        for g in groups:
            u = ids[g[0]]
            assert g == sorted(g) and set(g) <= set(users.examples_of(u)) and len(g) == min(k, counts[u])
            joined[u] += 1
            used[torch.tensor(g)] += 1
    # each user's joins are Binomial(steps, q): 5 standard deviations
    sd = math.sqrt(steps * q * (1 - q))
    assert ((joined - steps * q).abs() <= 5 * sd).all()
    # within a user of 40 joined J times, each example is used Binomial(J, k / 40)
    big = [u for u in range(users.n_users) if counts[u] == 40]
    for u in big:
        n_joined = float(joined[u])
        p = k / 40
        per = used[torch.tensor(users.examples_of(u))]
        assert ((per - n_joined * p).abs() <= 5 * math.sqrt(n_joined * p * (1 - p))).all()


def test_the_sampler_resumes_and_is_a_function_of_the_key():
    users = UserIndex([i % 7 for i in range(60)])
    a = UserPoissonSampler(users, sample_rate=0.5, max_examples=3, n_steps=6, key=key(1))
    first = [next(iter(a)) for _ in range(2)]
    b = UserPoissonSampler(users, sample_rate=0.5, max_examples=3, n_steps=6, key=key(1))
    b.load_state_dict(a.state_dict())
    assert list(b) == [a.batch(t) for t in range(2, 6)]
    assert first == [a.batch(0), a.batch(1)]
    other = UserPoissonSampler(users, sample_rate=0.5, max_examples=3, n_steps=6, key=key(2))
    assert [other.batch(t) for t in range(6)] != [a.batch(t) for t in range(6)]


def test_collate_refuses_a_group_larger_than_k():
    with pytest.raises(InputValueError, match="more than max_examples=2"):
        collate_users((torch.zeros(5),), [[0, 1, 2]], max_examples=2)


def _model():
    torch.manual_seed(0)
    return make_functional(nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double())


def _reference(fmodel, params, blocks, mask, c):
    """float64 per-user loop: the mean of each user's example gradients, clipped to c, summed."""
    x, y = blocks
    total = [torch.zeros_like(p) for p in params]
    for u in range(mask.shape[0]):
        rows = mask[u]
        loss = F.cross_entropy(fmodel(params, x[u][rows]), y[u][rows], reduction="mean")
        grads = torch.autograd.grad(loss, params)
        norm = torch.sqrt(sum((g ** 2).sum() for g in grads))
        scale = min(1.0, c / float(norm))
        total = [t + scale * g for t, g in zip(total, grads)]
    return total


@pytest.mark.parametrize("backend", ["vmap", "auto", "ghost"])
def test_a_user_with_many_adversarial_examples_moves_the_clipped_sum_by_at_most_the_clip_norm(backend):
    """Neighbouring data sets differ by ALL of one user's examples: 40 examples of huge, aligned
    inputs, of which k=8 are used. The clipped sum moves by at most C, and matches the float64
    per-user loop."""
    fmodel, params = _model()
    params = [p.detach().requires_grad_(True) for p in params]
    g = torch.Generator().manual_seed(1)
    counts = [3, 5, 40, 1, 8]
    ids = [u for u, n in enumerate(counts) for _ in range(n)]
    x = torch.randn(len(ids), 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (len(ids),), generator=g)
    attacker = 2
    rows = torch.tensor(UserIndex(ids).examples_of(attacker))
    x[rows] = 1e6  # every attacker example pushes the same way, hard
    y[rows] = 0
    k, c = 8, 0.5
    users = UserIndex(ids)
    groups = UserPoissonSampler(users, sample_rate=1.0, max_examples=k, n_steps=1, key=key(4)).batch(0)
    assert len(groups[attacker]) == k
    blocks, mask = collate_users((x, y), groups, max_examples=k)
    if backend == "vmap":
        loss = user_loss(lambda p, xi, yi: F.cross_entropy(fmodel(p, xi[None]), yi[None]))
    else:
        loss = batched_user_loss(lambda p, xb, yb: F.cross_entropy(fmodel(p, xb), yb, reduction="none"))
    stage = clip(loss, clipping_norm=c, batch_argnums=(1, 2, 3), clip_backend=backend,
                 model=None if backend == "vmap" else fmodel)
    with_attacker, _ = stage.update((*blocks, mask), stage.init(params), params)
    keep = torch.tensor([u != attacker for u in range(len(groups))])
    without, _ = stage.update((blocks[0][keep], blocks[1][keep], mask[keep]), stage.init(params), params)
    diff = torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(with_attacker.pytree, without.pytree))).detach()
    assert float(diff) <= c * (1 + 1e-12)
    assert float(diff) > 0.9 * c  # the attacker's unit is clipped, not dropped
    ref = _reference(fmodel, params, blocks, mask, c)
    for got, want in zip(with_attacker.pytree, ref):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_example_level_clipping_of_the_same_user_would_exceed_the_bound():
    """The reason for the unit: clipped per example, the attacker's k examples move the sum by k * C."""
    fmodel, params = _model()
    x = torch.full((8, 6), 1e6, dtype=torch.float64)
    y = torch.zeros(8, dtype=torch.long)
    stage = clip(lambda p, xi, yi: F.cross_entropy(fmodel(p, xi[None]), yi[None]), clipping_norm=0.5,
                 batch_argnums=(1, 2))
    out, _ = stage.update((x, y), stage.init(params), params)
    norm = torch.sqrt(sum((t ** 2).sum() for t in out.pytree))
    assert float(norm) > 3.0  # ~ 8 x 0.5: per-example clipping bounds each example, not the user


# --- the privacy unit as a value of the plan ---------------------------------------------

from opake_fx.optimizers import sgd  # noqa: E402
from opake_fx.plan import DPPlan  # noqa: E402
from opake_fx.serialization.runs import plan_identity  # noqa: E402
from opake_fx.transforms import apply_updates  # noqa: E402


def _user_data(n_users=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, n_users, (200,), generator=g)
    ids[:n_users] = torch.arange(n_users)  # every user has an example
    x = torch.randn(200, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (200,), generator=g)
    return ids, x, y


USER_PLAN = dict(dataset_size=30, batch_size=6, steps=5, clipping_norm=0.5, noise_multiplier=1.2, delta=1e-5,
                 privacy_unit="user", max_examples_per_user=4)


def test_a_user_plan_is_accounted_as_dp_sgd_over_users_and_keeps_example_plans_identity():
    plan = DPPlan(**USER_PLAN)
    over_users = DPPlan(**{k: v for k, v in USER_PLAN.items() if k not in ("privacy_unit", "max_examples_per_user")})
    assert plan.epsilon() == over_users.epsilon() and plan.step_cost == over_users.step_cost
    assert DPPlan(**plan.to_dict()) == plan and plan.to_dict()["privacy_unit"] == "user"
    assert "privacy_unit" not in plan_identity(over_users)  # checkpoints of example-level plans still match


def test_a_user_plan_samples_users_and_clips_each_user_once():
    fmodel, params = _model()
    ids, x, y = _user_data()
    plan = DPPlan(**USER_PLAN, clip_backend="auto")
    sampler = plan.sampler(x, key(1), user_ids=ids)
    assert isinstance(sampler, UserPoissonSampler) and sampler.max_examples == 4
    batch_loss = lambda p, xb, yb: F.cross_entropy(fmodel(p, xb), yb, reduction="none")  # noqa: E731
    pipeline = plan.pipeline(batch_loss, sgd(0.1), key=key(0), model=fmodel)
    state = pipeline.init(params)
    groups = sampler.batch(0)
    blocks, mask = collate_users((x, y), groups, max_examples=4)
    updates, state = pipeline.update((*blocks, mask), state, params)
    assert all(torch.isfinite(u).all() for u in updates)
    # the clip stage alone equals the float64 per-user loop (divided by the expected users per step)
    stage = clip(batched_user_loss(batch_loss), clipping_norm=0.5, batch_argnums=(1, 2, 3), clip_backend="auto",
                 model=fmodel, normalize_by=plan.batch_size)
    out, _ = stage.update((*blocks, mask), stage.init(params), params)
    for got, want in zip(out.pytree, _reference(fmodel, [p.detach().requires_grad_(True) for p in params], blocks,
                                                 mask, 0.5)):
        torch.testing.assert_close(got, want / plan.batch_size, rtol=1e-9, atol=1e-12)


def test_mixing_units_is_refused():
    fmodel, params = _model()
    ids, x, y = _user_data()
    user_plan = DPPlan(**USER_PLAN)
    pipeline = user_plan.pipeline(lambda p, xi, yi: F.cross_entropy(fmodel(p, xi[None]), yi[None]), sgd(0.1),
                                  key=key(0))
    with pytest.raises(InputValueError, match="user blocks and their mask"):  # an example-level batch
        pipeline.update((x[:5], y[:5], torch.ones(5, dtype=torch.bool)), pipeline.init(params), params)
    with pytest.raises(InputValueError, match="needs user_ids"):
        user_plan.sampler(x, key(1))
    with pytest.raises(InputValueError, match="31 users but the plan was made for dataset_size=30"):
        user_plan.sampler(torch.zeros(201), key(1), user_ids=torch.cat([ids, torch.tensor([99])]))
    example_plan = DPPlan(**{k: v for k, v in USER_PLAN.items() if k not in ("privacy_unit", "max_examples_per_user")})
    with pytest.raises(InputValueError, match="applies to privacy_unit='user'"):
        example_plan.sampler(range(30), key(1), user_ids=ids)
    with pytest.raises(InputValueError, match="needs max_examples_per_user"):
        DPPlan(**{**USER_PLAN, "max_examples_per_user": None})
    with pytest.raises(InputValueError, match="sampling='truncated_poisson'"):
        DPPlan(**USER_PLAN, sampling="truncated_poisson", max_batch_size=10)
    with pytest.raises(InputValueError, match="max_examples_per_user applies to privacy_unit='user'"):
        DPPlan(**{**USER_PLAN, "privacy_unit": "example"})


def test_a_user_plan_trains_and_its_sampler_checkpoints():
    import tempfile

    fmodel, params = _model()
    ids, x, y = _user_data()
    plan = DPPlan(**USER_PLAN)
    pipeline = plan.pipeline(lambda p, xi, yi: F.cross_entropy(fmodel(p, xi[None]), yi[None]), sgd(0.1), key=key(0))
    sampler, acct, state = plan.sampler(x, key(1), user_ids=ids), plan.accountant(), pipeline.init(params)
    for t, groups in zip(range(2), sampler):
        acct.step(plan.step_cost_at(t))
        blocks, mask = collate_users((x, y), groups, max_examples=4)
        updates, state = pipeline.update((*blocks, mask), state, params)
        params = apply_updates(params, updates)
    path = tempfile.mkdtemp() + "/run.pt"
    assert plan.save_checkpoint(path, params=params, state=state, sampler=sampler, accountant=acct) == 2
    back = plan.load_checkpoint(path, params=params, state=pipeline.init(params),
                                sampler=plan.sampler(x, key(1), user_ids=ids), accountant=plan.accountant())
    assert back["sampler"].next_step == 2 and back["sampler"].batch(3) == sampler.batch(3)


# --- example-level sampling with a per-user cap (ELS) and group privacy ------------------

from opake_fx.accounting import group_delta, group_epsilon  # noqa: E402
from opake_fx.dpsgd.accounting import gaussian, poisson  # noqa: E402
from opake_fx.users import cap_examples_per_user, user_epsilon_of_examples  # noqa: E402


def test_group_delta_is_the_lemmas_sum():
    for eps, d, k in [(0.3, 1e-7, 5), (2.0, 1e-9, 3), (1e-9, 1e-6, 4)]:
        assert math.isclose(group_delta(eps, d, k), d * sum(math.exp(i * eps) for i in range(k)), rel_tol=1e-12)
    # a large group at a large epsilon: the sum overflows a float; the delta is 1 (no guarantee), never a crash
    assert group_delta(50.0, 1e-6, 32) == 1.0 and group_delta(800.0, 1e-300, 2) == 1.0
    assert group_epsilon(poisson(gaussian(0.5), 0.1) * 100, 64, 1e-5, method="lemma") == math.inf


@pytest.mark.parametrize("k", [2, 4])
def test_group_epsilon_bounds_the_exact_group_mechanism_and_is_the_lemmas_best(k):
    """Unsampled Gaussian: a group of k moves the sum by k * C, exactly gaussian(sigma / k). The lemma's
    epsilon must be at least that exact one (validity), and equal to a direct search over example deltas."""
    sigma, delta = 6.0, 1e-6
    got = group_epsilon(gaussian(sigma), k, delta, method="lemma")
    exact = gaussian(sigma / k).epsilon_at(delta)
    assert got >= exact and group_epsilon(gaussian(sigma), k, delta) == min(got, group_epsilon(
        gaussian(sigma), k, delta, method="rdp"))
    direct = min(k * gaussian(sigma).epsilon_at(d) for d in (delta / k * 10 ** (-24 * j / 96) for j in range(97))
                 if group_delta(gaussian(sigma).epsilon_at(d), d, k) <= delta)
    assert got == direct


def test_els_caps_users_and_measures_the_group_from_the_data():
    ids = [0] * 30 + [1] * 5 + [2] * 2
    users = UserIndex(ids)
    kept = cap_examples_per_user(users, 4, key(9))
    assert kept == sorted(kept) and len(kept) == 4 + 4 + 2
    assert set(kept) >= {35, 36} and len(set(kept) & set(range(30))) == 4
    capped = UserIndex([ids[i] for i in kept])
    run = poisson(gaussian(3.0), 0.05) * 50
    capped_eps = user_epsilon_of_examples(run, capped, 1e-5)
    assert capped_eps == group_epsilon(run, 4, 1e-5) < math.inf
    # the uncapped data: the group is the user with 30 examples, never 4 (the lemma gives nothing for it; RDP's
    # group property a large but finite epsilon)
    assert user_epsilon_of_examples(run, users, 1e-5) == group_epsilon(run, 30, 1e-5) > 10 * capped_eps
    assert group_epsilon(run, 30, 1e-5, method="lemma") == math.inf


def test_sampling_users_protects_a_user_better_than_capping_examples_at_the_same_noise():
    """1000 users with k = 8 examples each, 512 examples a step either way (64 users x 8, or 512 examples),
    the same noise multiplier: per user, ULS costs one unit's epsilon, ELS a group of 8's."""
    n_users, k, sigma, steps = 1000, 8, 4.0, 200
    uls = (poisson(gaussian(sigma), 64 / n_users) * steps).epsilon_at(1e-6)
    els = group_epsilon(poisson(gaussian(sigma), 512 / (n_users * k)) * steps, k, 1e-6)
    assert 3 * uls < els < math.inf


# --- RDP's group property (Mironov 2017, Proposition 2) ----------------------------------

from opake_fx.accounting import group_rdp  # noqa: E402
from opake_fx.accounting.rdp import DEFAULT_RDP_ORDERS  # noqa: E402


@pytest.mark.parametrize("k", [2, 3, 4, 8])
def test_the_rdp_group_curve_bounds_the_exact_curve_of_a_group(k):
    """A group of k moves an unsampled Gaussian sum by k * C: its exact RDP is k^2 a / (2 sigma^2) at every
    order a. The group curve (3^c r(2^c a) at order a, c = ceil(log2 k)) must never be below it."""
    sigma = 3.0
    orders, curve = group_rdp(gaussian(sigma), k)
    c = (k - 1).bit_length()
    assert orders.min() >= 2 and len(orders) == sum(a >= 2 ** (c + 1) for a in DEFAULT_RDP_ORDERS)
    exact = k * k * orders / (2 * sigma**2)
    assert (curve >= exact * (1 - 1e-12)).all()
    assert group_epsilon(gaussian(sigma), k, 1e-6, method="rdp") >= gaussian(sigma / k).epsilon_at(1e-6)


def test_group_epsilon_takes_the_smaller_valid_route_and_the_rdp_route_covers_large_groups():
    run = poisson(gaussian(1.0), 0.01) * 1000
    lemma, rdp = (group_epsilon(run, 16, 1e-6, method=m) for m in ("lemma", "rdp"))
    assert lemma == math.inf and math.isfinite(rdp) and group_epsilon(run, 16, 1e-6) == rdp
    small = poisson(gaussian(3.0), 0.05) * 200
    lemma, rdp = (group_epsilon(small, 4, 1e-6, method=m) for m in ("lemma", "rdp"))
    assert group_epsilon(small, 4, 1e-6) == min(lemma, rdp) < math.inf
    with pytest.raises(InputValueError, match="method"):
        group_epsilon(small, 4, 1e-6, method="shortest")


# --- ELS as a plan value: DPPlan(privacy_unit="user", user_sampling="examples") ----------

ELS_IDS = torch.tensor([0] * 30 + [1] * 5 + [2] * 2 + list(range(3, 40)))  # 40 users, one with 30 examples
ELS_KEPT = UserIndex(ELS_IDS).capped_size(4)  # 4 + 4 + 2 + 37 = 47
ELS_PLAN = dict(dataset_size=ELS_KEPT, batch_size=10, steps=30, clipping_norm=0.5, target_epsilon=8.0, delta=1e-5,
                privacy_unit="user", max_examples_per_user=4, user_sampling="examples")


def test_an_els_plan_is_calibrated_per_user_by_group_privacy_and_reports_both_units():
    plan = DPPlan(**ELS_PLAN)
    as_examples = DPPlan(**{k: v for k, v in ELS_PLAN.items() if k not in (
        "privacy_unit", "max_examples_per_user", "user_sampling", "target_epsilon")}, noise_multiplier=plan.noise_multiplier)
    run = as_examples.run_cost(plan.noise_multiplier, plan.steps)
    e = plan.epsilons()
    assert e["per_user"] == plan.epsilon() == group_epsilon(run, 4, 1e-5) <= 8.0
    assert e["per_example"] == as_examples.epsilon() < e["per_user"] / 4
    # calibrated to the per-user target: 1% less noise would miss it
    assert group_epsilon(as_examples.run_cost(plan.noise_multiplier * 0.99, plan.steps), 4, 1e-5) > 8.0
    assert plan.epsilon_unit == "per user" and as_examples.epsilon_unit == "per example"
    acct = plan.accountant()
    for t in range(plan.steps):
        acct.step(plan.step_cost_at(t))
    spent = plan.spent_epsilons(acct)
    assert math.isclose(spent["per_user"], e["per_user"], rel_tol=1e-3) and "per example" in repr(acct)
    assert DPPlan(**plan.to_dict()) == plan


def test_an_els_sampler_keeps_the_same_k_examples_of_a_user_for_the_whole_run_and_shards_them():
    plan = DPPlan(**{**ELS_PLAN, "batch_size": 40})
    data = range(len(ELS_IDS))
    seen: dict[int, set[int]] = {}
    for batch in plan.sampler(data, key(3), user_ids=ELS_IDS):
        for i in batch:
            seen.setdefault(int(ELS_IDS[i]), set()).add(i)
    assert len(seen[0]) == 4 and seen[0] <= set(range(30))  # never more than k of the big user over the run
    assert seen[1] <= set(range(30, 35)) and len(seen[1]) == 4 and seen[2] == {35, 36}
    ranks = [plan.sampler(data, key(3), rank=r, world_size=2, user_ids=ELS_IDS) for r in (0, 1)]
    kept = cap_examples_per_user(UserIndex(ELS_IDS), 4, split(key(3))[0])
    assert ranks[0].indices == ranks[1].indices == kept  # one cap for every rank
    first = set(ranks[0].indices[: ranks[1].start])
    for t in range(5):
        a, b = ranks[0].batch(t), ranks[1].batch(t)
        assert set(a) <= first and not set(b) & first  # disjoint shards of the kept examples


def test_an_els_plan_refuses_what_its_accounting_does_not_cover():
    with pytest.raises(InputValueError, match="keeps 47 examples but the plan was made for dataset_size=74"):
        DPPlan(**{**ELS_PLAN, "dataset_size": len(ELS_IDS)}).sampler(range(len(ELS_IDS)), key(0), user_ids=ELS_IDS)
    with pytest.raises(InputValueError, match="user_sampling applies to privacy_unit='user'"):
        DPPlan(dataset_size=50, batch_size=5, steps=3, noise_multiplier=1.0, delta=1e-5, user_sampling="examples")
    with pytest.raises(InputValueError, match="clipping_mode='fixed' or 'auto'"):
        DPPlan(**ELS_PLAN, clipping_mode="adaptive")
    with pytest.raises(InputValueError, match="user_sampling"):
        DPPlan(**{**ELS_PLAN, "user_sampling": "households"})
    uls = DPPlan(**{**USER_PLAN, "user_sampling": "users"})
    with pytest.raises(InputValueError, match="do not mix"):  # an example-counting accountant for a per-user plan
        uls.spent_epsilons(DPPlan(**ELS_PLAN).accountant())
    with pytest.raises(InputValueError, match="does not meet target_epsilon=8.0 per user"):
        DPPlan(**ELS_PLAN, noise_multiplier=0.5)


def test_a_user_pipelines_privacy_report_says_per_user_and_an_example_pipelines_per_example():
    fmodel, _ = _model()
    plan = DPPlan(**USER_PLAN)
    one = lambda p, xi, yi: F.cross_entropy(fmodel(p, xi[None]), yi[None])  # noqa: E731
    report = plan.pipeline(one, sgd(0.1), key=key(0)).privacy_report(sample_rate=plan.sample_rate, steps=plan.steps,
                                                                       delta=plan.delta)
    assert report.unit == "user" and "epsilon per user: " in str(report) and "per-user clipping" in str(report)
    assert math.isclose(report.epsilon, plan.epsilon(), rel_tol=1e-6)
    example = DPPlan(**{k: v for k, v in USER_PLAN.items() if k not in ("privacy_unit", "max_examples_per_user")})
    assert "epsilon per example: " in str(example.pipeline(one, sgd(0.1), key=key(1)).privacy_report(
        sample_rate=0.2, steps=5, delta=1e-5))
