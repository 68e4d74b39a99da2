"""The documentation site builds, and what its pages show runs.

1. ``mkdocs build --strict`` succeeds (the CLI reference generated from the parsers, the API
   reference from the docstrings, every tutorial executed; scripts/mkdocs_hooks.py).
2. Every command shown in a ```bash, ```console or ```sh block of README.md and docs/**/*.md
   (in console blocks: after a ``$ `` prompt) that starts a program of ``PROGRAMS`` (after
   ``VAR=value`` assignments, or after an ``&&``) runs exactly as written and exits 0 (but on
   the pages of ``PARSED_ONLY``), and every ```python block runs as a script. A page's blocks run
   in page order in one scratch directory holding ``scripts/`` and ``tutorials/`` (the clone
   root's layout), so a later command can read what an earlier one wrote; the environment has
   Open MPI's root variables (CI runs as root).
3. What is not run is parsed (``test_every_documented_command_runs_or_parses``): the commands of
   ``not-run`` blocks and installs (``pip install``: they would change the environment the
   suite runs in). ``refimpl`` commands go through refimpl's own argparse parser, ``mpiexec``
   options through Open MPI (``mpiexec OPTIONS true``), ``python scripts/X.py`` must exist and
   know every ``--flag`` it is given (its ``--help``), ``python tutorials/X.py`` must exist, an
   install must name extras pyproject.toml has, ``bash X.sh`` must pass ``bash -n``. The
   tutorials' header commands are run by tests/test_tutorials.py, exactly as written.
   Every ``mpiexec`` line is written ``mpiexec -n N --oversubscribe ...`` (one convention:
   a 2-core machine refuses ``-n 4`` without it).

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
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

from launcher import run_launched

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md"] + sorted(DOCS.rglob("*.md"))
TUTORIALS = sorted((ROOT / "tutorials").glob("[0-9][0-9]_*.py"))
TIMEOUT = 120                       # seconds per command; every shown command takes < 60 s here
SHELL_LANGS = {"bash", "console", "sh", "shell"}
#: the programs whose commands the docs' shell blocks show (what else a block holds: cd, mkdir, ...)
PROGRAMS = ("mpiexec", "refimpl", "python", "bash", "srun", "pip")
#: a command line: one of them starts it, after VAR=value assignments, or after an ``&&``
COMMAND = re.compile(r"(?:^|&&\s*)(?:\w+=\S*\s+)*(?:" + "|".join(PROGRAMS) + r")\s")
#: the one launch convention of the docs
CONVENTION = re.compile(r"\bmpiexec -n \d+ --oversubscribe\s")
#: pages still written without the convention (the run adds ``--oversubscribe``); a page here
#: that follows it fails test_one_launch_convention
NOT_YET_CONVENTIONAL: set = set()
#: pages whose commands are parsed, never run, and why (a page of measurements: each command
#: is the run behind a table, minutes to hours here)
PARSED_ONLY = {"docs/benchmarks.md": "the measurement runs behind its tables"}
FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ ]*$",
                   re.M | re.S)
MARKER = re.compile(r"^\s*<!--\s*(?P<key>[\w-]+)\s*:\s*(?P<value>.*?)\s*-->\s*$")
KNOWN_MARKERS = {"not-run", "save-as", "exit-codes", "ranks"}
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
        """The commands of a shell block (``COMMAND``), continuation lines joined."""
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
        return [c for c in out if COMMAND.search(c)]


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


RUN_PAGES = [p for p in PAGES if str(p.relative_to(ROOT)) not in PARSED_ONLY
             and any(runnable(b) or "save-as" in b.markers for b in blocks(p))]


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
    assert len(skipped) <= 30, f"too many not-run blocks: {skipped}"      # their commands are still parsed


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


def is_install(command: str) -> bool:
    """``pip install ...`` (also as ``python -m pip``): parsed, never run (it would change the
    environment the suite runs in)."""
    return bool(re.search(r"(?:^|&&\s*)(?:python -m )?pip install\b", command))


def where(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", RUN_PAGES, ids=[str(p.relative_to(ROOT)) for p in RUN_PAGES])
def test_page_blocks_run(page, tmp_path):
    pytest.importorskip("mpi4py", reason="the docs' commands need mpi4py: pip install -e '.[mpi]'")
    text = page.read_text(encoding="utf-8")
    if "run-torch" in text:
        pytest.importorskip("torch", reason="this page runs PyTorch: pip install -e '.[oracle]'")
    for name in ("scripts", "tutorials"):                     # the clone root's layout, for relative paths
        (tmp_path / name).symlink_to(ROOT / name, target_is_directory=True)
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
                if is_install(command):
                    continue                                  # parsed: test_every_documented_command_runs_or_parses
                if where(page) in NOT_YET_CONVENTIONAL and not CONVENTION.search(command):
                    command = re.sub(r"\bmpiexec ", "mpiexec --oversubscribe ", command, count=1)   # 2 cores here
                _run(command, tmp_path, b.where, expected=code, shell=True)


# ------------------------------------------------------------------ every command: run or parsed

def header_commands() -> list[tuple[str, str]]:
    """(where, command) of every tutorial's header run line."""
    found = []
    for t in TUTORIALS:
        m = re.search(r"^#\s+((?:mpiexec .*?)?python tutorials/\S+\.py)", t.read_text(encoding="utf-8"), re.M)
        assert m, f"{t.name}: no run line in its header"
        found.append((f"tutorials/{t.name}", m.group(1)))
    return found


