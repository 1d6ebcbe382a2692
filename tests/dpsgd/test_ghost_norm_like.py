"""The rule for norm-like modules recognised by what they compute (``_rules_norm``).

Modules with one 1-D ``weight`` (and maybe a ``bias``) whose output is elementwise affine
in them — Hugging Face's RMSNorm classes, LayerNorm subclasses with their own forward,
Gemma's ``(1 + w) x``, eval-mode ``BatchNorm1d`` on ``[B, C]`` — must take the rule (no
vmap fallback) and give the clipped sum and norms of a per-example autograd loop in
float64 to 1e-10. Modules that only look like them (a weight squared, a weight along
another axis of equal size, randomness inside) must take the exact fallback and say so.
Adversarial inputs in float32 and bfloat16 must never contribute more than C.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any, Callable

import hypothesis.strategies as st
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from torch import nn

from opake_fx.dpsgd.clipping import _rules_norm as AN
from opake_fx.dpsgd.clipping import _ghost, _rules_fallback
from opake_fx.dpsgd.clipping import clipped_grad
from opake_fx.errors import SlowPathWarning
from opake_fx.functional import make_functional

try:
    import transformers
except ImportError:  # pragma: no cover
    transformers = None

BACKENDS = ["ghost", "auto"]
D = 6


# --- norm-like modules ------------------------------------------------------------------


class RMSNormLike(nn.Module):
    """LlamaRMSNorm's forward (float32 statistics, cast back, weight times normalised input)."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32) if dtype != torch.float64 else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


class LayerNormSubclass(nn.LayerNorm):
    """A LayerNorm subclass with its own forward (GPT-NeoX-style wrappers)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class OffsetNorm(nn.Module):
    """Gemma's RMSNorm: ``(1 + w) * normalised(x)``; w initialised to zeros."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return h * (1.0 + self.weight)


class SquaredWeight(nn.Module):
    """Looks norm-like but is not affine in its weight: at w = 1 it cannot be told apart."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self.weight * torch.tanh(x)


class CountingNorm(nn.Module):
    """Norm-like, but its forward updates a buffer: it must not be re-run for good."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.weight * x


class Net(nn.Module):
    """Linear -> norm -> Linear on ``[B, *, D]`` inputs."""

    def __init__(self, norm: nn.Module, d: int = D) -> None:
        super().__init__()
        self.inp, self.norm, self.out = nn.Linear(d, d), norm, nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.norm(self.inp(x))))


def _randomise(norm: nn.Module, seed: int = 0) -> nn.Module:
    """The norm's weight around 1 and its bias around 0, with distinct entries (a trained layer)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in norm.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) * 0.5 + (1.0 if n == "weight" else 0.0))
    return norm


def mse(fmodel: Any) -> Callable[..., torch.Tensor]:
    def loss(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((fmodel(p, x) - y) ** 2).flatten(1).sum(1)

    return loss


# --- reference and runner -----------------------------------------------------------------


def reference(loss_fn: Callable[..., torch.Tensor], params: tuple[torch.Tensor, ...], x: torch.Tensor, y: torch.Tensor,
              c: float) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Clipped sum and norms from one ``autograd.grad`` per example (batch of one)."""
    sums = [torch.zeros_like(p) for p in params]
    norms = []
    for i in range(x.shape[0]):
        ps = [p.detach().requires_grad_(True) for p in params]
        grads = torch.autograd.grad(loss_fn(ps, x[i : i + 1], y[i : i + 1])[0], ps, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
        n = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))
        w = 1.0 if n <= c else c / n
        for s, g in zip(sums, grads):
            s += w * g
        norms.append(n)
    return sums, torch.tensor(norms, dtype=torch.float64)


def run(backend: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, c: float) -> tuple[Any, Any, list[str]]:
    fmodel, params = make_functional(model)
    fn, state = clipped_grad(mse(fmodel), clipping_norm=c, batch_argnums=(1, 2), return_aux=True,
                             clip_backend=backend, model=fmodel)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (out, aux), _ = fn(params, x, y, state=state)
    return out, aux, [str(w.message) for w in caught if issubclass(w.category, SlowPathWarning)]


