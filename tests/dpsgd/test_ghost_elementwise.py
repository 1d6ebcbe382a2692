"""The elementwise rule: parameters a module broadcasts over the batch in its own forward
(ViT-style cls token expanded and concatenated, position embeddings added)."""

from __future__ import annotations

import math
import os
import warnings
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from opake_fx.dpsgd.clipping import clipped_grad
from opake_fx.errors import SlowPathWarning
from opake_fx.functional import make_functional
from tests.dpsgd.test_ghost_norm_like import assert_exact

BACKENDS = ["ghost", "auto"]
T, D = 4, 6


class Embed(nn.Module):
    """Patches -> tokens, a cls token expanded to the batch and concatenated, positions added."""

    def __init__(self, how: str = "vit") -> None:
        super().__init__()
        self.how = how
        self.proj = nn.Linear(3, D)
        self.cls = nn.Parameter(torch.randn(1, 1, D))
        self.pos = nn.Parameter(torch.randn(1, T + 1, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        b = h.shape[0]
        if self.how == "vit":
            h = torch.cat((self.cls.expand(b, -1, -1), h), dim=1)
            return h + self.pos
        if self.how == "radd":  # parameter first, expand_as, torch.add
            h = torch.cat((self.cls.expand_as(h[:, :1]), h), dim=1)
            return torch.add(self.pos, h)
        if self.how == "no-batch":  # a broadcast to [T + 1, T + 1, D]: its first axis may equal B, never the batch
            h = torch.cat((self.cls.expand(b, -1, -1), h), dim=1)
            return h + self.pos.expand(T + 1, T + 1, D).mean(0, keepdim=True)
        if self.how == "scaled":  # another use of the same parameter besides the broadcast
            h = torch.cat((self.cls.expand(b, -1, -1), h), dim=1)
            return h + self.pos + 0.5 * self.pos
        raise ValueError(self.how)


class Net(nn.Module):
    def __init__(self, how: str = "vit") -> None:
        super().__init__()
        self.embed = Embed(how)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.norm(self.embed(x)))).mean(1)


def run_exact(how: str, backend: str, batch: int, monkeypatch: pytest.MonkeyPatch | None) -> list[str]:
    """Clipped sum and norms against the per-example loop in float64 (with ``monkeypatch``:
    every vmap fallback is an error); returns the SlowPathWarning messages."""
    torch.manual_seed(batch)
    return assert_exact(Net(how), torch.randn(batch, T, 3, dtype=torch.float64), backend, monkeypatch)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["vit", "radd"])
