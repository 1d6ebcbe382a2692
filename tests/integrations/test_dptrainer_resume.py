"""DPTrainer checkpoints: a run stopped after a checkpoint and resumed ends where an uninterrupted run ends."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from opake_fx.errors import CheckpointError  # noqa: E402
from opake_fx.serialization import load_checkpoint  # noqa: E402
from opake_fx.transformers import DPTrainer, TrainingArguments  # noqa: E402
from tests.integrations import _hf_trainer as hf  # noqa: E402


def _run(out, callbacks=(), resume=None, seed=None):
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=16, max_steps=8, learning_rate=1e-2,
                             warmup_steps=2, privacy_target_epsilon=4.0, privacy_seed=seed, privacy_accountant="rdp",
                             logging_steps=1, **{**hf.COMMON, "save_strategy": "steps"}, save_steps=4)
    model = hf.gpt2_lora(seed=3)
    trainer = DPTrainer(model=model, args=args, train_dataset=hf.counting_lm_data(96), callbacks=list(callbacks))
    result = hf.quiet_train(trainer, resume_from_checkpoint=resume)
    return trainer, model, result


@pytest.mark.parametrize("seed", [11, None])  # a given seed, and one drawn from the CSPRNG (saved in the checkpoint)
def test_stop_after_a_checkpoint_and_resume_gives_the_uninterrupted_run(tmp_path, seed):
    _, _, first = _run(tmp_path / "cut", callbacks=[hf.StopAt(4)], seed=seed)
    assert first.global_step == 4
    # the seed the first part used (drawn from the CSPRNG when None), as saved in its checkpoint
    saved = load_checkpoint(tmp_path / "cut" / "checkpoint-4" / "dp_state.rank0.pt", meta={"seed": 0, "step": 0})["meta"]
    assert saved["step"] == 4 and (seed is None or saved["seed"] == seed)
    _, full_model, full = _run(tmp_path / "full", seed=saved["seed"])
    trainer, resumed_model, rest = _run(tmp_path / "cut", resume=str(tmp_path / "cut" / "checkpoint-4"), seed=seed)
    assert rest.global_step == 8
    a, b = hf.trainable(full_model), hf.trainable(resumed_model)
    for n in a:
        torch.testing.assert_close(b[n], a[n], atol=1e-6, rtol=0)
    assert rest.metrics["privacy_epsilon"] == pytest.approx(full.metrics["privacy_epsilon"], rel=1e-9)
    eps_logged = [h["epsilon"] for h in trainer.state.log_history if "epsilon" in h]
    assert len(eps_logged) == 8  # the resumed history continues the first part's


def test_resuming_from_a_weights_only_checkpoint_is_refused(tmp_path):
    _run(tmp_path, callbacks=[hf.StopAt(4)], seed=1)
    (tmp_path / "checkpoint-4" / "dp_state.rank0.pt").unlink()
    with pytest.raises(CheckpointError, match="cannot be resumed"):
        _run(tmp_path, resume=str(tmp_path / "checkpoint-4"), seed=1)


def test_resuming_under_another_plan_is_refused(tmp_path):
    _run(tmp_path, callbacks=[hf.StopAt(4)], seed=1)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=16, max_steps=8,
                             privacy_target_epsilon=2.0, privacy_seed=1, privacy_accountant="rdp", **hf.COMMON)
    trainer = DPTrainer(model=hf.gpt2_lora(seed=3), args=args, train_dataset=hf.counting_lm_data(96))
    with pytest.raises(CheckpointError, match="another privacy plan"):  # the plan identity is inside dp_state
        hf.quiet_train(trainer, resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
