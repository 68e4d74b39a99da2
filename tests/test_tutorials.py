"""Every tutorial runs top to bottom under mpiexec with the rank counts it declares (its asserts
are its checks), and one runs as a notebook.

A tutorial declares how it is run in its header, on a line of its own, the one launch
convention of the docs (``--oversubscribe``: more ranks than cores, as on a 2-core machine):

    #     mpiexec -n 4 --oversubscribe python tutorials/NN_name.py     (any number of ranks; 1 works too)
    #     python tutorials/NN_name.py        (one process ...)

That command is run exactly as written, from a scratch directory holding ``tutorials/`` (the
clone root's layout; what the tutorial writes lands there).  A tutorial that says "any number
of ranks" is also run with 1 and 3 ranks (3: a count that divides nothing evenly), and with
the counts of ``MORE_RANKS``; those runs go through ``python -m mpi4py`` (an exception on one
rank aborts them all, never a hang until the timeout).
"""
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from launcher import run_launched

pytest.importorskip("mpi4py", reason="mpi4py is not installed: pip install 'refimpl[mpi]'")

ROOT = Path(__file__).resolve().parent.parent
TUTORIALS = sorted((ROOT / "tutorials").glob("[0-9]*.py"))
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MPLBACKEND="Agg",
           PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
RUN_LINE = re.compile(r"^#\s+(?P<command>(?:mpiexec -n (?P<ranks>\d+) --oversubscribe )?"
                      r"python tutorials/(?P<name>\S+\.py))(?P<note>.*)$", re.M)
#: more rank counts for a tutorial that picks its grid from the rank count (5: a prime above 3;
#: 6: two factors, neither of them 1)
MORE_RANKS = {"08_hybrid_training_step.py": {2, 5, 6}}


def run_line(path: Path) -> tuple[str, int]:
    """The command ``path``'s header declares, and its rank count."""
    match = RUN_LINE.search(path.read_text())
    if match is None or match.group("name") != path.name:
        raise ValueError(f"{path.name} declares no run line for itself in its header (written as "
                         f"'mpiexec -n N --oversubscribe python tutorials/{path.name}' or 'python tutorials/...')")
    return match.group("command"), int(match.group("ranks") or 1)


def declared_ranks(path: Path) -> list[int]:
    """The rank counts ``path`` is run with: its header's, and more when it says "any number"."""
    ranks = {run_line(path)[1]}
    if "any number of ranks" in RUN_LINE.search(path.read_text()).group("note"):
        ranks |= {1, 3} | MORE_RANKS.get(path.name, set())
    return sorted(ranks)


RUNS = [(t, n) for t in TUTORIALS for n in declared_ranks(t)]


def test_the_learning_path_is_complete():
    """Twelve or more tutorials, numbered 01, 02, ... without gaps, each a Jupytext percent script."""
    numbers = [int(t.name[:2]) for t in TUTORIALS]
    assert len(TUTORIALS) >= 12 and numbers == list(range(1, len(TUTORIALS) + 1)), numbers
    for t in TUTORIALS:
        text = t.read_text()
        assert text.startswith("# %% [markdown]\n# # Tutorial"), t.name


@pytest.mark.parametrize("tutorial,nranks", RUNS, ids=[f"{t.stem}-{n}" for t, n in RUNS])
def test_tutorial_runs(tutorial, nranks, tmp_path):
    command, declared = run_line(tutorial)
    if nranks == declared:               # the header's command, exactly as written, from a clone-like root
        (tmp_path / "tutorials").symlink_to(ROOT / "tutorials", target_is_directory=True)
        proc = run_launched(command, shell=True, executable="/bin/bash", cwd=tmp_path, env=ENV, timeout=600)
    else:                                # python -m mpi4py: an exception on one rank aborts them all
        cmd = [shutil.which("mpiexec", path=ENV["PATH"]), "-n", str(nranks), "--oversubscribe", sys.executable,
               "-m", "mpi4py", str(tutorial)]
        proc = run_launched(cmd, cwd=tmp_path, env=ENV, timeout=600)
    assert proc.returncode == 0, f"{tutorial.name} with {nranks} ranks failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def test_a_tutorial_runs_as_a_notebook(tmp_path):
    """What a learner does in Jupyter: the percent script converted with jupytext, executed cell by
    cell in a kernel (one process), every cell without error, the printed checks in the outputs."""
    jupytext = pytest.importorskip("jupytext", reason="pip install -e '.[test]'")
    nbclient = pytest.importorskip("nbclient", reason="pip install -e '.[test]'")
    tutorial = ROOT / "tutorials" / "03_halo_exchange.py"
    notebook = jupytext.read(tutorial)
    assert sum(c.cell_type == "markdown" for c in notebook.cells) >= 3
    saved = dict(os.environ)
    os.environ.update({k: v for k, v in ENV.items() if k not in saved or saved[k] != v})
    try:
        nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    text = "".join(out.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                   for out in cell.get("outputs", []))
    assert "every rank's extended block equals the global slice" in text, text[:2000]
    assert re.search(r"relative difference \d\.\de[-+]\d+", text), text[:2000]
