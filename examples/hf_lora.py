"""DP fine-tuning of LoRA adapters on a Hugging Face GPT-2, with the fast clipping backend.

The usual recipe of private language-model fine-tuning, at a size that runs in about a
minute on two CPU cores and with data the script generates (nothing is downloaded):

1. "Pre-train" a tiny GPT-2 (built from a config) without privacy on PUBLIC text: token
   sequences from a random Markov chain P.
2. Fine-tune LoRA adapters (peft, rank 8 on the attention and MLP projections, which are
   Hugging Face ``Conv1D`` layers) on PRIVATE text from another chain Q with DP-SGD:
   Poisson sampling, per-example clipping by the ``"auto"`` backend (norms from layer
   activations; no per-example gradients), Gaussian noise, Adam; the noise multiplier is
   calibrated for (epsilon, delta) and an Accountant tracks the spend. The base model
   stays frozen and never enters the privacy computation.
3. Report the per-token loss on held-out private text before and after, against Q's
   entropy rate (the best any model can do).

    python examples/hf_lora.py                   # epsilon 8, delta 1e-5
    python examples/hf_lora.py --epsilon 2 --epochs 5

Needs the ``hf`` extra (``pip install -e ".[hf]"``: transformers and peft).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset, default_collate

import opake_fx.accounting as acc
import opake_fx.dpsgd.accounting as dpsgd_acc
from opake_fx.dpsgd import clip, noise
from opake_fx.dpsgd.sampling import PoissonSampler
from opake_fx.functional import empty_collate, make_functional
from opake_fx.optimizers import adam
from opake_fx.random import key
from opake_fx.transforms import apply_updates, named_chain

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


def token_losses(fmodel, params, ids: torch.Tensor) -> torch.Tensor:
    """Per-example mean next-token loss ``[B]``; positions carry the batch axis (see docs/clipping.md)."""
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    logits = fmodel(params, input_ids=ids, position_ids=positions).logits
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").mean(1)


def pretrain(model, public: torch.Tensor, steps: int, seed: int) -> None:
    """Non-private training on public data (plain PyTorch)."""
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    fmodel, _ = make_functional(model)
    for _ in range(steps):
        batch = public[torch.randint(0, len(public), (64,), generator=g)]
        opt.zero_grad()
        token_losses(fmodel, tuple(model.parameters()), batch).mean().backward()
        opt.step()


def evaluate(fmodel, params, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return float(token_losses(fmodel, params, ids).mean())


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--epochs", type=float, default=10.0, help="expected passes over the private data")
    parser.add_argument("--batch-size", type=int, default=256, help="expected batch size")
    parser.add_argument("--private-examples", type=int, default=4000)
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate for the adapters")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    from peft import LoraConfig, get_peft_model

    public_chain, private_chain = markov_chain(1), markov_chain(2)
    public = sample_sequences(public_chain, 8000, seed=3)
    private = sample_sequences(private_chain, args.private_examples, seed=4)
    private_test = sample_sequences(private_chain, 1000, seed=5)
    floor = entropy_rate(private_chain)

    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    base = build_gpt2()
    pretrain(base, public, args.pretrain_steps, args.seed)
    print(f"[public] pre-trained {args.pretrain_steps} steps in {time.perf_counter() - t0:.1f}s")

    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True)
    model = get_peft_model(base, lora)
    fmodel, params = make_functional(model)
    trainable = [i for i, name in enumerate(fmodel.param_names) if "lora_" in name]
    frozen = list(params)

    def with_adapters(adapters):
        full = list(frozen)
        for i, t in zip(trainable, adapters):
            full[i] = t
        return tuple(full)

    def loss_fn(adapters, ids):  # the whole batch: per-example losses [B]
        return token_losses(fmodel, with_adapters(adapters), ids)

    adapters = tuple(params[i] for i in trainable)
    n_adapter = sum(a.numel() for a in adapters)
    n_total = sum(p.numel() for p in params)
    before = evaluate(fmodel, params, private_test)

    n = len(private)
    q = args.batch_size / n
    steps = int(round(args.epochs / q))

    def per_step(nm: float) -> acc.DpProcess:
        return dpsgd_acc.poisson(dpsgd_acc.gaussian(nm), q)

    budget = acc.epsilon_budget(args.epsilon, delta=args.delta)
    nm = acc.calibrate(budget, lambda s: per_step(s) * steps, param_min=0.3, param_max=50.0).param
    print(f"[dp] {n_adapter} adapter parameters of {n_total}; {steps} steps at sample rate {q:.3f}, "
          f"noise multiplier {nm:.3f} for (epsilon={args.epsilon}, delta={args.delta})")

    pipeline = named_chain(
        ("clip", clip(loss_fn, clipping_norm=args.clip, batch_argnums=(1,), normalize_by=args.batch_size,
                      clip_backend="auto", model=fmodel)),
        ("noise", noise(noise_multiplier=nm, key=key(args.seed))),
        ("opt", adam(args.lr)),
    )
    state = pipeline.init(adapters)
    accountant = acc.Accountant(budget)
    step_cost = per_step(nm)
    sampler = PoissonSampler(TensorDataset(private), sample_rate=q, n_steps=steps, key=key(args.seed + 1))
    loader = DataLoader(TensorDataset(private), batch_sampler=sampler, collate_fn=empty_collate(default_collate))
    t0 = time.perf_counter()
    for step, (ids,) in enumerate(loader):
        if accountant.would_exceed(step_cost):
            print(f"[dp] stopping before step {step + 1}: it would exceed the privacy budget.")
            break
        updates, state = pipeline.update((ids,), state, adapters)
        adapters = apply_updates(adapters, updates)
        accountant |= step_cost
    spent = accountant.spent_epsilon(args.delta)
    after = evaluate(fmodel, with_adapters(adapters), private_test)
    print(f"[dp] {steps} steps in {time.perf_counter() - t0:.1f}s; epsilon spent {spent:.3f}")
    print()
    print(f"private test loss per token: pre-trained {before:.3f} -> DP LoRA {after:.3f} "
          f"(entropy rate of the private chain: {floor:.3f}; uniform guess: {math.log(VOCAB):.3f})")
    return {"before": before, "after": after, "floor": floor, "epsilon": spent}


if __name__ == "__main__":
    main()
