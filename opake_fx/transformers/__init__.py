"""Hugging Face integration: a ``DPTrainer`` and DP ``TrainingArguments`` (extra ``hf``).

A ``transformers.Trainer`` script becomes private by changing its two imports and adding
the DP fields to its arguments::

    from opake_fx.transformers import DPTrainer as Trainer, TrainingArguments

See ``docs/huggingface.md``.

* :class:`TrainingArguments`: Hugging Face's arguments plus the privacy fields.
* :class:`DPTrainer`: ``train()`` is a DP-SGD (or DP-FTRL) run built on one
  :class:`opake_fx.plan.DPPlan`; evaluation, callbacks and saving are Hugging Face's.
* :func:`per_example_loss_fn`, :func:`check_model`: the per-example losses of Hugging
  Face tasks and the model settings DP refuses.
"""

from __future__ import annotations

try:
    import transformers as _transformers  # noqa: F401
except ImportError as err:  # pragma: no cover - the hf extra is missing
    from opake_fx.errors import OperationError

    raise OperationError(
        "opake_fx.transformers needs the hf extra (transformers and peft): pip install 'opake_fx[hf]'."
    ) from err

from opake_fx.transformers.arguments import TrainingArguments
from opake_fx.transformers.losses import check_model, per_example_loss_fn, task_of
from opake_fx.transformers.trainer import DPTrainer

__all__ = ["DPTrainer", "TrainingArguments", "per_example_loss_fn", "check_model", "task_of"]
