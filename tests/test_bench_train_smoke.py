"""Smoke test of scripts/bench_train.py at tiny sizes: driver mode on 1 and 2 ranks, JSON fields.

With PyTorch installed the same run includes the torch baseline (1 process and
DDP over gloo with 2 processes) and the refimpl/torch ratios of the matching rows;
the torch U-Net is checked to compute what refimpl's computes (float64, same weights).
"""
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy
import pytest

pytest.importorskip("mpi4py", reason="mpi4py is not installed: pip install 'refimpl[mpi]'")

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_train.py"
TORCH = importlib.util.find_spec("torch") is not None
ROW_FIELDS = {"impl", "model", "grid", "ranks", "threads", "params", "samples_per_s", "step_s", "cpu_s",
              "numpy_peak_bytes", "maxrss_bytes", "oversubscribed", "ratio_vs_torch", "per_rank"}
TINY = {"cosmoflow": ["--layers", "1", "--width", "2"], "unet3d": ["--unet-layers", "1", "--unet-width", "2"]}


def load_script():
    spec = importlib.util.spec_from_file_location("bench_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("model", ["cosmoflow", "unet3d"])
def test_quick_run_one_and_two_ranks(tmp_path, model):
    out = tmp_path / "train.json"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--model", model, "--grids", "1,1,1,1", "2,1,1,1",
           "--size", "8", "--steps", "1", "--no-threads-run", "--json", str(out)] + TINY[model] \
        + ([] if TORCH else ["--no-torch"])
    proc = subprocess.run(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert len(report["load_average"]["start"]) == 3 and report["cores"] >= 1
    rows = {(r["impl"], r["ranks"]): r for r in report["rows"]}
    expected = {("refimpl", 1), ("refimpl", 2)} | ({("torch", 1), ("torch", 2)} if TORCH else set())
    assert set(rows) == expected, sorted(rows)
    assert report["settings"]["models"] == [model]
    for row in report["rows"]:
        assert ROW_FIELDS <= set(row), ROW_FIELDS - set(row)
        assert row["model"] == model
        assert row["samples_per_s"] > 0 and row["step_s"] > 0 and row["maxrss_bytes"] > 0
        assert row["threads"] == 1 and len(row["per_rank"]) == row["ranks"]
    one, two = rows["refimpl", 1], rows["refimpl", 2]
    assert (one["grid"], two["grid"]) == ([1, 1, 1, 1], [2, 1, 1, 1])
    assert one["numpy_peak_bytes"] > 0 and two["numpy_peak_bytes"] > 0
    if TORCH:
        torch1, ddp = rows["torch", 1], rows["torch", 2]
        assert torch1["params"] == one["params"] == ddp["params"]      # the same network in both
        assert f"{model}: {one['params']:,} parameters in refimpl and in torch" in proc.stdout
        assert one["ratio_vs_torch"] == pytest.approx(one["samples_per_s"] / torch1["samples_per_s"])
        assert two["ratio_vs_torch"] == pytest.approx(two["samples_per_s"] / ddp["samples_per_s"])
        assert torch1["numpy_peak_bytes"] is None
    else:
        assert "n/a" in proc.stdout
    assert "samples/s" in proc.stdout and "load average" in proc.stdout


@pytest.mark.skipif(not TORCH, reason="PyTorch is not installed")
def test_interleaved_rounds(tmp_path):
    """--rounds 2: every run twice, the second round in reverse order; each row with its round and
    the load average at its start; the per-round ratio table and its median."""
    out = tmp_path / "rounds.json"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--model", "cosmoflow", "--grids", "1,1,1,1",
           "--size", "8", "--steps", "1", "--no-threads-run", "--rounds", "2", "--json", str(out)] + TINY["cosmoflow"]
    proc = subprocess.run(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["settings"]["rounds"] == 2
    runs = [line.split(": ", 2)[1] for line in proc.stdout.splitlines() if line.startswith("#   round ")]
    assert runs == ["refimpl cosmoflow 1,1,1,1 threads 1", "torch cosmoflow 1 process threads 1",
                    "torch cosmoflow 1 process threads 1", "refimpl cosmoflow 1,1,1,1 threads 1"], runs
    assert sorted((r["round"], r["impl"]) for r in report["rows"]) == [
        (1, "refimpl"), (1, "torch"), (2, "refimpl"), (2, "torch")]
    assert all(r["load_1min"] >= 0 for r in report["rows"])
    (row,) = report["ratio_summary"]
    ours = {r["round"]: r for r in report["rows"] if r["impl"] == "refimpl"}
    theirs = {r["round"]: r for r in report["rows"] if r["impl"] == "torch"}
    ratios = [x["ratio"] for x in row["rounds"]]
    assert ratios == pytest.approx([ours[i]["samples_per_s"] / theirs[i]["samples_per_s"] for i in (1, 2)])
    assert row["median"] == pytest.approx(sum(ratios) / 2) and row["min"] == min(ratios)
    assert [x["load_torch"] for x in row["rounds"]] == [theirs[i]["load_1min"] for i in (1, 2)]
    assert "refimpl/torch per round" in proc.stdout and "median" in proc.stdout


def test_bad_rounds_are_rejected(capsys):
    for argv, message in ((["--rounds", "0"], "--rounds must be >= 1"),
                          (["--rounds", "x"], "invalid int value"),
                          (["--watchdog", "--rounds", "2"], "--watchdog takes --watchdog-rounds")):
        with pytest.raises(SystemExit) as exit_info:
            load_script().parse_args(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_model_selection():
    parse = load_script().parse_args
    assert parse([]).models == ["cosmoflow", "unet3d"]
    assert parse(["--model", "unet3d"]).models == ["unet3d"]
    assert parse(["--model", "unet3d,cosmoflow"]).models == ["unet3d", "cosmoflow"]
    assert parse(["--models", "cosmoflow", "unet3d"]).models == ["cosmoflow", "unet3d"]   # the older spelling


@pytest.mark.parametrize("value, message", [
    (["foo"], "unknown model 'foo'"), (["cosmoflow,"], "empty name in 'cosmoflow,'"),
    (["cosmoflow,,unet3d"], "empty name"), (["UNet3D"], "unknown model 'UNet3D'"),
    (["unet3d,unet3d"], "unet3d is listed more than once"), ([], "expected at least one argument")])
def test_bad_model_is_rejected(capsys, value, message):
    with pytest.raises(SystemExit) as exit_info:
        load_script().parse_args(["--model"] + value)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_size_must_halve_through_every_unet_level():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", "unet3d", "--size", "12", "--unet-layers", "3"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "--size 12 must be divisible by 2^3 for unet3d" in proc.stderr


@pytest.mark.skipif(not TORCH, reason="PyTorch is not installed")
@pytest.mark.parametrize("levels, width", [(1, 3), (2, 2)])
def test_torch_unet_is_refimpl_unet(levels, width):
    """Same weights in, same logits, loss and gradients out (float64): the baseline does the same work."""
    import torch
    from refimpl.models import build_model
    bench = load_script()
    args = bench.parse_args(["--quick", "--size", "8", "--unet-layers", str(levels), "--unet-width", str(width)])
    config = bench.model_config(args, "unet3d")
    ours = build_model("unet3d", config, seed=0, dtype="float64")
    net, loss_fn = bench.torch_model("unet3d", config)
    net = net.double().train()
    theirs = dict(net.named_parameters())
    # the twin (refimpl/oracle/model_twins.py) names its parameters as refimpl does
    pairs = [(p, theirs[name]) for name, p in ours.named_parameters()]
    assert len(pairs) == len(theirs)
    with torch.no_grad():
        for p, t in pairs:
            t.copy_(torch.from_numpy(p.data))
    x, y = bench.synthetic_batch("unet3d", config, 2, seed=1)
    x = x.astype(numpy.float64)
    ours.train()
    ours.zero_grad()
    out = ours.forward(x)
    loss, dout, _ = ours.loss(out, y)
    ours.backward(dout)
    t_out = net(torch.from_numpy(x))
    t_loss = loss_fn(t_out, torch.from_numpy(y))
    t_loss.backward()
    numpy.testing.assert_allclose(out, t_out.detach().numpy(), rtol=1e-10, atol=1e-12)
    assert loss == pytest.approx(t_loss.item(), rel=1e-12)
    for p, t in pairs:
        numpy.testing.assert_allclose(p.grad, t.grad.numpy(), rtol=1e-9, atol=1e-12)


def test_bad_batch_for_grid_is_rejected():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--grids", "2,1,1,1", "--batch", "3"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "--batch 3 must be divisible" in proc.stderr


def test_watchdog_cost_mode(tmp_path):
    """--watchdog: step time with and without the fail-stop watchdog, per model and grid."""
    out = tmp_path / "watchdog.json"
    cmd = [sys.executable, str(SCRIPT), "--watchdog", "--quick", "--model", "cosmoflow", "--grids", "2,1,1,1",
           "--size", "8", "--steps", "1", "--watchdog-rounds", "2", "--json", str(out)] + TINY["cosmoflow"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = json.loads(out.read_text())["watchdog"]
    assert row["model"] == "cosmoflow" and row["grid"] == [2, 1, 1, 1] and row["steps"] == 2
    assert row["step_s_on"] > 0 and row["step_s_off"] > 0
    assert row["overhead"] == pytest.approx(row["step_s_on"] / row["step_s_off"] - 1)
    assert re.search(r"cosmoflow +2,1,1,1 +2 +2 .*%", proc.stdout), proc.stdout


def test_device_options():
    """``--device cuda --help`` explains --tf32; ``--tf32 on`` off a GPU is refused; ``--device
    cuda`` where CuPy finds no GPU ends with one line, exit 2, before anything is launched."""
    run = lambda *a: subprocess.run([sys.executable, str(SCRIPT), *a], capture_output=True, text=True, timeout=60)
    proc = run("--device", "cuda", "--help")
    assert proc.returncode == 0 and "--tf32" in proc.stdout and "allow_tf32 = False" in proc.stdout
    proc = run("--tf32", "on")
    assert proc.returncode == 2 and "--tf32 on needs --device cuda" in proc.stderr
    from refimpl import settings
    if settings.cupy_unavailable() is None:
        pytest.skip("a CUDA device is here: gpu_check.sh runs --device cuda")
    proc = run("--device", "cuda", "--quick")
    assert proc.returncode == 2 and proc.stderr.startswith("bench_train: --device cuda:"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_strict_device_run(tmp_path):
    """The device path on the host stand-in (REFIMPL_BACKEND=strict: any hidden host sync or
    NumPy call on a device array fails), 1 and 2 ranks, kernel 2 (MLPerf's); the JSON says so."""
    out = tmp_path / "strict.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--device", "strict", "--kernel", "2",
                           "--model", "cosmoflow", "--grids", "1,1,1,1", "2,1,1,1", "--size", "8", "--steps", "1",
                           "--no-threads-run", "--json", str(out)] + TINY["cosmoflow"] + ([] if TORCH else ["--no-torch"]),
                          env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert (report["settings"]["device"], report["settings"]["tf32"], report["settings"]["kernel"]) == ("strict", "off", 2)
    assert {r["ranks"] for r in report["rows"] if r["impl"] == "refimpl"} == {1, 2}
    assert all(numpy.isfinite(r["loss"]) for r in report["rows"])
    assert "# device strict" in proc.stdout
    ddp = "gloo" if TORCH else None                  # the torch DDP backend, in the header and the JSON
    assert report["torch_ddp_backend"] == ddp and report["gpu"] is None
    assert ("torch DDP backend gloo" in proc.stdout) == TORCH


def test_device_defaults():
    """``--device cuda`` without --quick runs the issue's sizes: CosmoFlow's ``mlperf`` preset
    (kernel 2) and the U-Net's ``default`` preset at 128^3, batch 4, 1 and 2 ranks; --quick and
    explicit flags win; the CPU and strict defaults are unchanged."""
    from refimpl.models.presets import PRESETS
    bench = load_script()
    cosmo, unet = PRESETS["cosmoflow"]["mlperf"], PRESETS["unet3d"]["default"]
    args = bench.parse_args(["--device", "cuda"])
    assert (args.size, args.width, args.layers, args.kernel, args.fc1, args.fc2) == (
        cosmo["input_shape"][1], cosmo["conv_size"], cosmo["n_conv_layers"], cosmo["kernel_size"],
        cosmo["fc1_size"], cosmo["fc2_size"]) == (128, 32, 5, 2, 128, 64)
    assert (args.unet_width, args.unet_layers, unet["input_shape"][1]) == (unet["base_width"], unet["levels"], 128)
    assert (args.batch, args.grids) == (4, ["1,1,1,1", "2,1,1,1"])
    assert bench.model_config(args, "cosmoflow")["kernel_size"] == 2
    args = bench.parse_args(["--device", "cuda", "--size", "64", "--kernel", "3", "--grids", "1,1,1,1"])
    assert (args.size, args.kernel, args.width, args.grids) == (64, 3, 32, ["1,1,1,1"])
    for device in ("cpu", "strict"):
        args = bench.parse_args(["--device", device])
        assert (args.size, args.width, args.kernel, args.grids) == (64, 16, 3, list(bench.DEFAULT_GRIDS))
        args = bench.parse_args(["--device", device, "--quick"])
        assert (args.size, args.kernel) == (16, 3)
    assert (bench.parse_args(["--device", "cuda", "--quick"]).size, bench.parse_args(["--quick"]).kernel) == (16, 3)


def test_device_missing_torch(monkeypatch):
    """CuPy sees a GPU but PyTorch has no CUDA: refused, unless --no-torch (the line says so)."""
    torch = pytest.importorskip("torch")
    from refimpl import settings
    bench = load_script()
    monkeypatch.setattr(settings, "cupy_unavailable", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "--no-torch skips it" in bench.device_missing("cuda", use_torch=True)
    assert bench.device_missing("cuda", use_torch=False) is None
    assert bench.device_missing("strict") is None and bench.device_missing("cpu") is None
