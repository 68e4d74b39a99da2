"""Diagnoses that name what real peers get wrong: each pattern planted in PyTorch's per-rank run
(``run-torch --plant``), checked, and its diagnosis asserted; each is given only where it
explains every mismatch of the tensor, and a halo verdict only where the results hold x_needed."""
import os
import subprocess
import sys

import numpy as np
import pytest

from refimpl.oracle import compare, diagnose, load_case, load_results, parse_suite, write_case, write_results
from refimpl.oracle.compare import root_cause

torch = pytest.importorskip("torch", reason="PyTorch absent: pip install 'refimpl[oracle]'")
from refimpl.oracle import torch_adapter  # noqa: E402

ENV = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_WORLD", "PMI_"))}

#: small cases on which each pattern is observable
SUITE = {"seed": 3, "dtypes": ["float64", "float32"], "case": [
    # D blocks of 2 and a halo of 3: rank 1 reads rank 3's block, past rank 2's
    {"name": "far", "layer": "conv3d", "input": [1, 2, 8, 4, 3], "out_channels": 2, "kernel": [7, 3, 3],
     "padding": [3, 1, 1], "grids": [[1, 4, 1, 1]]},
    # W: inputs [0, 5) [5, 10), outputs [0, 3) [3, 5): rank 1's first window starts at 5, its block at 5 - 1
    {"name": "stride", "layer": "conv3d", "input": [1, 2, 4, 4, 10], "out_channels": 2, "kernel": 3, "stride": 2,
     "padding": 1, "grids": [[1, 1, 1, 2]]},
    # W: inputs [0, 5) [5, 9), outputs [0, 2) [2, 4): rank 1's first window [4, 6) crosses the block edge
    {"name": "maxpool", "layer": "max_pool3d", "input": [1, 2, 4, 4, 9], "kernel": 2, "grids": [[1, 1, 1, 2]]},
    {"name": "avgpool", "layer": "avg_pool3d", "input": [1, 2, 4, 4, 9], "kernel": 2, "grids": [[1, 1, 1, 2]]},
    {"name": "pad", "layer": "conv3d", "input": [1, 2, 6, 4, 4], "out_channels": 2, "kernel": 3, "padding": 1,
     "grids": [[1, 3, 1, 1], [1, 2, 2, 1]]},
    {"name": "convT", "layer": "conv_transpose3d", "input": [1, 2, 3, 3, 4], "out_channels": 2, "kernel": 3,
     "stride": 2, "padding": 1, "output_padding": 1, "grids": [[1, 1, 1, 2]]},
    {"name": "dil", "layer": "conv3d", "input": [1, 2, 4, 4, 9], "out_channels": 2, "kernel": 3,
     "dilation": [1, 1, 2], "grids": [[1, 1, 1, 2]]},
]}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    out = tmp_path_factory.mktemp("diag_cases")
    for spec in parse_suite(SUITE, "test"):
        write_case(spec, str(out))
    return out


def load(cases, name):
    return load_case(str(cases / f"{name}.h5"))


def planted(cases, tmp_path, name, plant, drop=()):
    """(case, report) of PyTorch's per-rank run with ``plant``, gathered; ``drop``: per-rank
    tensors left out of the results."""
    case = load(cases, name)
    glob, ranks = torch_adapter.run_case(case, torch_adapter.parse_plant(plant, case), "gathered")
    ranks = {d: {r: {k: v for k, v in a.items() if k not in drop} for r, a in per.items()} for d, per in ranks.items()}
    path = str(tmp_path / f"{name}.h5")
    write_results(path, case, glob, ranks)
    report = compare(case, load_results(path, case))
    assert not report.ok
    return case, report


def failing(report, tensor=None, rank="any", dtype="float64"):
    return [f for f in report.findings if not f.ok and f.dtype == dtype and (tensor is None or f.tensor == tensor)
            and (rank == "any" or f.rank == rank)]


def diagnosis(report, tensor, rank, dtype="float64"):
    f, = failing(report, tensor, rank, dtype)
    return f.diagnosis or ""


FAR = "halo needs cells from a non-neighbour: rank 1's window reaches rank 3's block, past rank 2's (2 cells wide)"


# ---------------------------------------------------------------- a halo wider than the neighbour's block

def test_far_halo_names_the_rank_reached_and_the_one_skipped(cases, tmp_path):
    case, report = planted(cases, tmp_path, "far.1-4-1-1", "far-halo:1")
    for dtype in ("float64", "float32"):
        assert diagnosis(report, "x_needed", 1, dtype).startswith(FAR)
        assert diagnosis(report, "y", 1, dtype).startswith(FAR)
        assert FAR in diagnosis(report, "y", None, dtype)
        # the adjoint: only the non-neighbour's dx misses rank 1's ghost gradients, tested sender by sender
        text = diagnosis(report, "dx", 3, dtype)
        assert text.startswith("dx on rank 3 lacks exactly rank 1's ghost gradients"), text
    assert {f.rank for f in failing(report, "dx")} == {3, None}
    cause = root_cause(report)
    assert (cause.tensor, cause.rank) == ("x_needed", 1) and cause.diagnosis.startswith(FAR)


