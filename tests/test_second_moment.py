"""One Gaussian mechanism (DP-SGD = identity MF) and the private second moment end to end."""

from __future__ import annotations

import math

import pytest
import torch

from opake_fx import dpftrl
from opake_fx.dpftrl.accounting import mf_gaussian
from opake_fx.dpftrl.noise import mf_gaussian_noise
from opake_fx.dpsgd.accounting import gaussian, poisson
from opake_fx.dpsgd.clipping import clip, clipped_grad
from opake_fx.dpsgd.noise import (
    gaussian_noise,
    joint_noise_multiplier,
    noise,
    second_moment_stddevs,
    squared_stream_key,
)
from opake_fx.errors import InputTypeError, InputValueError, NoiseInputError
from opake_fx.optimizers import adam, adamw, sgd
from opake_fx.random import fold_in, key
from opake_fx.transforms import apply_updates, named_chain
from opake_fx.types import ClippedPytree, NoisedPytree, PerGroup, SecondMomentClippingOutput, SecondMomentNoiseOutput


def _tree(seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(5, 4, generator=gen).to(dtype), "b": torch.randn(3, generator=gen).to(torch.float64)}


def _pair(c=0.5, n=4.0, seed=0):
    g = _tree(seed)
    return SecondMomentClippingOutput(
        ClippedPytree(g, max_norm=c / n), ClippedPytree({k: v * v for k, v in g.items()}, max_norm=c * c / n)
    )


# --- one Gaussian mechanism ------------------------------------------------------------


@pytest.mark.parametrize("exact", [False, True])
def test_identity_strategy_is_bit_identical_to_dp_sgd_noise(exact):
    mf_fn, mf_state = mf_gaussian_noise(dpftrl.identity_strategy(4), noise_multiplier=0.7, key=key(9), exact=exact)
    sgd_fn, sgd_state = gaussian_noise(noise_multiplier=0.7, key=key(9), exact=exact)
    for t in range(4):
        g = ClippedPytree(_tree(t), max_norm=0.25)
        a, mf_state = mf_fn(g, mf_state)
        b, sgd_state = sgd_fn(g, sgd_state)
        for k in ("w", "b"):
            assert torch.equal(a.pytree[k], b.pytree[k])
        assert a.noise_stddev == b.noise_stddev == 0.7 * 0.25
        # ... and the pair too: both streams, bit for bit
        pa, mf_state2 = mf_fn(_pair(seed=t), replace_step(mf_state, t))
        pb, _ = sgd_fn(_pair(seed=t), replace_step(sgd_state, t))
        for stream in ("noisy_grads", "noisy_squared_grads"):
            for k in ("w", "b"):
                assert torch.equal(getattr(pa, stream).pytree[k], getattr(pb, stream).pytree[k])


def replace_step(state, t):
    from dataclasses import replace

    return replace(state, step=t, max_norm=None, squared_max_norm=None) if hasattr(state, "buffers") else replace(state, step=t)


# --- the joint split: one budget, charged once ----------------------------------------------


@pytest.mark.parametrize("share", [0.1, 1 / 3, 0.9])
def test_split_makes_the_pair_one_gaussian_with_the_budget_multiplier(share):
    z, c, n = 1.3, 0.8, 64.0
    fn, st = gaussian_noise(noise_multiplier=z, key=key(0), second_moment_share=share)
    out, _ = fn(_pair(c, n), st)
    assert isinstance(out, SecondMomentNoiseOutput)
    s1, s2 = out.noisy_grads.noise_stddev, out.noisy_squared_grads.noise_stddev
    assert (s1, s2) == second_moment_stddevs(z, c / n, c * c / n, share)
    assert s1 == pytest.approx(z * (c / n) / math.sqrt(1 - share), rel=1e-15)
    joint = joint_noise_multiplier(c / n, s1, c * c / n, s2)
    assert joint == pytest.approx(z, rel=1e-12)
    # The accounting charges the pair once: poisson(gaussian(z_joint)) is poisson(gaussian(z)).
    q, steps, delta = 0.01, 500, 1e-5
    eps_pair = (poisson(gaussian(joint), q) * steps).epsilon_at(delta)
    eps_grad = (poisson(gaussian(z), q) * steps).epsilon_at(delta)
    assert eps_pair == pytest.approx(eps_grad, rel=1e-6)
    # Without sampling, the two streams' Gaussians compose to exactly gaussian(z) ...
    z1, z2 = s1 / (c / n), s2 / (c * c / n)
    assert (gaussian(z1) | gaussian(z2)).epsilon_at(delta) == pytest.approx(gaussian(z).epsilon_at(delta), rel=1e-6)
    # ... but under Poisson sampling the streams share ONE batch: composing two independently
    # sampled releases would claim less than the pair costs (unsound), which is why it is charged once.
    eps_apart = ((poisson(gaussian(z1), q) | poisson(gaussian(z2), q)) * steps).epsilon_at(delta)
    assert eps_apart < eps_grad


