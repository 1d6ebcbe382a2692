"""The accounting code needs numpy/scipy only, and its docstring examples run."""

from __future__ import annotations

import ast
import doctest
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
FILES = sorted((ROOT / "opake_fx" / "accounting").glob("*.py")) + [
    ROOT / "opake_fx" / "dpsgd" / "accounting.py",
    ROOT / "opake_fx" / "_typecheck.py",
]
# opake_fx._typecheck is the torch-free runtime type checker (beartype) behind opake_fx.typing.
ALLOWED_OPAKE = {"opake_fx.errors", "opake_fx.accounting", "opake_fx._typecheck"}


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


def test_accounting_imports_with_torch_unavailable():
    """Load opake_fx.accounting (and dpsgd.accounting) in a process where torch cannot be imported.

    The parent packages' ``__init__`` files (owned by other modules) are bypassed so that
    only the accounting code itself is under test.
    """
    code = f"""
import importlib.abc, sys, types

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
        return None

sys.meta_path.insert(0, NoTorch())
root = {str(ROOT / 'opake_fx')!r}
for name, path in (('opake_fx', root), ('opake_fx.dpsgd', root + '/dpsgd')):
    pkg = types.ModuleType(name); pkg.__path__ = [path]; sys.modules[name] = pkg
import opake_fx.accounting as acc
import opake_fx.dpsgd.accounting as dpsgd_acc
eps = (dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), 0.01) * 10).epsilon_at(1e-5)
assert 0 < eps < 10
assert 'torch' not in sys.modules
print('ok')
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


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
