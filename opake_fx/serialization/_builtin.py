"""Serializers for the library's own state that needs more than its fields: keys, ``PerGroup``,
samplers, clip states (configuration checked, not restored), ``Accountant``.

Registered in :mod:`opake_fx.serialization._registry` when this module is imported, which
the package ``opake_fx.serialization`` does: every function of the package finds them,
and the registry and :mod:`~opake_fx.serialization.tree` import none of these types.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
from typing import Any

import numpy as np
import torch

from opake_fx.accounting import Accountant
from opake_fx.dpftrl.sampling import BallsInBinsSampler, CyclicPoissonSampler, FixedEpochSampler, MinSepSampler
from opake_fx.dpsgd.clipping import AdaptiveClipState, FixedClipState
from opake_fx.dpsgd.clipping.adaptive import next_clipping_norm
from opake_fx.dpsgd.sampling import PoissonSampler, SequentialBatchSampler
from opake_fx.errors import CheckpointError
from opake_fx.random import RngKey, fold_in, normal
from opake_fx.serialization._registry import register_serializer
from opake_fx.serialization.tree import state_dict
from opake_fx.types import PerGroup
from opake_fx.users import UserPoissonSampler

# A key is one int64 tensor [hi, lo]: its path names the key, and the dtype rule of
# from_state_dict (integer tensors must match exactly) keeps a float from becoming a key.
register_serializer(
    RngKey,
    to_tree=lambda k: torch.tensor(k.words, dtype=torch.int64),
    from_tree=lambda template, words: RngKey(tuple(int(w) for w in words.tolist())),
)

# The group assignment is configuration (it follows the parameters): the template's is
# kept; the checkpoint supplies one value per group name.
register_serializer(
    PerGroup,
    to_tree=lambda pg: {"values": dict(pg.values)},
    from_tree=lambda template, tree: PerGroup(dict(template.groups), tree["values"]),
)


def _sampler_from_tree(template: Any, tree: dict[str, Any]) -> Any:
    # Samplers are the library's only mutable state; the template is left untouched.
    sampler = copy.deepcopy(template)
    sampler.load_state_dict(tree)
    return sampler


for _cls in (PoissonSampler, SequentialBatchSampler, CyclicPoissonSampler, BallsInBinsSampler, MinSepSampler, FixedEpochSampler,
             UserPoissonSampler):
    register_serializer(_cls, to_tree=lambda s: s.state_dict(), from_tree=_sampler_from_tree)


# Clip states: the privacy parameters they carry (the fixed clip norm; adaptive clipping's count
# noise multiplier, target quantile, learning rate and expected batch size) are configuration:
# the clipping function uses its own, and the saved copies are only compared with the template's
# (the configured stage's). A checkpoint that differs is refused, so a file cannot, e.g., turn the
# count noise off while the accountant charges for it. What is state (steps, the tracked norm,
# the last count and its noise) comes from the file and is checked for what it must satisfy.

_ADAPTIVE_CONFIG = ("target_quantile", "learning_rate", "count_noise_multiplier", "expected_batch_size")


def _fields_tree(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _same_configuration(template: Any, tree: dict[str, Any], names: tuple[str, ...]) -> None:
    differ = [f"{n}={tree[n]!r} (the pipeline has {getattr(template, n)!r})" for n in names
              if tree[n] != getattr(template, n)]
    if differ:
        raise CheckpointError(
            f"the {type(template).__name__} was saved with {', '.join(differ)}. Privacy parameters come from the "
            "pipeline (the plan), never from a checkpoint: a resumed run with other ones is another mechanism than "
            "the one accounted for. Build the pipeline with the run's parameters, or resume another checkpoint."
        )


def _step(value: Any, owner: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"{owner}.step must be an int >= 0; got {value!r}.")
    return value


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _fixed_clip_from_tree(template: FixedClipState, tree: dict[str, Any]) -> FixedClipState:
    _same_configuration(template, tree, ("clipping_norm",))
    return dataclasses.replace(template, step=_step(tree["step"], "FixedClipState"))


def _adaptive_clip_from_tree(template: AdaptiveClipState, tree: dict[str, Any]) -> AdaptiveClipState:
    _same_configuration(template, tree, _ADAPTIVE_CONFIG)
    state = dataclasses.replace(template, **{k: v for k, v in tree.items() if k not in _ADAPTIVE_CONFIG})
    step, c, prev = _step(state.step, "AdaptiveClipState"), state.clipping_norm, state.prev_clipping_norm
    if not (_finite(c) and c > 0):
        raise CheckpointError(f"AdaptiveClipState.clipping_norm must be a finite number > 0; got {c!r}.")
    if (prev is None) != (step == 0):
        raise CheckpointError(
            f"AdaptiveClipState: step={step} with prev_clipping_norm={prev!r}; a state has a previous norm exactly "
            "when it has taken a step."
        )
    if prev is None:
        return state
    for name in ("prev_clipping_norm", "centered_count", "count_noise"):
        if not _finite(getattr(state, name)):
            raise CheckpointError(f"AdaptiveClipState.{name} must be a finite number; got {getattr(state, name)!r}.")
    # the last count's noise is a function of the key and the step: a file cannot remove it
    drawn = state.count_noise_multiplier * float(normal(fold_in(state.key, step - 1), (), dtype=torch.float64, exact=True))
    if state.count_noise != drawn:
        raise CheckpointError(
            f"AdaptiveClipState.count_noise={state.count_noise!r} is not the noise drawn for step {step - 1} "
            f"({drawn!r} from the count key): the saved norm would follow a count without its noise."
        )
    if c != next_clipping_norm(state, state.centered_count):
        raise CheckpointError(
            f"AdaptiveClipState.clipping_norm={c!r} is not the update of prev_clipping_norm={prev!r} by the saved "
            f"count and its noise ({next_clipping_norm(state, state.centered_count)!r})."
        )
    return state


register_serializer(FixedClipState, to_tree=_fields_tree, from_tree=_fixed_clip_from_tree)
register_serializer(AdaptiveClipState, to_tree=_fields_tree, from_tree=_adaptive_clip_from_tree)


# The Accountant: its budget and spent process (registry-typed JSON, rebuilt without importing
# anything by name), and its running composition -- the PMF pair of its IncrementalPld and
# the RDP curve summed so far -- as float64 tensors that grow with the run (hence
# variable_shapes) and plain numbers, so that a resumed accountant continues bit for bit.
# The entries are the same for every accountant of a budget kind (absent parts are empty
# tensors with a False "present"), and a SHA-256 digest over all of them refuses a running
# state that was truncated, altered or spliced from another checkpoint.

_EMPTY = torch.zeros(0, dtype=torch.float64)


def _vector(array: np.ndarray | None) -> torch.Tensor:
    return _EMPTY.clone() if array is None else torch.from_numpy(np.array(array, dtype=np.float64))


def _array(tensor: torch.Tensor) -> np.ndarray:
    return np.array(tensor.detach().cpu().numpy(), dtype=np.float64, copy=True)


def _pmf_tree(pmf: dict[str, Any] | None) -> dict[str, Any]:
    if pmf is None:
        return {"present": False, "d": 0.0, "lo": 0, "inf": 0.0, "probs": _EMPTY.clone(), "log_mgfs": _EMPTY.clone()}
    return {"present": True, "d": pmf["d"], "lo": pmf["lo"], "inf": pmf["inf"], "probs": _vector(pmf["probs"]),
            "log_mgfs": _vector(pmf["log_mgfs"])}


def _pmf_state(tree: dict[str, Any]) -> dict[str, Any] | None:
    if not tree["present"]:
        return None
    mgf = tree["log_mgfs"]
    return {"d": tree["d"], "lo": tree["lo"], "inf": tree["inf"], "probs": _array(tree["probs"]),
            "log_mgfs": None if mgf.numel() == 0 else _array(mgf)}


def _accountant_to_tree(acct: Accountant) -> dict[str, Any]:
    state = acct.state_dict(running=True)
    running = dict(state.pop("running"))
    pld, rdp_sum = running.pop("pld"), running.pop("rdp_sum")
    tree: dict[str, Any] = {
        "state": json.dumps({**state, "running": running}, sort_keys=True),
        "pld": {
            "present": pld is not None,
            "relation": None if pld is None else pld["relation"],
            "folds": 0 if pld is None else pld["folds"],
            "remove": _pmf_tree(None if pld is None else pld["remove"]),
            "add": _pmf_tree(None if pld is None else pld["add"]),
        },
        "rdp_sum": _vector(rdp_sum),
    }
    tree["digest"] = _digest(tree)
    return tree


def _digest(tree: dict[str, Any]) -> str:
    """SHA-256 over every entry but the digest: paths, kinds, values, tensor dtypes, shapes, bytes."""
    h = hashlib.sha256()
    flat = state_dict({k: v for k, v in tree.items() if k != "digest"})
    for path in sorted(flat):
        value = flat[path]
        h.update(path.encode() + b"\0")
        if isinstance(value, torch.Tensor):
            h.update(f"{value.dtype}{tuple(value.shape)}".encode() + value.detach().cpu().contiguous().numpy().tobytes())
        else:
            h.update(f"{type(value).__name__}:{value!r}".encode())
        h.update(b"\0")
    return h.hexdigest()


def _accountant_from_tree(template: Accountant, tree: dict[str, Any]) -> Accountant:
    if tree["digest"] != _digest(tree):
        raise CheckpointError(
            "the accountant's running state does not match its digest: it was truncated, altered, or its "
            "entries come from different checkpoints. Resume from an intact checkpoint."
        )
    state = _json(tree["state"])
    if not isinstance(state, dict) or not isinstance(state.get("running"), dict):
        raise CheckpointError("the accountant's 'state' entry is not the JSON that save_checkpoint writes.")
    pld = tree["pld"]
    state["running"]["pld"] = None if not pld["present"] else {
        "relation": pld["relation"],
        "folds": pld["folds"],
        "remove": _pmf_state(pld["remove"]),
        "add": _pmf_state(pld["add"]),
    }
    state["running"]["rdp_sum"] = None if tree["rdp_sum"].numel() == 0 else _array(tree["rdp_sum"])
    return _same_budget(template, _restored(state))


def _accountant_from_leaf(template: Accountant, text: Any) -> Accountant:
    # A checkpoint written before the running composition was saved: the budget and the spent
    # process only. The composition is recomputed in one go, so the resumed accountant agrees
    # with the uninterrupted one to ~1e-9 relative, not bit for bit (docs/checkpoints.md).
    if not isinstance(text, str):
        raise CheckpointError(f"the accountant's entry is a {type(text).__name__}, not the JSON state an older save wrote.")
    return _same_budget(template, _restored(_json(text)))


def _restored(state: Any) -> Accountant:
    if not isinstance(state, dict):
        raise CheckpointError(f"the accountant's state is a JSON {type(state).__name__}, not an object.")
    try:
        return Accountant.from_state_dict(state)
    except (KeyError, IndexError, AttributeError) as exc:  # a field missing deep inside (budget, process)
        raise CheckpointError(f"the accountant's state is incomplete or malformed ({exc!r}).") from None


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"the accountant's state is not valid JSON ({exc}).") from None


def _same_budget(template: Accountant, restored: Accountant) -> Accountant:
    if restored.budget != template.budget:
        raise CheckpointError(
            f"the checkpoint's budget {restored.budget!r} differs from the template's {template.budget!r}; "
            "build the Accountant with the budget the run was accounted against."
        )
    return restored


register_serializer(
    Accountant,
    to_tree=_accountant_to_tree,
    from_tree=_accountant_from_tree,
    variable_shapes=True,
    from_leaf=_accountant_from_leaf,
)
