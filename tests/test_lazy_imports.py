"""The package ``__init__`` files load lazily (PEP 562): accounting imports without torch,
and every re-exported name still resolves, is listed by ``dir()`` and is the object it was."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import opake_fx
import opake_fx.dpsgd

ROOT = Path(__file__).parents[1]


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_accounting_imports_without_torch_through_the_real_packages():
    # Unlike tests/accounting/test_accounting_imports.py, the parent packages' __init__
    # files run as they do for users; torch is blocked so a regression names its importer.
    code = """
import importlib.abc, sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
        return None

sys.meta_path.insert(0, NoTorch())
import opake_fx.accounting as acc
import opake_fx.dpsgd.accounting as dpsgd_acc
import opake_fx
from opake_fx import OpakeError
from opake_fx.errors import BudgetExceededError
budget = acc.epsilon_budget(3.0, delta=1e-5)
assert budget.is_met_by(dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), 0.01) * 10)
assert issubclass(BudgetExceededError, OpakeError)
assert "torch" not in sys.modules
print("ok")
"""
    assert _run(code) == "ok"


def test_top_level_names_resolve_and_are_listed():
    from opake_fx.errors import OpakeError
    from opake_fx.random import RngKey, fold_in, key, split
    from opake_fx.transforms import Transform, apply_updates, chain, named_chain
    from opake_fx.types import ClippedPytree, NoisedPytree, PerGroup

    expected = {
        "OpakeError": OpakeError,
        "RngKey": RngKey,
        "key": key,
        "split": split,
        "fold_in": fold_in,
        "Transform": Transform,
        "chain": chain,
        "named_chain": named_chain,
        "apply_updates": apply_updates,
        "ClippedPytree": ClippedPytree,
        "NoisedPytree": NoisedPytree,
        "PerGroup": PerGroup,
    }
    assert set(opake_fx.__all__) == set(expected)
    for name, obj in expected.items():
        assert getattr(opake_fx, name) is obj
    listed = dir(opake_fx)
    assert set(opake_fx.__all__) <= set(listed)
    assert {"errors", "random", "transforms", "types", "pytree", "typing", "accounting", "dpsgd"} <= set(listed)
    assert not any(n.startswith("_") and not n.startswith("__") for n in listed)
    assert opake_fx.__version__
    assert opake_fx.random.key is key and opake_fx.accounting.calibrate is not None


def test_unknown_names_raise_attribute_and_import_errors():
    import pytest

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        opake_fx.nope  # noqa: B018
    with pytest.raises(ImportError):
        from opake_fx import nope  # noqa: F401
    with pytest.raises(AttributeError):
        opake_fx.dpsgd.nope  # noqa: B018


def test_dpsgd_names_resolve_and_are_listed():
    import opake_fx.dpsgd.clipping
    import opake_fx.dpsgd.noise  # noqa: F401  (binds the stage function, see below)
    import opake_fx.dpsgd.sampling

    sources = [sys.modules[f"opake_fx.dpsgd.{m}"] for m in ("clipping", "noise", "sampling")]
    assert set(opake_fx.dpsgd.__all__) <= set(dir(opake_fx.dpsgd))
    assert {"accounting", "clipping", "noise", "sampling"} <= set(dir(opake_fx.dpsgd))
    for name in opake_fx.dpsgd.__all__:
        obj = getattr(opake_fx.dpsgd, name)
        assert any(getattr(m, name, None) is obj for m in sources), name


def test_dpsgd_noise_is_the_stage_whichever_import_comes_first():
    # Loading the submodule opake_fx.dpsgd.noise binds it on the package; the package keeps
    # the re-exported stage function under that name, as its eager imports used to.
    code = """
import sys
from opake_fx.dpsgd.noise import gaussian_noise
from opake_fx.dpsgd import noise
import opake_fx.dpsgd as dpsgd
module = sys.modules["opake_fx.dpsgd.noise"]
assert noise is module.noise and dpsgd.noise is module.noise and callable(noise)
assert dpsgd.gaussian_noise is gaussian_noise
print("ok")
"""
    assert _run(code) == "ok"
