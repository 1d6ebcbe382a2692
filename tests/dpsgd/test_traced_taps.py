"""The traced path of clip_backend="auto" (opake_fx.dpsgd.clipping._traced), run eagerly as a
compiled step's planning step runs it: against a per-example autograd loop in float64, on the
uses that must not be tapped (tied weights, a Linear applied twice, a weight also used
directly by the loss), with padding masks, has_aux and crafted inputs; compiled in the slow
tests at the end."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opake_fx.compiled as compiled_module
from opake_fx.dpsgd import clipped_grad
from opake_fx.dpsgd.clipping import _traced
from opake_fx.functional import make_functional
from tests.dpsgd.test_ghost_layers import reference

B, T, V, D = 7, 5, 11, 6


@pytest.fixture
def plans(monkeypatch: pytest.MonkeyPatch) -> list[_traced.TapPlan]:
    """Runs clipping functions as in a compiled step's planning step; records the plans run."""
    monkeypatch.setattr(compiled_module._PLANNING, "on", True, raising=False)
    seen: list[_traced.TapPlan] = []
    original = _traced.traced_norms

    def recorded(plan: _traced.TapPlan, *args: Any, **kwargs: Any) -> Any:
        seen.append(plan)
        return original(plan, *args, **kwargs)

    monkeypatch.setattr(_traced, "traced_norms", recorded)
    return seen


def _run(model: nn.Module, loss_of: Any, x: torch.Tensor, y: torch.Tensor, c: float | None = None, *,
         example_mask: torch.Tensor | None = None) -> tuple[Any, Any, Any, float]:
    fmodel, params = make_functional(model.double())
    loss = loss_of(fmodel)
    if c is None:
        c = float(reference(loss, params, x, y, math.inf)[1].median())
    fn, state = clipped_grad(loss, clipping_norm=c, batch_argnums=(1, 2), return_aux=True, clip_backend="auto",
                             model=fmodel)
    (out, aux), _ = fn(params, x, y, state=state, example_mask=example_mask)
    return fmodel, params, (out, aux), c


def _assert_matches_loop(model: nn.Module, loss_of: Any, x: torch.Tensor, y: torch.Tensor, rtol: float = 1e-9) -> None:
    fmodel, params, (out, aux), c = _run(model, loss_of, x, y)
    want, norms, _ = reference(loss_of(fmodel), params, x, y, c)
    for name, got, ref in zip(fmodel.param_names, out.pytree, want):
        assert float((got - ref).abs().max()) <= rtol * max(float(ref.abs().max()), 1e-12), name
    torch.testing.assert_close(aux.grad_norms, norms, rtol=rtol, atol=1e-12)


def _assert_each_contribution_at_most(loss: Any, fmodel: Any, params: Any, x: torch.Tensor, y: torch.Tensor,
                                      c: float) -> None:
    """Each example alone: its released float32 sum, measured in float64, is at most ``c``."""
    fn, state = clipped_grad(loss, clipping_norm=c, batch_argnums=(1, 2), clip_backend="auto", model=fmodel)
    for i in range(x.shape[0]):
        out, _ = fn(params, x[i : i + 1], y[i : i + 1], state=state)
        total = math.sqrt(sum(float((t.double() ** 2).sum()) for t in out.pytree))
        assert total <= c * (1 + 1e-12), (i, total)