def test_far_halo_without_x_needed_is_no_halo_verdict(cases, tmp_path):
    _, report = planted(cases, tmp_path, "far.1-4-1-1", "far-halo:1", drop=("x_needed",))
    text = diagnosis(report, "y", 1)
    assert text.startswith(FAR) and "not confirmed" in text and ": the forward halo exchange" not in text


def test_adjoint_per_sender(cases, tmp_path):
    """dx on rank 3 less exactly one neighbour's ghost gradients (of two senders) names that one."""
    case = load(cases, "far.1-4-1-1")
    lo = case.layouts[3]
    by = diagnose._ghost_gradients_by_sender(case, "float64", lo)
    assert sorted(q for q, part in by.items() if q != 3 and part.any()) == [1, 2]
    ranks = {"float64": {r: {"dx": a["dx"][0].copy()} for r, a in enumerate(case.ranks["float64"])}}
    ranks["float64"][3]["dx"] -= by[2]
    path = str(tmp_path / "r.h5")
    write_results(path, case, None, ranks)
    report = compare(case, load_results(path, case))
    text = diagnosis(report, "dx", 3)
    assert text.startswith("dx on rank 3 lacks exactly rank 2's ghost gradients") and "non-neighbour" not in text


# ---------------------------------------------------------------- windows and padding of the local computation

STRIDE = ("strided windows misplaced: rank 1's outputs are those of windows starting at local 0, the global stride "
          "grid puts the first at local 1")


@pytest.mark.parametrize("drop", [(), ("x_needed",)])
def test_stride_phase_on_an_uneven_block(cases, tmp_path, drop):
    _, report = planted(cases, tmp_path, "stride.1-1-1-2", "stride-phase:1", drop)
    for dtype in ("float64", "float32"):
        text = diagnosis(report, "y", 1, dtype)
        assert text.startswith(STRIDE) and "along W" in text and "halo" not in text, text
        assert diagnosis(report, "y", None, dtype).startswith(STRIDE)
    assert not failing(report, "y", 0) and root_cause(report).diagnosis.startswith(STRIDE)


def test_padding_at_an_internal_face(cases, tmp_path):
    """Every rank pads its own block (the results hold no x_needed: there is no halo): the face is
    named by the two ranks, the ghost-zeros alternative only as a possibility x_needed decides."""
    _, report = planted(cases, tmp_path, "pad.1-3-1-1", "inner-padding")
    text = diagnosis(report, "y", 0)
    assert "padding applied at an internal face (between ranks 0 and 1)" in text and "D high face" in text
    assert "not confirmed" in text and ": the forward halo exchange" not in text
    text = diagnosis(report, "y", 1)
    assert "padding applied at internal faces (between ranks 0 and 1, between ranks 1 and 2)" in text
    assert diagnosis(report, "y", 2).count("between ranks") == 1


def test_zeros_for_ghosts_with_x_needed_names_both_causes(cases, tmp_path):
    """halo:R with x_needed reported: y fits both zero padding at the face and zero ghosts; x_needed
    (wrong) is the most likely cause."""
    _, report = planted(cases, tmp_path, "pad.1-3-1-1", "halo:2")
    text = diagnosis(report, "y", 2)
    assert "padding applied at an internal face (between ranks 1 and 2)" in text
    assert "the forward halo exchange" in text and "x_needed decides" in text
    assert (root_cause(report).tensor, root_cause(report).rank) == ("x_needed", 2)


@pytest.mark.parametrize("name", ["maxpool.1-1-1-2", "avgpool.1-1-1-2"])
def test_pooled_locally_without_a_halo(cases, tmp_path, name):
    _, report = planted(cases, tmp_path, name, "pool-no-halo")
    text = diagnosis(report, "y", 1)
    assert text.startswith("pooled locally without a halo: rank 1's outputs are those of pooling its own block")
    assert "halo exchange" not in text
    assert not failing(report, "y", 0)


def test_max_pool_ghosts_as_zeros_are_not_padding(cases, tmp_path):
    """Zeros are not max pooling's -inf padding: ghost cells that arrived as zeros are named."""
    _, report = planted(cases, tmp_path, "maxpool.1-1-1-2", "halo:1")
    assert "ghost cells that arrived as zeros: the forward halo exchange" in diagnosis(report, "y", 1)


# ---------------------------------------------------------------- missing gradients

