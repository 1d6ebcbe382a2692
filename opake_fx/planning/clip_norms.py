"""Clip norms as a plan takes them: one norm, per-group norms, or parameter-name regexes."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import opake_fx.validation as check
from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.types import PerGroup

__all__ = ["regex_norms", "per_group_by_regex", "clipping_norm_value"]


def regex_norms(norms: Any, where: str, hint: str = "") -> tuple[dict[str, re.Pattern[str]], dict[str, float]]:
    """Validates per-group clip norms given as ``{regex: C_g, ..., "fallback": C}``.

    Returns the compiled regexes (``"fallback"`` excluded) and the norms, in the dict's
    order. The one check of this form, for :func:`per_group_by_regex` and the trainer's
    ``TrainingArguments(clipping_norm={...})``.

    Raises:
        InputTypeError: ``norms`` is not a dict, or a key is not a string.
        InputValueError: an empty dict, a norm that is not finite and > 0 (``hint`` is
            appended), a key that is not a valid regular expression.

    Example:
        >>> rx, values = regex_norms({"attn": 1.0, "fallback": 2.0}, "example")
        >>> list(rx), values
        (['attn'], {'attn': 1.0, 'fallback': 2.0})
    """
    if not isinstance(norms, Mapping):
        raise InputTypeError(f"{where}: per-group norms must be a dict of regex -> norm (with 'fallback'); got "
                             f"{type(norms).__name__}.")
    if not norms:
        raise InputValueError(f"{where}: clipping_norm={{}} has no group; give {{regex: norm, ..., 'fallback': norm}} or one float.")
    compiled: dict[str, re.Pattern[str]] = {}
    values: dict[str, float] = {}
    for pattern, norm in norms.items():
        if not isinstance(pattern, str):
            raise InputTypeError(f"{where}: clipping_norm's keys are parameter-name regexes (strings); got {pattern!r}.")
        values[pattern] = check.positive(norm, f"clipping_norm[{pattern!r}]", where, hint)
        if pattern != "fallback":
            try:
                compiled[pattern] = re.compile(pattern)
            except re.error as err:
                raise InputValueError(f"{where}: clipping_norm key {pattern!r} is not a valid regular expression ({err}).") from None
    return compiled, values


def per_group_by_regex(params: Any, names: Sequence[str], norms: Mapping[str, float]) -> PerGroup:
    """Per-group clip norms from parameter-name regexes: ``{regex: C_g, ..., "fallback": C}``.

    Each parameter (leaf ``i`` of ``params``, named ``names[i]``, e.g. ``fmodel.param_names``
    of :func:`~opake_fx.functional.make_functional`) goes to the FIRST regex, in the
    dict's order, that ``re.search``-es its name, else to ``"fallback"``. The groups are
    named by their regex (and ``"fallback"``); the result is the
    :class:`~opake_fx.types.PerGroup` of :func:`opake_fx.dpsgd.clipping.per_group`.

    Args:
        params: the parameter pytree the clip stage is given (its leaves in ``names`` order).
        names: one name per leaf.
        norms: regex -> clip norm (finite, > 0), and optionally ``"fallback"`` -> norm.

    Raises:
        InputValueError: an invalid regex or norm; a regex that takes no parameter (it
            matches none, or only parameters an earlier regex took); a parameter that no
            regex matches when there is no ``"fallback"``.

    Privacy: none by itself; a plan clipping to these groups has total sensitivity
    ``sqrt(sum_g C_g**2)`` over the groups that have parameters (an unused ``"fallback"``
    does not count).

    Example:
        >>> import torch
        >>> pg = per_group_by_regex((torch.ones(2), torch.ones(1)), ["attn.weight", "head.bias"],
        ...                         {"attn": 3.0, "fallback": 4.0})
        >>> pg.for_path((0,)), pg.for_path((1,)), pg.effective
        (3.0, 4.0, 5.0)
    """
    from opake_fx.dpsgd.clipping import per_group

    where = "clipping_norm"
    compiled, values = regex_norms(norms, "per-group clipping", "Each group's clip norm is a finite number > 0.")
    names = [str(n) for n in names]
    owner: dict[str, str] = {}
    for name in names:
        hit = next((p for p, rx in compiled.items() if rx.search(name)), None)
        if hit is None and "fallback" in values:
            hit = "fallback"
        if hit is not None:
            owner[name] = hit
    unmatched = [n for n in names if n not in owner]
    if unmatched:
        raise InputValueError(
            f"{where}: trainable parameter(s) {unmatched[:5]}{' ...' if len(unmatched) > 5 else ''} match no regex "
            f"of {sorted(compiled)} and there is no 'fallback' entry. Add \"fallback\": <norm>, or a regex that "
            "matches them."
        )
    taken = set(owner.values())
    for pattern, rx in compiled.items():
        if pattern in taken:
            continue
        matched = [n for n in names if rx.search(n)]
        why = (f"matches no trainable parameter (they are {names[:6]}{' ...' if len(names) > 6 else ''})"
               if not matched else f"matches only parameters an earlier regex took ({matched[:3]})")
        raise InputValueError(
            f"{where}: the regex {pattern!r} {why}. Fix or remove it (regexes are re.search-ed against the trainable "
            "parameter names, first match in the dict's order wins)."
        )
    group_of = {p: (p if p not in ("params", "names") else f"re:{p}") for p in values}  # per_group's own keywords
    groups = {group_of[p]: (values[p], (lambda q: lambda name, leaf: owner.get(name) == q)(p))
              for p in values if p in taken}
    return per_group(params, names=names, **groups)


def clipping_norm_value(c: Any) -> float | PerGroup:
    """The plan's clipping_norm checked: a finite float > 0, or a PerGroup (also from its ``to_dict`` data).

    Example:
        >>> clipping_norm_value(1), clipping_norm_value({"groups": [[[0], "a"]], "values": {"a": 2.0}}).effective
        (1.0, 2.0)
    """
    if isinstance(c, Mapping):
        if set(c) != {"groups", "values"}:
            raise InputValueError(
                "DPPlan: clipping_norm as a dict must be the plain data of per-group norms, {'groups': [[path, "
                f"group], ...], 'values': {{group: norm}}}} (what to_dict writes); got keys {sorted(map(str, c))}. For "
                "parameter-name regex -> norm, build the PerGroup with opake_fx.plan.per_group_by_regex(params, "
                "names, norms) (DPTrainer does it from TrainingArguments.clipping_norm)."
            )
        try:
            c = PerGroup({tuple(path): group for path, group in c["groups"]}, dict(c["values"]))
        except (TypeError, ValueError) as err:
            raise InputValueError(f"DPPlan: clipping_norm's per-group data is malformed ({err}).") from None
    if isinstance(c, PerGroup):
        if not c.groups:
            raise InputValueError("DPPlan: a per-group clipping_norm must assign at least one parameter leaf.")
        bad = {g: v for g, v in c.values.items() if not (v > 0 and math.isfinite(v))}
        if bad:
            raise InputValueError(f"DPPlan: per-group clip norms must be finite and > 0; got {bad}.")
        return c
    v = check.real(c, "clipping_norm", "DPPlan", "the per-example clip norm, e.g. 1.0, or a PerGroup")
    if not (v > 0 and math.isfinite(v)):
        raise InputValueError(f"DPPlan: clipping_norm must be finite and > 0; got {v}.")
    return v
