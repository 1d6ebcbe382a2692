"""The accounting code needs numpy/scipy only, and its docstring examples run."""

from __future__ import annotations

import ast
import doctest
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
FILES = sorted((ROOT / "opake_fx" / "accounting").glob("*.py")) + [
    ROOT / "opake_fx" / "dpsgd" / "accounting.py",
    ROOT / "opake_fx" / "_typecheck.py",
    ROOT / "opake_fx" / "validation.py",
]
# opake_fx._typecheck is the torch-free runtime type checker (beartype) behind opake_fx.typing.
# opake_fx.validation is the library's torch-free home of argument checks.
ALLOWED_OPAKE = {"opake_fx.errors", "opake_fx.accounting", "opake_fx._typecheck", "opake_fx.validation"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_no_torch_and_no_other_opake_modules(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        for name in names:
            assert not name.startswith("torch"), f"{path.name} imports {name}"
            assert "dp_accounting" not in name, f"{path.name} imports {name}"
            if name.startswith("opake_fx"):
                assert any(name == a or name.startswith(a + ".") for a in ALLOWED_OPAKE), f"{path.name} imports {name}"


# The torch-free import through the real package __init__s is tested in tests/test_lazy_imports.py.


MODULES = [
    "opake_fx.accounting",
    "opake_fx.accounting.process",
    "opake_fx.accounting.mechanisms",
    "opake_fx.accounting.pld",
    "opake_fx.accounting.budgets",
    "opake_fx.accounting.calibrate",
    "opake_fx.accounting.accountant",
    "opake_fx.dpsgd.accounting",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
