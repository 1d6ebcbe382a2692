"""Clip bounds that hold against adversarial inputs, as computed in floating point.

An attacker who controls a training example can choose activations whose per-position
terms cancel: nearly identical rows of a long sequence with output gradients of
alternating sign. Gram-product norms evaluated in float32 then come out far too small
(or negative: a NaN norm), the example is scaled down too little, and its contribution
exceeds C. These tests craft such examples (and huge and tiny scales) for every layer
rule and check, on every backend, that the clipped sum of a batch holding only that
example has norm at most C, in float32 and in bfloat16.
"""

from __future__ import annotations

import math
import os

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from torch import nn

from opake_fx.dpsgd.clipping import _certified as cert
from opake_fx.dpsgd.clipping import clipped_grad
from opake_fx.functional import make_functional

BACKENDS = ["vmap", "ghost", "auto"]
# HYPOTHESIS_PROFILE=nightly draws 2000 adversarial examples per test and backend.
NIGHTLY = os.environ.get("HYPOTHESIS_PROFILE") == "nightly"


def examples(ci: int) -> int:
    return 2000 if NIGHTLY else ci


def exact_sq_norm(a: torch.Tensor, g: torch.Tensor) -> float:
    """``||g^T a||_F^2`` for one example ``a [T, d_in]``, ``g [T, d_out]``, exactly (fractions)."""
    from fractions import Fraction

    a_f = [[Fraction(float(v)) for v in row] for row in a.double().tolist()]
    g_f = [[Fraction(float(v)) for v in row] for row in g.double().tolist()]
    total = Fraction(0)
    for o in range(len(g_f[0])):
        for i in range(len(a_f[0])):
            entry = sum((g_f[t][o] * a_f[t][i] for t in range(len(a_f))), Fraction(0))
            total += entry * entry
    return float(total)


