"""The oracle checks results in any block layout (an ``offset`` per block: torch.chunk's split,
empty blocks, parameters given once), partial results (some tensors, some cases), and judges
NaN/inf and wrong shapes as located mismatches; a file that cannot be checked marks only its
own case unusable."""
import dataclasses
import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

from refimpl.oracle import compare, load_case, load_results, parse_suite, write_case, write_results
from refimpl.oracle.suite import load_suite
from refimpl.oracle.compare import _window_range, root_cause

torch = pytest.importorskip("torch", reason="PyTorch absent: pip install 'refimpl[oracle]'")
from refimpl.oracle import torch_adapter  # noqa: E402

ENV = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_WORLD", "PMI_"))}

SUITE = {"case": [
    {"name": "conv", "layer": "conv3d", "input": [2, 3, 4, 3, 6], "out_channels": 4, "kernel": 3, "padding": 1,
     "grids": [[1, 1, 1, 4]]},
    {"name": "pool", "layer": "max_pool3d", "input": [1, 2, 3, 3, 6], "kernel": 3, "stride": 1, "padding": 1,
     "grids": [[1, 1, 1, 4]], "dtypes": ["float64"]},
]}


def cli(*args):
    return subprocess.run([sys.executable, "-m", "refimpl", "oracle", *args], capture_output=True, text=True,
                          env=ENV, timeout=300)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    out = tmp_path_factory.mktemp("cases")
    return {spec.name: write_case(spec, str(out)) for spec in parse_suite(SUITE, "t")}


