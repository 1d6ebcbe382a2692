"""Per-example losses of Hugging Face models, and the model settings DP cannot train.

DP-SGD clips each example's gradient, so it needs each example's loss: a loss averaged
over the whole batch (what a Hugging Face model returns when given ``labels``) mixes the
examples and cannot be clipped per example. :func:`per_example_loss_fn` builds, from the
model's task, a function ``losses(fmodel, params, batch) -> [B]`` that calls the model
WITHOUT labels and computes each example's loss from the logits, with the padding
(label ``-100``) masked per example.

Padding is the batch's business, not the example's: an example's loss must not depend on
how long the longest example of its batch is, nor on the side it is padded on, or adding
one long example would move every other example's gradient and the per-example bound
would not hold. :func:`position_ids_from_mask` numbers each example's tokens from its own
attention mask (what Hugging Face's ``generate`` does), and
:func:`check_padding_invariance` verifies the property on an example.

:func:`check_model` refuses the settings that cannot be private or exact.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from opake_fx.errors import InputValueError

__all__ = ["task_of", "per_example_loss_fn", "check_model", "check_padding_invariance", "position_ids_from_mask",
           "PerExampleLoss"]

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
        The loss function. When the model takes ``position_ids`` and the batch has none,
        it adds them: :func:`position_ids_from_mask` of the batch's ``attention_mask``
        (``arange`` over the sequence without one), so each example's tokens are numbered
        from its own first token whatever its padding (left or right), and the fast
        clipping backends see the batch axis on every layer input. A causal-LM batch
        without labels is modelled on its ``input_ids`` with the padding
        (``attention_mask == 0``) ignored.

    Raises:
        InputValueError: (when called) ``custom`` returned anything but one loss per
            example (shape ``[B]``).

    Privacy: each returned entry depends on its own example only, and not on the padded
    length or padding side of its batch, which is what the per-example clipping bound
    needs (a batch-averaged loss is refused by ``DPTrainer``; a custom loss is checked
    for its shape here and for padding invariance by ``DPTrainer``).

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
            mask = inputs.get("attention_mask")
            if isinstance(mask, torch.Tensor) and tuple(mask.shape) == (b, t):
                inputs["position_ids"] = position_ids_from_mask(mask)
            else:
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
        flat = _at_least_float32(logits).reshape(b * t, logits.shape[-1])
        ce = F.cross_entropy(flat, labels.reshape(b * t), ignore_index=IGNORE_INDEX, reduction="none",
                             label_smoothing=label_smoothing).view(b, t)
        mask = (labels != IGNORE_INDEX).to(ce.dtype)
        total = (ce * mask).sum(1)
        return total if reduction == "sum" else total / mask.sum(1).clamp(min=1.0)

    def losses(fmodel: Any, params: Any, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        inputs = model_inputs(batch)
        if task == "custom":
            return _checked_custom(custom(fmodel(params, **inputs), batch), batch)  # type: ignore[misc]
        labels = labels_of(batch)
        if task == "seq2seq_lm":
            if "decoder_input_ids" not in inputs:
                inputs["decoder_input_ids"] = inner.prepare_decoder_input_ids_from_labels(labels=labels)
            return token_losses(fmodel(params, **inputs).logits, labels)
        logits = fmodel(params, **inputs).logits
        if task == "causal_lm":
            # Token t predicts token t+1: shift the labels (padded with IGNORE_INDEX) rather than
            # slicing the logits, which would copy them. A padding position predicts nothing: with
            # left padding the last pad would otherwise predict the first token, a prediction the
            # example alone does not make.
            targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
            mask = batch.get("attention_mask")
            if isinstance(mask, torch.Tensor) and mask.shape == targets.shape:
                targets = targets.masked_fill(mask == 0, IGNORE_INDEX)
            return token_losses(logits, targets)
        if task == "token_classification":
            return token_losses(logits, labels)
        # sequence classification, with Hugging Face's problem types
        logits = _at_least_float32(logits)
        if problem_type == "regression" or (problem_type is None and num_labels == 1):
            return ((logits - labels.to(logits.dtype).view_as(logits)) ** 2).reshape(logits.shape[0], -1).mean(1)
        if problem_type == "multi_label_classification":
            return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="none").mean(1)
        return F.cross_entropy(logits, labels, reduction="none", label_smoothing=label_smoothing)

    return losses


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each example's token positions counted from its own first unpadded token.

    ``cumsum(mask) - 1`` along the sequence, clamped at 0 (the positions of the padding
    before the first token; they are masked out of attention and of the loss). An
    example's tokens get ``0, 1, ..., L-1`` whether it is padded on the left or the right
    and whatever the padded length, as when it is run alone: Hugging Face's ``generate``
    numbers left-padded prompts the same way, while a model called without
    ``position_ids`` numbers the padded sequence ``0..T-1``.

    Args:
        attention_mask: ``[B, T]``, nonzero on the tokens, 0 on the padding.

    Returns:
        ``[B, T]`` int64 positions.

    Privacy: makes an example's positions, hence its loss, independent of the other
    examples of its batch (the longest one sets the padded length).

    Example:
        >>> position_ids_from_mask(torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]])).tolist()
        [[0, 0, 0, 1, 2], [0, 1, 2, 2, 2]]
    """
    return ((attention_mask != 0).long().cumsum(-1) - 1).clamp(min=0)


