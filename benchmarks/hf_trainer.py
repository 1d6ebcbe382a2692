"""Benchmark: ``DPTrainer``'s step against Hugging Face ``Trainer``'s non-private step.

A tiny GPT-2 (2 layers, d 128, 4 heads, vocab 5000, 64 tokens, batch 16 expected) on
random tokens, trained two ways for the same number of steps:

* ``gpt2-full`` — every parameter trained;
* ``gpt2-lora`` — peft LoRA adapters (rank 8 on ``c_attn``, ``c_proj``, ``c_fc``), the base frozen.

``hf`` is ``transformers.Trainer`` (AdamW, mean loss, backward, no gradient clipping);
``dp`` is ``opake_fx.transformers.DPTrainer`` (Poisson batches, ``clip_backend="auto"``,
noise calibrated for epsilon 8, AdamW). Two numbers per run:

* ``step``: the median time from a step's ``on_step_begin`` to its ``on_step_end``
  callback: collate, forward/backward (per-example clipping for DP), noise, optimizer,
  write-back. For DP this leaves out the accountant's charge of the step;
* ``loop``: the whole training loop divided by the steps, the accountant included (PLD
  composition step by step; ``--accountant rdp`` for the cheap RDP accountant).

Printed as ``dp / hf`` ratios; the target of issue 15 is ``step`` <= 1.3x for LoRA.

    python benchmarks/hf_trainer.py            # 30 steps per run, about 2 minutes on 2 cores
    python benchmarks/hf_trainer.py --steps 10 # quicker

Measured (``--steps 30``, 2 threads, PLD, idle 2-core machine): gpt2-full step 1.51x
(loop 2.40x), gpt2-lora step 1.09x (loop 2.28x): the LoRA target of 1.3x is met. The loop
ratio carries one-time setup (noise calibration, the accountant's first look-ahead) that
30 steps do not amortise (see ``docs/huggingface.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import tempfile
import time

import torch

VOCAB, SEQ, BATCH = 5000, 64, 16


class StepTimer:
    """A Trainer callback recording each step's wall time (on_step_begin -> on_step_end)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._t = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._t = time.perf_counter()
        return control

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._t)
        return control

    def __getattr__(self, name):  # every other callback event: nothing
        if name.startswith("on_"):
            return lambda args, state, control, **kwargs: control
        raise AttributeError(name)


def build(lora: bool):
    import peft
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=128, n_layer=2, n_head=4, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    if lora:
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_proj", "c_fc"],
                                                           fan_in_fan_out=True, lora_dropout=0.0))
    return model


def run(kind: str, lora: bool, steps: int, n: int, accountant: str) -> tuple[float, float]:
    import transformers

    import opake_fx.transformers as dp

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    data = [{"input_ids": r, "labels": r} for r in ids]
    common = dict(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=BATCH, max_steps=steps, learning_rate=1e-3,
                  optim="adamw_torch", report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=True,
                  logging_steps=10**6, dataloader_num_workers=0)
    timer = StepTimer()
    if kind == "hf":
        args = transformers.TrainingArguments(max_grad_norm=0.0, **common)
        trainer = transformers.Trainer(model=build(lora), args=args, train_dataset=data, callbacks=[timer])
    else:
        args = dp.TrainingArguments(privacy_target_epsilon=8.0, privacy_accountant=accountant, **common)
        trainer = dp.DPTrainer(model=build(lora), args=args, train_dataset=data, callbacks=[timer])
    with contextlib.redirect_stdout(io.StringIO()):
        result = trainer.train()
    warm = timer.times[2:] or timer.times  # the first steps warm up caches
    return statistics.median(warm), result.metrics["train_runtime"] / result.global_step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--examples", type=int, default=1024)
    parser.add_argument("--accountant", choices=["pld", "rdp"], default="pld")
    a = parser.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    print(f"tiny GPT-2 (d 128, 2 layers, vocab {VOCAB}), {SEQ} tokens, batch {BATCH}, {a.steps} steps, "
          f"{torch.get_num_threads()} threads, accountant {a.accountant}")
    for lora in (False, True):
        name = "gpt2-lora" if lora else "gpt2-full"
        hf_step, hf_loop = run("hf", lora, a.steps, a.examples, a.accountant)
        dp_step, dp_loop = run("dp", lora, a.steps, a.examples, a.accountant)
        print(f"{name}: step hf {hf_step * 1e3:.1f} ms, dp {dp_step * 1e3:.1f} ms -> {dp_step / hf_step:.2f}x;  "
              f"loop hf {hf_loop * 1e3:.1f} ms, dp {dp_loop * 1e3:.1f} ms -> {dp_loop / hf_loop:.2f}x")


if __name__ == "__main__":
    main()
