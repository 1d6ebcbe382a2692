"""Bridges from ``nn.Module`` and ``DataLoader`` to the functional world.

* :func:`make_functional` turns a module into ``fmodel(params, *inputs)`` plus a tuple
  of parameters, usable under ``torch.func.grad`` and ``torch.func.vmap``.
* :func:`empty_collate` makes a collate function return correctly shaped empty
  tensors for the empty batches that Poisson sampling produces.

Example:
    >>> import torch
    >>> fmodel, params = make_functional(torch.nn.Linear(3, 2))
    >>> fmodel(params, torch.ones(4, 3)).shape
    torch.Size([4, 2])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
from torch import nn

from opake_fx.typing import typechecked
from opake_fx.errors import InputTypeError, InputValueError, OperationError

__all__ = ["FunctionalModel", "make_functional", "empty_collate", "with_batch_dim"]


class FunctionalModel:
    """A module seen as a pure function of its parameters: ``fmodel(params, *args, **kwargs)``.

    ``params`` is a tuple of tensors in ``model.parameters()`` order (the order of
    :attr:`param_names`); buffers (e.g. GroupNorm statistics are not buffers, but
    BatchNorm running stats are) are read from the module. Tied parameters appear once.

    With ``trainable_only=True`` only the parameters with ``requires_grad`` (e.g. the
    LoRA adapters of a PEFT model) are in ``params``; the frozen ones stay in the module
    and are read from it as constants, so they never enter a gradient, a clip or a noise.

    Attributes:
        model: the wrapped module (the parameters in ``params`` are never read from it by
            ``__call__``).
        param_names: names of the parameters, aligned with ``params``.
        trainable_only: whether ``params`` holds the trainable parameters only.
    """

    def __init__(self, model: nn.Module, *, trainable_only: bool = False) -> None:
        self.model = model
        self.trainable_only = trainable_only
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad or not trainable_only]
        self.param_names: tuple[str, ...] = tuple(name for name, _ in named)
        # Every place a parameter lives, tied copies included: (module, attribute, index into params).
        index = {id(p): i for i, (_, p) in enumerate(named)}
        self._slots: tuple[tuple[nn.Module, str, int], ...] = tuple(
            (m, name, index[id(p)])
            for _, m in model.named_modules(remove_duplicate=False)
            for name, p in m._parameters.items()
            if p is not None and id(p) in index
        )

    def __call__(self, params: Sequence[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        if len(params) != len(self.param_names):
            raise InputTypeError(
                f"this model has {len(self.param_names)} parameters but {len(params)} were given; "
                "pass the params tuple that make_functional returned (or an update of it)."
            )
        # What torch.func.functional_call does for parameters (swap them into the modules,
        # run, swap back), with the slots found once instead of on every call.
        saved = [(m, name, m._parameters[name]) for m, name, _ in self._slots]
        try:
            for m, name, i in self._slots:
                m._parameters[name] = params[i]
            return self.model(*args, **kwargs)
        finally:
            for m, name, old in saved:
                m._parameters[name] = old

    def named(self, params: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """``params`` as a ``{name: tensor}`` dict (e.g. to load back into the module)."""
        return dict(zip(self.param_names, params))

    def load_into_model(self, params: Sequence[torch.Tensor]) -> nn.Module:
        """Copies ``params`` into the wrapped module's parameters and returns the module."""
        own = dict(self.model.named_parameters())
        if len(params) != len(self.param_names):
            raise InputTypeError(
                f"load_into_model: this model has {len(self.param_names)} parameters in params but "
                f"{len(params)} were given; pass the params tuple that make_functional returned (or an update of it)."
            )
        with torch.no_grad():
            for name, new in zip(self.param_names, params):
                own[name].copy_(new)
        return self.model


