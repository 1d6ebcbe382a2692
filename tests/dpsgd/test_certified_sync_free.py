"""Certified norms without host synchronisation, on adversarial batches.

The certification (``_certified.py``) no longer looks on the host for examples whose
float32 bound is loose or out of range (``bool(loose.any())``) to recompute them in
float64: examples outside a safe band are taken at the power-of-two scale of their largest
entries, on the device, and an example whose float32 Gram bound is loose (crafted
cancellation) keeps that bound. These tests draw batches that mix what used to be sent to
float64 (crafted cancellation, entries of 1e30 and 1e-30, float32 subnormals, rows at the
edge of float32's range, zero rows, NaN and inf rows) with ordinary ones, and check, for
every example, against its exact norm (rational arithmetic on the stored values):

* the certified squared norm is at least the exact one, and a row or example with a finite
  exact norm gets a finite norm (never weight 0); only NaN / inf entries give a
  non-finite one;
* it stays tight (``sq_norms``: within 1e-4; Gram norms: within the float32 rounding
  bound of ``_gram_sq_norms_float32_scaled``'s docstring);
* the call makes no host synchronisation.

End to end, ``clipped_grad`` with ``"ghost"`` and ``"auto"`` on such a batch gives weight 0
to the NaN example only, every other example a norm at or above its exact norm, and its
steady step makes no host synchronisation.
"""

from __future__ import annotations

import math
from fractions import Fraction

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from opake_fx.dpsgd.clipping import _certified as cert
from opake_fx.dpsgd.clipping import clipped_grad
from opake_fx.functional import make_functional
from opake_fx.pytree import leaves
from tests.dpsgd.test_certified_norms import alternating, cancelling, examples, float32_gram_slack


