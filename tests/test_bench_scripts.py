"""Smoke tests of scripts/bench_spatial.py at tiny sizes: driver mode, direct mpiexec mode, JSON.

The bytes a rank sends are checked three ways: the halo layers' own count
(``HaloExchange.bytes_sent``), the halo plan's prediction (``partition.bytes_sent``)
and, for a slab split, a count by hand.
"""
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from launcher import run_launched

pytest.importorskip("mpi4py", reason="mpi4py is not installed: pip install 'refimpl[mpi]'")

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_spatial.py"
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")


def load_script():
    spec = importlib.util.spec_from_file_location("bench_spatial", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(cmd, timeout=180):
    return run_launched(cmd, env=ENV, timeout=timeout)


def test_driver_bytes_match_plan_and_hand_count(tmp_path):
    out = tmp_path / "spatial.json"
    proc = run([sys.executable, str(SCRIPT), "--ranks", "1,2", "--split", "slab", "--size", "16",
                "--channels", "2,3,4", "--rounds", "2", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["rounds"] == 2 and "P=2 done" in proc.stdout and "round 2)" in proc.stdout
    one, two = report["rows"]                          # each P's fastest of its two runs
    assert (one["ranks"], one["grid"], two["ranks"], two["grid"]) == (1, [1, 1, 1], 2, [2, 1, 1])
    # slab of 2: each conv (k3, p1) sends one boundary plane forward and gets one back in the
    # adjoint, C_in * S^2 float32 each way; the pools (k2, s2) on even blocks exchange nothing
    hand = 2 * 4 * (2 * 16 * 16 + 3 * 8 * 8)
    for r in two["per_rank"]:
        assert r["bytes_sent"] == r["bytes_predicted"] == hand, r
    assert one["per_rank"][0]["bytes_sent"] == 0 and report["bytes_match"]
    assert two["checksum_rel_diff"] < 1e-5             # the same function on 1 and 2 ranks
    assert one["peak_bytes"] > 0 and two["peak_ideal_bytes"] == one["peak_bytes"] / 2
    assert (two["efficiency"] is None) == two["oversubscribed"]
    assert all(r["step_s"] > 0 and r["cpu_s"] > 0 for r in one["per_rank"] + two["per_rank"])
    assert 0 <= two["halo_share_max"] <= 1 and two["blas_env"]["OPENBLAS_NUM_THREADS"] == "1"
    assert "match" in proc.stdout and "efficiency" in proc.stdout


def test_mpiexec_mode_uneven_blocks_with_pool_halos(tmp_path):
    """13 over 3 ranks: blocks 5, 4, 4; the pools' output blocks then need a neighbour's plane."""
    out = tmp_path / "p3.json"
    proc = run([shutil.which("mpiexec"), "--oversubscribe", "-n", "3", sys.executable, str(SCRIPT),
                "--size", "13", "--channels", "2,3,2", "--grid", "1,3,1", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    rows = report["per_rank"]
    assert report["grid"] == [1, 3, 1] and [r["block"] for r in rows] == [[13, 5, 13], [13, 4, 13], [13, 4, 13]]
    assert all(r["bytes_sent"] == r["bytes_predicted"] > 0 for r in rows), rows
    conv_only = 2 * 4 * (2 * 13 * 13 + 3 * 6 * 6)      # rank 0: one plane to rank 1 per conv, each way
    assert rows[0]["bytes_sent"] > conv_only             # plus the pool halo it serves to rank 1
    assert report["bytes_match"] and report["oversubscribed"] == (3 > report["cores"])


def test_bad_rounds_are_refused():
    proc = run([sys.executable, str(SCRIPT), "--ranks", "1", "--rounds", "0"], timeout=60)
    assert proc.returncode == 2 and "--rounds must be a positive integer, got 0" in proc.stderr


def test_bad_grid_fails_cleanly():
    proc = run([shutil.which("mpiexec"), "--oversubscribe", "-n", "2", sys.executable, str(SCRIPT),
                "--size", "8", "--channels", "1,2", "--grid", "1,3,1"], timeout=60)
    assert proc.returncode == 2 and "holds 3 ranks, mpiexec gave 2" in proc.stderr


@pytest.mark.parametrize("p, dims", [(1, (1, 1, 1)), (2, (2, 1, 1)), (4, (2, 2, 1)), (7, (7, 1, 1)),
                                     (8, (2, 2, 2)), (12, (3, 2, 2)), (18, (3, 3, 2))])
def test_cubic_grid(p, dims):
    bench = load_script()
    assert bench.cubic_grid(p) == dims
    assert bench.spatial_grid(p, "slab") == (p, 1, 1)


def test_comparisons_only_where_ranks_fit_the_cores():
    bench = load_script()
    reports = [dict(ranks=p, step_s=t, peak_bytes=m, checksum=1.0, oversubscribed=p > 2)
               for p, t, m in ((1, 8.0, 800), (2, 5.0, 420), (4, 3.0, 230))]
    bench.add_comparisons(reports)
    assert [r["efficiency"] for r in reports] == [1.0, 0.8, None]
    assert [r["peak_ideal_bytes"] for r in reports] == [800, 400, 200]
    assert reports[2]["peak_over_ideal"] == 230 / 200


def test_model_parallel_bytes_match_the_formulas(tmp_path):
    """scripts/bench_model_parallel.py on 4 ranks: every layer's measured bytes equal the cost
    formula's on every rank and every grid, and the head's parameters fall as 1/Pm."""
    script = SCRIPT.parent / "bench_model_parallel.py"
    out = tmp_path / "mp.json"
    proc = run([shutil.which("mpiexec"), "--oversubscribe", "-n", "4", sys.executable, str(script),
                "--json", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    grids = {tuple(g["grid"]): g for g in json.loads(out.read_text())["grids"]}
    assert set(grids) == {(4, 1, 1, 1), (1, 2, 2, 1), (1, 1, 1, 1, 4), (2, 1, 1, 1, 2)}
    assert all(g["all_ranks_agree"] for g in grids.values())
    kinds = {key.split("|")[1] for key in grids[(1, 1, 1, 1, 4)]["rows"]}
    assert kinds >= {"channel", "allreduce"} and "halo|halo" not in grids[(4, 1, 1, 1)]["rows"]
    assert any(key.endswith("|halo") for key in grids[(1, 2, 2, 1)]["rows"])
    head = {dims: g["head_bytes"] for dims, g in grids.items()}
    assert head[(1, 1, 1, 1, 4)] < 0.3 * head[(4, 1, 1, 1)] and head[(2, 1, 1, 1, 2)] < 0.55 * head[(4, 1, 1, 1)]
