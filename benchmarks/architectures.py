"""Benchmark: the fast clipping backend on architectures users bring, against non-private.

``benchmarks/clipping.py`` times hand-built workloads against Opacus; this script times
the modules that take their own rules beyond Linear/conv/embedding/norm layers:

* ``torch-encoder`` — ``nn.TransformerEncoder`` of 2 ``nn.TransformerEncoderLayer``
  (d 128, 4 heads, FF 512, ``batch_first=True``, default dropout 0.1, training mode) with a
  causal mask, token embedding and LM head (vocab 1000): the ``nn.MultiheadAttention``
  self-attention rule, attention dropout included.
* ``gpt2-full`` — Hugging Face GPT-2 (2 layers, d 128, 4 heads, vocab 5000, tied input
  embedding and LM head), every parameter trained: the ``Conv1D`` rule and the tied
  embedding / head cross terms.
* ``gpt2-lora`` — the same GPT-2 with peft LoRA adapters (rank 8 on ``c_attn``,
  ``c_proj``, ``c_fc``), only the adapters trained.
* ``bert-cls`` — Hugging Face BERT (2 layers, d 128, 4 heads) sequence classifier.
* ``gpt-neox``, ``llama`` — Hugging Face GPT-NeoX (``nn.LayerNorm``, rotary on a quarter of
  each head, untied head) and Llama (``LlamaRMSNorm``, SwiGLU, rotary, untied head) causal
  LMs of the same size (2 layers, d 128, 4 heads, MLP width 512, vocab 5000): Llama's
  RMSNorm takes the norm-like rule (a module recognised by what it computes), so the two
  should cost the same.
* ``t5`` — Hugging Face T5 encoder-decoder (2 + 2 layers, d 128, 4 heads of 32, FF 512,
  vocab 5000, dropout 0.1 in training mode) on 64 source and 64 target tokens:
  ``T5LayerNorm`` takes the norm-like rule; the relative-attention bias tables are looked up
  with ``[T, T]`` bucket tensors (no batch axis) and take the exact whole-loss fallback.

Issue 29's architectures, the same size (2 layers, d 128, 4 heads, MLP 512, vocab 5000, the
models' default dropout in training mode); what one ``clip_backend="auto"`` step warns
(``SlowPathWarning``) is recorded with each (none, as of the library this was written against):

* ``opt`` — OPT causal LM (tied head), called without an attention mask: OPT builds an
  all-ones one and takes its positions from its cumulative sum; the decoder layers flatten
  to ``[B * T, d]`` before ``fc1``/``fc2``, rows the Linear/LayerNorm rules read as
  ``[B, T, d]``. No warning.
* ``gemma`` — Gemma causal LM (``(1 + w)`` RMSNorm, head_dim 32, 4 key/value heads, tied
  head): the norm-like rule, the lookup rule for its scaled embedding, the tied cross
  terms. No warning.
* ``falcon`` — Falcon-7B-style (multi-query, parallel attention, no biases, rotary): its
  ``FalconLinear`` (``input @ weight.T`` in its own forward) takes the inline-Linear rule.
  No warning.
* ``distilbert`` — DistilBERT classifier (4 labels) called without ``position_ids``: the
  position table is looked up on ``[1, T]`` and added to the batch (the shared-tensor
  rule). No warning.
* ``deberta-v2`` — DeBERTa-v2 classifier (relative attention, 32 buckets, p2c + c2p, no
  absolute positions, no token types): the relative table meets the batch through
  ``repeat(B, 1, 1)`` + ``bmm`` (the shared-tensor rule's repeat site). No warning.
* ``bart`` — BART encoder-decoder (2 + 2 layers) on 64 source and 64 target tokens: learned
  positions looked up on ``[T]`` (shared calls). No warning.
* ``gpt2-default-positions`` — ``gpt2-full`` called without ``position_ids`` (``wpe`` on
  ``[1, T]``, the shared-tensor rule). No warning.
* ``bigru`` — torch-native: embedding, 2-layer bidirectional batch-first ``nn.GRU``
  (128 -> 128), linear head (4 classes) on the mean over time: the recurrent rule (the GRU
  recomputed step by step, its weights tapped as Linears). No warning.
* ``convnext`` — torch-native ConvNeXt-style on 32 x 32 images (4 x 4 stride-4 stem to 64
  channels, 2 blocks of depthwise 7 x 7 conv, channels-last LayerNorm, MLP 64 -> 256 -> 64,
  layer scale ``gamma * y`` in the block's forward, residual; 10 classes): the depthwise
  conv rule and the elementwise rule for ``gamma``. No warning.

All at batch 16 (of 64 tokens for text), 2 threads. Variants: ``non-private`` (mean loss, backward,
SGD), ``floor`` (the same step plus one in-line draw of as many normals as there are
trained parameters with opake_fx's keyed generator: the least any DP step costs),
``opake-auto`` and ``opake-vmap`` (``clipped_grad`` with C = 1, ``gaussian_noise``,
in-place SGD); with ``--compiled`` also ``opake-auto-compiled`` and ``opake-vmap-compiled``
(``opake_fx.compiled.compile_step`` on ``chain(clip, noise, sgd)``; the compile time of
each is printed before the table). Times are printed as ``x non-private`` and ``x floor`` (Opacus is not run
here: its hooks have no per-sample rule for most of these modules). Timing is interleaved with one untimed settle step per turn (medians);
memory is the peak RSS growth of 2 steps after setup, in a fresh process per variant.
HF workloads need the ``hf`` extra and are skipped without it.

With ``--quick``, an issue-29 workload whose 7 rounds would take over 30 s (a loaded
machine, a slow fallback) gets fewer, at least one, noted under the table.

    python benchmarks/architectures.py --quick       # about 7.5 minutes on 2 cores
    python benchmarks/architectures.py --quick --compiled   # + the compiled steps
    python benchmarks/architectures.py --breaks     # graphs and graph breaks of the compiled auto step

``--breaks`` times nothing: for each workload it prints what ``torch.compile`` makes of the
compiled ``auto`` step (``CompiledStep.explain``: graphs, graph breaks and their reasons).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opake_fx import profiling  # noqa: E402
from opake_fx.dpsgd.clipping import clipped_grad  # noqa: E402
from opake_fx.dpsgd.noise import gaussian_noise  # noqa: E402
from opake_fx.functional import make_functional  # noqa: E402
from opake_fx.random import flat_tree_normal, fold_in, key  # noqa: E402

B, T, D, HEADS, LR = 16, 64, 128, 4, 0.05
WORKLOADS = ["torch-encoder", "gpt2-full", "gpt2-lora", "bert-cls", "gpt-neox", "llama", "t5",
             # issue 29's architectures
             "opt", "gemma", "falcon", "distilbert", "deberta-v2", "bart", "gpt2-default-positions", "bigru", "convnext"]
TORCH_NATIVE = ("torch-encoder", "bigru", "convnext")
ISSUE_29 = WORKLOADS[7:]
QUICK_BUDGET_S = 30.0  # --quick: timed seconds per issue-29 workload, the rounds are capped to fit
VARIANTS = ["non-private", "floor", "opake-auto", "opake-vmap"]
COMPILED = ["opake-auto-compiled", "opake-vmap-compiled"]  # with --compiled
COMPILE_S: dict[str, float] = {}  # variant -> seconds of its compiling first steps (the last workload built)


class TorchEncoderLM(nn.Module):
    def __init__(self, vocab: int = 1000) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, D)
        layer = nn.TransformerEncoderLayer(D, HEADS, 512, batch_first=True)  # dropout 0.1
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(D, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        return self.head(self.enc(self.emb(ids), mask=mask, is_causal=True))


class BiGRU(nn.Module):
    """Token embedding, a 2-layer bidirectional batch-first GRU, a head on the mean over time."""

    def __init__(self, vocab: int = 5000, classes: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, D)
        self.rnn = nn.GRU(D, D, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * D, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.emb(ids))
        return self.head(out.mean(1))


class ConvNeXtBlock(nn.Module):
    """Depthwise 7x7 conv, channels-last LayerNorm, pointwise MLP (x4), layer scale, residual."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c)
        self.pw1, self.pw2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
        self.gamma = nn.Parameter(torch.full((c,), 1e-1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pw2(F.gelu(self.pw1(self.norm(self.dw(x).permute(0, 2, 3, 1)))))
        return x + (self.gamma * y).permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    """A 4x4 stride-4 stem (3 -> 64 channels), 2 ConvNeXt blocks, global mean, a linear head."""

    def __init__(self, c: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 4, stride=4)
        self.blocks = nn.Sequential(ConvNeXtBlock(c), ConvNeXtBlock(c))
        self.head = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def build(workload: str) -> tuple[nn.Module, Callable[[Any, Any, torch.Tensor, torch.Tensor], torch.Tensor],
                                   torch.Tensor, torch.Tensor, Callable[[str], bool]]:
    """Model, per-example losses ``(fmodel, params, x, y) -> [B]``, data, and which parameters train."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    everything: Callable[[str], bool] = lambda name: True  # noqa: E731
    if workload == "torch-encoder":
        ids = torch.randint(0, 1000, (B, T + 1), generator=g)

        def lm(fmodel: Any, p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(fmodel(p, x).transpose(1, 2), y, reduction="none").mean(1)

        return TorchEncoderLM().train(), lm, ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), everything
    if workload in ("bigru", "convnext"):
        if workload == "bigru":
            model, x = BiGRU(), torch.randint(0, 5000, (B, T), generator=g)
            labels = torch.randint(0, 4, (B,), generator=g)
        else:
            model, x = ConvNeXt(), torch.randn(B, 3, 32, 32, generator=g)
            labels = torch.randint(0, 10, (B,), generator=g)

        def native(fmodel: Any, p: Any, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(fmodel(p, xb), yb, reduction="none")

        return model.train(), native, x, labels, everything
    import transformers  # the hf extra

    transformers.utils.logging.set_verbosity_error()
    positions = torch.arange(T).expand(B, T)
    if workload in ("gpt2-full", "gpt2-lora", "gpt2-default-positions"):
        config = transformers.GPT2Config(vocab_size=5000, n_positions=T, n_embd=D, n_layer=2, n_head=HEADS,
                                         bos_token_id=0, eos_token_id=0)
        model: nn.Module = transformers.GPT2LMHeadModel(config)
        trains = everything
        if workload == "gpt2-lora":
            import peft

            lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True)
            model = peft.get_peft_model(model, lora)
            trains = lambda name: "lora_" in name  # noqa: E731
        ids = torch.randint(0, 5000, (B, T), generator=g)

        default_positions = workload == "gpt2-default-positions"  # GPT-2 looks positions up on [1, T]

        def causal(fmodel: Any, p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            pos = {} if default_positions else {"position_ids": positions[: x.shape[0]]}
            logits = fmodel(p, input_ids=x, **pos).logits
            return F.cross_entropy(logits[:, :-1].transpose(1, 2), y[:, 1:], reduction="none").mean(1)

        return model.train(), causal, ids, ids, trains
    if workload == "bert-cls":
        config = transformers.BertConfig(vocab_size=5000, hidden_size=D, num_hidden_layers=2, num_attention_heads=HEADS,
                                         intermediate_size=512, max_position_embeddings=T, num_labels=4)
        ids, labels = torch.randint(0, 5000, (B, T), generator=g), torch.randint(0, 4, (B,), generator=g)

        def classify(fmodel: Any, p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = fmodel(p, input_ids=x, position_ids=positions[: x.shape[0]]).logits
            return F.cross_entropy(logits, y, reduction="none")

        return transformers.BertForSequenceClassification(config).train(), classify, ids, labels, everything
    if workload in ("gpt-neox", "llama", "gemma", "falcon", "opt"):
        common = dict(vocab_size=5000, hidden_size=D, num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=512,
                      max_position_embeddings=T, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False, use_cache=False)
        if workload == "llama":
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=HEADS, **common))
        elif workload == "gemma":  # Gemma's own default: input embedding and LM head tied
            model = transformers.GemmaForCausalLM(transformers.GemmaConfig(
                num_key_value_heads=HEADS, head_dim=D // HEADS, **{**common, "tie_word_embeddings": True}))
        elif workload == "falcon":  # MLP width 4 d = 512 (Falcon's own)
            model = transformers.FalconForCausalLM(transformers.FalconConfig(
                vocab_size=5000, hidden_size=D, num_hidden_layers=2, num_attention_heads=HEADS,
                new_decoder_architecture=False, multi_query=True, alibi=False, parallel_attn=True, bias=False,
                bos_token_id=0, eos_token_id=0, use_cache=False))
        elif workload == "opt":  # OPT's own default: input embedding and LM head tied
            model = transformers.OPTForCausalLM(transformers.OPTConfig(
                vocab_size=5000, hidden_size=D, num_hidden_layers=2, num_attention_heads=HEADS, ffn_dim=512,
                word_embed_proj_dim=D, max_position_embeddings=T, pad_token_id=1, bos_token_id=0, eos_token_id=0,
                use_cache=False))
        else:
            model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**common))
        ids = torch.randint(2, 5000, (B, T), generator=g)
        # OPT derives its positions from the attention mask (cumsum); it is called without one, as
        # the other workloads are, so it builds the all-ones mask itself.
        pos_kw = workload != "opt"

        def causal_lm(fmodel: Any, p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            pos = {"position_ids": positions[: x.shape[0]]} if pos_kw else {}
            logits = fmodel(p, input_ids=x, **pos).logits
            return F.cross_entropy(logits[:, :-1].transpose(1, 2), y[:, 1:], reduction="none").mean(1)

        return model.train(), causal_lm, ids, ids, everything
    if workload == "t5":
        config = transformers.T5Config(vocab_size=5000, d_model=D, d_kv=D // HEADS, d_ff=512, num_layers=2,
                                       num_decoder_layers=2, num_heads=HEADS, feed_forward_proj="relu",
                                       decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, use_cache=False)
        src, tgt = torch.randint(2, 5000, (B, T), generator=g), torch.randint(2, 5000, (B, T), generator=g)

        def seq2seq(fmodel: Any, p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            dec_in = torch.cat([torch.zeros_like(y[:, :1]), y[:, :-1]], dim=1)  # T5's _shift_right
            logits = fmodel(p, input_ids=x, decoder_input_ids=dec_in).logits
            return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(1)

        return transformers.T5ForConditionalGeneration(config).train(), seq2seq, src, tgt, everything
    if workload in ("distilbert", "deberta-v2"):
        if workload == "distilbert":
            config = transformers.DistilBertConfig(vocab_size=5000, dim=D, n_layers=2, n_heads=HEADS, hidden_dim=512,
                                                   max_position_embeddings=T, num_labels=4, pad_token_id=0)
            model = transformers.DistilBertForSequenceClassification(config)
        else:
            config = transformers.DebertaV2Config(
                vocab_size=5000, hidden_size=D, num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=512,
                max_position_embeddings=T, relative_attention=True, position_buckets=32, pos_att_type=["p2c", "c2p"],
                max_relative_positions=64, position_biased_input=False, type_vocab_size=0, num_labels=4, pad_token_id=0)
            model = transformers.DebertaV2ForSequenceClassification(config)
        ids, labels = torch.randint(1, 5000, (B, T), generator=g), torch.randint(0, 4, (B,), generator=g)

        def classify_own_positions(fmodel: Any, p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(fmodel(p, input_ids=x).logits, y, reduction="none")  # no position_ids

        return model.train(), classify_own_positions, ids, labels, everything
    if workload == "bart":
        config = transformers.BartConfig(vocab_size=5000, d_model=D, encoder_layers=2, decoder_layers=2,
                                         encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=512,
                                         decoder_ffn_dim=512, max_position_embeddings=T, pad_token_id=1, bos_token_id=0,
                                         eos_token_id=2, decoder_start_token_id=2, use_cache=False)
        src, tgt = torch.randint(3, 5000, (B, T), generator=g), torch.randint(3, 5000, (B, T), generator=g)

        def bart_seq2seq(fmodel: Any, p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            dec_in = torch.cat([torch.full_like(y[:, :1], 2), y[:, :-1]], dim=1)  # BART's shift_tokens_right
            logits = fmodel(p, input_ids=x, decoder_input_ids=dec_in).logits
            return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(1)

        return transformers.BartForConditionalGeneration(config).train(), bart_seq2seq, src, tgt, everything
    raise ValueError(f"unknown workload {workload!r}")


def setup_step(workload: str, variant: str, threads: int = 2) -> Callable[[], None]:
    """One full step of ``variant`` on ``workload`` (built fresh), as a zero-argument callable."""
    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore")
    model, losses, x, y, trains = build(workload)
    for name, p in model.named_parameters():
        p.requires_grad_(trains(name))
    # Only the trained parameters are in ``train``; the frozen ones are constants of ``fmodel``.
    fmodel, params = make_functional(model, trainable_only=True)
    train = list(params)
    if variant in ("non-private", "floor"):
        leaves = [t.clone().requires_grad_(True) for t in train]
        opt = torch.optim.SGD(leaves, lr=LR)
        like = [t.detach() for t in leaves]
        floor_step = [0]

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            losses(fmodel, tuple(leaves), x, y).mean().backward()
            opt.step()
            if variant == "floor":  # the noise any DP step must draw, in line, by our generator
                flat_tree_normal(fold_in(key(0), floor_step[0]), like)
                floor_step[0] += 1

        return step
    if variant in ("opake-auto-compiled", "opake-vmap-compiled"):
        return _compiled_step(variant, fmodel, losses, train, x, y)
    if variant == "opake-auto":
        batched = lambda tr, xb, yb: losses(fmodel, tr, xb, yb)  # noqa: E731
        grad_fn, cstate = clipped_grad(batched, clipping_norm=1.0, batch_argnums=(1, 2), normalize_by=B,
                                       clip_backend="auto", model=fmodel)
    elif variant == "opake-vmap":
        single = lambda tr, xi, yi: losses(fmodel, tr, xi[None], yi[None])[0]  # noqa: E731
        grad_fn, cstate = clipped_grad(single, clipping_norm=1.0, batch_argnums=(1, 2), normalize_by=B)
    else:
        raise ValueError(f"unknown variant {variant!r}")
    noise_fn, nstate = gaussian_noise(noise_multiplier=1.0, key=key(0))
    state: dict[str, Any] = {"clip": cstate, "noise": nstate}

    def dp_step() -> None:
        clipped, state["clip"] = grad_fn(tuple(train), x, y, state=state["clip"])
        noised, state["noise"] = noise_fn(clipped, state["noise"])
        torch._foreach_add_(train, list(noised.pytree), alpha=-LR)

    return dp_step


def _compiled_step(variant: str, fmodel: Any, losses: Any, train: list[torch.Tensor], x: Any, y: Any) -> Callable[[], None]:
    """The DP step of ``opake_fx.compiled.compile_step`` (clip, noise, SGD), compiled by its first two calls."""
    from opake_fx.compiled import compile_step
    from opake_fx.dpsgd import clip, noise
    from opake_fx.optimizers import sgd
    from opake_fx.transforms import chain

    if variant == "opake-auto-compiled":
        batched = lambda tr, xb, yb: losses(fmodel, tr, xb, yb)  # noqa: E731
        stage = clip(batched, clipping_norm=1.0, batch_argnums=(1, 2), normalize_by=B, clip_backend="auto", model=fmodel)
    else:
        single = lambda tr, xi, yi: losses(fmodel, tr, xi[None], yi[None])[0]  # noqa: E731
        stage = clip(single, clipping_norm=1.0, batch_argnums=(1, 2), normalize_by=B)
    compiled = compile_step(chain(stage, noise(noise_multiplier=1.0, key=key(0)), sgd(LR)))
    state: dict[str, Any] = {"params": tuple(train), "state": compiled.init(tuple(train))}

    def step() -> None:
        state["params"], state["state"] = compiled(state["params"], state["state"], (x, y))

    t0 = time.perf_counter()
    step(), step()  # compiles (the second call once more, with symbolic counters)
    COMPILE_S[variant] = time.perf_counter() - t0
    return step


def graph_breaks(workload: str) -> tuple[int, int, list[str]]:
    """``(graphs, breaks, reasons)`` of the compiled ``auto`` step on ``workload`` (``CompiledStep.explain``)."""
    from opake_fx.compiled import compile_step
    from opake_fx.dpsgd import clip, noise
    from opake_fx.optimizers import sgd
    from opake_fx.transforms import chain

    torch.set_num_threads(2)
    warnings.filterwarnings("ignore")
    model, losses, x, y, trains = build(workload)
    for name, p in model.named_parameters():
        p.requires_grad_(trains(name))
    fmodel, params = make_functional(model, trainable_only=True)
    batched = lambda tr, xb, yb: losses(fmodel, tr, xb, yb)  # noqa: E731
    stage = clip(batched, clipping_norm=1.0, batch_argnums=(1, 2), normalize_by=B, clip_backend="auto", model=fmodel)
    step = compile_step(chain(stage, noise(noise_multiplier=1.0, key=key(0)), sgd(LR)))
    train = tuple(params)
    report = step.explain(train, step.init(train), (x, y))
    return report.graph_count, report.graph_break_count, [str(r.reason).splitlines()[0][:100] for r in report.break_reasons]


def available(workload: str) -> bool:
    if workload in TORCH_NATIVE:
        return True
    try:
        import transformers  # noqa: F401

        if workload == "gpt2-lora":
            import peft  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"7 rounds per workload (default 15); issue 29's workloads: fewer where 7 take over {QUICK_BUDGET_S:.0f} s")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--compiled", action="store_true",
                    help=f"add the compiled steps ({', '.join(COMPILED)}; compile times printed per workload)")
    ap.add_argument("--breaks", action="store_true",
                    help="time nothing: print the graphs and graph breaks of each workload's compiled auto step")
    args = ap.parse_args()
    torch.set_num_threads(2)
    if args.breaks:
        print("| workload | graphs | graph breaks | reasons |\n|---|---:|---:|---|")
        for w in [w for w in args.workloads.split(",") if w and available(w)]:
            graphs, breaks, reasons = graph_breaks(w)
            print(f"| {w} | {graphs} | {breaks} | {'; '.join(reasons) or '-'} |", flush=True)
        return
    rounds = 7 if args.quick else 15
    variants = [v for v in args.variants.split(",") if v] + (COMPILED if args.compiled else [])
    rows = ["| workload | variant | step (ms) | x non-private | x floor | peak RSS growth (MiB) | memory / non-private |",
            "|---|---|---:|---:|---:|---:|---:|"]
    reduced: list[str] = []
    t0 = time.perf_counter()
    for w in [w for w in args.workloads.split(",") if w]:
        if not available(w):
            print(f"# {w}: skipped (needs the hf extra)", file=sys.stderr)
            continue
        COMPILE_S.clear()
        steps = {v: setup_step(w, v) for v in variants}
        if COMPILE_S:
            print(f"# {w}: compile " + ", ".join(f"{v} {t:.1f} s" for v, t in COMPILE_S.items()), file=sys.stderr)
        if args.quick and w in ISSUE_29:
            timings, r, settle = _time_within(steps, rounds, QUICK_BUDGET_S)
            if r < rounds:
                reduced.append(f"{w} {r} round(s), settle {settle}")
        else:
            timings = profiling.time_interleaved(steps, warmup=2, repeats=rounds, settle=1)
        del steps
        mems = {}
        for v in variants if not args.no_memory else []:
            r = profiling.peak_rss_in_subprocess(f"{Path(__file__).resolve()}:setup_step", {"workload": w, "variant": v},
                                                 steps=2, env={"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "2"})
            mems[v] = r["delta"] / 2**20
        base_t = timings["non-private"].median if "non-private" in timings else math.nan
        floor_t = timings["floor"].median if "floor" in timings else math.nan
        base_m = mems.get("non-private", math.nan)
        for v in variants:
            m = mems.get(v, math.nan)
            rows.append(f"| {w} | {v} | {1e3 * timings[v].median:.1f} | {timings[v].median / base_t:.2f}x | "
                        f"{timings[v].median / floor_t:.2f}x | {m:.1f} | {m / base_m if base_m else math.nan:.2f}x |")
        print(f"# {w}: {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    print(f"torch {torch.__version__}, 2 threads, batch {B} x {T} tokens, {rounds} interleaved rounds (medians), "
          f"settle 1; {time.perf_counter() - t0:.0f}s\n")
    print("\n".join(rows))
    if reduced:
        print(f"\n--quick: fewer rounds where {rounds} would take over {QUICK_BUDGET_S:.0f} s: " + "; ".join(reduced))


def _time_within(steps: dict[str, Callable[[], None]], rounds: int, budget_s: float) -> tuple[dict[str, Any], int, int]:
    """``time_interleaved`` with at most ``rounds`` rounds, fewer where they would take over ``budget_s``.

    The two warm-up turns are made here, the second timed to size the rounds; a workload
    whose slowest step takes over a second gets no settle call (a settle absorbs cache and
    allocator effects of the previous variant, small next to such a step)."""
    last: dict[str, float] = {}
    for _ in range(2):
        for v, fn in steps.items():
            t = time.perf_counter()
            fn()
            last[v] = time.perf_counter() - t
    settle = 0 if max(last.values()) > 1.0 else 1
    r = max(1, min(rounds, int(budget_s // ((settle + 1) * sum(last.values())))))
    return profiling.time_interleaved(steps, warmup=0, repeats=r, settle=settle), r, settle


if __name__ == "__main__":
    main()
