"""Tests of opake_fx.optim_primitives and of sgd/adam/adamw rebuilt from them.

The rebuilt optimizers are held to ``torch.equal`` against a verbatim copy of the update
arithmetic they replaced (``_reference_sgd``, ``_reference_adam``), over many configurations
and 12 steps; the primitives are tested alone, in hand-built chains, and against torch.optim.
"""

from __future__ import annotations

import math

import optree
import pytest
import torch

from opake_fx.errors import InputTypeError, InputValueError, OperationError
from opake_fx.optim_primitives import (
    ScaleByAdamState,
    ScheduleState,
    TraceState,
    add_decayed_weights,
    add_decoupled_weight_decay,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_private_second_moment,
    trace,
)
from opake_fx.optimizers import AdamState, SgdState, adam, adamw, sgd
from opake_fx.pytree import NAMESPACE, tree_flatten_with_paths, zeros_like
from opake_fx.random import key, normal
from opake_fx.scheduling import cosine, with_warmup
from opake_fx.transforms import Transform, apply_updates, chain, unwrap
from opake_fx.types import ClippedPytree, EmptyState, NoisedPytree, PerGroup, SecondMomentNoiseOutput

STEPS = 12
SCHEDULE = with_warmup(cosine(0.1, decay_steps=6, alpha=0.1), warmup_steps=3, init_value=0.01)

# --- today's optimizers (opake_fx/optimizers.py at 7b0d52a), the update arithmetic copied verbatim ---------------------
# The validation is left out; what is kept is every tensor operation, in its order, so that the rebuilt
# optimizers can be held to torch.equal against it.


def _ref_flatten(grads):
    paths, leaves, spec = tree_flatten_with_paths(unwrap(grads))
    return leaves, spec, paths


def _ref_lr(learning_rate, count):
    return float(learning_rate(count)) if callable(learning_rate) else float(learning_rate)


def _ref_decay_mask(mask, params, spec):
    if mask is None:
        return [True] * spec.num_leaves
    tree = mask(params) if callable(mask) else mask
    return list(optree.tree_leaves(tree, namespace=NAMESPACE))


def _ref_param_leaves(params):
    return optree.tree_leaves(unwrap(params), namespace=NAMESPACE)


def _ref_noise_variances(grads, paths, setting):
    if setting == "auto":
        sd = grads.noise_stddev
        if isinstance(sd, PerGroup):
            return [sd.for_path(p) ** 2 for p in paths]
        return [float(sd) ** 2] * len(paths)
    return [float(setting)] * len(paths)


def _reference_sgd(learning_rate, momentum=0.0, nesterov=False, weight_decay=0.0, *, mask=None):
    def init(params):
        if momentum == 0.0:
            return SgdState(count=0)
        return SgdState(count=0, momentum=zeros_like(params))

    def update(grads, state, params=None):
        lr = _ref_lr(learning_rate, state.count)
        g_leaves, spec, _ = _ref_flatten(grads)
        if weight_decay != 0.0:
            p_leaves = _ref_param_leaves(params)
            decayed = _ref_decay_mask(mask, params, spec)
            g_leaves = [g + weight_decay * p if d else g for g, p, d in zip(g_leaves, p_leaves, decayed)]
        new_buf = None
        if momentum != 0.0:
            b_leaves = optree.tree_leaves(state.momentum, namespace=NAMESPACE)
            b_leaves = [momentum * b + g for b, g in zip(b_leaves, g_leaves)]
            d_leaves = [g + momentum * b for g, b in zip(g_leaves, b_leaves)] if nesterov else b_leaves
            new_buf = optree.tree_unflatten(spec, b_leaves)
        else:
            d_leaves = g_leaves
        updates = optree.tree_unflatten(spec, [-lr * d for d in d_leaves])
        return updates, SgdState(count=state.count + 1, momentum=new_buf)

    return init, update


