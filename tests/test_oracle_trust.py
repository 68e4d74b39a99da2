"""The oracle never passes a wrong answer: every cell a peer provides is judged, a gap
between the blocks is a finding, a block past the tensor's end is compared on its in-range
cells (its excess reported) without silencing the other ranks' diagnoses, a rank that left
its tensors out makes the case incomplete, and diagnoses stay within what the layer kind
and the case can produce (issue 38, part A)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from refimpl import layers
from refimpl.oracle.compare import root_cause
from refimpl.oracle import compare, load_case, load_results, parse_suite, write_case, write_results

ENV = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_WORLD", "PMI_"))}

SUITE = {"case": [
    {"name": "pool", "layer": "max_pool3d", "input": [1, 2, 4, 4, 8], "kernel": 2, "stride": 2,
     "grids": [[1, 1, 1, 2]], "dtypes": ["float64"]},
    {"name": "conv", "layer": "conv3d", "input": [1, 2, 4, 4, 10], "out_channels": 3, "kernel": 3, "padding": 1,
     "grids": [[1, 1, 1, 3]], "dtypes": ["float64"]},
    {"name": "k2s2", "layer": "conv3d", "input": [1, 2, 4, 4, 8], "out_channels": 3, "kernel": 2, "stride": 2,
     "grids": [[1, 1, 1, 2]], "dtypes": ["float64"]},
]}


def cli(*args):
    return subprocess.run([sys.executable, "-m", "refimpl", "oracle", *args], capture_output=True, text=True,
                          env=ENV, timeout=300)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    out = tmp_path_factory.mktemp("trust_cases")
    return {spec.name: write_case(spec, str(out)) for spec in parse_suite(SUITE, "t")}


def case_blocks(case, names, dtype="float64"):
    """{rank: {name: array}}: the case's own expected blocks (an exact peer)."""
    return {r: {n: arrays[n][0].copy() for n in names if n in arrays} for r, arrays in enumerate(case.ranks[dtype])}


def written(tmp_path, case, ranks, name="results.h5"):
    path = str(tmp_path / name)
    write_results(path, case, None, {"float64": ranks})
    return path


def fails(report, tensor=None):
    return [f for f in report.findings if not f.ok and (tensor is None or f.tensor == tensor)]


# ---------------------------------------------------------------- A.1: cells no block covers

def test_a_missing_output_window_is_a_finding_not_a_pass(cases, tmp_path):
    """A forward-only max-pool result from which rank 1 left its last output window out: the
    union of the blocks misses cells, and that fails, located at the first missing cell."""
    case = load_case(cases["pool"])
    ranks = case_blocks(case, ("y",))
    y1, (offset) = ranks[1]["y"], case.ranks["float64"][1]["y"][1]
    ranks[1]["y"] = (y1[..., :-1], offset)                   # W [2, 4) -> [2, 3): window W 3 never computed
    report = compare(case, load_results(written(tmp_path, case, ranks), case))
    assert not report.ok and report.status == "fail"
    hole, = [f for f in report.findings if f.problem == "uncovered"]
    assert hole.tensor == "y" and hole.first_index == (0, 0, 0, 0, 3) and hole.mismatches == 2 * 2 * 2
    assert "output cells no rank holds" in hole.message
    assert not [g for g in report.not_provided if g["tensor"] == "y"]
    proc = cli("check", cases["pool"], written(tmp_path, case, ranks))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "output cells no rank holds" in proc.stdout and "[0, 0, 0, 0, 3]" in proc.stdout, proc.stdout
    # the same blocks with rank 1 absent: not a gap between blocks, a rank that is missing
    del ranks[1]
    report = compare(case, load_results(written(tmp_path, case, ranks, "r2.h5"), case))
    assert report.status == "incomplete" and report.incomplete == [{"dtype": "float64", "tensor": "y", "ranks": [1]}]


def test_a_complete_exact_result_passes(cases, tmp_path):
    for name in cases:
        case = load_case(cases[name])
        ranks = case_blocks(case, ("y", "dx", "dw", "db"))
        report = compare(case, load_results(written(tmp_path, case, ranks, f"{name}.h5"), case))
        assert report.ok and report.status == "pass" and not report.not_provided, name


# ---------------------------------------------------------------- A.2: a block past the tensor's end

