"""Every layer rule of the fast clipping backends against a per-example autograd loop.

Each case is a small float64 model; the clipped sum, the per-example norms and the
per-example losses of ``clip_backend="ghost"``, ``"auto"`` (and of ``"auto"`` with
per-example weight gradients forced) must equal a plain loop that calls
``torch.autograd.grad`` once per example, and the ``"vmap"`` backend.
"""

from __future__ import annotations

from typing import Any, Callable

import hypothesis.strategies as st
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from torch import nn

from opake_fx.dpsgd.clipping import _ghost, _numerics, _rules_embedding, _rules_fallback, _rules_linear
from opake_fx.dpsgd.clipping import clipped_grad
from opake_fx.functional import make_functional

BACKENDS = ["ghost", "auto", "auto-pe"]


def reference(loss_fn: Callable[..., torch.Tensor], params: tuple[torch.Tensor, ...], x: Any, y: Any, c: float):
    """Clipped sum, norms and losses from one ``autograd.grad`` call per example."""
    sums = [torch.zeros_like(p) for p in params]
    norms, losses = [], []
    for i in range(x.shape[0]):
        ps = [p.detach().requires_grad_(True) for p in params]
        loss = loss_fn(ps, x[i : i + 1], y[i : i + 1])[0]
        grads = torch.autograd.grad(loss, ps, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
        n = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
        w = 1.0 if n <= c else c / n
        for s, g in zip(sums, grads):
            s += w * g
        norms.append(float(n))
        losses.append(float(loss.detach()))
    return sums, torch.tensor(norms, dtype=torch.float64), torch.tensor(losses, dtype=torch.float64)


def run_backend(backend: str, batched: Callable[..., torch.Tensor], fmodel: Any, params: tuple[torch.Tensor, ...],
                x: Any, y: Any, c: float, monkeypatch: pytest.MonkeyPatch | None = None, **kw: Any):
    """Runs ``clipped_grad`` with ``backend`` ("auto-pe": auto with per-example weight gradients forced)."""
    if backend == "vmap":
        per_example = lambda p, xi, yi: batched(p, xi[None], yi[None])[0]  # noqa: E731
        fn, state = clipped_grad(per_example, clipping_norm=c, batch_argnums=(1, 2), return_aux=True, **kw)
    else:
        if backend == "auto-pe":
            assert monkeypatch is not None
            monkeypatch.setattr(_rules_linear, "choose_method", lambda mode, t, d_in, d_out: "pe")
        fn, state = clipped_grad(
            batched, clipping_norm=c, batch_argnums=(1, 2), return_aux=True,
            clip_backend="auto" if backend == "auto-pe" else backend, model=fmodel, **kw,
        )
    (out, aux), _ = fn(params, x, y, state=state)
    if monkeypatch is not None:
        monkeypatch.undo()
    return out, aux


def assert_matches(model: nn.Module, batched_of: Callable[[Any], Callable[..., torch.Tensor]], x: Any, y: Any,
                   backend: str, monkeypatch: pytest.MonkeyPatch, rtol: float = 1e-9) -> None:
    model = model.double()
    fmodel, params = make_functional(model)
    batched = batched_of(fmodel)
    _, norms, _ = reference(batched, params, x, y, float("inf"))
    c = float(norms.median())  # about half the examples are clipped
    ref_sum, ref_norms, ref_losses = reference(batched, params, x, y, c)
    forbid_fallbacks(monkeypatch)  # supported layers must be handled by their own rule
    out, aux = run_backend(backend, batched, fmodel, params, x, y, c, monkeypatch)
    assert out.max_norm == c
    for name, got, want in zip(fmodel.param_names, out.pytree, ref_sum):
        scale = max(float(want.abs().max()), 1e-12)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert float((got - want).abs().max()) <= rtol * scale, (name, got, want)
    torch.testing.assert_close(aux.grad_norms, ref_norms, rtol=rtol, atol=1e-12)
    torch.testing.assert_close(aux.loss_values.double(), ref_losses, rtol=rtol, atol=1e-12)


def forbid_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a supported layer went to a vmap fallback")

    monkeypatch.setattr(_ghost, "_whole_loss_per_example", fail)
    monkeypatch.setattr(_rules_fallback, "module_per_example", fail)


def mse(fmodel: Any) -> Callable[..., torch.Tensor]:
    def loss(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = fmodel(p, x)
        return ((out - y) ** 2).flatten(1).sum(1)

    return loss


def targets(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.randn_like(model.double()(x))


# --- Linear -----------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_2d(backend: str, bias: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7, bias=bias), nn.Tanh(), nn.Linear(7, 3))
    x = torch.randn(9, 5, dtype=torch.float64)
    assert_matches(model, mse, x, targets(model, x), backend, monkeypatch)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(6, 4), (3, 2, 4)])
def test_linear_sequence_inputs(backend: str, shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 2))
    x = torch.randn(7, *shape, dtype=torch.float64)
    assert_matches(model, mse, x, targets(model, x), backend, monkeypatch)


