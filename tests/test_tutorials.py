"""Every tutorial runs top to bottom under mpiexec (its asserts are its checks)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mpi4py", reason="mpi4py is not installed: pip install 'refimpl[mpi]'")

ROOT = Path(__file__).resolve().parent.parent
TUTORIALS = sorted((ROOT / "tutorials").glob("[0-9]*.py"))
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MPLBACKEND="Agg")


def test_tutorials_exist():
    assert len(TUTORIALS) >= 3


@pytest.mark.parametrize("nranks", [1, 3, 4])
@pytest.mark.parametrize("tutorial", TUTORIALS, ids=lambda p: p.stem)
def test_tutorial_runs(tutorial, nranks, tmp_path):
    cmd = [shutil.which("mpiexec"), "--oversubscribe", "-n", str(nranks), sys.executable, str(tutorial)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{tutorial.name} with {nranks} ranks failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