def cancelling(t: int, d: int, scale: float, spread: float, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """``t`` rows equal to one base row up to a relative ``spread``: what alternating output
    gradients nearly cancel."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(1, d, generator=gen, dtype=torch.float64)
    rows = base + spread * torch.randn(t, d, generator=gen, dtype=torch.float64)
    return (scale * rows).to(dtype)


def alternating(t: int, d: int, scale: float, seed: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    v = torch.randn(1, d, generator=gen, dtype=torch.float64)
    signs = torch.tensor([(-1.0) ** k for k in range(t)], dtype=torch.float64).unsqueeze(1)
    return (scale * signs * v).to(dtype)


# --- the certified Gram norm itself ---------------------------------------------------


@settings(max_examples=examples(40), deadline=None)
@given(
    t=st.sampled_from([2, 4, 16, 64]),
    d=st.sampled_from([3, 64, 512]),
    spread=st.sampled_from([0.0, 1e-7, 1e-4, 1e-2, 1.0]),
    scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e15, 1e30]),
    seed=st.integers(0, 2**16),
)
def test_gram_norm_is_an_upper_bound_of_the_exact_norm(t, d, spread, scale, seed):
    a = cancelling(t, d, scale, spread, seed, torch.float32)
    g = alternating(t, 5, 1.0, seed, torch.float32)
    sq, s = cert.gram_sq_norms(a[None, None], g[None, None])
    if t * d <= 1024:  # exact rational arithmetic is affordable here
        assert float(sq[0]) >= exact_sq_norm(a, g)
    # always: never NaN, never negative, never above the triangle bound
    assert math.isfinite(float(sq[0])) and 0.0 <= float(sq[0]) <= float(s[0]) ** 2 * (1 + 1e-12)


def float32_gram_slack(t: int, d_in: int, d_out: int) -> float:
    """What a float32 Gram bound may add to the squared norm, relative to ``s**2`` (the
    documented bound of ``_certified._gram_sq_norms_float32_scaled``, with a 10% margin)."""
    f32 = torch.float32
    return 1.1 * (cert.gamma(d_in + 2, f32) + cert.gamma(d_out + 2, f32) + 2 * cert.gamma(t, f32))


def test_gram_norm_bounds_cancellation_where_float32_grams_fail():
    # 64 equal rows, alternating output gradients: the exact gradient is zero up to the spread.
    a = cancelling(64, 64, 1.0, 1e-6, 3, torch.float32)
    g = alternating(64, 5, 1.0, 3, torch.float32)
    exact = exact_sq_norm(a, g)
    naive = float(torch.linalg.vecdot((a @ a.T).flatten(), (g @ g.T).flatten()))
    sq, s = cert.gram_sq_norms(a[None, None], g[None, None])
    assert abs(naive - exact) > 10 * exact  # float32 Grams are useless here...
    # ...the certified norm is above the exact one, by no more than the float32 rounding bound
    # (it is not recomputed in float64: that would need a host synchronisation to find it)
    assert exact <= float(sq[0]) <= exact + float32_gram_slack(64, 64, 5) * float(s[0]) ** 2


def test_sq_norms_upper_bound_in_float64_and_rescued_overflow():
    x = torch.tensor([[1e200, 1e200], [3.0, 4.0], [float("nan"), 1.0]], dtype=torch.float64)
    sq = cert.sq_norms(x)
    assert math.isinf(float(sq[0]))  # the square of a norm above 1.3e154: inf, never a wrong finite value
    assert float(sq[1]) >= 25.0 and float(sq[1]) <= 25.0 * (1 + 1e-14)
    assert math.isnan(float(sq[2]))
    y = torch.tensor([[1e150, 1e150]], dtype=torch.float64)
    assert float(cert.sq_norms(y)[0]) >= 2e300


# --- end to end: every backend, crafted examples --------------------------------------


def _contribution(backend, model, loss_fn, x, y, c):
    fmodel, params = make_functional(model)
    if backend == "vmap":
        per_example = lambda p, xi, yi: loss_fn(fmodel, p, xi[None], yi[None])[0]  # noqa: E731
        fn, state = clipped_grad(per_example, clipping_norm=c, batch_argnums=(1, 2), return_aux=True)
    else:
        batched = lambda p, xb, yb: loss_fn(fmodel, p, xb, yb)  # noqa: E731
        fn, state = clipped_grad(batched, clipping_norm=c, batch_argnums=(1, 2), return_aux=True,
                                 clip_backend=backend, model=fmodel)
    (out, aux), _ = fn(params, x, y, state=state)
    leaves = [v for v in (out.pytree.values() if isinstance(out.pytree, dict) else out.pytree)]
    total = math.sqrt(sum(float(v.double().square().sum()) for v in leaves))
    return total, aux


def _signed_output_loss(fmodel, p, x, y):
    # per-example loss sum_t (out_t . y_t): the output gradient of position t is y_t
    out = fmodel(p, x)
    return (out * y).flatten(1).sum(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(12), deadline=None)
@given(
    t=st.sampled_from([16, 64]),
    spread=st.sampled_from([1e-6, 1e-3, 1e-1]),
    scale=st.sampled_from([1e-6, 1.0, 1e4]),
    c=st.sampled_from([1e-3, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_linear_contribution_at_most_c_on_cancelling_sequences(backend, dtype, t, spread, scale, c, seed):
    d_in, d_out = 256, 8
    model = nn.Linear(d_in, d_out, bias=False).to(dtype)
    x = cancelling(t, d_in, scale, spread, seed, dtype)[None]
    y = alternating(t, d_out, 1.0, seed, dtype)[None]
    total, aux = _contribution(backend, model, _signed_output_loss, x, y, c)
    assert aux.num_nonfinite == 0
    assert total <= c, f"contribution {total} > C = {c} (norm reported {float(aux.grad_norms[0])})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_crafted_example_of_the_issue_stays_within_c(backend, dtype):
    # Nearly identical rows of a long sequence through a large Linear, output gradients of
    # alternating sign: float32 Gram norms used to let it through at ~1.7x C.
    model = nn.Linear(1024, 64, bias=True).to(dtype)
    t = 256
    x = cancelling(t, 1024, 1.0, 1e-5, 11, dtype)[None]
    y = alternating(t, 64, 1.0, 11, dtype)[None]
    total, aux = _contribution(backend, model, _signed_output_loss, x, y, 0.01)
    assert aux.num_nonfinite == 0 and bool(torch.isfinite(aux.grad_norms).all())
    assert total <= 0.01


def _conv_loss(fmodel, p, x, y):
    return (fmodel(p, x) * y).flatten(1).sum(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(8), deadline=None)
@given(spread=st.sampled_from([1e-6, 1e-2]), scale=st.sampled_from([1e-4, 1.0, 1e6]), seed=st.integers(0, 2**16))
def test_conv_contribution_at_most_c_on_constant_images(backend, dtype, spread, scale, seed):
    # A nearly constant image under a checkerboard output gradient: the patches cancel.
    model = nn.Conv2d(16, 4, 3, padding=1, bias=True).to(dtype)
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(1, 16, 1, 1, generator=gen, dtype=torch.float64)
    x = (scale * (base + spread * torch.randn(1, 16, 12, 12, generator=gen, dtype=torch.float64))).to(dtype)
    checker = torch.tensor([[(-1.0) ** (i + j) for j in range(12)] for i in range(12)], dtype=torch.float64)
    y = (checker * torch.randn(1, 4, 1, 1, generator=gen, dtype=torch.float64)).to(dtype)
    total, aux = _contribution(backend, model, _conv_loss, x, y, 0.5)
    assert aux.num_nonfinite == 0
    assert total <= 0.5


class _Tied(nn.Module):
    """An embedding whose table is also the output layer (a tied LM head)."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))


def _tied_loss(fmodel, p, ids, y):
    return (fmodel(p, ids) * y).flatten(1).sum(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(8), deadline=None)
@given(scale=st.sampled_from([1e-3, 1.0, 1e3]), seed=st.integers(0, 2**16))
def test_tied_embedding_contribution_at_most_c_on_repeated_tokens(backend, dtype, scale, seed):
    # One token repeated with alternating output gradients: the lookup's rows and the head's
    # Gram terms cancel each other in the cross term.
    torch.manual_seed(seed)
    model = _Tied(32, 16).to(dtype)
    ids = torch.full((1, 24), 7, dtype=torch.long)
    y = alternating(24, 32, scale, seed, dtype)[None]
    total, aux = _contribution(backend, model, _tied_loss, ids, y, 0.1)
    assert aux.num_nonfinite == 0
    assert total <= 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(8), deadline=None)
