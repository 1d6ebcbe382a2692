"""The one interface of the fast backends' layer rules (entries of :mod:`._registry`).

A *rule* decides everything about the calls of the modules it takes:

* :meth:`Rule.claims`: which modules (by type, and by predicate where the type says too
  little, e.g. a norm-like module recognised by its parameters);
* :meth:`Rule.check`: settings that mix examples or cannot be followed, refused with an error;
* :meth:`Rule.reads_batched`: whether the call's inputs that the rule reads carry the batch
  axis first, from the provenance verdicts (:mod:`._provenance`), never from a size;
* :meth:`Rule.route`: what the call must keep for the backward pass (``(a,)``, the first
  input, unless the rule says otherwise), or None when this call does not fit the rule
  and takes the exact module fallback;
* :meth:`Rule.build`: from what was kept and the output gradient ``g`` of the batch loss,
  the call's layer gradient (:class:`._numerics.LayerGrad`: certified per-example squared
  norms and the weighted sum).

*Deferred* rules (the module fallback, and the attention and recurrent entries whose
calls end there) keep the whole call instead and run after the backward pass
(:func:`._rules_fallback.module_per_example`). A rule may also *rewrite* a call
(:meth:`Rule.rewrite`: attention is recomputed from tapped projections).

Privacy contract: whatever a rule builds, the engine's weights come from the certified
norms of the tensors the weighted sum reads, so each example's contribution is at most
``C`` as computed in floating point.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import optree
import torch
from torch import nn

from opake_fx.dpsgd.clipping._numerics import LayerGrad
from opake_fx.errors import InputValueError


@dataclass(frozen=True)
class BuildContext:
    """What a rule's :meth:`Rule.build` may need besides the call.

    Attributes:
        mode: ``"ghost"`` or ``"auto"`` (how Linear-like rules form norms).
        dtype: the differentiated parameters' dtype.
        shared: whether one of the call's parameters is also used by another call (a tied
            table keeps token-level terms for the cross terms).
        checked: (module type, input shape, names) keys of registered rules already checked
            against autograd (the backend's, kept across steps).
        block: for a tapped projection, the rows of the packed weight it uses.
        static: the call is traced (:mod:`._traced`): the rule's tensors must have shapes that
            do not depend on the data (no ``torch.unique``).
    """

    mode: str
    dtype: torch.dtype
    shared: bool = False
    checked: set[tuple[Any, ...]] | None = None
    block: tuple[int, int] | None = None
    static: bool = False


class Rule:
    """Base of every layer rule (see the module docstring); the defaults fit a rule that
    reads the call's first input ``a`` (batch first) and its single output's gradient."""

    #: short name, used in messages and tests
    kind: str = ""
    #: module types the rule is keyed by; users cannot register rules for these
    types: tuple[type, ...] = ()
    #: the call is kept whole and handled after the backward pass (module fallback)
    deferred: bool = False
    #: the rule may replace the call's output (:meth:`rewrite`)
    rewrites: bool = False

    def claims(self, module: nn.Module) -> bool:
        """Whether the rule takes ``module``: one of :attr:`types` that runs one of their own
        ``forward`` methods (a subclass with its own ``forward`` computes something else)."""
        return isinstance(module, self.types) and type(module).forward in tuple(c.forward for c in self.types)

    def check(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], batched: dict[int, bool],
              batch: int, differentiated: bool) -> None:
        """Raises for a module setting or call that mixes examples (default: nothing to refuse)."""

    def reads_batched(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                      batched: dict[int, bool]) -> bool:
        """Whether what the rule reads carries the batch axis first (``batched``: id of each
        tensor of the call -> provenance verdict). The outputs were checked already."""
        a = first_input(args, kwargs)
        return isinstance(a, torch.Tensor) and batched.get(id(a), False)

    def route(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
              output: Any) -> tuple[torch.Tensor, ...] | None:
        """The tensors the backward pass needs (their gradients flow as the call's did), or
        None: this call takes the module fallback."""
        return (first_input(args, kwargs),)

    def build(self, module: nn.Module, saved: tuple[torch.Tensor, ...], g: torch.Tensor, names: dict[str, int],
              ctx: BuildContext) -> LayerGrad:
        """The call's layer gradient for the parameters ``names`` (name -> leaf index)."""
        raise NotImplementedError(f"{type(self).__name__} is deferred; it has no build")

    def rewrite(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any,
                names: dict[str, int], batched: dict[int, bool], tap: Callable[..., torch.Tensor],
                params_of: Callable[[nn.Module], dict[str, int]], cache: dict[tuple[Any, ...], bool]) -> Any:
        """A replacement output computed through ``tap``-ped sub-calls, or None (only for
        rules with :attr:`rewrites`)."""
        return None

    def rewrite_ahead(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], names: dict[str, int],
                      tap: Callable[..., torch.Tensor], params_of: Callable[[nn.Module], dict[str, int]],
                      cache: dict[tuple[Any, ...], bool]) -> Any:
        """The output :meth:`rewrite` would give, computed instead of the module's forward, for
        a call whose signature :meth:`rewrite` has already checked against the module's own
        output (``cache``); None otherwise (the module runs, then :meth:`rewrite` is asked)."""
        return None

    def confirms(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any,
                 batched: dict[int, bool]) -> bool:
        """Whether the layout of a call run by :meth:`rewrite_ahead` lets its taps stand
        (``batched``: the call's provenance verdicts, known only once it has run)."""
        return False

    def batch_axes(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], inputs: list[torch.Tensor],
                   outputs: list[torch.Tensor], batched: dict[int, bool]) -> tuple[list[int | None], list[int]]:
        """For a deferred call: the batch axis of each tensor input (None: not split per
        example) and of each output. Default: the first axis of those found batched."""
        return [0 if batched.get(id(t), False) else None for t in inputs], [0] * len(outputs)

    def batched(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], outputs: list[torch.Tensor],
                batched: dict[int, bool]) -> bool:
        """Whether the call carries the batch as the first dimension of its outputs and of
        what the rule reads, by provenance (``batched`` is empty when the call is undecidable)."""
        if not outputs or not all(batched.get(id(o), False) for o in outputs):
            return False
        return self.reads_batched(module, args, kwargs, batched)