@settings(max_examples=15, deadline=None)
@given(
    t=st.integers(1, 5), d_in=st.integers(1, 6), d_out=st.integers(1, 6), batch=st.integers(1, 6),
    scale=st.sampled_from([1e-3, 1.0, 1e3]),
)
def test_linear_ghost_and_per_example_norms_agree(t: int, d_in: int, d_out: int, batch: int, scale: float) -> None:
    torch.manual_seed(t * 100 + d_in * 10 + d_out)
    a = scale * torch.randn(batch, t, d_in, dtype=torch.float64)
    g = torch.randn(batch, t, d_out, dtype=torch.float64)
    lin = nn.Linear(d_in, d_out).double()
    names = {"weight": "weight", "bias": "bias"}
    ghost = _rules_linear.linear_grad(lin, a, g, names, "ghost", torch.float64)
    pe = torch.einsum("bto,bti->boi", g, a)
    torch.testing.assert_close(ghost.sq_norm("weight"), (pe**2).sum((1, 2)), rtol=1e-10, atol=0)
    w = torch.rand(batch, dtype=torch.float64)
    torch.testing.assert_close(ghost.weighted("weight", w, None), torch.einsum("b,boi->oi", w, pe))
    torch.testing.assert_close(ghost.per_example("bias"), g.sum(1))


# --- Embedding ----------------------------------------------------------------------


class EmbedSum(nn.Module):
    def __init__(self, vocab: int, dim: int, padding_idx: int | None = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        self.head = nn.Linear(dim, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(ids)).mean(dim=1))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("padding_idx", [None, 0, 3])
def test_embedding_repeated_tokens_and_padding(backend: str, padding_idx: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(2)
    model = EmbedSum(6, 4, padding_idx)
    ids = torch.randint(0, 6, (8, 10))  # 10 tokens from a vocabulary of 6: many repeats
    ids[0] = 1  # one example made of a single repeated token
    y = torch.randn(8, 2, dtype=torch.float64)
    assert_matches(model, mse, ids, y, backend, monkeypatch)


def test_embedding_never_builds_a_vocab_sized_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    # The norm and the weighted sum of a single-use table come from rows at the ids only.
    torch.manual_seed(3)
    emb = nn.Embedding(100_000, 8).double()
    ids = torch.randint(0, 100_000, (16, 5))
    g = torch.randn(16, 5, 8, dtype=torch.float64)
    rule = _rules_embedding.EmbeddingGrad(ids, g, emb, torch.float64)
    assert rule.rows.shape[0] <= 16 * 5
    w = torch.rand(16, dtype=torch.float64)
    dense = torch.zeros(100_000, 8, dtype=torch.float64).index_add_(0, ids.reshape(-1), (g * w.view(-1, 1, 1)).reshape(-1, 8))
    torch.testing.assert_close(rule.weighted("weight", w, None), dense)


# --- Convolutions ---------------------------------------------------------------------


CONV2D = [
    dict(kernel_size=3),
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=(2, 3), stride=(1, 2), padding=(1, 0), dilation=(2, 1)),
    dict(kernel_size=3, padding=1, groups=2),
    dict(kernel_size=3, padding="same", dilation=2),
    dict(kernel_size=2, padding="same"),
    dict(kernel_size=3, padding=1, padding_mode="reflect"),
    dict(kernel_size=3, padding=1, padding_mode="circular", bias=False),
    dict(kernel_size=2, stride=2),  # patchify: the patches are a view of the input
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cfg", CONV2D, ids=[str(c) for c in CONV2D])
def test_conv2d(backend: str, cfg: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(4)
    model = nn.Sequential(nn.Conv2d(4, 6, **cfg), nn.ReLU(), nn.Flatten(), nn.LazyLinear(3))
    x = torch.randn(5, 4, 7, 8, dtype=torch.float64)
    model.double()(x)  # materialise the lazy layer
    assert_matches(model, mse, x, targets(model, x), backend, monkeypatch)


@pytest.mark.parametrize("backend", ["ghost", "auto"])
@pytest.mark.parametrize("layer", ["conv", "linear-seq"])
def test_rules_cut_the_batch_into_chunks_exactly(backend: str, layer: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from opake_fx.dpsgd.clipping import _numerics

    monkeypatch.setattr(_numerics, "CHUNK_ELEMS", 64)  # every example a chunk of its own
    monkeypatch.setattr(_numerics, "CACHE_ELEMS", 16)
    torch.manual_seed(6)
    if layer == "conv":
        model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))
        x = torch.randn(7, 3, 5, 5, dtype=torch.float64)
    else:
        model = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 2))
        x = torch.randn(7, 4, 6, dtype=torch.float64)
    model.double()(x)
    assert_matches(model, mse, x, targets(model, x), backend, monkeypatch)


