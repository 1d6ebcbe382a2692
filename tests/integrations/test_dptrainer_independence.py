"""DPTrainer's custom per-example losses go through the fast backends' exact independence guard.

The review's attacks, through the trainer on a tiny BERT: a ``per_example_loss_func`` in
which example i reads example i - 1 (3.13 C of leave-one-out contribution, trained without
complaint before the guard), ``CE(10 (z - z.mean(0)))`` (its loss moves only 7e-4 on a
fresh BERT, under the old 1e-3 probe), and a custom autograd.Function with an identity
forward and a batch-mixing backward. Each is refused before any step, leaving the model
and the trainer as they were; an independent custom loss trains.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from opake_fx.errors import InputValueError  # noqa: E402
from opake_fx.transformers import DPTrainer, TrainingArguments  # noqa: E402
from tests.dpsgd._attacks import MixingBackward, shift  # noqa: E402
from tests.integrations import _hf_trainer as hf  # noqa: E402


def _reads_predecessor(outputs, batch):
    z = outputs.logits
    z = z + 0.5 * shift(z)
    return F.cross_entropy(z, batch["labels"], reduction="none")


def _centred(outputs, batch):
    z = outputs.logits
    return F.cross_entropy(10 * (z - z.mean(0)), batch["labels"], reduction="none")


def _mixing_backward(outputs, batch):
    return F.cross_entropy(MixingBackward.apply(outputs.logits), batch["labels"], reduction="none")


def _independent(outputs, batch):
    return F.cross_entropy(outputs.logits, batch["labels"], reduction="none")


def _trainer(tmp_path, loss, backend="auto"):
    model = hf.bert(seed=0)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=12, max_steps=2, logging_steps=1,
                             privacy_target_epsilon=8.0, privacy_seed=0, privacy_accountant="rdp", clip_backend=backend,
                             **hf.COMMON)
    return model, DPTrainer(model=model, args=args, train_dataset=hf.classification_data(48), per_example_loss_func=loss)


@pytest.mark.parametrize("backend", ["auto", "ghost"])
@pytest.mark.parametrize("loss", [_reads_predecessor, _centred, _mixing_backward], ids=lambda f: f.__name__.strip("_"))
def test_a_custom_loss_that_mixes_examples_is_refused_before_any_step(tmp_path, loss, backend):
    model, trainer = _trainer(tmp_path, loss, backend)
    before = hf.trainable(model)
    with pytest.raises(InputValueError, match="mixes examples"):
        hf.quiet_train(trainer)
    assert trainer.state.global_step == 0
    assert all(torch.equal(before[n], p) for n, p in hf.trainable(model).items())


def test_an_independent_custom_loss_trains(tmp_path):
    model, trainer = _trainer(tmp_path, _independent)
    before = hf.trainable(model)
    hf.quiet_train(trainer)
    assert trainer.state.global_step == 2
    assert any(not torch.equal(before[n], p) for n, p in hf.trainable(model).items())
