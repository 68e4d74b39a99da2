"""Full disks while writing data, and one writer per output directory (real processes).

A write past a file-size limit (``RLIMIT_FSIZE``: Python ignores SIGXFSZ, so the
write fails with EFBIG, as on a full disk) must end ``refimpl datagen``, the data
generation of ``refimpl train`` (no --data) and ``refimpl oracle generate`` at
once, with status 4 and one line naming the file: no traceback, no HDF5 error
stack, no crash, no temporary or partial file left, no lock left.  And a second
``datagen`` into a directory that a running one writes exits 2 naming the first,
which finishes unharmed.
"""
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_faults import expect, launch, mpi_env

pytest.importorskip("h5py")

from refimpl.data import cosmo  # noqa: E402
from refimpl.data.reader import HDF5Reader  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 120


def refimpl(*args, fsize=None):
    """``python -m refimpl ARGS`` in one process, with a file-size limit of ``fsize`` bytes."""
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    return subprocess.run([sys.executable, "-m", "refimpl", *map(str, args)], cwd=ROOT, env=mpi_env(),
                          capture_output=True, text=True, timeout=TIMEOUT_S,
                          preexec_fn=limit if fsize else None)


def expect_clean_failure(proc, out, *fragments):
    """Status 4, one refimpl line with ``fragments``, nothing else gone wrong, nothing left behind."""
    expect(proc, 4, "I/O error", *fragments)
    for noise in ("Segmentation", "HDF5", "Exception ignored", "internal error"):
        assert noise not in proc.stderr, proc.stderr
    left = [p for p in Path(out).rglob("*") if ".tmp" in p.name or p.name == ".lock"]
    assert left == [], left


@pytest.mark.parametrize("layout, samples, size, fsize, failed", [
    ("single", 48, 32, 2_000_000, "train.h5"),                 # ~4 samples fit: fails mid-split
    ("per-sample", 4, 16, 20_000, os.path.join("train", "000000.hdf5")),   # not even one sample file
])
def test_datagen_on_a_full_disk(tmp_path, layout, samples, size, fsize, failed):
    out = tmp_path / "data"
    proc = refimpl("datagen", "cosmoflow", "--out", out, "--samples", samples, "--val-samples", 8,
                   "--size", size, "--layout", layout, fsize=fsize)
    expect_clean_failure(proc, out, str(out / failed), "File too large")
    total = samples + 8
    assert f"{total}/{total}" not in proc.stderr, "went on generating after the failed write"
    assert sorted(os.listdir(out)) == []                      # no partial split under any name


def test_train_generation_on_a_full_disk(tmp_path):
    """Rank 0 generates OUT/data (no --data) under a limit below train.h5's size."""
    out = tmp_path / "run"
    proc = launch(2, ["--preset", "tiny", "--grid", "1,2,1,1", "--gen-samples", 8, "--gen-val-samples", 4,
                      "--global-batch", 2, "--steps", 2, "--out", out],
                  mpi_env(FAULT_RANK=0, FAULT_FSIZE=100_000))
    expect_clean_failure(proc, out, str(out / "data" / "train.h5"), "File too large")
    assert not (out / "data" / "train.h5").exists()


@pytest.mark.parametrize("fsize", [20_000, 30_000, 50_000, 100_000, 200_000])
def test_oracle_generate_on_a_full_disk(tmp_path, fsize):
    """Exit 4 at every limit: HDF5's failed flush inside h5py's close is raised as the write's
    OSError (atomic.hdf5_file), never an internal error (it was at 20-200 KB)."""
    out = tmp_path / "cases"
    proc = refimpl("oracle", "generate", "hard", "--out", out, fsize=fsize)
    expect_clean_failure(proc, out, str(out), ".h5", "File too large")


def test_oracle_trace_generate_on_a_full_disk(tmp_path):
    out = tmp_path / "traces"
    out.mkdir()
    proc = refimpl("oracle", "trace", "generate", "--model", "cosmoflow", "--input", "2,4,8,8,8", "--grid", "1,2,1,1",
                   "--out", out / "t.h5", fsize=100_000)
    expect_clean_failure(proc, out, "t.h5", "File too large")


def test_second_datagen_into_the_same_out_is_refused(tmp_path):
    out = tmp_path / "data"
    args = ("datagen", "cosmoflow", "--out", out, "--samples", 192, "--val-samples", 8, "--size", 32, "--quiet")
    first = subprocess.Popen([sys.executable, "-m", "refimpl", *map(str, args)], cwd=ROOT, env=mpi_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not (out / ".lock").exists():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.02)
        started = time.monotonic()
        second = refimpl(*args)
        assert time.monotonic() - started < 10
        assert first.poll() is None, "the first datagen ended before the second was refused: make it larger"
        expect(second, 2, "is in use by another job", f"PID {first.pid} ")
        stdout, stderr = first.communicate(timeout=TIMEOUT_S)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, stderr
    assert sorted(os.listdir(out)) == ["train.h5", "val.h5"]  # the lock is gone
    with HDF5Reader(str(out / "train.h5")) as train, HDF5Reader(str(out / "val.h5")) as val:
        assert (train.num_samples, val.num_samples) == (192, 8)
        assert (train.read(191)[0] == cosmo.generate_universe(191, 0, 32)[0]).all()