def test_dx_missing(cases, tmp_path):
    _, report = planted(cases, tmp_path, "stride.1-1-1-2", "dx-missing")
    for tensor in ("dx", "dx_needed"):
        found = failing(report, tensor)
        assert found and all(f.diagnosis.startswith("input gradient missing") for f in found)
    assert all(not f.diagnosis.startswith("follows") for f in failing(report))
    assert not failing(report, "y") and not failing(report, "dw")


@pytest.mark.parametrize("tensor, what", [("dw", "weight gradient missing"), ("db", "bias gradient missing")])
def test_parameter_gradient_missing(cases, tmp_path, tensor, what):
    case = load(cases, "pad.1-2-2-1")
    glob = {"float64": dict(case.expected["float64"])}
    glob["float64"][tensor] = np.zeros_like(glob["float64"][tensor])
    write_results(str(tmp_path / "m.h5"), case, glob)
    report = compare(case, load_results(str(tmp_path / "m.h5"), case))
    assert diagnosis(report, tensor, None).startswith(what)


# ---------------------------------------------------------------- the output-size rule

@pytest.mark.parametrize("name, rule", [("convT.1-1-1-2", "output size ignores output_padding (1)"),
                                        ("dil.1-1-1-2", "output size ignores dilation")])
def test_output_size_rule_of_a_wrong_shaped_y(cases, tmp_path, name, rule):
    case = load(cases, name)
    glob, ranks = torch_adapter.run_case(case, torch_adapter.parse_plant("output-size", case), "gathered")
    path = str(tmp_path / f"{name}.h5")
    write_results(path, case, glob, ranks)
    loaded = load_results(path, case)       # the global y cannot be placed; rank 1's block runs past the end
    errors = [e for e in loaded.shape_errors + loaded.excess if e["dtype"] == "float64" and e["tensor"] == "y"]
    assert {None, 1} <= {e["rank"] for e in errors}      # the global y, and the blocks at its end
    for e in errors:
        text = diagnose.output_size(case, e["dtype"], e["tensor"], e["rank"], e["shape"], e["offset"])
        assert text and text.startswith(rule), (e, text)
    # check reports each wrong shape as a finding, with the rule
    shaped = [f for f in compare(case, load_results(path, case)).findings if f.problem in ("shape", "excess")]
    assert shaped and all(rule in f.diagnosis for f in shaped)
    # the entry points compare calls take a wrong-shaped block the same way
    want = case.expected["float64"]["y"]
    assert diagnose.global_tensor(case, "float64", "y", glob["float64"]["y"], want, None, 0.0).startswith(rule)
    block = case.ranks["float64"][1]["y"][0]
    assert diagnose.rank_tensor(case, "float64", "y", 1, ranks["float64"][1]["y"], block, None, 0.0).startswith(rule)
    with pytest.raises(ValueError, match="neither output_padding nor dilation"):
        torch_adapter.parse_plant("output-size", load(cases, "stride.1-1-1-2"))


# ---------------------------------------------------------------- a halo claimed only where the location tells

def _y_results(case, tmp_path, rank, where):
    """Every rank's correct y, rank ``rank``'s perturbed where ``where`` (over its spatial block)."""
    ranks = {"float64": {r: {"y": a["y"][0].copy()} for r, a in enumerate(case.ranks["float64"])}}
    y = ranks["float64"][rank]["y"]
    noise = np.random.default_rng(0).standard_normal(y.shape)
    y += noise * where
    path = str(tmp_path / "y.h5")
    write_results(path, case, None, ranks)
    return compare(case, load_results(path, case))


def test_no_halo_verdict_where_every_output_reads_ghosts(cases, tmp_path):
    case = load(cases, "far.1-4-1-1")
    lo = case.layouts[2]                      # D block [4, 6), kernel 7: every output reads both neighbours
    report = _y_results(case, tmp_path, 2, np.ones(tuple(b - a for a, b in lo.outputs)))
    assert "halo" not in diagnosis(report, "y", 2)


def test_one_face_named(cases, tmp_path):
    """Errors in rank 3's first D output plane: the D low face holds them all; the H low face, which
    its corner windows also touch, is not named."""
    case = load(cases, "pad.1-2-2-1")
    lo = case.layouts[3]
    where = np.zeros(tuple(b - a for a, b in lo.outputs))
    where[0] = 1
    text = diagnosis(_y_results(case, tmp_path, 3, where), "y", 3)
    assert "(D low face)" in text and "H low" not in text and "not confirmed" in text


# ---------------------------------------------------------------- the command line

