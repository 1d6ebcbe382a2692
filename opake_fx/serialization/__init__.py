"""Checkpoints of explicit state that resume a run exactly.

Every state in opake_fx is a value — keys, clip, noise and optimizer states, chains of
them (tuples, dicts, ``NamedTuple`` s), samplers, schedules, an ``Accountant`` — so a
whole run checkpoints in one call and resumes bit for bit::

    save_checkpoint(path, params=params, state=state, sampler=sampler, accountant=acct)
    ...
    ckpt = load_checkpoint(path, params=params0, state=pipeline.init(params0),
                           sampler=sampler0, accountant=acct0)
    params, state = ckpt["params"], ckpt["state"]

* :func:`state_dict` / :func:`from_state_dict`: a state as a flat ``{path: leaf}`` dict,
  rebuilt from a *template* that decides every class, dtype and device.
* :func:`register_serializer`: the same for types of your own (importing this package
  registers the library's own types, so every function here finds them).
* :func:`save_checkpoint` / :func:`load_checkpoint`: atomic, checksummed files
  (:func:`read_checkpoint` / :func:`restore_trees`: the same in two parts).
* :func:`save_run` / :func:`load_run` (``DPPlan.save_checkpoint`` / ``load_checkpoint``):
  one step of one plan's run, refused on load unless the plan identity (inside the
  file), every counter, the keys and the privacy parameters agree.

Loading never imports or calls anything named in a file (``torch.load(weights_only=True)``
reads it). See ``docs/checkpoints.md``.

Privacy: a checkpoint holds the noise keys and steps; restoring them continues the noise
sequence (no noise is reused), and restoring the ``Accountant`` keeps what was spent. The
checksum detects a damaged file, not a writer who recomputes it: that a file is one
consistent step of one run is what :func:`load_run` checks.
"""

from opake_fx.serialization.files import load_checkpoint, read_checkpoint, restore_trees, save_checkpoint
from opake_fx.serialization.runs import load_run, plan_identity, refuse_together, run_counters, save_run
from opake_fx.serialization._registry import register_serializer
from opake_fx.serialization.tree import from_state_dict, state_dict
from opake_fx.serialization import _builtin  # noqa: F401  (registers the library's own types)

__all__ = ["state_dict", "from_state_dict", "register_serializer", "save_checkpoint", "load_checkpoint",
           "read_checkpoint", "restore_trees", "save_run", "load_run", "run_counters", "plan_identity", "refuse_together"]
