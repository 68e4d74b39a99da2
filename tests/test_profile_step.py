"""Smoke test of scripts/profile_step.py on the tiny presets: one repeat, both models, JSON rows.

Every leaf layer of each refimpl model has a row, in forward order, with positive
forward and backward times on both sides (the torch rows matched call by call,
torch's Flatten folded into the dense layer after it), then the loss and 'other'
rows; the shares add up to one.
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (the profile's baseline)")

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "profile_step.py"


def cosmoflow_layers(blocks=2):
    return [f"features.{i}" for i in range(3 * blocks)] + [f"head.{i}" for i in range(8)]


def unet3d_layers(levels=2):
    block = [f".{i}" for i in range(6)]           # [conv, batch norm, relu] x 2
    names = []
    for i in range(levels):
        names += [f"enc{i}{b}" for b in block] + [f"pool{i}"]
    names += [f"bottleneck{b}" for b in block]
    for i in reversed(range(levels)):
        names += [f"up{i}"] + [f"dec{i}{b}" for b in block]
    return names + ["out"]


def test_tiny_presets_one_repeat(tmp_path):
    out = tmp_path / "profile.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--preset", "tiny", "--repeats", "1", "--threads", "1",
                           "--json", str(out)], env=dict(os.environ, PYTHONUNBUFFERED="1"),
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["settings"]["threads"] == 1 and report["torch"]
    models = {m["model"]: m for m in report["models"]}
    assert set(models) == {"cosmoflow", "unet3d"}
    assert models["cosmoflow"]["batch"] == 4 and models["unet3d"]["batch"] == 2
    for name, expected in (("cosmoflow", cosmoflow_layers()), ("unet3d", unet3d_layers())):
        rows = models[name]["rows"]
        assert [r["layer"] for r in rows] == expected + ["loss", "other"], name
        for r in rows:
            assert r["ours_fwd_s"] > 0 and r["torch_fwd_s"] > 0 and r["torch_bwd_s"] > 0, r
            assert r["kind"] == "loss" or r["ours_bwd_s"] > 0, r
            assert r["torch_over_ours"] > 0 and 0 < r["ours_share"] < 1 and 0 < r["torch_share"] < 1, r
        assert abs(sum(r["ours_share"] for r in rows) - 1) < 1e-9
        assert abs(sum(r["torch_share"] for r in rows) - 1) < 1e-9
        totals = models[name]["totals"]
        for key in ("ours_step_s", "torch_step_s", "ours_step_instrumented_s", "torch_step_instrumented_s",
                    "ours_rows_s", "torch_rows_s", "torch_over_ours"):
            assert totals[key] > 0, key
        assert f"## {name}, preset tiny" in proc.stdout and "step plain (best of 1)" in proc.stdout
    head = {r["layer"]: r for r in models["cosmoflow"]["rows"]}
    assert head["features.0"]["label"] == "features.0 Conv3d 4->4 @16^3"
    assert head["head.0"]["torch_layer"] == "head.0"   # the twin's FlattenLinear, named as refimpl's
    assert "Warning" not in proc.stderr


def test_without_torch_columns_read_na(tmp_path):
    out = tmp_path / "profile.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", "cosmoflow", "--preset", "tiny", "--size", "8",
                           "--batch", "2", "--repeats", "1", "--threads", "1", "--no-torch", "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    model, = json.loads(out.read_text())["models"]
    assert model["config"]["input_shape"] == [4, 8, 8, 8] and model["batch"] == 2
    assert all(r["torch_s"] is None and r["ours_s"] > 0 for r in model["rows"])
    assert model["totals"]["torch_step_s"] is None and "n/a" in proc.stdout


def test_gemm_floor_of_the_conv_rows(tmp_path):
    """``--gemm-floor``: one floor per conv row (its GEMMs alone: K = C*27 rows, the batch's
    output positions), positive, its ratios to both sides' times of the row as reported (which
    side is faster is a measurement, not asserted here: on so small a conv ours ran below the
    floor of separate GEMM calls once); the first conv's floor counts no input gradient
    (CosmoFlow's input needs none), the second's does."""
    out = tmp_path / "profile.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", "cosmoflow", "--preset", "tiny", "--repeats", "1",
                           "--threads", "1", "--gemm-floor", "--json", str(out)],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    model, = json.loads(out.read_text())["models"]
    floors = {f["layer"]: f for f in model["gemm_floor"]}
    assert list(floors) == ["features.0", "features.3"]
    first, second = floors["features.0"], floors["features.3"]
    assert (first["k_rows"], first["positions"], second["k_rows"], second["positions"]) == (108, 4 * 16**3, 108, 4 * 8**3)
    assert not first["input_grad"] and second["input_grad"]
    for f in floors.values():
        assert 0 < f["floor_fwd_s"] and 0 < f["floor_bwd_s"], f
        assert math.isclose(f["floor_s"], f["floor_fwd_s"] + f["floor_bwd_s"]), f
        assert math.isclose(f["ours_over_floor"], f["floor_s"] / f["ours_s"]), f
        assert math.isclose(f["torch_over_floor"], f["torch_s"] / f["floor_s"]) and f["gemm_gflops"] > 0, f
    assert "GEMM floor of the conv rows" in proc.stdout


def test_device_strict_smoke(tmp_path):
    """``--device strict``: refimpl on the device stand-in (every clock read synchronised), the
    same rows as on the host."""
    out = tmp_path / "profile.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "strict", "--model", "cosmoflow", "--preset",
                           "tiny", "--repeats", "1", "--threads", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["settings"]["device"] == "strict" and report["settings"]["tf32"] == "off"
    model, = report["models"]
    assert [r["layer"] for r in model["rows"]] == cosmoflow_layers() + ["loss", "other"]
    assert all(r["ours_s"] > 0 and r["torch_s"] > 0 for r in model["rows"])
    assert "device strict" in proc.stdout


@pytest.mark.parametrize("argv, message", [
    (["--tf32", "on"], "--tf32 on: TF32 exists only on a GPU"),
    (["--device", "strict", "--gemm-floor"], "--gemm-floor times numpy's GEMMs on the host"),
])
def test_device_options_refused(argv, message):
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_device_cuda_without_a_gpu_is_one_line():
    from refimpl import settings
    if not settings.cupy_unavailable():
        pytest.skip("a GPU is here: scripts/gpu_check.sh runs the device profile")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cuda", "--preset", "tiny"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("profile_step: --device cuda: "), proc.stderr