def _reference_adam(learning_rate, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, decoupled=False, *,
                    dp_bias_correction=None, dp_bias_correction_gamma=1e-8, mask=None):
    gamma = dp_bias_correction_gamma
    gamma_floor = gamma if gamma > 0 else 1e-8

    def init(params):
        return AdamState(count=0, mu=zeros_like(params), nu=zeros_like(params))

    def update(grads, state, params=None):
        lr = _ref_lr(learning_rate, state.count)
        squares = None
        if isinstance(grads, SecondMomentNoiseOutput):
            squares, sq_spec, _ = _ref_flatten(grads.noisy_squared_grads)
            grads = grads.noisy_grads
        g_leaves, spec, paths = _ref_flatten(grads)
        phis = None if dp_bias_correction is None else _ref_noise_variances(grads, paths, dp_bias_correction)
        p_leaves = None
        decayed = [False] * len(g_leaves)
        if weight_decay != 0.0:
            p_leaves = _ref_param_leaves(params)
            decayed = _ref_decay_mask(mask, params, spec)
            if not decoupled:
                if squares is not None:  # the squares of g + wd * p, from the two private streams
                    squares = [
                        s + 2.0 * weight_decay * p * g + (weight_decay * p) ** 2 if d else s
                        for s, g, p, d in zip(squares, g_leaves, p_leaves, decayed)
                    ]
                g_leaves = [g + weight_decay * p if d else g for g, p, d in zip(g_leaves, p_leaves, decayed)]
        m_leaves = optree.tree_leaves(state.mu, namespace=NAMESPACE)
        v_leaves = optree.tree_leaves(state.nu, namespace=NAMESPACE)
        m_leaves = [b1 * m + (1.0 - b1) * g for m, g in zip(m_leaves, g_leaves)]
        if squares is None:
            v_leaves = [b2 * v + (1.0 - b2) * (g * g) for v, g in zip(v_leaves, g_leaves)]
        else:
            v_leaves = [b2 * v + (1.0 - b2) * sq.to(v.dtype) for v, sq in zip(v_leaves, squares)]
        t = state.count + 1
        bc1 = 1.0 - b1**t
        bc2 = 1.0 - b2**t
        step_size = lr / bc1
        out = []
        for i, (m, v) in enumerate(zip(m_leaves, v_leaves)):
            if squares is not None:
                denom = torch.clamp(v / bc2, min=gamma_floor).sqrt()
            elif phis is None:
                # torch.optim.Adam's order of operations, so the numbers agree to rounding.
                denom = v.sqrt() / math.sqrt(bc2) + eps
            else:
                denom = torch.clamp(v / bc2 - phis[i], min=gamma).sqrt()
            u = -step_size * (m / denom)
            if decoupled and p_leaves is not None and decayed[i]:
                u = u - (lr * weight_decay) * p_leaves[i]
            out.append(u)
        new_state = AdamState(count=t, mu=optree.tree_unflatten(spec, m_leaves), nu=optree.tree_unflatten(spec, v_leaves))
        return optree.tree_unflatten(spec, out), new_state

    return init, update


# --- trajectories: the rebuilt optimizers against the code they replaced --------------------------


def _params(dtype):
    return {"w": normal(key(0), (3, 4), dtype=dtype, exact=True), "b": normal(key(1), (4,), dtype=dtype, exact=True)}


def _tree(seed, dtype, scale=1.0):
    return {"w": scale * normal(key(seed), (3, 4), dtype=dtype, exact=True),
            "b": scale * normal(key(seed + 1), (4,), dtype=dtype, exact=True)}


PER_GROUP_SD = PerGroup({"w": "dense", "b": "bias"}, {"dense": 0.3, "bias": 0.1})


