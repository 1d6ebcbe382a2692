"""Hugging Face models (the ``hf`` extra) under the fast clipping backends.

Tiny models are built from configs (no weights are downloaded) and run in float64; each
backend must give the clipped sum and the norms of a per-example autograd loop. GPT-2's
projections are ``transformers.pytorch_utils.Conv1D`` (a Linear with its weight stored
``[d_in, d_out]``), which has its own rule; LoRA adapters from peft are plain Linears,
differentiated while the base model stays frozen.
"""

from __future__ import annotations

import warnings

import math
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from opake_fx.dpsgd.clipping import _ghost, _rules_fallback  # noqa: E402
from opake_fx.errors import SlowPathWarning  # noqa: E402
from opake_fx.functional import make_functional  # noqa: E402
from tests.dpsgd.test_ghost_clipping import count_calls  # noqa: E402
from tests.dpsgd.test_ghost_layers import reference, run_backend  # noqa: E402

B, T, VOCAB = 5, 7, 50


def gpt2(**overrides: Any) -> nn.Module:
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0, **overrides)
    return transformers.GPT2LMHeadModel(config)


def bert(num_labels: int = 3) -> nn.Module:
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, num_labels=num_labels)
    return transformers.BertForSequenceClassification(config)


def positions(ids: torch.Tensor) -> torch.Tensor:
    """Position ids with the batch axis (the fast backends need every layer input batched)."""
    return torch.arange(ids.shape[1]).expand(ids.shape[0], -1)


def lm_losses(fmodel: Any, p: Any, ids: torch.Tensor, batched_positions: bool = True) -> torch.Tensor:
    kw = {"position_ids": positions(ids)} if batched_positions else {}
    logits = fmodel(p, input_ids=ids, **kw).logits
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").mean(1)


def classifier_losses(fmodel: Any, p: Any, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = fmodel(p, input_ids=ids, position_ids=positions(ids)).logits
    return F.cross_entropy(logits, labels, reduction="none")


def check(model: nn.Module, x: torch.Tensor, y: torch.Tensor, losses: Callable[..., torch.Tensor],
          trainable: Callable[[str], bool] = lambda name: True, rtol: float = 1e-9) -> int:
    """Both fast backends against per-example autograd, differentiating the ``trainable`` parameters
    (the others are constants of ``fmodel``, as in fine-tuning). Returns how many were trained."""
    model = model.double().eval()
    for name, p in model.named_parameters():
        p.requires_grad_(trainable(name))
    fmodel, train = make_functional(model, trainable_only=True)
    assert all(trainable(name) for name in fmodel.param_names)

    def batched(params: Any, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return losses(fmodel, params, xb, yb)

    c = float(reference(batched, train, x, y, math.inf)[1].median())  # about half the examples clipped
    want, norms, _ = reference(batched, train, x, y, c)
    # Relative to the largest entry of the whole gradient: some leaves are exactly zero in
    # exact arithmetic (an attention key bias shifts every score of a query equally).
    scale = max(float(r.abs().max()) for r in want)
    for backend in ("ghost", "auto"):
        out, aux = run_backend(backend, batched, fmodel, train, x, y, c)
        for name, got, ref in zip(fmodel.param_names, out.pytree, want):
            assert got.shape == ref.shape
            err = float((got - ref).abs().max())
            assert err <= rtol * scale, (backend, name, err, scale)
        torch.testing.assert_close(aux.grad_norms, norms, rtol=rtol, atol=1e-12)
    return len(train)


@pytest.fixture
def fallbacks(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    return {
        "module": count_calls(monkeypatch, _rules_fallback, "module_per_example"),
        "whole": count_calls(monkeypatch, _ghost, "_whole_loss_per_example"),
    }


def test_gpt2_full_model_uses_rules_only(fallbacks: dict[str, list[int]]) -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (B, T))
    check(gpt2(), ids, ids, lambda fm, p, x, y: lm_losses(fm, p, x))
    # Conv1D has a rule, and the tied embedding / LM head is summed from its two rules.
    assert fallbacks["module"][0] == 0 and fallbacks["whole"][0] == 0


def test_gpt2_default_position_ids_take_the_shared_tensor_rule(fallbacks: dict[str, list[int]]) -> None:
    # GPT-2 looks positions up as [1, T] by default: wpe does not see the batch axis; its output
    # meets the batch in an add, where the shared-tensor rule takes it (it used to take the
    # whole-loss fallback).
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (B, T))
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPathWarning)
        check(gpt2(), ids, ids, lambda fm, p, x, y: lm_losses(fm, p, x, batched_positions=False))
    assert fallbacks["module"][0] == 0 and fallbacks["whole"][0] == 0