def chunk(n, p, i):
    """torch.chunk's block i of extent n over p: ceil(n/p) each, the last ones short or empty."""
    c = -(-n // p)
    return min(i * c, n), min((i + 1) * c, n)


def chunk_case(case):
    """The case with torch.chunk's split of W (6 over 4 ranks: 2, 2, 2, 0) in place of refimpl's."""
    spec = case.spec
    wo = case.expected[spec.dtypes[0]]["y"].shape[4]
    layouts = []
    for lo in case.layouts:
        w = lo.coords[3]
        outputs = lo.outputs[:2] + (chunk(wo, 4, w),)
        owned = lo.owned[:2] + (chunk(spec.input[4], 4, w),)
        needed = tuple(_window_range(case, a, *outputs[a]) for a in range(3))
        layouts.append(dataclasses.replace(lo, outputs=outputs, owned=owned, needed=needed))
    return dataclasses.replace(case, layouts=layouts)


def chunk_results(case, plant=None, names=None, root_params=True):
    """PyTorch's per-rank run (the run-torch adapter) in torch.chunk's split, every block with its
    ``offset``; dw and db on rank 0 only (a root-only-parameters design)."""
    split = chunk_case(case)
    ranks = {}
    for dtype in case.spec.dtypes:
        run = torch_adapter.run_ranks(split, dtype, torch, torch_adapter.parse_plant(plant, split))
        ranks[dtype] = {}
        for lo in split.layouts:
            where = {"y": "y", "dx": "x", "x_needed": "needed", "dx_needed": "needed"}
            out = {}
            for name, array in run[lo.rank].items():
                if names is not None and name not in names:
                    continue
                if name in ("dw", "db") and root_params and lo.rank != 0:
                    continue
                if name in where:
                    out[name] = (array, [s.start for s in lo.index(where[name])])
                else:
                    out[name] = array
            ranks[dtype][lo.rank] = out
    return split, ranks


def written(tmp_path, case, ranks, glob=None, name=None):
    path = str(tmp_path / (name or os.path.basename(case.path)))
    write_results(path, case, glob, ranks)
    return path


def fails(report, tensor=None, dtype="float64"):
    return [f for f in report.findings if not f.ok and f.dtype == dtype and (tensor is None or f.tensor == tensor)]


# ---------------------------------------------------------------- any block layout

def test_torch_chunk_split_with_root_only_parameters_passes(cases, tmp_path):
    case = load_case(cases["conv"])
    split, ranks = chunk_results(case)
    assert [lo.outputs[2] for lo in split.layouts] == [(0, 2), (2, 4), (4, 6), (6, 6)]   # 2, 2, 2, 0
    assert [lo.outputs[2] for lo in case.layouts] == [(0, 2), (2, 4), (4, 5), (5, 6)]    # refimpl's: 2, 2, 1, 1
    report = compare(case, load_results(written(tmp_path, case, ranks), case))
    assert report.ok, [f.as_dict() for f in report.findings if not f.ok][:3]
    assert report.layout == "results" and "grid [1, 1, 1, 4]" in report.layout_note
    assert not report.not_provided and not report.unchecked
    checked = {(f.dtype, f.tensor, f.rank) for f in report.findings}
    assert ("float64", "dw", 0) in checked and ("float64", "dw", 1) not in checked
    for tensor in ("y", "dx", "x_needed", "dx_needed", "dw_partial"):
        assert {r for d, t, r in checked if d == "float64" and t == tensor} == {0, 1, 2, 3}
    empty = [f for f in report.findings if f.rank == 3 and f.tensor == "y"]
    assert empty and all(f.shape[4] == 0 and f.offset[4] == 6 for f in empty)
    # the same through the CLI, with the note on the layout
    proc = cli("check", cases["conv"], written(tmp_path, case, ranks))
    assert proc.returncode == 0 and "PASS" in proc.stdout and "results' own" in proc.stdout, proc.stdout


def test_planted_halo_bug_is_located_in_the_results_layout(cases, tmp_path):
    case = load_case(cases["conv"])
    split, ranks = chunk_results(case, plant="halo:2")
    report = compare(case, load_results(written(tmp_path, case, ranks), case))
    assert not report.ok
    xn, = fails(report, "x_needed")
    assert xn.rank == 2 and xn.first_index[4] == 3 and xn.owner == 1        # W 3: rank 1's ([2, 4)) in the chunk split
    assert "rank 2's ghost cells are wrong" in xn.diagnosis and "rank 1)" in xn.diagnosis
    ys = fails(report, "y")
    assert {f.rank for f in ys} == {2}
    y, = ys
    assert y.offset[4] == 4 and y.shape[4] == 2 and y.first_index[4] == 4 and y.owner == 2
    assert "forward halo exchange" in y.diagnosis and "rank 2" in y.diagnosis
    cause = root_cause(report)
    assert cause.tensor == "x_needed" and cause.rank == 2
    # corrupt the last cell of rank 2's block (W 5: rank 3's in refimpl's split): rank 2 owns it here
    split, ranks = chunk_results(case, names=("y",))
    ranks["float64"][2]["y"][0][0, 1, 2, 1, 1] += 1.0
    report = compare(case, load_results(written(tmp_path, case, ranks), case))
    f, = fails(report)
    assert f.rank == 2 and f.first_index == (0, 1, 2, 1, 5) and f.owner == 2 and f.mismatches == 1
    assert "halo" not in (f.diagnosis or "")        # no x_needed in these results: no halo claim


def test_blocks_without_offset_keep_the_case_layout(cases, tmp_path):
    """Today's results (no offset attributes) are placed by the case's split, as before."""
    case = load_case(cases["conv"])
    glob, ranks = torch_adapter.run_case(case)
    report = compare(case, load_results(written(tmp_path, case, ranks, glob), case))
    assert report.ok and report.layout == "case" and report.layout_note is None


# ---------------------------------------------------------------- partial results

def test_forward_only_results(cases, tmp_path):
    case = load_case(cases["conv"])
    _, ranks = chunk_results(case, names=("y",))
    path = written(tmp_path, case, ranks)
    report = compare(case, load_results(path, case))
    assert report.ok and {f.tensor for f in report.findings} == {"y"}
    assert {(g["dtype"], g["tensor"]) for g in report.not_provided} == {
        (d, t) for d in ("float64", "float32") for t in ("dx", "dw", "db")}
    proc = cli("check", cases["conv"], path, "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 0 and "not provided: float64 dx, dw, db" in proc.stdout, proc.stdout
    entry, = json.loads((tmp_path / "r.json").read_text())["cases"]
    assert entry["status"] == "pass" and {f["status"] for f in entry["findings"]} == {"pass"}
    assert cli("check", cases["conv"], path, "--require", "forward").returncode == 0
    proc = cli("check", cases["conv"], path, "--require", "all")
    assert proc.returncode == 1 and "missing (--require): float64 dx, dw, db" in proc.stdout, proc.stdout
    proc = cli("check", cases["conv"], path, "--require", "bogus")
    assert proc.returncode == 2 and "--require must be" in proc.stderr
    # y wrong on rank 1: a located failure; y and dx without dw: not provided, not failed
    _, ranks = chunk_results(case, names=("y", "dx"))
    ranks["float32"][1]["y"][0][1, 3, 0, 0, 0] = 7.0
    report = compare(case, load_results(written(tmp_path, case, ranks), case))
    f, = fails(report, dtype="float32")
    assert (f.tensor, f.rank, f.first_index) == ("y", 1, (1, 3, 0, 0, 2))
    assert {g["tensor"] for g in report.not_provided} == {"dw", "db"}


def test_a_rank_subset_covers_part_of_a_tensor(cases, tmp_path):
    """A peer that runs on fewer ranks on purpose (--allow-missing-ranks): the blocks it gives
    are judged, the rest of the tensor is not provided."""
    case = load_case(cases["conv"])
    _, ranks = chunk_results(case, names=("y",))
    for dtype in ranks:
        del ranks[dtype][0]
    report = compare(case, load_results(written(tmp_path, case, ranks), case), allow_missing_ranks=True)
    assert report.ok
    y64, = [g for g in report.not_provided if g["tensor"] == "y" and g["dtype"] == "float64"]
    total = int(np.prod(case.expected["float64"]["y"].shape))
    assert y64["total"] == total and y64["covered"] == total * 4 // 6


THREE = ("conv_even_kernel.1-2-2-1.h5", "maxpool_overlap_ties.1-3-1-2.h5", "batchnorm_global.2-2-1-1.h5")


def test_three_of_the_hard_cases(hard, tmp_path):
    some = tmp_path / "some"
    for name in THREE:
        case = load_case(str(hard / name))
        glob, ranks = torch_adapter.run_case(case)
        write_results(str(some / name), case, glob, ranks)
    proc = cli("check", str(hard), str(some), "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    status = {c["case"]: c["status"] for c in report["cases"]}
    total = len(load_suite("hard"))
    assert len(status) == total and {k for k, v in status.items() if v == "pass"} == set(THREE)
    assert set(status.values()) == {"pass", "not run"} and report["summary"]["not run"] == total - 3
    assert f"{total} cases: 3 passed, 0 failed, {total - 3} not run" in proc.stdout
    not_run, = [line for line in proc.stdout.splitlines() if line.startswith("NOT RUN")]
    assert "conv_wide_halo.1-4-1-1.h5" in not_run and THREE[0] not in not_run
    # --require: the cases not run count as missing
    proc = cli("check", str(hard), str(some), "--require", "forward")
    assert proc.returncode == 1 and f"{total - 3} failed" in proc.stdout
    # one spoilt file: its own case unusable (exit 2), the others still judged
    path = some / THREE[0]
    path.write_bytes(path.read_bytes()[:5000])
    with h5py.File(some / THREE[1], "a") as h5:
        h5["float64/rank/1/y"][0, 0, 0, 0, 0] += 1.0
    proc = cli("check", str(hard), str(some), "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"UNUSABLE {THREE[0]}" in proc.stdout and f"FAIL {THREE[1]}" in proc.stdout
    assert f"PASS {THREE[2]}" in proc.stdout and "truncated or corrupt" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    status = {c["case"]: c["status"] for c in json.loads((tmp_path / "r.json").read_text())["cases"]}
    assert [status[n] for n in THREE] == ["unusable", "fail", "pass"]


# ---------------------------------------------------------------- NaN, -inf and wrong shapes are mismatches

def test_minus_inf_in_a_ghost_cell_is_a_located_mismatch(cases, tmp_path):
    """A ghost cell left at -inf (max pooling's padding value) is what a broken halo leaves."""
    case = load_case(cases["pool"])
    glob, ranks = torch_adapter.run_case(case, global_mode="gathered")
    lo = case.layouts[1]                     # W outputs [2, 4), needs [1, 5): W 1 is a ghost from rank 0
    assert lo.needed[2][0] < lo.owned[2][0]
    ranks["float64"][1]["x_needed"][0, 1, 2, 0, 0] = -np.inf
    ranks["float64"][1]["y"][0, 1, 2, 0, 0] = np.nan
    path = written(tmp_path, case, ranks, glob)
    report = compare(case, load_results(path, case))
    xn, = fails(report, "x_needed")
    assert xn.rank == 1 and xn.first_index == (0, 1, 2, 0, 1) and xn.owner == 0 and xn.nonfinite == 1
    assert "-inf" in xn.diagnosis and "ghost cells are wrong" in xn.diagnosis
    y, = fails(report, "y")
    assert y.rank == 1 and y.first_index == (0, 1, 2, 0, 2) and y.nonfinite == 1 and "NaN" in y.diagnosis
    proc = cli("check", cases["pool"], path, "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    json.loads((tmp_path / "r.json").read_text(), parse_constant=pytest.fail)    # strict JSON: no NaN


def test_wrong_shaped_y_is_a_finding_about_the_output_size(cases, tmp_path):
    case = load_case(cases["conv"])
    _, ranks = chunk_results(case, names=("y", "dx"))
    y, offset = ranks["float64"][2]["y"]
    ranks["float64"][2]["y"] = (np.concatenate([y, y[..., :1]], axis=4), offset)    # 3 outputs at W 4; 2 exist
    path = written(tmp_path, case, ranks)
    report = compare(case, load_results(path, case))
    f, = fails(report)          # its 2 in-range outputs are right: the excess is the one finding
    assert f.problem == "excess" and f.rank == 2 and f.tensor == "y" and f.first_index is None
    assert "rank 2's y has 3 outputs along W from offset 4; the layer has 6 (so 1 past its end)" in f.message
    assert [g.ok for g in report.findings if (g.dtype, g.tensor, g.rank, g.problem) == ("float64", "y", 2, None)] == [True]
    proc = cli("check", cases["conv"], path)
    assert proc.returncode == 1 and "has 3 outputs along W from offset 4" in proc.stdout, proc.stdout
    # x_needed with padding cells left in: cut off
    _, ranks = chunk_results(case, names=("x_needed",))
    xn, offset = ranks["float64"][0]["x_needed"]
    ranks["float64"][0]["x_needed"] = (np.pad(xn, [(0, 0)] * 4 + [(1, 0)]), list(offset[:4]) + [-1])
    report = compare(case, load_results(written(tmp_path, case, ranks), case))
    f, = fails(report)
    assert f.problem == "shape" and f.rank == 0 and "cut them off" in f.message
    assert "x_needed has 4 inputs along W at offset -1, 1 of them before the domain [0, 6)" in f.message


HARD_KINDS = ("conv_channel_parallel.1-1-2-1-2.h5", "convT_anisotropic.2-1-1-3.h5", "batchnorm_global.2-2-1-1.h5",
              "maxpool_overlap_ties.1-3-1-2.h5", "conv_empty_blocks.1-8-1-1.h5")


def test_own_layout_expectations_equal_the_cases(hard, tmp_path, monkeypatch):
    """The expectations derived from where a results' blocks lie (the path taken for another
    split) are the case's own where the blocks are the case's: for every kind of layer, model
    parallel ones and empty blocks included; and a planted halo bug is found by both paths."""
    from refimpl.oracle import casefile
    for name in HARD_KINDS:
        case = load_case(str(hard / name))
        for plant in (None, "halo:1"):
            glob, ranks = torch_adapter.run_case(case, torch_adapter.parse_plant(plant, case), "gathered")
            path = written(tmp_path, case, ranks, glob)
            want = compare(case, load_results(path, case))
            with monkeypatch.context() as m:
                m.setattr(casefile.Results, "own_layout", lambda self, case, dtype: True)
                got = compare(case, load_results(path, case))
            assert got.layout == "results" and not got.unchecked
            assert got.ok == want.ok and (want.ok or plant), name
            assert [(f.dtype, f.tensor, f.rank, f.ok, f.first_index) for f in got.findings] == \
                [(f.dtype, f.tensor, f.rank, f.ok, f.first_index) for f in want.findings], name
            if not want.ok:
                cause, expected = root_cause(got), root_cause(want)
                assert (cause.tensor, cause.rank) == (expected.tensor, expected.rank), name


def test_wrong_shaped_global_tensors(cases, tmp_path):
    """A global y one output too long and a dw of the wrong rank: mismatches with the rule
    that fixes the size, exit 1; the other tensors are still judged."""
    case = load_case(cases["conv"])
    glob = {"float64": dict(case.expected["float64"])}
    y = glob["float64"]["y"]
    glob["float64"]["y"] = np.concatenate([y, y[..., :1]], axis=4)
    glob["float64"]["dw"] = glob["float64"]["dw"][0]
    path = written(tmp_path, case, None, glob)
    report = compare(case, load_results(path, case))
    bad = {f.tensor: f for f in fails(report)}
    assert set(bad) == {"y", "dw"} and all(f.problem == "shape" and f.rank is None for f in bad.values())
    assert "the global y has 7 outputs along W; the layer has 6 (the output-size rule" in bad["y"].message
    assert bad["y"].first_index == (0, 0, 0, 0, 6)
    assert "the global dw has 4 dimensions" in bad["dw"].message
    assert {f.tensor for f in report.findings if f.ok} == {"dx", "db"}
    proc = cli("check", cases["conv"], path)
    assert proc.returncode == 1 and "wrong shape [2, 4, 4, 3, 7]" in proc.stdout, proc.stdout + proc.stderr
