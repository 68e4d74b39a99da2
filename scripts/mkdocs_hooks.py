"""MkDocs hooks of the documentation site (``hooks:`` in mkdocs.yml).

Three pages are generated at build time, so they cannot drift from the code:

* ``reference/cli.md``: the ``--help`` of ``refimpl`` and of every subcommand (and of
  ``refimpl oracle``'s actions), from the argparse parsers ``refimpl.cli.build_parser`` makes.
* ``tutorials/NN_name.ipynb``: every ``tutorials/NN_*.py`` (Jupytext percent format) run as
  its header says (``mpiexec -n N --oversubscribe python tutorials/NN_name.py``; plain
  ``python`` when it names no mpiexec), cell by cell in every rank by scripts/tutorial_runner.py
  (cwd a scratch directory), and turned into a notebook whose cells carry that run's outputs:
  what rank 0 printed (every rank's lines, marked ``[rank r]``, where the ranks printed
  different things) and the PNGs the cell saved, so a picture appears in the page right below
  the code that drew it. mkdocs-jupyter renders these notebooks (its own ``execute`` is off).
* ``tutorials/index.md``: the list of tutorials with their titles.

The Tutorials entry of ``nav`` is filled with the tutorials found, so a new
``tutorials/NN_name.py`` shows up without editing mkdocs.yml.

Environment:
  DOCS_TUTORIALS=0     do not execute the tutorials (pages without outputs: fast drafts)
  DOCS_JOBS=N          tutorials run at the same time (default 2; each is N processes)
  DOCS_TUTORIAL_TIMEOUT=S   seconds one tutorial's run may take (default 900)
The site also works offline: MathJax is served from ``assets/mathjax/`` (copied from the
``django-static-mathjax`` package), the theme uses the system's fonts (``font: false``), and
the notebook pages lose nbconvert's loader of mermaid.js from a CDN.

Executed notebooks are cached under ``$TMPDIR/refimpl-docs-tutorials``, keyed on the
tutorial's text, every refimpl source file, this hook and the runner, so ``mkdocs serve``
re-runs only what changed.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import html
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

log = logging.getLogger("mkdocs.hooks.refimpl")
ROOT = Path(__file__).resolve().parent.parent
TUTORIALS = ROOT / "tutorials"
TITLE = re.compile(r"^# # (Tutorial \d+\s*[—-]\s*.+)$", re.M)
CACHE = Path(tempfile.gettempdir()) / "refimpl-docs-tutorials"
RUNNER = Path(__file__).resolve().parent / "tutorial_runner.py"
#: Open MPI's launcher's message when it failed before any rank started (tests/launcher.py)
LAUNCHER_FLAKE = "PMIx server's listener thread failed to start"
# the settings tests/test_tutorials.py runs the tutorials with (one thread per rank)
KERNEL_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
              "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MPLBACKEND": "Agg"}


def tutorial_files() -> list[Path]:
    return sorted(TUTORIALS.glob("[0-9][0-9]_*.py"))


def tutorial_title(path: Path) -> str:
    match = TITLE.search(path.read_text(encoding="utf-8"))
    return match.group(1).strip() if match else path.stem


# a comment line of the header naming the command: "#     mpiexec -n 4 python tutorials/06_x.py",
# "#     mpiexec -n 4 --oversubscribe python tutorials/06_x.py", "#     python tutorials/13_x.py ..."
RUN_LINE = re.compile(r"^#\s+(?:(?P<launcher>mpiexec|mpirun)\s(?P<options>[^\n]*?))?"
                      r"\bpython3?\s+(?P<script>\S+\.py)\b", re.M)
RANK_OPTION = re.compile(r"(?:^|\s)(?:-n|-np|--n|--np|-c)(?:\s+|=)(\d+)(?=\s|$)")


@dataclass(frozen=True)
class TutorialRun:
    """How a tutorial's header says to run it."""
    ranks: int                  # the -n of its mpiexec line; 1 when it names plain python
    script: str                 # the path as the header writes it, e.g. tutorials/06_unet_partitioned.py

    @property
    def command(self) -> str:
        if self.ranks > 1:
            return f"mpiexec -n {self.ranks} --oversubscribe python {self.script}"
        return f"python {self.script}"