def check_padding_invariance(losses: PerExampleLoss, fmodel: Any, params: Any, batch: Mapping[str, Any]) -> None:
    """Refuses a per-example loss whose value depends on the padding of the batch.

    Takes the example of ``batch`` with the most padding (``attention_mask == 0``) and
    compares its loss padded as in the batch with its loss alone without the padding
    (every ``[B, T]`` tensor of the batch cut to the example's unmasked positions). They
    must agree to ``sqrt(eps)`` of the loss's dtype, relative (3.5e-4 in float32; a wrong
    position numbering or a loss that counts padded positions moves the loss by far more).
    The model runs in eval mode (no dropout) without gradients; its mode is restored.
    Not for encoder-decoder batches, whose labels have another length than the inputs.

    A batch without an ``attention_mask`` or without padding passes (nothing to compare).

    Raises:
        InputValueError: the two losses differ: with this padding an example's loss
            depends on the longest example of its batch. The message names the fix.

    Privacy: per-example clipping bounds the change one example makes to the sum only if
    every other example's gradient stays the same; if an example's loss depends on the
    padded length, adding one longer example changes them all.

    Example:
        >>> import transformers
        >>> from opake_fx.functional import make_functional
        >>> cfg = transformers.GPT2Config(vocab_size=8, n_positions=8, n_embd=8, n_layer=1, n_head=2)
        >>> model = transformers.GPT2LMHeadModel(cfg)
        >>> fmodel, params = make_functional(model)
        >>> batch = {"input_ids": torch.tensor([[0, 0, 3, 4, 5], [1, 2, 3, 4, 5]]),
        ...          "attention_mask": torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])}
        >>> check_padding_invariance(per_example_loss_fn(model), fmodel, params, batch)  # left padding: fine
    """
    mask = batch.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or bool((mask != 0).all()):
        return
    b, t = mask.shape
    i = int((mask == 0).sum(1).argmax())
    keep = (mask[i] != 0).nonzero().flatten()
    if keep.numel() == 0:  # an all-padding row: nothing of the example to compare
        return

    def one(cut: bool) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in batch.items():
            if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == b:
                v = v[i:i + 1]
                if cut and v.dim() >= 2 and v.shape[1] == t:
                    v = v.index_select(1, keep)
            out[k] = v
        return out

    model = getattr(fmodel, "model", None)
    was_training = bool(getattr(model, "training", False))
    try:
        if model is not None:
            model.eval()
        with torch.no_grad():
            padded, alone = losses(fmodel, params, one(False)), losses(fmodel, params, one(True))
    finally:
        if model is not None:
            model.train(was_training)
    padded, alone = padded.detach().reshape(-1)[0], alone.detach().reshape(-1)[0]
    tol = math.sqrt(torch.finfo(padded.dtype).eps) if padded.dtype.is_floating_point else 0.0
    if not bool((padded - alone).abs() <= tol * max(1.0, float(alone.abs()))):
        row = mask[i] != 0
        left = bool((~row[:-1] & row[1:]).any())
        side = "left" if left else "right"
        raise InputValueError(
            f"DPTrainer: the loss of example {i} of a batch changes with the padding of the batch ({float(padded):.6g} "
            f"padded on the {side} to length {t}, {float(alone):.6g} alone without padding), so every example's "
            "gradient depends on the longest example of its batch and the per-example clipping bound does not hold. "
            + ("Pad on the right (tokenizer.padding_side = 'right'), or put position_ids counted from each example's "
               "first token in the batch (the model does not number a left-padded sequence from its first token); "
               if left else "")
            + "a per_example_loss_func must ignore the padded positions (attention_mask == 0), and the model must mask "
            "them out of attention."
        )


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


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 if it is a narrower float (the loss of a bfloat16 model), else unchanged (float64 stays)."""
    return x.float() if x.is_floating_point() and torch.finfo(x.dtype).bits < 32 else x


def _checked_custom(values: Any, batch: Mapping[str, Any]) -> torch.Tensor:
    """A custom loss's output, refused unless it is one loss per example (shape ``[B]``)."""
    ref = next((v for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() >= 1), None)
    b = None if ref is None else ref.shape[0]
    if not isinstance(values, torch.Tensor) or values.dim() != 1 or (b is not None and values.shape[0] != b):
        got = f"a tensor of shape {list(values.shape)}" if isinstance(values, torch.Tensor) else type(values).__name__
        raise InputValueError(
            f"DPTrainer: per_example_loss_func must return one loss per example, a tensor of shape [B] = [{b}]; it "
            f"returned {got}. A scalar (a loss averaged or summed over the batch) cannot be clipped per example: "
            "return the unreduced losses, e.g. F.cross_entropy(logits, batch['labels'], reduction='none') (for token "
            "losses, reduce over each example's own tokens: (losses * mask).sum(1) / mask.sum(1))."
        )
    return values
