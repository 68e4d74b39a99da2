"""Checkpoints: round trip, atomic replacement (a crash mid-write keeps the old file), damage refused."""
import json
import os

import numpy
import pytest

from refimpl import checkpoint
from refimpl.checkpoint import CheckpointError, read_file, write_file

h5py = pytest.importorskip("h5py")


def sample_arrays(seed=0):
    rng = numpy.random.default_rng(seed)
    return {"model/0.weight": rng.standard_normal((3, 2, 3, 3, 3)).astype(numpy.float32),
            "model/0.bias": rng.standard_normal(3),
            "buffers/0/1.running_var": rng.random(3).astype(numpy.float32),
            "optimizer/momentum_buffer.0": rng.standard_normal((3, 2, 3, 3, 3)).astype(numpy.float32)}


META = {"step": 7, "epoch": 1, "loader": {"epoch": 1, "step": 3}, "config": {"lr": 0.1, "grid": "1,1,1,1"}}


def test_round_trip_is_bit_exact(tmp_path):
    path = tmp_path / "ck.h5"
    arrays = sample_arrays()
    write_file(path, arrays, META)
    back, meta = read_file(path)
    assert meta == json.loads(json.dumps(META))
    assert sorted(back) == sorted(arrays)
    for name, a in arrays.items():
        assert back[name].dtype == a.dtype and numpy.array_equal(back[name], a)
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_crash_mid_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ck.h5"
    write_file(path, sample_arrays(0), META)
    before = path.read_bytes()
    calls = []
    real = h5py.Group.create_dataset

    def dying(self, name, *args, **kwargs):   # the process "dies" after the second dataset
        calls.append(name)
        if len(calls) == 3:
            raise KeyboardInterrupt("simulated crash mid-write")
        return real(self, name, *args, **kwargs)

    monkeypatch.setattr(h5py.Group, "create_dataset", dying)
    with pytest.raises(KeyboardInterrupt):
        write_file(path, sample_arrays(1), dict(META, step=8))
    monkeypatch.undo()
    assert len(calls) == 3
    assert path.read_bytes() == before
    assert read_file(path)[1]["step"] == 7
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_stale_temporary_from_a_killed_writer_is_ignored_and_cleaned(tmp_path):
    path = tmp_path / "ck.h5"
    write_file(path, sample_arrays(0), META)
    stale = tmp_path / "ck.h5.tmp-99999"
    stale.write_bytes(b"half a checkpoint")      # a SIGKILL during a write leaves this
    assert read_file(path)[1]["step"] == 7
    write_file(path, sample_arrays(1), dict(META, step=9))
    assert not stale.exists() and read_file(path)[1]["step"] == 9


def test_damaged_data_is_refused(tmp_path):
    path = tmp_path / "ck.h5"
    arrays = sample_arrays()
    write_file(path, arrays, META)
    raw = bytearray(path.read_bytes())
    needle = arrays["model/0.weight"].tobytes()[:16]
    at = raw.find(needle)
    assert at > 0
    raw[at + 5] ^= 0x40                               # one flipped bit inside a weight
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="damaged.*checksum"):
        read_file(path)


def test_truncated_and_foreign_files_are_refused(tmp_path):
    path = tmp_path / "ck.h5"
    write_file(path, sample_arrays(), META)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="damaged"):
        read_file(path)
    path.write_bytes(b"not hdf5 at all")
    with pytest.raises(CheckpointError, match="damaged"):
        read_file(path)
    with h5py.File(path, "w") as f:
        f.attrs["format"] = "something-else"
    with pytest.raises(CheckpointError, match="not a refimpl checkpoint"):
        read_file(path)
    with pytest.raises(CheckpointError, match="does not exist"):
        read_file(tmp_path / "missing.h5")


