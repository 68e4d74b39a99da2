"""Smoke test of scripts/bench_train.py at tiny sizes: driver mode on 1 and 2 ranks, JSON fields.

With PyTorch installed the same run includes the torch baseline (1 process and
DDP over gloo with 2 processes) and the refimpl/torch ratios of the matching rows.
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mpi4py", reason="mpi4py is not installed: pip install 'refimpl[mpi]'")

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_train.py"
TORCH = importlib.util.find_spec("torch") is not None
ROW_FIELDS = {"impl", "model", "grid", "ranks", "threads", "samples_per_s", "step_s", "cpu_s",
              "numpy_peak_bytes", "maxrss_bytes", "oversubscribed", "ratio_vs_torch", "per_rank"}


def test_quick_run_one_and_two_ranks(tmp_path):
    out = tmp_path / "train.json"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--models", "cosmoflow", "--grids", "1,1,1,1", "2,1,1,1",
           "--size", "8", "--layers", "1", "--width", "2", "--steps", "1", "--no-threads-run",
           "--json", str(out)] + ([] if TORCH else ["--no-torch"])
    proc = subprocess.run(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert len(report["load_average"]["start"]) == 3 and report["cores"] >= 1
    rows = {(r["impl"], r["ranks"]): r for r in report["rows"]}
    expected = {("refimpl", 1), ("refimpl", 2)} | ({("torch", 1), ("torch", 2)} if TORCH else set())
    assert set(rows) == expected, sorted(rows)
    for row in report["rows"]:
        assert ROW_FIELDS <= set(row), ROW_FIELDS - set(row)
        assert row["samples_per_s"] > 0 and row["step_s"] > 0 and row["maxrss_bytes"] > 0
        assert row["threads"] == 1 and len(row["per_rank"]) == row["ranks"]
    one, two = rows["refimpl", 1], rows["refimpl", 2]
    assert (one["grid"], two["grid"]) == ([1, 1, 1, 1], [2, 1, 1, 1])
    assert one["numpy_peak_bytes"] > 0 and two["numpy_peak_bytes"] > 0
    if TORCH:
        torch1, ddp = rows["torch", 1], rows["torch", 2]
        assert torch1["params"] == one["params"]            # the same network in both
        assert one["ratio_vs_torch"] == pytest.approx(one["samples_per_s"] / torch1["samples_per_s"])
        assert two["ratio_vs_torch"] == pytest.approx(two["samples_per_s"] / ddp["samples_per_s"])
        assert torch1["numpy_peak_bytes"] is None
    else:
        assert "n/a" in proc.stdout
    assert "samples/s" in proc.stdout and "load average" in proc.stdout


def test_bad_batch_for_grid_is_rejected():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--grids", "2,1,1,1", "--batch", "3"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "--batch 3 must be divisible" in proc.stderr