@given(scale=st.sampled_from([1e-20, 1e-3, 1.0, 1e3, 1e15]), seed=st.integers(0, 2**16))
def test_norm_and_embedding_contributions_at_most_c_at_extreme_scales(backend, dtype, scale, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(20, 24), nn.LayerNorm(24), nn.Linear(24, 6)).to(dtype)
    ids = torch.randint(0, 20, (1, 10))
    y = alternating(10, 6, scale, seed, dtype)[None]
    total, aux = _contribution(backend, model, _tied_loss, ids, y, 1.0)
    if aux.num_nonfinite:  # only for gradients that are not finite in this dtype
        assert total == 0.0
    assert total <= 1.0


# --- the float32 fast paths -------------------------------------------------------------


def exact_row_sq(x: torch.Tensor) -> float:
    from fractions import Fraction

    return float(sum((Fraction(float(v)) ** 2 for v in x.double().flatten().tolist()), Fraction(0)))


@settings(max_examples=examples(60), deadline=None)
@given(
    t=st.sampled_from([2, 4, 16]),
    d=st.sampled_from([3, 64]),
    spread=st.sampled_from([0.0, 1e-7, 1e-4, 1e-2, 1.0]),
    scale=st.sampled_from([1e-30, 1e-20, 1e-3, 1.0, 1e15, 1e19]),
    g_scale=st.sampled_from([1e-25, 1.0, 1e10]),
    seed=st.integers(0, 2**16),
)
def test_float32_gram_bound_holds_for_every_example_it_keeps(t, d, spread, scale, g_scale, seed):
    # The fast path's bound must hold for every example it does not hand to float64,
    # whatever the cancellation, underflow or scale: those are the norms used as they are.
    a = cancelling(t, d, scale, spread, seed, torch.float32)
    g = alternating(t, 5, g_scale, seed, torch.float32)
    rnd = torch.randn(t, 5, generator=torch.Generator().manual_seed(seed), dtype=torch.float32) * g_scale
    for gg in (g, rnd):
        sq, s, loose = cert._gram_sq_norms_float32(a[None, None], gg[None, None])
        if bool(loose[0]):
            continue
        exact = exact_sq_norm(a, gg)
        assert float(sq[0]) >= exact
        assert float(sq[0]) <= float(s[0]) ** 2 * (1 + 1e-12)
        # ...and the public path (at the power-of-two scale of each example) is as tight:
        # equal but for the underflow terms, which the rescaling can only shrink
        full, _ = cert.gram_sq_norms(a[None, None], gg[None, None])
        assert exact <= float(full[0]) <= float(sq[0]) * (1 + 1e-12)


def test_float32_gram_is_kept_on_ordinary_sequences_and_tight():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(8, 1, 64, 128, generator=gen)
    g = torch.randn(8, 1, 64, 384, generator=gen)
    sq, s, loose = cert._gram_sq_norms_float32(a, g)
    assert not bool(loose.any())  # no example needs float64 here
    ref, _ = cert._gram_sq_norms_float64(a, g)  # tight to ~1e-12
    ratio = sq / ref
    assert bool((ratio >= 1.0 - 1e-9).all()) and bool((ratio <= 1.0 + cert.LOOSE).all())
    print("float32 Gram over-estimate of the squared norm, max:", float(ratio.max() - 1.0))


