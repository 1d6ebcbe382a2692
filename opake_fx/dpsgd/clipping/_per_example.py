"""Per-example maps that always run: ``vmap`` where it can, an exact loop where it cannot.

``torch.func.vmap`` refuses some models: data-dependent control flow on a batched tensor
(Hugging Face's mask code calls ``.all()`` on the attention mask), ``.item()``, kernels
without a batching rule (a float64 LSTM). The same function applied to one example at a
time is exact and runs everywhere, only slower. :func:`map_examples` tries ``vmap``
first and, when it raises, loops over the examples and says so with a
:class:`~opake_fx.errors.SlowPathWarning`. Errors that the library raises on purpose
(:class:`~opake_fx.errors.OpakeError`) are never caught: they name a misuse, not a
limit of ``vmap``. An error that is not about ``vmap`` comes back from the loop, raised
by the user's own code on a single example.

The loop may be given its own function (``loop_fn``): ``torch.func.grad`` and ``vjp``
refuse what ``vmap`` refuses for the same reason (an ``autograd.Function`` written in the
legacy style, without ``setup_context``), so the loop takes the same gradient with plain
autograd (:func:`autograd_grad`).
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any, Callable, Sequence

import optree
import torch

from opake_fx.dpsgd.clipping._compat import checkpoint_passthrough
from opake_fx.errors import OpakeError, SlowPathWarning
from opake_fx.pytree import NAMESPACE


def map_examples(fn: Callable[..., Any], in_dims: Sequence[int | None], args: Sequence[Any], batch: int, *,
                 what: str, loop_fn: Callable[..., Any] | None = None) -> Any:
    """``vmap(fn, in_dims)(*args)`` with ``randomness="different"``, or the same by a loop.

    Args:
        fn: the per-example function (inputs without the batch axis).
        in_dims: 0 for arguments batched along their first axis, None for shared ones.
        args: the arguments.
        batch: the number of examples (the size of every batched axis).
        what: what is being mapped, for the warning (e.g. "the loss").
        loop_fn: the same function without ``torch.func`` transforms, for the loop (default ``fn``).

    Returns:
        ``fn``'s outputs for every example, stacked along a new first axis.
    """
    try:
        with checkpoint_passthrough():
            return torch.func.vmap(fn, in_dims=tuple(in_dims), randomness="different")(*args)
    except OpakeError:
        raise
    except (RuntimeError, NotImplementedError, ValueError, IndexError) as err:
        out = _loop(loop_fn or fn, in_dims, args, batch)
        reason = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        warn_slow_path(
            f"torch.func.vmap cannot run {what} ({type(err).__name__}: {reason}); it was computed exactly by a loop "
            f"over the {batch} examples instead, which is slower. Common causes: data-dependent control flow on "
            "a batched tensor (e.g. `if mask.all():` in attention-mask code), `.item()`, or an op without a vmap "
            "batching rule."
        )
        return out


def autograd_grad(f: Callable[..., Any], argnums: int | tuple[int, ...] = 0, has_aux: bool = False) -> Callable[..., Any]:
    """``torch.func.grad(f, argnums, has_aux)`` computed by plain autograd (one example at a time).

    Runs where the ``torch.func`` transforms cannot, e.g. through an ``autograd.Function``
    without ``setup_context``. Leaves the differentiated arguments do not reach get zeros.
    """

    def grad(*args: Any) -> Any:
        nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
        run = list(args)
        trees = []
        for a in nums:
            leaves, spec = optree.tree_flatten(run[a], namespace=NAMESPACE)
            leaves = [t.detach().requires_grad_(True) for t in leaves]
            run[a] = optree.tree_unflatten(spec, leaves)
            trees.append((leaves, spec))
        with torch.enable_grad():
            out = f(*run)
            loss, aux = out if has_aux else (out, None)
            flat = [t for leaves, _ in trees for t in leaves]
            got = torch.autograd.grad(loss, flat, allow_unused=True) if flat else ()
        got = [torch.zeros_like(t) if g is None else g for t, g in zip(flat, got)]
        outs, k = [], 0
        for leaves, spec in trees:
            outs.append(optree.tree_unflatten(spec, got[k:k + len(leaves)]))
            k += len(leaves)
        result = outs[0] if isinstance(argnums, int) else tuple(outs)
        return (result, aux) if has_aux else result

    return grad


def warn_slow_path(message: str) -> None:
    """Emits ``message`` as a :class:`SlowPathWarning` pointed at the user's line."""
    warnings.warn(message, SlowPathWarning, stacklevel=first_caller_outside_package())


def first_caller_outside_package() -> int:
    """The ``stacklevel`` that points a warning at the user's line, not at opake_fx internals."""
    package = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level


def _loop(fn: Callable[..., Any], in_dims: Sequence[int | None], args: Sequence[Any], batch: int) -> Any:
    if batch == 0:
        raise OpakeError("cannot map over an empty batch")  # the engine never maps an empty batch
    outs = []
    for i in range(batch):
        one = [optree.tree_map(lambda t: t[i], a, namespace=NAMESPACE) if d == 0 else a for a, d in zip(args, in_dims)]
        with checkpoint_passthrough():
            outs.append(fn(*one))
    return optree.tree_map(lambda *xs: torch.stack(xs) if isinstance(xs[0], torch.Tensor) else xs[0], *outs,
                           namespace=NAMESPACE)
