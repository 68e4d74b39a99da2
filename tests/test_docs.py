"""The documentation site builds, and what its pages show runs.

1. ``mkdocs build --strict`` succeeds (the CLI reference generated from the parsers, the API
   reference from the docstrings, every tutorial executed; scripts/mkdocs_hooks.py).
2. Every command shown in a ```bash, ```console or ```sh block of docs/**/*.md that starts with
   ``refimpl `` or ``python -m refimpl``, directly or after ``mpiexec`` and its options (in console
   blocks: after a ``$ `` prompt), runs and exits 0 (``--oversubscribe`` is added to mpiexec), and every ```python block runs as a script. A page's blocks run in page order in one
   scratch directory, so a later command can read what an earlier one wrote.

Markers, HTML comments on the lines right before a block (docs/contributing.md, "Writing docs that are
tested"):

    <!-- not-run: REASON -->      skip the block (cluster-only, long, a fragment); REASON required
    <!-- save-as: FILE -->        also write the block's text to FILE (a python block runs as FILE)
    <!-- exit-codes: 0 1 -->      expected exit status of each command of the block, in order
    <!-- ranks: N -->             run a python block under ``mpiexec -n N``
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from launcher import run_launched

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
TIMEOUT = 120                       # seconds per command; every shown command takes < 60 s here
SHELL_LANGS = {"bash", "console", "sh", "shell"}
FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ ]*$",
                   re.M | re.S)
MARKER = re.compile(r"^\s*<!--\s*(?P<key>[\w-]+)\s*:\s*(?P<value>.*?)\s*-->\s*$")
KNOWN_MARKERS = {"not-run", "save-as", "exit-codes", "ranks"}
#: a refimpl command, run directly or under mpiexec (its options before the program)
LAUNCHED = re.compile(r"^(?:mpiexec(?:\s+-{1,2}[\w-]+(?:\s+(?!refimpl\b|python\b)[^\s-]\S*)?)*\s+)?"
                      r"(?:refimpl|python -m refimpl)\s")
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MPLBACKEND="Agg",
           PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    body: str
    markers: dict = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    def commands(self) -> list[str]:
        """The refimpl commands of a shell block, continuation lines joined."""
        out, pending = [], None
        for raw in self.body.splitlines():
            line = raw.rstrip()
            if pending is not None:                     # inside a backslash continuation
                pending += " " + line.strip().rstrip("\\").strip()
                if not line.endswith("\\"):
                    out.append(pending)
                    pending = None
                continue
            text = line.strip()
            if self.lang == "console":
                if not text.startswith("$ "):
                    continue                            # output, not a command
                text = text[2:].strip()
            if text.endswith("\\"):
                pending = text.rstrip("\\").strip()
                continue
            out.append(text)
        if pending is not None:
            out.append(pending)
        return [c for c in out if LAUNCHED.match(c)]


def blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    found = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        body = "\n".join(l[len(m.group("indent")):] for l in m.group("body").splitlines())
        markers = {}
        before = text[:m.start()].splitlines()
        while before and MARKER.match(before[-1]):      # the marker lines right above the fence
            mm = MARKER.match(before.pop())
            markers[mm.group("key")] = mm.group("value")
        found.append(Block(page, line, m.group("lang").lower(), body + "\n", markers))
    return found


def runnable(block: Block) -> bool:
    if block.lang == "python":
        return True
    return block.lang in SHELL_LANGS and bool(block.commands())


RUN_PAGES = [p for p in PAGES if any(runnable(b) or "save-as" in b.markers for b in blocks(p))]


def test_markers_are_known_and_explained():
    """Every marker is one of the four, a not-run says why, and the not-run list stays short."""
    skipped = []
    for page in PAGES:
        for b in blocks(page):
            unknown = set(b.markers) - KNOWN_MARKERS
            assert not unknown, f"{b.where}: unknown marker(s) {sorted(unknown)}"
            if "not-run" in b.markers:
                assert len(b.markers["not-run"]) >= 8, f"{b.where}: not-run needs a reason"
                skipped.append(b.where)
            if "exit-codes" in b.markers:
                codes = b.markers["exit-codes"].split()
                assert all(c.isdigit() for c in codes) and len(codes) == len(b.commands()), \
                    f"{b.where}: exit-codes {codes} for commands {b.commands()}"
    assert len(skipped) <= 12, f"too many not-run blocks: {skipped}"


def test_the_docs_show_runnable_commands():
    """The parser finds the commands (a regression guard for the fence and prompt rules)."""
    commands = [c for p in PAGES for b in blocks(p) if b.lang in SHELL_LANGS and "not-run" not in b.markers
                for c in b.commands()]
    assert any(c.startswith("refimpl oracle generate") for c in commands), commands
    assert any(c.startswith("refimpl train") for c in commands), commands
    assert len(commands) >= 10, commands


def _run(cmd, cwd: Path, where: str, expected: int = 0, shell: bool = False):
    try:
        proc = run_launched(cmd, cwd=cwd, env=ENV, shell=shell, executable="/bin/bash" if shell else None,
                            timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{where}: `{cmd}` took more than {TIMEOUT} s (shorten it in the docs, "
                    "or mark the block <!-- not-run: reason -->)")
    assert proc.returncode == expected, (
        f"{where}: `{cmd if shell else ' '.join(map(str, cmd))}` exited {proc.returncode}, expected {expected}\n"
        f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}")


@pytest.mark.parametrize("page", RUN_PAGES, ids=[str(p.relative_to(DOCS)) for p in RUN_PAGES])
def test_page_blocks_run(page, tmp_path):
    pytest.importorskip("mpi4py", reason="the docs' commands need mpi4py: pip install -e '.[mpi]'")
    text = page.read_text(encoding="utf-8")
    if "run-torch" in text:
        pytest.importorskip("torch", reason="this page runs PyTorch: pip install -e '.[oracle]'")
    for b in blocks(page):
        if "not-run" in b.markers:
            continue
        target = b.markers.get("save-as")
        if target:
            (tmp_path / target).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / target).write_text(b.body, encoding="utf-8")
        if b.lang == "python":
            script = tmp_path / (target or f"_block_{b.line}.py")
            script.write_text(b.body, encoding="utf-8")
            ranks = int(b.markers.get("ranks", "1"))
            cmd = [sys.executable, str(script)]
            if ranks > 1:
                cmd = [shutil.which("mpiexec", path=ENV["PATH"]), "--oversubscribe", "-n", str(ranks)] + cmd
            _run(cmd, tmp_path, b.where)
        elif b.lang in SHELL_LANGS:
            commands = b.commands()
            codes = [int(c) for c in b.markers.get("exit-codes", "").split()] or [0] * len(commands)
            for command, code in zip(commands, codes, strict=True):
                if command.startswith("mpiexec ") and "--oversubscribe" not in command:
                    command = "mpiexec --oversubscribe " + command[len("mpiexec "):]   # 2 cores here
                _run(command, tmp_path, b.where, expected=code, shell=True)


def test_mkdocs_build_strict(tmp_path):
    """The whole site, strict: broken links, anchors, docstrings and tutorials all fail it."""
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocs_jupyter", "jupytext", "nbclient"):
        pytest.importorskip(module, reason="pip install -e '.[docs]'")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                           "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                          cwd=ROOT, env=dict(ENV, NO_MKDOCS_2_WARNING="1"), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    site = tmp_path / "site"
    cli = (site / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    for command in ("refimpl train", "refimpl check-layer", "refimpl oracle check", "--grid"):
        assert command in cli, command
    for tutorial in sorted((ROOT / "tutorials").glob("[0-9][0-9]_*.py")):
        page = site / "tutorials" / tutorial.stem / "index.html"
        assert page.exists(), page
        html = page.read_text(encoding="utf-8")
        assert "jp-OutputArea" in html or "output_area" in html, f"{tutorial.name}: no outputs rendered"
        if "savefig(" in tutorial.read_text(encoding="utf-8"):   # its picture is in the page
            assert 'src="data:image/png' in html, f"{tutorial.name}: saved PNG not shown"