def assert_exact(model: nn.Module, x: torch.Tensor, backend: str, monkeypatch: pytest.MonkeyPatch | None,
                 rtol: float = 1e-10) -> list[str]:
    """The backend against the per-example loop (float64); with ``monkeypatch``, every vmap
    fallback is an error (the rule must take the module)."""
    model = model.double()
    fmodel, params = make_functional(model)
    with torch.no_grad():
        y = torch.randn_like(model(x))
    _, unclipped = reference(mse(fmodel), params, x, y, math.inf)
    c = float(unclipped.median())
    want, norms = reference(mse(fmodel), params, x, y, c)
    if monkeypatch is not None:
        def fail(*a: Any, **k: Any) -> None:
            raise AssertionError("a norm-like module went to a vmap fallback")

        monkeypatch.setattr(_rules_fallback, "module_per_example", fail)
        monkeypatch.setattr(_ghost, "_whole_loss_per_example", fail)
    out, aux, slow = run(backend, model, x, y, c)
    scale = max(float(w.abs().max()) for w in want)
    for name, got, ref in zip(fmodel.param_names, out.pytree, want):
        assert float((got - ref).abs().max()) <= rtol * scale, (name, got, ref)
    torch.testing.assert_close(aux.grad_norms, norms, rtol=rtol, atol=0.0)
    return slow


# --- the rule takes them, exactly -----------------------------------------------------------

NORM_LIKE: dict[str, Callable[[int], nn.Module]] = {
    "rmsnorm_like": lambda d: RMSNormLike(d),
    "layernorm_subclass": lambda d: LayerNormSubclass(d),
    "layernorm_subclass_no_bias": lambda d: LayerNormSubclass(d, bias=False),
    "gemma_offset": lambda d: OffsetNorm(d),
}
if transformers is not None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    NORM_LIKE.update({"LlamaRMSNorm": LlamaRMSNorm, "Qwen2RMSNorm": Qwen2RMSNorm, "MistralRMSNorm": MistralRMSNorm,
                      "T5LayerNorm": T5LayerNorm})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(NORM_LIKE))