def test_pair_noise_has_the_stated_stddevs_and_independent_streams():
    n = 20_000
    zeros = {"w": torch.zeros(n, dtype=torch.float64)}
    pair = SecondMomentClippingOutput(ClippedPytree(zeros, max_norm=1.0), ClippedPytree(zeros, max_norm=1.0))
    fn, st = gaussian_noise(noise_multiplier=1.0, key=key(5))
    out, _ = fn(pair, st)
    a, b = out.noisy_grads.pytree["w"], out.noisy_squared_grads.pytree["w"]
    tol = 5.0 / math.sqrt(2 * n)  # 5 standard errors of a sample std
    assert float(a.std()) / out.noisy_grads.noise_stddev == pytest.approx(1.0, abs=tol)
    assert float(b.std()) / out.noisy_squared_grads.noise_stddev == pytest.approx(1.0, abs=tol)
    corr = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
    assert abs(corr) < 5.0 / math.sqrt(n)
    # The gradient stream keeps its unpaired draws (scaled); the squared stream has its own key.
    fn1, st1 = gaussian_noise(noise_multiplier=1.0, key=key(5))
    alone, _ = fn1(ClippedPytree(zeros, max_norm=1.0), st1)
    torch.testing.assert_close(a / out.noisy_grads.noise_stddev, alone.pytree["w"], rtol=1e-12, atol=1e-12)
    assert squared_stream_key(key(5)) not in {fold_in(key(5), t) for t in range(64)}


def test_mf_pair_splits_over_the_strategy_sensitivity_and_stays_consistent():
    s = dpftrl.band_mf_strategy(8, 2, max_iterations=5)
    fn, st = mf_gaussian_noise(s, noise_multiplier=2.0, key=key(1), min_sep=2, max_participations=3)
    sens = fn.sensitivity
    outs = []
    for t in range(3):
        out, st = fn(_pair(seed=t), st)
        outs.append(out)
    assert len(st.squared_buffers) == len(st.buffers) == 2
    row = float(s.inverse_row_norms(8)[0])
    s1, s2 = second_moment_stddevs(2.0, sens * 0.125, sens * 0.0625)
    assert outs[0].noisy_grads.noise_stddev == pytest.approx(s1 * row)
    assert outs[0].noisy_squared_grads.noise_stddev == pytest.approx(s2 * row)
    assert joint_noise_multiplier(sens * 0.125, s1, sens * 0.0625, s2) == pytest.approx(2.0, rel=1e-12)
    # The pattern's accounting is the gradient's alone (charged once).
    assert mf_gaussian(2.0, s, min_sep=2, max_participations=3).epsilon_at(1e-5) > 0
    with pytest.raises(NoiseInputError, match="drops the squared-gradient stream"):
        fn(ClippedPytree(_tree(), max_norm=0.125), st)
    fn2, st2 = mf_gaussian_noise(s, noise_multiplier=2.0, key=key(1))
    _, st2 = fn2(ClippedPytree(_tree(), max_norm=0.125), st2)
    with pytest.raises(NoiseInputError, match="adds the squared-gradient stream"):
        fn2(_pair(), st2)