def test_run_torch_plant_and_check(cases, tmp_path):
    case = str(cases / "far.1-4-1-1.h5")
    run = subprocess.run([sys.executable, "-m", "refimpl", "oracle", "run-torch", case, "--out", str(tmp_path),
                          "--plant", "far-halo:1", "--global", "gathered"], capture_output=True, text=True, env=ENV,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    check = subprocess.run([sys.executable, "-m", "refimpl", "oracle", "check", case,
                            str(tmp_path / "far.1-4-1-1.h5")], capture_output=True, text=True, env=ENV, timeout=300)
    assert check.returncode == 1 and f"most likely cause (float64 x_needed, rank 1): {FAR}" in check.stdout
    assert "dx on rank 3 lacks exactly rank 1's ghost gradients" in check.stdout
    bad = subprocess.run([sys.executable, "-m", "refimpl", "oracle", "run-torch", str(cases / "stride.1-1-1-2.h5"),
                          "--out", str(tmp_path), "--plant", "far-halo:0"], capture_output=True, text=True, env=ENV,
                         timeout=300)
    assert bad.returncode == 2 and "read no cells past its neighbours' blocks" in bad.stderr


# ---------------------------------------------------------------- results in their own layout (real peers)

@pytest.mark.parametrize("name, plant, tensor, rank, text", [
    ("far.1-4-1-1", "far-halo:1", "x_needed", 1, FAR),
    ("far.1-4-1-1", "far-halo:1", "dx", 3, "dx on rank 3 lacks exactly rank 1's ghost gradients"),
    ("stride.1-1-1-2", "stride-phase:1", "y", 1, STRIDE),
    ("maxpool.1-1-1-2", "pool-no-halo", "y", 1, "pooled locally without a halo"),
    ("pad.1-3-1-1", "inner-padding", "y", 0, "padding applied at an internal face (between ranks 0 and 1)")])
def test_the_same_diagnoses_in_the_results_own_layout(cases, tmp_path, monkeypatch, name, plant, tensor, rank, text):
    """Blocks placed by their 'offset' (the path another split takes) get the same diagnoses."""
    from refimpl.oracle import casefile
    monkeypatch.setattr(casefile.Results, "own_layout", lambda self, case, dtype: True)
    _, report = planted(cases, tmp_path, name, plant)
    assert report.layout == "results" and text in diagnosis(report, tensor, rank)


def test_one_voxel_shifts_of_the_whole_tensor_and_of_every_block():
    """``shift`` finds a shift of the whole tensor; ``blockwise_shift`` one that each rank's block
    makes on its own (two blocks along W), which no shift of the whole tensor explains."""
    rng = np.random.default_rng(5)
    want = rng.standard_normal((1, 2, 5, 4, 8))                     # (N, C, D, H, W)
    atol = 1e-12

    whole = np.roll(want, 1, axis=3)                               # got[h] == want[h - 1]
    bad = np.abs(whole - want) > atol
    assert "shifted by +1 along H" in diagnose.shift(whole, want, bad, atol)

    class Block:
        def __init__(self, w):
            self.w = w

        def index(self, tensor):
            return (slice(None),) * 4 + (slice(*self.w),)

    case = type("Case", (), {"layouts": [Block((0, 4)), Block((4, 8))]})()
    per_block = want.copy()
    for lo, hi in ((0, 4), (4, 8)):                                # each block: got[w] == want[w + 1]
        per_block[..., lo:hi - 1] = want[..., lo + 1:hi]
    bad = np.abs(per_block - want) > atol
    assert diagnose.shift(per_block, want, bad, atol) is None     # each block's last plane breaks it
    found = diagnose.blockwise_shift(case, "y", per_block, want, bad, atol)
    assert found and "shifted by -1 along W" in found and "in every rank's block" in found
    assert diagnose.blockwise_shift(case, "y", want + 1.0, want, np.ones_like(bad), atol) is None


def test_a_conv_dx_never_follows_from_the_forward():
    """An undiagnosed dx after a diagnosed y: a consequence where dx reads the forward (max
    pooling's argmax), not for a conv or an average pool (dx is the adjoint applied to dy alone),
    and never a consequence of dw; dw follows from y (both read x)."""
    from refimpl import layers
    from refimpl.oracle.compare import CaseReport, Finding, trace_consequences

    def report():
        def fail(tensor, diagnosis=None):
            return Finding("float64", tensor, None, 1.0, 1.0, 1e-12, "", False, mismatches=3, diagnosis=diagnosis)
        return CaseReport("c", findings=[fail("y", "a halo plane missing"), fail("dw_partial", "planted"),
                                         fail("dx"), fail("dw")])

    for kind, reads in (("conv3d", False), ("conv_transpose3d", False), ("avg_pool3d", False),
                        ("max_pool3d", True), ("batch_norm3d", True)):
        assert layers.lookup(kind).dx_reads_forward is reads, kind
        r = report()
        trace_consequences(r, layers.lookup(kind).dx_reads_forward)
        dx, dw = r.findings[2], r.findings[3]
        assert (dx.diagnosis == "follows from the error in y (global) diagnosed above") is reads, (kind, dx.diagnosis)
        assert reads or dx.diagnosis is None
        assert dw.diagnosis.startswith("follows from the error in")
