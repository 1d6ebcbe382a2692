"""The sync and serializer registries: a lower layer that imports none of the types it holds.

State types register their sync where they are defined, so the listing holds a type exactly
when a value of it can exist; the serializers of the library's types are registered by the
package ``opake_fx.serialization``, before any of its functions can run.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import opake_fx.distributed as od
from opake_fx.distributed import state_sync as _state

ROOT = Path(__file__).parents[1]


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_state_type_is_listed_once_its_module_is_imported_and_never_imported_by_the_listing() -> None:
    code = """
import sys
import opake_fx.distributed as od
before = {t.__name__ for t in od.registered_sync_types()}
assert "opake_fx.dpsgd.noise" not in sys.modules and "GaussianNoiseState" not in before, before
from opake_fx.dpsgd.noise import GaussianNoiseState
assert GaussianNoiseState in od.registered_sync_types()

# serialization: importing only the tree module runs the package, which registers the built-ins
from opake_fx.serialization.tree import from_state_dict, state_dict
from opake_fx.random import key
flat = state_dict({"k": key(3)})
assert from_state_dict({"k": key(0)}, flat)["k"] == key(3)
print("ok")
"""
    assert _run(code) == "ok"


@dataclass(frozen=True)
class _Part:
    value: int


@dataclass(frozen=True)
class _Whole:
    first: _Part
    second: _Part | None
    kept: str = "unsynced"


def test_sync_fields_syncs_each_named_field_in_order(monkeypatch) -> None:
    calls = []
    monkeypatch.setitem(_state._SYNC_REGISTRY, _Part, lambda p: calls.append(p.value) or _Part(-p.value))
    monkeypatch.setitem(_state._SYNC_REGISTRY, _Whole, od.sync_fields("first", "second"))
    monkeypatch.setattr(_state, "is_distributed", lambda: True)  # exercise dispatch without a group
    assert od.sync(_Whole(_Part(1), _Part(2))) == _Whole(_Part(-1), _Part(-2))
    assert calls == [1, 2]
    assert od.sync(_Whole(_Part(3), None)) == _Whole(_Part(-3), None)  # None stays None
    assert calls == [1, 2, 3]
