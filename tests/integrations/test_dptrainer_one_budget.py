"""One DPTrainer, one run, one budget: a second ``train()`` continues the run or is refused.

The attack: ``train()`` called twice built a new accountant for the second call, so both
calls reported epsilon 7.995 after 8 private steps that cost 11.60.
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from opake_fx.errors import InputValueError  # noqa: E402
from opake_fx.transformers import DPTrainer, TrainingArguments  # noqa: E402
from tests.integrations import _hf_trainer as hf  # noqa: E402

STEPS = 4


def _trainer(tmp_path, callbacks=(), **kw):
    fields = dict(output_dir=str(tmp_path), per_device_train_batch_size=16, max_steps=STEPS, learning_rate=1e-2,
                  privacy_target_epsilon=4.0, privacy_seed=5, privacy_accountant="rdp", logging_steps=1, **hf.COMMON)
    fields.update(kw)
    return DPTrainer(model=hf.gpt2_lora(seed=3), args=TrainingArguments(**fields), train_dataset=hf.counting_lm_data(64),
                     callbacks=list(callbacks))


def _epsilon(trainer):
    return trainer.accountant.spent_epsilon(trainer.privacy_plan.delta)


def test_a_second_train_after_a_complete_run_is_refused_and_changes_nothing(tmp_path):
    trainer = _trainer(tmp_path)
    first = hf.quiet_train(trainer)
    assert first.global_step == STEPS
    eps, params, accountant = _epsilon(trainer), hf.trainable(trainer.model), trainer.accountant
    with pytest.raises(InputValueError, match="run is complete") as err:
        hf.quiet_train(trainer)
    assert "new DPTrainer" in str(err.value)  # how to start a new run
    assert trainer.accountant is accountant and _epsilon(trainer) == eps
    assert trainer.state.global_step == STEPS
    assert all(torch.equal(params[n], p) for n, p in hf.trainable(trainer.model).items())


class _Boom(Exception):
    pass


class _RaiseAtStepBegin(transformers.TrainerCallback):
    """Raises once in ``on_step_begin`` of step ``n`` (counted from 1): after the step is charged, before it runs."""

    def __init__(self, n: int) -> None:
        self.n, self.fired = n, False

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.n - 1 and not self.fired:
            self.fired = True
            raise _Boom("interrupted")


@pytest.mark.parametrize("stop", ["callback", "error-mid-step"])
def test_a_second_train_continues_a_stopped_run_exactly_and_charges_each_step_once(tmp_path, stop):
    whole = _trainer(tmp_path / "whole")
    hf.quiet_train(whole)
    stopper = hf.StopAt(2) if stop == "callback" else _RaiseAtStepBegin(3)
    trainer = _trainer(tmp_path / "cut", callbacks=[stopper])
    if stop == "callback":
        assert hf.quiet_train(trainer).global_step == 2
    else:
        with pytest.raises(_Boom):
            hf.quiet_train(trainer)
        assert trainer.state.global_step == 2  # step 3 was charged, then interrupted
    accountant = trainer.accountant
    out = hf.quiet_train(trainer)
    assert out.global_step == STEPS and trainer.accountant is accountant
    assert _epsilon(trainer) == pytest.approx(_epsilon(whole), rel=1e-12)  # 4 steps charged, not 5 or 6
    assert _epsilon(trainer) == pytest.approx(trainer.privacy_plan.epsilon(STEPS), rel=1e-9)
    a, b = hf.trainable(whole.model), hf.trainable(trainer.model)
    for n in a:
        torch.testing.assert_close(b[n], a[n], atol=1e-6, rtol=0)
    with pytest.raises(InputValueError, match="run is complete"):
        hf.quiet_train(trainer)


def test_a_second_train_under_arguments_that_make_another_plan_is_refused(tmp_path):
    trainer = _trainer(tmp_path, callbacks=[hf.StopAt(2)])
    hf.quiet_train(trainer)
    eps = _epsilon(trainer)
    trainer.args = TrainingArguments(**{**trainer.args.to_dict(), "privacy_target_epsilon": 8.0})
    with pytest.raises(InputValueError, match="another privacy plan"):
        hf.quiet_train(trainer)
    assert _epsilon(trainer) == eps and trainer.state.global_step == 2


def test_a_failed_first_train_that_took_no_step_starts_afresh(tmp_path):
    calls = []

    def custom(outputs, batch):
        calls.append(1)
        if len(calls) == 1:
            return outputs.logits.sum()  # wrong the first time: refused before anything is charged
        return outputs.logits.logsumexp(-1).mean(1)

    trainer = DPTrainer(model=hf.gpt2_lora(), args=_trainer(tmp_path).args, train_dataset=hf.counting_lm_data(64),
                        per_example_loss_func=custom)
    with pytest.raises(InputValueError, match="shape"):
        hf.quiet_train(trainer)
    assert hf.quiet_train(trainer).global_step == STEPS
    assert _epsilon(trainer) == pytest.approx(trainer.privacy_plan.epsilon(STEPS), rel=1e-9)


# --- the report: loss and epsilon at the last step with Hugging Face's default logging ---------


@pytest.mark.parametrize("strategy", ["steps", "epoch"])
def test_the_last_step_logs_loss_and_epsilon_with_default_logging(tmp_path, strategy):
    # Hugging Face's default logging_steps is 500: a shorter run used to end with train_loss nan and no epsilon logged
    trainer = _trainer(tmp_path, logging_steps=500, logging_strategy=strategy)
    out = hf.quiet_train(trainer)
    assert math.isfinite(out.metrics["train_loss"]) and math.isfinite(out.training_loss)
    logged = [h for h in trainer.state.log_history if "epsilon" in h and "loss" in h]
    assert [h["step"] for h in logged] == [STEPS]
    assert logged[0]["epsilon"] == pytest.approx(out.metrics["privacy_epsilon"])