def _token_loss(fmodel: Any) -> Any:
    def loss(p: Any, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(fmodel(p, ids).transpose(1, 2), y, reduction="none").mean(1)

    return loss


def _mse(fmodel: Any) -> Any:
    def loss(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((fmodel(p, x) - y) ** 2).flatten(1).sum(1)

    return loss


class _TiedLM(nn.Module):
    """Embedding, two Linear layers, LayerNorm and a head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        return self.head(self.norm(h + self.down(F.gelu(self.up(h)))))


def _tokens(seed: int = 0, n: int = B) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (n, T), generator=g), torch.randint(0, V, (n, T), generator=g)


def test_an_mlp_is_tapped_whole_and_matches_the_float64_loop(plans: list[_traced.TapPlan]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x = torch.randn(B, 4, dtype=torch.float64)
    y = torch.randn(B, 3, dtype=torch.float64)
    _assert_matches_loop(model, _mse, x, y)
    assert plans and plans[-1].exact == () and plans[-1].tapped == (0, 1, 2, 3)


def test_a_sequence_model_with_a_tied_head_taps_its_linear_layers_only(plans: list[_traced.TapPlan]) -> None:
    """Sequence Linear layers are tapped (ghost or per-example norms by the cost rule); the tied
    embedding/head weight (used by two tapped calls) and the LayerNorm take the exact path."""
    torch.manual_seed(0)
    model = _TiedLM()
    ids, y = _tokens()
    _assert_matches_loop(model, _token_loss, ids, y)
    plan = plans[-1]
    names = make_functional(model)[0].param_names
    tapped = {names[i] for i in plan.tapped}
    assert tapped == {"up.weight", "up.bias", "down.weight", "down.bias"}
    why = dict(plan.why_exact)
    assert "shared by several tapped modules" in why[names.index("emb.weight")]


class _UntiedLM(nn.Module):
    """Token embedding with a padding row, positions looked up inside ``forward`` (ids that no
    argument carries), Linear layers, LayerNorm and an untied head."""

    def __init__(self, scale_grad_by_freq: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(V, D, padding_idx=0, scale_grad_by_freq=scale_grad_by_freq)
        self.pos = nn.Embedding(T, D)
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        return self.head(self.norm(h + self.down(F.gelu(self.up(h)))))


def _repetitive_tokens(seed: int = 0, n: int = B) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens with repeats, padding (id 0) on either side, and one example of a single id."""
    ids, y = _tokens(seed, n)
    ids = ids % 4
    ids[1, :2] = 0
    ids[2, -1] = 0
    ids[3] = 2
    return ids, y


def test_an_untied_lm_taps_its_embeddings_and_matches_the_float64_loop(plans: list[_traced.TapPlan]) -> None:
    """nn.Embedding calls are tapped (their static-shaped rule: sorted ids, rows per distinct id),
    the positions' too (ids made inside forward, the same for every example); only the
    LayerNorm takes the exact path. Repeated ids and the padding row included."""
    torch.manual_seed(0)
    model = _UntiedLM()
    ids, y = _repetitive_tokens()
    _assert_matches_loop(model, _token_loss, ids, y)
    names = make_functional(model)[0].param_names
    assert {names[i] for i in plans[-1].exact} == {"norm.weight", "norm.bias"}


def test_an_embedding_that_scales_by_frequency_is_not_tapped(plans: list[_traced.TapPlan]) -> None:
    torch.manual_seed(0)
    model = _UntiedLM(scale_grad_by_freq=True)
    ids, y = _repetitive_tokens()
    _assert_matches_loop(model, _token_loss, ids, y)
    names = make_functional(model)[0].param_names
    assert "scale_grad_by_freq" in dict(plans[-1].why_exact)[names.index("tok.weight")]
    assert names.index("pos.weight") in plans[-1].tapped


def test_the_static_embedding_rows_equal_the_unique_rows() -> None:
    """StaticEmbeddingGrad (sorted ids, [B, T, D] rows) against EmbeddingGrad (torch.unique): the
    same norms, weighted sums and per-example gradients, padding rows adding nothing."""
    from opake_fx.dpsgd.clipping._rules_embedding import EmbeddingGrad, StaticEmbeddingGrad

    emb = nn.Embedding(V, D, padding_idx=0)
    ids, _ = _repetitive_tokens()
    g = torch.randn(B, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    static, unique = StaticEmbeddingGrad(ids, g, emb, torch.float64), EmbeddingGrad(ids, g, emb, torch.float64)
    torch.testing.assert_close(static.sq_norm("weight"), unique.sq_norm("weight"), rtol=1e-12, atol=0)
    w = torch.rand(B, dtype=torch.float64)
    keep = torch.tensor([True, False] * 3 + [True])
    for k in (None, keep):  # (EmbeddingGrad scales its rows in place: a fresh one each time)
        want = EmbeddingGrad(ids, g, emb, torch.float64).weighted("weight", w, k)
        torch.testing.assert_close(static.weighted("weight", w, k), want, rtol=1e-12, atol=1e-15)
    pe = static.per_example("weight")
    torch.testing.assert_close(pe, EmbeddingGrad(ids, g, emb, torch.float64).per_example("weight"))
    assert float(pe[:, 0].abs().max()) == 0.0  # the padding row


@pytest.mark.parametrize("scale", [1e30, 1e-30, 1.0])
def test_an_embedding_s_contribution_is_at_most_the_clip_norm_in_float32(plans: list[_traced.TapPlan],
                                                                          scale: float) -> None:
    """Crafted float32 token gradients for one repeated id that nearly cancel, at extreme scales:
    each example's released contribution, measured in float64, never exceeds C."""
    emb = nn.Embedding(V, D).float()
    fmodel, params = make_functional(emb)

    def loss(p: Any, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (fmodel(p, ids) * y).sum((1, 2))

    g = torch.Generator().manual_seed(1)
    v = torch.randn(1, 1, D, generator=g)
    y = torch.cat([torch.randn(1, T, D, generator=g), torch.cat([v, -v * (1 - 1e-7), v, -v, v * 1e-7], 1)]) * scale
    ids = torch.tensor([[1, 2, 1, 3, 4], [5, 5, 5, 5, 5]])
    _assert_each_contribution_at_most(loss, fmodel, params, ids, y, c=1e-3)
    assert plans and plans[-1].tapped == (0,)


def test_a_linear_applied_twice_is_not_tapped(plans: list[_traced.TapPlan]) -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.tanh(self.a(torch.tanh(self.a(x)))))

    torch.manual_seed(0)
    x, y = torch.randn(B, 4, dtype=torch.float64), torch.randn(B, 2, dtype=torch.float64)
    _assert_matches_loop(Twice(), _mse, x, y)
    assert plans[-1].tapped == (2, 3)  # b only
    assert "more than once" in dict(plans[-1].why_exact)[0]


def test_a_weight_also_used_directly_by_the_loss_takes_the_exact_path(plans: list[_traced.TapPlan]) -> None:
    """The loss reads the first layer's weight itself: its gradient has a part the tap cannot
    see, found from the autograd graph with the tapped use cut."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))

    def loss_of(fmodel: Any) -> Any:
        def loss(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            direct = (x @ p[0].t()).pow(2).sum(1)  # example-dependent, outside any module call
            return ((fmodel(p, x) - y) ** 2).sum(1) + 0.1 * direct

        return loss

    x, y = torch.randn(B, 4, dtype=torch.float64), torch.randn(B, 2, dtype=torch.float64)
    _assert_matches_loop(model, loss_of, x, y)
    assert 0 not in plans[-1].tapped and 1 in plans[-1].tapped
    assert "outside its tapped call" in dict(plans[-1].why_exact)[0]


class _CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, groups=2, stride=2)
        self.c3 = nn.Conv1d(8, 4, 2)
        self.head = nn.Linear(4 * 2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.c2(torch.relu(self.c1(x))))  # [B, 8, 3, 3]
        h = torch.tanh(self.c3(h.flatten(2)))  # [B, 4, 8]
        return self.head(h[:, :, :2].flatten(1))


def test_a_cnn_with_grouped_convolutions_takes_them_exactly_and_taps_its_head(plans: list[_traced.TapPlan]) -> None:
    """Convolutions are not tapped (their rule measured slower compiled than exact per-example
    gradients): exact, beside the tapped Linear head."""
    torch.manual_seed(0)
    x, y = torch.randn(B, 3, 7, 7, dtype=torch.float64), torch.randn(B, 3, dtype=torch.float64)
    model = _CNN()
    _assert_matches_loop(model, _mse, x, y)
    names = make_functional(model)[0].param_names
    assert {names[i] for i in plans[-1].tapped} == {"head.weight", "head.bias"}


def test_a_linear_over_frames_folded_into_the_batch_axis_is_tapped_per_example(plans: list[_traced.TapPlan]) -> None:
    """Each example is 3 frames that the model folds into the leading axis before a Linear: the
    tapped call sees 3 rows per example, all of that example's (each example runs alone), and
    the rule sums them into that example's gradient."""

    class Frames(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.frame = nn.Linear(5, 4)
            self.head = nn.Linear(3 * 4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, 3, 5]
            b = x.shape[0]
            h = torch.tanh(self.frame(x.reshape(b * 3, 5)))  # [B * 3, 4]
            return self.head(h.reshape(b, 12))

    torch.manual_seed(0)
    x, y = torch.randn(B, 3, 5, dtype=torch.float64), torch.randn(B, 2, dtype=torch.float64)
    _assert_matches_loop(Frames(), _mse, x, y)
    assert plans[-1].tapped == (0, 1, 2, 3) and plans[-1].exact == ()


def test_a_tiny_gpt2_with_a_padding_mask_taps_its_conv1d_layers(plans: list[_traced.TapPlan]) -> None:
    """Hugging Face GPT-2 built from a config (Conv1D projections, tied head, left padding)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=V, n_positions=8, n_embd=8, n_layer=2, n_head=2,
                                     attn_implementation="eager", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids, y = _tokens()
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :2] = 0
    mask[4, :1] = 0

    def loss_of(fmodel: Any) -> Any:
        def loss(p: Any, ids: torch.Tensor, ym: torch.Tensor) -> torch.Tensor:
            y, m = ym[:, 0], ym[:, 1]  # targets and attention mask, batched together
            logits = fmodel(p, input_ids=ids, attention_mask=m).logits
            tok = F.cross_entropy(logits.transpose(1, 2), y, reduction="none")
            return (tok * m).sum(1) / m.sum(1)

        return loss

    _assert_matches_loop(model, loss_of, ids, torch.stack([y, mask], 1), rtol=1e-8)
    names = make_functional(model)[0].param_names
    tapped = {names[i] for i in plans[-1].tapped}
    assert {"transformer.h.0.attn.c_attn.weight", "transformer.h.1.mlp.c_proj.weight"} <= tapped
    assert "transformer.wte.weight" not in tapped  # tied to the head: exact


@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_tiny_hugging_face_models_with_padding_tap_their_embeddings(plans: list[_traced.TapPlan], arch: str) -> None:
    """BERT (word, position and token-type tables; positions and token types from buffers, the
    same for every example) and Llama (untied token table and head), built from configs, with
    padding on either side: the tables are tapped and the step matches the float64 loop."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if arch == "bert":
        config = transformers.BertConfig(vocab_size=V, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=16, max_position_embeddings=8, num_labels=3,
                                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                         attn_implementation="eager")
        model = transformers.BertForSequenceClassification(config).eval()
        tables = {"bert.embeddings.word_embeddings.weight", "bert.embeddings.position_embeddings.weight",
                  "bert.embeddings.token_type_embeddings.weight"}
    else:
        config = transformers.LlamaConfig(vocab_size=V, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8,
                                          attn_implementation="eager", tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(config).eval()
        tables = {"model.embed_tokens.weight"}
    ids, y = _tokens()
    mask = torch.ones(B, T, dtype=torch.long)
    mask[4, -2:] = 0  # right padding
    if arch == "bert":  # (Llama's eager attention gives a fully masked, left-padded query NaN)
        mask[1, :2] = 0  # left padding

    def loss_of(fmodel: Any) -> Any:
        def loss(p: Any, ids: torch.Tensor, ym: torch.Tensor) -> torch.Tensor:
            y, m = ym[:, 0], ym[:, 1]
            out = fmodel(p, input_ids=ids, attention_mask=m).logits
            if arch == "bert":
                return F.cross_entropy(out, y[:, 0] % 3, reduction="none")
            tok = F.cross_entropy(out.transpose(1, 2), y, reduction="none")
            return (tok * m).sum(1) / m.sum(1)

        return loss

    _assert_matches_loop(model, loss_of, ids, torch.stack([y, mask], 1), rtol=1e-8)
    names = make_functional(model)[0].param_names
    assert tables <= {names[i] for i in plans[-1].tapped}


class _Attention(nn.Module):
    """Causal self-attention through F.scaled_dot_product_attention, two heads, then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.qkv = nn.Linear(D, 3 * D)
        self.head = nn.Linear(D, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        h = self.emb(ids)
        q, k, v = self.qkv(h).view(b, t, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(h + att.transpose(1, 2).reshape(b, t, D))


@pytest.mark.parametrize("math_attention", [True, False])
def test_attention_runs_batched_or_looped_and_matches_the_float64_loop(plans: list[_traced.TapPlan],
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        math_attention: bool) -> None:
    """The plan counts each example's attention scores (2 heads x T x T); below the bound the
    step runs attention by the math backend (batched under vmap), above it by the default
    kernel (looped by vmap): the same per-example gradients either way."""
    if not math_attention:
        monkeypatch.setattr(_traced, "MATH_ATTENTION_MAX_ELEMENTS", 2 * T * T * B - 1)
    torch.manual_seed(0)
    model = _Attention()
    _assert_matches_loop(model, _token_loss, *_tokens())
    plan = plans[-1]
    assert plan.attention_cells == 2 * T * T
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _run(model, _token_loss, *_tokens(), c=1.0)
    flash = sum(e.count for e in prof.key_averages() if e.key == "aten::_scaled_dot_product_flash_attention_for_cpu")
    # the planning pass's one call; then none (math backend), or the kernel once per example and more
    assert (flash == 1) if math_attention else (flash > B), flash
    chosen = _traced.attention_backend(plan, B, torch.device("cpu"))
    assert isinstance(chosen, contextlib.nullcontext) != math_attention
    assert isinstance(_traced.attention_backend(plan, B, torch.device("meta")), contextlib.nullcontext)


def test_padding_rows_add_exactly_nothing(plans: list[_traced.TapPlan]) -> None:
    torch.manual_seed(0)
    model = _TiedLM()
    ids, y = _tokens()
    mask = torch.tensor([True] * 5 + [False] * 2)
    _, _, (out, aux), c = _run(model, _token_loss, ids, y, c=0.5, example_mask=mask)
    torch.manual_seed(0)
    model = _TiedLM()
    _, _, (want, _), _ = _run(model, _token_loss, ids[:5], y[:5], c=0.5)
    for got, ref in zip(out.pytree, want.pytree):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-14)
    assert plans


def test_has_aux_returns_each_example_s_aux(plans: list[_traced.TapPlan]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3)).double()
    fmodel, params = make_functional(model)

    def loss(p: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        out = fmodel(p, x)
        return ((out - y) ** 2).sum(1), {"pred": out.detach()}

    x, y = torch.randn(B, 4, dtype=torch.float64), torch.randn(B, 3, dtype=torch.float64)
    fn, state = clipped_grad(loss, clipping_norm=1.0, batch_argnums=(1, 2), return_aux=True, has_aux=True,
                             clip_backend="auto", model=fmodel)
    (_, aux), _ = fn(params, x, y, state=state)
    torch.testing.assert_close(aux.loss_aux["pred"], model(x).detach())
    torch.testing.assert_close(aux.loss_values, ((model(x) - y) ** 2).sum(1).detach())
    assert plans


@pytest.mark.parametrize("scale", [1e30, 1e-30, 1.0])
def test_each_example_s_contribution_is_at_most_the_clip_norm_in_float32(plans: list[_traced.TapPlan],
                                                                           scale: float) -> None:
    """Crafted float32 inputs (extreme scales; tokens whose per-position gradients cancel): the
    contribution of each example alone, measured in float64 from the released float32 sum,
    never exceeds C."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 2 * D), nn.Linear(2 * D, 3)).float()
    fmodel, params = make_functional(model)

    def loss(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (fmodel(p, x) * y).sum((1, 2))

    g = torch.Generator().manual_seed(1)
    base = torch.randn(1, T, D, generator=g)
    x = torch.cat([base, torch.cat([base[:, :1], -base[:, :1] * (1 - 1e-7)] * 2 + [base[:, :1]], 1)]) * scale
    y = torch.randn(2, T, 3, generator=g)
    _assert_each_contribution_at_most(loss, fmodel, params, x, y, c=1e-3)
    assert plans


# --- compiled ------------------------------------------------------------------------


@pytest.mark.slow
def test_compiled_auto_on_a_tied_lm_equals_the_eager_rules_without_host_syncs() -> None:
    """The compiled step takes the traced path (Linear layers tapped, the rest exact) and equals
    the eager "auto" step (its rules) over padded steps; a steady step makes no .item()."""
    from opake_fx.compiled import compile_step
    from opake_fx.dpsgd import clip, noise
    from opake_fx.optimizers import adam
    from opake_fx.pytree import leaves
    from opake_fx.random import key
    from opake_fx.transforms import apply_updates, chain

    torch.manual_seed(0)
    fmodel, params = make_functional(_TiedLM())
    loss = _token_loss(fmodel)

    def pipeline() -> Any:
        return chain(clip(loss, clipping_norm=0.3, batch_argnums=(1, 2), clip_backend="auto", model=fmodel),
                     noise(noise_multiplier=1.0, key=key(5)), adam(1e-2))

    step, eager = compile_step(pipeline(), buckets=(8,)), pipeline()
    p_c, s_c, p_e, s_e = params, step.init(params), params, eager.init(params)
    for n in (8, 6, 7, 8):
        ids, y = _tokens(seed=n, n=n)
        p_c, s_c = step(p_c, s_c, (ids, y))
        u, s_e = eager.update((ids, y), s_e, p_e)
        p_e = apply_updates(p_e, u)
    rel = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(leaves(p_c), leaves(p_e)))
    assert rel < 1e-5, rel
    ids, y = _tokens(seed=9)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(p_c, s_c, (ids, y))
    assert sum(e.count for e in prof.key_averages() if e.key == "aten::_local_scalar_dense") == 0


@pytest.mark.slow
def test_compiled_auto_in_float64_with_tapped_embeddings_equals_the_vmap_step() -> None:
    """A float64 model (whose certified norms read binary exponents: inductor's CPU code for a
    float64 frexp did not compile) with tapped embeddings: the compiled step equals the eager
    "vmap" step's clipped sum."""
    from opake_fx.compiled import compile_step
    from opake_fx.dpsgd import clip, noise
    from opake_fx.optimizers import sgd
    from opake_fx.random import key
    from opake_fx.transforms import chain

    torch.manual_seed(0)
    fmodel, params = make_functional(_UntiedLM().double())
    loss = _token_loss(fmodel)
    step = compile_step(chain(clip(loss, clipping_norm=0.05, batch_argnums=(1, 2), normalize_by=B, clip_backend="auto",
                                   model=fmodel),
                              noise(noise_multiplier=0.0, key=key(5)), sgd(1.0)))
    ids, y = _repetitive_tokens()
    new, _ = step(params, step.init(params), (ids, y))

    def one(p: Any, i: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return loss(p, i[None], t[None])[0]

    want, _ = clipped_grad(one, clipping_norm=0.05, batch_argnums=(1, 2), normalize_by=B)[0](
        params, ids, y, state=clipped_grad(one, clipping_norm=0.05, batch_argnums=(1, 2))[1])
    for p, q, u in zip(params, new, want.pytree):
        torch.testing.assert_close(p - q, u, rtol=1e-9, atol=1e-15)
