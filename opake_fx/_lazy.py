"""Lazy package attributes (PEP 562): re-exports and submodules loaded on first access."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def attach(
    package: str, namespace: dict[str, Any], exports: Mapping[str, str], submodules: Iterable[str]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of a lazy package.

    Args:
        package: the package's ``__name__``.
        namespace: its ``globals()``; a loaded re-export is stored there, so later
            look-ups do not come back here.
        exports: re-exported name -> module that defines it.
        submodules: public submodules, importable as attributes.
    """
    subs = frozenset(submodules)

    def __getattr__(name: str) -> object:
        module = exports.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module), name)
            namespace[name] = value
            return value
        if name in subs:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        public = {n for n in namespace if not n.startswith("_") or (n.startswith("__") and n.endswith("__"))}
        return sorted(public | set(namespace.get("__all__", ())) | subs)

    return __getattr__, __dir__