def test_a_block_one_cell_too_long_is_compared_and_its_excess_reported(cases, tmp_path):
    """Rank 2's y one output too long (an honest block of an off-by-one output rule): its
    in-range cells are compared, the excess is its own finding, and rank 1's planted halo bug
    keeps exactly the diagnosis it has without the long block."""
    torch = pytest.importorskip("torch")
    from refimpl.oracle import torch_adapter
    case = load_case(cases["conv"])
    _, ranks = torch_adapter.run_case(case, torch_adapter.parse_plant("halo:1", case))
    plain = compare(case, load_results(written(tmp_path, case, ranks["float64"], "plain.h5"), case))
    y2 = ranks["float64"][2]["y"]
    offset = case.ranks["float64"][2]["y"][1]
    ranks["float64"][2]["y"] = (np.concatenate([y2, y2[..., -1:]], axis=4), offset)
    long = compare(case, load_results(written(tmp_path, case, ranks["float64"], "long.h5"), case))
    excess, = [f for f in long.findings if f.problem == "excess"]
    assert excess.rank == 2 and excess.tensor == "y" and excess.first_index is None
    assert excess.message.startswith(f"rank 2's y has 4 outputs along W from offset {offset[4]}; the layer has 10")
    assert "ceil_mode" not in excess.diagnosis                       # a conv has no ceil_mode
    inrange = [f for f in long.findings if f.rank == 2 and f.tensor == "y" and f.problem is None]
    assert [f.ok for f in inrange] == [True] and inrange[0].shape[4] == 3
    assert long.layout == "case"                                     # cut back, the block is the case's

    def diagnoses(report):
        return {(f.tensor, f.rank): (f.first_index, f.diagnosis) for f in report.findings
                if not f.ok and f.problem is None}
    assert diagnoses(plain) and diagnoses(long) == diagnoses(plain)
    assert root_cause(long).diagnosis == root_cause(plain).diagnosis
    assert "halo" in root_cause(long).diagnosis and root_cause(long).rank == 1
    proc = cli("check", cases["conv"], written(tmp_path, case, ranks["float64"], "long.h5"))
    assert proc.returncode == 1 and "block past the end: rank 2's y has 4 outputs" in proc.stdout, proc.stdout


def test_overlapping_blocks_are_each_judged(cases, tmp_path):
    """Two ranks giving the same cells: both judged against the same expectation, so they
    must agree; a wrong copy fails at its own rank."""
    case = load_case(cases["pool"])
    ranks = case_blocks(case, ("y",))
    whole = case.expected["float64"]["y"]
    ranks[0]["y"] = (whole.copy(), (0, 0, 0, 0, 0))                   # rank 0 holds everything
    ranks[1]["y"][0, 0, 0, 0, 0] += 1.0                                # rank 1's copy of W 2 is wrong
    report = compare(case, load_results(written(tmp_path, case, ranks), case))
    bad, = fails(report)
    assert bad.rank == 1 and bad.first_index == (0, 0, 0, 0, 2)
    assert report.first_wrong == [{"dtype": "float64", "tensor": "y", "index": [0, 0, 0, 0, 2], "ranks": [1]}]


# ---------------------------------------------------------------- A.6: a crashed rank

