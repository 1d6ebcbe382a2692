"""Every ```python block of README.md and docs/*.md runs as written (docs/api/ excluded).

A page is a script: its blocks run in order in one namespace (a fresh ``__main__`` module
per page, as ``python page.py`` would have), in a temporary working directory, after
``torch.manual_seed(0)``. One test per page, so a failure names the page; the message
gives the block's line and source, and tracebacks point at the lines of the ``.md`` file.

A block that is not meant to run as part of the fast suite says so in an HTML comment on
the line directly above its fence:

    <!-- docs-test: slow -->                  runs only in the slow suite (`make test-slow`)
    <!-- docs-test: torchrun -->              a complete script, run under torchrun with 2
                                              gloo ranks (slow suite)
    <!-- docs-test: skip because <reason> --> never runs: only where running is impossible
                                              (a GPU, a shell command, an output listing)

A function named ``test_*`` that a block defines is called right after the block, as
pytest would call it. Blocks whose first line starts with ``>>>`` run as doctests in the
page's namespace; blocks with IPython magics (a line starting with ``%``) run through
IPython's ``InteractiveShell`` (the whole page then shares the shell's namespace, and any
``%dist_start`` pool is stopped afterwards). Fences other than ```python are not run.
docs/testing.md says how to mark a block.
"""

from __future__ import annotations

import doctest
import io
import os
import re
import socket
import subprocess
import sys
import traceback
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^```\s*([\w+-]*)\s*$")
_MARKER = re.compile(r"^<!--\s*docs-test:\s*(?P<body>.*?)\s*-->\s*$")
_MAGIC = re.compile(r"^%", re.MULTILINE)


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # line of the block's first source line in the page (1-based)
    source: str
    marker: str  # "fast", "slow", "torchrun" or "skip"
    reason: str = ""

    @property
    def kind(self) -> str:
        if self.source.lstrip().startswith(">>>"):
            return "doctest"
        return "ipython" if _MAGIC.search(self.source) else "python"


class MarkerError(ValueError):
    """A ``docs-test`` marker that is unknown, lacks its reason, or is not right above a python fence."""


def parse(text: str, page: str) -> list[Block]:
    """The ```python blocks of a page's text, with their markers; raises MarkerError on a bad marker."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        marker = _MARKER.match(lines[i])
        if marker:
            fence = _FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
            if not fence or fence.group(1) != "python":
                raise MarkerError(f"{page}:{i + 1}: a docs-test marker must be on the line directly above a ```python fence")
        fence = _FENCE.match(lines[i])
        if fence and fence.group(1):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
            if end is None:
                raise MarkerError(f"{page}:{i + 1}: the ```{fence.group(1)} fence is never closed")
            if fence.group(1) == "python":
                above = _MARKER.match(lines[i - 1]) if i else None
                kind, reason = _marker(above.group("body"), page, i) if above else ("fast", "")
                blocks.append(Block(page, i + 2, "\n".join(lines[i + 1:end]) + "\n", kind, reason))
            i = end
        i += 1
    return blocks


def _marker(body: str, page: str, index: int) -> tuple[str, str]:
    if body in ("slow", "torchrun"):
        return body, ""
    skip = re.fullmatch(r"skip(?:\s+because(?:\s+(?P<reason>\S.*))?)?", body)
    if skip and skip.group("reason"):
        return "skip", skip.group("reason")
    if skip:
        raise MarkerError(f"{page}:{index}: `docs-test: skip` needs its reason: `<!-- docs-test: skip because ... -->`")
    raise MarkerError(f"{page}:{index}: unknown docs-test marker {body!r}; use slow, torchrun or skip because <reason>")


def _page_blocks(page: str) -> list[Block]:
    return parse((ROOT / page).read_text(encoding="utf-8"), page)