DEPTHWISE = [
    dict(kernel_size=3, padding=1),
    dict(kernel_size=3, padding=2, dilation=2, stride=2),
    dict(kernel_size=(3, 2), padding=(2, 1), dilation=(1, 2)),
    dict(kernel_size=4, padding="same", dilation=(2, 1)),
    dict(kernel_size=(1, 3), padding=(0, 1), padding_mode="reflect", bias=False),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cfg", DEPTHWISE, ids=[str(c) for c in DEPTHWISE])
def test_depthwise_conv2d_with_channel_multiplier(backend: str, cfg: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """One group per channel, two filters each (the per-example weight gradients come from one
    grouped convolution over the whole batch)."""
    torch.manual_seed(7)
    model = nn.Sequential(nn.Conv2d(4, 8, groups=4, **cfg), nn.Tanh(), nn.Flatten(), nn.LazyLinear(3))
    x = torch.randn(5, 4, 6, 7, dtype=torch.float64)
    model.double()(x)
    assert_matches(model, mse, x, targets(model, x), backend, monkeypatch)


CONV1D = [
    dict(kernel_size=3),
    dict(kernel_size=4, stride=2, padding=2, dilation=2),
    dict(kernel_size=3, padding=1, groups=3),
    dict(kernel_size=4, padding="same"),
    dict(kernel_size=3, padding=2, padding_mode="replicate"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cfg", CONV1D, ids=[str(c) for c in CONV1D])
def test_conv1d(backend: str, cfg: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(5)
    model = nn.Sequential(nn.Conv1d(3, 6, **cfg), nn.Tanh(), nn.Flatten(), nn.LazyLinear(2))
    x = torch.randn(6, 3, 11, dtype=torch.float64)
    model.double()(x)
    assert_matches(model, mse, x, targets(model, x), backend, monkeypatch)


# --- Normalisation layers ---------------------------------------------------------------


NORMS = [
    ("layernorm-2d", lambda: nn.LayerNorm(6), (6,)),
    ("layernorm-seq", lambda: nn.LayerNorm(6), (4, 6)),
    ("layernorm-2dims", lambda: nn.LayerNorm((3, 6)), (2, 3, 6)),
    ("layernorm-nobias", lambda: nn.LayerNorm(6, bias=False), (4, 6)),
    ("groupnorm", lambda: nn.GroupNorm(2, 6), (6, 3, 3)),
    ("groupnorm-1d", lambda: nn.GroupNorm(3, 6), (6, 5)),
    ("rmsnorm", lambda: nn.RMSNorm(6), (4, 6)),
]


@pytest.mark.parametrize("backend", ["ghost", "auto"])
@pytest.mark.parametrize("name,make,shape", NORMS, ids=[n[0] for n in NORMS])
def test_norm_layers(backend: str, name: str, make: Callable[[], nn.Module], shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(6)
    norm = make()
    with torch.no_grad():  # non-trivial affine parameters
        for p in norm.parameters():
            p.add_(0.3 * torch.randn_like(p))
    model = nn.Sequential(norm, nn.Tanh())
    x = torch.randn(7, *shape, dtype=torch.float64) * 2 + 0.5
    assert_matches(model, mse, x, targets(model, x), backend, monkeypatch)


def test_float32_matches_vmap_to_1e5() -> None:
    # The acceptance bar: same results as the vmap backend to 1e-5 relative (float32 model).
    torch.manual_seed(7)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 36, 16), nn.LayerNorm(16), nn.Linear(16, 3))
    fmodel, params = make_functional(model)
    x, y = torch.randn(12, 2, 6, 6), torch.randint(0, 3, (12,))
    batched = lambda p, x, y: F.cross_entropy(fmodel(p, x), y, reduction="none")  # noqa: E731
    want, want_aux = run_backend("vmap", batched, fmodel, params, x, y, 0.5)
    for backend in ("ghost", "auto"):
        got, got_aux = run_backend(backend, batched, fmodel, params, x, y, 0.5)
        for a, b in zip(got.pytree, want.pytree):
            assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())
        torch.testing.assert_close(got_aux.grad_norms, want_aux.grad_norms, rtol=1e-5, atol=0)