def _grads(kind, t, dtype):
    g = _tree(100 + 7 * t, dtype)
    if kind == "plain":
        return g
    if kind == "noised":
        return NoisedPytree(g, max_norm=1.0, noise_stddev=0.3)
    if kind == "per_group":
        return NoisedPytree(g, max_norm=1.0, noise_stddev=PER_GROUP_SD)
    # the private second moment: noised squares, some of them negative
    sq_dtype = torch.float64 if kind == "pair64" else dtype
    sq = {k: v * v - 0.3 * n for (k, v), n in zip(g.items(), _tree(500 + 7 * t, dtype).values())}
    sq = {k: v.to(sq_dtype) for k, v in sq.items()}
    return SecondMomentNoiseOutput(NoisedPytree(g, 1.0, noise_stddev=0.1), NoisedPytree(sq, 1.0, noise_stddev=0.2))


MASK = {"w": True, "b": False}
MASK_FN = lambda p: {k: k == "w" for k in p}  # noqa: E731

SGD_CONFIGS = [
    ("plain", dict(learning_rate=0.05), "plain"),
    ("wd", dict(learning_rate=0.05, weight_decay=0.1), "plain"),
    ("momentum", dict(learning_rate=0.05, momentum=0.9), "plain"),
    ("nesterov", dict(learning_rate=0.05, momentum=0.9, nesterov=True), "plain"),
    ("nesterov-wd", dict(learning_rate=0.05, momentum=0.8, nesterov=True, weight_decay=0.05), "plain"),
    ("momentum-wd-mask", dict(learning_rate=0.05, momentum=0.5, weight_decay=0.2, mask=MASK), "plain"),
    ("momentum-wd-mask-fn-schedule", dict(learning_rate=SCHEDULE, momentum=0.5, weight_decay=0.2, mask=MASK_FN), "plain"),
    ("schedule", dict(learning_rate=SCHEDULE), "plain"),
    ("noised-momentum-wd", dict(learning_rate=0.05, momentum=0.9, weight_decay=0.1), "noised"),
    ("noised-plain", dict(learning_rate=0.05), "noised"),
]

ADAM_CONFIGS = [
    ("plain", dict(learning_rate=0.01), "plain"),
    ("betas-eps-wd", dict(learning_rate=0.01, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.1), "plain"),
    ("wd-mask", dict(learning_rate=0.01, weight_decay=0.1, mask=MASK), "plain"),
    ("wd-mask-fn-schedule", dict(learning_rate=SCHEDULE, weight_decay=0.1, mask=MASK_FN), "plain"),
    ("eps0", dict(learning_rate=0.01, eps=0.0), "plain"),
    ("noised", dict(learning_rate=0.01, weight_decay=0.1), "noised"),
    ("bc-auto", dict(learning_rate=0.01, b2=0.99, dp_bias_correction="auto", dp_bias_correction_gamma=1e-4), "noised"),
    ("bc-float-noised", dict(learning_rate=0.01, dp_bias_correction=0.09, dp_bias_correction_gamma=1e-3), "noised"),
    ("bc-float-plain", dict(learning_rate=0.01, dp_bias_correction=0.05), "plain"),
    ("bc-auto-wd-schedule", dict(learning_rate=SCHEDULE, weight_decay=0.1, dp_bias_correction="auto"), "noised"),
    ("bc-auto-per-group-wd-mask", dict(learning_rate=0.01, weight_decay=0.1, mask=MASK, dp_bias_correction="auto",
                                       dp_bias_correction_gamma=1e-3), "per_group"),
    ("private-v", dict(learning_rate=0.01), "pair"),
    ("private-v-wd", dict(learning_rate=0.01, weight_decay=0.3), "pair"),
    ("private-v-wd-mask-schedule", dict(learning_rate=SCHEDULE, weight_decay=0.3, mask=MASK_FN), "pair"),
    ("private-v-gamma0", dict(learning_rate=0.01, weight_decay=0.3, dp_bias_correction_gamma=0.0), "pair"),
    ("private-v-gamma", dict(learning_rate=0.01, b1=0.5, dp_bias_correction_gamma=1e-2), "pair"),
    ("private-v-squares-float64", dict(learning_rate=0.01, weight_decay=0.3), "pair64"),
]
ADAMW_CONFIGS = [(n, {"weight_decay": 1e-2, **c}, k) for n, c, k in ADAM_CONFIGS] + [
    ("wd0", dict(learning_rate=0.01, weight_decay=0.0), "plain"),
    ("wd0-bc-auto", dict(learning_rate=0.01, weight_decay=0.0, dp_bias_correction="auto"), "noised"),
]


