"""Nothing refimpl reads or writes is a FIFO, a device node or a socket (issue 41, items 1
and 4): an output path naming one is refused before any work (exit 2, one line) and the
node is left as it was — never replaced by the atomic rename; an input naming one is
refused at once instead of blocking on the first read."""
import os
import stat
import subprocess
import sys

import pytest

from refimpl import checkpoint, paths
from refimpl.atomic import atomic_write
from refimpl.paths import check_writable
from refimpl.oracle import parse_suite, write_case

ENV = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_WORLD", "PMI_"))}


def cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "refimpl", *args], capture_output=True, text=True, env=ENV,
                          timeout=timeout)


@pytest.fixture()
def fifo(tmp_path):
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


@pytest.fixture()
def char_device(tmp_path):
    """A character device node like /dev/null (1, 3), made in a temporary directory (root only)."""
    path = tmp_path / "null"
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("making a device node needs root")
    return path


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    spec, = parse_suite({"case": [{"name": "c", "layer": "conv3d", "input": [1, 1, 3, 3, 4], "out_channels": 1,
                                   "kernel": 3, "padding": 1, "grids": [[1, 1, 1, 2]], "dtypes": ["float64"]}]}, "t")
    return write_case(spec, str(tmp_path_factory.mktemp("case")))


def test_special_kind_names_each_kind(tmp_path, fifo):
    assert paths.special_kind(fifo) == "a FIFO (named pipe)"
    assert paths.special_kind(tmp_path) is None and paths.special_kind(tmp_path / "absent") is None
    (tmp_path / "file").write_text("x")
    assert paths.special_kind(tmp_path / "file") is None
    assert paths.special_kind("/dev/null") == "a character device"


@pytest.mark.parametrize("node", ["fifo", "char_device"])
def test_json_onto_a_special_file_is_refused_and_the_node_kept(case, tmp_path, node, request):
    target = request.getfixturevalue(node)
    before = os.stat(target)
    proc = cli("oracle", "check", case, case, "--json", str(target))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "not a regular file" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    after = os.stat(target)
    assert stat.S_IFMT(after.st_mode) == stat.S_IFMT(before.st_mode) and after.st_ino == before.st_ino
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_atomic_write_never_replaces_a_special_file(fifo):
    with pytest.raises(ValueError, match="FIFO"):
        atomic_write(str(fifo), lambda f: f.write("report"))
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    with pytest.raises(ValueError, match="not a regular file"):
        check_writable(str(fifo), "--json")


@pytest.mark.parametrize("which", ["results", "case"])
def test_a_fifo_given_as_input_is_refused_at_once(case, fifo, which):
    args = (case, str(fifo)) if which == "results" else (str(fifo), case)
    proc = cli("oracle", "check", *args, timeout=30)              # a blocking open would time out here
    assert proc.returncode == 2 and "is a FIFO (named pipe), not a regular file" in proc.stderr, proc.stderr


def test_a_fifo_in_a_results_directory_makes_only_its_case_unusable(case, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    os.mkfifo(results / os.path.basename(case))
    proc = cli("oracle", "check", os.path.dirname(case), str(results), timeout=30)
    assert proc.returncode == 2 and "UNUSABLE" in proc.stdout and "FIFO" in proc.stdout, proc.stdout + proc.stderr


def test_a_fifo_as_suite_config_data_or_checkpoint(tmp_path, fifo):
    proc = cli("oracle", "generate", str(fifo), "--out", str(tmp_path / "cases"), timeout=30)
    assert proc.returncode == 2 and "suite" in proc.stderr and "FIFO" in proc.stderr, proc.stderr
    from refimpl.config import load_toml
    with pytest.raises(ValueError, match="--config .* is a FIFO"):
        load_toml(str(fifo))
    from refimpl.data.reader import HDF5Reader
    with pytest.raises(ValueError, match="data .* is a FIFO"):
        HDF5Reader(str(fifo))
    samples = tmp_path / "samples"
    samples.mkdir()
    os.mkfifo(samples / "sample_0.h5")
    with pytest.raises(ValueError, match="sample file .* is a FIFO"):
        HDF5Reader(str(samples))
    with pytest.raises(checkpoint.CheckpointError, match="is a FIFO"):
        checkpoint.read_file(str(fifo))


def test_train_refuses_a_fifo_where_its_metrics_go(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    os.mkfifo(out / "metrics.jsonl")
    proc = cli("train", "--model", "cosmoflow", "--preset", "tiny", "--steps", "1", "--out", str(out), timeout=120)
    assert proc.returncode == 2 and "metrics.jsonl" in proc.stderr and "FIFO" in proc.stderr, proc.stderr


# ---------------------------------------------------------------- issue 41, item 3: sizes bounded before allocation

@pytest.mark.parametrize("extra, words", [
    ('grids = [[1, 100000, 100000, 1]]', "makes 10,000,000,000 ranks"),
    ('padding = 1000\ngrids = [[1, 1, 1, 1]]', "the padded input"),
    ('padding = [0, 99999999999, 0, 0, 0, 0]\ngrids = [[1, 1, 1, 1]]', "the padded input"),
    ('input = [100000, 2, 800, 800, 800]\ngrids = [[1, 1, 1, 1]]', "the input"),
    ('kernel = 1000000\npadding = "same"\ngrids = [[1, 1, 1, 1]]', "taps"),
])
def test_a_huge_suite_is_refused_at_once(tmp_path, extra, words):
    import time
    text = '[[case]]\nname = "x"\nlayer = "conv3d"\nout_channels = 2\n' + extra + "\n"
    if "input =" not in extra:
        text += "input = [1, 2, 8, 8, 8]\n"
    (tmp_path / "s.toml").write_text(text)
    start = time.monotonic()
    proc = cli("oracle", "generate", str(tmp_path / "s.toml"), "--out", str(tmp_path / "cases"), timeout=30)
    assert proc.returncode == 2 and words in proc.stderr and time.monotonic() - start < 10, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("flags, words", [(("--padding", "100000000"), "the padded input"),
                                          (("--kernel", "1000000,1,1", "--padding", "same"), "taps")])
def test_check_layer_refuses_huge_sizes(flags, words):
    proc = cli("check-layer", "conv3d", "--input", "1,2,8,8,8", "--grid", "1,1,1,1", *flags, timeout=30)
    assert proc.returncode == 2 and words in proc.stderr, proc.stderr


# ---------------------------------------------------------------- issue 41, item 9: a digest that is not a string

@pytest.mark.parametrize("value", [[1, 2], 7])
def test_a_case_digest_that_is_not_a_string_names_file_and_attribute(case, tmp_path, value):
    import h5py
    import numpy as np
    path = tmp_path / "r.h5"
    with h5py.File(path, "w") as h5:
        h5.attrs["case_digest"] = np.asarray(value)
        h5.create_dataset("float64/global/y", data=np.zeros(1))
    proc = cli("oracle", "check", case, str(path))
    assert proc.returncode == 2 and str(path) in proc.stderr and "'case_digest' must be one string" in proc.stderr, \
        proc.stderr


def test_a_fifo_as_a_trace_name_map_is_refused(fifo):
    from refimpl.oracle.trace_results import load_names
    with pytest.raises(ValueError, match="--names .* is a FIFO"):
        load_names(str(fifo), trace=None)
