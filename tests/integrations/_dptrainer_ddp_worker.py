"""One rank of the 2-rank DPTrainer test (run by torchrun; writes its parameters and epsilon to OUT/rank{r}.pt)."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from opake_fx.transformers import DPTrainer, TrainingArguments  # noqa: E402
from tests.integrations import _hf_trainer as hf  # noqa: E402


def main(out: str) -> None:
    torch.set_num_threads(1)
    args = TrainingArguments(output_dir=os.path.join(out, "run"), per_device_train_batch_size=8, max_steps=4,
                             learning_rate=1e-2, privacy_target_epsilon=4.0, privacy_accountant="rdp",
                             ddp_backend="gloo", **hf.COMMON)  # privacy_seed None: drawn on rank 0, shared
    model = hf.gpt2_lora(seed=0)
    trainer = DPTrainer(model=model, args=args, train_dataset=hf.counting_lm_data(96))
    result = hf.quiet_train(trainer)
    rank = torch.distributed.get_rank()
    torch.save({"params": hf.trainable(model), "epsilon": result.metrics["privacy_epsilon"],
                "world": torch.distributed.get_world_size(), "steps": result.global_step,
                "batches": [trainer._dp["sampler"].batch(t) for t in range(4)]},
               os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
    # Leave the process group before exiting: gloo's threads torn down at interpreter exit
    # abort the process now and then ("terminate called without an active exception").
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
