"""DP fine-tuning of a tiny Llama sharded with FSDP2, under torchrun (issue 32).

    torchrun --nproc_per_node 2 examples/fsdp_llama.py                        # one node
    torchrun --nnodes 2 --nproc_per_node 1 --rdzv-backend c10d \\
             --rdzv-endpoint HOST:29500 --rdzv-id run1 examples/fsdp_llama.py  # on each of 2 nodes

Every decoder layer and the root are sharded with ``fully_shard``; the plan's pipeline
(``clip_backend="auto"``) gathers the parameters, clips each rank's examples, reduce-scatters
the clipped sums and noises each rank's rows of the unsharded noise (docs/sharded.md).
The model is built from a config (no weights are downloaded); the data are random token
sequences with a learnable rule (each token is the previous one plus one).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from opake_fx.distributed.fsdp import make_functional_fsdp
from opake_fx.optimizers import adam
from opake_fx.plan import DPPlan
from opake_fx.random import key
from opake_fx.transforms import apply_updates

VOCAB, T, N = 32, 12, 256


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial model on every rank
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T)
    config._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(config)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    fmodel, params = make_functional_fsdp(model)

    g = torch.Generator().manual_seed(1)  # the same data set on every rank; the sampler shards it
    start = torch.randint(0, VOCAB, (N, 1), generator=g)
    tokens = (start + torch.arange(T)) % VOCAB

    def loss(p, batch):  # per-example next-token loss [B]
        logits = fmodel(p, input_ids=batch).logits[:, :-1]
        return F.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none").mean(1)

    plan = DPPlan(dataset_size=N, batch_size=64, steps=6, clipping_norm=1.0, target_epsilon=8.0, delta=1e-4,
                  clip_backend="auto")
    pipeline = plan.pipeline(loss, adam(3e-3), key=key(0), model=fmodel, batch_argnums=(1,))
    state, accountant = pipeline.init(params), plan.accountant()
    for t, batch in enumerate(plan.sampler(tokens, key(1))):
        accountant.step(plan.step_cost_at(t))
        updates, state = pipeline.update((tokens[torch.as_tensor(batch, dtype=torch.long)],), state, params)
        params = apply_updates(params, updates)
    local = sum(p.to_local().numel() for p in params)
    total = sum(p.numel() for p in params)
    print(f"[rank {rank}/{world}] holds {local} of {total} parameters; epsilon {accountant.epsilon:.3f} per example "
          f"at delta {plan.delta:g}", flush=True)
    assert accountant.epsilon <= 8.0 and local < total
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