@pytest.mark.parametrize("shape", [(5, 4, D), (D, D, D), (4, 4, D), (D, D), (3, 2, 5, D)], ids=str)
def test_norm_like_modules_take_the_rule_exactly(backend: str, name: str, shape: tuple[int, ...],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # Batch sizes equal to the sequence length and to the feature size (D, D, D), a 2-D input,
    # a 4-D one; trained (random) weights and biases.
    torch.manual_seed(0)
    model = Net(_randomise(NORM_LIKE[name](D)))
    x = torch.randn(*shape, dtype=torch.float64)
    assert assert_exact(model, x, backend, monkeypatch) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_weights_at_their_initial_ones_and_zeros(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # At w = 1 (RMSNorm's initialisation) and w = 0 (Gemma's) every function of w looks
    # linear; the probe must still find the right form.
    torch.manual_seed(1)
    for norm in (RMSNormLike(D), OffsetNorm(D), LayerNormSubclass(D)):
        model = Net(norm)
        assert assert_exact(model, torch.randn(5, 3, D, dtype=torch.float64), backend, monkeypatch) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_batchnorm1d_in_eval_takes_the_rule(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(2)
    bn = nn.BatchNorm1d(D)
    with torch.no_grad():
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
    model = Net(_randomise(bn)).eval()
    assert assert_exact(model, torch.randn(D, D, dtype=torch.float64), backend, monkeypatch) == []


# --- look-alikes take the exact fallback and say so ---------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_weight_squared_at_ones_is_not_taken_for_affine(backend: str) -> None:
    # w = 1 everywhere: w * w * x == w * x at this weight; only the probe can tell.
    AN._PROBED.clear()
    torch.manual_seed(3)
    slow = assert_exact(Net(SquaredWeight(D)), torch.randn(5, 4, D, dtype=torch.float64), backend, None)
    assert any("not elementwise affine" in m for m in slow), slow


@pytest.mark.parametrize("backend", BACKENDS)
def test_weight_along_another_axis_of_equal_size(backend: str) -> None:
    # BatchNorm2d (eval) on [B, C, H, W] with W == C: the weight has the size of the last
    # dimension but scales channels (dim 1). With a constant weight the two agree.
    torch.manual_seed(4)

    class Images(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm2d(4)
            self.head = nn.Linear(4 * 3 * 4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.bn(x)).flatten(1))

    model = Images().eval()
    with torch.no_grad():
        model.bn.running_mean.normal_()
    slow = assert_exact(model, torch.randn(5, 4, 3, 4, dtype=torch.float64), backend, None)
    assert any("not elementwise affine" in m for m in slow), slow


def test_route_restores_buffers_and_refuses_side_effects() -> None:
    norm = CountingNorm(D)
    x = torch.randn(3, D)
    y = norm(x)
    assert float(norm.calls) == 1
    with pytest.warns(SlowPathWarning, match="modifies its buffers"):
        saved = AN.route_affine(norm, (x,), {}, y)
    assert saved is None  # the module fallback
    assert float(norm.calls) == 1  # the probe's calls were undone


def test_route_refuses_randomness_inside_the_module() -> None:
    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(D))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.weight * F.dropout(x, 0.5, training=True)

    norm = Noisy()
    x = torch.randn(4, 3, D)
    with pytest.warns(SlowPathWarning):
        saved = AN.route_affine(norm, (x,), {}, norm(x))
    assert saved is None


def test_candidates_by_structure() -> None:
    assert AN.is_candidate(RMSNormLike(4)) and AN.is_candidate(OffsetNorm(4)) and AN.is_candidate(nn.PReLU(4))
    assert not AN.is_candidate(nn.Linear(4, 4))  # 2-D weight
    assert not AN.is_candidate(nn.Embedding(4, 4))
    assert not AN.is_candidate(Net(RMSNormLike(D)))  # no own weight

    class Extra(RMSNormLike):
        def __init__(self) -> None:
            super().__init__(4)
            self.scale = nn.Parameter(torch.ones(4))

    assert not AN.is_candidate(Extra())  # another parameter

    class Child(RMSNormLike):
        def __init__(self) -> None:
            super().__init__(4)
            self.proj = nn.Linear(4, 4)

    assert not AN.is_candidate(Child())  # parameters in a submodule


# --- the clip bound under adversarial inputs -------------------------------------------------


def _alternating(t: int, d: int, scale: float, seed: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(1, d, generator=gen, dtype=torch.float64)
    signs = torch.tensor([(-1.0) ** k for k in range(t)], dtype=torch.float64).unsqueeze(1)
    return (scale * signs * v).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [1e-20, 1e-3, 1.0, 1e3, 1e15])
@pytest.mark.parametrize("norm", ["rmsnorm_like", "gemma_offset", "layernorm_subclass"])
def test_contribution_at_most_c_at_extreme_scales(backend: str, dtype: torch.dtype, scale: float, norm: str) -> None:
    # Nearly identical positions (a repeated token) under output gradients of alternating sign
    # at extreme scales: the per-position terms of dw cancel. Each example's contribution,
    # as computed in `dtype`, must stay within C.
    torch.manual_seed(5)
    model = nn.Sequential(nn.Embedding(20, 24), _randomise(NORM_LIKE[norm](24)), nn.Linear(24, 6)).to(dtype)
    fmodel, params = make_functional(model)
    ids = torch.full((1, 16), 7, dtype=torch.long)
    ids[0, ::5] = 3
    y = _alternating(16, 6, scale, 5, dtype)[None]

    def loss(p: Any, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return (fmodel(p, xb) * yb).flatten(1).sum(1)

    for c in (1e-3, 1.0):
        fn, state = clipped_grad(loss, clipping_norm=c, batch_argnums=(1, 2), return_aux=True, clip_backend=backend,
                                 model=fmodel)
        with warnings.catch_warnings():
            warnings.simplefilter("error", SlowPathWarning)
            (out, aux), _ = fn(params, ids, y, state=state)
        total = math.sqrt(sum(float(v.double().square().sum()) for v in out.pytree))
        if aux.num_nonfinite:
            assert total == 0.0
        assert total <= c, f"contribution {total} > C = {c}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_non_finite_example_is_zeroed_on_the_rule(backend: str) -> None:
    # A NaN example makes A(x) and the output NaN in its rows only: the call still takes the
    # rule (no fallback, no warning), the example gets weight 0 and the others are exact.
    torch.manual_seed(8)
    model = Net(_randomise(RMSNormLike(D))).double()
    fmodel, params = make_functional(model)
    x = torch.randn(5, 3, D, dtype=torch.float64)
    y = torch.randn(5, 3, 3, dtype=torch.float64)
    x[2, 1, 0] = float("nan")
    keep = torch.tensor([True, True, False, True, True])
    want, norms = reference(mse(fmodel), params, x[keep], y[keep], 0.5)
    fn, state = clipped_grad(mse(fmodel), clipping_norm=0.5, batch_argnums=(1, 2), return_aux=True, clip_backend=backend,
                             model=fmodel)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPathWarning)
        (out, aux), _ = fn(params, x, y, state=state)
    assert aux.num_nonfinite == 1
    scale = max(float(w.abs().max()) for w in want)
    for got, ref in zip(out.pytree, want):
        assert float((got - ref).abs().max()) <= 1e-10 * scale


# --- property: drawn adversarial inputs ---------------------------------------------------

NIGHTLY = os.environ.get("HYPOTHESIS_PROFILE") == "nightly"


@settings(max_examples=2000 if NIGHTLY else 60, deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)
@given(
    norm=st.sampled_from(sorted(NORM_LIKE)),
    backend=st.sampled_from(BACKENDS),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    t=st.integers(1, 48),
    spread=st.sampled_from([0.0, 1e-7, 1e-4, 1e-1]),
    scale=st.sampled_from([1e-30, 1e-12, 1e-3, 1.0, 1e3, 1e12, 1e30]),
    g_scale=st.sampled_from([1e-20, 1e-3, 1.0, 1e6, 1e20]),
    c=st.sampled_from([1e-4, 1e-2, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_property_contribution_at_most_c(norm, backend, dtype, t, spread, scale, g_scale, c, seed) -> None:
    # Nearly identical positions (A_t nearly equal) under output gradients of alternating sign:
    # the terms of dw = sum_t g_t * A_t cancel; huge and tiny scales on both sides.
    torch.manual_seed(seed)
    d = 16
    model = nn.Sequential(_randomise(NORM_LIKE[norm](d), seed), nn.Linear(d, 4)).to(dtype)
    fmodel, params = make_functional(model)
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(1, 1, d, generator=gen, dtype=torch.float64)
    x = (scale * (base + spread * torch.randn(1, t, d, generator=gen, dtype=torch.float64))).to(dtype)
    y = _alternating(t, 4, g_scale, seed, dtype)[None]

    def loss(p: Any, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return (fmodel(p, xb).float() * yb.float()).flatten(1).sum(1)

    fn, state = clipped_grad(loss, clipping_norm=c, batch_argnums=(1, 2), return_aux=True, clip_backend=backend,
                             model=fmodel)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowPathWarning)  # speed only: a fallback must be within C too
        (out, aux), _ = fn(params, x, y, state=state)
    total = math.sqrt(sum(float(v.double().square().sum()) for v in out.pytree))
    assert total <= c, f"contribution {total} > C = {c} (norm reported {float(aux.grad_norms[0])})"
