"""Serializers for the library's own non-dataclass state: keys, ``PerGroup``, samplers, ``Accountant``.

Imported once, on the first use of the registry (it imports the samplers and the
accounting, which must not be imported when ``opake_fx.serialization`` is).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import torch

from opake_fx.accounting import Accountant
from opake_fx.dpftrl.sampling import BallsInBinsSampler, CyclicPoissonSampler, FixedEpochSampler, MinSepSampler
from opake_fx.dpsgd.sampling import PoissonSampler, SequentialBatchSampler
from opake_fx.errors import CheckpointError
from opake_fx.random import RngKey
from opake_fx.serialization.tree import register_serializer
from opake_fx.types import PerGroup

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


for _cls in (PoissonSampler, SequentialBatchSampler, CyclicPoissonSampler, BallsInBinsSampler, MinSepSampler, FixedEpochSampler):
    register_serializer(_cls, to_tree=lambda s: s.state_dict(), from_tree=_sampler_from_tree)


def _accountant_to_tree(acct: Accountant) -> str:
    # The spent process is a composition whose shape grows with the run, so it cannot come
    # from a template: it is one entry, the accountant's own JSON state (registry-typed,
    # rebuilt without importing anything by name).
    return json.dumps(acct.state_dict(), sort_keys=True)


def _accountant_from_tree(template: Accountant, text: str) -> Accountant:
    try:
        state = json.loads(text)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"the accountant's state is not valid JSON ({exc}).") from None
    restored = Accountant.from_state_dict(state)
    if restored.budget != template.budget:
        raise CheckpointError(
            f"the checkpoint's budget {restored.budget!r} differs from the template's {template.budget!r}; "
            "build the Accountant with the budget the run was accounted against."
        )
    return restored


register_serializer(Accountant, to_tree=_accountant_to_tree, from_tree=_accountant_from_tree)
