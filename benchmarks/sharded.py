"""Sharded (FSDP2) against data-parallel DP training on 2 gloo ranks: memory held per rank and step time.

    python benchmarks/sharded.py            # launches itself under torchrun with 2 ranks

A tiny Llama (2 layers, hidden 64) built from a config; every layer and the root sharded
with ``fully_shard``. Per rank it prints the bytes of the parameters, the clipped-and-noised
gradient and the Adam state a rank holds between steps (counted from the tensors, not an
allocator peak) for the data-parallel pipeline (``named_chain(clip, psum, noise, adam)``
on the unsharded model) and for the sharded one (``DPPlan.pipeline(model=fmodel)`` of
``make_functional_fsdp``), and the median step time of the sharded DP step against FSDP2's
own non-private step (``loss.backward()`` + ``torch.optim.Adam``) measured in the same run.
During a step the sharded DP step still gathers the full parameters (docs/sharded.md).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from opake_fx.transforms import apply_updates

VOCAB, T, B, STEPS = 32, 16, 8, 4


def _model():
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T)
    config._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(config)


def _bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors)


def _leaves(tree):
    import optree

    return [t for t in optree.tree_leaves(tree, namespace="opake_fx") if isinstance(t, torch.Tensor)]


def _time(fn) -> float:
    times = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _held_and_time(pipe, params, tokens, opt_of) -> tuple[int, float]:
    """Bytes of params + updates + optimizer state after one step, and the median time of a step."""
    state = pipe.init(params)
    updates, state = pipe.update((tokens,), state, params)
    held = _bytes(params) + _bytes(updates) + _bytes(_leaves(opt_of(state)))
    box = [apply_updates(params, updates), state]

    def step():
        u, box[1] = pipe.update((tokens,), box[1], box[0])
        box[0] = apply_updates(box[0], u)

    return held, _time(step)


def worker() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from opake_fx.distributed import psum
    from opake_fx.distributed.fsdp import make_functional_fsdp
    from opake_fx.dpsgd import clip, noise
    from opake_fx.functional import make_functional
    from opake_fx.optimizers import adam
    from opake_fx.plan import DPPlan
    from opake_fx.random import key
    from opake_fx.transforms import named_chain

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1 + rank)
    tokens = torch.randint(0, VOCAB, (B, T), generator=g)

    def loss_of(fmodel):
        def loss(p, batch):
            logits = fmodel(p, input_ids=batch).logits[:, :-1]
            return F.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none").mean(1)
        return loss

    # data parallel: the whole model on every rank
    fm, params = make_functional(_model())
    ddp = named_chain(("clip", clip(loss_of(fm), clipping_norm=1.0, batch_argnums=(1,), normalize_by=float(B * world),
                                    clip_backend="auto", model=fm)),
                      ("psum", psum()), ("noise", noise(noise_multiplier=1.0, key=key(0))), ("opt", adam(1e-3)))
    ddp_bytes, t_ddp = _held_and_time(ddp, params, tokens, lambda state: state["opt"])
    print(f"[rank {rank}] data-parallel done", file=sys.stderr, flush=True)

    # FSDP2: each rank its rows
    mesh = init_device_mesh("cpu", (world,))
    model = _model()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    fmodel, sparams = make_functional_fsdp(model)
    plan = DPPlan(dataset_size=10_000, batch_size=B * world, steps=100, clipping_norm=1.0, noise_multiplier=1.0,
                  delta=1e-5, clip_backend="auto")
    pipe = plan.pipeline(loss_of(fmodel), adam(1e-3), key=key(0), model=fmodel, batch_argnums=(1,))
    fsdp_bytes, t_fsdp = _held_and_time(pipe, sparams, tokens, lambda state: state.opt)
    print(f"[rank {rank}] sharded DP done", file=sys.stderr, flush=True)

    # FSDP2's own non-private step on the same sharded model
    plain = _model()
    for layer in plain.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(plain, mesh=mesh)
    opt = torch.optim.Adam(plain.parameters(), lr=1e-3)

    def nonprivate_step():
        logits = plain(input_ids=tokens).logits[:, :-1]
        F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad()

    t_plain = _time(nonprivate_step)
    rows = [rank, ddp_bytes, fsdp_bytes, t_ddp, t_fsdp, t_plain]
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        print(f"tiny Llama, {sum(p.numel() for p in params):,} parameters, {world} gloo ranks, batch {B} x {T} per rank")
        print(f"{'rank':>4} {'DDP MB':>8} {'FSDP2 MB':>9} {'ratio':>6} {'DDP ms':>8} {'FSDP2 DP ms':>12} "
              f"{'FSDP2 non-private ms':>21} {'DP / non-private':>17}")
        for r, db, fb, td, tf, tp in gathered:
            print(f"{r:>4} {db / 2**20:8.2f} {fb / 2**20:9.2f} {fb / db:6.2f} {td * 1e3:8.1f} {tf * 1e3:12.1f} "
                  f"{tp * 1e3:21.1f} {tf / tp:17.2f}")
    dist.destroy_process_group()


def main() -> None:
    if "RANK" in os.environ:
        worker()
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", __file__]
    sys.exit(subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}))


if __name__ == "__main__":
    main()
