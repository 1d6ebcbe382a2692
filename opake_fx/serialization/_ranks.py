"""The cross-rank check of :func:`~opake_fx.serialization.load_checkpoint`.

Every rank adds the same noise after the all-reduce only if every rank resumed with the
same noise key and step (and adaptive clipping with the same count-noise key, step and
norm). Each rank loads its own file, so a stale or mixed-up file on one rank would
silently desynchronise the noise; this check turns that into an error on every rank.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Mapping
from typing import Any

import torch

from opake_fx.distributed import all_reduce, get_world_size, is_distributed
from opake_fx.errors import DistributedMismatchError
from opake_fx.random import RngKey


def _shared_fields() -> dict[type, tuple[str, ...]]:
    """type -> the fields every rank must agree on (imported only when distributed)."""
    from opake_fx.dpftrl.noise import MfNoiseState
    from opake_fx.dpsgd.clipping import AdaptiveClipState
    from opake_fx.dpsgd.noise import GaussianNoiseState

    return {
        GaussianNoiseState: ("key", "step"),
        MfNoiseState: ("key", "step", "max_norm"),
        AdaptiveClipState: ("key", "step", "clipping_norm"),
    }


def check_shared_state(trees: Mapping[str, Any], where: str) -> None:
    """Raises ``DistributedMismatchError`` on every rank if the ranks restored different shared values.

    A no-op in a single process. Issues the same collectives on every rank.
    """
    if not is_distributed() or get_world_size() < 2:
        return
    labels: list[str] = []
    values: list[int] = []
    shared = _shared_fields()
    for name, tree in trees.items():
        _collect(tree, name, shared, labels, values)
    count = torch.tensor([len(values)], dtype=torch.int64)
    if int(all_reduce(count, "min")) != int(all_reduce(count, "max")):
        raise DistributedMismatchError(
            f"load_checkpoint({where}): the ranks restored different numbers of noise / adaptive-clipping states; "
            "every rank must load a checkpoint of the same run and step."
        )
    vec = torch.tensor(values, dtype=torch.int64)
    low, high = all_reduce(vec, "min"), all_reduce(vec, "max")
    differ = sorted({labels[i] for i in torch.nonzero(low != high).flatten().tolist()})
    if differ:
        raise DistributedMismatchError(
            f"load_checkpoint({where}): the ranks restored different {', '.join(differ)}. Every rank must resume "
            "from the same step of the same run (the noise key and step are shared); check each rank's checkpoint file."
        )


def _collect(obj: Any, path: str, shared: dict[type, tuple[str, ...]], labels: list[str], values: list[int]) -> None:
    fields = shared.get(type(obj))
    if fields is not None:
        for f in fields:
            ints = _as_ints(getattr(obj, f))
            labels.extend([f"{path}.{f}"] * len(ints))
            values.extend(ints)
        return
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            _collect(v, f"{path}/{k}", shared, labels, values)
    elif isinstance(obj, (tuple, list)):
        names = getattr(obj, "_fields", None) or [str(i) for i in range(len(obj))]
        for k, v in zip(names, obj):
            _collect(v, f"{path}/{k}", shared, labels, values)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _collect(getattr(obj, f.name), f"{path}/{f.name}", shared, labels, values)


def _as_ints(value: Any) -> list[int]:
    if isinstance(value, RngKey):
        return list(value.words)
    if value is None:
        return [-1]
    if isinstance(value, float):
        return [struct.unpack("<q", struct.pack("<d", value))[0]]
    if isinstance(value, int):
        return [value]
    return [struct.unpack("<q", struct.pack("<d", float(value.effective)))[0]]  # a PerGroup norm
