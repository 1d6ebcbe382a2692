"""mkdocs hook: every notebook in ``notebooks/`` becomes a page ``notebooks/<name>.md``.

The page is the notebook as stored (outputs cleared): its Markdown cells as they are, its
code cells as Python blocks (``%%dist`` and other magics kept, as a reader types them).
Rendered at build time, offline, with no extra plugin; nothing is written to ``docs/``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

NOTEBOOKS = Path(__file__).parents[1] / "notebooks"
REPO_PATH = "notebooks"


def notebook_to_markdown(path: Path) -> str:
    """The Markdown of one notebook: Markdown cells verbatim, code cells fenced as Python."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    parts = [f"<!-- rendered from {REPO_PATH}/{path.name}; edit the notebook, not this page -->\n"]
    for cell in nb["cells"]:
        source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            parts.append(source.strip() + "\n")
        elif cell["cell_type"] == "code" and source.strip():
            parts.append("```python\n" + source.rstrip() + "\n```\n")
    parts.append(f"\n*Run it: `jupyter lab {REPO_PATH}/{path.name}` (kernel: the project's `.venv`).*\n")
    return "\n".join(parts)


def on_files(files: Files, config: Any) -> Files:
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        files.append(File.generated(config, f"notebooks/{path.stem}.md", content=notebook_to_markdown(path)))
    return files
