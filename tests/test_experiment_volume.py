"""scripts/experiment_volume.py: its flags, its pieces, and one tiny end-to-end run (well under a minute).

The --quick run (minutes) and the full run (about 40 minutes) are not for CI; what they rest on
is checked here: every flag refused with a message, the run config refimpl train accepts, the
floor on generated data, the network scored in eval mode as refimpl train's own validation
scores it, and the JSON / table / plot built from the results.
"""
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "experiment_volume.py"
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MPLBACKEND="Agg")


def load_script():
    spec = importlib.util.spec_from_file_location("experiment_volume", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ev = load_script()


def test_help_explains_the_design():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, env=ENV,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    for words in ("--quick", "--floor-only", "global average pool", "--data-seeds", "the floor", "--jobs",
                  "capacity does NOT grow with the volume"):
        assert words in text, words


@pytest.mark.parametrize("argv, message", [
    (["--sizes", "16,20"], "multiple of 2^--blocks = 8"),
    (["--sizes", "16,x"], "--sizes must be comma-separated integers"),
    (["--sizes", "16,16"], "--sizes repeats a value"),
    (["--sizes", "8", "--blocks", "4"], "multiple of 2^--blocks = 16"),
    (["--data-seeds", "0,100"], "share universes"),
    (["--data-seeds", "-1"], "--data-seeds must be integers >= 0"),
    (["--train-seeds", "0,0"], "--train-seeds repeats a value"),
    (["--samples", "8"], "must be at least --batch"),
    (["--epochs", "0"], "--epochs must be a positive integer"),
    (["--jobs", "0"], "--jobs must be a positive integer"),
    (["--lr", "nan"], "--lr must be a positive number"),
    (["--decay-at", "0"], "--decay-at must be a fraction in (0, 1]"),
    (["--folds", "1"], "--folds must be in [2, --samples"),
    (["--sizes", "8", "--bins", "40"], "without a Fourier mode"),
    (["--report", "/nonexistent/volume.json"], "--report /nonexistent/volume.json: no such file"),
    (["--out", "/dev/null"], "--out /dev/null exists and is not a directory"),
    (["--grid", "1,2,1"], "--grid must be 4 positive integers Pn,Pd,Ph,Pw, got '1,2,1'"),
    (["--grid", "1,0,1,1"], "--grid must be 4 positive integers"),
    (["--grid", "1,a,1,1"], "--grid must be 4 positive integers"),
    (["--grid", "3,1,1,1"], "--grid 3,1,1,1 cannot train the 8^3 network: Pn = 3 sample groups do not divide "
                            "the batch of 16"),
    (["--grid", "1,1,16,1", "--sizes", "8,16"], "cannot train the 8^3 network: Ph = 16 ranks on an extent of 8"),
    (["--grid", "1,2,1,1", "--launcher", "mpiexec -n 2"], "--launcher must hold {ranks}"),
    (["--grid", "1,2,1,1", "--launcher", "no-such-launcher -n {ranks}"], "no-such-launcher is not on PATH"),
    (["--grid", "1,2,1,1", "--launcher", "'mpiexec -n {ranks}"], "No closing quotation"),
    (["--backend", "gpu"], "invalid choice: 'gpu'"),
])
def test_bad_flags_are_refused_naming_them(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        ev.parse_args(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_cupy_where_it_cannot_run_is_refused_before_any_data(capsys):
    from refimpl import settings
    reason = settings.cupy_unavailable()
    if reason is None:                          # a machine with CuPy and a GPU: the flag is accepted
        assert ev.parse_args(["--quick", "--backend", "cupy"]).backend == "cupy"
        return
    with pytest.raises(SystemExit) as stop:
        ev.parse_args(["--quick", "--backend", "cupy"])
    assert stop.value.code == 2 and f"--backend cupy: {reason}" in capsys.readouterr().err


def test_a_grid_of_more_ranks_runs_under_the_launcher(tmp_path):
    """The run config carries --grid and --backend; one rank runs bare, more run under --launcher
    with {ranks} filled in."""
    args = ev.parse_args(["--quick", "--grid", "2,1,2,1", "--launcher", "mpirun -np {ranks} --bind-to none"])
    assert args.grid == [2, 1, 2, 1] and ev.ranks(args) == 4
    cmd = ev.train_command(args, "c.toml", "data", "run", [])
    assert cmd[:5] == ["mpirun", "-np", "4", "--bind-to", "none"] and cmd[5:9] == [sys.executable, "-m", "refimpl",
                                                                                  "train"]
    single = ev.parse_args(["--quick"])
    assert ev.train_command(single, "c.toml", "data", "run", ["--no-cache"])[:4] == [sys.executable, "-m",
                                                                                    "refimpl", "train"]
    from refimpl import config as run_config
    path = tmp_path / "c.toml"
    ev.write_config(path, ev.parse_args(["--quick", "--grid", "1,2,1,1", "--backend", "strict"]), 16, seed=0)
    table = run_config.load_toml(path)
    run_config.validate({**run_config.DEFAULTS, **table})
    assert (table["grid"], table["backend"]) == ("1,2,1,1", "strict")


def test_quick_and_full_settings_and_a_flag_beats_both():
    quick, full = ev.parse_args(["--quick"]), ev.parse_args([])
    assert quick.sizes == full.sizes == [8, 16, 24, 32, 48]
    assert (quick.samples, len(quick.data_seeds), len(quick.train_seeds)) == (512, 2, 1)
    assert (full.samples, len(full.data_seeds), len(full.train_seeds)) == (2048, 3, 2)
    assert ev.parse_args(["--quick", "--samples", "64", "--sizes", "24,8"]).samples == 64
    assert ev.parse_args(["--quick", "--sizes", "24,8"]).sizes == [8, 24]


def test_the_network_is_the_same_at_every_size(tmp_path):
    """One parameter count at every size (the global average pool), and a run config that
    refimpl train's own validation accepts, with the decay step and the model family."""
    from refimpl import config as run_config
    from refimpl.models.cosmoflow import check_config
    args = ev.parse_args(["--quick"])
    counts = {ev.parameter_count(args, s) for s in args.sizes}
    assert len(counts) == 1
    path = tmp_path / "c.toml"
    ev.write_config(path, args, 24, seed=1)
    table = run_config.load_toml(path)
    merged = {**run_config.DEFAULTS, **table}
    run_config.validate(merged)
    assert table["decay"] == f"{round(0.75 * ev.steps(args))}:0.1" and table["seed"] == 1
    assert check_config(table["model_config"])["global_pool"] == "avg"
    ev.write_config(path, ev.parse_args(["--quick", "--decay-at", "1"]), 24, seed=1)
    assert "decay" not in run_config.load_toml(path)


def test_chunks_tile_the_sample():
    assert [ev.chunk_edge(s) for s in (8, 16, 24, 32, 48, 40, 96)] == [8, 16, 24, 32, 24, 20, 32]


def test_one_experiment_per_out(tmp_path, capsys):
    held = ev.lock_out(str(tmp_path))
    try:
        with pytest.raises(SystemExit) as stop:
            ev.lock_out(str(tmp_path))
        assert stop.value.code == 2 and "in use by another experiment_volume" in capsys.readouterr().err
    finally:
        held.close()


def fake_results(sizes=(8, 16, 32)):
    """Floors and runs whose validation MAE is exactly 0.4 (voxels / 512)^-0.25 (floor: half of it)."""
    floors, nets = [], []
    for s in sizes:
        v = 0.4 * (s ** 3 / 512) ** -0.25
        for seed, shift in ((1, -0.01), (2, 0.01)):
            floors.append({"size": s, "data_seed": seed, "train_mae": v / 2 - 0.01, "val_mae": v / 2 + shift,
                           "val_mae_per_target": [v / 2] * 4, "constant_mae": 0.5})
            nets.append({"size": s, "data_seed": seed, "train_seed": 0, "train_mae": v - 0.02, "val_mae": v + shift,
                         "val_mae_per_target": [v] * 4, "train_s": 1.0})
    return floors, nets


def test_summary_table_slope_and_plot(tmp_path):
    args = ev.parse_args(["--quick", "--sizes", "8,16,32"])
    floors, nets = fake_results()
    rows = ev.summarise(args, floors, nets)
    assert [r["size"] for r in rows] == [8, 16, 32]
    assert math.isclose(rows[1]["network"]["val_mae"]["mean"], 0.4 * 8 ** -0.25)
    assert math.isclose(rows[1]["network"]["val_mae"]["std"], math.sqrt(2) * 0.01)
    assert rows[0]["parameters"] == rows[2]["parameters"]
    assert math.isclose(ev.slope(rows, "network"), -0.25) and math.isclose(ev.slope(rows, "floor"), -0.25)
    text = ev.table(rows)
    assert text.count("\n") == 4 and "| 16³ | 512 |" in text and "±" in text
    per = ev.per_target_table(rows)
    assert "log10_damping_k" in per and f"| 8³ | {0.4:.3f} / {0.2:.3f} |" in per
    png = tmp_path / "v.png"
    ev.plot(rows, str(png), "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    only_floor = ev.summarise(args, floors, [])
    assert "network" not in only_floor[0] and ev.slope(only_floor, "network") is None
    assert "| — | — |" in ev.table(only_floor) and "| — / 0.200 |" in ev.per_target_table(only_floor)


def test_tiny_run_end_to_end(tmp_path):
    """Data, floor, one training run, its evaluation, the JSON and the plot: 8^3 and 16^3, 32
    samples, one epoch.  The eval-mode validation MAE is refimpl train's own final validation
    (16 validation samples = one batch: the same samples, the same weights)."""
    out, report, png = tmp_path / "out", tmp_path / "v.json", tmp_path / "v.png"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--sizes", "8,16", "--samples", "32", "--val-samples", "16", "--data-seeds",
         "7,1007", "--train-seeds", "0", "--epochs", "1", "--bins", "4", "--folds", "4", "--jobs", "2",
         "--out", str(out), "--json", str(report), "--plot", str(png)],
        capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(report.read_text())
    assert [r["size"] for r in result["sizes"]] == [8, 16] and png.is_file()
    for row in result["sizes"]:
        for who in ("network", "floor"):
            for split in ("train_mae", "val_mae"):
                s = row[who][split]
                assert 0 < s["min"] <= s["mean"] <= s["max"] < 1.2 and s["n"] == (2 if who == "floor" else 2)
        assert row["parameters"] == result["sizes"][0]["parameters"]
    assert len(result["runs"]) == 4 and len(result["floors"]) == 4
    for run in result["runs"]:
        name = f"S{run['size']}_seed{run['data_seed']}_train{run['train_seed']}"
        rows = [json.loads(line) for line in open(out / "runs" / name / "metrics.jsonl") if line.strip()]
        final = [r for r in rows if r["split"] == "val"][-1]
        assert math.isclose(run["val_mae"], final["mae"], rel_tol=1e-5), (run["val_mae"], final["mae"])
    assert "| 16³ | 32 |" in proc.stdout and "validation MAE ~ volume^" in proc.stdout
    # --report: the same tables from the JSON, and the plot redrawn, without running anything
    redrawn = tmp_path / "again.png"
    shown = subprocess.run([sys.executable, str(SCRIPT), "--report", str(report), "--plot", str(redrawn)],
                           capture_output=True, text=True, env=ENV, timeout=60)
    assert shown.returncode == 0 and redrawn.is_file(), shown.stderr
    assert ev.table(result["sizes"]) in proc.stdout and ev.table(result["sizes"]) in shown.stdout
    # a second run reuses the data and refuses nothing
    again = subprocess.run(
        [sys.executable, str(SCRIPT), "--sizes", "8", "--samples", "32", "--val-samples", "16", "--data-seeds",
         "7", "--bins", "4", "--folds", "4", "--floor-only", "--jobs", "1", "--out", str(out)],
        capture_output=True, text=True, env=ENV, timeout=120)
    assert again.returncode == 0 and "(reused)" in again.stdout, again.stderr


def test_tiny_run_split_over_ranks_on_the_device_stand_in(tmp_path):
    """The same experiment with every training run split over 4 ranks (2 sample groups x 2 along
    D) on the strict CuPy stand-in: each run trains under mpiexec on that grid and backend, and
    the network scored afterwards on the host is the one refimpl train validated."""
    from launcher import run_launched
    if shutil.which("mpiexec") is None:
        pytest.fail("mpiexec not found: pip install 'refimpl[mpi]' installs Open MPI's mpiexec")
    out, report = tmp_path / "out", tmp_path / "v.json"
    proc = run_launched(
        [sys.executable, str(SCRIPT), "--sizes", "8,16", "--samples", "32", "--val-samples", "16", "--data-seeds",
         "7", "--train-seeds", "0", "--epochs", "1", "--bins", "4", "--folds", "4", "--jobs", "1",
         "--grid", "2,2,1,1", "--backend", "strict", "--out", str(out), "--json", str(report)],
        env=dict(ENV, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "each on grid 2,2,1,1 (4 processes, backend strict)" in proc.stdout
    result = json.loads(report.read_text())
    assert result["settings"]["grid"] == [2, 2, 1, 1] and result["settings"]["backend"] == "strict"
    for run in result["runs"]:
        run_dir = out / "runs" / f"S{run['size']}_seed{run['data_seed']}_train{run['train_seed']}"
        config = json.loads((run_dir / "config.json").read_text())
        assert (config["grid"], config["backend"]) == ("2,2,1,1", "strict")
        rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl") if line.strip()]
        final = [r for r in rows if r["split"] == "val"][-1]
        assert math.isclose(run["val_mae"], final["mae"], rel_tol=1e-5), (run["val_mae"], final["mae"])