def tutorial_run(path: Path) -> TutorialRun:
    """The rank count and script of the first header line that runs this tutorial (matched by
    file name; either option order of mpiexec), or one process if no line does."""
    for match in RUN_LINE.finditer(path.read_text(encoding="utf-8")):
        if Path(match.group("script")).name != path.name:
            continue
        ranks = 1
        if match.group("launcher"):
            found = RANK_OPTION.search(" " + match.group("options"))
            ranks = int(found.group(1)) if found else 1
        return TutorialRun(max(1, ranks), match.group("script"))
    return TutorialRun(1, f"tutorials/{path.name}")


# ------------------------------------------------------------------------------ nav

def on_config(config):
    """Fill the nav's "Tutorials" section with the tutorials found on disk."""
    entries = [{"Overview": "tutorials/index.md"}]
    entries += [{tutorial_title(t): f"tutorials/{t.stem}.ipynb"} for t in tutorial_files()]
    for item in config["nav"] or []:
        if isinstance(item, dict) and "Tutorials" in item:
            item["Tutorials"] = entries
    return config


# ------------------------------------------------------------------------------ CLI reference

def _subparsers(parser: argparse.ArgumentParser):
    for action in parser._actions:                       # argparse keeps them here
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def _help(parser: argparse.ArgumentParser) -> str:
    return parser.format_help().rstrip()


def cli_reference() -> str:
    from refimpl.cli import COMMANDS, build_parser
    saved = {k: os.environ.get(k) for k in ("COLUMNS", "NO_COLOR", "PYTHON_COLORS")}
    # argparse wraps to $COLUMNS; no ANSI colours in the page (Python >= 3.14 colours help)
    os.environ.update(COLUMNS="100", NO_COLOR="1", PYTHON_COLORS="0")
    try:
        parser = build_parser()
        lines = ["# CLI reference", "",
                 "Generated at build time from the argparse parsers of `refimpl/cli.py` "
                 "(`refimpl COMMAND --help`); every subcommand also takes `--debug`. "
                 "Settings read from the environment (`REFIMPL_*`) are listed in "
                 "[Training](../training.md#speed-settings-environment-variables) and "
                 "[GPUs](../gpu.md).", "",
                 "## refimpl", "", "```text", _help(parser), "```", ""]
        for name, sub in _subparsers(parser).items():
            lines += [f"## refimpl {name}", "", COMMANDS[name][1].capitalize() + ".", "",
                      "```text", _help(sub), "```", ""]
            for action, subsub in _subparsers(sub).items():
                lines += [f"### refimpl {name} {action}", "", "```text", _help(subsub), "```", ""]
                for inner, parser3 in _subparsers(subsub).items():     # e.g. refimpl oracle trace check
                    lines += [f"#### refimpl {name} {action} {inner}", "", "```text", _help(parser3), "```", ""]
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return "\n".join(lines)


# ------------------------------------------------------------------------------ tutorials

