"""The pages in docs/ build as a site (``mkdocs build --strict``: no broken links between
pages, every page in the navigation) when the ``docs`` extra is installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def test_every_page_is_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert pages, "no docs pages"
    missing = [p for p in pages if f": {p}" not in nav]
    assert not missing, f"add these pages to mkdocs.yml's nav: {missing}"


def test_site_builds_strictly(tmp_path: Path):
    pytest.importorskip("mkdocs")
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "site" / "clipping" / "index.html").exists()
