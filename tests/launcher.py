"""Run a command that starts ``mpiexec`` (directly, or through a script that launches it) from a
test, surviving one known flake of Open MPI's launcher.

Open MPI's ``mpiexec`` sometimes fails before any rank starts, printing "The PMIx server's
listener thread failed to start" (seen a few times per hundred launches on the 2-core CI
machine; the same command then runs fine).  That is the launcher's failure, not refimpl's,
so such a run is started once more; any other failure, and a second launcher failure, is
returned to the test as it came.
"""
import subprocess

#: The launcher's message when it failed before any rank started.
LAUNCHER_FLAKE = "PMIx server's listener thread failed to start"


def run_launched(cmd, **kwargs):
    """``subprocess.run(cmd, capture_output=True, text=True, **kwargs)``, run once more when
    the output holds ``LAUNCHER_FLAKE`` (``TimeoutExpired`` propagates as from ``run``)."""
    for _ in range(2):
        proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
        if LAUNCHER_FLAKE not in (proc.stdout or "") + (proc.stderr or ""):
            break
    return proc
