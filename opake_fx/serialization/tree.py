"""Template-driven flattening of states: :func:`state_dict`, :func:`from_state_dict`, :func:`register_serializer`.

:func:`state_dict` turns a state into a flat ``{path: leaf}`` dict whose leaves are
tensors and plain values (``None``, ``bool``, ``int``, ``float``, ``str``);
:func:`from_state_dict` rebuilds a state from such a dict *and a template* — a state of
the same structure, typically ``pipeline.init(params)``. The template decides every
class, container, dtype and device; the dict supplies only the leaf values. The dict
names no class and no function, so nothing is imported or called by a name read from a
file, and the dict saves and loads with ``torch.load(..., weights_only=True)``.

Types that need more than their fields are looked up in
:mod:`opake_fx.serialization._registry` (:func:`register_serializer` is re-exported here);
this module knows none of them.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch

from opake_fx.errors import CheckpointError, InputTypeError, OpakeError
from opake_fx.serialization._registry import register_serializer, serializer_for

__all__ = ["state_dict", "from_state_dict", "register_serializer"]

SEPARATOR = "/"
"""Joins the components of an entry's path: ``"opt/mu/weight"``."""

_PLAIN = (type(None), bool, int, float, str)
_MAX_LISTED = 8


def state_dict(obj: Any) -> dict[str, Any]:
    """Flattens a state into ``{path: leaf}`` with tensor and plain-value leaves.

    Paths join dict keys, field names and indices with ``"/"`` (a ``"/"`` or ``"%"``
    inside a key is written ``%2F`` / ``%25``); a leaf at the root has the path ``""``.
    Tensors are detached copies, so later in-place updates do not change the dict.

    Args:
        obj: tensors, plain values, tuples, lists, dicts, ``NamedTuple`` s, dataclasses
            and registered types (every opake_fx state, keys, samplers, schedules, an
            ``Accountant``, ``PerGroup``), nested in any way.

    Returns:
        A flat dict; ``torch.save`` it, or use :func:`~opake_fx.serialization.save_checkpoint`.

    Raises:
        InputTypeError: a value of a type that cannot be saved (a function, a module),
            naming its path; register it with :func:`register_serializer`.
        CheckpointError: two keys of one dict give the same path component.

    Privacy: the dict holds the noise keys and steps; treat it like the model itself.

    Example:
        >>> from opake_fx.dpsgd.noise import GaussianNoiseState
        >>> from opake_fx.random import key
        >>> flat = state_dict({"noise": GaussianNoiseState(key(3), step=7)})
        >>> sorted(flat)
        ['noise/key', 'noise/step']
        >>> from_state_dict({"noise": GaussianNoiseState(key(0))}, flat)["noise"]
        GaussianNoiseState(key=RngKey(0, 3), step=7)
    """
    out: dict[str, Any] = {}
    flatten_into(obj, "", out, copy=True)
    return out


