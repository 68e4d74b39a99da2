"""Smoke test of scripts/bench_layers.py: one conv row (the issue-9 stride-2 block) at one
repeat, its table and its JSON: the ratios are torch time / our time, the GEMM shares are
the row's flops over each side's time and the measured GEMM rate."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_layers.py"


def test_bench_layers_one_row_table_and_json(tmp_path):
    out = tmp_path / "layers.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--threads", "1", "--repeats", "1",
                          "--only", "33^3", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "torch/GEMM" in run.stdout and "ours/GEMM" in run.stdout
    data = json.loads(out.read_text())
    assert data["threads"] == 1 and data["only"] == "33^3"
    (row,) = data["conv_rows"]
    assert row["shape"].startswith("N=2 32->32 @33^3 k3s2p1") and row["issue_row"]
    fb = row["fwd_bwd"]
    assert fb["flops"] == 3 * 2 * 2 * 32 * 32 * 27 * 17 ** 3          # three passes, 17^3 outputs
    assert math.isclose(fb["torch_over_ours"], fb["torch_s"] / fb["ours_s"])
    gemm = data["gemm_gflops"]
    assert gemm > 0
    assert math.isclose(fb["ours_over_gemm"], fb["flops"] / fb["ours_s"] / 1e9 / gemm)
    assert math.isclose(fb["torch_over_gemm"], fb["flops"] / fb["torch_s"] / 1e9 / gemm)
    summary = data["conv_summary"]["issue9"]
    assert summary["rows"] == 1 and math.isclose(summary["min_fwd_bwd"], fb["torch_over_ours"])


def test_bench_layers_phases_on_the_device_stand_in(tmp_path):
    """--phases (the device schedule's time per phase; strict: its host stand-in): every phase
    and the rest add up to the pass's time, the stride-2 backward adds its columns back by
    col2im; on the CPU route, where there is no device schedule, the flag is refused."""
    out = tmp_path / "layers.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--threads", "1", "--repeats", "1",
                          "--only", "33^3", "--device", "strict", "--phases", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "where the device schedule's time goes" in run.stdout
    rows = {r["pass_"]: r for r in json.loads(out.read_text())["conv_phases"]}
    assert set(rows) == {"fwd", "bwd"}
    for r in rows.values():
        assert r["total"] > 0 and min(r["phases"].values()) >= 0
        assert math.isclose(sum(r["phases"].values()) + r["other"], r["total"])
        assert r["phases"]["columns"] > 0 and r["phases"]["gemm"] > 0
    assert rows["bwd"]["phases"]["col2im"] > 0 and rows["fwd"]["phases"]["col2im"] == 0
    cpu = subprocess.run([sys.executable, str(SCRIPT), "--phases", "--only", "33^3"], capture_output=True, text=True,
                         timeout=120)
    assert cpu.returncode == 2 and "--phases times the device schedule" in cpu.stderr
