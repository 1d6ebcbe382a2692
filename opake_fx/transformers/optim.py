"""Hugging Face's optimizer and learning-rate settings, mapped onto :mod:`opake_fx.optimizers` and :mod:`opake_fx.scheduling`.

``TrainingArguments.optim`` / ``lr_scheduler_type`` / ``warmup_steps`` name torch
optimizers and schedulers; DPTrainer needs the functional ones. The mapping follows
Hugging Face's definitions step for step: the optimizer's ``k``-th update (from 0) uses
``schedule(k)``, which is the value Hugging Face's ``LambdaLR`` gives the ``k``-th step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opake_fx import scheduling
from opake_fx.errors import InputValueError
from opake_fx.optimizers import adamw, sgd

__all__ = ["learning_rate_schedule", "optimizer_from_args"]

_ADAMW = ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_torch_xla", "adamw_torch_npu_fused", "adamw_apex_fused")


def _name(value: Any) -> str:
    return str(getattr(value, "value", value))


def learning_rate_schedule(args: Any, total_steps: int) -> scheduling.Schedule:
    """The learning rate of each step, as Hugging Face's ``lr_scheduler_type`` with its warmup.

    Supported: ``linear``, ``cosine``, ``constant``, ``constant_with_warmup``,
    ``inverse_sqrt``; anything else is an error naming the supported ones.

    Example:
        >>> from types import SimpleNamespace
        >>> args = SimpleNamespace(learning_rate=1.0, lr_scheduler_type="linear", warmup_steps=2,
        ...                        lr_scheduler_kwargs=None, get_warmup_steps=lambda n: 2)
        >>> s = learning_rate_schedule(args, total_steps=6)
        >>> [s(t) for t in range(7)]
        [0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0]
    """
    lr = float(args.learning_rate)
    kind = _name(args.lr_scheduler_type)
    warmup = int(args.get_warmup_steps(total_steps))
    if args.lr_scheduler_kwargs:
        raise InputValueError(
            f"DPTrainer: lr_scheduler_kwargs={args.lr_scheduler_kwargs!r} are not supported; leave them empty."
        )
    decay = max(1, total_steps - warmup)
    if kind == "linear":
        return scheduling.with_warmup(scheduling.linear(lr, 0.0, decay), warmup)
    if kind == "cosine":
        return scheduling.with_warmup(scheduling.cosine(lr, decay), warmup)
    if kind == "constant":
        return scheduling.constant(lr)
    if kind == "constant_with_warmup":
        return scheduling.with_warmup(scheduling.constant(lr), warmup)
    if kind == "inverse_sqrt":
        # Hugging Face: lr * sqrt(W / t) after a linear warmup of W steps (timescale W; 10_000 without warmup)
        scale = warmup if warmup > 0 else 10_000
        return scheduling.with_warmup(scheduling.inverse_sqrt(lr, scale), warmup)
    raise InputValueError(
        f"DPTrainer: lr_scheduler_type={kind!r} has no functional counterpart yet; use one of linear, cosine, "
        "constant, constant_with_warmup, inverse_sqrt."
    )


def optimizer_from_args(args: Any, total_steps: int, decay_mask: Sequence[bool] | None = None) -> Any:
    """The functional optimizer of ``args.optim`` (AdamW by default; ``sgd``), with the schedule.

    Args:
        args: the ``TrainingArguments``.
        total_steps: the run's steps (the schedule's length).
        decay_mask: one bool per trainable parameter, in the order of the parameters the
            optimizer updates (``True``: ``weight_decay`` applies). ``DPTrainer`` passes
            Hugging Face's own choice, ``Trainer.get_decay_parameter_names`` (every parameter
            except biases and norm weights), so the decay is Hugging Face's. ``None``: every
            parameter is decayed.

    Privacy: post-processing of the noised gradient; weight decay (masked or not) reads the
    parameters only, never the data, so it changes no guarantee.

    Example:
        >>> from types import SimpleNamespace
        >>> import torch
        >>> args = SimpleNamespace(optim="adamw_torch", learning_rate=0.1, lr_scheduler_type="constant",
        ...                        lr_scheduler_kwargs=None, get_warmup_steps=lambda n: 0, adam_beta1=0.9,
        ...                        adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.5)
        >>> opt = optimizer_from_args(args, total_steps=1, decay_mask=(True, False))  # (weight, bias)
        >>> params = (torch.ones(2), torch.ones(2))
        >>> updates, _ = opt.update((torch.zeros(2), torch.zeros(2)), opt.init(params), params)
        >>> updates[0].tolist(), updates[1].abs().tolist()  # zero gradients: only the weight decays
        ([-0.05000000074505806, -0.05000000074505806], [0.0, 0.0])
    """
    kind = _name(args.optim)
    lr = learning_rate_schedule(args, total_steps)
    mask = None if decay_mask is None else tuple(bool(d) for d in decay_mask)
    if kind in _ADAMW:
        return adamw(lr, b1=args.adam_beta1, b2=args.adam_beta2, eps=args.adam_epsilon, weight_decay=args.weight_decay,
                     mask=mask)
    if kind == "sgd":
        if args.weight_decay:
            raise InputValueError("DPTrainer: optim='sgd' with weight_decay is not supported; set weight_decay=0.")
        return sgd(lr)
    raise InputValueError(f"DPTrainer: optim={kind!r} is not supported; use 'adamw_torch' (the default) or 'sgd'.")
