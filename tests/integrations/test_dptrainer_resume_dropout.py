"""A DPTrainer run with dropout, stopped after a checkpoint and resumed, ends bit for bit where the full run ends.

The noise and the batches come from the privacy keys (saved in ``dp_state``); dropout draws
from torch's global generator, which the checkpoint's ``rng_state*.pth`` (Hugging Face's)
restores. The existing resume tests set every dropout to 0; these keep GPT-2's default 0.1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from opake_fx.transformers import DPTrainer, TrainingArguments  # noqa: E402
from tests.integrations import _hf_trainer as hf  # noqa: E402

ROOT = Path(__file__).parents[2]


def gpt2_with_dropout(seed: int = 0) -> torch.nn.Module:
    """A tiny GPT-2 with the config's default dropout (0.1 everywhere)."""
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=hf.VOCAB, n_positions=hf.T, n_embd=16, n_layer=2, n_head=2,
                                  bos_token_id=0, eos_token_id=0)
    assert cfg.resid_pdrop == cfg.embd_pdrop == cfg.attn_pdrop == 0.1
    return transformers.GPT2LMHeadModel(cfg)


def _run(out, callbacks=(), resume=None, logging_steps=2):
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=8, max_steps=6, learning_rate=1e-2,
                             privacy_target_epsilon=8.0, privacy_seed=5, privacy_accountant="rdp",
                             logging_steps=logging_steps, save_steps=3, **{**hf.COMMON, "save_strategy": "steps"})
    model = gpt2_with_dropout()
    trainer = DPTrainer(model=model, args=args, train_dataset=hf.counting_lm_data(64), callbacks=list(callbacks))
    hf.quiet_train(trainer, resume_from_checkpoint=resume)
    return hf.trainable(model)


def test_resume_with_dropout_gives_the_uninterrupted_run(tmp_path):
    full = _run(tmp_path / "full")
    _run(tmp_path / "cut", callbacks=[hf.StopAt(3)])
    resumed = _run(tmp_path / "cut", resume=str(tmp_path / "cut" / "checkpoint-3"))
    for n in full:
        torch.testing.assert_close(resumed[n], full[n], atol=1e-6, rtol=0)


def test_a_second_train_after_a_stop_with_dropout_gives_the_uninterrupted_run(tmp_path):
    # the same trainer continues in process: torch's generators go on where the stopped run left them
    full = _run(tmp_path / "full")
    args = TrainingArguments(output_dir=str(tmp_path / "cont"), per_device_train_batch_size=8, max_steps=6,
                             learning_rate=1e-2, privacy_target_epsilon=8.0, privacy_seed=5, privacy_accountant="rdp",
                             logging_steps=2, **hf.COMMON)
    model = gpt2_with_dropout()
    trainer = DPTrainer(model=model, args=args, train_dataset=hf.counting_lm_data(64), callbacks=[hf.StopAt(3)])
    assert hf.quiet_train(trainer).global_step == 3
    trainer.callback_handler.pop_callback(hf.StopAt)
    assert hf.quiet_train(trainer).global_step == 6
    continued = hf.trainable(model)
    for n in full:
        torch.testing.assert_close(continued[n], full[n], atol=1e-6, rtol=0)


def test_the_logged_loss_draws_nothing_from_the_training_randomness(tmp_path):
    # logging runs an extra forward pass (with dropout); it must not move the training's random stream
    every_step, rarely = _run(tmp_path / "a", logging_steps=1), _run(tmp_path / "b", logging_steps=500)
    for n in every_step:
        assert torch.equal(every_step[n], rarely[n]), n


@pytest.mark.slow
def test_two_ranks_resume_with_dropout_gives_the_uninterrupted_run(tmp_path):
    from tests.integrations.test_dptrainer_distributed import _free_port

    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()),
           str(ROOT / "tests" / "integrations" / "_dptrainer_ddp_dropout_worker.py"), str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in reports:
        assert r["world"] == 2
        assert r["max_abs_diff"] <= 1e-6, r
        assert r["rng_file"]  # each rank restored its own rng_state_{rank}.pth
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    for n in r0:
        assert torch.equal(r0[n], r1[n]), n  # the ranks still agree