class SyncCounter(TorchDispatchMode):
    """Counts ``aten::_local_scalar_dense`` (``.item()``, ``bool(tensor)``, ...) under it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def exact_row_sq(row: torch.Tensor) -> Fraction | None:
    """The exact squared norm of the stored row (None if it holds a NaN or an inf)."""
    values = row.double().tolist()
    if not all(math.isfinite(v) for v in values):
        return None
    return sum((Fraction(v) ** 2 for v in values), Fraction(0))


def exact_gram_sq(a: torch.Tensor, g: torch.Tensor) -> Fraction | None:
    """``||g^T a||_F^2`` of one example ``a [T, d_in]``, ``g [T, d_out]``, exactly."""
    av, gv = a.double().tolist(), g.double().tolist()
    if not all(math.isfinite(v) for row in av + gv for v in row):
        return None
    a_f = [[Fraction(v) for v in row] for row in av]
    g_f = [[Fraction(v) for v in row] for row in gv]
    total = Fraction(0)
    for o in range(len(g_f[0])):
        for i in range(len(a_f[0])):
            entry = sum((g_f[t][o] * a_f[t][i] for t in range(len(a_f))), Fraction(0))
            total += entry * entry
    return total


# Row kinds: (name, scale of the entries); "edge" rows hold entries near float32's largest.
ROW_KINDS = ["normal", "huge", "edge", "sum_overflows", "tiny", "subnormal", "mixed", "zero", "nan", "inf"]


def _row(kind: str, n: int, gen: torch.Generator) -> torch.Tensor:
    r = torch.randn(n, generator=gen, dtype=torch.float64)
    if kind == "normal":
        return r.float()
    if kind == "huge":
        return (r * 1e30).float()
    if kind == "edge":  # entries up to ~3e38: their squares overflow float32 by far
        return (r.clamp(-1, 1) * 3.0e38).float()
    if kind == "sum_overflows":  # squares in range, their float32 sum not
        return (r * 1e19).float()
    if kind == "tiny":
        return (r * 1e-30).float()
    if kind == "subnormal":
        return (r * 1e-42).float()
    if kind == "mixed":  # one huge entry among tiny ones: scaling down underflows the rest
        x = (r * 1e-30).float()
        x[0] = 1e30
        return x
    if kind == "zero":
        return torch.zeros(n)
    x = r.float()
    x[n // 2] = float("nan") if kind == "nan" else float("inf")
    return x


@settings(max_examples=examples(40), deadline=None)
@given(
    n=st.sampled_from([512, 700, 2000]),
    kinds=st.lists(st.sampled_from(ROW_KINDS), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_float32_row_norms_of_a_mixed_batch_bound_every_row_without_a_sync(n, kinds, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.stack([_row(k, n, gen) for k in kinds])
    with SyncCounter() as syncs:
        sq = cert.sq_norms(x)
    assert syncs.count == 0
    for i, kind in enumerate(kinds):
        exact = exact_row_sq(x[i])
        got = float(sq[i])
        if exact is None:
            assert not math.isfinite(got), kind
            continue
        assert math.isfinite(got), f"{kind}: a finite row got {got} (weight 0)"
        assert Fraction(got) >= exact, kind
        assert Fraction(got) <= exact * Fraction(1 + 1e-4) + Fraction(2.0**-1070), kind  # tight, not recomputed
        if kind == "zero":
            assert got == 0.0


EXAMPLE_KINDS = [  # (kind of a, scale of a, kind of g, scale of g)
    ("random", 1.0, "random", 1.0),
    ("cancelling", 1.0, "alternating", 1.0),
    ("cancelling", 1e30, "alternating", 1e-30),
    ("random", 1e30, "random", 1e5),      # Gram products past float32's range
    ("random", 3.0e38, "random", 1.0),    # row norms past float32's range
    ("random", 1e-30, "random", 1e-25),   # underflow in every product
    ("random", 1e-42, "random", 1.0),     # subnormal inputs
    ("random", 1.0, "random", 1e-8),      # an ordinary output gradient scale
    ("random", 1.0, "zero", 0.0),
    ("random", 1.0, "nan", 1.0),
]


def _example(kind: tuple[str, float, str, float], t: int, d_in: int, d_out: int, seed: int):
    a_kind, a_scale, g_kind, g_scale = kind
    gen = torch.Generator().manual_seed(seed)
    if a_kind == "cancelling":
        a = cancelling(t, d_in, 1.0, 1e-6, seed, torch.float64)
    else:
        a = torch.randn(t, d_in, generator=gen, dtype=torch.float64).clamp(-1, 1)
    if g_kind == "alternating":
        g = alternating(t, d_out, 1.0, seed, torch.float64)
    else:
        g = torch.randn(t, d_out, generator=gen, dtype=torch.float64)
    g = g * g_scale
    if g_kind == "nan":
        g[0, 0] = float("nan")
    return (a * a_scale).float(), g.float()


@settings(max_examples=examples(25), deadline=None)
@given(
    picks=st.lists(st.integers(0, len(EXAMPLE_KINDS) - 1), min_size=1, max_size=5),
    t=st.sampled_from([2, 8]),
    d_in=st.sampled_from([3, 16]),
    seed=st.integers(0, 2**16),
)
def test_float32_gram_norms_of_a_mixed_batch_bound_every_example_without_a_sync(picks, t, d_in, seed):
    d_out = 4
    pairs = [_example(EXAMPLE_KINDS[k], t, d_in, d_out, seed + i) for i, k in enumerate(picks)]
    a = torch.stack([p[0] for p in pairs]).unsqueeze(1)
    g = torch.stack([p[1] for p in pairs]).unsqueeze(1)
    with SyncCounter() as syncs:
        sq, s = cert.gram_sq_norms(a, g)
    assert syncs.count == 0
    for i, k in enumerate(picks):
        exact = exact_gram_sq(a[i, 0], g[i, 0])
        got, tri = float(sq[i]), float(s[i])
        if exact is None:
            assert not math.isfinite(got), EXAMPLE_KINDS[k]
            continue
        assert math.isfinite(got), f"{EXAMPLE_KINDS[k]}: finite exact norm, certified {got} (weight 0)"
        assert Fraction(got) >= exact, EXAMPLE_KINDS[k]
        assert got <= tri**2 * (1 + 1e-12)
        # loose only by the float32 rounding bound (crafted cancellation), never more
        slack = Fraction(float32_gram_slack(t, d_in, d_out)) * Fraction(tri) ** 2
        assert Fraction(got) <= exact + slack + Fraction(2.0**-1000), EXAMPLE_KINDS[k]


def test_float64_norms_far_below_float64_range_stay_upper_bounds():
    # Squares of 1e-200 underflow in float64: the bound must not round to 0 below the exact value.
    x = torch.full((2, 3), 1e-200, dtype=torch.float64)
    x[1] = 0.0
    sq = cert.sq_norms(x)
    assert Fraction(float(sq[0])) >= exact_row_sq(x[0]) > 0 and float(sq[1]) == 0.0
    a = torch.full((1, 1, 2, 3), 1e-200, dtype=torch.float64)
    g = torch.full((1, 1, 2, 2), 1e-200, dtype=torch.float64)
    sq, s = cert.gram_sq_norms(a, g)
    assert Fraction(float(sq[0])) >= exact_gram_sq(a[0, 0], g[0, 0]) > 0
    with SyncCounter() as syncs:
        cert.sq_norms(x), cert.gram_sq_norms(a, g)
    assert syncs.count == 0


def test_power_of_two_scales_are_exact():
    # built from the bits: 2**e exactly, over the dtype's whole normal range
    for dtype, top in ((torch.float32, 127), (torch.float64, 1023)):
        e = torch.arange(-top + 1, top + 1)
        mantissa, exponent = torch.frexp(cert._exp2(e, dtype))
        assert bool((mantissa == 0.5).all()) and bool((exponent.long() == e + 1).all())


# --- end to end ---------------------------------------------------------------------------


def _mixed_batch(t: int, d_in: int, d_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and output gradients (the loss is sum_t out_t . y_t, so g = y) of: an ordinary
    example, crafted cancellation, inputs of 1e30 (Gram products past float32's range),
    output gradients of 1e-30, subnormal inputs, and an example with a NaN input."""
    gen = torch.Generator().manual_seed(0)
    xs, ys = [], []
    for kind in ("normal", "cancel", "huge", "tiny_g", "subnormal", "nan"):
        x = torch.randn(t, d_in, generator=gen, dtype=torch.float64)
        y = torch.randn(t, d_out, generator=gen, dtype=torch.float64)
        if kind == "cancel":
            x, y = cancelling(t, d_in, 1.0, 1e-6, 1, torch.float64), alternating(t, d_out, 1.0, 1, torch.float64)
        elif kind == "huge":
            x = x * 1e30
        elif kind == "tiny_g":
            y = y * 1e-30
        elif kind == "subnormal":
            x = x * 1e-42
        elif kind == "nan":
            x[1, 2] = float("nan")
        xs.append(x.float())
        ys.append(y.float())
    return torch.stack(xs), torch.stack(ys)


