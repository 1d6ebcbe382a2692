"""DP fine-tuning of a tiny Llama sharded with FSDP2, under torchrun (issue 32).

    torchrun --nproc_per_node 2 examples/fsdp_llama.py                        # one node
    torchrun --nproc_per_node 2 examples/fsdp_llama.py --bf16 --checkpoint ckpt  # bf16 compute; resumable
    torchrun --nnodes 2 --nproc_per_node 1 --rdzv-backend c10d \\
             --rdzv-endpoint HOST:29500 --rdzv-id run1 examples/fsdp_llama.py  # on each of 2 nodes

Every decoder layer and the root are sharded with ``fully_shard``; the plan's pipeline
(``clip_backend="auto"``) gathers the parameters, clips each rank's examples, reduce-scatters
the clipped sums and noises each rank's rows of the unsharded noise (docs/sharded.md).
With ``--bf16`` the forward and backward run in bfloat16 (FSDP2's ``MixedPrecisionPolicy``);
the clipped sums, the noise and the parameters stay float32. With ``--checkpoint DIR`` the
run saves a sharded checkpoint after every step and, started again, resumes from it.
The model is built from a config (no weights are downloaded); the data are random token
sequences with a learnable rule (each token is the previous one plus one).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from opake_fx.distributed.fsdp import make_functional_fsdp
from opake_fx.optimizers import adam
from opake_fx.plan import DPPlan
from opake_fx.random import key
from opake_fx.transforms import apply_updates

VOCAB, T, N = 32, 12, 256


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bf16", action="store_true", help="compute in bfloat16 (float32 sums, noise, parameters)")
    parser.add_argument("--checkpoint", help="a directory: save after every step, resume from it if it exists")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial model on every rank
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T)
    config._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(config)
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if args.bf16 else None)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    fmodel, params = make_functional_fsdp(model)

    g = torch.Generator().manual_seed(1)  # the same data set on every rank; the sampler shards it
    start = torch.randint(0, VOCAB, (N, 1), generator=g)
    tokens = (start + torch.arange(T)) % VOCAB

    def loss(p, batch):  # per-example next-token loss [B]
        logits = fmodel(p, input_ids=batch).logits[:, :-1].float()
        return F.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none").mean(1)

    plan = DPPlan(dataset_size=N, batch_size=64, steps=6, clipping_norm=1.0, target_epsilon=8.0, delta=1e-4,
                  clip_backend="auto")
    pipeline = plan.pipeline(loss, adam(3e-3), key=key(0), model=fmodel, batch_argnums=(1,))
    sampler, state, accountant = plan.sampler(tokens, key(1)), pipeline.init(params), plan.accountant()
    start = 0
    if args.checkpoint and os.path.isdir(args.checkpoint):  # resume: every counter, key and shard is checked
        ckpt = plan.load_checkpoint(args.checkpoint, params=params, state=state, sampler=sampler,
                                    accountant=accountant)
        params, state, sampler, accountant, start = (ckpt[k] for k in ("params", "state", "sampler", "accountant",
                                                                        "step"))
        print(f"[rank {rank}/{world}] resumed at step {start}", flush=True)
    for t in range(start, plan.steps):
        accountant.step(plan.step_cost_at(t))
        batch = torch.as_tensor(sampler.batch(t), dtype=torch.long)
        updates, state = pipeline.update((tokens[batch],), state, params)
        params = apply_updates(params, updates)
        if args.checkpoint:
            plan.save_checkpoint(args.checkpoint, params=params, state=state, sampler=sampler, accountant=accountant)
    checksum = sum(p.full_tensor().double().sum().item() for p in params)  # equal runs print equal sums
    local = sum(p.to_local().numel() for p in params)
    total = sum(p.numel() for p in params)
    print(f"[rank {rank}/{world}] holds {local} of {total} parameters; epsilon {accountant.epsilon:.3f} per example "
          f"at delta {plan.delta:g}; parameter sum {checksum!r}", flush=True)
    assert accountant.epsilon <= 8.0 and local < total
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