def _pages_with(markers: set[str]) -> list[str]:
    out = []
    for page in PAGES:
        try:
            blocks = _page_blocks(page)
        except MarkerError:
            out.append(page)  # its test fails with the marker's error
            continue
        if any(b.marker in markers for b in blocks):
            out.append(page)
    return out


# ------------------------------------------------------------------------------ the tests
@pytest.mark.parametrize("page", _pages_with({"fast"}))
def test_page_runs(page, tmp_path, monkeypatch):
    """The page's unmarked blocks, in order, as one script (slow, torchrun and skip blocks left out)."""
    _run_page(page, {"fast"}, tmp_path, monkeypatch)


def _slow_params() -> list:
    """Pages with slow blocks; those that start ranks (torchrun blocks, ``%dist_start``) are also ``distributed``."""
    out = []
    for page in _pages_with({"slow", "torchrun"}):
        try:
            ranks = any(b.marker == "torchrun" or b.kind == "ipython" for b in _page_blocks(page))
        except MarkerError:
            ranks = False
        out.append(pytest.param(page, marks=[pytest.mark.distributed] if ranks else []))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("page", _slow_params())
def test_page_runs_with_its_slow_blocks(page, tmp_path, monkeypatch):
    """The whole page, slow blocks included; torchrun blocks are launched on 2 gloo ranks."""
    _run_page(page, {"fast", "slow", "torchrun"}, tmp_path, monkeypatch)


def test_markers_are_known_and_skips_say_why():
    for page in PAGES:
        _page_blocks(page)  # raises MarkerError
    with pytest.raises(MarkerError, match="needs its reason"):
        parse("<!-- docs-test: skip -->\n```python\nx = 1\n```\n", "page.md")
    with pytest.raises(MarkerError, match="needs its reason"):
        parse("<!-- docs-test: skip because -->\n```python\nx = 1\n```\n", "page.md")
    with pytest.raises(MarkerError, match="unknown docs-test marker"):
        parse("<!-- docs-test: fast-ish -->\n```python\nx = 1\n```\n", "page.md")
    with pytest.raises(MarkerError, match="directly above"):
        parse("<!-- docs-test: slow -->\n\n```python\nx = 1\n```\n", "page.md")
    blocks = parse("text\n<!-- docs-test: skip because it needs a GPU -->\n```python\nx = 1\n```\n"
                   "```bash\nls\n```\n```python\n>>> 1 + 1\n2\n```\n", "page.md")
    assert [(b.line, b.marker, b.reason, b.kind) for b in blocks] == [
        (4, "skip", "it needs a GPU", "python"), (10, "fast", "", "doctest")]