def test_a_rank_left_out_makes_the_case_incomplete(cases, tmp_path):
    case = load_case(cases["conv"])
    ranks = case_blocks(case, ("y", "dx", "dw", "db"))
    del ranks[1]                                                       # rank 1 crashed: nothing written
    path = written(tmp_path, case, ranks)
    proc = cli("check", cases["conv"], path, "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "INCOMPLETE" in proc.stdout and "rank 1 lacks y, dx (float64)" in proc.stdout and "1 incomplete" in proc.stdout
    report = json.loads((tmp_path / "r.json").read_text())["cases"][0]
    assert report["status"] == "incomplete" and {g["tensor"] for g in report["incomplete"]} == {"y", "dx"}
    proc = cli("check", cases["conv"], path, "--allow-missing-ranks")
    assert proc.returncode == 0 and "PASS" in proc.stdout, proc.stdout
    # one tensor left out on one rank only (dx of rank 2), the rest there
    ranks = case_blocks(case, ("y", "dx"))
    del ranks[2]["dx"]
    report = compare(case, load_results(written(tmp_path, case, ranks, "r3.h5"), case))
    assert report.status == "incomplete" and report.incomplete == [{"dtype": "float64", "tensor": "dx", "ranks": [2]}]


def test_parameter_gradients_given_once_are_not_incomplete(cases, tmp_path):
    case = load_case(cases["conv"])
    ranks = case_blocks(case, ("y", "dx", "dw", "db"))
    for r in (1, 2):
        del ranks[r]["dw"], ranks[r]["db"]
    report = compare(case, load_results(written(tmp_path, case, ranks), case))
    assert report.ok and not report.incomplete


# ---------------------------------------------------------------- A.4: diagnoses the kind and the case can produce

def test_no_ceil_mode_rule_for_a_conv():
    spec, = parse_suite({"case": [{"name": "c", "layer": "conv3d", "input": [1, 1, 5, 5, 5], "out_channels": 1,
                                   "kernel": 2, "stride": 2, "grids": [[1, 1, 1, 1]]}]}, "t")
    assert not any("ceil" in what for a in range(3) for what, _ in layers.lookup("conv3d").output_size_rules(spec, a))
    pool, = parse_suite({"case": [{"name": "p", "layer": "max_pool3d", "input": [1, 1, 5, 5, 5], "kernel": 2,
                                   "stride": 2, "grids": [[1, 1, 1, 1]]}]}, "t")
    assert any("ceil_mode" in what for what, _ in layers.lookup("max_pool3d").output_size_rules(pool, 2))


@pytest.mark.parametrize("tensor", ["y", "dx"])
def test_no_halo_diagnosis_where_the_case_has_no_halo(cases, tmp_path, tensor):
    """A k2 s2 conv on an even split reads no ghost cell: whatever is wrong in one rank's
    block, no forward or adjoint halo exchange is named."""
    case = load_case(cases["k2s2"])
    for lo in case.layouts:
        assert lo.needed == lo.owned
    ranks = case_blocks(case, ("y", "dx"))
    block = ranks[1][tensor]
    block[..., 0] *= 1.5                    # the first plane of rank 1's block: where a halo bug would sit
    block[..., 0] += 0.25
    report = compare(case, load_results(written(tmp_path, case, ranks), case))
    bad, = fails(report)
    assert bad.rank == 1 and "halo" not in (bad.diagnosis or "") and "adjoint" not in (bad.diagnosis or "")


# ---------------------------------------------------------------- A.5/A.8: exact reports

def test_inf_is_counted_in_max_rel_and_described(cases, tmp_path):
    case = load_case(cases["pool"])
    ranks = case_blocks(case, ("y",))
    ranks[0]["y"][0, 0, 0, 0, 0] = -np.inf
    report = compare(case, load_results(written(tmp_path, case, ranks), case))
    bad, = fails(report)
    assert bad.max_rel == float("inf") and bad.nonfinite == 1 and bad.finite_max_rel == 0.0
    assert "-inf" in bad.diagnosis
    assert bad.as_dict()["max_rel"] == "inf"
    json.dumps(report.as_dict(), allow_nan=False)                      # strict JSON


def test_singular_and_plural_in_the_summary(cases, tmp_path):
    case = load_case(cases["pool"])
    proc = cli("check", cases["pool"], written(tmp_path, case, case_blocks(case, ("y",))))
    assert proc.returncode == 0 and "1 case: 1 passed, 0 failed" in proc.stdout, proc.stdout


# ---------------------------------------------------------------- A.5: y-only results in a peer's own layout

def test_y_only_results_in_a_chunk_layout_get_the_halo_diagnosis(tmp_path):
    """torch.chunk's split (W 6 over 4: 2, 2, 2, 0) with y alone: the input split is inferred
    by the same rule, so rank 2's planted halo bug is diagnosed as with dx given, hedged
    (no x_needed: the halo is a possibility)."""
    pytest.importorskip("torch")
    sys.path.insert(0, os.path.dirname(__file__))
    from test_oracle_layouts import SUITE as LAYOUT_SUITE, chunk_results
    spec = [s for s in parse_suite(LAYOUT_SUITE, "t") if s.name == "conv"][0]
    case = load_case(write_case(spec, str(tmp_path)))
    _, with_dx = chunk_results(case, plant="halo:2", names=("y", "dx"))
    _, y_only = chunk_results(case, plant="halo:2", names=("y",))
    reports = [compare(case, load_results(str(tmp_path / name), case))
               for name, ranks in (("a.h5", with_dx), ("b.h5", y_only)) if not write_results(str(tmp_path / name),
                                                                                           case, None, ranks)]
    diagnosis = [[f.diagnosis for f in fails(r, "y") if f.dtype == "float64"] for r in reports]
    assert diagnosis[0] == diagnosis[1] and diagnosis[1][0] and "halo" in diagnosis[1][0], diagnosis
    assert not [u for u in reports[1].unchecked if u["tensor"] == "y"]


# ---------------------------------------------------------------- A.5: one plant, four layouts, one diagnosis

def chunk_case(case):
    """The case with torch.chunk's split of every split axis (inputs and outputs) in place of
    refimpl's balanced blocks."""
    import dataclasses
    from refimpl.oracle import expect
    from refimpl.oracle.compare import _window_range
    from refimpl.parallel.partition import ceil_block_range
    dims, out = expect.grid5(case.spec.grid), expect.output_shape(case.spec)[2:]
    layouts = []
    for lo in case.layouts:
        outputs = tuple(ceil_block_range(out[a], dims[1 + a], lo.coords[1 + a]) for a in range(3))
        owned = tuple(ceil_block_range(case.spec.input[2 + a], dims[1 + a], lo.coords[1 + a]) for a in range(3))
        needed = tuple(_window_range(case, a, *outputs[a]) for a in range(3))
        layouts.append(dataclasses.replace(lo, outputs=outputs, owned=owned, needed=needed))
    return dataclasses.replace(case, layouts=layouts)


def chunk_layout_results(case, plant, names=None, params_once=False):
    """PyTorch's per-rank run (run-torch's adapter) in torch.chunk's split, every block with its
    offset; ``params_once``: dw and db on rank 0 only."""
    import torch
    from refimpl.oracle import torch_adapter
    split = chunk_case(case)
    where = {"y": "y", "dx": "x", "x_needed": "needed", "dx_needed": "needed", "y_partial": "y"}
    ranks = {}
    for dtype in case.spec.dtypes:
        run = torch_adapter.run_ranks(split, dtype, torch, torch_adapter.parse_plant(plant, split))
        ranks[dtype] = {}
        for lo in split.layouts:
            out = {}
            for name, array in run[lo.rank].items():
                if (names is not None and name not in names) or (name in ("dw", "db") and params_once and lo.rank):
                    continue
                if name in where:
                    offset = [s.start for s in lo.index(where[name])]
                    offset[1] = 0 if name == "y_partial" else offset[1]
                    out[name] = (array, offset)
                elif name in ("dw", "db"):
                    out[name] = (array, [0] * array.ndim)
            ranks[dtype][lo.rank] = out
    return ranks


#: (case of the hard suite, plant, words of its first diagnosis, whether y shows it)
PLANTED = [
    ("conv_even_kernel.1-2-2-1.h5", "halo:1", "halo", True),
    ("conv_even_kernel.1-2-2-1.h5", "inner-padding", "padding applied at an internal face", True),
    ("conv_even_kernel.1-2-2-1.h5", "padding:H", "off by one", True),
    ("conv_even_kernel.1-2-2-1.h5", "dx-missing", "input gradient missing", False),
    ("conv_stride_uneven.1-2-3-1.h5", "stride-phase:1", "strided windows misplaced", True),
    ("maxpool_overlap_ties.1-3-1-2.h5", "pool-no-halo", "pooled locally without a halo", True),
    ("batchnorm_global.2-2-1-1.h5", "local-stats", "not reduced over the spatial group", True),
    ("conv_dilation.1-1-2-3.h5", "ghost-clear", "without clearing", False),
    ("conv_dilation.2-2-2-1.h5", "dw-unsummed", "not summed over the", False),
    ("conv_wide_halo.1-4-1-1.h5", "far-halo:1", "non-neighbour", True),
]


@pytest.mark.parametrize("name, plant, words, in_y", PLANTED, ids=[p[1] for p in PLANTED])
def test_the_same_first_diagnosis_in_every_layout(hard, tmp_path, name, plant, words, in_y):
    """A planted bug written in refimpl's layout, in torch.chunk's (an offset per block), with
    y alone (where the bug shows in y) and with dw/db given once: the first diagnosis names
    the planted cause in all of them, hedged ("not confirmed") exactly where a halo claim
    has no x_needed to stand on."""
    pytest.importorskip("torch")
    from refimpl.oracle import torch_adapter
    case = load_case(str(hard / name))
    _, refimpl_layout = torch_adapter.run_case(case, torch_adapter.parse_plant(plant, case))
    layouts = {"refimpl": refimpl_layout}
    if in_y:
        layouts["refimpl, y only"] = {d: {r: {"y": a["y"]} for r, a in per.items()} for d, per in refimpl_layout.items()}
    if plant != "far-halo:1":                 # torch.chunk's split of that case reads no cell past a neighbour
        layouts["torch.chunk"] = chunk_layout_results(case, plant)
        layouts["torch.chunk, dw/db once"] = chunk_layout_results(case, plant, ("y", "dx", "dw", "db"), True)
        if in_y:
            layouts["torch.chunk, y only"] = chunk_layout_results(case, plant, ("y",))
    firsts = {}
    for i, (layout, ranks) in enumerate(layouts.items()):
        path = str(tmp_path / f"{i}.h5")
        write_results(path, case, None, ranks)
        cause = root_cause(compare(case, load_results(path, case)))
        firsts[layout] = cause and cause.diagnosis
    assert all(text and words in text for text in firsts.values()), firsts
    no_x_needed = {n for n, ranks in layouts.items() if not any("x_needed" in a for a in ranks["float64"].values())}
    for layout, text in firsts.items():
        if "not confirmed" in text:
            assert layout in no_x_needed and "halo" in text, (layout, text)


# ---------------------------------------------------------------- A.5: adjoint senders named, -inf named

def test_dx_missing_two_senders_names_both(tmp_path):
    """Rank 0 of a 2×2 split receives ghost gradients from ranks 1, 2 and 3; its dx lacks those
    of ranks 1 and 3: both are named, not a generic sentence."""
    from refimpl.oracle import diagnose
    spec, = parse_suite({"case": [{"name": "corner", "layer": "conv3d", "input": [1, 2, 3, 6, 6], "out_channels": 2,
                                   "kernel": 3, "padding": 1, "grids": [[1, 1, 2, 2]], "dtypes": ["float64"]}]}, "t")
    case = load_case(write_case(spec, str(tmp_path)))
    by = diagnose._ghost_gradients_by_sender(case, "float64", case.layouts[0])
    assert {1, 2, 3} <= set(by)
    ranks = case_blocks(case, ("y", "dx", "dx_needed"))
    ranks[0]["dx"] = ranks[0]["dx"] - by[1] - by[3]
    report = compare(case, load_results(written(tmp_path, case, ranks), case))
    bad, = fails(report)
    assert bad.tensor == "dx" and bad.rank == 0
    assert "lacks exactly ranks 1, 3' ghost gradients" in bad.diagnosis, bad.diagnosis


def test_ghosts_that_arrived_as_minus_inf_are_named_so(tmp_path):
    pytest.importorskip("torch")
    from refimpl.oracle import torch_adapter
    spec, = parse_suite({"case": [{"name": "mp", "layer": "max_pool3d", "input": [1, 2, 3, 3, 8], "kernel": 3,
                                   "stride": 1, "padding": 1, "grids": [[1, 1, 1, 2]], "dtypes": ["float64"]}]}, "t")
    case = load_case(write_case(spec, str(tmp_path)))
    _, ranks = torch_adapter.run_case(case, torch_adapter.parse_plant("inner-padding", case))
    ys = [{r: {"y": a["y"]} for r, a in ranks["float64"].items()}]
    report = compare(case, load_results(written(tmp_path, case, ys[0]), case))
    text = " ".join(f.diagnosis or "" for f in fails(report, "y"))
    assert "ghost cells that arrived as -inf" in text, text


# ---------------------------------------------------------------- A.4: replicated outputs gathered with the wrong sizes

def test_a_replicated_y_gathered_with_torch_chunk_sizes(tmp_path):
    """Every rank holds the whole y, gathered from balanced blocks (W 6 over 4: 2, 2, 1, 1) with
    torch.chunk's sizes (2, 2, 2, 0): block 2 lands at W 4 padded by one cell, block 3 is lost.
    The copies are compared, and the cause named (ShardTensor's bug, in its own layout)."""
    spec, = parse_suite({"case": [{"name": "rep", "layer": "conv3d", "input": [1, 2, 3, 3, 6], "out_channels": 2,
                                   "kernel": 3, "padding": 1, "grids": [[1, 1, 1, 4]], "dtypes": ["float64"]}]}, "t")
    case = load_case(write_case(spec, str(tmp_path)))
    want = case.expected["float64"]["y"]
    got = want.copy()
    got[..., 4] = want[..., 4]                 # block 2 (W [4, 5)) at chunk slot 2 (W [4, 6)): in place
    got[..., 5] = 0.0                          # ... padded; block 3 (W 5) lost
    assert not np.allclose(got, want)
    ranks = {r: {"y": (got.copy(), (0, 0, 0, 0, 0))} for r in range(4)}
    report = compare(case, load_results(written(tmp_path, case, ranks), case))
    bad = fails(report, "y")
    assert {f.rank for f in bad} == {0, 1, 2, 3}
    for f in bad:
        assert f.diagnosis.startswith("y gathered along W with torch.chunk's shard sizes (2, 2, 2, 0) where the 4 "
                                      "blocks have refimpl's balanced split sizes (2, 2, 1, 1)"), f.diagnosis
    path = str(tmp_path / "global.h5")
    write_results(path, case, {"float64": {"y": got}}, None)
    g, = fails(compare(case, load_results(path, case)), "y")
    assert g.rank is None and "torch.chunk's shard sizes" in g.diagnosis


def test_an_arbitrary_error_in_the_last_plane_is_not_called_a_gather(tmp_path):
    spec, = parse_suite({"case": [{"name": "rep", "layer": "conv3d", "input": [1, 2, 3, 3, 6], "out_channels": 2,
                                   "kernel": 3, "padding": 1, "grids": [[1, 1, 1, 4]], "dtypes": ["float64"]}]}, "t")
    case = load_case(write_case(spec, str(tmp_path)))
    got = case.expected["float64"]["y"].copy()
    got[..., 5] += np.random.default_rng(0).standard_normal(got[..., 5].shape)
    path = str(tmp_path / "global.h5")
    write_results(path, case, {"float64": {"y": got}}, None)
    g, = fails(compare(case, load_results(path, case)), "y")
    assert "gathered" not in (g.diagnosis or "")


def test_the_gather_sizes_plant_is_diagnosed(cases, tmp_path):
    """run-torch --plant gather-sizes: every rank holds the whole y, gathered with torch.chunk's
    sizes (W 10 over 3: balanced 4, 3, 3; torch.chunk 4, 4, 2); check names it."""
    pytest.importorskip("torch")
    out = tmp_path / "planted"
    proc = subprocess.run([sys.executable, "-m", "refimpl", "oracle", "run-torch", cases["conv"], "--out", str(out),
                           "--plant", "gather-sizes"], capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr
    proc = cli("check", cases["conv"], str(out / os.path.basename(cases["conv"])))
    assert proc.returncode == 1
    assert ("y gathered along W with torch.chunk's shard sizes (4, 4, 2) where "
            "the 3 blocks have refimpl's balanced split sizes (4, 3, 3)") in proc.stdout, proc.stdout
    proc = subprocess.run([sys.executable, "-m", "refimpl", "oracle", "run-torch", cases["pool"], "--out", str(out),
                           "--plant", "gather-sizes"], capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 2 and "torch.chunk's shard sizes differ" in proc.stderr, proc.stderr


def test_a_halo_buffer_wider_than_needed_keeps_the_case_layout(cases, tmp_path):
    """x_needed written as a buffer one cell wider than the rank's windows read (inside the
    domain; docs/oracle.md allows it): the case's block of it is judged, the rank keeps the
    case's layout, and dw's "not summed" diagnosis is still made."""
    pytest.importorskip("torch")
    from refimpl.oracle import torch_adapter
    case = load_case(cases["conv"])                  # W 10 over 3: rank 0 needs W [0, 5)
    _, ranks = torch_adapter.run_case(case, torch_adapter.parse_plant("dw-unsummed", case))
    x = case.inputs["float64"]["x"]
    needed, offset = case.ranks["float64"][0]["x_needed"]
    assert offset[4] == 0 and needed.shape[4] == 5
    ranks["float64"][0]["x_needed"] = (x[..., :6].copy(), (0, 0, 0, 0, 0))      # one cell more
    report = compare(case, load_results(written(tmp_path, case, ranks["float64"]), case))
    assert report.layout == "case" and report.layout_note is None
    assert all(f.ok for f in report.findings if f.tensor == "x_needed")
    assert "not summed over the spatial shards" in root_cause(report).diagnosis