def test_model_optimizer_dropout_state_round_trip(tmp_path):
    """save() on a 1-rank grid, restore() into a fresh model: every array and counter equal."""
    MPI = pytest.importorskip("mpi4py.MPI")
    if MPI.COMM_WORLD.Get_size() != 1:
        pytest.skip("single-process test")
    from refimpl.models import build_model
    from refimpl.optim import make_optimizer
    from refimpl.parallel.grid import ProcessGrid

    grid = ProcessGrid(MPI.COMM_WORLD, (1, 1, 1, 1))
    model = build_model("cosmoflow", "tiny", grid, seed=3, dtype=numpy.float32, global_batch=2)
    opt = make_optimizer("sgd", model.parameters(), lr=0.05, momentum=0.9)
    rng = numpy.random.default_rng(0)
    x = rng.random((2,) + tuple(model.input_shape)).astype(numpy.float32)
    y = rng.uniform(-1, 1, (2, 4)).astype(numpy.float32)
    for _ in range(2):
        model.zero_grad()
        _, dout, _ = model.loss(model.forward(x), y)
        model.backward(dout)
        opt.step()
    counters = checkpoint.dropout_state(model)
    assert counters and all(v["step"] == 2 for v in counters.values())
    path = tmp_path / "ck.h5"
    checkpoint.save(path, model, opt, grid, {"step": 2, "config": {}})

    fresh = build_model("cosmoflow", "tiny", grid, seed=4, dtype=numpy.float32, global_batch=2)
    fresh_opt = make_optimizer("sgd", fresh.parameters(), lr=1.0, momentum=0.9)
    arrays, meta = read_file(path)
    checkpoint.restore(arrays, meta, fresh, fresh_opt, grid)
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert numpy.array_equal(a, b), name
    assert checkpoint.dropout_state(fresh) == counters
    assert fresh_opt.step_count == 2 and fresh_opt.lr == 0.05
    for key, a in opt.state_dict()["arrays"].items():
        assert numpy.array_equal(a, fresh_opt.state_dict()["arrays"][key])
    # the next step is identical bit for bit
    for m, o in ((model, opt), (fresh, fresh_opt)):
        m.zero_grad()
        _, dout, _ = m.loss(m.forward(x), y)
        m.backward(dout)
        o.step()
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert numpy.array_equal(a, b), name

    other = build_model("unet3d", "tiny", grid, seed=0, dtype=numpy.float32, global_batch=2)
    with pytest.raises(CheckpointError, match="does not fit"):
        checkpoint.restore(arrays, meta, other, make_optimizer("sgd", other.parameters(), lr=0.1), grid)


def test_every_single_bit_flip_is_refused_or_harmless(tmp_path):
    """A bit flipped anywhere in the file, the HDF5 structure included (superblock, object
    headers, B-trees, heaps): reading it raises CheckpointError (one clean message, never
    another exception, a crash or a hang: a flip at byte 961 of this file once made HDF5's
    attribute read loop forever) or, in the trailer's magic, gives back exactly what was
    written.  Every byte of the file, one seeded random bit each."""
    path, bad = tmp_path / "ck.h5", tmp_path / "bad.h5"
    arrays = sample_arrays()
    write_file(path, arrays, META)
    data = path.read_bytes()
    rng = numpy.random.default_rng(11)
    outcomes = {"refused": 0, "harmless": 0}
    for at in range(len(data)):
        raw = bytearray(data)
        raw[at] ^= 1 << int(rng.integers(8))
        bad.write_bytes(bytes(raw))
        try:
            back, meta = read_file(bad)
        except CheckpointError:
            outcomes["refused"] += 1
            continue
        assert meta == json.loads(json.dumps(META)) and sorted(back) == sorted(arrays), at
        for name, a in arrays.items():
            assert back[name].dtype == a.dtype and numpy.array_equal(back[name], a), (at, name)
        outcomes["harmless"] += 1
    assert outcomes["harmless"] <= len(checkpoint.TRAILER_MAGIC) + 1, outcomes     # the trailer's magic only


def test_a_checkpoint_without_the_trailer_is_read_by_the_inner_checks(tmp_path):
    """Files written before the trailer existed (or whose trailer is damaged) still resume: the
    inner sha256 of the contents decides, and a flipped weight is still refused."""
    path = tmp_path / "ck.h5"
    arrays = sample_arrays()
    write_file(path, arrays, META)
    raw = path.read_bytes()
    assert raw[-checkpoint.TRAILER_LEN:].startswith(checkpoint.TRAILER_MAGIC)
    path.write_bytes(raw[:-checkpoint.TRAILER_LEN])
    back, meta = read_file(path)
    assert meta["step"] == META["step"] and numpy.array_equal(back["model/0.weight"], arrays["model/0.weight"])
    old = bytearray(raw[:-checkpoint.TRAILER_LEN])
    at = old.find(arrays["model/0.weight"].tobytes()[:16])
    old[at + 3] ^= 0x08
    path.write_bytes(bytes(old))
    with pytest.raises(CheckpointError, match="damaged.*checksum does not match the contents"):
        read_file(path)
