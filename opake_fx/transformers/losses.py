"""Per-example losses of Hugging Face models, and the model settings DP cannot train.

DP-SGD clips each example's gradient, so it needs each example's loss: a loss averaged
over the whole batch (what a Hugging Face model returns when given ``labels``) mixes the
examples and cannot be clipped per example. :func:`per_example_loss_fn` builds, from the
model's task, a function ``losses(fmodel, params, batch) -> [B]`` that calls the model
WITHOUT labels and computes each example's loss from the logits, with the padding
(label ``-100``) masked per example.

:func:`check_model` refuses the settings that cannot be private or exact.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from opake_fx.errors import InputValueError

__all__ = ["task_of", "per_example_loss_fn", "check_model", "PerExampleLoss"]

PerExampleLoss = Callable[[Any, Any, Mapping[str, torch.Tensor]], torch.Tensor]
"""``losses(fmodel, params, batch) -> [B]``: one loss per example of the batch dict."""

IGNORE_INDEX = -100
_REFUSED_ATTENTION = ("flash_attention_2", "flash_attention_3", "flex_attention")


def base_model(model: nn.Module) -> nn.Module:
    """The model under a PEFT wrapper (``get_base_model()``), else ``model``."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def task_of(model: nn.Module) -> str:
    """``"causal_lm"``, ``"seq2seq_lm"``, ``"sequence_classification"`` or ``"token_classification"``.

    Read from the class name of the (PEFT-unwrapped) model, as Hugging Face names its
    heads (``...ForCausalLM``/``...LMHeadModel``, ``...ForConditionalGeneration``,
    ``...ForSequenceClassification``, ``...ForTokenClassification``/``...ForMaskedLM``).

    Example:
        >>> import transformers
        >>> cfg = transformers.GPT2Config(vocab_size=8, n_positions=8, n_embd=8, n_layer=1, n_head=2)
        >>> task_of(transformers.GPT2LMHeadModel(cfg))
        'causal_lm'
    """
    inner = base_model(model)
    name = type(inner).__name__
    config = getattr(inner, "config", None)
    if name.endswith("ForCausalLM") or name.endswith("LMHeadModel"):
        return "causal_lm"
    if getattr(config, "is_encoder_decoder", False) and (name.endswith("ForConditionalGeneration") or name.endswith("Seq2SeqLM")):
        return "seq2seq_lm"
    if name.endswith("ForSequenceClassification"):
        return "sequence_classification"
    if name.endswith("ForTokenClassification") or name.endswith("ForMaskedLM"):
        return "token_classification"
    raise InputValueError(
        f"DPTrainer cannot tell the per-example loss of a {name}: it knows causal LMs, seq2seq LMs, sequence and "
        "token classifiers. Pass per_example_loss_func=lambda outputs, batch: <one loss per example, shape [B]> to "
        "DPTrainer."
    )


