"""The package's import graph: module -> the opake_fx modules it imports (at the top or inside
a function, which is how a cycle is usually held apart), and its cycles.

Issue 31 removed the cycles; this test fails on any cycle, with its modules named. The last
two were registries of the library's own types that a lower layer loaded lazily: the state
types now register their own sync (``opake_fx.distributed.register_sync_type`` in the module
that defines them), and the serializers live in a registry module that ``tree`` and the
built-in serializers both import (the package imports the built-ins).
"""

from __future__ import annotations

import ast
import pathlib

import opake_fx

ROOT = pathlib.Path(opake_fx.__file__).parent
KNOWN_CYCLES: list[set[str]] = []


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = ["opake_fx", *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Edges to the modules each module imports; an import of a package's attribute that is a
    submodule points at the submodule. A module's own ancestors are left out (importing them
    is implied by importing the module), a package's children are not."""
    mods = modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for a in node.names:
                    targets.add(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base)
        graph[name] = {t for t in targets if t in mods and t != name and not name.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_function_local_imports() -> None:
    # process_from_dict once imported the mechanisms inside the function: the graph must see
    # such an import, or a cycle held apart that way would go unnoticed.
    graph = import_graph()
    assert "opake_fx.accounting.process" in graph["opake_fx.accounting.mechanisms"]
    assert "opake_fx.dpftrl.noise" in graph["opake_fx.serialization.runs"]  # inside _dp_state_types


def test_no_import_cycle_beyond_the_known_ones() -> None:
    new = [sorted(c) for c in cycles(import_graph()) if c not in KNOWN_CYCLES]
    assert not new, f"new import cycles (give the shared piece one lower home, or a registry): {new}"


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [{"a", "b", "c"}]


def test_the_registries_import_none_of_the_types_they_hold() -> None:
    # The lower layer offers the registration; the types' modules (or the package above,
    # for the serializers) register. No registry reaches up to the types it holds.
    graph = import_graph()
    upward = {
        name: sorted(t for t in graph[name] if not t.startswith(("opake_fx.distributed", "opake_fx.errors")))
        for name in ("opake_fx.distributed.builtin_sync", "opake_fx.distributed.collectives")
    }
    upward["opake_fx.distributed.builtin_sync"].remove("opake_fx.pytree")
    assert upward == {"opake_fx.distributed.builtin_sync": [], "opake_fx.distributed.collectives": []}
    assert graph["opake_fx.serialization._registry"] <= {"opake_fx.typing"}
    assert not any(t.startswith(("opake_fx.dpsgd", "opake_fx.dpftrl", "opake_fx.accounting"))
                   for t in graph["opake_fx.serialization.tree"])


def test_both_gaussian_mechanisms_draw_from_one_home() -> None:
    # DP-FTRL does not reach into DP-SGD's noise module for the Gaussian mechanism: both
    # draw from opake_fx._gaussian, and secure_random needs only the collectives below it.
    graph = import_graph()
    for mechanism in ("opake_fx.dpsgd.noise", "opake_fx.dpftrl.noise"):
        assert "opake_fx._gaussian" in graph[mechanism]
    assert "opake_fx.dpsgd.noise" not in graph["opake_fx.dpftrl.noise"]
    assert graph["opake_fx.secure_random"] <= {"opake_fx.distributed.collectives", "opake_fx.errors"}


def test_accounting_process_does_not_import_the_mechanisms() -> None:
    # The mechanism types register themselves (the package imports them); process.py, the
    # lower layer, does not reach up to them.
    assert "opake_fx.accounting.mechanisms" not in import_graph()["opake_fx.accounting.process"]