@pytest.mark.parametrize("backend", ["ghost", "auto"])
def test_a_mixed_batch_drops_only_the_nan_example_and_makes_no_sync(backend):
    t, d_in, d_out = 16, 64, 8  # "auto": per-example weights (512 entries, the float32 fast path)
    torch.manual_seed(0)
    model = nn.Linear(d_in, d_out, bias=True)
    model.weight.data.mul_(1e-3)  # keeps the 1e30 example's outputs finite in float32
    fmodel, params = make_functional(model)
    x, y = _mixed_batch(t, d_in, d_out)

    def loss(p, xb, yb):
        return (fmodel(p, xb) * yb).flatten(1).sum(1)

    fn, state = clipped_grad(loss, clipping_norm=1.0, batch_argnums=(1, 2), return_aux=True, clip_backend=backend,
                             model=fmodel)
    (_, aux), _ = fn(params, x, y, state=state)
    assert aux.num_nonfinite == 1
    for i in range(5):  # every example but the NaN one: a finite norm at or above its exact norm
        exact = exact_gram_sq(x[i], y[i]) + exact_row_sq(y[i].double().sum(0))  # weight, and a bias of sum_t g_t
        assert math.isfinite(float(aux.grad_norms[i]))
        assert Fraction(float(aux.grad_norms[i])) ** 2 >= exact * Fraction(1 - 1e-12)
        assert float(aux.clipped_grad_norms[i]) > 0.0  # its weight is not 0
    assert float(aux.clipped_grad_norms[5]) == 0.0
    plain, state = clipped_grad(loss, clipping_norm=1.0, batch_argnums=(1, 2), clip_backend=backend, model=fmodel)
    for _ in range(2):
        out, _ = plain(params, x, y, state=state)
    with SyncCounter() as syncs:
        out, _ = plain(params, x, y, state=state)
    assert syncs.count == 0
    assert all(bool(torch.isfinite(v).all()) for v in leaves(out.pytree))
