"""DP fine-tuning of LoRA adapters on a Hugging Face GPT-2 with ``DPTrainer``.

The usual recipe of private language-model fine-tuning, at a size that runs in about a
minute on two CPU cores and with data the script generates (nothing is downloaded):

1. "Pre-train" a tiny GPT-2 (built from a config) without privacy on PUBLIC text: token
   sequences from a random Markov chain P, with Hugging Face's own ``Trainer``.
2. Fine-tune LoRA adapters (peft, rank 8 on the attention and MLP projections) on PRIVATE
   text from another chain Q with ``opake_fx.transformers.DPTrainer``: the same script as
   step 1 with the DP fields added to the arguments. Poisson sampling, per-example
   clipping by the ``"auto"`` backend, Gaussian noise calibrated for (epsilon, delta),
   AdamW, an accountant; only the adapters are clipped, noised and released, the base
   model stays frozen.
3. Report the per-token loss on held-out private text before and after, against Q's
   entropy rate (the best any model can do).

    python examples/hf_lora.py                   # epsilon 8, delta 1e-5
    python examples/hf_lora.py --epsilon 2 --epochs 5

Needs the ``hf`` extra (``pip install -e ".[hf]"``: transformers and peft).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import tempfile
import time

import torch
import torch.nn.functional as F

VOCAB, SEQ = 32, 24


def markov_chain(seed: int, sharpness: float = 4.0) -> torch.Tensor:
    """A random transition matrix ``[VOCAB, VOCAB]`` with a few likely successors per token."""
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(sharpness * torch.randn(VOCAB, VOCAB, generator=g), dim=1)


def sample_sequences(chain: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.empty(n, SEQ, dtype=torch.int64)
    ids[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
    for t in range(1, SEQ):
        ids[:, t] = torch.multinomial(chain[ids[:, t - 1]], 1, generator=g).squeeze(1)
    return ids


def entropy_rate(chain: torch.Tensor) -> float:
    """Per-token entropy (nats) under the chain's stationary distribution: the loss floor."""
    evals, evecs = torch.linalg.eig(chain.double().T)
    pi = evecs[:, torch.argmin((evals - 1).abs())].real
    pi = pi / pi.sum()
    return float(-(pi[:, None] * chain.double() * chain.double().log()).sum())


def build_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def as_dataset(ids: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": row, "labels": row} for row in ids]


def per_token_loss(model, ids: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        return float(F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:]))


def train(trainer_cls, args_cls, model, data, out_dir: str, **fields):
    """The one training function of both phases: a plain Hugging Face Trainer call."""
    args = args_cls(output_dir=out_dir, report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=True,
                    logging_steps=10, **fields)
    trainer = trainer_cls(model=model, args=args, train_dataset=data)
    with contextlib.redirect_stdout(io.StringIO()):  # Hugging Face prints its logs
        return trainer.train()


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--epochs", type=float, default=10.0, help="expected passes over the private data")
    parser.add_argument("--batch-size", type=int, default=256, help="expected batch size")
    parser.add_argument("--private-examples", type=int, default=4000)
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate for the adapters")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    import transformers
    from peft import LoraConfig, get_peft_model

    import opake_fx.transformers as dp

    public_chain, private_chain = markov_chain(1), markov_chain(2)
    public = sample_sequences(public_chain, 8000, seed=3)
    private = sample_sequences(private_chain, args.private_examples, seed=4)
    private_test = sample_sequences(private_chain, 1000, seed=5)
    floor = entropy_rate(private_chain)
    out = tempfile.mkdtemp(prefix="hf_lora_")

    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    base = build_gpt2()
    train(transformers.Trainer, transformers.TrainingArguments, base, as_dataset(public), out + "/public",
          per_device_train_batch_size=64, max_steps=args.pretrain_steps, learning_rate=3e-3, seed=args.seed)
    print(f"[public] pre-trained {args.pretrain_steps} steps in {time.perf_counter() - t0:.1f}s")

    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True)
    model = get_peft_model(base, lora)
    n_adapter = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_total = sum(p.numel() for p in model.parameters())
    before = per_token_loss(model, private_test)

    t0 = time.perf_counter()
    result = train(dp.DPTrainer, dp.TrainingArguments, model, as_dataset(private), out + "/private",
                   per_device_train_batch_size=args.batch_size, num_train_epochs=args.epochs, learning_rate=args.lr,
                   lr_scheduler_type="constant", seed=args.seed,
                   # the DP fields: everything else is the script of the public phase
                   privacy_target_epsilon=args.epsilon, privacy_target_delta=args.delta, clipping_norm=args.clip)
    m = result.metrics
    print(f"[dp] {n_adapter} adapter parameters of {n_total}; {result.global_step} steps, noise multiplier "
          f"{m['privacy_noise_multiplier']:.3f} for (epsilon={args.epsilon}, delta={args.delta}), "
          f"{time.perf_counter() - t0:.1f}s; epsilon spent {m['privacy_epsilon']:.3f}")
    after = per_token_loss(model, private_test)
    print()
    print(f"private test loss per token: pre-trained {before:.3f} -> DP LoRA {after:.3f} "
          f"(entropy rate of the private chain: {floor:.3f}; uniform guess: {math.log(VOCAB):.3f})")
    merged = model.merge_and_unload()  # the merged-weight export: a plain GPT-2 with the adapters folded in
    assert abs(per_token_loss(merged, private_test) - after) < 1e-4
    return {"before": before, "after": after, "floor": floor, "epsilon": m["privacy_epsilon"]}


if __name__ == "__main__":
    main()