def per_example_loss_fn(
    model: nn.Module,
    *,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    label_names: tuple[str, ...] = ("labels",),
    custom: Callable[[Any, Mapping[str, torch.Tensor]], torch.Tensor] | None = None,
) -> PerExampleLoss:
    """The per-example loss of ``model``'s task, as ``losses(fmodel, params, batch) -> [B]``.

    Args:
        model: a Hugging Face model (PEFT-wrapped or not).
        reduction: how an example's token losses make its loss: ``"mean"`` over its own
            non-ignored tokens (default), or ``"sum"``.
        label_smoothing: as ``TrainingArguments.label_smoothing_factor``.
        label_names: the batch keys holding labels (never passed to the model).
        custom: ``custom(outputs, batch) -> [B]`` replaces the built-in loss (the model
            is then called with the batch minus the labels).

    Returns:
        The loss function. It adds ``position_ids`` (``arange`` over the sequence,
        broadcast over the batch: the models' own default for right padding) when the
        model takes them and the batch has none, so the fast clipping backends see the
        batch axis on every layer input.

    Privacy: each returned entry depends on its own example only, which is what the
    per-example clipping bound needs (a batch-averaged loss is refused by ``DPTrainer``).

    Example:
        >>> import torch, transformers
        >>> from opake_fx.functional import make_functional
        >>> cfg = transformers.GPT2Config(vocab_size=8, n_positions=8, n_embd=8, n_layer=1, n_head=2)
        >>> model = transformers.GPT2LMHeadModel(cfg)
        >>> fmodel, params = make_functional(model)
        >>> ids = torch.randint(0, 8, (3, 5))
        >>> per_example_loss_fn(model)(fmodel, params, {"input_ids": ids, "labels": ids}).shape
        torch.Size([3])
    """
    if reduction not in ("mean", "sum"):
        raise InputValueError(f"per_example_loss_fn: reduction must be 'mean' or 'sum'; got {reduction!r}.")
    task = "custom" if custom is not None else task_of(model)
    inner = base_model(model)
    accepts = set(inspect.signature(inner.forward).parameters)
    wants_positions = "position_ids" in accepts and task != "seq2seq_lm"
    num_labels = getattr(getattr(inner, "config", None), "num_labels", None)
    problem_type = getattr(getattr(inner, "config", None), "problem_type", None)

    def model_inputs(batch: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        inputs = {k: v for k, v in batch.items() if k not in label_names}
        ref = inputs.get("input_ids", inputs.get("inputs_embeds"))
        if wants_positions and "position_ids" not in inputs and isinstance(ref, torch.Tensor) and ref.dim() >= 2:
            b, t = ref.shape[0], ref.shape[1]
            inputs["position_ids"] = torch.arange(t, device=ref.device).expand(b, t)
        return inputs

    def labels_of(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        for name in label_names:
            if name in batch:
                return batch[name]
        if task == "causal_lm" and "input_ids" in batch:  # language modelling of the inputs, padding masked
            ids = batch["input_ids"]
            mask = batch.get("attention_mask")
            return ids if mask is None else ids.masked_fill(mask == 0, IGNORE_INDEX)
        raise InputValueError(f"DPTrainer: the batch has no labels (looked for {list(label_names)}); got keys {sorted(batch)}.")

    def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # Cross-entropy over rows of a contiguous [B*T, V] view: the class axis last and
        # contiguous (a [B, V, T] layout runs about 3x slower on CPU), then back to [B, T].
        b, t = labels.shape[0], labels.shape[1]
        flat = logits.float().reshape(b * t, logits.shape[-1])
        ce = F.cross_entropy(flat, labels.reshape(b * t), ignore_index=IGNORE_INDEX, reduction="none",
                             label_smoothing=label_smoothing).view(b, t)
        mask = (labels != IGNORE_INDEX).to(ce.dtype)
        total = (ce * mask).sum(1)
        return total if reduction == "sum" else total / mask.sum(1).clamp(min=1.0)

    def losses(fmodel: Any, params: Any, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        inputs = model_inputs(batch)
        if task == "custom":
            return custom(fmodel(params, **inputs), batch)  # type: ignore[misc]
        labels = labels_of(batch)
        if task == "seq2seq_lm":
            if "decoder_input_ids" not in inputs:
                inputs["decoder_input_ids"] = inner.prepare_decoder_input_ids_from_labels(labels=labels)
            return token_losses(fmodel(params, **inputs).logits, labels)
        logits = fmodel(params, **inputs).logits
        if task == "causal_lm":
            # Token t predicts token t+1: shift the labels (padded with IGNORE_INDEX) rather than
            # slicing the logits, which would copy them.
            return token_losses(logits, F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX))
        if task == "token_classification":
            return token_losses(logits, labels)
        # sequence classification, with Hugging Face's problem types
        if problem_type == "regression" or (problem_type is None and num_labels == 1):
            return ((logits.float() - labels.float().view_as(logits)) ** 2).reshape(logits.shape[0], -1).mean(1)
        if problem_type == "multi_label_classification":
            return F.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction="none").mean(1)
        return F.cross_entropy(logits.float(), labels, reduction="none", label_smoothing=label_smoothing)

    return losses


def check_model(model: nn.Module, args: Any = None) -> None:
    """Refuses the settings that cannot be private or exact, naming the one to change.

    * flash-attention-2/3 and flex attention: their kernels cannot run under the
      per-example machinery; load the model with ``attn_implementation="eager"`` or ``"sdpa"``.
    * BatchNorm: its batch statistics mix the examples, so no per-example bound holds.
    * Reentrant gradient checkpointing: it re-runs the forward inside ``backward`` and
      hides the activations the clipping needs.

    Raises:
        InputValueError: one of the above.
    """
    inner = base_model(model)
    config = getattr(inner, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl in _REFUSED_ATTENTION:
        raise InputValueError(
            f"DPTrainer: the model uses attn_implementation={impl!r}, which per-example clipping cannot run through. "
            "Load it with attn_implementation='eager' (or 'sdpa')."
        )
    for name, m in model.named_modules():
        if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)):
            raise InputValueError(
                f"DPTrainer: module {name!r} is a {type(m).__name__}, whose batch statistics mix the examples of a "
                "batch, so no per-example bound holds. Replace it by GroupNorm or LayerNorm."
            )
    flag_name = "is_activation_checkpointing" if hasattr(type(inner), "is_activation_checkpointing") else "is_gradient_checkpointing"
    on = bool(getattr(inner, flag_name, False))
    kwargs: dict[str, Any] = {}
    if args is not None:
        for flag, kw in (("gradient_checkpointing", "gradient_checkpointing_kwargs"),
                         ("activation_checkpointing", "activation_checkpointing_kwargs")):
            if getattr(args, flag, False):
                on = True
                kwargs.update(getattr(args, kw, None) or {})
    if on and kwargs.get("use_reentrant", True):
        raise InputValueError(
            "DPTrainer: reentrant gradient checkpointing re-runs the forward inside backward and hides the "
            "activations per-example clipping needs. Turn it off (gradient_checkpointing=False) or pass "
            "gradient_checkpointing_kwargs={'use_reentrant': False}."
        )
