"""Every ```python block in README.md and docs/*.md runs.

Each file's blocks run in order in one fresh interpreter (a subprocess per file, in a
temporary directory), so a later block may use the names an earlier block of the same file
defined, and nothing leaks between files. A block is skipped only with a marker line right
before it that says why, ``<!-- not run: needs torchrun -->``, which is meant for snippets
that need several processes or a GPU. Shell blocks (sh, bash, console) and blocks without a
language are text. Relative links between the documents must point to files and headings
that exist.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
MARKER = re.compile(r"<!--\s*not run\b(.*?)-->", re.DOTALL)
REASON = re.compile(r"^\s*:\s*(\S.*?)\s*$", re.DOTALL)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")

# Runs the blocks given on stdin, in order, in one namespace. Each block is compiled with
# its first line at its line in the Markdown file, so a traceback names the file and line.
RUNNER = r"""
import json, sys, traceback
ns = {"__name__": "__main__"}
for path, line, source in json.load(sys.stdin):
    try:
        exec(compile("\n" * (line - 1) + source, path, "exec"), ns)
    except BaseException:
        traceback.print_exc()
        print(f"FAILED: the python block at {path}:{line}", file=sys.stderr)
        sys.exit(1)
    print(f"ok: {path}:{line}", flush=True)
"""


@dataclass
class Block:
    path: Path
    line: int  # the block's first line of code in the file (1-based)
    lang: str
    source: str
    skip: str | None  # the opt-out marker's text before the block, if any


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    found = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip().rsplit("\n", 1)[-1]
        marker = MARKER.fullmatch(before.strip())
        line = text.count("\n", 0, m.start(2)) + 1
        found.append(
            Block(path, line, m[1].lower(), m[2], marker[1] if marker is not None else None)
        )
    return found


def run_blocks(path: Path, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """Runs the file's python blocks (skipped ones left out) in one fresh interpreter."""
    todo = [
        (str(b.path), b.line, b.source)
        for b in blocks(path)
        if b.lang in ("python", "py") and b.skip is None
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-c", RUNNER],
        input=json.dumps(todo),
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=timeout,
    )


def name(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("path", DOCS, ids=name)
def test_python_blocks_run(path: Path, tmp_path: Path) -> None:
    result = run_blocks(path, tmp_path)
    assert result.returncode == 0, f"{name(path)}:\n{result.stdout}\n{result.stderr[-6000:]}"


@pytest.mark.parametrize("path", DOCS, ids=name)
def test_opt_outs_say_why_and_sit_before_a_python_block(path: Path) -> None:
    text = path.read_text()
    markers = len(MARKER.findall(text))
    skipped = [b for b in blocks(path) if b.skip is not None]
    # A marker anywhere else (before text, a shell block, or with a blank gap) is an error.
    assert markers == len(skipped), f"{name(path)}: a 'not run' marker not right before a block"
    for b in skipped:
        assert b.lang == "python", f"{name(path)}:{b.line}: 'not run' before a {b.lang} block"
        reason = REASON.fullmatch(b.skip)
        assert reason is not None and len(reason[1]) >= 8, (
            f"{name(path)}:{b.line}: say why the block is not run: <!-- not run: needs torchrun -->"
        )


def test_readme_is_a_short_start() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    first = blocks(ROOT / "README.md")[0]
    assert first.lang == "sh" and first.source.split()[:2] == ["make", "demo"]
    assert "make test" in first.source
    assert any(b.lang == "python" and b.skip is None for b in blocks(ROOT / "README.md"))


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = FENCE.sub("", path.read_text())
    out = set()
    for heading in re.findall(r"^#+\s+(.*?)\s*$", text, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        out.add(slug)
    return out


@pytest.mark.parametrize("path", DOCS, ids=name)
def test_relative_links_resolve(path: Path) -> None:
    text = FENCE.sub("", path.read_text())
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s):, mailto:
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        assert dest.exists(), f"{name(path)}: link to missing {target}"
        if anchor and dest.suffix == ".md":
            assert anchor in anchors(dest), f"{name(path)}: no heading for {target}"


def test_a_broken_block_fails_and_names_its_line(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "```python\nx = 41\n```\n\n"
        "<!-- not run: needs torchrun -->\n```python\nraise SystemExit(3)\n```\n\n"
        "```sh\nexit 1\n```\n\n"
        "```python\nassert x + 1 == 42\n```\n"
    )
    assert run_blocks(doc, tmp_path).returncode == 0
    doc.write_text(doc.read_text() + "\ntext\n\n```python\nx = undefined_name\n```\n")
    result = run_blocks(doc, tmp_path)
    assert result.returncode == 1
    line = doc.read_text().splitlines().index("x = undefined_name") + 1
    assert f"FAILED: the python block at {doc}:{line}" in result.stderr
    assert f'File "{doc}", line {line}' in result.stderr  # the traceback names the doc line
    assert "undefined_name" in result.stderr


def test_architecture_picture_covers_every_module() -> None:
    # docs/architecture.png groups the modules by pipeline stage; a new module must join a
    # group (and the picture be redrawn) or this fails.
    proc = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "architecture.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr


def test_no_library_module_is_over_400_lines() -> None:
    # The style: small modules with one concept each (a module over 400 lines is two).
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / "functacc").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 400
    }
    assert not long, f"split these modules: {long}"


MODULES = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    for p in (ROOT / "functacc").rglob("*.py")
)


# Examples that show what a torch of the supported range may lack: skipped there, naming it.
NEEDS = {
    "functacc.backends.compile": (
        "make_fx_traces_generators",
        "make_fx to trace a torch.Generator argument (torch 2.12 and later)",
    ),
}


@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples_run(module: str) -> None:
    """Every ``>>>`` example in the package's docstrings runs and prints what it shows
    (the style asks for a short example per public function; an example that rots fails
    here)."""
    import doctest
    import importlib

    from functacc import _compat

    if module in NEEDS and not getattr(_compat, NEEDS[module][0])():
        pytest.skip(f"the example needs {NEEDS[module][1]}; torch {torch.__version__} lacks it")
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed"
