"""One rank of the sharded DPTrainer checkpoint tests (run by torchrun on 2 gloo ranks).

    _dptrainer_fsdp_resume_worker.py OUT cut
    _dptrainer_fsdp_resume_worker.py OUT rest

A tiny eager Llama whose embedding is frozen (the rest trained), sharded with Hugging Face's
fsdp arguments, 6 steps with a checkpoint every 2.

``cut``: trains in OUT/cut and every rank ends its process with ``os._exit(9)`` right after
the checkpoint of step 4 is written (a kill: no ``train()`` returns).

``rest``, in one process group: (1) the uninterrupted run in OUT/full (its parameters at
the step-4 save recorded); (2) OUT/tampered/checkpoint-4, a copy of the cut run's checkpoint
whose ``dp_state/run.rank1.pt`` is checkpoint-2's, resumed under fsdp; (3) OUT/dp/checkpoint-4,
a copy whose DP state has the data-parallel layout (``dp_state.rank{r}.pt``), resumed under
fsdp; (4) ``resume_from_checkpoint=True`` in OUT/cut. The resuming models are built from
another seed, so every value they end with comes from the checkpoint. Each rank writes
OUT/rest.rank{r}.pt: what each part did.
"""

from __future__ import annotations

import os
import shutil
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import transformers  # noqa: E402

from opake_fx.errors import CheckpointError, CheckpointRanksError  # noqa: E402
from opake_fx.transformers import DPTrainer, TrainingArguments  # noqa: E402
from tests.integrations import _hf_trainer as hf  # noqa: E402

FSDP = dict(fsdp=True, fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
KILL_AT = 4


def tiny_llama(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=hf.VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=hf.T,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg)
    model.model.embed_tokens.weight.requires_grad_(False)  # frozen: restored from the checkpoint's weights
    return model


def trainer(output_dir: str, seed: int = 0, callbacks=()) -> DPTrainer:
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=8, max_steps=6, learning_rate=1e-2,
                             privacy_noise_multiplier=1.0, privacy_seed=3, logging_steps=1, ddp_backend="gloo",
                             save_steps=2, **FSDP, **{**hf.COMMON, "save_strategy": "steps"})
    return DPTrainer(model=tiny_llama(seed), args=args, train_dataset=hf.counting_lm_data(96),
                     callbacks=list(callbacks))


def full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, gathered (a collective)."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


class ExitAfterSave(transformers.TrainerCallback):
    """Ends every rank's process (exit code 9) once the checkpoint of step ``step`` is written on every rank."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            dist.barrier()  # every rank has returned from the save (rank 0 wrote trainer_state.json)
            os._exit(9)


class RecordAtSave(transformers.TrainerCallback):
    """The full parameters at the save of step ``step`` (every rank calls on_save: the gather is collective)."""

    def __init__(self, step: int) -> None:
        self.step, self.params = step, None

    def on_save(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step:
            self.params = full(model)


def logged(trainer: DPTrainer, after: int = 0) -> list[tuple[int, float, float]]:
    return [(h["step"], h["loss"], h["epsilon"]) for h in trainer.state.log_history
            if "loss" in h and "train_loss" not in h and h["step"] > after]


def refusal(trainer: DPTrainer, checkpoint: str) -> dict:
    before = full(trainer.model)
    try:
        hf.quiet_train(trainer, resume_from_checkpoint=checkpoint)
        out = {"outcome": "ok"}
    except CheckpointError as exc:
        out = {"outcome": type(exc).__name__, "ranks_error": isinstance(exc, CheckpointRanksError),
               "message": str(exc)}
    after = full(trainer.model)
    out["model_unchanged"] = all(torch.equal(before[n], after[n]) for n in before)
    return out


def main(out: str, mode: str) -> None:
    torch.set_num_threads(1)
    if mode == "cut":
        hf.quiet_train(trainer(os.path.join(out, "cut"), callbacks=[ExitAfterSave(KILL_AT)]))
        raise SystemExit("the run was not killed after its checkpoint")  # pragma: no cover
    record: dict = {}
    # (1) the uninterrupted run
    at_save = RecordAtSave(KILL_AT)
    t = trainer(os.path.join(out, "full"), callbacks=[at_save])  # its arguments start the process group
    rank = dist.get_rank()
    result = hf.quiet_train(t)
    record["full"] = {"params": full(t.model), "logs": logged(t), "epsilon": result.metrics["privacy_epsilon"],
                      "steps": result.global_step, "at_save": at_save.params}
    cut4 = os.path.join(out, "cut", f"checkpoint-{KILL_AT}")
    # (2) one rank's run file of another step (checkpoint-2's) in checkpoint-4
    tampered = os.path.join(out, "tampered", f"checkpoint-{KILL_AT}")
    # (3) the data-parallel layout: dp_state.rank{r}.pt, no dp_state/ directory
    ddp = os.path.join(out, "dp", f"checkpoint-{KILL_AT}")
    if rank == 0:
        shutil.copytree(cut4, tampered)
        shutil.copy(os.path.join(out, "cut", "checkpoint-2", "dp_state", "run.rank1.pt"),
                    os.path.join(tampered, "dp_state", "run.rank1.pt"))
        shutil.copytree(cut4, ddp, ignore=shutil.ignore_patterns("dp_state"))
        for r in range(dist.get_world_size()):
            shutil.copy(os.path.join(cut4, "dp_state", f"run.rank{r}.pt"), os.path.join(ddp, f"dp_state.rank{r}.pt"))
    dist.barrier()
    record["tampered"] = refusal(trainer(os.path.join(out, "tampered"), seed=1), tampered)
    record["dp_layout"] = refusal(trainer(os.path.join(out, "dp"), seed=1), ddp)
    # (4) the killed run, resumed from its last checkpoint
    t = trainer(os.path.join(out, "cut"), seed=1)
    result = hf.quiet_train(t, resume_from_checkpoint=True)
    record["resumed"] = {"params": full(t.model), "logs": logged(t, after=KILL_AT), "all_logs": logged(t),
                         "epsilon": result.metrics["privacy_epsilon"], "steps": result.global_step,
                         "state": type(t._dp["state"]).__name__}
    if rank == 0:
        from safetensors.torch import load_file

        record["checkpoint_files"] = sorted(os.listdir(cut4))
        record["dp_state_files"] = sorted(os.listdir(os.path.join(cut4, "dp_state")))
        record["checkpoint_weights"] = load_file(os.path.join(cut4, "model.safetensors"))
    torch.save(record, os.path.join(out, f"rest.rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
