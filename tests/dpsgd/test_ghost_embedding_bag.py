"""The ``nn.EmbeddingBag`` rule (``_embedding_bag``) against a per-example autograd loop.

Modes sum (with and without per-sample weights), mean and max; ``padding_idx``; the
2-D ``[B, L]`` form and the flat form (1-D ids and offsets, with and without
``include_last_offset``) with empty bags and repeated ids; batch sizes equal to the bag
length, the embedding dimension and the number of tokens; a table tied to the output
layer. Clipped sum and per-example norms must equal the loop in float64 to 1e-10 without
any vmap fallback; adversarial inputs in float32 and bfloat16 must stay within C.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from torch import nn

from opake_fx.dpsgd.clipping import _ghost, _rules_fallback
from opake_fx.dpsgd.clipping import clipped_grad
from opake_fx.errors import OpakeError, SlowPathWarning
from opake_fx.functional import make_functional

BACKENDS = ["ghost", "auto"]
VOCAB, DIM, L = 12, 5, 4


class Bag(nn.Module):
    """An EmbeddingBag and a head; ``flat``: the bags are built inside the forward from a
    padded ``[B, L]`` batch (-1 marks an absent slot), so the ids tensor has no batch axis."""

    def __init__(self, mode: str, padding_idx: int | None, flat: bool, weighted: bool, include_last: bool = False,
                 tied: bool = False) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(VOCAB, DIM, mode=mode, padding_idx=padding_idx, include_last_offset=include_last)
        if tied:
            self.head = nn.Linear(DIM, VOCAB, bias=False)
            self.head.weight = self.bag.weight
        else:
            self.head = nn.Linear(DIM, 3)
        self.flat, self.weighted, self.include_last = flat, weighted, include_last

    def forward(self, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if not self.flat:
            out = self.bag(ids.clamp_min(0), per_sample_weights=w if self.weighted else None)
        else:
            keep = ids >= 0
            lengths = keep.sum(1)
            offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]])
            if self.include_last:
                offsets = torch.cat([offsets, lengths.sum().reshape(1)])
            out = self.bag(ids[keep], offsets, per_sample_weights=w[keep] if self.weighted else None)
        return self.head(torch.tanh(out))


def batch(b: int, seed: int, flat: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [b, L] with repeated ids and padding (id 0); in the flat form -1 slots too (an
    empty bag for example 1); per-sample weights of both signs; labels."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 6, (b, L), generator=gen)  # a small range: ids repeat within bags
    ids[0] = torch.tensor([3, 3, 0, 5])
    if b > 2:
        ids[2] = 0  # only padding: an empty bag after padding is removed
    if flat:
        absent = torch.rand(b, L, generator=gen) < 0.3
        ids = torch.where(absent, torch.full_like(ids, -1), ids)
        if b > 1:
            ids[1] = -1  # an empty bag
    w = torch.rand(b, L, generator=gen, dtype=torch.float64) * 2 - 0.5
    return ids, w, torch.randint(0, 3, (b,), generator=gen)


def loss_of(fmodel: Any, tied: bool) -> Any:
    def loss(p: Any, ids: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(fmodel(p, ids, w), y, reduction="none")

    return loss


def reference(loss: Any, params: tuple[torch.Tensor, ...], xs: tuple[torch.Tensor, ...], c: float):
    sums = [torch.zeros_like(p) for p in params]
    norms = []
    for i in range(xs[0].shape[0]):
        ps = [p.detach().requires_grad_(True) for p in params]
        grads = torch.autograd.grad(loss(ps, *(x[i : i + 1] for x in xs))[0], ps, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
        n = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))
        for s, g in zip(sums, grads):
            s += (1.0 if n <= c else c / n) * g
        norms.append(n)
    return sums, torch.tensor(norms, dtype=torch.float64)


def assert_exact(model: nn.Module, xs: tuple[torch.Tensor, ...], backend: str, monkeypatch: pytest.MonkeyPatch,
                 tied: bool = False) -> None:
    model = model.double()
    fmodel, params = make_functional(model)
    loss = loss_of(fmodel, tied)
    _, unclipped = reference(loss, params, xs, math.inf)
    c = float(unclipped.median())
    want, norms = reference(loss, params, xs, c)

    def fail(*a: Any, **k: Any) -> None:
        raise AssertionError("the embedding bag went to a vmap fallback")

    monkeypatch.setattr(_rules_fallback, "module_per_example", fail)
    monkeypatch.setattr(_ghost, "_whole_loss_per_example", fail)
    fn, state = clipped_grad(loss, clipping_norm=c, batch_argnums=(1, 2, 3), return_aux=True, clip_backend=backend,
                             model=fmodel)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPathWarning)
        (out, aux), _ = fn(params, *xs, state=state)
    scale = max(float(w.abs().max()) for w in want)
    for name, got, ref in zip(fmodel.param_names, out.pytree, want):
        assert float((got - ref).abs().max()) <= 1e-10 * scale, (name, got, ref)
    torch.testing.assert_close(aux.grad_norms, norms, rtol=1e-10, atol=0.0)


CONFIGS = [
    dict(mode="sum", padding_idx=None, weighted=False),
    dict(mode="sum", padding_idx=0, weighted=False),
    dict(mode="sum", padding_idx=None, weighted=True),
    dict(mode="sum", padding_idx=0, weighted=True),
    dict(mode="mean", padding_idx=None, weighted=False),
    dict(mode="mean", padding_idx=0, weighted=False),
    dict(mode="max", padding_idx=None, weighted=False),
    dict(mode="max", padding_idx=0, weighted=False),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("b", [5, L, DIM, 3])
def test_two_dimensional_bags(backend: str, cfg: dict, b: int, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    assert_exact(Bag(flat=False, **cfg), batch(b, 10 + b, flat=False), backend, monkeypatch)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("include_last", [False, True])
@pytest.mark.parametrize("b", [5, L, DIM])
def test_flat_bags_with_offsets(backend: str, cfg: dict, include_last: bool, b: int,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(1)
    assert_exact(Bag(flat=True, include_last=include_last, **cfg), batch(b, 20 + b, flat=True), backend, monkeypatch)


@pytest.mark.parametrize("backend", BACKENDS)
def test_number_of_tokens_equal_to_the_batch_size(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Flat ids of length N == B: only the offsets (the output's rows) say which bag is whose.
    torch.manual_seed(2)
    ids = torch.tensor([[3, 4, -1, -1], [-1, -1, -1, -1], [5, -1, -1, -1], [1, -1, -1, -1]])
    w = torch.rand(4, L, dtype=torch.float64) + 0.5
    y = torch.tensor([0, 1, 2, 0])
    assert int((ids >= 0).sum()) == ids.shape[0]
    assert_exact(Bag("sum", None, flat=True, weighted=True), (ids, w, y), backend, monkeypatch)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("flat", [False, True])
def test_table_tied_to_the_output_layer(backend: str, mode: str, flat: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # The bag's table is also the head's weight: the cross terms between the bag's rows and
    # the head's Linear come from the stored tokens (no per-example [B, V, D]).
    torch.manual_seed(3)
    ids, w, _ = batch(5, 30, flat=flat)
    y = torch.randint(0, VOCAB, (5,), generator=torch.Generator().manual_seed(4))
    assert_exact(Bag(mode, 0, flat=flat, weighted=False, tied=True), (ids, w, y), backend, monkeypatch, tied=True)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("include_last", [False, True])
@pytest.mark.parametrize("b", [5, L, 3])
def test_flat_rule_matches_autograd_per_bag(cfg: dict, include_last: bool, b: int) -> None:
    # The rule on the flat form (ids [N], offsets; empty bags, padding inside bags, N == B for
    # some draws) against autograd of g_b . out_b for each bag b alone: per-example gradients,
    # certified norms (an upper bound within 1e-12) and the weighted sum.
    from opake_fx.dpsgd.clipping import _rules_embedding as EB

    torch.manual_seed(7)
    module = nn.EmbeddingBag(VOCAB, DIM, mode=cfg["mode"], padding_idx=cfg["padding_idx"],
                             include_last_offset=include_last).double()
    ids, w, _ = batch(b, 40 + b, flat=True)
    keep = ids >= 0
    lengths = keep.sum(1)
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]])
    if include_last:
        offsets = torch.cat([offsets, lengths.sum().reshape(1)])
    psw = w[keep] if cfg["weighted"] else None
    out = module(ids[keep], offsets, per_sample_weights=psw)
    g = torch.randn(b, DIM, dtype=torch.float64)
    saved = EB.EMBEDDING_BAG.route(module, (ids[keep], offsets), {"per_sample_weights": psw}, out)
    assert saved is not None
    rule = EB.bag_grad(saved, g, module, torch.float64, keep_tokens=True)
    want = torch.stack([torch.autograd.grad((out[i] * g[i]).sum(), module.weight, retain_graph=True)[0]
                        for i in range(b)])
    torch.testing.assert_close(rule.per_example("weight"), want, rtol=1e-12, atol=1e-15)
    exact = want.square().flatten(1).sum(1)
    got = rule.sq_norm("weight")
    assert bool((got >= exact).all()) and bool((got <= exact * (1 + 1e-12) + 1e-300).all())
    coeff = torch.rand(b, dtype=torch.float64)
    torch.testing.assert_close(rule.weighted("weight", coeff, None), (coeff.view(-1, 1, 1) * want).sum(0),
                               rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("setting", [dict(scale_grad_by_freq=True), dict(max_norm=1.0)], ids=str)
def test_settings_that_mix_examples_or_modify_the_table_are_refused(setting: dict) -> None:
    model = nn.Sequential(nn.EmbeddingBag(VOCAB, DIM, mode="sum", **setting), nn.Linear(DIM, 2)).double()
    fmodel, params = make_functional(model)

    def loss(p: Any, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(fmodel(p, ids), y, reduction="none")

    fn, state = clipped_grad(loss, clipping_norm=1.0, batch_argnums=(1, 2), clip_backend="auto", model=fmodel)
    with pytest.raises(OpakeError, match="EmbeddingBag"):
        fn(params, torch.randint(0, VOCAB, (3, L)), torch.randint(0, 2, (3,)), state=state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [1e-20, 1e-3, 1.0, 1e3, 1e15])
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_contribution_at_most_c_at_extreme_scales(backend: str, dtype: torch.dtype, scale: float, mode: str) -> None:
    # One id repeated through a long bag (its row is a sum of many equal terms), per-sample
    # weights of alternating sign that nearly cancel, a tied head; huge and tiny scales.
    torch.manual_seed(6)
    model = Bag(mode, None, flat=False, weighted=mode == "sum", tied=True).to(dtype)
    fmodel, params = make_functional(model)
    t = 64
    ids = torch.full((1, t), 7, dtype=torch.long)
    ids[0, ::9] = 2
    w = (torch.tensor([(-1.0) ** k for k in range(t)]) * scale + 1e-3 * scale).to(dtype)[None]
    y = (torch.randn(1, VOCAB) * scale).to(dtype)

    def loss(p: Any, xb: torch.Tensor, wb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return (fmodel(p, xb, wb) * yb).sum(1) * scale

    for c in (1e-3, 1.0):
        fn, state = clipped_grad(loss, clipping_norm=c, batch_argnums=(1, 2, 3), return_aux=True, clip_backend=backend,
                                 model=fmodel)
        with warnings.catch_warnings():
            warnings.simplefilter("error", SlowPathWarning)
            (out, aux), _ = fn(params, ids, w, y, state=state)
        total = math.sqrt(sum(float(v.double().square().sum()) for v in out.pytree))
        if aux.num_nonfinite:
            assert total == 0.0
        assert total <= c, f"contribution {total} > C = {c}"


# --- property: drawn adversarial inputs ---------------------------------------------------

NIGHTLY = os.environ.get("HYPOTHESIS_PROFILE") == "nightly"


@settings(max_examples=2000 if NIGHTLY else 60, deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)
@given(
    mode=st.sampled_from(["sum", "mean", "max"]),
    flat=st.booleans(),
    tied=st.booleans(),
    backend=st.sampled_from(BACKENDS),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    t=st.integers(1, 64),
    scale=st.sampled_from([1e-30, 1e-12, 1e-3, 1.0, 1e3, 1e12, 1e30]),
    imbalance=st.sampled_from([0.0, 1e-6, 1e-3, 1.0]),
    c=st.sampled_from([1e-4, 1e-2, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_property_contribution_at_most_c(mode, flat, tied, backend, dtype, t, scale, imbalance, c, seed) -> None:
    # One id repeated through the bag with per-sample weights of alternating sign (their sum
    # nearly cancels), a few other ids, a head that may share the table; huge and tiny scales.
    torch.manual_seed(seed)
    model = Bag(mode, None, flat=flat, weighted=mode == "sum", tied=tied).to(dtype)
    fmodel, params = make_functional(model)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.full((1, t), 7, dtype=torch.long)
    ids[0, torch.rand(t, generator=gen) < 0.2] = 2
    signs = torch.tensor([(-1.0) ** k for k in range(t)], dtype=torch.float64)
    w = (scale * (signs + imbalance)).to(dtype)[None]
    y = (torch.randn(1, VOCAB if tied else 3, generator=gen, dtype=torch.float64) * scale).to(dtype)

    def loss(p: Any, xb: torch.Tensor, wb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return (fmodel(p, xb, wb).float() * yb.float()).sum(1)

    fn, state = clipped_grad(loss, clipping_norm=c, batch_argnums=(1, 2, 3), return_aux=True, clip_backend=backend,
                             model=fmodel)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowPathWarning)
        (out, aux), _ = fn(params, ids, w, y, state=state)
    total = math.sqrt(sum(float(v.double().square().sum()) for v in out.pytree))
    assert total <= c, f"contribution {total} > C = {c} (norm reported {float(aux.grad_norms[0])})"
