"""DPTrainer's log: ``loss``, ``epsilon`` and ``delta`` at every logging step and at the run's end, never nan.

``trainer.state.log_history`` is what the reporters (``report_to``) receive; the final
``train()`` metrics hold ``train_loss``, ``privacy_epsilon`` and ``privacy_delta``.
"""

from __future__ import annotations

import math

import pytest

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from opake_fx.transformers import DPTrainer, TrainingArguments  # noqa: E402
from tests.integrations import _hf_trainer as hf  # noqa: E402


class _LogAt(transformers.TrainerCallback):
    """Asks for a log at step ``n`` (as a reporter's callback may), off the logging_steps grid."""

    def __init__(self, n: int) -> None:
        self.n = n

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.n:
            control.should_log = True
        return control


def _train(tmp_path, n=64, callbacks=(), **kw):
    fields = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=7, privacy_target_epsilon=8.0,
                  privacy_seed=0, privacy_accountant="rdp", **hf.COMMON)
    trainer = DPTrainer(model=hf.gpt2_lora(), args=TrainingArguments(**{**fields, **kw}),
                        train_dataset=hf.counting_lm_data(n), callbacks=list(callbacks))
    return trainer, hf.quiet_train(trainer)


def _finite(x) -> bool:
    return isinstance(x, float) and math.isfinite(x)


def _check_log(trainer, out, expected_steps):
    history = trainer.state.log_history
    logs, final = history[:-1], history[-1]
    assert [h["step"] for h in logs] == expected_steps
    for h in logs:
        for k in ("loss", "epsilon", "delta", "learning_rate"):
            assert _finite(h.get(k)), (k, h)
        assert h["delta"] == trainer.privacy_plan.delta
    eps = [h["epsilon"] for h in logs]
    assert eps == sorted(eps) and 0 < eps[0]
    for k in ("train_loss", "privacy_epsilon", "privacy_delta"):
        assert _finite(final.get(k)) and _finite(out.metrics[k]), (k, final)
    assert out.metrics["privacy_epsilon"] == eps[-1]
    assert out.metrics["train_loss"] == pytest.approx(sum(h["loss"] for h in logs) / len(logs))


@pytest.mark.parametrize("kw, steps", [
    ({}, [7]),  # Hugging Face's default logging_steps=500: the last step still logs
    ({"logging_steps": 3}, [3, 6, 7]),  # a logging_steps that does not divide the steps
    ({"logging_steps": 3, "gradient_accumulation_steps": 2, "per_device_train_batch_size": 4}, [3, 6, 7]),
    ({"logging_steps": 1, "logging_first_step": True}, [1, 2, 3, 4, 5, 6, 7]),
    ({"logging_strategy": "epoch"}, [7]),
])
def test_every_logging_step_and_the_end_log_loss_epsilon_and_delta(tmp_path, kw, steps):
    trainer, out = _train(tmp_path, **kw)
    _check_log(trainer, out, steps)


def test_a_logging_step_with_an_empty_batch_logs_a_loss(tmp_path):
    # expected batch 1 of 200: some steps draw no example; the loss is then the last non-empty batch's
    trainer, out = _train(tmp_path, n=200, per_device_train_batch_size=1, max_steps=6, logging_steps=1)
    sampler = trainer._dp["sampler"]
    assert any(len(sampler.batch(t)) == 0 for t in range(6))  # the case is exercised
    _check_log(trainer, out, [1, 2, 3, 4, 5, 6])


def test_a_log_asked_by_a_callback_and_a_run_stopped_early_log_a_loss(tmp_path):
    trainer, out = _train(tmp_path, callbacks=[_LogAt(2), hf.StopAt(4)])
    _check_log(trainer, out, [2, 4])  # step 4 ends the run: it logs although logging_steps is 500


def test_a_run_stopped_by_its_budget_logs_its_end(tmp_path, monkeypatch):
    from opake_fx import accounting as acc
    from opake_fx.plan import DPPlan

    # a budget that covers two of the plan's steps (as a run resumed on a half-spent budget)
    monkeypatch.setattr(DPPlan, "accountant", lambda self: acc.Accountant(
        acc.epsilon_budget(self.epsilon(2) * 1.001, self.delta, accountant="rdp")))
    trainer, out = _train(tmp_path)
    assert out.global_step == 2 and out.metrics["privacy_budget_exhausted"] is True
    _check_log(trainer, out, [2])
