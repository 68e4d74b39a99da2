"""refimpl convert and refimpl/data/tfrecord.py: MLPerf CosmoFlow's TFRecords read without TensorFlow.

The oracle is an independent writer: the ``tfrecord`` package (Google's protobuf for the
tf.train.Example, the ``crc32c`` package for the checksums), plain and gzip-compressed as
MLPerf's v1.0 release is.  What is checked: the CRC-32C against ``crc32c`` on every length
regime of the lane algorithm, the Example parser on every feature kind, every converted
sample against the int16 counts written (moved to channels first), the split and sample
limits and layouts, that refimpl train takes log(1 + counts) of it, and every damaged or
foreign input refused with exit 2 naming its file and record, leaving nothing behind.
"""
import gzip
import os
import re
import shutil
import subprocess
import sys

import numpy
import pytest

h5py = pytest.importorskip("h5py")
crc32c_package = pytest.importorskip("crc32c")
tfrecord_writer = pytest.importorskip("tfrecord.writer")

from refimpl.cli import main  # noqa: E402
from refimpl.data import tfrecord  # noqa: E402


def write_records(path, examples, compress=False):
    """``examples``: dicts for the tfrecord package's writer ({name: (value, "byte"|"float"|"int")})."""
    w = tfrecord_writer.TFRecordWriter(str(path))
    for example in examples:
        w.write(example)
    w.close()
    if compress:
        with open(path, "rb") as src, gzip.open(f"{path}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(f"{path}.gz", path)


def mlperf_example(counts, y):
    return {"x": (counts.astype("<i2").tobytes(), "byte"), "y": (list(map(float, y)), "float")}


def make_source(root, n_train=5, n_val=3, size=8, seed=0, val_dir="validation"):
    """MLPerf's layout: train/ and validation/ of one record per file, every other file gzip-ed;
    returns the counts and targets written, per split."""
    rng = numpy.random.default_rng(seed)
    written = {}
    for split, n in (("train", n_train), (val_dir, n_val)):
        os.makedirs(root / split, exist_ok=True)
        written[split] = []
        for i in range(n):
            counts = rng.integers(0, 2000, (size, size, size, 4)).astype(numpy.int16)
            y = rng.uniform(-1, 1, 4).astype(numpy.float32)
            write_records(root / split / f"univ_{i:04d}.tfrecord", [mlperf_example(counts, y)], compress=i % 2 == 1)
            written[split].append((counts, y))
    return written


# ---------------------------------------------------------------- CRC-32C and the Example parser

@pytest.mark.parametrize("n", [0, 1, 7, 4095, tfrecord.MIN_LANE_BYTES - 1, tfrecord.MIN_LANE_BYTES,
                               tfrecord.MIN_LANE_BYTES + 1, tfrecord.LANES * 37 + 4095, 3_000_017,
                               tfrecord.LANES * (tfrecord.MIN_PIECE_BYTES + 3) + tfrecord.LANES - 1])
def test_crc32c_equals_the_crc32c_package(n):
    data = numpy.random.default_rng(n).integers(0, 256, n, dtype=numpy.uint8).tobytes()
    assert tfrecord.crc32c(data) == crc32c_package.crc32c(data)
    assert tfrecord.masked_crc(data).to_bytes(4, "little") == tfrecord_writer.TFRecordWriter.masked_crc(data)


def test_crc32c_check_value():
    assert tfrecord.crc32c(b"123456789") == 0xE3069283          # CRC-32C's published check value


def test_every_feature_kind_parses_as_written(tmp_path):
    path = tmp_path / "kinds.tfrecord"
    floats = [0.5, -1.25, 3e38, 1e-45]
    ints = [0, 1, -1, 2 ** 62, -(2 ** 63), 300]
    write_records(path, [{"b": ([b"", b"\x00\xff", b"abc"], "byte"), "f": (floats, "float"), "i": (ints, "int")},
                         {"only": (b"one", "byte")}])
    first, second = [tfrecord.parse_example(r) for r in tfrecord.records(path)]
    assert first["b"] == [b"", b"\x00\xff", b"abc"]
    assert first["f"].dtype == numpy.float32 and numpy.array_equal(first["f"], numpy.float32(floats))
    assert first["i"].dtype == numpy.int64 and first["i"].tolist() == ints
    assert second == {"only": [b"one"]}


def test_an_mlperf_record_is_its_counts_channels_first(tmp_path):
    counts = numpy.random.default_rng(3).integers(-5, 30000, (4, 4, 4, 4)).astype(numpy.int16)
    counts[0, 1, 2, 3] = -32768                                  # int16's extremes survive
    counts[3, 2, 1, 0] = 32767
    path = tmp_path / "one.tfrecord"
    write_records(path, [mlperf_example(counts, [0.1, -0.2, 0.3, -0.4])], compress=True)
    (record,) = list(tfrecord.records(path))
    full, y = tfrecord.mlperf_sample(record, "here")
    assert full.dtype == numpy.float32 and full.shape == (4, 4, 4, 4)
    assert numpy.array_equal(full, counts.transpose(3, 0, 1, 2).astype(numpy.float32))
    assert full[3, 0, 1, 2] == -32768 and full[0, 3, 2, 1] == 32767
    assert numpy.array_equal(y, numpy.float32([0.1, -0.2, 0.3, -0.4]))


# ---------------------------------------------------------------- refimpl convert

def convert(*args):
    return main(["convert", "mlperf-cosmoflow", *map(str, args), "--quiet"])


def test_convert_writes_every_sample_and_train_reads_log1p_of_it(tmp_path):
    from refimpl.data.reader import HDF5Reader
    from refimpl.train_data import counts_data
    src, out = tmp_path / "src", tmp_path / "out"
    written = make_source(src)
    assert convert(src, "--out", out) == 0
    for split, name, first in (("train", "train.h5", 0), ("validation", "val.h5", 5)):
        with h5py.File(out / name, "r") as f:
            assert f["full"].shape == (len(written[split]), 4, 8, 8, 8) and f["unitPar"].dtype == numpy.float32
            for i, (counts, y) in enumerate(written[split]):
                assert numpy.array_equal(f["full"][i], counts.transpose(3, 0, 1, 2).astype(numpy.float32))
                assert numpy.array_equal(f["unitPar"][i], y)
            assert f.attrs["first_index"] == first and f.attrs["generator"] == "mlperf-cosmoflow"
    reader = HDF5Reader(out / "train.h5")
    assert counts_data(reader.attrs)                          # refimpl train's log1p "auto": log(1 + counts)
    logged = HDF5Reader(out / "train.h5", log1p=True).read(2)[0]
    assert numpy.allclose(logged, numpy.log1p(written["train"][2][0].transpose(3, 0, 1, 2).astype(numpy.float32)))


def test_limits_layouts_and_the_val_directory_name(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    written = make_source(src, n_train=4, n_val=3, val_dir="val")
    assert convert(src, "--out", out, "--samples", 3, "--val-samples", 2, "--layout", "per-sample") == 0
    assert sorted(os.listdir(out / "train")) == ["000000.hdf5", "000001.hdf5", "000002.hdf5"]
    assert sorted(os.listdir(out / "val")) == ["000000.hdf5", "000001.hdf5"]
    with h5py.File(out / "val" / "000001.hdf5", "r") as f:
        assert numpy.array_equal(f["full"][()], written["val"][1][0].transpose(3, 0, 1, 2).astype(numpy.float32))
        assert f.attrs["sample_index"] == 4
    assert convert(src, "--out", tmp_path / "noval", "--val-samples", 0) == 0
    assert [n for n in os.listdir(tmp_path / "noval") if not n.startswith(".")] == ["train.h5"]


def test_a_reconversion_leaves_no_split_of_the_earlier_one(tmp_path, capsys):
    src, out = tmp_path / "src", tmp_path / "out"
    make_source(src, n_train=2, n_val=1)
    assert convert(src, "--out", out) == 0
    assert convert(src, "--out", out, "--val-samples", 0, "--layout", "per-sample") == 2
    assert "from an earlier dataset would stay beside this one" in capsys.readouterr().err
    assert convert(src, "--out", out, "--val-samples", 0, "--layout", "per-sample", "--overwrite") == 0
    assert [n for n in sorted(os.listdir(out)) if not n.startswith(".")] == ["train"]


def test_a_file_of_several_records(tmp_path):
    src = tmp_path / "src"
    os.makedirs(src / "train")
    rng = numpy.random.default_rng(5)
    samples = [(rng.integers(0, 9, (4, 4, 4, 4)).astype(numpy.int16), rng.uniform(-1, 1, 4)) for _ in range(3)]
    write_records(src / "train" / "many.tfrecord", [mlperf_example(c, y) for c, y in samples], compress=True)
    assert convert(src, "--out", tmp_path / "out") == 0
    with h5py.File(tmp_path / "out" / "train.h5", "r") as f:
        assert f["full"].shape == (3, 4, 4, 4, 4)
        assert numpy.array_equal(f["full"][2], samples[2][0].transpose(3, 0, 1, 2).astype(numpy.float32))


def damage(path, offset_from_end):
    raw = bytearray(open(path, "rb").read())
    raw[len(raw) - offset_from_end] ^= 0x40
    open(path, "wb").write(bytes(raw))


@pytest.mark.parametrize("how, message", [
    ("data-byte", "record 0: the data's CRC does not match"),
    ("truncate", "record 0: truncated"),
    ("gzip-byte", "the gzip stream is damaged"),
    ("length-byte", "the length's CRC does not match"),
    ("no-x", "no feature 'x'"),
    ("not-a-cube", "not S^3 x 4 int16 values of a cube"),
    ("other-shape", "one dataset holds one sample shape"),
])
def test_damaged_or_foreign_input_is_refused_naming_the_record(tmp_path, capsys, how, message):
    src, out = tmp_path / "src", tmp_path / "out"
    make_source(src, n_train=3, n_val=1)
    target = src / "train" / ("univ_0001.tfrecord" if how == "gzip-byte" else "univ_0002.tfrecord")
    if how == "data-byte":
        damage(target, 100)
    elif how == "truncate":
        open(target, "r+b").truncate(os.path.getsize(target) - 10)
    elif how == "gzip-byte":                    # gzip's own CRC-32 in its trailer (the records read right)
        damage(target, 6)
    elif how == "length-byte":
        damage(target, os.path.getsize(target) - 1)
    elif how == "no-x":
        write_records(target, [{"y": ([0.0] * 4, "float")}])
    elif how == "not-a-cube":
        write_records(target, [{"x": (b"\x00" * (2 * 4 * 10), "byte"), "y": ([0.0] * 4, "float")}])
    elif how == "other-shape":
        write_records(target, [mlperf_example(numpy.zeros((4, 4, 4, 4), numpy.int16) + 1, [0.0] * 4)])
    assert convert(src, "--out", out) == 2
    err = capsys.readouterr().err
    assert "refimpl convert: error:" in err and message in err, err
    assert "univ_000" in err and err.count("\n") == 1
    assert not os.path.exists(out / "train.h5") and not [n for n in os.listdir(out) if n.startswith(".tmp")]


def test_with_several_workers_the_first_bad_record_is_named(tmp_path, capsys):
    """Readers on threads finish out of order; the writer takes their samples in order, so the
    error is the one a sequential read meets first (univ_0001), not the one read first."""
    src, out = tmp_path / "src", tmp_path / "out"
    make_source(src, n_train=6, n_val=1)
    damage(src / "train" / "univ_0001.tfrecord", 6)                  # gzip's trailer
    damage(src / "train" / "univ_0004.tfrecord", 100)                # a data byte (plain file)
    assert convert(src, "--out", out, "--workers", "4") == 2
    err = capsys.readouterr().err
    assert "univ_0001.tfrecord: record 1: the gzip stream is damaged" in err and err.count("\n") == 1, err
    assert not [n for n in os.listdir(out) if not n.startswith(".lock")]


def test_the_closing_lines_name_count_rate_and_readers(tmp_path, capsys):
    make_source(tmp_path / "src", n_train=5, n_val=2)
    assert main(["convert", "mlperf-cosmoflow", str(tmp_path / "src"), "--out", str(tmp_path / "out"),
                 "--workers", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(re.fullmatch(
        rf"wrote .*{split}: {n} samples of \(4, 8, 8, 8\) from {n} files in [0-9.]+ s "
        r"\([0-9.]+ samples/s, 3 reader threads\)", line) for line, split, n in zip(lines, ("train.h5", "val.h5"),
                                                                                  (5, 2))), lines


def test_a_source_that_cannot_be_read_is_bad_input_not_a_failed_write(tmp_path, capsys):
    make_source(tmp_path / "src", n_train=2, n_val=1)
    os.makedirs(tmp_path / "src" / "train" / "univ_0005.tfrecord")    # a directory where a file is expected
    assert convert(tmp_path / "src", "--out", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "univ_0005.tfrecord: cannot be read (Is a directory" in err and err.count("\n") == 1, err


def dataset_contents(path):
    """Every dataset and root attribute of a split (one file, or a directory of per-sample files)."""
    files = sorted(os.path.join(path, n) for n in os.listdir(path)) if os.path.isdir(path) else [path]
    out = []
    for name in files:
        with h5py.File(name, "r") as f:
            out.append(({k: f[k][()] for k in f}, dict(f.attrs)))
    return out


def same_contents(a, b):
    return len(a) == len(b) and all(
        da.keys() == db.keys() and all(numpy.array_equal(da[k], db[k]) for k in da)
        and aa.keys() == ab.keys() and all(numpy.array_equal(aa[k], ab[k]) for k in aa)
        for (da, aa), (db, ab) in zip(a, b))


@pytest.mark.parametrize("layout", ["single", "per-sample"])
def test_any_worker_count_writes_the_same_dataset(tmp_path, layout):
    src = tmp_path / "src"
    make_source(src, n_train=7, n_val=3)
    rng = numpy.random.default_rng(9)                                 # and a file of several records
    write_records(src / "train" / "univ_0003.tfrecord",
                  [mlperf_example(rng.integers(0, 9, (8, 8, 8, 4)).astype(numpy.int16), rng.uniform(-1, 1, 4))
                   for _ in range(4)], compress=True)
    make_universes(tmp_path / "universes", count=3, width=8)
    suffix = ".h5" if layout == "single" else ""
    for workers in ("1", "3", "8"):
        assert convert(src, "--out", tmp_path / f"m{workers}", "--layout", layout, "--workers", workers,
                       "--samples", "9") == 0
        assert main(["convert", "nersc-cosmoflow", str(tmp_path / "universes"), "--size", "4", "--val-files", "1",
                     "--out", str(tmp_path / f"n{workers}"), "--layout", layout, "--workers", workers,
                     "--quiet"]) == 0
    for kind in "mn":
        for split in ("train", "val"):
            one = dataset_contents(tmp_path / f"{kind}1" / (split + suffix))
            assert len(one) == (1 if layout == "single" else {"m": {"train": 9, "val": 3},
                                                                  "n": {"train": 16, "val": 8}}[kind][split])
            for workers in ("3", "8"):
                assert same_contents(one, dataset_contents(tmp_path / f"{kind}{workers}" / (split + suffix)))


def test_no_verify_skips_the_data_crc_only(tmp_path):
    src = tmp_path / "src"
    make_source(src, n_train=3, n_val=1)
    damage(src / "train" / "univ_0002.tfrecord", 100)             # a byte of the counts: a wrong value, no error
    assert convert(src, "--out", tmp_path / "out", "--no-verify") == 0


@pytest.mark.parametrize("args, message", [
    (["--samples", "0"], "--samples must be >= 1"),
    (["--val-samples", "-1"], "--val-samples must be >= 0"),
    (["--chunk", "0"], "--chunk must be >= 1"),
    (["--workers", "0"], "--workers must be >= 1"),
])
def test_bad_flags(tmp_path, capsys, args, message):
    make_source(tmp_path / "src", n_train=1, n_val=1)
    assert convert(tmp_path / "src", "--out", tmp_path / "out", *args) == 2
    assert message in capsys.readouterr().err


def test_a_source_without_records_and_an_existing_output(tmp_path, capsys):
    os.makedirs(tmp_path / "empty" / "train")
    assert convert(tmp_path / "empty", "--out", tmp_path / "o") == 2
    assert "no train/*.tfrecord" in capsys.readouterr().err
    assert convert(tmp_path / "nowhere", "--out", tmp_path / "o") == 2
    assert "is not a directory" in capsys.readouterr().err
    make_source(tmp_path / "src", n_train=1, n_val=1)
    assert convert(tmp_path / "src", "--out", tmp_path / "out") == 0
    assert convert(tmp_path / "src", "--out", tmp_path / "out") == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err
    assert convert(tmp_path / "src", "--out", tmp_path / "out", "--overwrite") == 0


def test_help_names_the_format_and_the_layout():
    proc = subprocess.run([sys.executable, "-m", "refimpl", "convert", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    for words in ("mlperf-cosmoflow", "train/*.tfrecord", "gzip", "int16", "--layout", "--no-verify", "CRC-32C",
                  "nersc-cosmoflow", "--size", "--val-files", "validation split", "--workers"):
        assert words in text, words


# ---------------------------------------------------------------- nersc-cosmoflow: universes cut into cubes

def make_universes(root, count=3, width=8, dtype=numpy.int16, seed=0):
    """NERSC-style universes: 'full' (W, W, W, 4) channels last, 'unitPar' (4,) float64."""
    rng = numpy.random.default_rng(seed)
    os.makedirs(root, exist_ok=True)
    out = []
    for i in range(count):
        full = rng.integers(0, 500, (width, width, width, 4)).astype(dtype)
        par = rng.uniform(-1, 1, 4)
        with h5py.File(root / f"univ_{i:02d}.hdf5", "w") as f:
            f["full"], f["unitPar"] = full, par
        out.append((full, par))
    return out


def test_universes_are_cut_into_cubes_in_prepare_py_order(tmp_path):
    """Each universe cut into (W/S)^3 cubes, the first axis outermost (MLPerf's prepare.py:
    np.split along axis 0, then 1, then 2), channels first; the last --val-files universes are
    the validation split, whole."""
    universes = make_universes(tmp_path / "src", count=3, width=8)
    out = tmp_path / "out"
    assert main(["convert", "nersc-cosmoflow", str(tmp_path / "src"), "--size", "4", "--val-files", "1",
                 "--out", str(out), "--quiet"]) == 0
    expected = {"train": [], "val": []}
    for u, (full, par) in enumerate(universes):
        for a in numpy.split(full, 2, axis=0):                 # prepare.py's split_universe
            for ab in numpy.split(a, 2, axis=1):
                for abc in numpy.split(ab, 2, axis=2):
                    expected["val" if u == 2 else "train"].append((abc.transpose(3, 0, 1, 2), par))
    for split in ("train", "val"):
        with h5py.File(out / f"{split}.h5", "r") as f:
            assert f["full"].shape == (len(expected[split]), 4, 4, 4, 4)
            for i, (cube, par) in enumerate(expected[split]):
                assert numpy.array_equal(f["full"][i], cube.astype(numpy.float32))
                assert numpy.array_equal(f["unitPar"][i], par.astype(numpy.float32))
            assert f.attrs["generator"] == "nersc-cosmoflow"
    from refimpl.data.reader import HDF5Reader
    from refimpl.train_data import counts_data
    assert counts_data(HDF5Reader(out / "train.h5").attrs)


def test_universe_defaults_limits_and_float_counts(tmp_path):
    make_universes(tmp_path / "src" / "deeper", count=2, width=4, dtype=numpy.float32)
    assert main(["convert", "nersc-cosmoflow", str(tmp_path / "src"), "--size", "4", "--out", str(tmp_path / "o"),
                 "--quiet"]) == 0                              # fewer than 8 universes: no validation split
    assert [n for n in os.listdir(tmp_path / "o") if not n.startswith(".")] == ["train.h5"]
    assert main(["convert", "nersc-cosmoflow", str(tmp_path / "src"), "--size", "2", "--samples", "3",
                 "--out", str(tmp_path / "o2"), "--quiet"]) == 0
    with h5py.File(tmp_path / "o2" / "train.h5", "r") as f:
        assert f["full"].shape == (3, 4, 2, 2, 2)


@pytest.mark.parametrize("args, message", [
    (["--val-files", "1"], "needs --size S"),
    (["--size", "3"], "--size 3 does not divide the universe's extents (8, 8, 8)"),
    (["--size", "0"], "--size must be >= 1"),
    (["--size", "4", "--val-files", "3"], "--val-files must be in [0, 2]"),
    (["--size", "4", "--no-verify"], "--no-verify is mlperf-cosmoflow's"),
])
def test_bad_universe_flags(tmp_path, capsys, args, message):
    make_universes(tmp_path / "src", count=3, width=8)
    assert main(["convert", "nersc-cosmoflow", str(tmp_path / "src"), "--out", str(tmp_path / "o"), *args]) == 2
    assert message in capsys.readouterr().err


def test_a_foreign_universe_file_is_refused_naming_it(tmp_path, capsys):
    make_universes(tmp_path / "src", count=2, width=8)
    with h5py.File(tmp_path / "src" / "univ_01.hdf5", "w") as f:
        f["full"] = numpy.zeros((8, 8, 8, 4), numpy.int16)
        f["unitPar"] = numpy.array([0.1, numpy.nan, 0.2, 0.3])
    assert main(["convert", "nersc-cosmoflow", str(tmp_path / "src"), "--size", "4", "--out", str(tmp_path / "o"),
                 "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "univ_01.hdf5: 'unitPar' holds a NaN or infinity" in err and err.count("\n") == 1
    with h5py.File(tmp_path / "src" / "univ_00.hdf5", "w") as f:
        f["data"] = numpy.zeros(3)
    assert main(["convert", "nersc-cosmoflow", str(tmp_path / "src"), "--size", "4", "--out", str(tmp_path / "o"),
                 "--quiet"]) == 2
    assert "univ_00.hdf5: no dataset 'full'" in capsys.readouterr().err


# ---------------------------------------------------------------- lbann-cosmoflow: LBANN's split, a file per sample

def write_lbann_split(universe_dir, out, size, n_val, transpose=True):
    """LBANN's ``split_cosmoflow_sample.py`` layout, written here as that script does: universes
    sorted by path, the first ones train/ and the next n_val validation/, 64 universes per
    numbered subdirectory, each cube ``<universe>_<i:03d>.hdf5`` with 'split' (channels first
    unless not ``transpose``) in the universe's dtype and 'unitPar' as stored (float64)."""
    files = sorted(str(p) for p in universe_dir.rglob("*.hdf5"))
    for chunk, names in (("train", files[:len(files) - n_val]), ("validation", files[len(files) - n_val:])):
        for idx, name in enumerate(names):
            with h5py.File(name, "r") as f:
                x, y = f["full"][:], f["unitPar"][:]
            base = out / chunk / f"{idx // 64:03d}" / os.path.splitext(os.path.basename(name))[0]
            os.makedirs(base.parent, exist_ok=True)
            k = x.shape[0] // size
            cubes = [c for a in numpy.split(x, k, 0) for b in numpy.split(a, k, 1) for c in numpy.split(b, k, 2)]
            for i, cube in enumerate(cubes):
                with h5py.File(f"{base}_{i:03d}.hdf5", "w") as g:
                    g.create_dataset("split", data=cube.transpose(3, 0, 1, 2) if transpose else cube)
                    g.create_dataset("unitPar", data=y)


@pytest.mark.parametrize("transpose", [True, False])
def test_lbann_split_files_convert_to_the_same_samples_as_the_universes(tmp_path, transpose):
    """A Distconv user's LBANN split and refimpl's own cut of the same universes give the same
    dataset: the same cubes, channels first, in the same order, float32."""
    make_universes(tmp_path / "universes", count=3, width=16)      # cubes of 8: not 4 = C, which reads either way
    write_lbann_split(tmp_path / "universes", tmp_path / "lbann", size=8, n_val=1, transpose=transpose)
    assert main(["convert", "nersc-cosmoflow", str(tmp_path / "universes"), "--size", "8", "--val-files", "1",
                 "--out", str(tmp_path / "n"), "--quiet"]) == 0
    assert main(["convert", "lbann-cosmoflow", str(tmp_path / "lbann"), "--out", str(tmp_path / "l"),
                 "--workers", "3", "--quiet"]) == 0
    for split in ("train.h5", "val.h5"):
        with h5py.File(tmp_path / "n" / split, "r") as a, h5py.File(tmp_path / "l" / split, "r") as b:
            assert b["full"].shape == a["full"].shape == ((16 if split == "train.h5" else 8), 4, 8, 8, 8)
            assert b["full"].dtype == numpy.float32 and b["unitPar"].dtype == numpy.float32
            assert numpy.array_equal(a["full"][()], b["full"][()])
            assert numpy.array_equal(a["unitPar"][()], b["unitPar"][()])
            assert b.attrs["generator"] == "lbann-cosmoflow"
    from refimpl.data.reader import HDF5Reader
    from refimpl.train_data import counts_data
    assert counts_data(HDF5Reader(tmp_path / "l" / "train.h5").attrs)


@pytest.mark.parametrize("content, message", [
    ({"other": numpy.ones(3)}, "holds 'split' (or 'full')"),
    ({"split": numpy.ones((4, 4, 4)), "unitPar": numpy.ones(4)}, "must be a 4-D cube of numbers"),
    ({"split": numpy.ones((4, 4, 5, 4)), "unitPar": numpy.ones(4)}, "is not a cube (C, S, S, S) or (S, S, S, C)"),
    ({"split": numpy.ones((4, 4, 4, 4)), "unitPar": numpy.array([1, numpy.inf, 0, 0])}, "holds a NaN or infinity"),
])
def test_a_foreign_lbann_file_is_refused_naming_it(tmp_path, capsys, content, message):
    for i in range(3):
        os.makedirs(tmp_path / "src" / "train" / "000", exist_ok=True)
        with h5py.File(tmp_path / "src" / "train" / "000" / f"u_{i:03d}.hdf5", "w") as f:
            for k, v in (content if i == 1 else {"split": numpy.ones((4, 4, 4, 4)) + i,
                                                  "unitPar": numpy.ones(4)}).items():
                f[k] = v
    assert main(["convert", "lbann-cosmoflow", str(tmp_path / "src"), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "u_001.hdf5" in err and message in err and err.count("\n") == 1, err
    assert not [n for n in os.listdir(tmp_path / "o") if not n.startswith(".lock")]


def test_lbann_refuses_the_other_kinds_flags_and_an_empty_source(tmp_path, capsys):
    os.makedirs(tmp_path / "src" / "train")
    assert main(["convert", "lbann-cosmoflow", str(tmp_path / "src"), "--out", str(tmp_path / "o")]) == 2
    assert "no train/**/*.hdf5 (LBANN's CosmoFlow split" in capsys.readouterr().err
    for extra in (["--size", "4"], ["--val-files", "1"], ["--no-verify"]):
        assert main(["convert", "lbann-cosmoflow", str(tmp_path / "src"), "--out", str(tmp_path / "o"), *extra]) == 2
        assert "leave it out" in capsys.readouterr().err


def test_mlperf_refuses_the_universe_flags(tmp_path, capsys):
    make_source(tmp_path / "src", n_train=1, n_val=1)
    for extra in (["--size", "4"], ["--val-files", "1"]):
        assert convert(tmp_path / "src", "--out", tmp_path / "o", *extra) == 2
        assert "is nersc-cosmoflow's" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["convert", "mlperf-cosmoflow", "SRC"], ["datagen", "cosmoflow"]])
def test_under_mpiexec_it_is_refused_before_writing(tmp_path, command):
    """One writer per split: P copies would race for OUT's lock and files, and mpiexec kills the
    rest when one exits; every rank refuses instead, and nothing is written."""
    from launcher import run_launched
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        pytest.fail("mpiexec not found: pip install 'refimpl[mpi]'")
    make_source(tmp_path / "SRC", n_train=1, n_val=1)
    argv = [str(tmp_path / a) if a == "SRC" else a for a in command]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    proc = run_launched([mpiexec, "--oversubscribe", "-n", "2", sys.executable, "-m", "refimpl", *argv,
                         "--out", str(tmp_path / "out"), "--quiet"], env=env, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"refimpl {command[0]} runs in one process" in proc.stderr and "without mpiexec" in proc.stderr
    assert not (tmp_path / "out" / "train.h5").exists()
