"""Run the distributed tests (tests/mpi/) under real ``mpiexec`` with 1, 2, 3, 4, 6, 8 ranks.

Each rank count is one pytest case that launches
``mpiexec -n N python -m pytest tests/mpi`` in a subprocess with a timeout, so
a deadlock shows up as a failure with the ranks' output instead of a hung CI.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import run_launched
from refimpl.settings import env_setting

pytest.importorskip("mpi4py", reason="mpi4py is not installed: pip install 'refimpl[mpi]'")

ROOT = Path(__file__).resolve().parent.parent
MPI_TESTS = ROOT / "tests" / "mpi"
TIMEOUT_S = env_setting("REFIMPL_MPI_TIMEOUT")


def mpiexec_command(n: int) -> list[str]:
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        pytest.fail("mpiexec not found: pip install 'refimpl[mpi]' installs Open MPI's mpiexec")
    return [mpiexec, "--oversubscribe", "-n", str(n)]


def mpi_env() -> dict:
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONHASHSEED="0")
    return env


@pytest.mark.parametrize("nranks", [1, 2, 3, 4, 6, 8])
def test_mpi_suite(nranks):
    files = sorted(str(p) for p in MPI_TESTS.glob("test_*.py"))
    assert files, "no MPI test files found"
    cmd = mpiexec_command(nranks) + [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                     "--no-header", "-rN", *files]
    try:
        proc = run_launched(cmd, cwd=ROOT, env=mpi_env(), timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"")[-8000:] if isinstance(err.stdout, bytes) else (err.stdout or "")[-8000:]
        pytest.fail(f"mpiexec -n {nranks} timed out after {TIMEOUT_S}s (deadlock?)\n{out}")
    if proc.returncode != 0:
        pytest.fail(f"mpiexec -n {nranks} failed (rc={proc.returncode})\n"
                    f"--- stdout ---\n{proc.stdout[-12000:]}\n--- stderr ---\n{proc.stderr[-4000:]}")


def test_a_launcher_failure_is_run_once_more(tmp_path):
    """``launcher.run_launched`` starts a command again only when Open MPI's launcher printed
    its failure-before-any-rank message, and only once; any other failure comes back as is."""
    from launcher import LAUNCHER_FLAKE
    script = ("import pathlib, sys; p = pathlib.Path(sys.argv[1]); n = int(p.read_text()) if p.exists() else 0; "
              "p.write_text(str(n + 1)); fail = n < int(sys.argv[3]); "
              "print(sys.argv[2] if fail else 'ran', file=sys.stderr); sys.exit(1 if fail else 0)")
    for failures, message, runs, rc in ((1, LAUNCHER_FLAKE, 2, 0), (5, LAUNCHER_FLAKE, 2, 1),
                                        (1, "a rank raised", 1, 1), (0, "", 1, 0)):
        count = tmp_path / f"runs-{failures}-{len(message)}"
        proc = run_launched([sys.executable, "-c", script, str(count), message, str(failures)], timeout=60)
        assert int(count.read_text()) == runs and proc.returncode == rc, (failures, message, proc.stderr)


def test_the_mpi_hypothesis_profile_does_not_shrink():
    """A failing distributed property test reports its example as drawn: shrinking replays it
    hundreds of times under mpiexec (over 10 minutes on 2 cores)."""
    from hypothesis import Phase, settings
    profile = settings.get_profile("mpi")
    assert Phase.shrink not in profile.phases and Phase.generate in profile.phases
    assert profile.derandomize and profile.database is None