def test_pair_refusals():
    fn, st = gaussian_noise(noise_multiplier=1.0, key=key(0))
    g = ClippedPytree(_tree(), max_norm=1.0)
    noised = NoisedPytree(_tree(), max_norm=1.0, noise_stddev=1.0)
    with pytest.raises(NoiseInputError, match="already noised"):
        fn(_AlreadyNoisedPair(g, noised), st)
    pg = ClippedPytree(_tree(), max_norm=PerGroup({("w",): "a", ("b",): "a"}, {"a": 1.0}))
    with pytest.raises(InputValueError, match="scalar max_norm"):
        fn(SecondMomentClippingOutput(pg, g), st)
    for bad in (0.0, 1.0, -0.2, True):
        with pytest.raises(InputValueError, match="second_moment_share"):
            gaussian_noise(noise_multiplier=1.0, key=key(0), second_moment_share=bad)
    with pytest.raises(InputTypeError, match="second_moment_share"):
        gaussian_noise(noise_multiplier=1.0, key=key(0), second_moment_share="half")
    with pytest.raises(InputTypeError, match="never noised"):
        adam(1e-3).update(_pair(), adam(1e-3).init(_tree()), _tree())
    noised_pair, _ = fn(_pair(), st)
    with pytest.raises(InputTypeError, match="no second moment"):
        sgd(0.1).update(noised_pair, sgd(0.1).init(_tree()), _tree())
    with pytest.raises(InputValueError, match="twice"):
        opt = adam(1e-3, dp_bias_correction="auto")
        opt.update(noised_pair, opt.init(_tree()), _tree())


class _AlreadyNoisedPair(SecondMomentClippingOutput):
    """A pair whose squared stream was noised already (a SecondMomentClippingOutput refuses it at construction)."""

    def __init__(self, grads, squared):
        object.__setattr__(self, "grads", grads)
        object.__setattr__(self, "squared_grads", squared)


# --- the optimizer takes v from the private stream ---------------------------------------------


def test_adam_feeds_v_from_the_private_squares():
    params = {"w": torch.zeros(5, 4), "b": torch.zeros(3, dtype=torch.float64)}
    g = _tree(1)
    sq = {k: v * v + 0.5 for k, v in g.items()}  # anything: v must come from here
    pair = SecondMomentNoiseOutput(NoisedPytree(g, 1.0, noise_stddev=0.1), NoisedPytree(sq, 1.0, noise_stddev=0.2))
    for opt, wd in ((adam(0.1, weight_decay=0.3), 0.3), (adamw(0.1, weight_decay=0.3), 0.0)):
        p = {k: v + 1.0 for k, v in params.items()}
        updates, state = opt.update(pair, opt.init(p), p)
        for k in p:
            gk = g[k] + wd * p[k]
            sk = sq[k] + 2 * wd * p[k] * g[k] + (wd * p[k]) ** 2
            torch.testing.assert_close(state.nu[k], (1 - 0.999) * sk)
            torch.testing.assert_close(state.mu[k], (1 - 0.9) * gk)
    # Negative noised squares hit the floor instead of a NaN.
    neg = SecondMomentNoiseOutput(NoisedPytree(g, 1.0, noise_stddev=0.1), NoisedPytree({k: -v.abs() for k, v in g.items()}, 1.0))
    updates, _ = adam(0.1).update(neg, adam(0.1).init(params), params)
    assert all(bool(torch.isfinite(u).all()) for u in updates.values())


def test_chain_clip_second_moment_noise_adam_trains_and_reports():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, generator=gen)
    y = x @ torch.tensor([1.0, -2.0, 0.5])
    loss = lambda p, xi, yi: (xi @ p - yi) ** 2  # noqa: E731
    pipe = named_chain(
        ("clip", clip(loss, clipping_norm=5.0, batch_argnums=(1, 2), normalize_by=64, second_moment=True)),
        ("noise", noise(noise_multiplier=0.5, key=key(2))),
        ("opt", adam(0.05)),
    )
    p = torch.zeros(3)
    state = pipe.init(p)
    first = float(((x @ p - y) ** 2).mean())
    for _ in range(60):
        updates, state = pipe.update((x, y), state, p)
        p = apply_updates(p, updates)
    assert float(((x @ p - y) ** 2).mean()) < 0.2 * first
    report = pipe.privacy_report(sample_rate=0.01, steps=100, delta=1e-5)
    assert report.private and report.noise_multiplier == 0.5


@pytest.mark.slow
def test_digits_example_runs_every_variant_at_one_budget(capsys):
    pytest.importorskip("sklearn")
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "examples" / "second_moment_digits.py"
    spec = importlib.util.spec_from_file_location("second_moment_digits", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    results = example.main(["--epsilon", "8", "--epochs", "1", "--seeds", "1", "--lrs", "0.01", "--gammas", "1e-4"])
    out = capsys.readouterr().out
    assert "spent 7.9" in out or "spent 8.000" in out
    assert {variant for _, variant in results} == {"dp-adam", "dp-adambc", "private-v"}
    assert all(0.0 <= mean <= 1.0 for mean, *_ in results.values())