def documented_commands() -> list[tuple[str, str, str]]:
    """(where, command, how) of every command the README, the docs and the tutorials' headers
    show; how: "run" (test_page_blocks_run), "tutorial" (tests/test_tutorials.py) or "parsed"."""
    found = []
    for page in PAGES:
        for b in blocks(page):
            if b.lang not in SHELL_LANGS:
                continue
            for c in b.commands():
                parsed = "not-run" in b.markers or is_install(c) or where(page) in PARSED_ONLY
                found.append((b.where, c, "parsed" if parsed else "run"))
    return found + [(w, c, "tutorial") for w, c in header_commands()]


@cache
def _pyproject_extras() -> frozenset:
    return frozenset(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


@cache
def _mpiexec_accepts(options: tuple) -> str:
    """'' when Open MPI takes ``options`` (``mpiexec OPTIONS true``), else its complaint."""
    proc = run_launched([shutil.which("mpiexec", path=ENV["PATH"]), *options, "true"], env=ENV, timeout=60)
    return "" if proc.returncode == 0 else (proc.stderr or proc.stdout)[-800:]


@cache
def _script_help(script: str) -> str:
    proc = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"{script} --help exited {proc.returncode}: {proc.stderr[-800:]}"
    return proc.stdout


def _refimpl_parses(argv: list[str]) -> None:
    from refimpl.cli import build_parser
    try:
        build_parser().parse_args(argv)
    except SystemExit as stop:
        if stop.code:
            raise AssertionError(f"refimpl's parser refuses {argv}") from None


def check_parsed(command: str) -> None:
    """AssertionError unless every program of ``command`` would start as written (see the module
    docstring, item 3): without running what would take long or need a GPU or a cluster."""
    for segment in re.split(r"\s*&&\s*", command):
        words = shlex.split(segment, comments=True)
        assigned = set()
        while words and re.fullmatch(r"\w+=.*", words[0]):       # VAR=value before the program
            assigned.add(words.pop(0).split("=")[0])
        if words[:1] == ["exec"]:
            words.pop(0)
        if not words or words[0] not in PROGRAMS:
            continue                                              # cd, mkdir, ... the shell's own
        if words[0] in ("mpiexec", "srun"):                      # the launcher's options, then the program
            i = 1
            while i < len(words) and words[i].startswith("-"):
                takes = i + 1 < len(words) and not words[i + 1].startswith("-") and words[i + 1] not in PROGRAMS
                i += 2 if takes else 1
            launcher, options, words = words[0], words[1:i], words[i:]
            if launcher == "mpiexec":                            # (srun: no Slurm here)
                # one rank: the options are checked, not this machine's cores (a cluster's -n 64 --bind-to core)
                one = tuple("1" if k and options[k - 1] in ("-n", "-np") else o for k, o in enumerate(options))
                complaint = _mpiexec_accepts(one)
                assert not complaint, f"Open MPI refuses mpiexec {' '.join(one)} true:\n{complaint}"
            if not words:
                raise AssertionError(f"no program after the launcher in {segment!r}")
        program, args = words[0], words[1:]
        if program == "refimpl" and "REFIMPL_KINDS" in assigned:
            continue      # kinds of a file the page writes (docs/contributing.md): its own run executes it
        if program == "refimpl":
            _refimpl_parses(args)
        elif program in ("python", "pip"):
            if program == "pip":
                args = ["-m", "pip"] + args
            if args[:2] == ["-m", "refimpl"]:
                if "REFIMPL_KINDS" not in assigned:
                    _refimpl_parses(args[2:])
            elif args[:3] == ["-m", "pip", "install"]:
                for spec in args[3:]:
                    extras = re.fullmatch(r"\.\[([\w,-]+)\]", spec)
                    if extras:
                        missing = set(extras.group(1).split(",")) - _pyproject_extras()
                        assert not missing, f"pyproject.toml has no extra(s) {sorted(missing)}"
            elif args[:1] == ["-c"]:
                compile(args[1], "<python -c>", "exec")
            elif args and args[0].startswith("tutorials/"):
                assert (ROOT / args[0]).is_file(), f"{args[0]} does not exist"
            elif args and args[0].startswith("scripts/"):
                assert (ROOT / args[0]).is_file(), f"{args[0]} does not exist"
                known = set(re.findall(r"--[\w-]+", _script_help(args[0])))
                unknown = [a.split("=")[0] for a in args[1:] if a.startswith("--") and a.split("=")[0] not in known]
                assert not unknown, f"{args[0]} takes no {unknown}"
            else:
                raise AssertionError(f"no check for {segment!r}: run it, or teach check_parsed")
        elif program == "bash":
            if args[:1] == ["-c"]:
                check_parsed(args[1])
            else:
                assert (ROOT / args[0]).is_file(), f"{args[0]} does not exist"
                proc = subprocess.run(["bash", "-n", str(ROOT / args[0])], capture_output=True, text=True)
                assert proc.returncode == 0, f"bash -n {args[0]}: {proc.stderr}"


@pytest.mark.parametrize("command", [
    "refimpl train --grid 1,2,1,1 --no-such-flag",
    "mpiexec -n 2 --oversubscribe refimpl plan --batch",
    "mpiexec -n 2 --no-such-option python tutorials/01_conv_by_hand.py",
    "mpiexec -n 4 --oversubscribe python tutorials/99_missing.py",
    "python scripts/bench_plan.py --model unet3d --no-such-flag 3",
    'python -m pip install -e ".[mpi,no-such-extra]"',
    "bash scripts/no_such_script.sh",
    "srun -n 2 refimpl check-layer conv3d --grid 1,2,1,1",          # --input is required
])
def test_check_parsed_refuses(command):
    """The parse check fails what would not start: each program's own refusal."""
    pytest.importorskip("mpi4py", reason="checking mpiexec's options needs mpiexec: pip install -e '.[mpi]'")
    with pytest.raises(AssertionError):
        check_parsed(command)


def test_one_launch_convention():
    """Every mpiexec line of the README, the docs and the tutorials' headers is written
    ``mpiexec -n N --oversubscribe ...`` (runs as written on a 2-core machine)."""
    off = [(w, c) for w, c, _ in documented_commands()
           if "mpiexec" in c and not CONVENTION.search(c) and w.split(":")[0] not in NOT_YET_CONVENTIONAL]
    assert not off, "write mpiexec -n N --oversubscribe ...:\n" + "\n".join(f"{w}: {c}" for w, c in off)
    for page in NOT_YET_CONVENTIONAL:                           # an exemption that is no longer needed
        assert any(w.startswith(page + ":") and "mpiexec" in c and not CONVENTION.search(c)
                   for w, c, _ in documented_commands()), f"{page} follows the convention now: drop it from the list"


def test_every_documented_command_runs_or_parses(capsys):
    """Every command the README, the docs and the tutorials' headers show is run (by
    test_page_blocks_run, or tests/test_tutorials.py) or, where that would take long or needs a
    GPU, a cluster or an install, parsed (``check_parsed``); the counts are printed."""
    pytest.importorskip("mpi4py", reason="checking mpiexec's options needs mpiexec: pip install -e '.[mpi]'")
    commands = documented_commands()
    failures = []
    for w, c, how in commands:
        if how == "parsed" or "mpiexec" in c:                 # also every tutorial header's mpiexec options
            try:
                check_parsed(c)
            except (AssertionError, ValueError, SyntaxError) as err:
                failures.append(f"{w}: `{c}`: {err}")
    assert not failures, "\n".join(failures)
    count = {how: sum(h == how for _, _, h in commands) for how in ("run", "tutorial", "parsed")}
    with capsys.disabled():
        print(f"\ndocumented commands: {len(commands)}: {count['run']} run by the page tests, "
              f"{count['tutorial']} tutorial headers run by tests/test_tutorials.py, {count['parsed']} parsed")
    assert count["tutorial"] == len(TUTORIALS) and count["run"] >= 40 and count["parsed"] >= 15, count
    assert sum(count.values()) == len(commands)


def test_mkdocs_build_strict(tmp_path):
    """The whole site, strict: broken links, anchors, docstrings and tutorials all fail it."""
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocs_jupyter", "jupytext", "nbclient"):
        pytest.importorskip(module, reason="pip install -e '.[docs]'")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
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
