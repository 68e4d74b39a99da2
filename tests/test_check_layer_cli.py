"""``refimpl check-layer`` as a user runs it: under mpiexec, JSON out, .npz checked by PyTorch."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from launcher import run_launched

pytest.importorskip("mpi4py", reason="mpi4py is not installed: pip install 'refimpl[mpi]'")

ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")


def run_check(nranks, *args, timeout=180):
    cmd = [shutil.which("mpiexec"), "--oversubscribe", "-n", str(nranks), sys.executable, "-m",
           "refimpl", "check-layer", *args]
    return run_launched(cmd, env=ENV, timeout=timeout)


def test_conv3d_saved_arrays_match_torch(tmp_path):
    torch = pytest.importorskip("torch", reason="PyTorch absent: pip install 'refimpl[oracle]'")
    out = tmp_path / "conv.npz"
    proc = run_check(3, "conv3d", "--input", "2,3,7,5,6", "--out-channels", "4", "--kernel", "3,2,4",
                     "--stride", "2,1,1", "--padding", "1,0,2", "--dilation", "1,2,1",
                     "--grid", "1,3,1,1", "--save", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["grid"] == [1, 3, 1, 1]
    assert all(e <= 1e-10 for e in report["max_rel_err"].values())
    a = {k: torch.from_numpy(v) for k, v in np.load(out).items()}
    x = a["x"].clone().requires_grad_()
    w = a["w"].clone().requires_grad_()
    b = a["b"].clone().requires_grad_()
    y = torch.nn.functional.conv3d(x, w, b, (2, 1, 1), (1, 0, 2), (1, 2, 1))
    y.backward(a["dy"])
    for name, ref in (("y", y), ("dx", x.grad), ("dw", w.grad), ("db", b.grad)):
        err = (a[name] - ref.detach()).abs().max() / ref.detach().abs().max()
        assert err <= 1e-10, (name, float(err))


def test_bad_grid_fails_cleanly_on_every_rank():
    proc = run_check(3, "conv3d", "--input", "1,1,5,5,5", "--grid", "1,2,1,1", timeout=60)
    assert proc.returncode == 2
    assert "--grid 1,2,1,1 holds 2 ranks but mpiexec started 3" in proc.stderr


def test_one_process_is_told_to_run_under_mpiexec(capsys):
    """Without mpiexec (one process) the error says so, with the command to run."""
    from refimpl.cli import main
    assert main(["check-layer", "conv3d", "--input", "1,1,5,5,5", "--grid", "1,2,1,1"]) == 2
    err = capsys.readouterr().err
    assert "this process is 1 rank" in err and "mpiexec -n 2 --oversubscribe refimpl" in err


def test_help_explains():
    proc = subprocess.run([sys.executable, "-m", "refimpl", "check-layer", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--grid" in proc.stdout and "mpiexec" in proc.stdout


def test_a_rank_failing_alone_in_the_layer_ends_every_rank(tmp_path):
    """``check_layer`` (the Python API, as tests/mpi drives it): a partitioned layer that raises
    on one rank only, after the others have entered its messages, ends every rank with that
    rank's traceback and exit 70 -- never a hang.  (The halo exchange of a spatial conv split
    over 3 ranks: rank 1's local backward raises.)"""
    script = tmp_path / "fail_alone.py"
    script.write_text(
        "from mpi4py import MPI\n"
        "from refimpl.check import LayerCheck, check_layer\n"
        "from refimpl.nn import spatial\n"
        "original = spatial.SpatialConv3d.local_backward\n"
        "def local_backward(self, *args):\n"
        "    if MPI.COMM_WORLD.rank == 1:\n"
        "        raise RuntimeError('rank 1 alone')\n"
        "    return original(self, *args)\n"
        "spatial.SpatialConv3d.local_backward = local_backward\n"
        "check_layer(LayerCheck(layer='conv3d', input=(1, 2, 9, 4, 4), grid=(1, 3, 1, 1), kernel=3,\n"
        "                       padding=1, out_channels=2), MPI.COMM_WORLD)\n"
        "print('not reached')\n")
    cmd = [shutil.which("mpiexec"), "--oversubscribe", "-n", "3", sys.executable, str(script)]
    proc = run_launched(cmd, env=ENV, timeout=120)
    assert proc.returncode == 70, (proc.returncode, proc.stdout, proc.stderr[-3000:])
    assert "check_layer: rank 1 of 3 raised in the partitioned layer's backward" in proc.stderr
    assert "RuntimeError: rank 1 alone" in proc.stderr and "not reached" not in proc.stdout