@pytest.mark.parametrize("batch", [3, 1, T + 1, D])  # B equal to the sequence (with cls) and the width
def test_broadcast_parameters_take_the_rule_exactly(how: str, backend: str, batch: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    assert run_exact(how, backend, batch, monkeypatch) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_broadcast_without_the_batch_axis_stays_on_the_exact_fallback(backend: str) -> None:
    # pos[0].expand(T + 1, D) has a first axis of T + 1 = B here: never taken for the batch.
    slow = run_exact("no-batch", backend, T + 1, None)
    assert any("embed.pos" in m for m in slow), slow


@pytest.mark.parametrize("backend", BACKENDS)
def test_another_use_of_the_parameter_takes_an_exact_fallback(backend: str) -> None:
    slow = run_exact("scaled", backend, 3, None)
    assert any("embed.pos" in m for m in slow), slow


NIGHTLY = os.environ.get("HYPOTHESIS_PROFILE") == "nightly"


@settings(max_examples=2000 if NIGHTLY else 40, deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)
@given(
    backend=st.sampled_from(BACKENDS),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    scale=st.sampled_from([1e-30, 1e-6, 1.0, 1e6, 1e30]),
    g_scale=st.sampled_from([1e-20, 1e-3, 1.0, 1e6, 1e20]),
    c=st.sampled_from([1e-4, 1e-2, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_property_contribution_at_most_c(backend: str, dtype: torch.dtype, scale: float, g_scale: float, c: float,
                                        seed: int) -> None:
    # One example whose position gradients alternate in sign: the sums over positions that
    # form d(pos) and d(cls) cancel; huge and tiny scales on both sides.
    torch.manual_seed(seed)
    model = Net("vit")
    with torch.no_grad():
        model.embed.pos.mul_(scale)
        model.embed.cls.mul_(scale)
    model = model.to(dtype)
    fmodel, params = make_functional(model)
    x = torch.randn(1, T, 3).to(dtype)
    sign = torch.tensor([(-1.0) ** k for k in range(2)])
    y = (g_scale * sign)[None].to(dtype)

    def loss(p: Any, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return (fmodel(p, xb).float() * yb.float()).sum(1)

    fn, state = clipped_grad(loss, clipping_norm=c, batch_argnums=(1, 2), return_aux=True, clip_backend=backend,
                             model=fmodel)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPathWarning)  # the rule itself must hold the bound
        (out, aux), _ = fn(params, x, y, state=state)
    total = math.sqrt(sum(float(v.double().square().sum()) for v in out.pytree))
    assert total <= c, f"contribution {total} > C = {c} (norm reported {float(aux.grad_norms[0])})"


class LayerScale(nn.Module):
    """A ConvNeXt-style residual branch scaled by a layer-scale vector in the block's own forward."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.dw = nn.Conv2d(D, D, 3, padding=1, groups=D)
        self.norm = nn.LayerNorm(D)
        self.pw = nn.Linear(D, D)
        self.gamma = nn.Parameter(torch.full((D,), 0.5) + 0.1 * torch.randn(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pw(self.norm(self.dw(x).permute(0, 2, 3, 1)))
        if self.how == "mul":
            y = self.gamma * y
        elif self.how == "rmul":
            y = y * self.gamma
        elif self.how == "div":
            y = y / (self.gamma + 2.0)  # not a broadcast of gamma itself: its module's fallback
        elif self.how == "sub":
            y = y - self.gamma
        return x + y.permute(0, 3, 1, 2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["mul", "rmul", "sub"])
@pytest.mark.parametrize("b", [1, 5, D])
def test_layer_scale_takes_the_elementwise_rule(how: str, b: int, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before the rule took mul/sub, gamma went to the block's module fallback (vmap of its vjp).
    torch.manual_seed(3)
    x = torch.randn(b, D, 3, 3, dtype=torch.float64)
    slow = assert_exact(LayerScale(how), x, backend, monkeypatch)
    assert not slow, slow


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_parameter_changed_before_its_broadcast_keeps_the_fallback(backend: str) -> None:
    torch.manual_seed(3)
    slow = assert_exact(LayerScale("div"), torch.randn(5, D, 3, 3, dtype=torch.float64), backend, None)
    assert any("gamma" in s for s in slow), slow


# --- table lookups in an nn.Embedding subclass's own forward ------------------------------------


class ScaledEmbedding(nn.Embedding):
    """Hugging Face's scaled word embedding: ``super().forward(ids) * scale`` (its own forward)."""

    def __init__(self, n: int, d: int, padding_idx: int | None = None) -> None:
        super().__init__(n, d, padding_idx=padding_idx)
        self.scale = d ** 0.5

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.scale


class LearnedPositions(nn.Embedding):
    """OPT's learned positions: computed from the mask (cumsum), offset by 2, looked up."""

    def forward(self, mask: torch.Tensor) -> torch.Tensor:
        positions = (torch.cumsum(mask, dim=1) * mask).long() - 1
        return super().forward(positions.clamp_min(0) + 2)


class Lookups(nn.Module):
    def __init__(self, padding_idx: int | None, tied: bool = False) -> None:
        super().__init__()
        self.tok = ScaledEmbedding(9, D, padding_idx=padding_idx)
        self.pos = LearnedPositions(T + 4, D)
        self.head = nn.Linear(D, 9, bias=False)
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = (ids != 0).long()
        return self.head(torch.tanh(self.tok(ids) + self.pos(mask)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("padding_idx,tied", [(None, False), (0, False), (-9, False), (None, True)])
@pytest.mark.parametrize("b", [1, 5, T, 9])
def test_lookups_in_an_embedding_subclass_take_the_lookup_rule(padding_idx: int | None, tied: bool, b: int,
                                                               backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before the lookup rule, both tables took the module fallback: [B, V, D] per-example gradients.
    torch.manual_seed(4)
    ids = torch.randint(0, 9, (b, T), generator=torch.Generator().manual_seed(b))
    ids[:, 0] = 3  # at least one real token per example
    slow = assert_exact(Lookups(padding_idx, tied), ids, backend, monkeypatch)
    assert not slow, slow


class NormedLookup(nn.Embedding):
    """A lookup with max_norm: it renormalises the table in place, which no rule follows."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.weight, max_norm=1.0) * 2.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_lookup_with_max_norm_keeps_the_fallback(backend: str) -> None:
    torch.manual_seed(4)
    model = nn.Sequential(NormedLookup(9, D), nn.Flatten(), nn.Linear(T * D, 1))
    slow = assert_exact(model, torch.randint(0, 9, (5, T)), backend, None)
    assert any("per-module fallback" in s for s in slow), slow


# --- Linear layers written inline in a module's own forward -------------------------------------


class InlineLinear(nn.Linear):
    """Falcon's FalconLinear (``x @ W.T``, bias added) or a layer calling ``F.linear`` itself."""

    def __init__(self, d_in: int, d_out: int, how: str, bias: bool = True) -> None:
        super().__init__(d_in, d_out, bias=bias)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "matmul":
            y = x @ self.weight.T
            return y if self.bias is None else y + self.bias
        if self.how == "t":
            return torch.matmul(x, self.weight.t()) * 0.5
        return torch.nn.functional.linear(x, self.weight, self.bias) * 2.0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how,bias", [("matmul", True), ("matmul", False), ("t", False), ("f_linear", True),
                                      ("f_linear", False)])
@pytest.mark.parametrize("b", [1, 5, D, 2 * D])  # B equal to d_in, to d_out
def test_inline_linear_layers_take_the_inline_linear_rule(how: str, bias: bool, b: int, backend: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # Before the inline-Linear rule, these took the module fallback (vmap of the layer's vjp).
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(3, D), InlineLinear(D, 2 * D, how, bias), nn.Tanh(), InlineLinear(2 * D, 2, how, bias))
    slow = assert_exact(model, torch.randn(b, T, 3, dtype=torch.float64), backend, monkeypatch)
    assert not slow, slow


class SharedInput(nn.Module):
    """``W`` applied inline to a tensor without the batch axis, then added to the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, D)
        self.weight = nn.Parameter(torch.randn(D, D) / D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = torch.linspace(-1, 1, T * D, dtype=x.dtype).reshape(T, D)
        return torch.tanh(self.inp(x) + table @ self.weight.T)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_inline_linear_on_an_unbatched_input_keeps_the_fallback(backend: str) -> None:
    torch.manual_seed(5)
    slow = assert_exact(SharedInput(), torch.randn(5, T, 3, dtype=torch.float64), backend, None)
    assert any("weight" in s for s in slow), slow
