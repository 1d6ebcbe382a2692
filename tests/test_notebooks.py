"""Every notebook in notebooks/ is valid nbformat 4, is stored without outputs, and runs top to bottom.

A notebook runs as the concatenation of its code cells, executed in a fresh namespace with
the notebook's folder as working directory (as Jupyter does), so notebook code must be
plain Python (no ``%`` magics or ``!`` shell lines). A notebook that trains privately
exposes ``test_accuracy``, ``spent_epsilon`` and ``TARGET_EPS`` at the top level; they are
checked here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# Notebooks whose results are checked (besides running at all).
TRAINING_NOTEBOOKS = {"quickstart.ipynb"}


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _source(cell: dict) -> str:
    src = cell["source"]
    return src if isinstance(src, str) else "".join(src)


def test_there_are_notebooks():
    assert {p.name for p in NOTEBOOKS} >= TRAINING_NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_nbformat4_without_outputs(path):
    nb = _load(path)
    assert nb["nbformat"] == 4
    assert nb["cells"], "empty notebook"
    for i, cell in enumerate(nb["cells"]):
        assert cell["cell_type"] in {"code", "markdown", "raw"}, (i, cell["cell_type"])
        assert isinstance(cell["metadata"], dict)
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [], f"cell {i} has stored outputs: clear them before committing"
            assert cell["execution_count"] is None, f"cell {i} has an execution count"
            src = _source(cell)
            assert not any(line.lstrip().startswith(("%", "!")) for line in src.splitlines()), (
                f"cell {i} uses IPython syntax; notebooks here must be plain Python"
            )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, monkeypatch):
    pytest.importorskip("sklearn")
    nb = _load(path)
    code = "\n\n".join(_source(c) for c in nb["cells"] if c["cell_type"] == "code")
    monkeypatch.chdir(path.parent)
    namespace: dict = {"__name__": "__main__"}
    exec(compile(code, str(path), "exec"), namespace)
    if path.name in TRAINING_NOTEBOOKS:
        accuracy, spent, target = namespace["test_accuracy"], namespace["spent_epsilon"], namespace["TARGET_EPS"]
        assert accuracy > 0.5, accuracy  # chance is 0.1 on digits
        assert 0 < spent <= target, (spent, target)
