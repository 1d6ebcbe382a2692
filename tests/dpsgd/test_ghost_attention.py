"""The self-attention rule for ``nn.MultiheadAttention``: its two projections are tapped as
Linears, the rest of the module is recomputed; exact against per-example autograd for every
mask the module takes, and the module fallback for what the rule does not cover."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from opake_fx.dpsgd.clipping import _ghost, _rules_attention, _rules_fallback
from tests.dpsgd.test_ghost_clipping import check, count_calls

B, T, D, H = 5, 6, 8, 2


class SelfAttention(nn.Module):
    def __init__(self, call: dict[str, Any], **mha: Any) -> None:
        super().__init__()
        self.inp = nn.Linear(3, D)
        self.mha = nn.MultiheadAttention(D, H, batch_first=True, **mha)
        self.head = nn.Linear(D, 1)
        self.call = call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        kw = {k: (v(x) if callable(v) else v) for k, v in self.call.items()}
        out = self.mha(h, h, h, **{"need_weights": False, **kw})[0]
        return self.head(out).squeeze(-1)


def causal_float(x: torch.Tensor) -> torch.Tensor:
    return nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype)


def causal_bool(x: torch.Tensor) -> torch.Tensor:
    return torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)


# Masks are functions of each example's own data (the reference runs examples one at a time).


def padding(x: torch.Tensor) -> torch.Tensor:
    lengths = 1 + (x[:, 0, 0].abs() * 7).long() % x.shape[1]  # 1..T valid positions
    return torch.arange(x.shape[1]).expand(x.shape[0], -1) >= lengths[:, None]


def per_head_mask(x: torch.Tensor) -> torch.Tensor:
    scores = torch.einsum("bti,bsi->bts", x, x)
    return torch.stack([0.3 * (h + 1) * scores for h in range(H)], dim=1).reshape(-1, x.shape[1], x.shape[1])


@pytest.fixture
def fallbacks(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    return {
        "module": count_calls(monkeypatch, _rules_fallback, "module_per_example"),
        "whole": count_calls(monkeypatch, _ghost, "_whole_loss_per_example"),
    }


RULE_CASES = {
    "no mask": {},
    "causal (float mask + is_causal)": {"attn_mask": causal_float, "is_causal": True},
    "bool mask": {"attn_mask": causal_bool},
    "float mask, no hint": {"attn_mask": causal_float},
    "key padding": {"key_padding_mask": padding},
    "key padding + causal": {"key_padding_mask": padding, "attn_mask": causal_bool, "is_causal": True},
    "3-d per-head mask": {"attn_mask": per_head_mask},
}


@pytest.mark.parametrize("case", RULE_CASES, ids=list(RULE_CASES))
def test_self_attention_rule_matches_per_example_autograd(case: str, fallbacks: dict[str, list[int]]) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(B, T, 3, dtype=torch.float64), torch.randn(B, T, dtype=torch.float64)
    check(SelfAttention(RULE_CASES[case]), x, y)
    # in_proj_weight and out_proj have no other route than the rule besides these fallbacks
    assert fallbacks["module"][0] == 0 and fallbacks["whole"][0] == 0


def test_without_biases(fallbacks: dict[str, list[int]]) -> None:
    torch.manual_seed(1)
    x, y = torch.randn(B, T, 3, dtype=torch.float64), torch.randn(B, T, dtype=torch.float64)
    check(SelfAttention({"attn_mask": causal_float, "is_causal": True}, bias=False), x, y)
    assert fallbacks["module"][0] == 0 and fallbacks["whole"][0] == 0


def test_transformer_encoder_with_causal_mask_uses_rules_only(fallbacks: dict[str, list[int]]) -> None:
    torch.manual_seed(2)

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(3, D)
            layer = nn.TransformerEncoderLayer(D, H, dim_feedforward=16, dropout=0.1, batch_first=True)
            self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(D, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype)
            return self.head(self.enc(self.inp(x), mask=mask, is_causal=True)).squeeze(-1)

    x, y = torch.randn(B, T, 3, dtype=torch.float64), torch.randn(B, T, dtype=torch.float64)
    check(Encoder().eval(), x, y)  # eval: the reference loop must see the same (no) dropout
    assert fallbacks["module"][0] == 0 and fallbacks["whole"][0] == 0


def test_only_the_output_projection_trained(fallbacks: dict[str, list[int]]) -> None:
    # in_proj frozen (not differentiated): out_proj still takes the Linear rule.
    torch.manual_seed(3)
    model = SelfAttention({"attn_mask": causal_bool}).double()
    from opake_fx.functional import make_functional
    from tests.dpsgd.test_ghost_layers import reference, run_backend

    for n, p in model.named_parameters():
        p.requires_grad_(not n.startswith("mha.in_proj"))
    fmodel, train = make_functional(model, trainable_only=True)

    def batched(train: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (fmodel(tuple(train), x) - y).pow(2).sum(1)

    x, y = torch.randn(B, T, 3, dtype=torch.float64), torch.randn(B, T, dtype=torch.float64)
    want, norms, _ = reference(batched, train, x, y, 0.5)
    for backend in ("ghost", "auto"):
        out, aux = run_backend(backend, batched, fmodel, train, x, y, 0.5)
        for got, ref in zip(out.pytree, want):
            torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(aux.grad_norms, norms, rtol=1e-9, atol=1e-12)
    assert fallbacks["module"][0] == 0 and fallbacks["whole"][0] == 0


def test_checkpointed_attention(fallbacks: dict[str, list[int]]) -> None:
    torch.manual_seed(4)

    class Checkpointed(SelfAttention):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.inp(x))
            mask = causal_float(x)
            out = checkpoint(lambda t: self.mha(t, t, t, need_weights=False, attn_mask=mask, is_causal=True)[0], h,
                             use_reentrant=False)
            return self.head(out).squeeze(-1)

    x, y = torch.randn(B, T, 3, dtype=torch.float64), torch.randn(B, T, dtype=torch.float64)
    check(Checkpointed({}), x, y)
    assert fallbacks["module"][0] == 0 and fallbacks["whole"][0] == 0


def deterministic_dropout_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
    """SDPA whose 'dropout' drops a fixed pattern of (head, query, key) positions: the same for
    every example and batch size, so a per-example reference sees the masks the batch saw."""
    t, s = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-2, -1) / (q.shape[-1] ** 0.5 if scale is None else 1 / scale)
    if is_causal:
        scores = scores.masked_fill(torch.ones(t, s, dtype=torch.bool).triu(1), float("-inf"))
    if attn_mask is not None:
        scores = scores + attn_mask if attn_mask.dtype != torch.bool else scores.masked_fill(~attn_mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    if dropout_p > 0:
        h = torch.arange(q.shape[-3]).view(-1, 1, 1)
        keep = (h * 31 + torch.arange(t).view(-1, 1) * 7 + torch.arange(s) * 3) % 5 != 0
        weights = weights * keep / (1 - dropout_p)
    return weights @ v


def test_attention_dropout_in_training_uses_the_rule(monkeypatch: pytest.MonkeyPatch,
                                                      fallbacks: dict[str, list[int]]) -> None:
    # With a reproducible "dropout", the rule (which draws its own masks in the recomputation,
    # after a once-per-signature check without dropout) equals per-example autograd.
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", deterministic_dropout_attention)
    torch.manual_seed(7)
    model = SelfAttention({"attn_mask": causal_float, "is_causal": True}, dropout=0.25).train()
    x, y = torch.randn(B, T, 3, dtype=torch.float64), torch.randn(B, T, dtype=torch.float64)
    check(model, x, y)
    assert fallbacks["module"][0] == 0 and fallbacks["whole"][0] == 0


def test_attention_dropout_check_failing_sends_the_call_to_the_fallback(monkeypatch: pytest.MonkeyPatch,
                                                                        fallbacks: dict[str, list[int]]) -> None:
    monkeypatch.setattr(_rules_attention, "same_outputs", lambda ours, ref: False)
    torch.manual_seed(8)
    model = SelfAttention({"attn_mask": causal_float, "is_causal": True}, dropout=0.25).eval()
    x, y = torch.randn(B, T, 3, dtype=torch.float64), torch.randn(B, T, dtype=torch.float64)
    check(model, x, y)  # eval: no dropout; the failing check alone decides
    assert fallbacks["module"][0] == 2


@pytest.mark.parametrize("kind", ["attention", "lstm"])
def test_sequence_first_module_given_the_batch_first_is_an_error(kind: str) -> None:
    # batch_first=False modules run over dim 0: with the batch there they would mix examples.
    from opake_fx.dpsgd.clipping import clipped_grad
    from opake_fx.errors import InputValueError
    from opake_fx.functional import make_functional

    class SeqFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.MultiheadAttention(D, H) if kind == "attention" else nn.LSTM(D, D)
            self.head = nn.Linear(D, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.inner(x, x, x, need_weights=False)[0] if kind == "attention" else self.inner(x)[0]
            return self.head(out).squeeze(-1).sum(-1)

    fmodel, params = make_functional(SeqFirst())
    fn, state = clipped_grad(lambda p, x: fmodel(p, x), clipping_norm=1.0, batch_argnums=(1,), clip_backend="auto",
                             model=fmodel)
    # Either the probe sees examples mixed (attention across the batch changes the others'
    # losses) or the hook sees the batch-first input of a sequence-first module: a clear error.
    with pytest.raises(InputValueError, match="batch_first=True|mixes examples"):
        fn(params, torch.randn(B, T, D), state=state)


def test_sequence_first_attention_with_the_batch_second_is_exact() -> None:
    # [T, B, d] with T != B: the layers see no batch axis first and take the whole-loss fallback.
    torch.manual_seed(9)

    class SeqFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = nn.MultiheadAttention(D, H)
            self.head = nn.Linear(D, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            xt = x.transpose(0, 1)  # [T, B, D]
            return self.head(self.mha(xt, xt, xt, need_weights=False)[0]).squeeze(-1).transpose(0, 1)

    x, y = torch.randn(B, T, D, dtype=torch.float64), torch.randn(B, T, dtype=torch.float64)
    with pytest.warns(Warning):
        check(SeqFirst(), x, y)


class CrossAttention(nn.Module):
    """Queries from one sequence, keys = values from another (an encoder's memory)."""

    def __init__(self, call: dict[str, Any], **mha: Any) -> None:
        super().__init__()
        self.inp, self.mem = nn.Linear(3, D), nn.Linear(3, D)
        self.mha = nn.MultiheadAttention(D, H, batch_first=True, **mha)
        self.head = nn.Linear(D, 1)
        self.call = call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, m = torch.tanh(self.inp(x)), torch.tanh(self.mem(x[:, :-2].flip(1)))  # memory of S = T - 2
        kw = {k: (v(x) if callable(v) else v) for k, v in self.call.items()}
        return self.head(self.mha(h, m, m, **{"need_weights": False, **kw})[0]).squeeze(-1)


def memory_padding(x: torch.Tensor) -> torch.Tensor:
    lengths = 1 + (x[:, 0, 0].abs() * 7).long() % (x.shape[1] - 2)
    return torch.arange(x.shape[1] - 2).expand(x.shape[0], -1) >= lengths[:, None]


def memory_mask(x: torch.Tensor) -> torch.Tensor:
    return torch.ones(x.shape[1], x.shape[1] - 2, dtype=torch.bool).triu(2)


CROSS_CASES = {
    "no mask": {},
    "memory padding": {"key_padding_mask": memory_padding},
    "memory mask": {"attn_mask": memory_mask},
    "both": {"attn_mask": memory_mask, "key_padding_mask": memory_padding},
}


@pytest.mark.parametrize("case", CROSS_CASES, ids=list(CROSS_CASES))
def test_cross_attention_rule_matches_per_example_autograd(case: str, fallbacks: dict[str, list[int]]) -> None:
    torch.manual_seed(10)
    x, y = torch.randn(B, T, 3, dtype=torch.float64), torch.randn(B, T, dtype=torch.float64)
    check(CrossAttention(CROSS_CASES[case]), x, y)
    assert fallbacks["module"][0] == 0 and fallbacks["whole"][0] == 0


def test_cross_attention_dropout_uses_the_rule(monkeypatch: pytest.MonkeyPatch, fallbacks: dict[str, list[int]]) -> None:
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", deterministic_dropout_attention)
    torch.manual_seed(11)
    model = CrossAttention({"key_padding_mask": memory_padding}, dropout=0.25).train()
    x, y = torch.randn(B, T, 3, dtype=torch.float64), torch.randn(B, T, dtype=torch.float64)
    check(model, x, y)
    assert fallbacks["module"][0] == 0 and fallbacks["whole"][0] == 0


class Configured(nn.Module):
    """``nn.MultiheadAttention`` built with ``mha`` and called on ``inputs`` (which of query,
    key and value share a tensor), ``call`` its keyword arguments (callables of ``x``); with
    ``use_weights`` the returned attention weights enter the output too."""

    def __init__(self, inputs: str, call: dict[str, Any], use_weights: bool = False, **mha: Any) -> None:
        super().__init__()
        self.inp, self.mem = nn.Linear(3, D), nn.Linear(3, mha.get("kdim") or D)
        self.val = nn.Linear(3, mha.get("vdim") or D)  # (kdim = vdim: the memory feeds both)
        self.mha = nn.MultiheadAttention(D, H, batch_first=True, **mha)
        self.head = nn.Linear(D, 1)
        self.inputs, self.call, self.use_weights = inputs, call, use_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if self.inputs == "qqq":
            q = k = v = h
        elif self.inputs == "qmm":  # memory of S = T - 2 positions
            q, k = h, torch.sin(self.mem(x[:, :-2].flip(1)))
            v = k
        elif self.inputs == "qmv":
            q, k, v = h, torch.sin(self.mem(x[:, :-2].flip(1))), torch.cos(self.val(x[:, :-2]))
        elif self.inputs == "qqv":
            q, k, v = h, h, torch.cos(self.val(x))
        else:  # "qmq"
            q, k, v = h, torch.sin(self.mem(x)), h
        kw = {name: (f(x) if callable(f) else f) for name, f in self.call.items()}
        out, weights = self.mha(q, k, v, **{"need_weights": self.use_weights, **kw})
        y = self.head(out).squeeze(-1)
        if self.use_weights:  # [B, T, S] or [B, H, T, S]: the weights reach the loss
            ramp = torch.linspace(-1, 1, weights.shape[-1], dtype=weights.dtype)
            y = y + (weights * ramp).sum(-1) if weights.dim() == 3 else y + 0.3 * (weights * ramp).sum((1, 3))
        return y


CONFIGURED_CASES: dict[str, tuple[str, dict[str, Any], bool, dict[str, Any]]] = {
    # name: (inputs, call, attention weights used, module settings)
    "weights returned, unused": ("qqq", {"need_weights": True}, False, {}),
    "weights averaged in the loss": ("qqq", {}, True, {}),
    "per-head weights in the loss, causal": ("qqq", {"average_attn_weights": False, "attn_mask": causal_float,
                                                     "is_causal": True}, True, {}),
    "weights with key padding": ("qqq", {"key_padding_mask": padding}, True, {}),
    "key is not value": ("qmv", {"key_padding_mask": memory_padding}, False, {}),
    "query is key, value apart": ("qqv", {"attn_mask": causal_bool}, False, {}),
    "query is value, key apart": ("qmq", {}, False, {}),
    "kdim / vdim": ("qmv", {"key_padding_mask": memory_padding}, False, {"kdim": 5, "vdim": 4}),
    "kdim / vdim, no bias": ("qmv", {}, True, {"kdim": 5, "vdim": 4, "bias": False}),
    "kdim = vdim, key is value": ("qmm", {"attn_mask": memory_mask}, True, {"kdim": 5, "vdim": 5}),
    "add_bias_kv": ("qqq", {"attn_mask": causal_float}, False, {"add_bias_kv": True}),
    "add_bias_kv, key padding, 3-d mask": ("qqq", {"attn_mask": per_head_mask, "key_padding_mask": padding}, True,
                                           {"add_bias_kv": True}),
    "add_zero_attn": ("qmm", {"key_padding_mask": memory_padding}, False, {"add_zero_attn": True}),
    "everything": ("qmv", {"key_padding_mask": memory_padding, "attn_mask": memory_mask}, True,
                   {"kdim": 5, "vdim": 4, "add_bias_kv": True, "add_zero_attn": True}),
}


@pytest.mark.parametrize("case", CONFIGURED_CASES, ids=list(CONFIGURED_CASES))
def test_every_configuration_takes_the_rule_exactly(case: str, fallbacks: dict[str, list[int]]) -> None:
    torch.manual_seed(5)
    inputs, call, use_weights, mha = CONFIGURED_CASES[case]
    x, y = torch.randn(B, T, 3, dtype=torch.float64), torch.randn(B, T, dtype=torch.float64)
    model = Configured(inputs, call, use_weights, **mha)
    if "add_bias_kv" in mha:  # the extra biases start at zero-mean small values: make them count
        with torch.no_grad():
            model.mha.bias_k.normal_()
            model.mha.bias_v.normal_()
    check(model, x, y)
    assert fallbacks["module"][0] == 0 and fallbacks["whole"][0] == 0


def test_transformer_decoder_uses_rules_only(fallbacks: dict[str, list[int]]) -> None:
    torch.manual_seed(12)

    class Seq2Seq(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.src, self.tgt = nn.Linear(3, D), nn.Linear(3, D)
            self.model = nn.Transformer(D, H, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=16,
                                        dropout=0.0, batch_first=True)
            self.head = nn.Linear(D, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            tgt_mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype)
            out = self.model(self.src(x.flip(1)), self.tgt(x), tgt_mask=tgt_mask, tgt_is_causal=True)
            return self.head(out).squeeze(-1)

    x, y = torch.randn(B, T, 3, dtype=torch.float64), torch.randn(B, T, dtype=torch.float64)
    check(Seq2Seq(), x, y)
    assert fallbacks["module"][0] == 0 and fallbacks["whole"][0] == 0


@pytest.mark.parametrize("case", ["weights in the loss, add_bias_kv", "cross, key padding", "dropout in training"])
def test_later_steps_recompute_instead_of_running_the_module(case: str, monkeypatch: pytest.MonkeyPatch,
                                                             fallbacks: dict[str, list[int]]) -> None:
    # Once a call signature is checked, the rule's recomputation runs in place of the module's
    # forward (no attention computed twice): later steps stay exact, with new inputs and
    # batch sizes, and the module's own attention is not run again.
    from opake_fx.dpsgd.clipping import clipped_grad
    from opake_fx.functional import make_functional
    from tests.dpsgd.test_ghost_layers import mse, reference

    torch.manual_seed(14)
    if case == "dropout in training":
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", deterministic_dropout_attention)
        model = CrossAttention({"key_padding_mask": memory_padding}, dropout=0.25).train()
    elif case == "cross, key padding":
        model = CrossAttention({"key_padding_mask": memory_padding})
    else:
        model = Configured("qqq", {"key_padding_mask": padding}, True, add_bias_kv=True)
    fmodel, params = make_functional(model.double())
    module_runs = count_calls(monkeypatch, torch.nn.functional, "multi_head_attention_forward")
    loss = mse(fmodel)
    xs = [torch.randn(n, T, 3, dtype=torch.float64) for n in (B, B, B + 2)]
    ys = [torch.randn(n, T, dtype=torch.float64) for n in (B, B, B + 2)]
    c = float(reference(loss, params, xs[0], ys[0], float("inf"))[1].median())
    fn, state = clipped_grad(loss, clipping_norm=c, batch_argnums=(1, 2), return_aux=True, clip_backend="auto",
                             model=fmodel)
    runs = []
    for x, y in zip(xs, ys):
        want, norms, _ = reference(loss, params, x, y, c)
        before = module_runs[0]
        (out, aux), state = fn(params, x, y, state=state)
        runs.append(module_runs[0] - before)
        torch.testing.assert_close(aux.grad_norms, norms, rtol=1e-9, atol=1e-12)
        for got, ref in zip(out.pytree, want):
            assert float((got - ref).abs().max()) <= 1e-9 * max(float(ref.abs().max()), 1e-12)
    assert runs[0] > 0 and runs[1] == 0 and runs[2] == 0, runs
    assert fallbacks["module"][0] == 0 and fallbacks["whole"][0] == 0


def test_nothing_stays_on_the_modules_after_a_step_or_a_failing_one() -> None:
    # The recomputation replaces forward only while a step's capture is open.
    from opake_fx.dpsgd.clipping import clipped_grad
    from opake_fx.functional import make_functional
    from tests.dpsgd.test_ghost_layers import mse

    torch.manual_seed(15)
    model = SelfAttention({"key_padding_mask": padding}).double()
    fmodel, params = make_functional(model)
    loss = mse(fmodel)
    calls = [0]

    def flaky(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] > 4:  # after the probes and two good steps
            raise RuntimeError("loss failed")
        return loss(p, x, y)

    fn, state = clipped_grad(flaky, clipping_norm=1.0, batch_argnums=(1, 2), clip_backend="auto", model=fmodel)
    x, y = torch.randn(B, T, 3, dtype=torch.float64), torch.randn(B, T, dtype=torch.float64)
    raised = False
    for _ in range(6):
        try:
            _, state = fn(params, x, y, state=state)
        except RuntimeError:
            raised = True
        assert "forward" not in model.mha.__dict__
        assert not model.mha._forward_hooks and not model.mha._forward_pre_hooks
    assert raised
