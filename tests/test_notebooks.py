"""The notebooks in notebooks/: stored as valid nbformat 4 without outputs, and executed.

Every notebook runs top to bottom under nbmake (a real Jupyter kernel, the registered
``python3`` kernel of the environment) in the slow suite; each asserts its own results
(budgets respected, accuracy above chance, backends agreeing). The quickstart, plain
Python, also runs in the fast suite as the concatenation of its code cells.
``distributed_tutorial.ipynb`` must hold the seed's distributed tutorial verbatim (imports
renamed only), as ``examples/distributed_dp_training.py`` does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# Notebooks whose results are checked here as well (besides their own asserts).
TRAINING_NOTEBOOKS = {"quickstart.ipynb"}
EXPECTED = {
    "quickstart.ipynb", "dpsgd_digits.ipynb", "accounting.ipynb", "distributed_tutorial.ipynb",
    "dpftrl_strategies.ipynb", "fast_clipping.ipynb", "utility_ablation.ipynb", "user_level.ipynb",
}


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _source(cell: dict) -> str:
    src = cell["source"]
    return src if isinstance(src, str) else "".join(src)


def test_there_are_notebooks():
    assert {p.name for p in NOTEBOOKS} >= EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_nbformat4_without_outputs(path):
    nb = _load(path)
    assert nb["nbformat"] == 4
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    assert nb["cells"], "empty notebook"
    for i, cell in enumerate(nb["cells"]):
        assert cell["cell_type"] in {"code", "markdown", "raw"}, (i, cell["cell_type"])
        assert isinstance(cell["metadata"], dict)
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [], f"cell {i} has stored outputs: clear them before committing"
            assert cell["execution_count"] is None, f"cell {i} has an execution count"
            src = _source(cell)
            if any(line.lstrip().startswith(("%", "!")) for line in src.splitlines()):
                assert path.name == "distributed_tutorial.ipynb", f"cell {i}: IPython syntax outside the %%dist notebook"


def test_distributed_notebook_runs_the_tutorial_verbatim():
    nb = _load(ROOT / "notebooks" / "distributed_tutorial.ipynb")
    cells = [_source(c) for c in nb["cells"] if c["cell_type"] == "code"]
    assert cells[0].splitlines() == ["%load_ext opake_fx.notebook", "%dist_start -n 2"]
    dist_cells = [c.split("\n", 1)[1] for c in cells[1:] if c.startswith("%%dist\n")]
    script = (ROOT / "examples" / "distributed_dp_training.py").read_text(encoding="utf-8")
    tutorial_cells = dist_cells[:5]
    assert "\n".join(tutorial_cells).split() == script.split(), "the notebook's first five %%dist cells must be the tutorial"
    assert cells[-1].splitlines() == ["%dist_status", "%dist_stop"]


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.name in TRAINING_NOTEBOOKS], ids=lambda p: p.name)
def test_plain_notebook_runs(path, monkeypatch):
    pytest.importorskip("sklearn")
    nb = _load(path)
    code = "\n\n".join(_source(c) for c in nb["cells"] if c["cell_type"] == "code")
    monkeypatch.chdir(path.parent)
    namespace: dict = {"__name__": "__main__"}
    exec(compile(code, str(path), "exec"), namespace)
    accuracy, spent, target = namespace["test_accuracy"], namespace["spent_epsilon"], namespace["TARGET_EPS"]
    assert accuracy > 0.5, accuracy  # chance is 0.1 on digits
    assert 0 < spent <= target, (spent, target)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes_under_nbmake(path):
    pytest.importorskip("nbmake", reason="the notebook extra (nbmake) is not installed")
    pytest.importorskip("ipykernel", reason="the notebook extra (ipykernel) is not installed")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--nbmake", "--nbmake-timeout=600", "-q", "-p", "no:cacheprovider",
         str(path.relative_to(ROOT))],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
