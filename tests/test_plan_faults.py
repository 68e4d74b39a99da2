"""Fail-stop of ``refimpl plan --calibrate`` under real mpiexec, and sizes refused before a run.

``plan --calibrate`` is the one ``plan`` that runs on several ranks (ranks 0 and 1 time the
link): like ``train`` it runs under the watchdog, so a rank that stops answering while the
machine is measured ends the job (exit 5) with one line naming it, and bad input is one line
from rank 0 with every rank exiting 2.  The helpers are tests/test_faults.py's.

The gradient bucket sizes of ``train`` are checked in refimpl/config.py: ``bucket_mb`` must
be a finite number > 0, ``chunk_mb`` a finite number >= 0 (0: whole buckets).
"""
import math
import os
import subprocess
import sys

import pytest

from refimpl.config import merge
from test_faults import ROOT, alive, expect, launch, mpi_env

EXIT_BOUND_S = 15           # the stall timeout elapsed -> every rank gone


@pytest.mark.parametrize("rank", [0, 1])
def test_rank_stopped_during_calibration_is_named_and_the_job_ends(tmp_path, rank):
    """The stopped rank freezes before timing its second conv shape; the other one measures on
    and waits for it in the ping-pong, until its watchdog ends the job."""
    log = tmp_path / "log"
    log.mkdir()
    timeout = 3
    proc = launch(2, ["--calibrate", "--preset", "tiny", "--stall-timeout", timeout],
                  mpi_env(FAULT="stop-calibrating:2", FAULT_RANK=rank, FAULT_LOG=log), command="plan")
    expect(proc, 5, "refimpl plan: stalled", f"rank {rank} stopped answering", "calibration",
           f"--stall-timeout {timeout}")
    assert proc.ended - float((log / "fault").read_text()) < timeout + EXIT_BOUND_S
    pids = {p.name: int(p.read_text()) for p in log.glob("pid-*")}
    assert len(pids) == 2
    for name, pid in pids.items():
        assert not alive(pid), f"rank process {pid} ({name}) survived the job:\n{proc.stderr}"


@pytest.mark.parametrize("args, fragment", [
    (["--calibrate", "--stall-timeout", -1], "--stall-timeout must be a number of seconds >= 0"),
    (["--batch", 4, "--ranks", 4], "runs in one process"),          # under mpiexec, only to calibrate
])
def test_bad_input_under_mpiexec_is_one_line_from_rank_0(args, fragment):
    expect(launch(2, args, command="plan"), 2, "refimpl plan: error:", fragment)


@pytest.mark.parametrize("key, bad", [("bucket_mb", 0), ("bucket_mb", 0.0), ("bucket_mb", -1),
                                      ("bucket_mb", math.inf), ("bucket_mb", math.nan), ("bucket_mb", True),
                                      ("chunk_mb", -0.5), ("chunk_mb", math.inf), ("chunk_mb", math.nan)])
def test_bucket_sizes_refused(key, bad):
    with pytest.raises(ValueError, match=f"^{key} must be a number (>|>=) 0") as err:
        merge({key: bad})
    assert "\n" not in str(err.value)


def test_bucket_sizes_accepted():
    assert merge({"bucket_mb": 0.05, "chunk_mb": 0})["chunk_mb"] == 0          # 0: whole buckets
    assert merge({})["chunk_mb"] is None and merge({})["bucket_mb"] == 25.0


def test_train_refuses_bucket_mb_0(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_WORLD", "PMI_", "REFIMPL_"))}
    proc = subprocess.run([sys.executable, "-m", "refimpl", "train", "--bucket-mb", "0", "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    expect(proc, 2, "refimpl train: error:", "bucket_mb must be a number > 0, got 0.0")
    assert not (tmp_path / "o").exists()
