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

All at batch 16 of 64 tokens, 2 threads. Variants: ``non-private`` (mean loss, backward,
SGD), ``floor`` (the same step plus one in-line draw of as many normals as there are
trained parameters with opake_fx's keyed generator: the least any DP step costs),
``opake-auto`` and ``opake-vmap`` (``clipped_grad`` with C = 1, ``gaussian_noise``,
in-place SGD); with ``--compiled`` also ``opake-auto-compiled`` and ``opake-vmap-compiled``
(``opake_fx.compiled.compile_step`` on ``chain(clip, noise, sgd)``; the compile time of
each is printed before the table). Times are printed as ``x non-private`` and ``x floor`` (Opacus is not run
here: its hooks have no per-sample rule for most of these modules). Timing is interleaved with one untimed settle step per turn (medians);
memory is the peak RSS growth of 2 steps after setup, in a fresh process per variant.
HF workloads need the ``hf`` extra and are skipped without it.

    python benchmarks/architectures.py --quick       # about 2.5 minutes on 2 cores
    python benchmarks/architectures.py --quick --compiled   # + the compiled steps
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
WORKLOADS = ["torch-encoder", "gpt2-full", "gpt2-lora", "bert-cls", "gpt-neox", "llama", "t5"]
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
    import transformers  # the hf extra

    transformers.utils.logging.set_verbosity_error()
    positions = torch.arange(T).expand(B, T)
    if workload in ("gpt2-full", "gpt2-lora"):
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

        def causal(fmodel: Any, p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = fmodel(p, input_ids=x, position_ids=positions[: x.shape[0]]).logits
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
    if workload in ("gpt-neox", "llama"):
        common = dict(vocab_size=5000, hidden_size=D, num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=512,
                      max_position_embeddings=T, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False, use_cache=False)
        if workload == "llama":
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=HEADS, **common))
        else:
            model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**common))
        ids = torch.randint(0, 5000, (B, T), generator=g)

        def causal_lm(fmodel: Any, p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = fmodel(p, input_ids=x, position_ids=positions[: x.shape[0]]).logits
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


def available(workload: str) -> bool:
    if workload == "torch-encoder":
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
    ap.add_argument("--quick", action="store_true", help="7 rounds per workload (default 15)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--compiled", action="store_true",
                    help=f"add the compiled steps ({', '.join(COMPILED)}; compile times printed per workload)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    rounds = 7 if args.quick else 15
    variants = [v for v in args.variants.split(",") if v] + (COMPILED if args.compiled else [])
    rows = ["| workload | variant | step (ms) | x non-private | x floor | peak RSS growth (MiB) | memory / non-private |",
            "|---|---|---:|---:|---:|---:|---:|"]
    t0 = time.perf_counter()
    for w in [w for w in args.workloads.split(",") if w]:
        if not available(w):
            print(f"# {w}: skipped (needs the hf extra)", file=sys.stderr)
            continue
        COMPILE_S.clear()
        steps = {v: setup_step(w, v) for v in variants}
        if COMPILE_S:
            print(f"# {w}: compile " + ", ".join(f"{v} {t:.1f} s" for v, t in COMPILE_S.items()), file=sys.stderr)
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


if __name__ == "__main__":
    main()
