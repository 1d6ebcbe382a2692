"""The registry of layer rules: which rule (:class:`._rule.Rule`) takes each module call.

Users' rules (:func:`~.rules.register_rule`, keyed by module type) come first, then the
built-in entries in this order, the first that claims the module winning:

=====================  =========================================  =======================
entry                  claims                                     file
=====================  =========================================  =======================
``linear``             ``nn.Linear``                              ``_rules_linear.py``
``linear_t``           transformers' ``Conv1D`` (GPT-2)           ``_rules_linear.py``
``conv``               ``nn.Conv1d`` / ``nn.Conv2d``              ``_rules_linear.py``
``embedding``          ``nn.Embedding``                           ``_rules_embedding.py``
``embedding_bag``      ``nn.EmbeddingBag``                        ``_rules_embedding.py``
``norm``               ``nn.LayerNorm`` / ``GroupNorm`` / ``RMSNorm``  ``_rules_norm.py``
``attention``          ``nn.MultiheadAttention``                  ``_rules_attention.py``
``recurrent``          ``nn.RNN`` / ``nn.LSTM`` / ``nn.GRU``      ``_rules_recurrent.py``
``affine_norm``        norm-like by structure and computation     ``_rules_norm.py``
``fallback``           any other module with parameters           ``_rules_fallback.py``
=====================  =========================================  =======================

A torch type is claimed only when the module runs that type's own ``forward`` (a subclass
with its own ``forward`` computes something else and goes on down the table).

Two entries claim no module; other entries create their calls: ``projection`` (the
attention rule's tapped input projections) and ``elementwise`` (``_rules_elementwise.py``:
broadcasts of a module's own parameters, watched while a module that only the fallback
would take runs its ``forward``).

Example:
    >>> from torch import nn
    >>> from opake_fx.dpsgd.clipping import _registry
    >>> [_registry.lookup(m).kind for m in (nn.Linear(2, 3), nn.LSTM(2, 3), nn.PReLU(3), nn.Bilinear(2, 2, 1))]
    ['linear', 'recurrent', 'affine_norm', 'fallback']
"""

from __future__ import annotations

from torch import nn

from opake_fx.dpsgd.clipping._rule import Rule
from opake_fx.dpsgd.clipping._rules_attention import ATTENTION
from opake_fx.dpsgd.clipping._rules_embedding import EMBEDDING, EMBEDDING_BAG
from opake_fx.dpsgd.clipping._rules_fallback import FALLBACK
from opake_fx.dpsgd.clipping._rules_linear import CONV, LINEAR, TRANSPOSED_LINEAR
from opake_fx.dpsgd.clipping._rules_norm import AFFINE_NORM, NORM
from opake_fx.dpsgd.clipping._rules_recurrent import RECURRENT
from opake_fx.dpsgd.clipping._rules_registered import LayerRule, UserRule

BUILT_IN: tuple[Rule, ...] = (LINEAR, TRANSPOSED_LINEAR, CONV, EMBEDDING, EMBEDDING_BAG, NORM, ATTENTION, RECURRENT,
                              AFFINE_NORM, FALLBACK)

# Users' rules (documented module state, like ``register_sync_type``): module type -> entry.
_USER: dict[type, UserRule] = {}


def lookup(module: nn.Module) -> Rule:
    """The rule that takes ``module``'s calls: a user's rule for its type, else the first
    built-in entry that claims it (the fallback claims every module)."""
    if _USER:
        found = user_rule(module)
        if found is not None:
            return found
    return built_in(module)


def built_in(module: nn.Module) -> Rule:
    """The first built-in entry that claims ``module``."""
    for rule in BUILT_IN:
        if rule.claims(module):
            return rule
    return FALLBACK


def user_rule(module: nn.Module) -> UserRule | None:
    """The rule registered for ``module``'s type, or for the nearest registered base class
    whose ``forward`` the module still runs; None otherwise."""
    for base in type(module).__mro__:
        rule = _USER.get(base)
        if rule is not None:
            return rule if type(module).forward is base.forward else None
    return None


def add_user(module_type: type, fn: LayerRule) -> None:
    """Registers ``fn`` for ``module_type`` (validated by :func:`~.rules.register_rule`)."""
    _USER[module_type] = UserRule(fn, built_in)


def remove_user(module_type: type) -> None:
    """Removes the user's rule for ``module_type`` (no-op if there is none)."""
    _USER.pop(module_type, None)


def built_in_types() -> frozenset[type]:
    """The module types the built-in entries are keyed by."""
    return frozenset(t for rule in BUILT_IN for t in rule.types)


__all__ = ["BUILT_IN", "add_user", "built_in", "built_in_types", "lookup", "remove_user", "user_rule"]
