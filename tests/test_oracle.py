"""The oracle toolkit: PyTorch passes the hard suite; planted bugs are caught, located and
diagnosed; unusable input is refused with exit 2 and one line, never a traceback."""
import json
import os
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest

from refimpl import layers
from refimpl.oracle import compare, load_case, load_results, load_suite, parse_suite, write_case, write_results
from refimpl.oracle.casefile import UnusableInput
from refimpl.oracle.compare import root_cause
from refimpl.oracle.expect import rank_layouts

torch = pytest.importorskip("torch", reason="PyTorch absent: pip install 'refimpl[oracle]'")
from refimpl.oracle import torch_adapter  # noqa: E402

ENV = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_WORLD", "PMI_"))}


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "refimpl", "oracle", *args], capture_output=True, text=True,
                          env=ENV, cwd=cwd, timeout=300)


def case_file(hard, name):
    return str(hard / f"{name}.h5")


# ---------------------------------------------------------------- PyTorch passes the hard suite

def test_torch_passes_the_whole_hard_suite(hard, tmp_path):
    specs = load_suite("hard")
    assert len(os.listdir(hard)) == len(specs) >= 30
    assert {s.layer for s in specs} == {"conv3d", "conv_transpose3d", "max_pool3d", "avg_pool3d", "batch_norm3d",
                                           "group_norm3d", "instance_norm3d", "layer_norm3d"}
    assert max(s.ranks for s in specs) == 8 and {s.model_parallel for s in specs} == {"none", "filter", "channel"}
    proc = cli("run-torch", str(hard), "--out", str(tmp_path / "torch"))
    assert proc.returncode == 0, proc.stderr
    proc = cli("check", str(hard), str(tmp_path / "torch"), "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["ok"] and len(report["cases"]) == len(specs)
    findings = [f for c in report["cases"] for f in c["findings"]]
    assert {f["dtype"] for f in findings} == {"float64", "float32"}
    ranks = {f["tensor"] for f in findings if f["rank"] is not None}
    assert {"x_needed", "y", "dx_needed", "dx", "dw_partial", "dw", "y_partial", "sum_partial"} <= ranks
    # the documented margin: PyTorch stays below a tenth of every tolerance
    assert max(f["max_rel"] / f["tolerance"] for f in findings) < 0.1


def test_gathered_globals_pass_too(hard, tmp_path):
    """The per-rank model adapter, gathered, equals the whole: it partitions correctly."""
    for name in ("conv_wide_halo.1-2-2-2", "convT_anisotropic.2-1-1-3", "conv_channel_parallel.2-1-1-1-4",
                 "batchnorm_channel_parallel.2-1-1-2-2", "maxpool_overlap_ties.1-3-1-2"):
        case = load_case(case_file(hard, name))
        glob, ranks = torch_adapter.run_case(case, global_mode="gathered")
        write_results(str(tmp_path / f"{name}.h5"), case, glob, ranks)
        assert compare(case, load_results(str(tmp_path / f"{name}.h5"), case)).ok, name


# ---------------------------------------------------------------- expectations are self-consistent

def test_rank_blocks_tile_the_global_arrays(hard):
    """Every rank's y and dx are slices of the global expectation at their offsets, and the
    owned blocks tile the input exactly once per model copy."""
    case = load_case(case_file(hard, "conv_empty_blocks.1-8-1-1"))
    x = case.inputs["float64"]["x"]
    cover = np.zeros(x.shape, int)
    empty = 0
    for lo, arrays in zip(case.layouts, case.ranks["float64"]):
        for name, whole in (("y", case.expected["float64"]["y"]), ("dx", case.expected["float64"]["dx"]),
                            ("x_needed", x)):
            block, offset = arrays[name]
            index = tuple(slice(o, o + n) for o, n in zip(offset, block.shape))
            np.testing.assert_array_equal(block, whole[index])
        cover[lo.index("x")] += 1
        empty += arrays["y"][0].size == 0
    assert (cover == 1).all() and empty > 0          # 8 ranks on 5 inputs / 3 outputs: empty blocks


def test_layouts_come_from_the_halo_plan():
    from refimpl.parallel.partition import conv_halo_plan
    spec, = parse_suite({"case": [{"name": "w", "layer": "conv3d", "input": [1, 2, 6, 7, 5], "kernel": [5, 5, 3],
                                   "padding": [2, 2, 1], "grids": [[1, 4, 1, 1]]}]}, "t")
    plan = conv_halo_plan((6, 7, 5), (4, 1, 1), (5, 5, 3), 1, (2, 2, 1), 1)
    for lo in rank_layouts(spec):
        assert lo.needed == plan.needed(lo.coords[1:4]) and lo.owned == plan.owned(lo.coords[1:4])
    # a halo wider than the neighbour's block: rank 2 (D block [4, 5)) needs [2, 6)
    assert rank_layouts(spec)[2].needed[0] == (2, 6)


# ---------------------------------------------------------------- planted bugs, caught and located

def planted(hard, tmp_path, name, plant, global_mode="gathered"):
    case = load_case(case_file(hard, name))
    glob, ranks = torch_adapter.run_case(case, torch_adapter.parse_plant(plant, case), global_mode)
    path = str(tmp_path / f"{name}.h5")
    write_results(path, case, glob, ranks)
    report = compare(case, load_results(path, case))
    assert not report.ok
    return case, report


def failing(report, dtype="float64", tensor=None, rank="any"):
    return [f for f in report.findings if not f.ok and f.dtype == dtype and (tensor is None or f.tensor == tensor)
            and (rank == "any" or f.rank == rank)]


def test_wrong_halo_on_one_rank(hard, tmp_path):
    case, report = planted(hard, tmp_path, "conv_even_kernel.1-2-2-1", "halo:1")
    # only rank 1's forward tensors are wrong
    assert {f.rank for f in failing(report, tensor="y")} == {1, None}
    assert {f.rank for f in failing(report, tensor="x_needed")} == {1}
    f, = failing(report, tensor="x_needed")
    assert "ghost cells are wrong" in f.diagnosis and "rank 0)" in f.diagnosis
    lo = case.layouts[1]
    for f in failing(report, tensor="y"):
        assert "forward halo exchange" in f.diagnosis and "rank 1" in f.diagnosis and f.owner == 1
        # the first mismatch is rank 1's first output whose window reaches below its own H block
        ho = f.first_index[3]
        assert ho == lo.outputs[1][0] and ho * 1 - 1 < lo.owned[1][0]
    cause = root_cause(report)
    assert cause.rank == 1 and cause.tensor == "x_needed"
    assert all(f.diagnosis for f in failing(report))     # downstream errors traced to it


def test_missing_ghost_clear_in_backward(hard, tmp_path):
    case, report = planted(hard, tmp_path, "conv_wide_halo.1-4-1-1", "ghost-clear")
    found = failing(report, tensor="dx")
    assert found and all("doubled gradient on ghost cells" in f.diagnosis for f in found)
    assert not failing(report, tensor="y") and not failing(report, tensor="dw")
    # the first bad element of each rank is the first cell of its block another rank reads
    for f in found:
        if f.rank is None:
            continue
        lo = case.layouts[f.rank]
        readers = [q for q in case.layouts if q.rank != lo.rank]
        first_ghost = min(d for d in range(*lo.owned[0]) if any(q.needed[0][0] <= d < q.needed[0][1] for q in readers))
        assert f.first_index[2] == first_ghost and f.owner == f.rank


def test_padding_off_by_one(hard, tmp_path):
    _, report = planted(hard, tmp_path, "conv_dilation.1-1-2-3", "padding:W")
    f, = failing(report, tensor="y", rank=None)
    assert "shifted by +1 along W" in f.diagnosis and "padding" in f.diagnosis
    assert f.first_index == (0, 0, 0, 0, 0) and f.owner == 0


def test_batch_norm_statistics_not_reduced(hard, tmp_path):
    _, report = planted(hard, tmp_path, "batchnorm_global.2-2-1-1", "local-stats")
    ys = failing(report, tensor="y")
    assert {f.rank for f in ys} == {None, 0, 1, 2, 3}
    assert all("not reduced over the spatial group" in f.diagnosis for f in ys)
    assert "not reduced over the spatial group" in root_cause(report).diagnosis


def test_dw_not_summed_over_spatial_shards(hard, tmp_path):
    _, report = planted(hard, tmp_path, "conv_dilation.2-2-2-1", "dw-unsummed")
    assert not failing(report, tensor="y") and not failing(report, tensor="dx")
    dws = failing(report, tensor="dw")
    assert {f.rank for f in dws} == set(range(8)) | {None}
    assert all("not summed over the 4 spatial shards" in f.diagnosis for f in dws)
    # rank 5 sits at spatial block 1: its dw sums that block's partials over the sample groups
    f, = failing(report, tensor="dw", rank=5)
    assert "spatial block 1 only" in f.diagnosis and f.owner == 5 and f.first_index == (0, 0, 0, 0, 0)
    _, report = planted(hard, tmp_path, "conv_even_kernel.1-2-2-1", "dw-unsummed")
    f, = failing(report, tensor="db", rank=None)
    assert "rank 0 alone" in f.diagnosis and "spatial shards" in f.diagnosis


def test_averaged_instead_of_summed(hard, tmp_path):
    """A data-parallel code that averages over the sample groups is told to scale by Pn."""
    case = load_case(case_file(hard, "batchnorm_global.4-1-2-1"))
    glob = {"float64": dict(case.expected["float64"])}
    glob["float64"]["dw"] = glob["float64"]["dw"] / 4
    write_results(str(tmp_path / "m.h5"), case, glob)
    report = compare(case, load_results(str(tmp_path / "m.h5"), case))
    f, = failing(report)
    assert f.tensor == "dw" and "averaged over the 4 sample groups" in f.diagnosis


# ---------------------------------------------------------------- unusable input: exit 2, one line

@pytest.fixture()
def good(hard, tmp_path):
    """A correct results file for one case, to spoil."""
    name = "conv_even_kernel.1-2-2-1.h5"
    case = load_case(case_file(hard, name[:-3]))
    glob, ranks = torch_adapter.run_case(case)
    path = tmp_path / "res" / name
    write_results(str(path), case, glob, ranks)
    return case_file(hard, name[:-3]), path


def spoil_and_check(good, spoil):
    case_path, path = good
    with h5py.File(path, "a") as h5:
        spoil(h5)
    proc = cli("check", case_path, str(path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    return proc.stderr


def check_spoilt(good, spoil, *flags):
    """A spoilt file that can still be checked: exit 1 (or 0), no traceback, the report on stdout."""
    case_path, path = good
    with h5py.File(path, "a") as h5:
        spoil(h5)
    proc = cli("check", case_path, str(path), *flags)
    assert "Traceback" not in proc.stderr and not proc.stderr.strip(), proc.stderr
    return proc


def test_missing_dataset_is_not_provided(good):
    """Partial results are judged as far as they go; --require makes a gap a failure."""
    proc = check_spoilt(good, lambda h5: h5.__delitem__("float64/global/dx"))
    assert proc.returncode == 0 and "PASS" in proc.stdout, proc.stdout
    case_path, path = good
    with h5py.File(path, "a") as h5:
        for r in range(4):
            del h5[f"float64/rank/{r}/dx"]
    proc = cli("check", case_path, str(path))
    assert proc.returncode == 0 and "not provided: float64 dx" in proc.stdout, proc.stdout
    proc = cli("check", case_path, str(path), "--require", "all")
    assert proc.returncode == 1 and "missing (--require): float64 dx" in proc.stdout, proc.stdout
    assert cli("check", case_path, str(path), "--require", "forward,params").returncode == 0


def test_wrong_shape(good):
    def spoil(h5):
        del h5["float64/rank/2/y"]
        h5["float64/rank/2/y"] = np.ones((2, 4, 3, 3, 3))
    proc = check_spoilt(good, spoil)
    assert proc.returncode == 1 and "FAIL" in proc.stdout
    assert "rank 2's y has 3 outputs along D; the case's block of rank 2 has 4 there" in proc.stdout, proc.stdout


def test_wrong_dtype(good):
    def spoil(h5):
        y = h5["float32/global/y"][()]
        del h5["float32/global/y"]
        h5["float32/global/y"] = y.astype(np.float64)
    assert "dtype float64, expected float32" in spoil_and_check(good, spoil)


def test_nan(good, tmp_path):
    def spoil(h5):
        h5["float64/rank/1/dx"][0, 0, 0, 0, 0] = np.nan
    proc = check_spoilt(good, spoil, "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 1 and "NaN" in proc.stdout
    bad = [f for c in json.loads((tmp_path / "r.json").read_text())["cases"] for f in c["findings"] if not f["ok"]]
    f, = [f for f in bad if f["tensor"] == "dx"]
    assert f["rank"] == 1 and f["nonfinite"] == 1 and f["first_index"] == [0, 0, 0, 4, 0] and f["owner"] == 1


def test_unknown_dataset(good):
    def spoil(h5):
        h5["float64/rank/0/dW"] = np.ones(3)
    assert "unknown dataset(s) ['dW']" in spoil_and_check(good, spoil)


def test_results_for_another_case_or_version(good):
    def spoil(h5):
        h5.attrs["case_digest"] = "0123456789abcdef0123"
    assert "another refimpl version" in spoil_and_check(good, spoil)


def test_truncated_results(good):
    case_path, path = good
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    proc = cli("check", case_path, str(path))
    assert proc.returncode == 2 and "truncated or corrupt" in proc.stderr and "Traceback" not in proc.stderr


def test_case_from_another_version(good, tmp_path):
    case_path, path = good
    other = tmp_path / "old.h5"
    shutil.copy(case_path, other)
    with h5py.File(other, "a") as h5:
        h5.attrs["refimpl_version"] = "0.0.9"
    proc = cli("check", str(other), str(path))
    assert proc.returncode == 2 and "regenerate the cases" in proc.stderr


def test_missing_results_file(hard, tmp_path):
    (tmp_path / "empty").mkdir()
    proc = cli("check", str(hard), str(tmp_path / "empty"))
    assert proc.returncode == 2 and "no such file" in proc.stderr and "Traceback" not in proc.stderr


def test_mismatch_exits_1_with_json(good, tmp_path):
    case_path, path = good
    with h5py.File(path, "a") as h5:
        h5["float64/global/y"][0, 1, 5, 3, 4] += 1.0
    proc = cli("check", case_path, str(path), "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 1 and "FAIL" in proc.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    bad = [f for c in report["cases"] for f in c["findings"] if not f["ok"]]
    assert len(bad) == 1 and bad[0]["first_index"] == [0, 1, 5, 3, 4] and bad[0]["mismatches"] == 1
    assert bad[0]["owner"] == 2          # grid (1,2,2,1): D 5 of 8 outputs is in block 1, H 3 of 7 in block 0: rank 1*2 + 0


@pytest.mark.parametrize("suite, message", [
    ('[[case]]\nname = "a"\nlayer = "conv3d"\ninput = [1, 2, 5, 5, 5]\ngrids = [[1, 2, 1, 1]]\nkernal = 3\n',
     "unknown key(s) ['kernal']"),
    ('[[case]]\nname = "a"\nlayer = "conv4d"\ninput = [1, 2, 5, 5, 5]\ngrids = [[1, 2, 1, 1]]\n', "conv4d"),
    ('[[case]]\nname = "a"\nlayer = "max_pool3d"\ninput = [1, 2, 5, 5, 5]\nkernel = 2\npadding = 2\n'
     'grids = [[1, 2, 1, 1]]\n', "at most half the kernel"),
    ('[[case]]\nname = "a"\nlayer = "conv3d"\ninput = [1, 2, 5, 5, 5]\ngrids = [[2, 1, 1, 1]]\n',
     "every data-parallel rank needs at least one sample"),
    ('[[case]]\nname = "a b"\nlayer = "conv3d"\ninput = [1, 2, 5, 5, 5]\ngrids = [[1, 1, 1, 1]]\n', "name must be"),
    ('not toml [', "not valid TOML"),
])
def test_bad_suites(tmp_path, suite, message):
    (tmp_path / "s.toml").write_text(suite)
    proc = cli("generate", str(tmp_path / "s.toml"), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_bad_flags(hard, tmp_path):
    proc = cli("run-torch", case_file(hard, "conv_even_kernel.1-2-2-1"), "--out", str(tmp_path), "--plant", "halo:9")
    assert proc.returncode == 2 and "ranks 0..3" in proc.stderr
    proc = cli("run-torch", str(hard), "--out", str(tmp_path), "--plant", "typo")
    assert proc.returncode == 2 and "--plant must be one of" in proc.stderr
    proc = cli("check", str(hard), str(hard), "--tolerance-factor", "0.5")
    assert proc.returncode == 2 and "--tolerance-factor must be >= 1" in proc.stderr
    proc = cli("generate", "hard", "--out", str(tmp_path), "--case", "nope")
    assert proc.returncode == 2 and "not in suite hard" in proc.stderr
    env = dict(ENV, OMPI_COMM_WORLD_SIZE="2")
    proc = subprocess.run([sys.executable, "-m", "refimpl", "oracle", "generate", "hard", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and "without mpiexec" in proc.stderr


def test_python_api_minimal_writer(hard, tmp_path):
    """The docs' minimal writer: h5py only, global arrays from 'your' code (refimpl here)."""
    from refimpl import functional as F
    path = case_file(hard, "conv_stride_uneven.1-3-1-2")
    with h5py.File(path, "r") as case_h5:
        digest = case_h5.attrs["digest"]
        x, w, b, dy = (case_h5[f"float64/inputs/{k}"][()] for k in ("x", "w", "b", "dy"))
        args = json.loads(case_h5.attrs["case"])
    y = F.conv3d(x, w, b, args["stride"], args["padding"], args["dilation"])
    dx, dw, db = F.conv3d_backward(dy, x, w, args["stride"], args["padding"], args["dilation"])
    with h5py.File(tmp_path / "mine.h5", "w") as out:
        out.attrs["case_digest"] = digest
        for name, array in dict(y=y, dx=dx, dw=dw, db=db).items():
            out[f"float64/global/{name}"] = array
    case = load_case(path)
    report = compare(case, load_results(str(tmp_path / "mine.h5"), case))
    assert report.ok and {f.tensor for f in report.findings} == {"y", "dx", "dw", "db"}


def test_write_case_is_deterministic(tmp_path):
    spec = load_suite("hard")[0]
    a = load_case(write_case(spec, str(tmp_path / "a") if os.makedirs(tmp_path / "a") is None else ""))
    b = load_case(write_case(spec, str(tmp_path / "b") if os.makedirs(tmp_path / "b") is None else ""))
    assert a.digest == b.digest
    for dtype in spec.dtypes:
        for k in a.expected[dtype]:
            np.testing.assert_array_equal(a.expected[dtype][k], b.expected[dtype][k])
    with pytest.raises(UnusableInput, match="no such file"):
        load_case(str(tmp_path / "missing.h5"))


def test_only_the_adapter_imports_torch():
    """refimpl's math never calls PyTorch: the torch imports in refimpl/ are the peers under test
    (the run-torch adapters of layer cases and traces, the models' PyTorch twins, and DTensor's
    runners for run-dtensor), and importing the oracle does not load torch."""
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent / "refimpl"
    importers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                       if "import torch" in p.read_text() or "from torch" in p.read_text())
    assert importers == ["oracle/dtensor_runner.py", "oracle/dtensor_trace_runner.py", "oracle/model_twins.py",
                         "oracle/torch_adapter.py", "oracle/trace_torch.py"]
    code = ("import sys, refimpl.oracle, refimpl.commands.oracle, refimpl.oracle.trace_check, "
            "refimpl.oracle.trace_torch, refimpl.oracle.model_twins, refimpl.oracle.dtensor_trace_runner; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV).stdout.strip()
    assert out == "False"


def test_dataset_where_a_group_belongs(good):
    def spoil(h5):
        del h5["float64/global"]
        h5["float64/global"] = np.ones(3)
    assert "/float64/global must be a group of datasets" in spoil_and_check(good, spoil)


# ---------------------------------------------------------------- a kind added by a test

class ChannelAffineKind(layers.LayerKind):
    """y = w_c * x + b_c: what the oracle needs of a pointwise kind with parameters (its
    reference, parameters, tolerances and PyTorch twin); the base class supplies the rest."""

    name = "channel_affine"
    model_modes = ("none", "channel")

    def parameter_shapes(self, spec):
        return (spec.input[1],), (spec.input[1],)

    def draw_parameters(self, rng, spec):
        return {"w": rng.uniform(0.5, 1.5, spec.input[1]), "b": rng.standard_normal(spec.input[1])}

    def forward(self, spec, x, w, b):
        return x * w.reshape(1, -1, 1, 1, 1) + b.reshape(1, -1, 1, 1, 1), (x, w)

    def backward(self, spec, dy, saved):
        x, w = saved
        return dy * w.reshape(1, -1, 1, 1, 1), (dy * x).sum(axis=(0, 2, 3, 4)), dy.sum(axis=(0, 2, 3, 4))

    def reduction_length(self, spec, tensor, out_shape):
        if tensor.startswith(("dw", "db")):
            return int(np.prod(out_shape)) // out_shape[1], "N·D·H·W terms per channel"
        return 1, "one product per element"

    def torch_forward(self, spec, tf, x, w, b):
        return x * w.reshape(1, -1, 1, 1, 1) + b.reshape(1, -1, 1, 1, 1)


def test_a_kind_added_by_a_test_gets_cases_checks_and_diagnoses(monkeypatch, tmp_path):
    """Registered in the test, the kind runs through generate, run-torch and check, split over
    space and channels, and a missing reduction of dw is diagnosed as for the built-in kinds."""
    monkeypatch.setitem(layers.REGISTRY, ChannelAffineKind.name, ChannelAffineKind())
    spec, = parse_suite({"case": [{"name": "affine", "layer": "channel_affine", "input": [2, 3, 5, 4, 3],
                                   "model_parallel": "channel", "grids": [[1, 2, 1, 1, 3]]}]}, "t")
    case = load_case(write_case(spec, str(tmp_path)))
    assert {"x_needed", "dx_needed", "dw_partial"} <= set(case.ranks["float64"][0])
    for plant in (None, "dw-unsummed"):
        glob, ranks = torch_adapter.run_case(case, torch_adapter.parse_plant(plant, case), "gathered")
        path = str(tmp_path / f"{plant}.h5")
        write_results(path, case, glob, ranks)
        report = compare(case, load_results(path, case))
        assert report.ok == (plant is None), [f.as_dict() for f in report.findings if not f.ok][:2]
    dws = failing(report, tensor="dw")
    assert dws and all("not summed over the spatial shards" in f.diagnosis for f in dws)