@typechecked
def make_functional(model: nn.Module, trainable_only: bool = False) -> tuple[FunctionalModel, tuple[torch.Tensor, ...]]:
    """Splits ``model`` into a pure function and its parameters.

    Args:
        model: any module.
        trainable_only: ``False`` (default): every parameter is in ``params``. ``True``:
            only the parameters with ``requires_grad`` (LoRA adapters, an unfrozen
            head...); the frozen ones are read from the module as constants. This is what
            parameter-efficient fine-tuning needs: the clipped gradients, the noise and
            the optimizer state cover the trainable subset only.

    Returns:
        ``(fmodel, params)``: ``fmodel(params, *inputs)`` runs the module with
        ``params`` in place of its own (trainable) parameters (works under
        ``torch.func.vmap`` and ``grad``); ``params`` is a tuple of detached tensors in
        ``model.parameters()`` order, named by ``fmodel.param_names``.

    Privacy: none by itself; it only changes how the model is called. With
    ``trainable_only=True`` the frozen parameters are constants of the function: only
    the trainable ones are released by a DP step built on it.

    Raises:
        InputTypeError: ``model`` is not a module.
        InputValueError: ``trainable_only=True`` and no parameter requires grad.

    Example:
        >>> import torch
        >>> fmodel, params = make_functional(torch.nn.Linear(2, 1))
        >>> [tuple(p.shape) for p in params]
        [(1, 2), (1,)]
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
        >>> net[0].requires_grad_(False)  # doctest: +ELLIPSIS
        Linear(...)
        >>> fmodel, params = make_functional(net, trainable_only=True)
        >>> fmodel.param_names, fmodel(params, torch.ones(4, 2)).shape
        (('1.weight', '1.bias'), torch.Size([4, 1]))
    """
    if not isinstance(model, nn.Module):
        raise InputTypeError(f"make_functional needs an nn.Module; got {type(model).__name__}.")
    fmodel = FunctionalModel(model, trainable_only=trainable_only)
    if trainable_only and not fmodel.param_names:
        raise InputValueError(
            "make_functional(trainable_only=True): no parameter of the model requires grad, so there is nothing "
            "to train. Unfreeze the parameters to train (e.g. peft's get_peft_model marks the adapters trainable)."
        )
    own = dict(model.named_parameters())
    params = tuple(own[name].detach() for name in fmodel.param_names)
    return fmodel, params


def with_batch_dim(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Adapts a batched function to single examples: adds a leading batch dim of 1 to
    every tensor argument and removes it from the output.

    Handy for writing the per-example ``loss_fn`` that ``clipped_grad`` vmaps over
    from a model that expects batches.
    """

    def per_example(*args: Any, **kwargs: Any) -> Any:
        def add(x: Any) -> Any:
            return x.unsqueeze(0) if isinstance(x, torch.Tensor) else x

        out = fn(*optree.tree_map(add, args), **kwargs)
        return optree.tree_map(lambda x: x.squeeze(0) if isinstance(x, torch.Tensor) and x.dim() > 0 else x, out)

    return per_example


@typechecked
def empty_collate(collate: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
    """Wraps ``collate`` so that an empty batch gives correctly shaped empty tensors.

    Poisson sampling can draw an empty batch; most collate functions fail on ``[]``.
    Call the wrapped function once with one example (``collate([dataset[0]])``) to
    prime it: it remembers the structure, trailing shapes and dtypes of the output, and
    from then on returns tensors of shape ``(0, *trailing)`` for an empty batch.

    Example:
        >>> import torch
        >>> from torch.utils.data import default_collate
        >>> c = empty_collate(default_collate)
        >>> _ = c([(torch.zeros(3), torch.tensor(1))])
        >>> [t.shape for t in c([])]
        [torch.Size([0, 3]), torch.Size([0])]
    """
    template: list[Any] = []

    def wrapped(batch: list[Any]) -> Any:
        if len(batch) == 0:
            if not template:
                raise OperationError(
                    "empty_collate got an empty batch before it was primed. Call it once with one "
                    "example first, e.g. collate([dataset[0]]), so it knows the shapes to return."
                )
            return optree.tree_map(
                lambda t: torch.empty((0, *t.shape[1:]), dtype=t.dtype, device=t.device)
                if isinstance(t, torch.Tensor)
                else t,
                template[0],
            )
        out = collate(batch)
        if not template:
            template.append(optree.tree_map(lambda t: t[:0] if isinstance(t, torch.Tensor) else t, out))
        return out

    return wrapped
