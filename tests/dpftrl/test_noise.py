"""Streaming correlated noise: equals dense C^{-1} Z, keyed, resumable, memory, refusals."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from opake_fx import dpftrl
from opake_fx.dpsgd.noise import gaussian_noise
from opake_fx.errors import InputTypeError, InputValueError, NoiseInputError, OperationError
from opake_fx.optimizers import sgd
from opake_fx.random import flat_tree_normal, fold_in, key
from opake_fx.serialization import from_state_dict, state_dict
from opake_fx.transforms import named_chain, stateless
from opake_fx.types import ClippedPytree, NoisedPytree

from .conftest import N


def _leaves(dtype=torch.float32):
    return {"w": torch.zeros(3, 2, dtype=dtype), "b": torch.zeros(5, dtype=dtype)}


def _run(strategy, steps, dtype=torch.float32, **kw):
    fn, state = dpftrl.mf_gaussian_noise(strategy, noise_multiplier=1.0, key=key(7), **kw)
    outs = []
    for _ in range(steps):
        out, state = fn(ClippedPytree(_leaves(dtype), max_norm=1.0), state)
        outs.append(torch.cat([out.pytree["b"].reshape(-1), out.pytree["w"].reshape(-1)]).double())
    return torch.stack(outs), state


def _dense_reference(strategy, steps, dtype=torch.float32):
    like = _leaves(dtype)
    z = []
    for t in range(steps):
        b, w = flat_tree_normal(fold_in(key(7), t), [like["b"], like["w"]])[0]  # the stage's draw, leaves in tree order
        z.append(torch.cat([b.reshape(-1), w.reshape(-1)]).double())
    return strategy.materialize_inverse()[:steps, :steps] @ torch.stack(z)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_streaming_noise_equals_dense_inverse_times_z_for_every_strategy(small_strategies, dtype, tol):
    for name, s in small_strategies.items():
        x, state = _run(s, N, dtype)
        ref = _dense_reference(s, N, dtype) * s.sensitivity()
        assert float((x - ref).abs().max()) <= tol, name
        assert state.step == N


def test_memory_is_bands_minus_one_or_buffers(small_strategies):
    like = _leaves()
    param_bytes = sum(v.numel() * 4 for v in like.values())
    expected = {
        "identity": 0,
        "band_mf_toeplitz": 3,
        "band_mf_column_normalized": 3,
        "blt": small_strategies["blt"].num_buffers,
        "bsr": 4,
        "bisr": 4,
        "lambda_cgd": 0,
        "dense": N - 1,
    }
    for name, count in expected.items():
        _, state = _run(small_strategies[name], 3)
        assert small_strategies[name].inverse_noise().memory == count, name
        assert state.memory_bytes == count * param_bytes, name


def test_replay_mode_needs_no_buffers_and_gives_the_same_noise():
    stored = dpftrl.bisr_strategy(16, 4)
    replayed = dpftrl.bisr_strategy(16, 4, replay=True)
    a, sa = _run(stored, 16)
    b, sb = _run(replayed, 16)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert sa.memory_bytes > 0 and sb.memory_bytes == 0


def test_inplace_updates_give_the_same_noise(small_strategies):
    for name in ("band_mf_toeplitz", "blt", "bisr", "dense"):
        a, _ = _run(small_strategies[name], 10)
        b, _ = _run(small_strategies[name], 10, inplace=True)
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_identity_strategy_equals_dp_sgd_noise_with_the_same_key():
    mf_fn, mf_state = dpftrl.mf_gaussian_noise(dpftrl.identity_strategy(5), noise_multiplier=1.3, key=key(3))
    sgd_fn, sgd_state = gaussian_noise(noise_multiplier=1.3, key=key(3))
    for _ in range(5):
        g = ClippedPytree({"w": torch.zeros(4, 3)}, max_norm=0.5)
        a, mf_state = mf_fn(g, mf_state)
        b, sgd_state = sgd_fn(g, sgd_state)
        # one Gaussian mechanism: the identity strategy runs DP-SGD's add_gaussian_noise itself
        assert torch.equal(a.pytree["w"], b.pytree["w"])
        assert a.noise_stddev == b.noise_stddev


def test_same_key_gives_identical_noise_across_ranks_and_resumes_from_a_checkpoint():
    s = dpftrl.band_mf_strategy(12, 3, max_iterations=10)
    rank0 = dpftrl.mf_gaussian_noise(s, noise_multiplier=1.0, key=key(11))
    rank1 = dpftrl.mf_gaussian_noise(s, noise_multiplier=1.0, key=key(11))
    (f0, s0), (f1, s1) = rank0, rank1
    g = ClippedPytree((torch.zeros(6),), max_norm=1.0)
    outs = []
    for t in range(12):
        a, s0 = f0(g, s0)
        b, s1 = f1(g, s1)
        assert torch.equal(a.pytree[0], b.pytree[0])
        outs.append(a.pytree[0])
        if t == 5:
            saved = state_dict(s0)
    restored = from_state_dict(s1, saved)  # any state of the same structure is a template
    for t in range(6, 12):
        c, restored = f0(g, restored)
        assert torch.equal(c.pytree[0], outs[t])


def test_noise_scale_and_reported_marginal_stddev():
    s = dpftrl.bsr_strategy(8, 4)
    fn, state = dpftrl.mf_gaussian_noise(s, noise_multiplier=2.0, key=key(5), buffer_dtype=torch.float64)
    g = ClippedPytree((torch.zeros(20_000, dtype=torch.float64),), max_norm=0.25)
    std_z = 2.0 * s.sensitivity() * 0.25
    for t in range(8):
        out, state = fn(g, state)
        expected = std_z * float(s.inverse_row_norms()[t])
        assert out.noise_stddev == pytest.approx(expected)
        # 20000 draws: a 10% scale error would be rejected with overwhelming power.
        assert stats.kstest(out.pytree[0].numpy(), "norm", args=(0, expected)).pvalue > 1e-4


def test_min_sep_participation_scales_the_noise_by_the_multi_participation_sensitivity():
    s = dpftrl.band_mf_strategy(16, 4, max_iterations=10)
    single, _ = _run(s, 4)
    multi, _ = _run(s, 4, min_sep=4, max_participations=None)
    ratio = s.sensitivity(4, None) / s.sensitivity()
    assert ratio == pytest.approx(2.0, rel=1e-6)  # 4 orthogonal unit-norm columns
    torch.testing.assert_close(multi, single * ratio, rtol=1e-6, atol=1e-6)
    dense = dpftrl.dense_strategy(8, epochs=2, max_iterations=20)
    _, state = dpftrl.mf_gaussian_noise(dense, noise_multiplier=1.0, key=key(0), epochs=2)
    assert state.step == 0


def test_chain_stage_allocates_buffers_and_runs_with_an_optimizer():
    s = dpftrl.band_mf_strategy(6, 3, max_iterations=10)
    params = {"w": torch.ones(4)}
    pipe = named_chain(
        ("wrap", stateless(lambda g, params=None: ClippedPytree(g, max_norm=1.0))),
        ("noise", dpftrl.noise(s, noise_multiplier=1.0, key=key(2))),
        ("opt", sgd(0.1)),
    )
    state = pipe.init(params)
    assert state["noise"].memory_bytes == 2 * 4 * 4
    updates, state = pipe.update({"w": torch.zeros(4)}, state, params)
    assert state["noise"].step == 1 and updates["w"].shape == (4,)


def test_zero_noise_multiplier_adds_nothing():
    fn, state = dpftrl.mf_gaussian_noise(dpftrl.bsr_strategy(4, 2), noise_multiplier=0.0, key=key(0))
    out, state = fn(ClippedPytree((torch.ones(3),), max_norm=float("inf")), state)
    assert torch.equal(out.pytree[0], torch.ones(3)) and out.noise_stddev == 0.0


def test_refusals():
    s = dpftrl.bsr_strategy(3, 2)
    fn, state = dpftrl.mf_gaussian_noise(s, noise_multiplier=1.0, key=key(0))
    with pytest.raises(NoiseInputError, match="ClippedPytree"):
        fn((torch.zeros(2),), state)
    with pytest.raises(NoiseInputError, match="already noised"):
        fn(NoisedPytree((torch.zeros(2),), 1.0, noise_stddev=1.0), state)
    with pytest.raises(NoiseInputError, match="unbounded"):
        fn(ClippedPytree((torch.zeros(2),), max_norm=math.inf), state)
    _, state1 = fn(ClippedPytree((torch.zeros(2),), max_norm=1.0), state)
    with pytest.raises(NoiseInputError, match="max_norm changed"):
        fn(ClippedPytree((torch.zeros(2),), max_norm=2.0), state1)
    for _ in range(2):
        _, state1 = fn(ClippedPytree((torch.zeros(2),), max_norm=1.0), state1)
    with pytest.raises(OperationError, match="beyond the strategy's n_steps=3"):
        fn(ClippedPytree((torch.zeros(2),), max_norm=1.0), state1)
    with pytest.raises(InputTypeError, match="key"):
        dpftrl.mf_gaussian_noise(s, noise_multiplier=1.0, key=0)
    with pytest.raises(InputTypeError, match="Strategy"):
        dpftrl.mf_gaussian_noise("bandmf", noise_multiplier=1.0, key=key(0))
    with pytest.raises(InputValueError, match="noise_multiplier"):
        dpftrl.mf_gaussian_noise(s, noise_multiplier=-1.0, key=key(0))
    with pytest.raises(InputValueError, match="pass n_steps"):
        dpftrl.mf_gaussian_noise(dpftrl.lambda_cgd_strategy(0.5), noise_multiplier=1.0, key=key(0))
    fn2, st2 = dpftrl.mf_gaussian_noise(dpftrl.lambda_cgd_strategy(0.5), noise_multiplier=1.0, key=key(0), n_steps=4)
    out, _ = fn2(ClippedPytree((torch.zeros(2),), max_norm=1.0), st2)
    assert out.noise_stddev == pytest.approx(math.sqrt(sum(0.25**k for k in range(4))))
