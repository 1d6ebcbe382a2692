"""Per-example gradient clipping: the step that bounds each example's influence.

* :func:`clipped_grad` — fixed clip norm (global or per group).
* :func:`auto_clipped_grad` — AUTO-S normalisation (Bu et al. 2023).
* :func:`adaptive_clipped_grad` — private quantile tracking (Andrew et al. 2021).
* :func:`per_group` — build per-group clip norms from parameter names.
* :func:`register_rule` — a fast-clipping rule for a module type of yours.
* :func:`clip`, :func:`auto_clip`, :func:`adaptive_clip` / :func:`as_stage` — the same as chain stages.

Every function returns a :class:`~opake_fx.types.ClippedPytree` whose ``max_norm`` is
its L2 sensitivity under add-or-remove-one neighbours.
"""

from opake_fx.dpsgd.clipping.adaptive import AdaptiveClipState, adaptive_clipped_grad
from opake_fx.dpsgd.clipping.auto import auto_clipped_grad
from opake_fx.dpsgd.clipping.fixed import clipped_grad
from opake_fx.dpsgd.clipping.groups import per_group
from opake_fx.dpsgd.clipping.rules import LayerRule, register_rule, unregister_rule
from opake_fx.dpsgd.clipping.stage import ClipStageState, adaptive_clip, as_stage, auto_clip, clip
from opake_fx.dpsgd.clipping.types import ClippedGradAux, ClippingStats, FixedClipState

__all__ = [
    "clipped_grad",
    "auto_clipped_grad",
    "adaptive_clipped_grad",
    "per_group",
    "register_rule",
    "unregister_rule",
    "LayerRule",
    "clip",
    "auto_clip",
    "adaptive_clip",
    "as_stage",
    "ClipStageState",
    "FixedClipState",
    "AdaptiveClipState",
    "ClippingStats",
    "ClippedGradAux",
]