def from_state_dict(template: Any, flat: Mapping[str, Any]) -> Any:
    """Rebuilds a state of ``template``'s structure from the leaves in ``flat``.

    Every class, container and key comes from ``template``; ``flat`` must have exactly
    the entries that ``state_dict(template)`` would have. Tensors must have the
    template's shape and take its dtype and device (a float32 checkpoint resumes a
    bfloat16 model on another device; integer and bool tensors must match exactly);
    inside a type registered with ``variable_shapes=True`` (the ``Accountant``'s
    running composition) a tensor may have any size but must have exactly the
    template's dtype and number of dimensions. Nothing named in ``flat`` is imported or
    called.

    Args:
        template: a state of the structure to rebuild (e.g. ``pipeline.init(params)``);
            it is not modified.
        flat: the output of :func:`state_dict` (possibly after ``torch.save`` /
            ``torch.load(weights_only=True)``).

    Returns:
        A new state with the template's structure and the checkpoint's values.

    Raises:
        CheckpointError: entries missing, unknown (e.g. renamed), of the wrong shape or
            kind, or refused by the state's own checks (a sampler built with another
            configuration, an accountant with another budget); the message names every
            such path. Nothing is restored in that case.

    Privacy: restoring a noise state restores its key and step, so a resumed run
    continues the noise sequence instead of repeating noise already used; restoring an
    ``Accountant`` restores everything spent.

    Example:
        >>> import torch
        >>> from opake_fx.optimizers import adam
        >>> params = {"w": torch.zeros(2)}
        >>> opt = adam(0.1)
        >>> _, st = opt.update({"w": torch.ones(2)}, opt.init(params), params)
        >>> back = from_state_dict(opt.init(params), state_dict(st))
        >>> back.count, back.mu["w"].tolist()
        (1, [0.10000000149011612, 0.10000000149011612])
        >>> from_state_dict(opt.init({"w": torch.zeros(3)}), state_dict(st))
        Traceback (most recent call last):
        ...
        opake_fx.errors.CheckpointError: the checkpoint does not fit the template: 'mu/w': shape (2,) in the checkpoint, the template has (3,); 'nu/w': shape (2,) in the checkpoint, the template has (3,).
    """
    if not isinstance(flat, Mapping):
        raise CheckpointError(
            f"from_state_dict needs the flat dict that state_dict wrote; got {type(flat).__name__}. "
            + _OLD_FORMAT_HINT * _looks_old(flat)
        )
    bad_keys = [k for k in flat if not isinstance(k, str)]
    if bad_keys or _looks_old(flat):
        raise CheckpointError(
            "from_state_dict got a dict that state_dict did not write"
            + (f" (non-string keys {bad_keys[:_MAX_LISTED]!r})" if bad_keys else "")
            + ". "
            + _OLD_FORMAT_HINT * _looks_old(flat)
        )
    loader = _Loader(flat)
    out = loader.load(template, "")
    unknown = sorted(set(flat) - loader.used)
    problems = loader.problems
    if unknown:
        problems.append(_unknown_message(unknown, loader.missing))
    if problems:
        raise CheckpointError("the checkpoint does not fit the template: " + "; ".join(problems) + ".")
    return out


def flatten_into(obj: Any, path: str, out: dict[str, Any], *, copy: bool) -> None:
    """Adds ``obj``'s entries under ``path`` to ``out`` (what :func:`state_dict` does).

    ``copy=False`` keeps the tensors themselves (for writing a file right away).

    Privacy: none by itself (see :func:`state_dict`).

    Example:
        >>> import torch
        >>> out = {}
        >>> flatten_into((torch.ones(1), 3), "opt", out, copy=False)
        >>> sorted(out)
        ['opt/0', 'opt/1']
    """
    serializer = serializer_for(type(obj))
    if serializer is not None:
        flatten_into(serializer.to_tree(obj), path, out, copy=copy)
        return
    if isinstance(obj, torch.Tensor) or isinstance(obj, _PLAIN):
        if path in out:
            raise CheckpointError(f"two values have the path {path!r}; give them distinct keys.")
        if isinstance(obj, torch.Tensor):
            obj = obj.detach().clone() if copy else obj.detach()
        out[path] = obj
        return
    children = _children(obj, path)
    if children is None:
        raise InputTypeError(
            f"state_dict cannot save the {type(obj).__module__}.{type(obj).__qualname__} at "
            f"{_shown(path)}. States are tensors, plain values, containers, dataclasses and NamedTuples; "
            "save other types with opake_fx.serialization.register_serializer."
        )
    for component, child in children:
        flatten_into(child, _join(path, component), out, copy=copy)


# --- private helpers ---------------------------------------------------------------

_OLD_FORMAT_HINT = (
    "It looks like the old format, which named classes by import path ('__opake_type__'); "
    "it is not loaded, because rebuilding a class named in a file can run code. Rebuild the "
    "state from its template and save it again with state_dict / save_checkpoint."
)


