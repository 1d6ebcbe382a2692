"""The shared-tensor rule: parameter-derived tensors with no batch axis that meet the batch.

Position embeddings looked up on ``arange(T)``, relative-position biases looked up on a
``[T, T]`` bucket tensor, a projection of a shared table, a parameter scaling a shared
tensor outside any module call: all against a float64 per-example loop, with every vmap
fallback made an error (each of these took the whole-loss fallback before the rule).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opake_fx.dpsgd.clipping import clipped_grad
from opake_fx.errors import InputValueError, SlowPathWarning
from opake_fx.functional import make_functional
from tests.dpsgd.test_ghost_norm_like import assert_exact

BACKENDS = ["ghost", "auto"]
VOCAB, T, D, H, BUCKETS = 11, 4, 8, 2, 3


def buckets(t: int) -> torch.Tensor:
    """``[T, T]`` relative-position buckets (no batch axis)."""
    rel = torch.arange(t)[None, :] - torch.arange(t)[:, None]
    return rel.clamp(-1, 1) + 1


class Attention(nn.Module):
    """Self-attention with a learned relative-position bias joined to the scores by ``how``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.reshape(b, t, H, D // H).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        if self.how == "sdpa":
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        else:
            scores = q @ k.transpose(-1, -2) / math.sqrt(D // H)
            if self.how == "add":
                scores = scores + bias
            elif self.how == "iadd":
                scores += bias
            elif self.how == "where":  # the mask [B, 1, 1, T] meets the bias in a where
                scores = scores + torch.where(keep[:, None, None, :], bias, -1e4)
            else:
                raise ValueError(self.how)
            a = scores.softmax(-1) @ v
        return self.out(a.transpose(1, 2).reshape(b, t, D))


class RelBiasNet(nn.Module):
    """T5-style: one bias table, looked up once, used by every layer."""

    def __init__(self, how: str, layers: int = 1) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.rel = nn.Embedding(BUCKETS, H)
        self.layers = nn.ModuleList(Attention(how) for _ in range(layers))
        self.head = nn.Linear(D, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        bias = self.rel(buckets(ids.shape[1])).permute(2, 0, 1).unsqueeze(0)  # [1, H, T, T]
        keep = ids != 0
        h = self.tok(ids)
        for layer in self.layers:
            h = h + layer(h, bias, keep)
        return self.head(torch.tanh(h)).squeeze(-1)


class PositionNet(nn.Module):
    """Positions looked up on arange(T), joined to the tokens by ``how``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.tok = nn.Embedding(VOCAB, D)
        self.pos = nn.Embedding(T + 2, D)
        self.proj = nn.Linear(D, D)
        if how == "scaled":
            self.scale = nn.Parameter(torch.tensor(0.7))
        self.head = nn.Linear(D, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1])
        h = self.tok(ids)
        p = self.pos(positions)  # [T, D]: no batch axis
        if self.how == "add":
            h = h + p
        elif self.how == "mul":
            h = h * torch.sigmoid(p)
        elif self.how == "projected":  # a Linear called on the shared table (DeBERTa's position projections)
            h = h + self.proj(p)
        elif self.how == "scaled":  # a parameter used outside any module call, on the shared side only
            h = h + self.scale * p
        elif self.how == "tied":  # the token table also looked up on shared ids
            h = h + self.tok(positions % VOCAB)
        elif self.how == "twice":  # the same shared tensor meets the batch twice
            h = torch.tanh(h + p) * p
        else:
            raise ValueError(self.how)
        return self.head(torch.tanh(h)).squeeze(-1)


class Disentangled(nn.Module):
    """DeBERTa-style: a relative-position table (a parameter used outside its module), normed and
    projected without a batch axis, repeated over the batch and multiplied with ``[B * H]``
    query rows; ``order`` lays the queries out example-major (as DeBERTa) or head-major (then
    the pairing with the repeat's rows depends on the batch size: a model that mixes)."""

    def __init__(self, order: str) -> None:
        super().__init__()
        self.order = order
        self.tok = nn.Embedding(VOCAB, D)
        self.rel = nn.Embedding(2 * T, D)
        self.norm = nn.LayerNorm(D)
        self.pos_key = nn.Linear(D, D)
        self.q = nn.Linear(D, D)
        self.head = nn.Linear(2 * T, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        h = self.tok(ids)
        rel = self.norm(self.rel.weight)  # [2T, D]: no batch axis
        pk = self.pos_key(rel).reshape(2 * T, H, D // H).transpose(0, 1)  # [H, 2T, dh]
        q = self.q(h).reshape(b, t, H, D // H)
        if self.order == "example-major":
            q = q.permute(0, 2, 1, 3).reshape(b * H, t, D // H)  # rows b * H + h
        else:
            q = q.permute(2, 0, 1, 3).reshape(H * b, t, D // H)  # rows h * B + b
        scores = torch.bmm(q, pk.repeat(b, 1, 1).transpose(-1, -2))  # [B * H, T, 2T]
        if self.order == "example-major":
            scores = scores.reshape(b, H, t, 2 * T)
        else:
            scores = scores.reshape(H, b, t, 2 * T).transpose(0, 1)
        return self.head(torch.tanh(scores.sum(1))).squeeze(-1)


def ids_batch(b: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + b)
    ids = torch.randint(1, VOCAB, (b, T), generator=g)
    ids[0, -1] = 0  # one padded position (masked in the "where" model)
    return ids


# Batch sizes that equal another size of the model: positions, heads, buckets, position table.
SIZES = [1, 5, T, H, BUCKETS, T + 2]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("b", SIZES)
@pytest.mark.parametrize("how", ["add", "iadd", "where", "sdpa"])
def test_relative_bias_takes_the_rule(how: str, b: int, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    slow = assert_exact(RelBiasNet(how), ids_batch(b), backend, monkeypatch)
    assert not slow, slow


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bias_shared_by_layers(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(1)
    slow = assert_exact(RelBiasNet("add", layers=3), ids_batch(5), backend, monkeypatch)
    assert not slow, slow


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("b", [1, 5, T, T + 2])
@pytest.mark.parametrize("how", ["add", "mul", "projected", "tied", "twice"])
def test_positions_take_the_rule(how: str, b: int, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(2)
    slow = assert_exact(PositionNet(how), ids_batch(b), backend, monkeypatch)
    assert not slow, slow


def test_no_whole_loss_pass_runs() -> None:
    """The rule computes the shared parameters' per-example gradients from the one backward
    pass: the loss runs once in the step (plus the probe's runs on the first call only)."""
    model = PositionNet("add").double()
    fmodel, params = make_functional(model)
    calls = []
    model.register_forward_pre_hook(lambda m, a: calls.append(a[0].shape[0]))

    def loss(p: Any, ids: torch.Tensor) -> torch.Tensor:
        return (fmodel(p, ids) ** 2).sum(1)

    fn, state = clipped_grad(loss, clipping_norm=1.0, batch_argnums=1, clip_backend="ghost", model=fmodel)
    ids = ids_batch(6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPathWarning)
        fn(params, ids, state=state)
        calls.clear()
        fn(params, ids, state=state)
    assert calls == [6]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("b", [1, 2, 5, H, 2 * T])
def test_a_table_repeated_over_the_batch_takes_the_rule(b: int, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(5)
    slow = assert_exact(Disentangled("example-major"), ids_batch(b), backend, monkeypatch)
    assert not slow, slow


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_repeat_paired_head_major_is_refused(backend: str) -> None:
    # Row h * B + b of the queries meets row (h * B + b) mod H of the repeat: which position
    # projection an example gets depends on the batch size (alone it gets another): mixing.
    model = Disentangled("head-major").double()
    fmodel, params = make_functional(model)
    fn, state = clipped_grad(lambda p, ids: (fmodel(p, ids) ** 2).sum(1), clipping_norm=1.0, batch_argnums=1,
                             clip_backend=backend, model=fmodel)
    with pytest.raises(InputValueError, match="mixes examples"):
        fn(params, ids_batch(5), state=state)


# --- what the rule does not take ---------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_parameter_of_a_module_without_a_rule_on_the_shared_side(backend: str) -> None:
    # `self.scale * p` in the model's own forward: the model's module fallback would recompute
    # the sites' paths that the rule also counts, so the parameter takes the whole-loss path (exact).
    torch.manual_seed(2)
    slow = assert_exact(PositionNet("scaled"), ids_batch(5), backend, None)
    assert any("scale: used by a module without a rule on the side of a tensor without the batch axis" in s
               for s in slow), slow


class ReadsExampleZero(nn.Module):
    """The shared positions are scaled by a value of example 0: every example reads example 0."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.pos = nn.Embedding(T, D)
        self.head = nn.Linear(D, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids)
        p = self.pos(torch.arange(ids.shape[1])) * h[0].mean()
        return self.head(torch.tanh(h + p)).squeeze(-1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixing_through_a_shared_tensor_is_refused(backend: str) -> None:
    model = ReadsExampleZero().double()
    fmodel, params = make_functional(model)
    fn, state = clipped_grad(lambda p, ids: (fmodel(p, ids) ** 2).sum(1), clipping_norm=1.0, batch_argnums=1,
                             clip_backend=backend, model=fmodel)
    with pytest.raises(InputValueError, match="mixes examples"):
        fn(params, ids_batch(5), state=state)


# --- the bound holds at extreme scales ---------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1e-30, 1.0, 1e30])
@pytest.mark.parametrize("how", ["add", "where"])
def test_each_contribution_is_at_most_c(how: str, scale: float, dtype: torch.dtype) -> None:
    """Each example alone (a batch of one): the clipped output is that example's contribution;
    its norm, in float64, is at most C, with the shared table at extreme scales."""
    torch.manual_seed(4)
    model = (RelBiasNet(how) if how == "where" else PositionNet(how)).to(dtype)
    with torch.no_grad():
        table = model.rel.weight if how == "where" else model.pos.weight
        table.mul_(scale)
    fmodel, params = make_functional(model)
    c = 0.5

    def loss(p: Any, ids: torch.Tensor) -> torch.Tensor:
        return ((fmodel(p, ids).float() * scale) ** 2).sum(1)

    fn, state = clipped_grad(loss, clipping_norm=c, batch_argnums=1, clip_backend="ghost", model=fmodel)
    ids = ids_batch(5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPathWarning)
        for i in range(ids.shape[0]):
            out, state = fn(params, ids[i : i + 1], state=state)
            norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in out.pytree if torch.isfinite(g).all()))
            assert norm <= c, (i, norm)
