"""Run one tutorial cell by cell in every rank, recording each cell's output per rank.

The documentation build (scripts/mkdocs_hooks.py) starts this under the launch its header
names, e.g.::

    mpiexec -n 4 --oversubscribe python scripts/tutorial_runner.py CELLS.json OUT tutorials/06_unet_partitioned.py

``CELLS.json`` is the list of the tutorial's code cells (their sources, in order, as Jupytext
splits the file on its ``# %%`` markers). Every rank runs them in one namespace, as
``python tutorials/NN_x.py`` would run the file top to bottom (``__name__ == "__main__"``,
``__file__`` and ``sys.argv[0]`` the tutorial, ``sys.path[0]`` its folder, the cwd the scratch
directory the build started it in), with its file descriptors 1 and 2 sent, cell by cell, to
``OUT/rank{r}/cell{i}.out`` and ``.err`` (what C code and child processes write is caught too).
Rank 0 also copies every PNG that appeared or changed in the cwd during cell ``i`` to
``OUT/figures/cell{i}-NAME.png``.

A rank whose cell raises writes the traceback to that cell's ``.err`` and to the launcher's
stderr, records the cell in ``OUT/rank{r}/failed``, and ends the job (``MPI_Abort`` once MPI
is up, so that no rank waits forever for it). ``OUT/rank{r}/done`` marks a rank that ran
every cell.
"""
from __future__ import annotations

import json
import linecache
import os
import shutil
import sys
import traceback
from pathlib import Path

RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "MPI_LOCALRANKID")


def launcher_rank() -> int:
    """This process's rank, from the launcher's environment (0 when started without one);
    read before the tutorial starts MPI, so running this script changes nothing in MPI's start."""
    for name in RANK_VARIABLES:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


class FdCapture:
    """Sends file descriptors 1 and 2 to one pair of files after another."""

    def __init__(self):
        sys.stdout.flush()
        sys.stderr.flush()
        self.saved = os.dup(1), os.dup(2)

    def to(self, out: Path, err: Path) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, path in ((1, out), (2, err)):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)

    def restore(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved in zip((1, 2), self.saved):
            os.dup2(saved, fd)


def _stamps(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in folder.glob("*.png")}


def _abort(code: int) -> None:
    """End every rank: MPI_Abort if the tutorial started MPI, else this process."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.COMM_WORLD.Abort(code)
    os._exit(code)


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    cells = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    out, script = Path(argv[1]).resolve(), Path(argv[2]).resolve()
    rank = launcher_rank()
    mine = out / f"rank{rank}"
    mine.mkdir(parents=True, exist_ok=True)
    figures = out / "figures"
    if rank == 0:
        figures.mkdir(exist_ok=True)
    cwd = Path.cwd()
    seen = _stamps(cwd)

    # as `python tutorials/NN_x.py` would start it
    sys.argv = [str(script)]
    sys.path[0] = str(script.parent)
    namespace = {"__name__": "__main__", "__file__": str(script), "__builtins__": __builtins__}
    capture = FdCapture()
    for index, source in enumerate(cells):
        capture.to(mine / f"cell{index}.out", mine / f"cell{index}.err")
        filename = f"<{script.name}, cell {index}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        try:
            exec(compile(source, filename, "exec"), namespace)
        except BaseException as err:                  # SystemExit too: the page must not end early
            text = "".join(traceback.format_exception(type(err), err, err.__traceback__.tb_next))
            sys.stderr.write(text)
            capture.restore()
            sys.stderr.write(f"[rank {rank}] {script.name}: cell {index} raised:\n{text}")
            (mine / "failed").write_text(f"{index}\n", encoding="utf-8")
            _abort(1)
        sys.stdout.flush()
        sys.stderr.flush()
        if rank == 0:
            now = _stamps(cwd)
            for name, stamp in sorted(now.items()):
                if seen.get(name) != stamp:
                    shutil.copyfile(cwd / name, figures / f"cell{index}-{name}")
            seen = now
    capture.restore()
    (mine / "done").write_text("ok\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
