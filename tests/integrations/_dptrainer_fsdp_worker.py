"""One rank of the FSDP2 DPTrainer tests (run by torchrun on 2 gloo ranks).

    _dptrainer_fsdp_worker.py OUT MODE ARCH

MODE ``fsdp`` (Hugging Face's fsdp arguments) or ``ddp`` (none: data-parallel); ARCH ``llama``
(every parameter trained), ``lora`` (peft adapters on a frozen base), ``users`` (the llama,
``privacy_unit="user"``), ``bf16`` (the llama with ``bf16=True``; fsdp only), ``ftrl`` (the llama
with DP-FTRL: band_mf, cyclic Poisson), ``groups`` (per-group clip norms) or ``adaptive``
(adaptive clipping). Rank 0 writes the initial and trained parameters (full tensors), the
epsilon, the logged losses and clip norms, the evaluation loss and, under fsdp, what
``save_model`` wrote and how the parameters were placed, to OUT/MODE-ARCH.pt.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import peft  # noqa: E402
import transformers  # noqa: E402

from opake_fx.transformers import DPTrainer, TrainingArguments  # noqa: E402
from tests.integrations import _hf_trainer as hf  # noqa: E402

# three spellings of Hugging Face's FSDP2 arguments, one per ARCH
FSDP = {
    "llama": dict(fsdp="full_shard", fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}),
    "lora": dict(fsdp=True, fsdp_config={"version": 2}),  # the layer classes from the model's _no_split_modules
    "users": dict(fsdp=["shard_grad_op", "auto_wrap"],  # layers stay gathered after an evaluation's forward
                  fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}),
}
FSDP["bf16"] = dict(FSDP["llama"], bf16=True)  # the llama, computed in bfloat16 (FSDP2's MixedPrecisionPolicy)
FSDP["ftrl"] = FSDP["groups"] = FSDP["adaptive"] = FSDP["llama"]  # the llama, with other plan parts
FTRL = dict(privacy_noise_mechanism="band_mf", privacy_noise_mechanism_kwargs={"bands": 2},
            sampling_mode="cyclic_poisson")


def tiny_llama(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial model on every rank and in both modes
    cfg = transformers.LlamaConfig(vocab_size=hf.VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=hf.T,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg)
    if arch == "lora":
        model = peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                                           lora_dropout=0.0))
        with torch.no_grad():  # LoRA's B starts at zero: nonzero adapters matter from step 1
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.05)
    return model


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def main(out: str, mode: str, arch: str) -> None:
    torch.set_num_threads(1)
    users = dict(privacy_unit="user", privacy_max_examples_per_user=2) if arch == "users" else {}
    if arch == "ftrl":
        users = FTRL
    if arch == "groups":  # the attention projections at 0.3, everything else at 1.0
        users = dict(clipping_norm={r"self_attn\.": 0.3, "fallback": 1.0}, clipping_mode="fixed")
    if arch == "adaptive":
        users = dict(clipping_mode="adaptive", clipping_norm=0.05)  # small: most norms above it, the norm grows
    args = TrainingArguments(output_dir=os.path.join(out, f"{mode}-{arch}"), per_device_train_batch_size=8,
                             max_steps=4, learning_rate=1e-2, privacy_noise_multiplier=1.0, privacy_seed=3,
                             logging_steps=1, eval_strategy="steps", eval_steps=2, ddp_backend="gloo", **users,
                             **(FSDP[arch] if mode == "fsdp" else {}), **hf.COMMON)
    model = tiny_llama(arch)
    init = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    data = hf.counting_lm_data(96)
    if arch == "users":  # 32 users of 3 examples each
        data = [dict(d, user_id=i % 32) for i, d in enumerate(data)]
    trainer = DPTrainer(model=model, args=args, train_dataset=data, eval_dataset=hf.counting_lm_data(16, seed=9))
    result = hf.quiet_train(trainer)
    trainer.evaluate()  # every rank: Hugging Face's evaluation of the (sharded) model, logged after the two in the run
    record = {"init": init, "params": {n: full(p) for n, p in model.named_parameters() if p.requires_grad},
              "eval_losses": [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h],
              "state": type(trainer._dp["state"]).__name__,
              "noise_state": type(trainer._dp["state"].noise if mode == "fsdp" else trainer._dp["state"]["noise"]).__name__,
              "frozen": {n: full(p) for n, p in model.named_parameters() if not p.requires_grad},
              "epsilon": result.metrics["privacy_epsilon"], "steps": result.global_step,
              "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h and "train_loss" not in h],
              "clip_norms": [h["clipping_norm"] for h in trainer.state.log_history if "clipping_norm" in h],
              "world": torch.distributed.get_world_size()}
    if mode == "fsdp":
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        params = [p for p in model.parameters()]
        record["all_dtensors"] = all(isinstance(p, DTensor) for p in params)
        record["local_numel"] = sum(p.to_local().numel() for p in params)
        record["total_numel"] = sum(p.numel() for p in params)
        record["groups"] = sum(isinstance(m, FSDPModule) for m in model.modules())
        record["compute_dtype"] = str(model._get_fsdp_state()._mp_policy.param_dtype)  # the root group's policy
        saved = os.path.join(out, f"{mode}-{arch}", "saved")
        trainer.save_model(saved)  # every rank (a collective gather); the main process writes
        torch.distributed.barrier()
        if trainer.args.should_save:
            from safetensors.torch import load_file

            name = "adapter_model.safetensors" if arch == "lora" else "model.safetensors"
            record["saved"] = load_file(os.path.join(saved, name))
    if torch.distributed.get_rank() == 0:
        torch.save(record, os.path.join(out, f"{mode}-{arch}.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:4])
    # Leave the process group before exiting: gloo's threads torn down at interpreter exit
    # abort the process now and then ("terminate called without an active exception").
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
