"""One rank of the 2-rank DPTrainer resume-with-dropout test (run by torchrun).

Trains 6 steps uninterrupted, then 3 steps with a checkpoint at step 3 (stopped there), then
resumes from it in a new trainer; writes ``OUT/rank{r}.json`` (the largest difference of the
resumed parameters from the uninterrupted run's) and ``OUT/rank{r}.pt`` (the resumed parameters).
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from opake_fx.transformers import DPTrainer, TrainingArguments  # noqa: E402
from tests.integrations import _hf_trainer as hf  # noqa: E402
from tests.integrations.test_dptrainer_resume_dropout import gpt2_with_dropout  # noqa: E402


def _train(out: str, callbacks=(), resume=None) -> dict[str, torch.Tensor]:
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, max_steps=6, learning_rate=1e-2,
                             privacy_target_epsilon=8.0, privacy_accountant="rdp", privacy_seed=7, logging_steps=2,
                             ddp_backend="gloo", save_steps=3, **{**hf.COMMON, "save_strategy": "steps"})
    model = gpt2_with_dropout()
    trainer = DPTrainer(model=model, args=args, train_dataset=hf.counting_lm_data(64), callbacks=list(callbacks))
    hf.quiet_train(trainer, resume_from_checkpoint=resume)
    return hf.trainable(model)


def main(out: str) -> None:
    torch.set_num_threads(1)
    full = _train(os.path.join(out, "full"))
    rank = torch.distributed.get_rank()  # the process group is set up by the first TrainingArguments
    _train(os.path.join(out, "cut"), callbacks=[hf.StopAt(3)])
    checkpoint = os.path.join(out, "cut", "checkpoint-3")
    resumed = _train(os.path.join(out, "cut"), resume=checkpoint)
    diff = max(float((resumed[n] - full[n]).abs().max()) for n in full)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"world": torch.distributed.get_world_size(), "max_abs_diff": diff,
                   "rng_file": os.path.isfile(os.path.join(checkpoint, f"rng_state_{rank}.pth"))}, f)
    torch.save(resumed, os.path.join(out, f"rank{rank}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
