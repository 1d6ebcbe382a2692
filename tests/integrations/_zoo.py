"""The model zoo of issue 12: tiny real architectures for the clipping backends.

Each :class:`Case` builds a small model (Hugging Face models from config objects, random
initialisation, nothing downloaded; torch-native ones directly), a batch of a given size,
and a *batched* loss ``loss(fmodel, params, *batch) -> [B]`` (per-example losses, padding
excluded). :func:`prepare` casts everything to float64 and closes over the frozen
parameters; :func:`reference` is the oracle (each example run alone, batch size 1, one
``torch.autograd.grad`` per example, its norm clipped, summed); :func:`run_backend` runs
``clipped_grad`` with a backend and records the ``SlowPathWarning`` messages and the
number of ``torch.func.vmap`` calls it made.

Sizes are chosen so that a batch size can equal another dimension of the model (sequence
length, number of heads, relative-attention buckets, channels, layers...): the bug class
"a dimension equal to the batch size is taken for the batch axis".
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from opake_fx.dpsgd.clipping import clipped_grad
from opake_fx.errors import SlowPathWarning
from opake_fx.functional import make_functional

try:  # the hf extra
    import transformers
except ImportError:  # pragma: no cover
    transformers = None
try:
    import peft
except ImportError:  # pragma: no cover
    peft = None

VOCAB = 50
HIDDEN = 16
HEADS = 4  # head dim 4
SEQ = 6

Batch = tuple[torch.Tensor, ...]
LossFn = Callable[..., torch.Tensor]


@dataclass
class Case:
    """One zoo model.

    ``sizes`` maps a label to a batch size (``"odd"``, ``"B=T"``, ...). ``expect`` maps a
    backend to what the issue asks of it:

    * ``"fast"``: the layer rules only: no ``SlowPathWarning`` (and, for ghost/auto, no
      ``torch.func.vmap`` at all: see ``test_zoo_fast_path_runs_no_vmap``);
    * ``"slow"``: an exact slow path that must say so (a ``SlowPathWarning``);
    * ``"any"``: either a rule or an exact fallback; a fallback must still say so (vmap
      calls on ghost/auto imply a warning).
    """

    name: str
    model: Callable[[], nn.Module]
    batch: Callable[[int, torch.Generator], Batch]
    loss: LossFn
    sizes: dict[str, int]
    expect: dict[str, str]
    trainable: Callable[[str], bool] | None = None
    hf: bool = False
    slow: bool = False
    # Why ghost/auto still take the whole-loss fallback for some parameters (None: they never
    # do; checked both ways by test_model_zoo.test_zoo_whole_loss_fallback_as_listed).
    whole_loss: str | None = None


# --- data ----------------------------------------------------------------------------------


def padded_ids(b: int, gen: torch.Generator, t: int = SEQ, pad: int = 0, low: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``[b, t]`` and an attention mask with right padding: example 0 is full,
    example 1 (if any) has 2 padded positions, the others random lengths in [t/2, t]."""
    ids = torch.randint(low, VOCAB, (b, t), generator=gen)
    lengths = torch.randint(t // 2, t + 1, (b,), generator=gen)
    lengths[0] = t
    if b > 1:
        lengths[1] = t - 2
    mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).long()
    ids = torch.where(mask.bool(), ids, torch.full_like(ids, pad))
    return ids, mask


