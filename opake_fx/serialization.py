"""Checkpointing of explicit state: :func:`state_dict` and :func:`from_state_dict`.

Every state in opake_fx is a value (frozen dataclasses, tuples and dicts of them, keys,
tensors), so a whole pipeline state — ``pipeline.init(params)`` or what ``update``
returned — checkpoints with one call and ``torch.save``::

    torch.save({"params": params, "state": state_dict(state)}, path)
    ...
    ckpt = torch.load(path)
    state = from_state_dict(ckpt["state"])

The encoding uses plain containers (dict/list/str/int/float/bool/None) and tensors.
Only opake_fx's own dataclasses (and ones registered with :func:`register_serializable`)
are rebuilt, so loading a checkpoint never imports arbitrary code.

Privacy: restoring a noise state restores its key and step, so a resumed run continues
the exact noise sequence instead of reusing noise already spent.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from types import MappingProxyType
from typing import Any

import torch

from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.random import RngKey
from opake_fx.typing import typechecked

__all__ = ["state_dict", "from_state_dict", "register_serializable"]

_TYPE = "__opake_type__"
_EXTRA: dict[str, type] = {}


@typechecked
def register_serializable(cls: type) -> type:
    """Allows a user dataclass to be rebuilt by :func:`from_state_dict` (usable as a decorator)."""
    if not dataclasses.is_dataclass(cls):
        raise InputTypeError(f"register_serializable needs a dataclass; got {cls!r}.")
    _EXTRA[_qualname(cls)] = cls
    return cls


def state_dict(obj: Any) -> Any:
    """Encodes a state (dataclasses, keys, tensors, containers) as plain data + tensors.

    Example:
        >>> from opake_fx.dpsgd.noise import GaussianNoiseState
        >>> from opake_fx.random import key
        >>> d = state_dict(GaussianNoiseState(key(3), step=7))
        >>> from_state_dict(d) == GaussianNoiseState(key(3), step=7)
        True
    """
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {_TYPE: "float", "repr": repr(obj)}
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, RngKey):
        return {_TYPE: "RngKey", "words": list(obj.words)}
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return {_TYPE: "tuple", "items": [state_dict(x) for x in obj]}
    if isinstance(obj, list):
        return [state_dict(x) for x in obj]
    if isinstance(obj, (dict, MappingProxyType)):
        if all(isinstance(k, str) for k in obj):
            return {_TYPE: "dict", "items": {k: state_dict(v) for k, v in obj.items()}}
        return {_TYPE: "pairs", "items": [[state_dict(k), state_dict(v)] for k, v in obj.items()]}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        name = _qualname(type(obj))
        _resolve(name)  # refuse to write what could not be read back
        fields = {f.name: state_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        return {_TYPE: name, "fields": fields}
    raise InputTypeError(
        f"state_dict cannot encode a {type(obj).__name__}. States are dataclasses, keys, tensors and "
        "containers; register your own dataclass with opake_fx.serialization.register_serializable."
    )


def from_state_dict(data: Any) -> Any:
    """Rebuilds what :func:`state_dict` encoded."""
    if isinstance(data, list):
        return [from_state_dict(x) for x in data]
    if not isinstance(data, dict):
        return data
    kind = data.get(_TYPE)
    if kind is None:
        raise InputValueError("from_state_dict got a dict that state_dict did not write (no type tag).")
    if kind == "float":
        return float(data["repr"])
    if kind == "RngKey":
        return RngKey(tuple(int(w) for w in data["words"]))  # type: ignore[arg-type]
    if kind == "tuple":
        return tuple(from_state_dict(x) for x in data["items"])
    if kind == "dict":
        return {k: from_state_dict(v) for k, v in data["items"].items()}
    if kind == "pairs":
        return {_hashable(from_state_dict(k)): from_state_dict(v) for k, v in data["items"]}
    cls = _resolve(kind)
    return cls(**{k: from_state_dict(v) for k, v in data["fields"].items()})


def _qualname(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _resolve(name: str) -> type:
    if name in _EXTRA:
        return _EXTRA[name]
    module, _, qual = name.partition(":")
    if not (module == "opake_fx" or module.startswith("opake_fx.")):
        raise InputValueError(
            f"{name} is not an opake_fx type; register it with register_serializable before saving or loading."
        )
    obj: Any = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and dataclasses.is_dataclass(obj)):
        raise InputValueError(f"{name} is not a dataclass state; refusing to rebuild it.")
    return obj


def _hashable(x: Any) -> Any:
    return tuple(_hashable(v) for v in x) if isinstance(x, list) else x