def _source_key() -> str:
    h = hashlib.sha256(Path(__file__).read_bytes())          # this hook too: it edits the pages
    h.update(RUNNER.read_bytes())                            # and the runner: it records the outputs
    for path in sorted((ROOT / "refimpl").rglob("*")):
        if path.is_file() and path.suffix in (".py", ".toml"):
            h.update(str(path.relative_to(ROOT)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _session_members(sid: int) -> list[int]:
    """The processes of session ``sid`` (Linux /proc; empty elsewhere)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if len(fields) > 3 and int(fields[3]) == sid:      # after "pid (comm)": state ppid pgrp session
            members.append(int(stat.parent.name))
    return members


def _end_session(proc: subprocess.Popen) -> None:
    """End a launch that ran too long: mpiexec first (it ends its ranks), then whatever is left
    of its session (the ranks sit in process groups of their own)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    for pid in _session_members(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _launch(cmd: list[str], cwd: Path, env: dict, timeout: float) -> tuple[int, str]:
    """Run ``cmd`` (its own process group, killed whole on timeout); its return code and output.
    Started once more when Open MPI's launcher failed before any rank started (a known flake of
    mpiexec on a loaded machine, see tests/launcher.py)."""
    for _ in range(2):
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, errors="replace", start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _end_session(proc)
            output, _ = proc.communicate()
            return -1, output + f"\n(killed after {timeout:.0f} s: DOCS_TUTORIAL_TIMEOUT)"
        if LAUNCHER_FLAKE not in output:
            break
    return proc.returncode, output


def merge_ranks(texts: list[str]) -> str:
    """One cell's output on every rank as the page shows it: rank 0's text when no other rank
    printed anything else, otherwise every rank's lines, in rank order, each marked ``[rank r]``."""
    first = texts[0]
    if all(text in ("", first) for text in texts[1:]):
        return first
    return "".join(f"[rank {r}] {line}\n" for r, text in enumerate(texts) for line in text.splitlines())


def _note(run: TutorialRun):
    """The box under the title saying what the outputs are (raw HTML: notebook markdown does not
    go through the admonition extension, so ``!!! note`` would show as typed)."""
    import nbformat
    title = (f"Outputs of rank 0 of a {run.ranks}-rank run" if run.ranks > 1 else
             "Outputs of a one-process run")
    ranks = (" Under each cell: what rank 0 printed, and the pictures the run saved; where the ranks "
             "printed different lines, every rank's lines, each marked <code>[rank r]</code>."
             if run.ranks > 1 else " Under each cell: what it printed and the pictures it saved.")
    return nbformat.v4.new_markdown_cell(
        f'<div class="admonition note">\n<p class="admonition-title">{title}</p>\n'
        f"<p>This page was executed when the site was built, as the tutorial's header says: "
        f"<code>{html.escape(run.command)}</code>.{ranks}</p>\n</div>")


def execute_tutorial(path: Path, out: Path) -> float:
    """Run ``path`` as its header says (``mpiexec -n N``), cell by cell in every rank
    (scripts/tutorial_runner.py, cwd a scratch directory), and write the notebook ``out``:
    under each code cell its output (``merge_ranks``) and the PNGs the run wrote meanwhile."""
    import jupytext
    import nbformat
    notebook = jupytext.read(path)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    run = tutorial_run(path)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"docs-{path.stem}-") as scratch:
        scratch = Path(scratch)
        work, outputs, cells = scratch / "cwd", scratch / "outputs", scratch / "cells.json"
        work.mkdir()
        cells.write_text(json.dumps([cell.source for cell in code]), encoding="utf-8")
        cmd = [sys.executable, str(RUNNER), str(cells), str(outputs), str(path)]
        if run.ranks > 1:
            mpiexec = shutil.which("mpiexec")
            if mpiexec is None:
                raise PluginError(f"tutorials/{path.name} runs under mpiexec, which is not on PATH "
                                  "(pip install -e '.[mpi]'; DOCS_TUTORIALS=0 builds without running them)")
            cmd = [mpiexec, "-n", str(run.ranks), "--oversubscribe", *cmd]
        timeout = float(os.environ.get("DOCS_TUTORIAL_TIMEOUT", "900"))
        code_rc, output = _launch(cmd, work, dict(os.environ, **KERNEL_ENV), timeout)
        done = [(outputs / f"rank{r}" / "done").exists() for r in range(run.ranks)]
        if code_rc != 0 or not all(done):
            failed = []
            for r in range(run.ranks):
                mark = outputs / f"rank{r}" / "failed"
                if mark.exists():
                    index = int(mark.read_text())
                    err = (outputs / f"rank{r}" / f"cell{index}.err").read_text(errors="replace")
                    failed.append(f"rank {r}, code cell {index}:\n{code[index].source}\n---\n{err[-4000:]}")
                elif not done[r]:                            # still running when ended: where it was
                    started = sorted(int(f.stem[4:]) for f in (outputs / f"rank{r}").glob("cell*.out"))
                    if started:
                        index = started[-1]
                        text = "".join((outputs / f"rank{r}" / f"cell{index}.{x}").read_text(errors="replace")
                                       for x in ("out", "err"))
                        failed.append(f"rank {r} was in code cell {index}; its output there:\n{text[-2000:]}")
            raise PluginError(f"tutorials/{path.name} failed when run for the docs "
                              f"({' '.join(cmd)}: exit {code_rc}):\n" + "\n".join(failed)
                              + f"\n--- launcher output (end):\n{output[-4000:]}")
        for index, cell in enumerate(code):
            cell.execution_count = index + 1
            cell.outputs = []
            for suffix, name in (("out", "stdout"), ("err", "stderr")):
                files = [outputs / f"rank{r}" / f"cell{index}.{suffix}" for r in range(run.ranks)]
                text = merge_ranks([f.read_text(errors="replace") for f in files])
                if text:
                    cell.outputs.append(nbformat.v4.new_output("stream", name=name, text=text))
            for png in sorted((outputs / "figures").glob(f"cell{index}-*.png")):
                data = base64.b64encode(png.read_bytes()).decode("ascii")
                name = png.name.partition("-")[2]
                cell.outputs.append(nbformat.v4.new_output(
                    "display_data", data={"image/png": data, "text/plain": f"<{name}>"}))
    notebook.cells.insert(1, _note(run))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    nbformat.write(notebook, str(tmp))
    tmp.replace(out)
    return time.perf_counter() - t0


def executed_notebooks(tutorials: list[Path]) -> dict[Path, Path]:
    """The executed notebook of every tutorial (from the cache, else executed now, in parallel)."""
    source = _source_key()
    todo, result = [], {}
    for t in tutorials:
        key = hashlib.sha256(source.encode() + t.read_bytes()).hexdigest()[:20]
        out = CACHE / key / f"{t.stem}.ipynb"
        result[t] = out
        if not out.exists():
            todo.append(t)
    if todo:
        jobs = max(1, int(os.environ.get("DOCS_JOBS", "2")))
        t0 = time.perf_counter()
        with ThreadPoolExecutor(jobs) as pool:
            times = list(pool.map(lambda t: execute_tutorial(t, result[t]), todo))
        log.info("executed %d tutorial(s) in %.1f s (%s)", len(todo), time.perf_counter() - t0,
                 ", ".join(f"{t.stem} {s:.1f} s" for t, s in zip(todo, times)))
    return result


def plain_notebook(path: Path, out: Path) -> Path:
    import jupytext
    out.parent.mkdir(parents=True, exist_ok=True)
    jupytext.write(jupytext.read(path), str(out), fmt="ipynb")
    return out


def tutorials_index(tutorials: list[Path]) -> str:
    lines = ["# Tutorials", "",
             "Step-through scripts in `tutorials/`, each a [Jupytext](https://jupytext.readthedocs.io) "
             "percent-format file: run it as a script, under `mpiexec` with the rank count its header "
             "names, or open it as a notebook (`jupytext --to notebook tutorials/03_halo_exchange.py`). "
             "The pages below were executed when this site was built, each as its header says "
             "(`mpiexec -n 4` for most); under each cell the page shows what rank 0 printed and the "
             "pictures the run saved, and where the ranks printed different lines, every rank's "
             "lines, each marked `[rank r]`.", "",
             "```bash",
             "mpiexec -n 4 --oversubscribe python tutorials/03_halo_exchange.py   # 4 ranks, more than cores",
             "python tutorials/03_halo_exchange.py                                # 1 rank",
             "```", "",
             "| | tutorial | run with |", "|---|---|---|"]
    for t in tutorials:
        title = tutorial_title(t)
        number, _, name = title.partition("—") if "—" in title else ("", "", title)
        lines.append(f"| {t.stem[:2]} | [{name.strip() or title}]({t.stem}.ipynb) | "
                     f"`{tutorial_run(t).command}` |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ offline site

#: MathJax 3 (its es5 build), served from the site: the files the page loads (tex-mml-chtml.js
#: in mkdocs.yml's extra_javascript) and those it fetches on demand (TeX extensions, fonts, the
#: menu's accessibility tools); from the django-static-mathjax wheel (the ``docs`` extra)
MATHJAX_SITE_DIR = "assets/mathjax"
MATHJAX_PARTS = ("tex-mml-chtml.js", "input", "output/chtml", "ui", "a11y", "adaptors", "sre")


def mathjax_dir() -> Path:
    from importlib.metadata import PackageNotFoundError, distribution
    try:
        es5 = Path(distribution("django-static-mathjax").locate_file("mathjax/static/mathjax/es5"))
    except PackageNotFoundError:
        es5 = None
    if es5 is None or not (es5 / "tex-mml-chtml.js").is_file():
        raise PluginError("MathJax not found: pip install -e '.[docs]' (django-static-mathjax "
                          "ships the MathJax the site serves itself)")
    return es5


def mathjax_files(config) -> list[File]:
    es5, files = mathjax_dir(), []
    for part in MATHJAX_PARTS:
        root = es5 / part
        found = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for path in found:
            files.append(File.generated(config, f"{MATHJAX_SITE_DIR}/{path.relative_to(es5).as_posix()}",
                                        abs_src_path=str(path)))
    return files


# nbconvert's page template loads mermaid.js from a CDN when a notebook holds a mermaid diagram;
# no tutorial does, and the site must not name a script on another host
MERMAID_LOADER = re.compile(r'<script type="module">(?:(?!</script>).)*?mermaid(?:(?!</script>).)*?</script>',
                            re.S)


#: where docs/peers.md's table of DTensor's verdicts on the hard suite begins
HARD_TABLE = "<!-- table: hard -->"


def _hard_table(markdown: str) -> tuple[set, int]:
    """(the case file names of the hard table's rows, the offset just past its last row)."""
    offset = markdown.index(HARD_TABLE)
    rows, started = set(), False
    for line in markdown[offset:].splitlines(keepends=True):
        if line.startswith("|"):
            started = True
            rows.add(line.strip().strip("|").split("|")[0].strip().strip("`"))
        elif started:
            break
        offset += len(line)
    return rows, offset


def hard_cases_without_rows(markdown: str) -> list[str]:
    """The case files of the shipped ``hard`` suite that the page's hard table has no row for:
    cases added since the last DTensor run (it takes ~15 minutes; the page shows the command)."""
    return _cases_without(_hard_table(markdown)[0])


def _cases_without(rows: set) -> list[str]:
    from refimpl.oracle import load_suite
    return sorted(spec.file_name for spec in load_suite("hard") if spec.file_name not in rows)


def hard_table_note(markdown: str) -> str:
    """``markdown`` with a note after the hard table naming the suite's cases it has no row
    for, so that a new ``hard`` case needs no DTensor run to keep the page true (and CI green)."""
    rows, end = _hard_table(markdown)
    missing = _cases_without(rows)
    if not missing:
        return markdown
    note = (f"\n**Not run under DTensor yet** ({len(missing)} case file{'s' if len(missing) > 1 else ''} added to the "
            "suite since this table was made; the commands above give their rows): "
            + ", ".join(f"`{name}`" for name in missing) + ".\n")
    return markdown[:end] + note + markdown[end:]


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri == "peers.md":
        markdown = hard_table_note(markdown)
    return markdown


def on_post_page(output, page, config):
    if page.file.src_uri.endswith(".ipynb"):
        output = MERMAID_LOADER.sub("", output)
    return output


_SRC_DIR: Path | None = None


def on_post_build(config):
    if _SRC_DIR is not None:
        shutil.rmtree(_SRC_DIR, ignore_errors=True)


@event_priority(100)                 # before mkdocs-jupyter wraps the .ipynb files
def on_files(files, config):
    tutorials = tutorial_files()
    files.append(File.generated(config, "reference/cli.md", content=cli_reference()))
    files.append(File.generated(config, "tutorials/index.md", content=tutorials_index(tutorials)))
    for file in mathjax_files(config):
        files.append(file)
    if os.environ.get("DOCS_TUTORIALS", "1") == "0":
        scratch = CACHE / "plain"
        notebooks = {t: plain_notebook(t, scratch / f"{t.stem}.ipynb") for t in tutorials}
    else:
        notebooks = executed_notebooks(tutorials)
    # a File with a src_dir (not File.generated): mkdocs-jupyter's wrapper reads abs_src_path,
    # which a generated file computes from src_dir
    global _SRC_DIR
    src_dir = _SRC_DIR = Path(tempfile.mkdtemp(prefix="refimpl-docs-src-"))
    (src_dir / "tutorials").mkdir()
    for t, nb in notebooks.items():
        shutil.copyfile(nb, src_dir / "tutorials" / f"{t.stem}.ipynb")
        files.append(File(f"tutorials/{t.stem}.ipynb", src_dir=str(src_dir), dest_dir=config.site_dir,
                          use_directory_urls=config.use_directory_urls))
    return files