def positions(ids: torch.Tensor) -> torch.Tensor:
    """Position ids with the batch axis (what docs/clipping.md asks for)."""
    return torch.arange(ids.shape[1]).expand(ids.shape[0], -1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-example mean of ``values [B, T]`` over positions where ``mask`` is 1."""
    m = mask.to(values.dtype)
    return (values * m).sum(1) / m.sum(1).clamp_min(1.0)


def causal_lm_losses(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    ce = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    return masked_mean(ce, mask[:, 1:])


# --- Hugging Face models ---------------------------------------------------------------------


def _hf_common() -> dict[str, Any]:
    return dict(vocab_size=VOCAB, use_cache=False)


def llama() -> nn.Module:
    cfg = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=1, num_attention_heads=HEADS,
                                   num_key_value_heads=2, max_position_embeddings=32, attention_dropout=0.0,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=1, **_hf_common())
    return transformers.LlamaForCausalLM(cfg)


def qwen2() -> nn.Module:
    cfg = transformers.Qwen2Config(hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=1, num_attention_heads=HEADS,
                                   num_key_value_heads=2, max_position_embeddings=32, attention_dropout=0.0,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=1, tie_word_embeddings=False,
                                   **_hf_common())
    return transformers.Qwen2ForCausalLM(cfg)


def gpt_neox() -> nn.Module:
    cfg = transformers.GPTNeoXConfig(hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=1, num_attention_heads=HEADS,
                                     max_position_embeddings=32, rotary_pct=0.5, hidden_dropout=0.0, attention_dropout=0.0,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=1, **_hf_common())
    return transformers.GPTNeoXForCausalLM(cfg)


def gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(n_positions=16, n_embd=HIDDEN, n_layer=1, n_head=HEADS, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0, bos_token_id=1, eos_token_id=1, pad_token_id=0, **_hf_common())
    model = transformers.GPT2LMHeadModel(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    return model


def _bert_config(**kw: Any) -> Any:
    return transformers.BertConfig(hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=HEADS, intermediate_size=32,
                                   max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                   pad_token_id=0, **_hf_common(), **kw)


def bert_cls() -> nn.Module:
    return transformers.BertForSequenceClassification(_bert_config(num_labels=3))


def bert_mlm() -> nn.Module:
    model = transformers.BertForMaskedLM(_bert_config())
    head = model.cls.predictions
    assert head.decoder.bias is head.bias  # the parent-owned tied bias (decoder.bias = self.bias)
    with torch.no_grad():
        head.bias.normal_(0, 0.1)
    return model


def roberta_mlm() -> nn.Module:
    cfg = transformers.RobertaConfig(hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=HEADS, intermediate_size=32,
                                     max_position_embeddings=SEQ + 4, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                                     type_vocab_size=1, **_hf_common())
    model = transformers.RobertaForMaskedLM(cfg)
    assert model.lm_head.decoder.bias is model.lm_head.bias
    with torch.no_grad():
        model.lm_head.bias.normal_(0, 0.1)
    return model


T5_ENC, T5_DEC, T5_BUCKETS = 6, 5, 8


def t5() -> nn.Module:
    cfg = transformers.T5Config(d_model=HIDDEN, d_kv=4, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=HEADS,
                                relative_attention_num_buckets=T5_BUCKETS, relative_attention_max_distance=16,
                                dropout_rate=0.0, feed_forward_proj="relu", decoder_start_token_id=0, pad_token_id=0,
                                eos_token_id=1, **_hf_common())
    return transformers.T5ForConditionalGeneration(cfg)


VIT_IMAGE, VIT_PATCH = 8, 4  # 4 patches + cls: sequence length 5


def vit() -> nn.Module:
    cfg = transformers.ViTConfig(image_size=VIT_IMAGE, patch_size=VIT_PATCH, num_channels=3, hidden_size=HIDDEN,
                                 num_hidden_layers=1, num_attention_heads=HEADS, intermediate_size=32, num_labels=3,
                                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = transformers.ViTForImageClassification(cfg)
    with torch.no_grad():  # HF initialises them with small or zero values; make them matter
        model.vit.embeddings.cls_token.normal_(0, 0.5)
        model.vit.embeddings.position_embeddings.normal_(0, 0.5)
    return model


def llama_lora() -> nn.Module:
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(llama(), config)
    for name, p in model.named_parameters():  # peft zero-initialises B; give the adapters a real gradient path
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    return model


# Issue 29's architectures: 2 layers where the model has a stack, width HIDDEN.


def opt() -> nn.Module:
    cfg = transformers.OPTConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=2, ffn_dim=32,
                                 max_position_embeddings=32, word_embed_proj_dim=HIDDEN, dropout=0.0,
                                 attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=1, **_hf_common())
    return transformers.OPTForCausalLM(cfg)


def gemma() -> nn.Module:
    cfg = transformers.GemmaConfig(hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=2, num_attention_heads=HEADS,
                                   num_key_value_heads=2, head_dim=4, max_position_embeddings=32, attention_dropout=0.0,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=1, **_hf_common())
    model = transformers.GemmaForCausalLM(cfg)
    with torch.no_grad():  # (1 + w) norms start at w = 0; make the weights matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    return model


def falcon() -> nn.Module:
    cfg = transformers.FalconConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=2, hidden_dropout=0.0,
                                    attention_dropout=0.0, new_decoder_architecture=False, multi_query=True, alibi=False,
                                    parallel_attn=True, bias=False, pad_token_id=0, bos_token_id=1, eos_token_id=1,
                                    **_hf_common())
    return transformers.FalconForCausalLM(cfg)


def distilbert() -> nn.Module:
    cfg = transformers.DistilBertConfig(dim=HIDDEN, n_heads=HEADS, n_layers=2, hidden_dim=32, max_position_embeddings=16,
                                        dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0, num_labels=3,
                                        pad_token_id=0, vocab_size=VOCAB)
    return transformers.DistilBertForSequenceClassification(cfg)


def deberta_v2() -> nn.Module:
    cfg = transformers.DebertaV2Config(hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=2,
                                       intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                       attention_probs_dropout_prob=0.0, relative_attention=True, position_buckets=4,
                                       pos_att_type=["p2c", "c2p"], max_relative_positions=8, num_labels=3,
                                       type_vocab_size=0, position_biased_input=False, pad_token_id=0, vocab_size=VOCAB)
    return transformers.DebertaV2ForSequenceClassification(cfg)


def bart() -> nn.Module:
    cfg = transformers.BartConfig(d_model=HIDDEN, encoder_layers=1, decoder_layers=1, encoder_attention_heads=HEADS,
                                  decoder_attention_heads=HEADS, encoder_ffn_dim=32, decoder_ffn_dim=32,
                                  max_position_embeddings=16, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=1, decoder_start_token_id=1,
                                  **_hf_common())
    return transformers.BartForConditionalGeneration(cfg)


def text_batch(b: int, gen: torch.Generator) -> Batch:
    return padded_ids(b, gen)


def lm_loss(fmodel: Any, p: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    logits = fmodel(p, input_ids=ids, attention_mask=mask).logits
    return causal_lm_losses(logits, ids, mask)


def gpt2_loss(fmodel: Any, p: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    logits = fmodel(p, input_ids=ids, attention_mask=mask, position_ids=positions(ids)).logits
    return causal_lm_losses(logits, ids, mask)


def cls_batch(b: int, gen: torch.Generator) -> Batch:
    ids, mask = padded_ids(b, gen)
    return ids, mask, torch.randint(0, 3, (b,), generator=gen)


def bert_cls_loss(fmodel: Any, p: Any, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = fmodel(p, input_ids=ids, attention_mask=mask, position_ids=positions(ids)).logits
    return F.cross_entropy(logits, labels, reduction="none")


def cls_loss(fmodel: Any, p: Any, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Classification with the model's own positions (no position_ids: shared [T] lookups)."""
    logits = fmodel(p, input_ids=ids, attention_mask=mask).logits
    return F.cross_entropy(logits, labels, reduction="none")


def mlm_batch(b: int, gen: torch.Generator, pad: int = 0, low: int = 3) -> Batch:
    """ids with some tokens replaced by a [MASK] id (2), and the original tokens as targets."""
    target, mask = padded_ids(b, gen, pad=pad, low=low)
    hide = (torch.rand(target.shape, generator=gen) < 0.3) & mask.bool()
    ids = torch.where(hide, torch.full_like(target, 2), target)
    return ids, mask, target


def bert_mlm_loss(fmodel: Any, p: Any, ids: torch.Tensor, mask: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    logits = fmodel(p, input_ids=ids, attention_mask=mask, position_ids=positions(ids)).logits
    return masked_mean(F.cross_entropy(logits.transpose(1, 2), target, reduction="none"), mask)


def roberta_mlm_loss(fmodel: Any, p: Any, ids: torch.Tensor, mask: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # RoBERTa derives its position ids from input_ids (padding_idx aware): already [B, T].
    logits = fmodel(p, input_ids=ids, attention_mask=mask).logits
    return masked_mean(F.cross_entropy(logits.transpose(1, 2), target, reduction="none"), mask)


def t5_batch(b: int, gen: torch.Generator) -> Batch:
    ids, mask = padded_ids(b, gen, t=T5_ENC)
    labels, dec_mask = padded_ids(b, gen, t=T5_DEC)
    return ids, mask, labels, dec_mask


def t5_loss(fmodel: Any, p: Any, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor,
            dec_mask: torch.Tensor) -> torch.Tensor:
    start = torch.zeros_like(labels[:, :1])
    dec_in = torch.cat([start, labels[:, :-1]], dim=1)  # what T5 does with labels= (_shift_right)
    logits = fmodel(p, input_ids=ids, attention_mask=mask, decoder_input_ids=dec_in,
                    decoder_attention_mask=dec_mask).logits
    return masked_mean(F.cross_entropy(logits.transpose(1, 2), labels, reduction="none"), dec_mask)


def gpt2_default_positions_loss(fmodel: Any, p: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # GPT-2 looks positions up with a [1, T] tensor by default: the position table does not
    # see the batch axis (docs/clipping.md: an exact slow path that says so).
    logits = fmodel(p, input_ids=ids, attention_mask=mask).logits
    return causal_lm_losses(logits, ids, mask)


def t5_unpadded_batch(b: int, gen: torch.Generator) -> Batch:
    return (torch.randint(2, VOCAB, (b, T5_ENC), generator=gen), torch.randint(2, VOCAB, (b, T5_DEC), generator=gen))


def t5_unpadded_loss(fmodel: Any, p: Any, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    dec_in = torch.cat([torch.zeros_like(labels[:, :1]), labels[:, :-1]], dim=1)
    logits = fmodel(p, input_ids=ids, decoder_input_ids=dec_in).logits
    return F.cross_entropy(logits.transpose(1, 2), labels, reduction="none").mean(1)


def seq2seq_batch(b: int, gen: torch.Generator) -> Batch:
    ids, mask = padded_ids(b, gen)
    return ids, mask, torch.randint(2, VOCAB, (b, T5_DEC), generator=gen)


def bart_loss(fmodel: Any, p: Any, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = fmodel(p, input_ids=ids, attention_mask=mask, decoder_input_ids=labels).logits
    return F.cross_entropy(logits.transpose(1, 2), labels, reduction="none").mean(1)


def vit_batch(b: int, gen: torch.Generator) -> Batch:
    return torch.randn(b, 3, VIT_IMAGE, VIT_IMAGE, generator=gen), torch.randint(0, 3, (b,), generator=gen)


def vit_loss(fmodel: Any, p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(fmodel(p, pixel_values=x).logits, y, reduction="none")


# --- torch-native models ---------------------------------------------------------------------


class ResBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.norm1 = nn.Conv2d(c, c, 3, padding=1), nn.GroupNorm(2, c)
        self.conv2, self.norm2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.GroupNorm(2, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.norm1(self.conv1(x)))
        return F.relu(x + self.norm2(self.conv2(h)))


class GroupNormResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.blocks = nn.Sequential(ResBlock(4), ResBlock(4))
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class ConvNeXtBlock(nn.Module):
    """A ConvNeXt block: depthwise 7x7 conv, channels-last LayerNorm, pointwise MLP, layer scale."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 2, stride=2)
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c)
        self.pw1, self.pw2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
        self.gamma = nn.Parameter(torch.full((c,), 0.5))
        self.head = nn.Linear(c, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        y = self.pw2(F.gelu(self.pw1(self.norm(self.dw(x).permute(0, 2, 3, 1)))))
        x = x + (self.gamma * y).permute(0, 3, 1, 2)
        return self.head(x.mean((2, 3)))


class BiGRU(nn.Module):
    """A 2-layer bidirectional GRU classifier over token ids."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.rnn = nn.GRU(8, 8, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(16, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.emb(ids))
        return self.head(out.mean(1))


def ids_cls_batch(b: int, gen: torch.Generator) -> Batch:
    return torch.randint(0, VOCAB, (b, SEQ), generator=gen), torch.randint(0, 3, (b,), generator=gen)


def image_batch(c: int, hw: int, classes: int) -> Callable[[int, torch.Generator], Batch]:
    def make(b: int, gen: torch.Generator) -> Batch:
        return torch.randn(b, c, hw, hw, generator=gen), torch.randint(0, classes, (b,), generator=gen)

    return make


def ce_loss(fmodel: Any, p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(fmodel(p, x), y, reduction="none")


class Encoder(nn.Module):
    """Embedding + nn.TransformerEncoder (batch first, padding mask) + mean-pooled head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        layer = nn.TransformerEncoderLayer(HIDDEN, HEADS, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(HIDDEN, 3)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.emb(ids), src_key_padding_mask=~mask.bool())
        m = mask.unsqueeze(-1).to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1))


def encoder_loss(fmodel: Any, p: Any, ids: torch.Tensor, mask: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(fmodel(p, ids, mask), y, reduction="none")


class CrossAttentionKV(nn.Module):
    """Queries from the tokens, keys and values from two other sequences of their own widths
    (``kdim``/``vdim``: separate projection weights, one packed bias), extra key/value biases,
    zero attention, the memory's padding mask, and the averaged attention weights returned and
    used by the head (issue 29's ``nn.MultiheadAttention`` in every configuration)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.keys, self.values = nn.Linear(HIDDEN, 6), nn.Linear(HIDDEN, 5)
        self.attn = nn.MultiheadAttention(HIDDEN, HEADS, kdim=6, vdim=5, add_bias_kv=True, add_zero_attn=True,
                                          batch_first=True)
        self.head = nn.Linear(HIDDEN + 1, 3)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        memory = torch.tanh(h.flip(1))  # the memory: the sequence read backwards, padding first
        padding = ~mask.bool().flip(1)
        out, weights = self.attn(h, self.keys(memory), self.values(memory), key_padding_mask=padding,
                                 need_weights=True)
        m = mask.unsqueeze(-1).to(h.dtype)
        focus = weights[..., -1:]  # the weight each query gives the zero-attention slot
        return self.head(torch.cat([(out * m).sum(1), (focus * m).sum(1)], dim=-1) / m.sum(1))


RNN_IN, RNN_HIDDEN = 4, 8


class Recurrent(nn.Module):
    """A batch-first RNN and a head on its last output (``from_state``: on the last layer's
    final hidden state ``h_n[-1]``, whose batch axis is the second)."""

    def __init__(self, kind: type, layers: int = 1, from_state: bool = False) -> None:
        super().__init__()
        self.rnn = kind(RNN_IN, RNN_HIDDEN, num_layers=layers, batch_first=True)
        self.head = nn.Linear(RNN_HIDDEN, 2)
        self.from_state = from_state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, state = self.rnn(x)
        if self.from_state:
            h = state[0] if isinstance(state, tuple) else state
            return self.head(h[-1])
        return self.head(out[:, -1])


def seq_batch(b: int, gen: torch.Generator) -> Batch:
    return torch.randn(b, SEQ, RNN_IN, generator=gen), torch.randn(b, 2, generator=gen)


def mse_loss(fmodel: Any, p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((fmodel(p, x) - y) ** 2).flatten(1).sum(1)


class SharedLinear(nn.Module):
    """One Linear applied twice (its weight gets the sum of two calls' gradients)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.proj(torch.tanh(self.proj(x)))).mean(1))


def shared_batch(b: int, gen: torch.Generator) -> Batch:
    return torch.randn(b, 3, 4, generator=gen), torch.randn(b, 2, generator=gen)


class Convs(nn.Module):
    """Grouped + dilated Conv2d, a depthwise Conv2d, and a grouped dilated Conv1d."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(4, 8, 3, padding=2, dilation=2, groups=2)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.c3 = nn.Conv1d(8, 4, 2, dilation=3, groups=4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.c2(torch.tanh(self.c1(x))))  # [B, 8, 6, 6]
        h = torch.tanh(self.c3(h.flatten(2)))  # [B, 4, 33]
        return self.head(h.mean(2))


class Bag2d(nn.Module):
    """nn.EmbeddingBag on [B, L] ids (mode mean, padding_idx)."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(VOCAB, 8, mode="mean", padding_idx=0)
        self.head = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.bag(ids)))


class BagOffsets(nn.Module):
    """nn.EmbeddingBag in its flat form (1-D ids, offsets, per-sample weights, mode sum),
    built from a padded [B, L] batch inside the forward: the ids tensor has no batch axis."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(VOCAB, 8, mode="sum")
        self.head = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        keep = ids != 0
        lengths = keep.sum(1)
        offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]])
        out = self.bag(ids[keep], offsets, per_sample_weights=weights[keep])
        return self.head(torch.tanh(out))


BAG_LEN = 4


def bag_batch(b: int, gen: torch.Generator) -> Batch:
    ids, _ = padded_ids(b, gen, t=BAG_LEN, low=1)
    return ids, torch.randint(0, 3, (b,), generator=gen)


def bag_offsets_batch(b: int, gen: torch.Generator) -> Batch:
    ids, _ = padded_ids(b, gen, t=BAG_LEN, low=1)
    return ids, torch.rand(b, BAG_LEN, generator=gen) + 0.5, torch.randint(0, 3, (b,), generator=gen)


def bag_offsets_loss(fmodel: Any, p: Any, ids: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(fmodel(p, ids, w), y, reduction="none")


class Mixing(nn.Module):
    """Mixes examples without parameters: ``h - h.mean(0)`` between two Linears."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.b(h - h.mean(0))


# --- the zoo ---------------------------------------------------------------------------------

FAST = {"vmap": "fast", "ghost": "fast", "auto": "fast"}


def _hf(name: str, model: Callable[[], nn.Module], batch: Any, loss: LossFn, sizes: dict[str, int],
        expect: dict[str, str] | None = None, **kw: Any) -> Case:
    # The default vmap backend runs an HF model with attention_mask through transformers' mask
    # code; where vmap cannot, the issue asks for an exact per-example loop with a warning.
    return Case(name, model, batch, loss, sizes, {**FAST, "vmap": "slow", **(expect or {})}, hf=True, **kw)


TEXT_SIZES = {"odd": 5, "B=T": SEQ, "B=heads": HEADS}

CASES: list[Case] = [
    _hf("llama", llama, text_batch, lm_loss, {**TEXT_SIZES, "B=kv_heads": 2}),
    _hf("qwen2", qwen2, text_batch, lm_loss, TEXT_SIZES),
    _hf("gpt_neox", gpt_neox, text_batch, lm_loss, TEXT_SIZES),
    _hf("gpt2_tied", gpt2, text_batch, gpt2_loss, TEXT_SIZES),
    # wpe looked up on [1, T] positions (a shared call) and added to the batch: the shared-tensor rule.
    _hf("gpt2_default_positions", gpt2, text_batch, gpt2_default_positions_loss, {"odd": 5, "B=T": SEQ}),
    _hf("bert_cls", bert_cls, cls_batch, bert_cls_loss, {**TEXT_SIZES, "B=labels": 3}),
    _hf("bert_mlm", bert_mlm, mlm_batch, bert_mlm_loss, TEXT_SIZES),
    _hf("roberta_mlm", roberta_mlm, lambda b, g: mlm_batch(b, g, pad=1, low=4), roberta_mlm_loss, TEXT_SIZES),
    # T5's relative-attention bias is an embedding looked up with a [T, T] bucket tensor (no
    # batch axis, a shared call) that meets the batch at the mask's `where`: the shared-tensor rule.
    _hf("t5", t5, t5_batch, t5_loss,
        {"odd": 3, "B=T_enc": T5_ENC, "B=T_dec": T5_DEC, "B=heads": HEADS, "B=buckets": T5_BUCKETS}),
    # Without padding masks (no vmap trouble from transformers' mask code): isolates the
    # relative-attention bias, whose [T, T] lookup is taken for batched when B == T.
    _hf("t5_unpadded", t5, t5_unpadded_batch, t5_unpadded_loss,
        {"odd": 3, "B=T_enc": T5_ENC, "B=T_dec": T5_DEC, "B=buckets": T5_BUCKETS}, {"vmap": "fast"}),
    # No attention mask: the default vmap backend must run it as it is.
    # ViTEmbeddings uses cls_token (expanded to the batch) and position_embeddings (added) in its
    # own forward, outside any submodule call: the elementwise rule takes both broadcasts.
    _hf("vit", vit, vit_batch, vit_loss, {"odd": 3, "B=T": 5, "B=heads": HEADS}, FAST),
    _hf("llama_lora", llama_lora, text_batch, lm_loss, TEXT_SIZES, trainable=lambda n: "lora_" in n),
    Case("groupnorm_resnet", GroupNormResNet, image_batch(3, 6, 3), ce_loss,
         {"odd": 5, "B=channels": 4, "B=H=W": 6, "B=groups": 2}, FAST),
    Case("transformer_encoder", Encoder, cls_batch, encoder_loss, TEXT_SIZES, FAST),
    Case("mha_cross_kdim_vdim", CrossAttentionKV, cls_batch, encoder_loss, TEXT_SIZES, FAST),
    # LSTM/GRU: a rule or an exact routed fallback (with a warning) are both acceptable.
    Case("lstm", lambda: Recurrent(nn.LSTM), seq_batch, mse_loss, {"odd": 5, "B=T": SEQ, "B=layers": 1},
         {"vmap": "any", "ghost": "any", "auto": "any"}),
    Case("gru", lambda: Recurrent(nn.GRU), seq_batch, mse_loss, {"odd": 5, "B=T": SEQ, "B=layers": 1},
         {"vmap": "any", "ghost": "any", "auto": "any"}),
    Case("lstm_2layer", lambda: Recurrent(nn.LSTM, layers=2), seq_batch, mse_loss, {"odd": 5, "B=T": SEQ, "B=layers": 2},
         {"vmap": "any", "ghost": "any", "auto": "any"}),
    Case("lstm_2layer_h_n", lambda: Recurrent(nn.LSTM, layers=2, from_state=True), seq_batch, mse_loss,
         {"odd": 5, "B=T": SEQ, "B=layers": 2}, {"vmap": "any", "ghost": "any", "auto": "any"}),
    Case("shared_linear", SharedLinear, shared_batch, mse_loss, {"odd": 5, "B=d": 4, "B=T": 3}, FAST),
    Case("grouped_dilated_conv", Convs, image_batch(4, 6, 3), ce_loss,
         {"odd": 5, "B=C_in": 4, "B=H=W": 6, "B=groups": 2}, FAST),
    # Issue 29's architectures.
    # OPT's decoder layers flatten the batch with the positions ([B * T, d]) before fc1/fc2 and
    # the final layer norm: read as T consecutive rows per example (the grouping proven by the
    # independence check); its mask-derived positions are a lookup in an Embedding subclass's
    # own forward (the lookup rule).
    _hf("opt", opt, text_batch, lm_loss, TEXT_SIZES, {"vmap": "any"}),
    # GemmaRMSNorm computes in float32 whatever the model's dtype, so in this float64 zoo its
    # output is not affine in its weight to float64 rounding: the module fallback (in a float32
    # model it takes the norm-like rule). Its scaled word embedding takes the lookup rule.
    _hf("gemma", gemma, text_batch, lm_loss, TEXT_SIZES, {"vmap": "any", "ghost": "slow", "auto": "slow"}),
    # FalconLinear (an nn.Linear subclass computing `x @ W.T` in its own forward): the inline-Linear rule.
    _hf("falcon", falcon, text_batch, lm_loss, TEXT_SIZES, {"vmap": "any"}),
    _hf("distilbert", distilbert, cls_batch, cls_loss, {**TEXT_SIZES, "B=labels": 3}, {"vmap": "any"}),
    # Disentangled attention: the relative-position table (a parameter used outside its module,
    # layer-normed, projected) meets the batch through repeat(B, 1, 1) + bmm over [B * heads]
    # rows: the shared-tensor rule's repeat site.
    _hf("deberta_v2", deberta_v2, cls_batch, cls_loss, {**TEXT_SIZES, "B=buckets": 4}, {"vmap": "any"}),
    # Scaled word embeddings and learned positions (offset 2) are lookups in Embedding subclasses'
    # own forward (the lookup rule); the decoder's positions have no batch axis (shared tensors).
    _hf("bart", bart, seq2seq_batch, bart_loss, {"odd": 3, "B=T_enc": SEQ, "B=T_dec": T5_DEC, "B=heads": HEADS},
        {"vmap": "any"}),
    Case("convnext_block", ConvNeXtBlock, image_batch(3, 8, 3), ce_loss, {"odd": 5, "B=C": 4, "B=H=W": 4}, FAST),
    # The recurrent rule: unrolled over time from tapped projections.
    Case("bigru", BiGRU, ids_cls_batch, ce_loss, {"odd": 5, "B=T": SEQ, "B=layers*dirs": 4}, {**FAST, "vmap": "any"}),
    Case("embedding_bag", Bag2d, bag_batch, ce_loss, {"odd": 5, "B=L": BAG_LEN, "B=dim": 8}, FAST),
    # The flat form: the ids tensor has no batch axis; total tokens can equal B.
    Case("embedding_bag_offsets", BagOffsets, bag_offsets_batch, bag_offsets_loss, {"odd": 5, "B=L": BAG_LEN, "B=dim": 8},
         {"vmap": "any", "ghost": "any", "auto": "any"}),
]

BY_NAME = {c.name: c for c in CASES}


# --- running ---------------------------------------------------------------------------------


@dataclass
class Prepared:
    fmodel: Any
    train: tuple[torch.Tensor, ...]
    names: list[str]
    batched: Callable[..., torch.Tensor]  # (train, *batch) -> [B]
    batch: Batch


def build(case: Case, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = case.model()
    return model.double().eval()


def prepare(case: Case, b: int, model: nn.Module | None = None, seed: int = 0) -> Prepared:
    """The float64 model, its trainable parameters and the batched loss over them."""
    model = build(case, seed) if model is None else model
    if case.trainable is not None:  # freeze the rest: only the trainable subset is differentiated
        for n, p in model.named_parameters():
            p.requires_grad_(case.trainable(n))
    fmodel, params = make_functional(model, trainable_only=True)
    gen = torch.Generator().manual_seed(1000 * seed + b)
    batch = tuple(t.double() if t.is_floating_point() else t for t in case.batch(b, gen))

    def batched(train: Any, *xs: torch.Tensor) -> torch.Tensor:
        return case.loss(fmodel, tuple(train), *xs)

    return Prepared(fmodel, tuple(params), list(fmodel.param_names), batched, batch)


def per_example_grads(batched: Callable[..., torch.Tensor], train: tuple[torch.Tensor, ...],
                      batch: Batch) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    """Each example run alone (batch size 1), one ``torch.autograd.grad`` per example:
    its gradient (a list aligned with ``train``) and its norm, float64."""
    grads_of, norms = [], []
    for i in range(batch[0].shape[0]):
        ps = [p.detach().requires_grad_(True) for p in train]
        loss = batched(ps, *(x[i : i + 1] for x in batch))
        assert loss.shape == (1,), loss.shape
        grads = torch.autograd.grad(loss[0], ps, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(train, grads)]
        grads_of.append(grads)
        norms.append(float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads))))
    return grads_of, torch.tensor(norms, dtype=torch.float64)


def clipped_sum(grads_of: list[list[torch.Tensor]], norms: torch.Tensor, c: float) -> list[torch.Tensor]:
    """``sum_i min(1, c / ||g_i||) g_i``."""
    sums = [torch.zeros_like(g) for g in grads_of[0]]
    for grads, n in zip(grads_of, norms.tolist()):
        w = 1.0 if n <= c else c / n
        for s, g in zip(sums, grads):
            s += w * g
    return sums


def reference(batched: Callable[..., torch.Tensor], train: tuple[torch.Tensor, ...], batch: Batch,
              c: float) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Clipped sum and per-example norms from the per-example loop."""
    grads_of, norms = per_example_grads(batched, train, batch)
    return clipped_sum(grads_of, norms, c), norms


def clip_norm_between(norms: torch.Tensor) -> float:
    """A clipping norm with about half the examples above it and half below (strictly)."""
    s = norms.sort().values
    if s.numel() == 1:
        return float(s[0]) / 2
    k = s.numel() // 2
    assert float(s[k]) > float(s[k - 1]), "two examples with equal norms: pick another seed"
    return float(math.sqrt(float(s[k - 1]) * float(s[k])))


class VmapCounter:
    """Counts ``torch.func.vmap`` / ``torch.vmap`` calls (the exact fallbacks are built on vmap)."""

    def __init__(self) -> None:
        self.calls = 0
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> VmapCounter:
        import torch.func

        for owner, attr in ((torch.func, "vmap"), (torch, "vmap")):
            original = getattr(owner, attr)

            def counted(*a: Any, _original: Any = original, **k: Any) -> Any:
                self.calls += 1
                return _original(*a, **k)

            self._saved.append((owner, attr, original))
            setattr(owner, attr, counted)
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, attr, original in reversed(self._saved):
            setattr(owner, attr, original)
        self._saved = []


@dataclass
class Run:
    out: Any
    aux: Any
    warnings: list[str]
    vmap_calls: int


def run_backend(backend: str, prep: Prepared, c: float, *, error_on_slow: bool = False) -> Run:
    """``clipped_grad`` with ``backend`` on the prepared case. ``error_on_slow``: a
    ``SlowPathWarning`` is raised as an error (the fast path is asserted)."""
    nb = len(prep.batch)
    argnums = tuple(range(1, nb + 1))
    if backend == "vmap":
        per_example = lambda p, *xs: prep.batched(p, *(x.unsqueeze(0) for x in xs))[0]  # noqa: E731
        fn, state = clipped_grad(per_example, clipping_norm=c, batch_argnums=argnums, return_aux=True)
    else:
        fn, state = clipped_grad(prep.batched, clipping_norm=c, batch_argnums=argnums, return_aux=True,
                                 clip_backend=backend, model=prep.fmodel)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if error_on_slow:
            warnings.simplefilter("error", SlowPathWarning)
        with VmapCounter() as counter:
            (out, aux), _ = fn(prep.train, *prep.batch, state=state)
    slow = [str(w.message) for w in caught if issubclass(w.category, SlowPathWarning)]
    return Run(out, aux, slow, counter.calls)


def compare(prep: Prepared, run: Run, want: list[torch.Tensor], norms: torch.Tensor, rtol: float = 1e-10) -> None:
    """The backend's clipped sum and norms against the per-example loop, to ``rtol``.

    Each leaf is compared relative to the largest entry of the whole reference sum (some
    leaves are exactly zero in exact arithmetic, e.g. an attention key bias)."""
    scale = max(float(w.abs().max()) for w in want)
    assert scale > 0
    errors = []
    for name, got, ref in zip(prep.names, run.out.pytree, want):
        assert got.shape == ref.shape, (name, got.shape, ref.shape)
        err = float((got.double() - ref).abs().max())
        if not err <= rtol * scale:
            errors.append((name, err / scale))
    assert not errors, f"clipped sum differs (leaf, error / largest entry): {sorted(errors, key=lambda e: -e[1])[:6]}"
    got_norms = run.aux.grad_norms.double()
    rel = ((got_norms - norms).abs() / norms.clamp_min(1e-300)).tolist()
    assert max(rel) <= rtol, f"per-example norms differ: got {got_norms.tolist()}, want {norms.tolist()} (rel {rel})"
