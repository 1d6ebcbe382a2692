"""Tests of opake_fx.optimizers: torch.optim as the oracle, purity, DP wrappers, bias correction, errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.optimizers import AdamState, SgdState, adam, adamw, sgd
from opake_fx.pytree import tree_map
from opake_fx.random import key, normal
from opake_fx.scheduling import cosine, linear, with_warmup
from opake_fx.transforms import apply_updates, chain, named_chain, stateless
from opake_fx.types import ClippedPytree, NoisedPytree, PerGroup

STEPS = 8


def _params(dtype=torch.float32):
    return {
        "w": normal(key(0), (3, 4), dtype=dtype, exact=True),
        "b": normal(key(1), (4,), dtype=dtype, exact=True),
    }


def _grads(step, dtype=torch.float32):
    return {
        "w": normal(key(100 + step), (3, 4), dtype=dtype, exact=True),
        "b": normal(key(200 + step), (4,), dtype=dtype, exact=True),
    }


def _run_ours(opt, params, dtype):
    state = opt.init(params)
    history = []
    for t in range(STEPS):
        updates, state = opt.update(_grads(t, dtype), state, params)
        params = apply_updates(params, updates)
        history.append(params)
    return history, state


def _run_torch(make, params, dtype, schedule=None):
    tensors = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    opt = make(list(tensors.values()))
    history = []
    for t in range(STEPS):
        if schedule is not None:
            for group in opt.param_groups:
                group["lr"] = schedule(t)
        grads = _grads(t, dtype)
        for name, p in tensors.items():
            p.grad = grads[name].clone()
        opt.step()
        history.append({k: v.detach().clone() for k, v in tensors.items()})
    return history


CASES = [
    ("sgd", lambda lr: sgd(lr), lambda ps, lr: torch.optim.SGD(ps, lr=lr)),
    ("sgd-wd", lambda lr: sgd(lr, weight_decay=0.1), lambda ps, lr: torch.optim.SGD(ps, lr=lr, weight_decay=0.1)),
    ("momentum", lambda lr: sgd(lr, momentum=0.9), lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9)),
    (
        "nesterov-wd",
        lambda lr: sgd(lr, momentum=0.8, nesterov=True, weight_decay=0.05),
        lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.8, nesterov=True, weight_decay=0.05),
    ),
    ("adam", lambda lr: adam(lr), lambda ps, lr: torch.optim.Adam(ps, lr=lr)),
    (
        "adam-wd",
        lambda lr: adam(lr, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.1),
        lambda ps, lr: torch.optim.Adam(ps, lr=lr, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    ),
    ("adamw", lambda lr: adamw(lr), lambda ps, lr: torch.optim.AdamW(ps, lr=lr)),
    (
        "adamw-wd",
        lambda lr: adamw(lr, b1=0.5, b2=0.9, eps=1e-7, weight_decay=0.3),
        lambda ps, lr: torch.optim.AdamW(ps, lr=lr, betas=(0.5, 0.9), eps=1e-7, weight_decay=0.3),
    ),
]


@pytest.mark.parametrize(("name", "ours", "theirs"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_torch_optim(name, ours, theirs, dtype):
    lr = 0.05
    params = _params(dtype)
    got, state = _run_ours(ours(lr), params, dtype)
    want = _run_torch(lambda ps: theirs(ps, lr), params, dtype)
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    for g, w in zip(got, want):
        for k in g:
            torch.testing.assert_close(g[k], w[k], atol=tol, rtol=tol)
    assert state.count == STEPS


@pytest.mark.parametrize(("name", "ours", "theirs"), CASES, ids=[c[0] for c in CASES])
def test_matches_torch_optim_with_a_schedule(name, ours, theirs):
    schedule = with_warmup(cosine(0.1, decay_steps=5, alpha=0.1), warmup_steps=3, init_value=0.01)
    params = _params(torch.float64)
    got, _ = _run_ours(ours(schedule), params, torch.float64)
    want = _run_torch(lambda ps: theirs(ps, 1.0), params, torch.float64, schedule=schedule)
    for g, w in zip(got, want):
        for k in g:
            torch.testing.assert_close(g[k], w[k], atol=1e-12, rtol=1e-12)


MASKED = [
    ("sgd", lambda lr, m: sgd(lr, momentum=0.5, weight_decay=0.2, mask=m),
     lambda groups, lr: torch.optim.SGD(groups, lr=lr, momentum=0.5)),
    ("adam", lambda lr, m: adam(lr, weight_decay=0.2, mask=m), lambda groups, lr: torch.optim.Adam(groups, lr=lr)),
    ("adamw", lambda lr, m: adamw(lr, weight_decay=0.2, mask=m), lambda groups, lr: torch.optim.AdamW(groups, lr=lr)),
]


@pytest.mark.parametrize(("name", "ours", "theirs"), MASKED, ids=[c[0] for c in MASKED])
@pytest.mark.parametrize("as_callable", [False, True])
def test_a_weight_decay_mask_is_torchs_zero_decay_param_group(name, ours, theirs, as_callable):
    # torch's oracle: "w" in a group with weight_decay=0.2, "b" in one with weight_decay=0 (Hugging Face's split)
    params = _params(torch.float64)
    mask = (lambda p: {k: k == "w" for k in p}) if as_callable else {"w": True, "b": False}
    got, _ = _run_ours(ours(0.05, mask), params, torch.float64)
    tensors = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    opt = theirs([{"params": [tensors["w"]], "weight_decay": 0.2}, {"params": [tensors["b"]], "weight_decay": 0.0}], 0.05)
    for t in range(STEPS):
        for k, g in _grads(t, torch.float64).items():
            tensors[k].grad = g.clone()
        opt.step()
        for k in tensors:
            torch.testing.assert_close(got[t][k], tensors[k].detach(), atol=1e-12, rtol=1e-12)
    unmasked, _ = _run_ours(ours(0.05, None), params, torch.float64)  # without the mask "b" decays too
    assert not torch.allclose(unmasked[-1]["b"], got[-1]["b"], atol=1e-6)
    torch.testing.assert_close(unmasked[-1]["w"], got[-1]["w"], atol=1e-12, rtol=1e-12)


def test_a_weight_decay_mask_of_another_structure_or_not_bools_is_refused():
    params = _params()
    for mask, error, match in (({"w": True}, InputValueError, "structure"),
                               ({"w": True, "b": 0}, InputTypeError, "bools"),
                               (lambda p: [True, False], InputValueError, "structure")):
        opt = adamw(0.1, weight_decay=0.1, mask=mask)
        with pytest.raises(error, match=match):
            opt.update(_grads(0), opt.init(params), params)


def test_schedule_is_called_with_the_update_count():
    seen = []

    def schedule(step):
        seen.append(step)
        return 1.0

    opt = sgd(schedule)
    state = opt.init(None)
    for _ in range(3):
        _, state = opt.update([torch.ones(1)], state)
    assert seen == [0, 1, 2]


def test_first_update_values():
    # Hand-computed: Adam's first step is -lr * sign(g) (up to eps); SGD's is -lr * g.
    g = [torch.tensor([2.0, -0.5, 0.0])]
    p = [torch.zeros(3)]
    u, _ = adam(0.1).update(g, adam(0.1).init(p), p)
    torch.testing.assert_close(u[0], torch.tensor([-0.1, 0.1, 0.0]), atol=1e-7, rtol=0)
    u, _ = sgd(0.1).update(g, sgd(0.1).init(None))
    torch.testing.assert_close(u[0], torch.tensor([-0.2, 0.05, -0.0]))


OPTIMIZERS = [
    sgd(0.1),
    sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.1),
    adam(0.1, weight_decay=0.1),
    adamw(0.1),
    adam(0.1, dp_bias_correction=0.01),
]


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_update_is_pure(opt):
    params = _params()
    grads = _grads(0)
    params_copy = tree_map(torch.clone, params)
    grads_copy = tree_map(torch.clone, grads)
    state = opt.init(params)
    _, state1 = opt.update(grads, state, params)  # gives the state some history
    state1_copy = tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, vars(state1))
    updates, state2 = opt.update(grads, state1, params)
    for a, b in ((params, params_copy), (grads, grads_copy)):
        for k in a:
            assert torch.equal(a[k], b[k])
    for field, value in vars(state1).items():
        if value is not None and not isinstance(value, int):
            for k in value:
                assert torch.equal(value[k], state1_copy[field][k])
    # Same inputs, same outputs: nothing hidden in the closure.
    again, _ = opt.update(grads, state1, params)
    for k in updates:
        assert torch.equal(updates[k], again[k])
        assert updates[k].data_ptr() not in (params[k].data_ptr(), grads[k].data_ptr())


@settings(max_examples=20, deadline=None)
@given(
    values=st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=1, max_size=6),
    lr=st.floats(0.0, 1.0),
)
def test_purity_property(values, lr):
    g = (torch.tensor(values),)
    p = (torch.tensor(values[::-1]),)
    g0, p0 = g[0].clone(), p[0].clone()
    for opt in (sgd(lr, momentum=0.5, weight_decay=0.1), adamw(lr)):
        opt.update(g, opt.init(p), p)
    assert torch.equal(g[0], g0) and torch.equal(p[0], p0)


@pytest.mark.parametrize("opt_fn", [lambda: sgd(0.1, momentum=0.9), lambda: adam(0.01), lambda: adamw(0.01)])
def test_noised_wrappers_are_accepted_and_un_noised_clipped_ones_refused(opt_fn):
    params = _params()
    plain = _grads(0)
    noised = NoisedPytree(plain, max_norm=0.5, noise_stddev=1.0)
    outs = []
    for g in (plain, noised):
        opt = opt_fn()
        updates, _ = opt.update(g, opt.init(params), params)
        assert isinstance(updates, dict)
        outs.append(updates)
    for k in outs[1]:
        assert torch.equal(outs[1][k], outs[0][k])
    opt = opt_fn()
    with pytest.raises(InputTypeError, match="ClippedPytree that was never noised"):
        opt.update(ClippedPytree(plain, max_norm=0.5), opt.init(params), params)


def test_in_a_chain_with_extras_ignored():
    params = [torch.ones(2)]
    pipeline = named_chain(("double", stateless(lambda g, params=None: [2 * x for x in g])), ("opt", sgd(0.1)))
    updates, state = pipeline.update([torch.ones(2)], pipeline.init(params), params, step=3, anything="x")
    assert updates[0].tolist() == pytest.approx([-0.2, -0.2])
    assert isinstance(state["opt"], SgdState) and state["opt"].count == 1
    c = chain(adam(0.1))
    _, s = c.update([torch.ones(2)], c.init(params), params)
    assert isinstance(s[0], AdamState)


# --- DP bias correction (DP-AdamBC) ---------------------------------------------------


def _reference_adambc(grads_seq, lr, b1, b2, phi, gamma, params):
    """Tang et al. 2024, Algorithm 1, written out per coordinate in float64."""
    m = torch.zeros_like(params)
    v = torch.zeros_like(params)
    p = params.clone()
    for t, g in enumerate(grads_seq, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g**2
        m_hat = m / (1 - b1**t)
        v_hat = v / (1 - b2**t)
        p = p - lr * m_hat / torch.sqrt(torch.clamp(v_hat - phi, min=gamma))
    return p


@pytest.mark.parametrize("mode", ["float", "auto"])
def test_dp_bias_correction_matches_the_paper(mode):
    sd = 0.3
    params = torch.linspace(-1, 1, 7, dtype=torch.float64)
    seq = [normal(key(t), (7,), dtype=torch.float64) * 0.5 + sd * normal(key(50 + t), (7,), dtype=torch.float64) for t in range(6)]
    opt = adam(0.01, b1=0.9, b2=0.99, dp_bias_correction=sd**2 if mode == "float" else "auto", dp_bias_correction_gamma=1e-4)
    p = (params,)
    state = opt.init(p)
    for g in seq:
        updates, state = opt.update(NoisedPytree((g,), max_norm=1.0, noise_stddev=sd), state, p)
        p = apply_updates(p, updates)
    want = _reference_adambc(seq, 0.01, 0.9, 0.99, sd**2, 1e-4, params)
    torch.testing.assert_close(p[0], want, atol=1e-12, rtol=1e-12)


def test_dp_bias_correction_changes_the_step_and_zero_phi_is_nearly_adam():
    g = [torch.tensor([0.5, -0.2, 0.05], dtype=torch.float64)]
    p = [torch.zeros(3, dtype=torch.float64)]
    plain, _ = adam(0.1, eps=0.0).update(g, adam(0.1).init(p), p)
    zero_phi, _ = adam(0.1, dp_bias_correction=0.0, dp_bias_correction_gamma=1e-30).update(g, adam(0.1).init(p), p)
    torch.testing.assert_close(zero_phi[0], plain[0], atol=1e-12, rtol=1e-9)
    # With Phi above v_hat = g**2 the floor takes over: the step is lr * g / sqrt(gamma).
    floored, _ = adam(0.1, dp_bias_correction=1.0, dp_bias_correction_gamma=1.0).update(g, adam(0.1).init(p), p)
    torch.testing.assert_close(floored[0], -0.1 * g[0], atol=1e-12, rtol=1e-12)


def test_dp_bias_correction_per_group_stddev():
    grads = {"w": torch.full((2,), 0.5, dtype=torch.float64), "b": torch.full((2,), 0.5, dtype=torch.float64)}
    params = tree_map(torch.zeros_like, grads)
    sd = PerGroup({"w": "dense", "b": "bias"}, {"dense": 0.4, "bias": 0.1})
    opt = adamw(1.0, weight_decay=0.0, dp_bias_correction="auto", dp_bias_correction_gamma=1e-12)
    updates, _ = opt.update(NoisedPytree(grads, max_norm=1.0, noise_stddev=sd), opt.init(params), params)
    # First step: m_hat = g, v_hat = g**2, so the update is -g / sqrt(g**2 - sd**2).
    torch.testing.assert_close(updates["w"], torch.full((2,), -0.5 / math.sqrt(0.25 - 0.16), dtype=torch.float64))
    torch.testing.assert_close(updates["b"], torch.full((2,), -0.5 / math.sqrt(0.25 - 0.01), dtype=torch.float64))


def test_dp_bias_correction_errors():
    p = [torch.zeros(2)]
    g = [torch.ones(2)]
    opt = adam(0.1, dp_bias_correction="auto")
    with pytest.raises(InputTypeError, match="NoisedPytree"):
        opt.update(g, opt.init(p), p)
    with pytest.raises(InputTypeError, match="noise_stddev=None"):
        opt.update(NoisedPytree(g, max_norm=1.0), opt.init(p), p)
    mismatched = adam(0.1, dp_bias_correction=0.5)  # a stddev passed where a variance is expected
    with pytest.raises(InputValueError, match="variance"):
        mismatched.update(NoisedPytree(g, max_norm=1.0, noise_stddev=0.5), mismatched.init(p), p)
    ok = adam(0.1, dp_bias_correction=0.25)
    ok.update(NoisedPytree(g, max_norm=1.0, noise_stddev=0.5), ok.init(p), p)
    with pytest.raises(InputValueError, match="'auto'"):
        adam(0.1, dp_bias_correction="yes")
    with pytest.raises(InputValueError, match=">= 0"):
        adam(0.1, dp_bias_correction=-1.0)
    with pytest.raises(InputValueError, match="gamma > 0"):
        adam(0.1, dp_bias_correction=0.1, dp_bias_correction_gamma=0.0)


# --- errors ------------------------------------------------------------------------------


def test_weight_decay_needs_params():
    g = [torch.ones(2)]
    for opt, p in ((sgd(0.1, weight_decay=0.1), None), (adam(0.1, weight_decay=0.1), [torch.ones(2)]), (adamw(0.1), [torch.ones(2)])):
        state = opt.init(p)
        with pytest.raises(InputValueError, match=r"update\(grads, state, params\)"):
            opt.update(g, state)


def test_init_needs_params_when_state_has_moments():
    with pytest.raises(InputValueError, match=r"init\(params\)"):
        adam(0.1).init(None)
    with pytest.raises(InputValueError, match=r"init\(params\)"):
        sgd(0.1, momentum=0.9).init(None)
    assert sgd(0.1).init(None) == SgdState(count=0)


def test_bad_hyperparameters():
    with pytest.raises(InputValueError, match="learning_rate"):
        sgd(-0.1)
    with pytest.raises(InputTypeError, match="learning_rate"):
        sgd("0.1")
    with pytest.raises(InputValueError, match="momentum > 0"):
        sgd(0.1, nesterov=True)
    with pytest.raises(InputValueError, match="b1"):
        adam(0.1, b1=1.0)
    with pytest.raises(InputValueError, match="b2"):
        adamw(0.1, b2=-0.1)
    with pytest.raises(InputValueError, match="eps"):
        adam(0.1, eps=float("nan"))


def test_bad_update_inputs():
    p = [torch.zeros(2)]
    opt = adam(0.1)
    with pytest.raises(InputTypeError, match="AdamState"):
        opt.update([torch.ones(2)], SgdState(count=0), p)
    with pytest.raises(InputValueError, match="tree structure"):
        opt.update([torch.ones(2), torch.ones(2)], opt.init(p), p)
    with pytest.raises(InputTypeError, match="tensors"):
        opt.update([1.0], opt.init(p), p)
    bad = sgd(lambda step: -1.0)
    with pytest.raises(InputValueError, match="schedule returned -1.0 at step 0"):
        bad.update(p, bad.init(None))
    linear_lr = sgd(linear(0.1, 0.0, 2))
    s = linear_lr.init(None)
    for _ in range(4):  # past the end of the schedule: lr stays 0
        u, s = linear_lr.update([torch.ones(1)], s)
    assert u[0].item() == 0.0
