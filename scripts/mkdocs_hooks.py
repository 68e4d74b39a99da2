"""MkDocs hooks of the documentation site (``hooks:`` in mkdocs.yml).

Three pages are generated at build time, so they cannot drift from the code:

* ``reference/cli.md``: the ``--help`` of ``refimpl`` and of every subcommand (and of
  ``refimpl oracle``'s actions), from the argparse parsers ``refimpl.cli.build_parser`` makes.
* ``tutorials/NN_name.ipynb``: every ``tutorials/NN_*.py`` (Jupytext percent format)
  converted to a notebook and executed in a Jupyter kernel (one process, cwd a scratch
  directory); a PNG a cell saves into the cwd is attached to that cell's outputs, so the
  picture appears in the page right below the code that drew it. mkdocs-jupyter renders
  the executed notebooks (its own ``execute`` is off).
* ``tutorials/index.md``: the list of tutorials with their titles.

The Tutorials entry of ``nav`` is filled with the tutorials found, so a new
``tutorials/NN_name.py`` shows up without editing mkdocs.yml.

Environment:
  DOCS_TUTORIALS=0     do not execute the tutorials (pages without outputs: fast drafts)
  DOCS_JOBS=N          tutorials executed at the same time (default 2)
Executed notebooks are cached under ``$TMPDIR/refimpl-docs-tutorials``, keyed on the
tutorial's text and every refimpl source file, so ``mkdocs serve`` re-runs only what changed.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import logging
import os
import re
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

log = logging.getLogger("mkdocs.hooks.refimpl")
ROOT = Path(__file__).resolve().parent.parent
TUTORIALS = ROOT / "tutorials"
TITLE = re.compile(r"^# # (Tutorial \d+\s*[—-]\s*.+)$", re.M)
CACHE = Path(tempfile.gettempdir()) / "refimpl-docs-tutorials"
# one process per kernel, the same settings tests/test_tutorials.py runs the tutorials with
KERNEL_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
              "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MPLBACKEND": "Agg"}


def tutorial_files() -> list[Path]:
    return sorted(TUTORIALS.glob("[0-9][0-9]_*.py"))


def tutorial_title(path: Path) -> str:
    match = TITLE.search(path.read_text(encoding="utf-8"))
    return match.group(1).strip() if match else path.stem


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
    for path in sorted((ROOT / "refimpl").rglob("*")):
        if path.is_file() and path.suffix in (".py", ".toml"):
            h.update(str(path.relative_to(ROOT)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _attach_new_pngs(workdir: Path, seen: dict, cell) -> None:
    """Attach every PNG that appeared or changed in ``workdir`` to ``cell``'s outputs."""
    import nbformat
    for png in sorted(workdir.glob("*.png")):
        stamp = png.stat().st_mtime_ns, png.stat().st_size
        if seen.get(png.name) == stamp:
            continue
        seen[png.name] = stamp
        data = base64.b64encode(png.read_bytes()).decode("ascii")
        cell.outputs.append(nbformat.v4.new_output(
            "display_data", data={"image/png": data, "text/plain": f"<{png.name}>"}))


def execute_tutorial(path: Path, out: Path) -> float:
    """Convert ``path`` to a notebook, run it in a kernel in a scratch cwd, write ``out``."""
    import jupytext
    import nbclient
    import nbformat
    notebook = jupytext.read(path)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"docs-{path.stem}-") as work:
        workdir, seen = Path(work), {}

        def on_cell_executed(cell, cell_index, execute_reply):
            _attach_new_pngs(workdir, seen, cell)

        client = nbclient.NotebookClient(
            notebook, timeout=600, kernel_name="python3", allow_errors=False,
            resources={"metadata": {"path": work}}, on_cell_executed=on_cell_executed)
        try:
            client.execute(env=dict(os.environ, **KERNEL_ENV))
        except nbclient.exceptions.CellExecutionError as err:
            raise PluginError(f"tutorials/{path.name} failed when executed for the docs:\n{err}") from err
    # the outputs are a 1-rank run: say so under the title, with the command that shows the messages
    match = re.search(r"^#\s+(mpiexec -n \d+ python tutorials/\S+\.py)", path.read_text(encoding="utf-8"), re.M)
    if match:
        notebook.cells.insert(1, nbformat.v4.new_markdown_cell(
            "!!! note \"The outputs below are from one process\"\n"
            "    The site runs each tutorial as a notebook, on one rank: no message is sent. Run it as "
            f"its header says to see the ranks at work:\n    `{match.group(1).replace('mpiexec', 'mpiexec --oversubscribe', 1)}` "
            "(`--oversubscribe`: more ranks than cores)."))
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
             "The pages below were executed when this site was built, in one process "
             "(every tutorial also runs on one rank); what a cell prints and the pictures it saves "
             "are shown under it.", "",
             "```bash",
             "mpiexec -n 4 python tutorials/03_halo_exchange.py   # 4 ranks",
             "python tutorials/03_halo_exchange.py                # 1 rank",
             "```", "",
             "| | tutorial | run with |", "|---|---|---|"]
    run_line = re.compile(r"^#\s+((?:mpiexec -n \d+ )?python tutorials/\S+\.py)", re.M)
    for t in tutorials:
        match = run_line.search(t.read_text(encoding="utf-8"))
        title = tutorial_title(t)
        number, _, name = title.partition("—") if "—" in title else ("", "", title)
        lines.append(f"| {t.stem[:2]} | [{name.strip() or title}]({t.stem}.ipynb) | "
                     f"`{match.group(1) if match else 'python tutorials/' + t.name}` |")
    return "\n".join(lines) + "\n"


_SRC_DIR: Path | None = None


def on_post_build(config):
    if _SRC_DIR is not None:
        shutil.rmtree(_SRC_DIR, ignore_errors=True)


@event_priority(100)                 # before mkdocs-jupyter wraps the .ipynb files
def on_files(files, config):
    tutorials = tutorial_files()
    files.append(File.generated(config, "reference/cli.md", content=cli_reference()))
    files.append(File.generated(config, "tutorials/index.md", content=tutorials_index(tutorials)))
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