def test_bert_classifier_uses_rules_only(fallbacks: dict[str, list[int]]) -> None:
    torch.manual_seed(2)
    ids, labels = torch.randint(0, VOCAB, (B, T)), torch.randint(0, 3, (B,))
    check(bert(), ids, labels, classifier_losses)
    assert fallbacks["module"][0] == 0 and fallbacks["whole"][0] == 0


def test_lora_on_gpt2_conv1d_projections(fallbacks: dict[str, list[int]]) -> None:
    torch.manual_seed(3)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)
    model = peft.get_peft_model(gpt2(), config)
    for name, p in model.named_parameters():  # peft zero-initialises B; give the adapters a real gradient path
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    ids = torch.randint(0, VOCAB, (B, T))
    trained = check(model, ids, ids, lambda fm, p, x, y: lm_losses(fm, p, x), trainable=lambda n: "lora_" in n)
    assert trained == 2 * 2 * 3  # (A, B) x 2 layers x (c_attn, attention c_proj, MLP c_proj)
    assert fallbacks["module"][0] == 0 and fallbacks["whole"][0] == 0


def test_lora_on_bert_with_a_trained_classifier_head(fallbacks: dict[str, list[int]]) -> None:
    torch.manual_seed(4)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"], modules_to_save=["classifier"])
    model = peft.get_peft_model(bert(), config)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    ids, labels = torch.randint(0, VOCAB, (B, T)), torch.randint(0, 3, (B,))
    trained = check(model, ids, labels, classifier_losses,
                    trainable=lambda n: "lora_" in n or "modules_to_save" in n)
    assert trained == 2 * 2 * 2 + 2  # (A, B) x 2 layers x (query, value) + classifier weight and bias
    assert fallbacks["module"][0] == 0 and fallbacks["whole"][0] == 0


def test_a_user_class_named_conv1d_is_not_taken_for_transformers_conv1d(fallbacks: dict[str, list[int]]) -> None:
    # Only transformers' own Conv1D.forward gets the transposed-Linear rule; a look-alike
    # with other arithmetic goes to the exact module fallback.
    class Conv1D(nn.Module):
        def __init__(self, nf: int, nx: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(nx, nf))
            self.bias = nn.Parameter(torch.randn(nf))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(x) @ self.weight * 2.0 + self.bias

    torch.manual_seed(5)
    model = nn.Sequential(Conv1D(3, 4), nn.Linear(3, 1))
    x = torch.randn(6, 4, dtype=torch.float64)
    y = torch.randn(6, dtype=torch.float64)
    check(model, x, y, lambda fm, p, xb, yb: (fm(p, xb).squeeze(-1) - yb) ** 2)
    assert fallbacks["module"][0] == 2  # once per backend


def test_transformers_conv1d_used_twice_sums_its_per_example_gradients(fallbacks: dict[str, list[int]]) -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = transformers.pytorch_utils.Conv1D(4, 4)  # nf = nx: applied twice
            self.head = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.proj(torch.tanh(self.proj(x))))).squeeze(-1)

    torch.manual_seed(6)
    x = torch.randn(6, 3, 4, dtype=torch.float64)
    y = torch.randn(6, 3, dtype=torch.float64)
    check(Twice(), x, y, lambda fm, p, xb, yb: ((fm(p, xb) - yb) ** 2).sum(1))
    assert fallbacks["module"][0] == 0 and fallbacks["whole"][0] == 0