def test_float32_gram_keeps_a_loose_but_valid_bound_on_cancellation():
    a = cancelling(64, 64, 1.0, 1e-6, 3, torch.float32)
    g = alternating(64, 5, 1.0, 3, torch.float32)
    _, _, loose = cert._gram_sq_norms_float32(a[None, None], g[None, None])
    assert bool(loose[0])  # the float32 bound is far above the tiny exact norm...
    sq, s = cert.gram_sq_norms(a[None, None], g[None, None])
    exact = exact_sq_norm(a, g)  # ...and kept: still an upper bound, within the float32 rounding bound
    assert exact <= float(sq[0]) <= exact + float32_gram_slack(64, 64, 5) * float(s[0]) ** 2


def test_non_ieee_float32_matmul_takes_the_float64_path():
    gen = torch.Generator().manual_seed(1)
    a, g = torch.randn(3, 1, 8, 16, generator=gen), torch.randn(3, 1, 8, 4, generator=gen)
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")  # bf16 matmuls allowed: the float32 bound would not hold
        assert not cert.float32_matmul_is_ieee(a.device)
        sq, s = cert.gram_sq_norms(a, g)
    finally:
        torch.set_float32_matmul_precision(before)
    ref, ref_s = cert._gram_sq_norms_float64(a, g)
    assert torch.equal(sq, ref) and torch.equal(s, ref_s)


@settings(max_examples=examples(60), deadline=None)
@given(
    n=st.sampled_from([1, 5, 64, 512, 700, 1536, 2000]),
    scale=st.sampled_from([1e-44, 1e-30, 1e-20, 1.0, 1e18, 1e19, 3e19]),
    zeros=st.booleans(),
    seed=st.integers(0, 2**16),
)
@pytest.mark.parametrize("path", ["public", "float32 segments", "float64"])
def test_float32_row_sq_norms_are_upper_bounds(path, n, scale, zeros, seed):
    # sq_norms takes the float64 path below _FLOAT32_PATH_ELEMS elements and the float32
    # segment sums above: both paths are checked at every size.
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(3, n, generator=gen, dtype=torch.float64) * scale).to(torch.float32)
    if zeros:
        x[1] = 0.0
    norms = {"public": cert.sq_norms, "float32 segments": cert._sq_norms_float32_scaled,
             "float64": cert._sq_norms_float64}[path]
    sq = norms(x)
    for i in range(3):
        exact = exact_row_sq(x[i])
        if math.isinf(exact):
            assert math.isinf(float(sq[i]))
        else:
            assert float(sq[i]) >= exact
            assert float(sq[i]) <= exact * (1 + cert.LOOSE) + 1e-300


def test_float32_gram_products_past_float32_range_are_rescaled():
    # Grams in range (entries ~1e30 and ~1e20) whose products (~1e50) are not: the float32
    # evaluation of sum Â Ĥ overflows at the stored scale, so the example is taken at the
    # power-of-two scale of its largest entries, where its norm is finite, an upper bound of
    # the exact one, and tight.
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(6, 8, generator=gen) * 1e15
    g = torch.randn(6, 3, generator=gen) * 1e10
    sq32, _, loose = cert._gram_sq_norms_float32(a[None, None], g[None, None])
    assert bool(loose[0])
    sq, s = cert.gram_sq_norms(a[None, None], g[None, None])
    exact = exact_sq_norm(a, g)
    assert exact <= float(sq[0]) <= exact * (1 + 1e-4)


def test_float32_gram_rows_that_cancel_keep_a_valid_bound():
    # Within one row t, sum_s Â_ts Ĥ_ts cancels (Ĥ alternates in sign along s while Â is
    # nearly constant): the float32 row sums lose digits, and what the fast path keeps must
    # still bound the exact norm.
    kept = 0
    for spread, noise in ((1e-1, 1e-1), (1e-2, 1e-1), (1e-1, 1e-2)):
        for seed in range(10):
            a = cancelling(32, 16, 1.0, spread, seed, torch.float32)
            g = alternating(32, 4, 1.0, seed, torch.float32) + noise * torch.randn(
                32, 4, generator=torch.Generator().manual_seed(seed))
            sq, s, loose = cert._gram_sq_norms_float32(a[None, None], g[None, None])
            if not bool(loose[0]):
                kept += 1
                assert float(sq[0]) >= exact_sq_norm(a, g)
    assert kept >= 15  # the fast path keeps most of these (so the bound above is exercised)
