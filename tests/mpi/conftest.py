"""Setup for tests that run under ``mpiexec -n N python -m pytest tests/mpi``.

tests/test_mpiexec.py launches these files with 1, 2, 3, 4, 6 and 8 ranks; they
also run in a plain ``pytest`` as a 1-rank world.  Rules for writing them:

- every rank must take the same code path and call the same collectives in the
  same order: decide pass/fail with the ``all_ranks_agree`` fixture (a
  collective: ``all_ranks_agree(ok, "message")``), never with a bare ``assert``
  placed *before* a collective call;
- Hypothesis examples are drawn with the derandomized "mpi" profile, so every
  rank draws the same example.
"""
import pytest
from hypothesis import settings

settings.load_profile("mpi")

MPI = pytest.importorskip("mpi4py.MPI", reason="mpi4py is not installed: pip install 'refimpl[mpi]'")


@pytest.fixture
def comm():
    return MPI.COMM_WORLD


@pytest.fixture
def all_ranks_agree(comm):
    """Collective assert: ``all_ranks_agree(ok, msg)`` fails on every rank if it fails on any."""
    def check(ok: bool, message: str = "") -> None:
        flags = comm.allgather(bool(ok))
        if not all(flags):
            bad = [r for r, f in enumerate(flags) if not f]
            raise AssertionError(f"failed on ranks {bad}: {message}")
    return check


@pytest.fixture(scope="module")
def grids():
    """A ProcessGrid for every (Pn, Pd, Ph, Pw) whose product is the world size."""
    from refimpl.parallel.grid import ProcessGrid, all_grids
    made = [ProcessGrid(MPI.COMM_WORLD, dims) for dims in all_grids(MPI.COMM_WORLD.Get_size())]
    yield made
    for grid in made:
        grid.free()
