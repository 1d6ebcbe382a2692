"""The pages in docs/ build as a site (``mkdocs build --strict``: no broken links between
pages, every page in the navigation, API pages rendered by mkdocstrings) offline, when the
``docs`` extra is installed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def _public_modules() -> set[str]:
    """Every public module of opake_fx (no path part starting with an underscore)."""
    out = set()
    for path in (ROOT / "opake_fx").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not any(p.startswith("_") for p in parts):
            out.add(".".join(parts))
    return out


def test_every_page_is_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    pages = sorted(str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md"))
    assert pages, "no docs pages"
    missing = [p for p in pages if f": {p}" not in nav]
    assert not missing, f"add these pages to mkdocs.yml's nav: {missing}"


def test_every_public_module_has_an_api_page():
    documented = set()
    for page in (ROOT / "docs" / "api").glob("*.md"):
        documented |= set(re.findall(r"^::: (\S+)$", page.read_text(encoding="utf-8"), flags=re.MULTILINE))
    missing = sorted(_public_modules() - documented)
    assert not missing, f"add `::: module` entries under docs/api/ for: {missing}"
    gone = sorted(documented - _public_modules())
    assert not gone, f"docs/api/ documents modules that do not exist: {gone}"


def test_site_builds_strictly_offline(tmp_path: Path):
    pytest.importorskip("mkdocs", reason="the docs extra (mkdocs) is not installed")
    pytest.importorskip("material", reason="the docs extra (mkdocs-material) is not installed")
    pytest.importorskip("mkdocstrings", reason="the docs extra (mkdocstrings[python]) is not installed")
    site = tmp_path / "site"
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    pages = sorted(site.rglob("index.html"))
    assert len(pages) >= 15, [str(p) for p in pages]
    api = site / "api" / "notebook" / "index.html"
    html = api.read_text(encoding="utf-8")
    assert "DistPool" in html and "rank 0" in html and "Source code in" in html  # docstrings and source
    for page in pages:  # no remote fonts or scripts: the site reads offline
        text = page.read_text(encoding="utf-8")
        assert "fonts.googleapis.com" not in text and "fonts.gstatic.com" not in text, page
        assert not re.search(r"<script[^>]+src=\"https?://", text), page


def test_every_notebook_has_a_page_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    notebooks = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    missing = [n for n in notebooks if f": notebooks/{n}.md" not in nav]
    assert not missing, f"add these notebooks' pages to mkdocs.yml's nav: {missing}"