class _Loader:
    """One template walk: collects every problem instead of stopping at the first."""

    def __init__(self, flat: Mapping[str, Any]) -> None:
        self.flat = flat
        self.used: set[str] = set()
        self.problems: list[str] = []
        self.missing: list[str] = []
        self.variable_shapes = 0  # > 0 inside the tree of a variable_shapes serializer

    def load(self, template: Any, path: str) -> Any:
        serializer = serializer_for(type(template))
        if serializer is not None:
            if serializer.from_leaf is not None and path in self.flat:  # written in the one-leaf format
                self.used.add(path)
                value = self.flat[path]
                return self._build(path, lambda: serializer.from_leaf(template, value))
            before = len(self.problems)
            self.variable_shapes += serializer.variable_shapes
            try:
                tree = self.load(serializer.to_tree(template), path)
            finally:
                self.variable_shapes -= serializer.variable_shapes
            if len(self.problems) > before:
                return template
            return self._build(path, lambda: serializer.from_tree(template, tree))
        if isinstance(template, torch.Tensor):
            return self._leaf(path, template, _any_size_tensor_value if self.variable_shapes else _tensor_value)
        if isinstance(template, _PLAIN):
            return self._leaf(path, template, _plain_value)
        children = _children(template, path)
        if children is None:
            raise InputTypeError(
                f"from_state_dict: the template holds a {type(template).__qualname__} at {_shown(path)}, "
                "which has no serializer; register one with opake_fx.serialization.register_serializer."
            )
        before = len(self.problems)
        values = [self.load(child, _join(path, component)) for component, child in children]
        if len(self.problems) > before:
            return template
        return self._build(path, lambda: _rebuild(template, values))

    def _leaf(self, path: str, template: Any, convert: Callable[[Any, Any], Any]) -> Any:
        if path not in self.flat:
            self.missing.append(path)
            self.problems.append(f"{_shown(path)} is missing")
            return template
        self.used.add(path)
        try:
            return convert(self.flat[path], template)
        except _Misfit as misfit:
            self.problems.append(f"{_shown(path)}: {misfit}")
            return template

    def _build(self, path: str, make: Callable[[], Any]) -> Any:
        try:
            return make()
        except (OpakeError, ValueError, TypeError) as exc:
            self.problems.append(f"{_shown(path)} was refused: {exc}")
            return None


class _Misfit(Exception):
    """A leaf value that does not fit its template leaf (reported with its path)."""


def _tensor_value(value: Any, template: torch.Tensor) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise _Misfit(f"the checkpoint has the {type(value).__name__} {value!r:.40} where the template has a tensor")
    if tuple(value.shape) != tuple(template.shape):
        raise _Misfit(f"shape {tuple(value.shape)} in the checkpoint, the template has {tuple(template.shape)}")
    if not _dtype_fits(value.dtype, template.dtype):
        raise _Misfit(
            f"dtype {value.dtype} in the checkpoint cannot become the template's {template.dtype} "
            "(only floating-point precision may change on load)"
        )
    out = value.detach().to(device=template.device, dtype=template.dtype, copy=True)
    if isinstance(template, torch.nn.Parameter):
        return torch.nn.Parameter(out, requires_grad=template.requires_grad)
    if template.requires_grad:
        out.requires_grad_(True)
    return out


def _any_size_tensor_value(value: Any, template: torch.Tensor) -> torch.Tensor:
    """A tensor leaf of a ``variable_shapes`` serializer: any size, the template's rank and dtype."""
    if not isinstance(value, torch.Tensor):
        raise _Misfit(f"the checkpoint has the {type(value).__name__} {value!r:.40} where the template has a tensor")
    if value.dim() != template.dim():
        raise _Misfit(f"{value.dim()} dimensions in the checkpoint, the template has {template.dim()}")
    if value.dtype != template.dtype:
        raise _Misfit(f"dtype {value.dtype} in the checkpoint, the template has {template.dtype} (it must match exactly)")
    return value.detach().to(device=template.device, copy=True)


