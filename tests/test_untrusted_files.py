"""Untrusted files are bounded: checkpoints, data files and the oracle's case and results files
are checked from their metadata before any array is read.

Each test crafts one file with h5py that declares more than it holds (HDF5 keeps a dataset's
shape apart from its data, so a 6 KB file can declare gigabytes), or metadata that is
damaged, and asserts a refusal: exit 2 (``InputError``) and one line naming the file and the
field, never an allocation, a MemoryError, a stall or a traceback.
"""
import json
import random
import resource
import shutil
import sys
import time
from pathlib import Path

import numpy
import pytest

from launcher import run_launched

h5py = pytest.importorskip("h5py")
pytest.importorskip("mpi4py", reason="mpi4py is not installed: pip install 'refimpl[mpi]'")

from refimpl import checkpoint  # noqa: E402
from refimpl.checkpoint import CheckpointError  # noqa: E402
from refimpl.errors import InputError, classify  # noqa: E402
from refimpl.oracle import load_case, parse_suite, write_case, write_results  # noqa: E402
from refimpl.oracle.casefile import UnusableInput  # noqa: E402
from test_faults import expect, mpi_env  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 120            # the test's own limit, far above every bound below
HUGE = 805_306_368         # float32 values: 3.2 GB declared


def refimpl(*args, n=None, address_space=None):
    """``refimpl ARGS`` as one process, or under ``mpiexec -n n``; ``address_space``: RLIMIT_AS
    in bytes for every process of the job (each rank inherits its own)."""
    cmd = [sys.executable, "-m", "refimpl", *map(str, args)]
    if n is not None:
        cmd = [shutil.which("mpiexec"), "--oversubscribe", "-n", str(n)] + cmd
    limit = None if address_space is None else \
        (lambda: resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space)))
    started = time.monotonic()
    proc = run_launched(cmd, cwd=ROOT, env=mpi_env(), timeout=TIMEOUT_S, preexec_fn=limit)
    proc.elapsed = time.monotonic() - started
    return proc


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A real run of 3 steps on one rank, whose checkpoint the tests spoil."""
    root = tmp_path_factory.mktemp("trained")
    proc = refimpl("datagen", "cosmoflow", "--out", root / "data", "--samples", 8, "--val-samples", 2,
                   "--size", 16, "--quiet")
    assert proc.returncode == 0, proc.stderr
    proc = refimpl("train", "--grid", "1,1,1,1", "--data", root / "data", "--global-batch", 2, "--steps", 3,
                   "--optimizer", "sgd", "--no-plot", "--out", root / "run", "--quiet")
    assert proc.returncode == 0, proc.stderr
    return root / "run"


def huge_checkpoint(path):
    """~6 KB on disk, every dataset declaring 3.2 GB (allocated lazily: nothing written)."""
    with h5py.File(path, "w") as f:
        f.attrs.update({"format": checkpoint.FORMAT, "version": checkpoint.VERSION,
                        "meta": json.dumps({"step": 3, "config": {}}), "sha256": "0" * 64})
        for name in ("model/features.0.weight", "model/features.0.bias", "optimizer/momentum_buffer.0"):
            f.create_dataset(name, shape=(HUGE,), dtype=numpy.float32)


# ---------------------------------------------------------------- checkpoints

def test_checkpoint_declaring_gigabytes_is_refused_before_any_read(tmp_path):
    path = tmp_path / "checkpoint.h5"
    huge_checkpoint(path)
    assert path.stat().st_size < 16_000
    started = time.monotonic()
    with pytest.raises(CheckpointError) as info:
        checkpoint.read_file(path)
    assert time.monotonic() - started < 1.0
    message = str(info.value)
    assert f"checkpoint {path} is damaged: dataset 'model/features.0.bias' declares 3.2 GB " \
           f"({HUGE} float32" in message and "stores 0 B" in message, message
    assert "\n" not in message and classify(info.value) is InputError


def test_resume_from_a_checkpoint_declaring_gigabytes_under_2gb_per_rank(tmp_path):
    """Two ranks, 2 GB of address space each: exit 2 in seconds, no rank allocates."""
    out = tmp_path / "run"
    out.mkdir()
    huge_checkpoint(out / "checkpoint.h5")
    proc = refimpl("train", "--out", out, "--resume", "--quiet", n=2, address_space=2 * 1000 ** 3)
    expect(proc, 2, "refimpl train: error:", f"checkpoint {out / 'checkpoint.h5'} is damaged",
           "declares 3.2 GB")
    assert proc.elapsed < 10, proc.elapsed


def test_negative_step_is_damaged(trained, tmp_path):
    """The checksum is right (written by write_file), the step is not: refused on read with exit 2
    (before: a ZeroDivisionError, exit 70, once training had started)."""
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    arrays, meta = checkpoint.read_file(out / "checkpoint.h5")
    checkpoint.write_file(out / "checkpoint.h5", arrays, dict(meta, step=-1))
    proc = refimpl("train", "--out", out, "--resume", "--steps", 6, "--quiet")
    expect(proc, 2, f"checkpoint {out / 'checkpoint.h5'} is damaged", "meta field 'step' is -1")
    bad = tmp_path / "bad.h5"
    for field, value in (("loader", dict(meta["loader"], step=-3)), ("optimizer", dict(meta["optimizer"], lr=None)),
                         ("dropout", {"head.2": {"seed": -1, "step": 0}}), ("step", 2 ** 80), ("step", True),
                         ("input_norm", [[1.0], [1.0, 2.0]])):
        checkpoint.write_file(bad, arrays, dict(meta, **{field: value}))
        with pytest.raises(CheckpointError, match=rf"bad\.h5 is damaged: meta field '{field}[.']"):
            checkpoint.read_file(bad)


def test_every_byte_flip_in_the_metadata_is_damaged(trained, tmp_path):
    """40 positions of the stored meta JSON (fixed seed), each XOR-ed with a random byte: every
    one is refused as damaged with one line naming the file; invalid UTF-8 included.  The
    file's trailing sha256 would refuse them all before HDF5 reads a byte, so the trailer is cut
    off here (a file written before it existed): the inner checks of the meta must hold alone."""
    path, flipped = trained / "checkpoint.h5", tmp_path / "flipped.h5"
    raw = path.read_bytes()
    assert raw[-checkpoint.TRAILER_LEN:].startswith(checkpoint.TRAILER_MAGIC)
    raw = raw[:-checkpoint.TRAILER_LEN]
    with h5py.File(path, "r") as f:
        text = f.attrs["meta"].encode()
    start = raw.find(text)
    assert start > 0
    rng = random.Random(30)
    utf8 = 0
    for position in rng.sample(range(start, start + len(text)), 40):
        spoiled = bytearray(raw)
        spoiled[position] ^= rng.randrange(1, 256)
        flipped.write_bytes(bytes(spoiled))
        with pytest.raises(CheckpointError) as info:       # never another exception type
            checkpoint.read_file(flipped)
        message = str(info.value)
        assert f"checkpoint {flipped} is damaged" in message and "\n" not in message, (position, message)
        assert classify(info.value) is InputError
        utf8 += "not UTF-8" in message
    assert utf8 >= 5           # about half the XORs set the high bit: the UnicodeEncodeError of before


def test_restore_checks_the_meta_against_the_model(trained):
    """What only the model can judge: the input normalisation's channels, the generators' states."""
    from mpi4py import MPI

    from refimpl.models import build_model
    from refimpl.optim import make_optimizer
    from refimpl.parallel.grid import ProcessGrid
    if MPI.COMM_WORLD.Get_size() != 1:
        pytest.skip("single-process test")
    grid = ProcessGrid(MPI.COMM_WORLD, (1, 1, 1, 1))
    model = build_model("cosmoflow", "tiny", grid, seed=0, dtype=numpy.float32, global_batch=2)
    optimizer = make_optimizer("sgd", model.parameters(), lr=0.01, momentum=0.9)
    arrays, meta = checkpoint.read_file(trained / "checkpoint.h5")
    checkpoint.restore(arrays, meta, model, optimizer, grid)
    model.head.rng = numpy.random.default_rng(0)
    for spoiled, message in (({"input_norm": [[0.0], [1.0]]}, "input normalisation has 1 channels, the model takes 4"),
                             ({"generators": {"head:gen": {}}}, "generator state for 'head:gen', not in this model"),
                             ({"generators": {"head:rng": {"bit_generator": "PCG64", "state": 5}}},
                              "damaged: generator state 'head:rng' is not one numpy accepts")):
        with pytest.raises(CheckpointError, match=message):
            checkpoint.restore(arrays, dict(meta, **spoiled), model, optimizer, grid)


# ---------------------------------------------------------------- data files

def test_data_file_declaring_ten_million_samples(tmp_path):
    """6 KB declaring 10^7 samples: refused on open (before: trained on zeros until the stall timeout)."""
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "val"):
        with h5py.File(data / f"{split}.h5", "w") as f:
            f.create_dataset("full", shape=(10 ** 7, 4, 16, 16, 16), dtype=numpy.float32, chunks=(1, 4, 16, 16, 16))
            f.create_dataset("unitPar", shape=(10 ** 7, 4), dtype=numpy.float32, chunks=(1, 4))
    assert (data / "train.h5").stat().st_size < 16_000
    proc = refimpl("train", "--grid", "1,2,1,1", "--data", data, "--global-batch", 2, "--steps", 3, "--no-plot",
                   "--out", tmp_path / "run", "--stall-timeout", 30, "--quiet", n=2)
    expect(proc, 2, f"{data / 'train.h5'} is damaged: dataset 'full' declares",
           "shape (10000000, 4, 16, 16, 16)", "stores 0 B")
    assert proc.elapsed < 10, proc.elapsed


# ---------------------------------------------------------------- oracle case and results files

@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """One small case file and a correct results file for it (the case's own expectations)."""
    spec, = parse_suite({"case": [{"name": "small", "layer": "conv3d", "input": [1, 2, 5, 4, 4],
                                   "out_channels": 3, "grids": [[1, 2, 1, 1]]}]}, "test suite")
    directory = tmp_path_factory.mktemp("case")
    path = write_case(spec, str(directory))
    loaded = load_case(path)
    results = directory / "results.h5"
    write_results(str(results), loaded, loaded.expected)
    return Path(path), results


def spoil(source, target, name, shape=None):
    """A copy of ``source`` in which dataset ``name`` declares ``shape`` (default: its own) and
    stores nothing."""
    shutil.copy(source, target)
    with h5py.File(target, "a") as h5:
        dtype, shape = h5[name].dtype, shape or h5[name].shape
        del h5[name]
        h5.create_dataset(name, shape=shape, dtype=dtype)
    return target


def test_results_file_declaring_a_huge_shape(case, tmp_path):
    case_path, results = case
    huge = spoil(results, tmp_path / "huge.h5", "float64/global/y", (1000, 1000, 1000, 100))
    # a wrong shape is a finding about the output-size rule (exit 1), never a read: 2 GiB of
    # address space for a file that declares 800 GB
    proc = refimpl("oracle", "check", case_path, huge, address_space=2 * 2**30)
    assert proc.returncode == 1 and not proc.stderr.strip(), proc.stdout + proc.stderr
    assert "the global y has 4 dimensions [1000, 1000, 1000, 100]; it needs 5" in proc.stdout, proc.stdout
    unstored = spoil(results, tmp_path / "unstored.h5", "float64/global/y")
    proc = refimpl("oracle", "check", case_path, unstored)
    expect(proc, 2, f"results file {unstored} is damaged: dataset 'float64/global/y' declares", "stores 0 B")


def test_case_file_declaring_a_huge_shape(case, tmp_path):
    case_path, results = case
    huge = spoil(case_path, tmp_path / case_path.name, "float32/inputs/x", (1000, 1000, 1000, 100))
    for args in (("check", huge, results), ("run-torch", huge, "--out", tmp_path / "torch")):
        proc = refimpl("oracle", *args)
        expect(proc, 2, f"case file {huge}: /float32/inputs/x: shape (1000, 1000, 1000, 100), expected (1, 2, 5, 4, 4)")
    unstored = spoil(case_path, tmp_path / "unstored.h5", "float32/rank/1/dx_needed")
    with pytest.raises(UnusableInput, match=r"unstored\.h5 is damaged: dataset 'float32/rank/1/dx_needed' declares"):
        load_case(str(unstored))
