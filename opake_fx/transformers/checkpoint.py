"""The DP part of a DPTrainer checkpoint: ``dp_state.rank{r}.pt`` and ``accountant.json``.

A Hugging Face checkpoint directory holds the model (or the adapters), the trainer state
and the callbacks' state. DPTrainer adds what the private run depends on, through
:mod:`opake_fx.serialization` (atomic, checksummed, nothing imported on load):

* ``dp_state.rank{r}.pt``: the trainable parameters, the pipeline state (clip state, the
  noise key and step, the optimizer), the rank's sampler position, the accountant's spent
  composition and the privacy seed;
* ``accountant.json`` (human-readable): the plan, the steps taken and the epsilon spent.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from opake_fx.errors import CheckpointError
from opake_fx.serialization import load_checkpoint, save_checkpoint

__all__ = ["ACCOUNTANT_NAME", "dp_state_name", "save_dp_state", "load_dp_state", "write_accountant_json", "read_accountant_json"]

ACCOUNTANT_NAME = "accountant.json"


def dp_state_name(rank: int) -> str:
    """The file of rank ``rank``'s DP state in a checkpoint directory."""
    return f"dp_state.rank{rank}.pt"


def save_dp_state(directory: str, rank: int, *, params: Any, state: Any, sampler: Any, accountant: Any, meta: dict[str, Any]) -> None:
    """Writes rank ``rank``'s DP state into ``directory`` (atomically)."""
    trees: dict[str, Any] = {"params": params, "state": state, "sampler": sampler, "meta": meta}
    if accountant is not None:
        trees["accountant"] = accountant
    save_checkpoint(os.path.join(directory, dp_state_name(rank)), **trees)


def load_dp_state(directory: str, rank: int, *, params: Any, state: Any, sampler: Any, accountant: Any, meta: dict[str, Any]) -> dict[str, Any]:
    """Reads rank ``rank``'s DP state from ``directory``; the arguments are the templates.

    Raises:
        CheckpointError: the directory has no DP state (e.g. saved with ``save_only_model``:
            a weights-only export cannot be resumed), or it does not fit the run.
    """
    path = os.path.join(directory, dp_state_name(rank))
    if not os.path.isfile(path):
        raise CheckpointError(
            f"DPTrainer: {directory} has no {dp_state_name(rank)}, so the private run cannot be resumed from it "
            "(was it saved with save_only_model=True, or by a plain Trainer?). Resume from a DPTrainer checkpoint."
        )
    templates: dict[str, Any] = {"params": params, "state": state, "sampler": sampler, "meta": meta}
    if accountant is not None:
        templates["accountant"] = accountant
    return load_checkpoint(path, **templates)


def write_accountant_json(directory: str, *, plan: Any, steps: int, epsilon: float, accountant: Any) -> None:
    """``accountant.json``: the plan, the steps taken, epsilon spent and the accountant's state."""
    doc = {
        "plan": plan.to_dict(),
        "steps": steps,
        "epsilon": epsilon if math.isfinite(epsilon) else "inf",
        "delta": plan.delta,
        "noise_multiplier": plan.noise_multiplier,
        "accountant": None if accountant is None else accountant.state_dict(),
    }
    tmp = os.path.join(directory, ACCOUNTANT_NAME + ".tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(directory, ACCOUNTANT_NAME))


def read_accountant_json(directory: str) -> dict[str, Any]:
    """The content of ``accountant.json`` (``epsilon`` as a float, inf included)."""
    with open(os.path.join(directory, ACCOUNTANT_NAME)) as f:
        doc = json.load(f)
    if doc.get("epsilon") == "inf":
        doc["epsilon"] = math.inf
    return doc