def _dtype_fits(saved: torch.dtype, wanted: torch.dtype) -> bool:
    if wanted.is_floating_point:
        return saved.is_floating_point
    if wanted.is_complex:
        return saved.is_complex
    return saved == wanted


def _plain_value(value: Any, template: Any) -> Any:
    if not isinstance(value, _PLAIN):
        raise _Misfit(f"the checkpoint has a {type(value).__name__} where the template has the {type(template).__name__} {template!r}")
    if value is None or template is None:
        return value
    if isinstance(template, bool) or isinstance(value, bool):
        fits = isinstance(template, bool) and isinstance(value, bool)
    elif isinstance(template, int):
        fits = isinstance(value, int)
    elif isinstance(template, float):
        fits = isinstance(value, (int, float))
    else:
        fits = isinstance(value, str)
    if not fits:
        raise _Misfit(
            f"the checkpoint has the {type(value).__name__} {value!r} where the template has the "
            f"{type(template).__name__} {template!r}"
        )
    return value


def _children(obj: Any, path: str) -> list[tuple[str, Any]] | None:
    """``(component, child)`` pairs of a container, NamedTuple or dataclass; ``None`` otherwise."""
    if isinstance(obj, tuple) and hasattr(type(obj), "_fields"):
        return [(name, getattr(obj, name)) for name in obj._fields]
    if isinstance(obj, (tuple, list)):
        return [(str(i), x) for i, x in enumerate(obj)]
    if isinstance(obj, Mapping):
        pairs = [(_component(k), v) for k, v in obj.items()]
        seen: dict[str, Any] = {}
        for (component, _), k in zip(pairs, obj):
            if component in seen:
                raise CheckpointError(
                    f"the keys {seen[component]!r} and {k!r} of the dict at {_shown(path)} give the same path "
                    f"component {component!r}; use distinct string keys."
                )
            seen[component] = k
        return pairs
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init]
    return None


def _rebuild(template: Any, values: list[Any]) -> Any:
    if isinstance(template, tuple) and hasattr(type(template), "_fields"):
        return type(template)._make(values)
    if isinstance(template, tuple):
        return tuple(values)
    if isinstance(template, list):
        return list(values)
    if isinstance(template, Mapping):
        items = dict(zip(template.keys(), values))
        if isinstance(template, MappingProxyType):
            return MappingProxyType(items)
        if isinstance(template, OrderedDict):
            return OrderedDict(items)
        if type(template) is dict:
            return items
        return type(template)(items)
    names = [f.name for f in dataclasses.fields(template) if f.init]
    return dataclasses.replace(template, **dict(zip(names, values)))


def _component(k: Any) -> str:
    if isinstance(k, int) and not isinstance(k, bool):
        return str(k)
    text = k if isinstance(k, str) else repr(k)
    return text.replace("%", "%25").replace(SEPARATOR, "%2F")


def _join(path: str, component: str) -> str:
    return f"{path}{SEPARATOR}{component}" if path else component


def _shown(path: str) -> str:
    return repr(path) if path else "the root"


def _looks_old(data: Any) -> bool:
    if isinstance(data, Mapping):
        return "__opake_type__" in data or any(_looks_old(v) for v in data.values() if isinstance(v, (Mapping, list)))
    if isinstance(data, list):
        return any(_looks_old(v) for v in data)
    return False


def _unknown_message(unknown: list[str], missing: list[str]) -> str:
    listed = ", ".join(repr(u) for u in unknown[:_MAX_LISTED]) + (" ..." if len(unknown) > _MAX_LISTED else "")
    hints = []
    for name in unknown[:_MAX_LISTED]:
        close = difflib.get_close_matches(name, missing, n=1)
        if close:
            hints.append(f"{name!r} may be the renamed {close[0]!r}")
    text = f"unknown entries {listed} (the template has no such path"
    return text + ("; " + ", ".join(hints) if hints else "") + ")"
