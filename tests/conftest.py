"""Shared pytest setup.

Hypothesis profiles:
- "default": bounded example counts so the whole suite fits CI on 2 cores.
- "mpi": the same, derandomized and without database or time-based health
  checks, so that every MPI rank draws the *same* sequence of examples (a
  rank that drew a different shape would deadlock its peers); and without the
  shrink phase: shrinking a failing example replays it hundreds of times under
  mpiexec (over 10 minutes on 2 cores), so the failure is reported as drawn.
The MPI test files (tests/mpi/) load the "mpi" profile themselves.
"""
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, Phase, settings

from refimpl.settings import env_setting

settings.register_profile(
    "default", max_examples=env_setting("REFIMPL_EXAMPLES"),
    deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "mpi", max_examples=env_setting("REFIMPL_MPI_EXAMPLES"),
    deadline=None, derandomize=True, database=None,
    suppress_health_check=list(HealthCheck), print_blob=False,
    phases=[Phase.explicit, Phase.reuse, Phase.generate])
settings.load_profile("default")


@pytest.fixture(scope="session")
def hard(tmp_path_factory):
    """The shipped hard suite (``refimpl oracle generate hard``), generated once for the whole
    session and only read by the tests that take it."""
    out = tmp_path_factory.mktemp("hard")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_WORLD", "PMI_"))}
    proc = subprocess.run([sys.executable, "-m", "refimpl", "oracle", "generate", "hard", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return out