def _assert_trees_equal(a, b, what):
    la, sa = optree.tree_flatten(a, namespace=NAMESPACE)
    lb, sb = optree.tree_flatten(b, namespace=NAMESPACE)
    assert sa == sb, what
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and torch.equal(x, y), (what, (x - y).abs().max().item())


def _run_against_reference(opt, ref_init, ref_update, kind, dtype):
    params = _params(dtype)
    ref_params = params
    state, ref_state = opt.init(params), ref_init(params)
    for t in range(STEPS):
        updates, state = opt.update(_grads(kind, t, dtype), state, params)
        ref_updates, ref_state = ref_update(_grads(kind, t, dtype), ref_state, ref_params)
        _assert_trees_equal(updates, ref_updates, f"updates at step {t}")
        assert type(state) is type(ref_state) and state.count == ref_state.count == t + 1
        for field in vars(ref_state):
            if field != "count":
                _assert_trees_equal(getattr(state, field), getattr(ref_state, field), f"state.{field} at step {t}")
        params = apply_updates(params, updates)
        ref_params = apply_updates(ref_params, ref_updates)
    assert all(bool(torch.isfinite(p).all()) for p in params.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize(("name", "config", "kind"), SGD_CONFIGS, ids=[c[0] for c in SGD_CONFIGS])
def test_sgd_is_bit_identical_to_the_code_it_replaced(name, config, kind, dtype):
    ref_init, ref_update = _reference_sgd(**config)
    _run_against_reference(sgd(**config), ref_init, ref_update, kind, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize(("name", "config", "kind"), ADAM_CONFIGS, ids=[c[0] for c in ADAM_CONFIGS])
def test_adam_is_bit_identical_to_the_code_it_replaced(name, config, kind, dtype):
    ref_init, ref_update = _reference_adam(**config)
    _run_against_reference(adam(**config), ref_init, ref_update, kind, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize(("name", "config", "kind"), ADAMW_CONFIGS, ids=[c[0] for c in ADAMW_CONFIGS])
def test_adamw_is_bit_identical_to_the_code_it_replaced(name, config, kind, dtype):
    ref_init, ref_update = _reference_adam(decoupled=True, **config)
    _run_against_reference(adamw(**config), ref_init, ref_update, kind, dtype)


def test_a_schedule_is_called_with_the_update_count():
    # adamw evaluates it in two primitives (the Adam step and the decoupled decay): twice per update, same count
    for make, calls in ((lambda s: sgd(s, momentum=0.5, weight_decay=0.1), 1), (lambda s: adam(s, weight_decay=0.1), 1),
                        (lambda s: adamw(s, weight_decay=0.1), 2), (lambda s: adamw(s, weight_decay=0.0), 1)):
        seen = []

        def schedule(step, seen=seen):
            seen.append(step)
            return 0.1

        opt = make(schedule)
        params = _params(torch.float32)
        state = opt.init(params)
        for t in range(3):
            _, state = opt.update(_grads("plain", t, torch.float32), state, params)
        assert seen == [t for t in range(3) for _ in range(calls)]


# --- the primitives alone ------------------------------------------------------------------------


def test_trace_is_torch_momentum_and_nesterov_by_hand():
    g1, g2 = torch.tensor([1.0, -2.0], dtype=torch.float64), torch.tensor([0.5, 0.25], dtype=torch.float64)
    for nesterov in (False, True):
        t = trace(0.9, nesterov=nesterov)
        state = t.init([torch.zeros(2, dtype=torch.float64)])
        assert isinstance(state, TraceState)
        out1, state = t.update([g1], state)
        out2, state = t.update([g2], state)
        buf1, buf2 = g1, 0.9 * g1 + g2
        assert torch.equal(state.trace[0], buf2)
        assert torch.equal(out1[0], g1 + 0.9 * buf1 if nesterov else buf1)
        assert torch.equal(out2[0], g2 + 0.9 * buf2 if nesterov else buf2)
    with pytest.raises(InputValueError, match=r"init\(params\)"):
        trace(0.9).init(None)
    with pytest.raises(InputValueError, match="decay"):
        trace(-0.1)
    with pytest.raises(InputTypeError, match="TraceState"):
        trace(0.9).update([g1], ScheduleState(count=0))


def test_add_decayed_weights_masks_and_keeps_the_noised_wrapper():
    params = {"w": torch.ones(2), "b": torch.full((2,), 2.0)}
    grads = {"w": torch.zeros(2), "b": torch.zeros(2)}
    for mask in (None, MASK, MASK_FN):
        t = add_decayed_weights(0.5, mask)
        out, state = t.update(NoisedPytree(grads, max_norm=0.5, noise_stddev=PER_GROUP_SD), t.init(params), params)
        assert isinstance(out, NoisedPytree) and out.max_norm == 0.5 and out.noise_stddev == PER_GROUP_SD
        assert isinstance(state, EmptyState)
        assert out.pytree["w"].tolist() == [0.5, 0.5]
        assert out.pytree["b"].tolist() == ([1.0, 1.0] if mask is None else [0.0, 0.0])
    plain, _ = add_decayed_weights(0.5).update(grads, EmptyState(), params)
    assert type(plain) is dict
    same, _ = add_decayed_weights(0.0).update(grads, EmptyState())  # 0: no params needed, nothing touched
    assert same is grads
    with pytest.raises(InputValueError, match=r"update\(grads, state, params\)"):
        add_decayed_weights(0.5).update(grads, EmptyState())
    with pytest.raises(InputTypeError, match="bools"):
        add_decayed_weights(0.5, {"w": 1, "b": True}).update(grads, EmptyState(), params)
    with pytest.raises(InputTypeError, match="never noised"):
        add_decayed_weights(0.5).update(ClippedPytree(grads, max_norm=1.0), EmptyState(), params)


def test_add_decayed_weights_turns_the_private_squares_into_those_of_the_decayed_gradient():
    pair = _grads("pair", 0, torch.float64)
    params = _params(torch.float64)
    out, _ = add_decayed_weights(0.3).update(pair, EmptyState(), params)
    assert isinstance(out, SecondMomentNoiseOutput) and out.noisy_squared_grads.noise_stddev is None
    assert out.noisy_grads.noise_stddev == 0.1
    for k, p in params.items():
        g, s = pair.noisy_grads.pytree[k], pair.noisy_squared_grads.pytree[k]
        torch.testing.assert_close(out.noisy_grads.pytree[k], g + 0.3 * p, atol=0, rtol=0)
        # the noiseless identity: (g + wd p)**2 = g**2 + 2 wd p g + (wd p)**2
        torch.testing.assert_close(out.noisy_squared_grads.pytree[k] - s + g * g, (g + 0.3 * p) ** 2)


def test_scale_by_adam_first_step_and_bias_correction_against_the_paper():
    t = scale_by_adam()
    params = [torch.zeros(3, dtype=torch.float64)]
    g = [torch.tensor([2.0, -0.5, 1e-3], dtype=torch.float64)]
    out, state = t.update(g, t.init(params))
    assert isinstance(state, ScaleByAdamState) and state.count == 1
    torch.testing.assert_close(out[0], g[0] / (g[0].abs() + 1e-8), atol=1e-12, rtol=0)  # m_hat / (|g| + eps)
    # DP-AdamBC over 6 steps: the direction is m_hat / sqrt(max(v_hat - Phi, gamma)) (Tang et al. 2024, Alg. 1)
    sd, b1, b2, gamma = 0.3, 0.9, 0.99, 1e-4
    for setting in ("auto", sd**2):
        t = scale_by_adam(b1, b2, dp_bias_correction=setting, dp_bias_correction_gamma=gamma)
        state, m, v = t.init(params), torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
        for step in range(1, 7):
            x = normal(key(step), (3,), dtype=torch.float64)
            out, state = t.update(NoisedPytree([x], max_norm=1.0, noise_stddev=sd), state)
            m, v = b1 * m + (1 - b1) * x, b2 * v + (1 - b2) * x**2
            want = (m / (1 - b1**step)) / torch.sqrt(torch.clamp(v / (1 - b2**step) - sd**2, min=gamma))
            torch.testing.assert_close(out[0], want, atol=1e-12, rtol=1e-12)
    with pytest.raises(InputTypeError, match="noise_stddev"):
        scale_by_adam(dp_bias_correction="auto").update(g, t.init(params))
    with pytest.raises(InputTypeError, match="scale_by_private_second_moment"):
        scale_by_adam().update(_grads("pair", 0, torch.float64), scale_by_adam().init(_params(torch.float64)))
    with pytest.raises(InputValueError, match="gamma > 0"):
        scale_by_adam(dp_bias_correction=0.1, dp_bias_correction_gamma=0.0)
    with pytest.raises(InputValueError, match="b2"):
        scale_by_adam(b2=1.0)


def test_scale_by_adam_with_a_learning_rate_is_torchs_fused_step():
    # learning_rate folded in: -(lr / bc1) * (m / denom), torch.optim.Adam's step_size, bit for bit against adam()
    params = _params(torch.float32)
    fused, plain = scale_by_adam(learning_rate=0.01), adam(0.01)
    fs, ps = fused.init(params), plain.init(params)
    for t in range(STEPS):
        fu, fs = fused.update(_grads("plain", t, torch.float32), fs)
        pu, ps = plain.update(_grads("plain", t, torch.float32), ps, params)
        _assert_trees_equal(fu, pu, f"step {t}")


def test_scale_by_private_second_moment_feeds_v_from_the_squares_and_floors_it():
    pair = _grads("pair", 0, torch.float64)
    params = _params(torch.float64)
    t = scale_by_private_second_moment(b1=0.9, b2=0.999, gamma=1e-3)
    out, state = t.update(pair, t.init(params))
    for k in params:
        s = pair.noisy_squared_grads.pytree[k]
        torch.testing.assert_close(state.nu[k], (1 - 0.999) * s, atol=0, rtol=0)
        want = pair.noisy_grads.pytree[k] / torch.sqrt(torch.clamp(s, min=1e-3))  # first step: m_hat = g, v_hat = s
        torch.testing.assert_close(out[k], want, atol=1e-12, rtol=1e-12)
    assert any(bool((pair.noisy_squared_grads.pytree[k] < 0).any()) for k in params)  # the floor was exercised
    with pytest.raises(InputTypeError, match="SecondMomentNoiseOutput"):
        t.update(_grads("noised", 0, torch.float64), t.init(params))
    with pytest.raises(InputTypeError, match="never noised"):
        t.update(ClippedPytree(_grads("plain", 0, torch.float64), max_norm=1.0), t.init(params))
    with pytest.raises(InputValueError, match="gamma"):
        scale_by_private_second_moment(gamma=0.0)


def test_scale_by_learning_rate_negates_and_calls_the_schedule_with_the_count():
    seen = []
    t = scale_by_learning_rate(lambda step: seen.append(step) or 0.5 * step)
    state = t.init(None)
    for step in range(3):
        out, state = t.update(NoisedPytree([torch.ones(2)], max_norm=1.0, noise_stddev=1.0), state)
        assert type(out) is list and out[0].tolist() == [-0.5 * step] * 2
    assert seen == [0, 1, 2] and state == ScheduleState(count=3)
    with pytest.raises(InputValueError, match="learning_rate"):
        scale_by_learning_rate(-1.0)
    with pytest.raises(InputValueError, match="schedule returned -1.0 at step 0"):
        scale_by_learning_rate(lambda step: -1.0).update([torch.ones(1)], ScheduleState(count=0))
    with pytest.raises(InputTypeError, match="no second moment"):
        scale_by_learning_rate(0.1).update(_grads("pair", 0, torch.float32), ScheduleState(count=0))


def test_add_decoupled_weight_decay_subtracts_lr_times_wd_times_params():
    params = _params(torch.float64)
    updates = _grads("plain", 0, torch.float64)
    t = add_decoupled_weight_decay(0.2, SCHEDULE, MASK)
    out, state = t.update(updates, ScheduleState(count=4), params)
    assert state.count == 5
    assert torch.equal(out["w"], updates["w"] - (SCHEDULE(4) * 0.2) * params["w"])
    assert torch.equal(out["b"], updates["b"])
    with pytest.raises(InputValueError, match=r"update\(grads, state, params\)"):
        t.update(updates, t.init(params))


@pytest.mark.parametrize(
    "primitive",
    [lambda: trace(0.5), lambda: add_decayed_weights(0.1), lambda: scale_by_adam(), lambda: scale_by_learning_rate(0.1),
     lambda: add_decoupled_weight_decay(0.1, 0.1), lambda: scale_by_private_second_moment()],
)
def test_every_primitive_is_a_pure_transform_that_refuses_un_noised_gradients(primitive):
    t = primitive()
    assert isinstance(t, Transform) and t.privacy.kind == "optimizer"
    params = _params(torch.float32)
    kind = "pair" if t.privacy.description.startswith("scale_by_private") else "noised"
    grads = _grads(kind, 0, torch.float32)
    before = [x.clone() for x in optree.tree_leaves(unwrap(params), namespace=NAMESPACE)]
    state = t.init(params)
    out1, _ = t.update(grads, state, params, step=3, anything="ignored")
    out2, _ = t.update(grads, state, params)
    _assert_trees_equal(unwrap(out1) if not isinstance(out1, SecondMomentNoiseOutput) else out1.noisy_grads.pytree,
                        unwrap(out2) if not isinstance(out2, SecondMomentNoiseOutput) else out2.noisy_grads.pytree, "again")
    for a, b in zip(optree.tree_leaves(params, namespace=NAMESPACE), before):
        assert torch.equal(a, b)
    with pytest.raises(InputTypeError, match="never noised"):
        t.update(ClippedPytree(_grads("plain", 0, torch.float32), max_norm=1.0), state, params)


def test_a_primitive_after_clip_without_noise_is_refused_by_chain():
    from opake_fx.dpsgd import clip

    loss = lambda p, x, y: ((x @ p["w"]) - y) ** 2  # noqa: E731
    with pytest.raises(OperationError, match="without a noise stage"):
        chain(clip(loss, clipping_norm=1.0, batch_argnums=(1, 2)), scale_by_adam(), scale_by_learning_rate(1e-3))


# --- chains of primitives --------------------------------------------------------------------------


def _run_chain(opt, kind, dtype, steps=STEPS):
    params = _params(dtype)
    state = opt.init(params)
    out = []
    for t in range(steps):
        updates, state = opt.update(_grads(kind, t, dtype), state, params)
        params = apply_updates(params, updates)
        out.append(params)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_chains_that_are_the_optimizers_bit_for_bit(dtype):
    pairs = [
        (chain(add_decayed_weights(0.05, MASK), trace(0.8, nesterov=True), scale_by_learning_rate(SCHEDULE)),
         sgd(SCHEDULE, momentum=0.8, nesterov=True, weight_decay=0.05, mask=MASK), "noised"),
        (chain(add_decayed_weights(0.1), scale_by_adam(learning_rate=0.01)), adam(0.01, weight_decay=0.1), "plain"),
        (chain(add_decayed_weights(0.1), scale_by_adam(dp_bias_correction="auto", learning_rate=0.01)),
         adam(0.01, weight_decay=0.1, dp_bias_correction="auto"), "per_group"),
        (chain(add_decayed_weights(0.3), scale_by_private_second_moment(learning_rate=0.01)),
         adam(0.01, weight_decay=0.3), "pair"),
        (chain(scale_by_adam(learning_rate=SCHEDULE), add_decoupled_weight_decay(0.2, SCHEDULE, MASK_FN)),
         adamw(SCHEDULE, weight_decay=0.2, mask=MASK_FN), "plain"),
    ]
    for built, opt, kind in pairs:
        for a, b in zip(_run_chain(built, kind, dtype), _run_chain(opt, kind, dtype)):
            _assert_trees_equal(a, b, kind)


def test_the_optax_ordered_chains_match_the_optimizers_to_rounding():
    # scale_by_adam() then scale_by_learning_rate(lr): the same Adam with the learning rate applied last
    cases = [
        (chain(add_decayed_weights(0.01), scale_by_adam(), scale_by_learning_rate(1e-3)), adam(1e-3, weight_decay=0.01)),
        (chain(scale_by_adam(), scale_by_learning_rate(1e-3), add_decoupled_weight_decay(0.01, 1e-3)),
         adamw(1e-3, weight_decay=0.01)),
        # optax's adamw: the decay added to the direction before the learning rate, -lr * (adam + wd * p)
        (chain(scale_by_adam(), add_decayed_weights(0.01), scale_by_learning_rate(1e-3)), adamw(1e-3, weight_decay=0.01)),
    ]
    for built, opt in cases:
        for a, b in zip(_run_chain(built, "plain", torch.float64), _run_chain(opt, "plain", torch.float64)):
            for k in a:
                torch.testing.assert_close(a[k], b[k], atol=1e-14, rtol=1e-12)


TORCH_CASES = [
    (lambda lr: chain(add_decayed_weights(0.05), trace(0.8, nesterov=True), scale_by_learning_rate(lr)),
     lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.8, nesterov=True, weight_decay=0.05)),
    (lambda lr: chain(add_decayed_weights(0.1), scale_by_adam(0.8, 0.99, 1e-6), scale_by_learning_rate(lr)),
     lambda ps, lr: torch.optim.Adam(ps, lr=lr, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)),
    (lambda lr: chain(scale_by_adam(0.5, 0.9, 1e-7), add_decayed_weights(0.3), scale_by_learning_rate(lr)),
     lambda ps, lr: torch.optim.AdamW(ps, lr=lr, betas=(0.5, 0.9), eps=1e-7, weight_decay=0.3)),
]


@pytest.mark.parametrize(("ours", "theirs"), TORCH_CASES, ids=["sgd", "adam", "adamw"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_chains_of_primitives_match_torch_optim(ours, theirs, dtype):
    lr = 0.05
    got = _run_chain(ours(lr), "plain", dtype, steps=8)
    tensors = {k: v.clone().requires_grad_(True) for k, v in _params(dtype).items()}
    opt = theirs(list(tensors.values()), lr)
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    for t in range(8):
        for k, g in _grads("plain", t, dtype).items():
            tensors[k].grad = g.clone()
        opt.step()
        for k in tensors:
            torch.testing.assert_close(got[t][k], tensors[k].detach(), atol=tol, rtol=tol)