def first_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The call's first positional argument, or its ``input=`` keyword."""
    return args[0] if args else kwargs.get("input")


def refuse_sequence_first(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], batched: dict[int, bool],
                          batch: int) -> None:
    """Raises when a ``batch_first=False`` module (attention, recurrent) gets a 3-D input whose
    first dimension is the batch by provenance: it would run along the batch as if it were the
    sequence and mix examples."""
    if getattr(module, "batch_first", True):
        return
    x = args[0] if args else kwargs.get("query", kwargs.get("input"))
    if isinstance(x, torch.Tensor) and x.dim() == 3 and batched.get(id(x), False):
        raise InputValueError(
            f"{type(module).__name__}(batch_first=False) got an input of shape {tuple(x.shape)} whose first "
            f"dimension is the batch ({batch} examples): the module then runs along the batch as if "
            "it were the sequence and mixes examples (one example's gradient would depend on the others). "
            "Build the module with batch_first=True and pass [batch, sequence, features]."
        )


def same_output(ours: torch.Tensor, ref: torch.Tensor) -> bool:
    """Whether a rule's recomputation of a call reproduces the module's own output (to 1e-4
    relative, 1e-5 of the largest entry): the check a rewriting rule makes before it replaces
    an output (it guards correctness; the clip bound holds either way). One host read."""
    ref = ref.detach()
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    return bool(torch.allclose(ours.detach(), ref, rtol=1e-4, atol=1e-5 * scale + 1e-30))


def same_outputs(ours: Any, ref: Any) -> bool:
    """:func:`same_output` over every tensor of two outputs (tuples, ``None`` entries): the
    same number of tensors, each reproduced."""
    mine = [t for t in optree.tree_leaves(ours) if isinstance(t, torch.Tensor)]
    theirs = [t for t in optree.tree_leaves(ref) if isinstance(t, torch.Tensor)]
    return ours is not None and len(mine) == len(theirs) and all(same_output(o, r) for o, r in zip(mine, theirs))


def checked_once(cache: dict[tuple[Any, ...], bool], key: tuple[Any, ...], compute: Callable[[], Any],
                 reproduces: Callable[[Any], bool]) -> Any:
    """A rewriting rule's output ``compute()``, trusted for the call signature ``key`` only
    once ``reproduces(output)`` held on its first call (one host read, kept in ``cache``
    across steps); None for a signature whose check failed (the module's own output stays)."""
    if cache.get(key) is False:
        return None
    out = compute()
    if out is None:
        return None
    if key not in cache:
        cache[key] = reproduces(out)
        if not cache[key]:
            return None  # the caller registers the taps only for a replaced output
    return out


def roles(names: dict[str, int]) -> dict[str, str]:
    """``{name: name}``: a module's own parameter names are their roles ("weight", "bias")."""
    return {n: n for n in names}


__all__ = ["BuildContext", "Rule", "checked_once", "first_input", "refuse_sequence_first", "roles", "same_output", "same_outputs"]
