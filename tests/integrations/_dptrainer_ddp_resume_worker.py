"""One rank of the 2-rank DPTrainer resume test (run by torchrun).

Trains 4 steps with a checkpoint every 2, then (``attack``) rank 1's ``dp_state.rank1.pt``
of checkpoint-4 is rewritten with rank 1's genuine accountant of checkpoint-2 (checksum
recomputed: rank 1 would report, and budget, 2 steps fewer than taken, and could stop at
another step than rank 0), and every rank resumes from checkpoint-4. Writes ``OUT/rank{r}.json``: what the resume did.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from opake_fx.errors import CheckpointError, CheckpointRanksError  # noqa: E402
from opake_fx.serialization import read_checkpoint, save_checkpoint  # noqa: E402
from opake_fx.transformers import DPTrainer, TrainingArguments  # noqa: E402
from tests.integrations import _hf_trainer as hf  # noqa: E402


def _trainer(out: str, callbacks=()) -> DPTrainer:
    args = TrainingArguments(output_dir=os.path.join(out, "run"), per_device_train_batch_size=8, max_steps=6,
                             learning_rate=1e-2, privacy_target_epsilon=4.0, privacy_accountant="rdp", privacy_seed=3,
                             ddp_backend="gloo", save_steps=2, **{**hf.COMMON, "save_strategy": "steps"})
    return DPTrainer(model=hf.gpt2_lora(seed=0), args=args, train_dataset=hf.counting_lm_data(96),
                     callbacks=list(callbacks))


def main(out: str, attack: str) -> None:
    torch.set_num_threads(1)
    hf.quiet_train(_trainer(out, callbacks=[hf.StopAt(4)]))
    rank = torch.distributed.get_rank()
    checkpoint = os.path.join(out, "run", "checkpoint-4")
    if attack == "spliced_accountant" and rank == 1:
        path = os.path.join(checkpoint, "dp_state.rank1.pt")
        flats = {name: dict(flat) for name, flat in read_checkpoint(path).items()}
        early = os.path.join(out, "run", "checkpoint-2", "dp_state.rank1.pt")
        flats["accountant"] = dict(read_checkpoint(early)["accountant"])
        trees = {}
        for name, flat in flats.items():
            tree: dict = {}
            for p, v in flat.items():
                *parents, last = p.split("/")
                node = tree
                for q in parents:
                    node = node.setdefault(q, {})
                node[last] = v
            trees[name] = tree
        save_checkpoint(path, **trees)
    torch.distributed.barrier()
    trainer = _trainer(out)
    before = hf.trainable(trainer.model)
    try:
        result = hf.quiet_train(trainer, resume_from_checkpoint=checkpoint)
        report = {"outcome": "ok", "steps": result.global_step}
    except CheckpointError as exc:
        after = hf.trainable(trainer.model)
        report = {"outcome": type(exc).__name__, "ranks_error": isinstance(exc, CheckpointRanksError),
                  "message": str(exc), "model_unchanged": all(torch.equal(before[n], after[n]) for n in before)}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