def test_a_failing_block_names_its_page_line_and_source(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n```python\nx = 1\n```\n\n```python\ny = x + 1\nassert y == 3, y\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(pytest.fail.Exception) as info:
        _run_page("page.md", {"fast"}, tmp_path, monkeypatch)
    text = str(info.value)
    assert "page.md, block at line 8" in text and "   9 | assert y == 3, y" in text
    assert "AssertionError: 2" in text and 'page.md", line 9' in text


# ---------------------------------------------------------------------------- the runner
def _run_page(page: str, markers: set[str], tmp_path: Path, monkeypatch) -> None:
    try:
        blocks = _page_blocks(page)
    except MarkerError as exc:
        pytest.fail(str(exc), pytrace=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MKL_NUM_THREADS", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")  # plots are drawn, never shown
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the pages' models are tiny: more threads only contend on a shared machine
    shell = _shell() if any(b.kind == "ipython" for b in blocks) else None
    module = types.ModuleType("__main__")
    module.__dict__["__builtins__"] = __builtins__
    ns = shell.user_ns if shell is not None else module.__dict__
    main = sys.modules["__main__"]
    profile = _hypothesis_profile()
    sys.modules["__main__"] = module  # classes and functions a page defines pickle as a script's do
    try:
        failure = None
        for block in blocks:
            if block.marker not in markers:
                continue
            try:
                _run_block(block, ns, shell, tmp_path)
            except Exception as exc:  # noqa: BLE001 - reported with the block's page, line and source
                failure = _report(block, exc)
                if isinstance(exc, NameError) and "slow" not in markers and any(
                        b.marker in ("slow", "torchrun") for b in blocks if b.line < block.line):
                    failure += ("\n(an earlier block of this page is marked slow and did not run here: "
                                "if this block needs it, mark this one slow too)")
                break
        if failure is not None:
            pytest.fail(failure, pytrace=False)
    finally:
        sys.modules["__main__"] = main
        torch.set_num_threads(threads)
        if profile is not None:  # a page that loads its own hypothesis profile leaves the suite's alone
            from hypothesis import settings

            settings.load_profile(profile)
        if shell is not None:
            _stop_shell(shell)


def _run_block(block: Block, ns: dict, shell, tmp_path: Path) -> None:
    path = str(ROOT / block.page)
    if block.marker == "torchrun":
        _torchrun(block, tmp_path)
    elif block.kind == "doctest":
        test = doctest.DocTestParser().get_doctest(block.source, ns, f"{block.page}:{block.line}", path, block.line - 1)
        out = io.StringIO()
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        result = runner.run(test, out=out.write, clear_globs=False)
        if result.failed:
            raise AssertionError(f"{result.failed} of {result.attempted} doctest examples failed:\n{out.getvalue()}")
    elif block.kind == "ipython":
        result = shell.run_cell(block.source, store_history=False, silent=False)
        error = result.error_before_exec or result.error_in_exec
        if error is not None:
            raise error
    else:
        # padded with blank lines so that line numbers in tracebacks are the page's
        before = set(ns)
        code = compile("\n" * (block.line - 1) + block.source, path, "exec")
        exec(code, ns)  # noqa: S102 - running the page is the point
        for name in [n for n in ns if n not in before and n.startswith("test_") and callable(ns[n])]:
            ns[name]()  # a test the page defines runs, as pytest would run it


def _report(block: Block, exc: BaseException) -> str:
    numbered = "\n".join(f"{block.line + k:4d} | {line}" for k, line in enumerate(block.source.splitlines()))
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    tb_lines = tb.splitlines()
    if len(tb_lines) > 60:
        tb = "\n".join(["...", *tb_lines[-60:]])
    return f"{block.page}, block at line {block.line} failed:\n\n{numbered}\n\n{tb}"


def _hypothesis_profile() -> str | None:
    if "hypothesis" not in sys.modules:
        return None
    from hypothesis import settings

    return settings._current_profile  # noqa: SLF001 - hypothesis has no public getter


# ------------------------------------------------------------------- IPython and torchrun
def _shell():
    pytest.importorskip("IPython", reason="the notebook extra (IPython) is not installed")
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.reset(new_session=False)
    return shell


def _stop_shell(shell) -> None:
    for magics in shell.magics_manager.registry.values():
        pool = getattr(magics, "pool", None)
        if pool is not None:
            pool.stop()
            magics.pool = None
    shell.reset(new_session=False)


# After the script has returned, the wrapper leaves with os._exit, as in
# tests/distributed/test_tutorial.py: torch's interpreter teardown after a gloo group
# occasionally aborts a rank after all its output.
_WRAPPER = """
import os, runpy, sys
runpy.run_path(sys.argv[1], run_name="__main__")
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""


def _torchrun(block: Block, tmp_path: Path, timeout: float = 300.0) -> None:
    script = tmp_path / f"{Path(block.page).stem}_line{block.line}.py"
    script.write_text("\n" * (block.line - 1) + block.source)
    wrapper = tmp_path / "run_block.py"
    wrapper.write_text(_WRAPPER)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    if os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
           "--master_addr=127.0.0.1", f"--master_port={port}", str(wrapper), str(script)]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun --nproc_per_node=2 exited with {proc.returncode}:\n"
                             f"{(proc.stdout + proc.stderr)[-6000:]}")
