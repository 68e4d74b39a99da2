"""``refimpl train`` end to end under mpiexec: outputs, SIGKILL + --resume bit for bit, bad input.

Every run is tiny (cosmoflow tiny preset: 4 x 16^3 samples, 1-3 ranks) and has a
timeout, so a rank that hangs (instead of exiting with the others) fails the test.
"""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy
import pytest

pytest.importorskip("mpi4py", reason="mpi4py is not installed: pip install 'refimpl[mpi]'")
h5py = pytest.importorskip("h5py")

from launcher import run_launched  # noqa: E402
from refimpl.checkpoint import read_file  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 240


def mpi_env():
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def train_cmd(n, *args):
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        pytest.fail("mpiexec not found: pip install 'refimpl[mpi]'")
    return [mpiexec, "--oversubscribe", "-n", str(n), sys.executable, "-m", "refimpl", "train",
            "--quiet", *map(str, args)]


def train(n, *args, timeout=TIMEOUT_S):
    try:
        return run_launched(train_cmd(n, *args), cwd=ROOT, env=mpi_env(), timeout=timeout)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"refimpl train {args} hung for {timeout}s (a rank did not exit)\n{err.stdout}\n{err.stderr}")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A tiny cosmoflow dataset matching the tiny preset (4 x 16^3)."""
    out = tmp_path_factory.mktemp("data")
    subprocess.run([sys.executable, "-m", "refimpl", "datagen", "cosmoflow", "--out", str(out),
                    "--samples", "24", "--val-samples", "4", "--size", "16", "--quiet"],
                   check=True, cwd=ROOT, timeout=TIMEOUT_S)
    return out


def metric_rows(out):
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def model_arrays(path):
    arrays, meta = read_file(path)
    return {k: v for k, v in arrays.items() if not k.startswith("buffers/")}, meta


# ---------------------------------------------------------------- runs that succeed

@pytest.mark.parametrize("nranks,grid", [(2, "1,2,1,1"), (3, "3,1,1,1")])
def test_short_run_writes_outputs(tmp_path, data_dir, nranks, grid):
    out = tmp_path / "run"
    proc = train(nranks, "--grid", grid, "--data", data_dir, "--steps", 4, "--global-batch", nranks,
                 "--checkpoint-every", 2, "--validate-every", 2, "--out", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("checkpoint.h5", "metrics.jsonl", "loss.png", "config.json", "summary.json"):
        assert (out / name).is_file(), name
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = metric_rows(out)
    assert [r["step"] for r in rows if r["split"] == "train"] == [1, 2, 3, 4]
    assert [r["step"] for r in rows if r["split"] == "val"] == [2, 4]
    assert all(numpy.isfinite(r["loss"]) and "mae" in r for r in rows)
    _, meta = read_file(out / "checkpoint.h5")
    assert meta["step"] == 4 and meta["config"]["grid"] == grid and meta["world_size"] == nranks


def test_log_lines_carry_an_eta_from_this_runs_pace(tmp_path):
    """A job log has no progress bar: each log line but the last says how long the rest takes
    at this run's pace (H:MM:SS, M:SS under an hour)."""
    from refimpl.train_report import format_duration
    assert [format_duration(s) for s in (0, 0.2, 59.5, 61, 3600, 3725.4)] == \
        ["0:00", "0:01", "1:00", "1:01", "1:00:00", "1:02:06"]
    out = tmp_path / "run"
    proc = train(1, "--steps", 6, "--log-every", 2, "--gen-samples", 8, "--gen-val-samples", 4, "--no-plot",
                 "--out", out, "--no-quiet")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 3 and all(" | eta " in line for line in lines[:2]) and " | eta " not in lines[2], lines


def test_generates_data_when_none_given(tmp_path):
    out = tmp_path / "gen"
    proc = train(2, "--grid", "1,1,2,1", "--steps", 2, "--gen-samples", 8, "--gen-val-samples", 4,
                 "--out", out, "--no-plot")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (out / "data" / "train.h5").is_file() and (out / "data" / "val.h5").is_file()
    assert (out / "checkpoint.h5").is_file()


def test_sigkill_then_resume_equals_uninterrupted_bit_for_bit(tmp_path, data_dir):
    steps, common = 40, ["--grid", "1,2,1,1", "--data", data_dir, "--global-batch", 2,
                         "--optimizer", "sgd", "--lr", 0.01, "--checkpoint-every", 3,
                         "--validate-every", 10, "--no-plot"]
    whole = tmp_path / "whole"
    proc = train(2, *common, "--steps", steps, "--out", whole)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    killed = tmp_path / "killed"
    kill_at = random.Random(os.getpid()).randint(5, 25)
    runner = subprocess.Popen(train_cmd(2, *common, "--steps", steps, "--out", killed), cwd=ROOT,
                              env=mpi_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while time.monotonic() < deadline and runner.poll() is None:
            if (killed / "metrics.jsonl").exists():
                done = [json.loads(x)["step"] for x in open(killed / "metrics.jsonl") if x.strip()]
                if done and max(done) >= kill_at:
                    break
            time.sleep(0.01)
        assert runner.poll() is None, "the run ended before it could be killed"
    finally:
        os.killpg(runner.pid, signal.SIGKILL)      # mpiexec and every rank, no clean-up
        runner.wait()
    _, meta = read_file(killed / "checkpoint.h5")
    assert 3 <= meta["step"] < steps and meta["step"] % 3 == 0

    # the ranks outlive mpiexec for a moment (OUT/.lock names rank 0 until it is gone); the lock is
    # left behind where rank 0 itself died by SIGKILL (tests/test_faults.py), so resume as a
    # requeue script would: --break-lock takes over only a lock whose holder is gone
    holder = json.loads((killed / ".lock").read_text())["pid"]
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{holder}") and time.monotonic() < deadline:
        time.sleep(0.05)
    proc = train(2, *common, "--steps", steps, "--out", killed, "--resume", "--break-lock")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    a, meta_a = model_arrays(whole / "checkpoint.h5")
    b, meta_b = model_arrays(killed / "checkpoint.h5")
    assert meta_a["step"] == meta_b["step"] == steps
    assert sorted(a) == sorted(b) and any(k.startswith("optimizer/") for k in a)
    for key in a:
        assert numpy.array_equal(a[key], b[key]), key
    assert meta_a["loader"] == meta_b["loader"] and meta_a["dropout"] == meta_b["dropout"]
    # the metrics log of the resumed run has every step exactly once
    assert [r["step"] for r in metric_rows(killed) if r["split"] == "train"] == list(range(1, steps + 1))


# ---------------------------------------------------------------- bad input: status 2 everywhere

def test_optimizer_sharding_checkpoints_move_to_and_from_the_plain_update(tmp_path, data_dir):
    """--optimizer-sharding (the distributed weight update) saves the plain optimizer state: 2 steps
    with it on (2,1,1,1) resumed without it on (1,2,1,1), and 2 plain steps resumed with it on
    (1,1,2,1), each end 4 steps later where 4 plain steps on (2,1,1,1) end (float64, 1e-12)."""
    common = ["--data", data_dir, "--dtype", "float64", "--optimizer", "adam", "--weight-decay", "0.001",
              "--global-batch", "4"]
    plain = tmp_path / "plain"
    assert train(2, "--grid", "2,1,1,1", "--steps", 4, "--out", plain, *common).returncode == 0
    off = tmp_path / "off.toml"
    off.write_text("optimizer_sharding = false\n")
    runs = {"sharded->plain": ((["--optimizer-sharding"], "2,1,1,1"), (["--config", off], "1,2,1,1")),
            "plain->sharded": (([], "2,1,1,1"), (["--optimizer-sharding"], "1,1,2,1"))}
    want, _ = model_arrays(plain / "checkpoint.h5")
    for name, ((first, grid1), (second, grid2)) in runs.items():
        out = tmp_path / name.replace(">", "")
        proc = train(2, "--grid", grid1, "--steps", 2, "--out", out, *common, *first)
        assert proc.returncode == 0, proc.stderr
        proc = train(2, "--grid", grid2, "--steps", 4, "--out", out, "--resume", *second)
        assert proc.returncode == 0, proc.stderr
        got, meta = model_arrays(out / "checkpoint.h5")
        assert meta["step"] == 4 and got.keys() == want.keys()
        for key, value in want.items():
            err = numpy.abs(got[key] - value).max() / max(numpy.abs(value).max(), 1e-300)
            assert err <= 1e-12, (name, key, err)


@pytest.mark.parametrize("spec", ["int8", "topk:0.01"])
def test_compressed_exchange_resumes_bit_for_bit(tmp_path, data_dir, spec):
    """--compress: the error-feedback residuals are saved per rank, so 2 steps + --resume to 4
    equal 4 uninterrupted steps bit for bit; the bytes sent are reported per step."""
    common = ["--data", data_dir, "--grid", "2,1,1,1", "--compress", spec, "--checkpoint-every", 2]
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert train(2, "--steps", 4, "--out", whole, *common).returncode == 0
    assert train(2, "--steps", 2, "--out", split, *common).returncode == 0
    proc = train(2, "--steps", 4, "--out", split, "--resume")
    assert proc.returncode == 0, proc.stderr
    a, _ = model_arrays(whole / "checkpoint.h5")
    b, _ = model_arrays(split / "checkpoint.h5")
    assert a.keys() == b.keys() and any(k.startswith("rank/1/compress/") for k in a)
    assert all(numpy.array_equal(a[k], b[k]) for k in a)
    summary = json.loads((whole / "summary.json").read_text())["gradient_exchange"]
    assert 0 < summary["bytes_sent_per_step"] < summary["bytes_uncompressed"] / (3 if spec == "int8" else 40)
    assert all(r["grad_bytes_sent"] == summary["bytes_sent_per_step"] for r in metric_rows(whole)
               if r["split"] == "train")


def expect_error(proc, *fragments):
    text = proc.stderr
    assert proc.returncode == 2, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "refimpl train: error:" in text, text
    for fragment in fragments:
        assert fragment in text, f"{fragment!r} not in:\n{text}"


def write_cosmo(path, full, targets):
    with h5py.File(path, "w") as f:
        f.create_dataset("full", data=full)
        f.create_dataset("unitPar", data=targets)


def test_grid_not_matching_ranks(tmp_path, data_dir):
    expect_error(train(2, "--grid", "2,2,1,1", "--data", data_dir, "--out", tmp_path / "o"),
                 "holds 4 ranks", "started 2")


def test_global_batch_not_divisible(tmp_path, data_dir):
    expect_error(train(2, "--grid", "2,1,1,1", "--global-batch", 3, "--data", data_dir,
                       "--out", tmp_path / "o"), "--global-batch 3", "divisible by Pn=2")


def test_wrong_sample_shape_and_dtype(tmp_path):
    rng = numpy.random.default_rng(0)
    small = tmp_path / "small"
    small.mkdir()
    write_cosmo(small / "train.h5", rng.random((4, 4, 12, 12, 12), dtype=numpy.float32),
                rng.random((4, 4), dtype=numpy.float32))
    expect_error(train(2, "--grid", "1,2,1,1", "--data", small, "--out", tmp_path / "o"),
                 "(4, 12, 12, 12)", "expects (4, 16, 16, 16)")
    wide = tmp_path / "wide"
    wide.mkdir()
    write_cosmo(wide / "train.h5", rng.random((4, 4, 16, 16, 16)), rng.random((4, 4), dtype=numpy.float32))
    expect_error(train(2, "--grid", "1,2,1,1", "--data", wide, "--out", tmp_path / "o"), "float32")


def test_sample_size_not_divisible_for_the_model(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('model = "cosmoflow"\n[model_config]\ninput_shape = [4, 18, 16, 16]\n')
    expect_error(train(2, "--config", cfg, "--grid", "1,2,1,1", "--out", tmp_path / "o"),
                 "divisible by 4")


def test_nan_in_one_ranks_block(tmp_path, data_dir):
    bad = tmp_path / "nan"
    bad.mkdir()
    with h5py.File(data_dir / "train.h5") as f:
        full, targets = f["full"][:], f["unitPar"][:]
    full[5, 1, 12, 3, 3] = numpy.nan           # in the second depth block only: rank 1 of grid 1,2,1,1
    write_cosmo(bad / "train.h5", full, targets)
    expect_error(train(2, "--grid", "1,2,1,1", "--data", bad, "--out", tmp_path / "o"),
                 "NaN or Inf", "sample 5")


def test_unknown_config_key_and_missing_data(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text("learning_rate = 0.1\n")
    expect_error(train(2, "--config", cfg, "--out", tmp_path / "o"), "unknown key", "learning_rate")
    expect_error(train(2, "--data", tmp_path / "nowhere", "--out", tmp_path / "o"), "does not exist")


def test_per_sample_data_trains_as_the_single_file_does(tmp_path):
    """--data with train/ and val/ directories of one file per sample (datagen --layout
    per-sample, LBANN's layout) trains on a spatial grid exactly as the same samples in
    train.h5 / val.h5 do (log1p of the counts in both); a directory holding a split in both
    layouts, or in neither, is refused on every rank with one line."""
    def datagen(out, *layout):
        subprocess.run([sys.executable, "-m", "refimpl", "datagen", "cosmoflow", "--out", str(out), "--samples", "8",
                        "--val-samples", "4", "--size", "16", "--quiet", *layout], check=True, cwd=ROOT,
                       timeout=TIMEOUT_S)
    single, per_sample = tmp_path / "single", tmp_path / "per_sample"
    datagen(single)
    datagen(per_sample, "--layout", "per-sample")
    common = ("--grid", "1,2,1,1", "--global-batch", 4, "--steps", 3, "--validate-every", 3, "--no-plot")
    for data in (single, per_sample):
        proc = train(2, *common, "--data", data, "--out", tmp_path / f"run_{data.name}")
        assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [[{k: v for k, v in r.items() if k not in ("samples_per_s", "step_s")}    # timings differ
             for r in metric_rows(tmp_path / f"run_{d.name}")] for d in (single, per_sample)]
    assert rows[0] == rows[1] and len(rows[1]) == 4
    assert [r["split"] for r in rows[1]].count("val") == 1
    meta = read_file(tmp_path / "run_per_sample" / "checkpoint.h5")[1]
    assert meta["data"]["train"]["layout"] == "per-sample" and meta["data"]["train"]["samples"] == 8
    shutil.copytree(per_sample / "train", single / "train")
    expect_error(train(2, *common, "--data", single, "--out", tmp_path / "o"), "holds both", "train.h5",
                 "two layouts")
    expect_error(train(2, *common, "--data", tmp_path, "--out", tmp_path / "o2"), "nor a per-sample directory")


def test_damaged_checkpoint_refused_on_resume(tmp_path, data_dir):
    out = tmp_path / "run"
    proc = train(2, "--grid", "1,2,1,1", "--data", data_dir, "--steps", 2, "--out", out, "--no-plot")
    assert proc.returncode == 0, proc.stderr
    raw = bytearray((out / "checkpoint.h5").read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (out / "checkpoint.h5").write_bytes(bytes(raw))
    expect_error(train(2, "--out", out, "--resume", "--steps", 4), "damaged")
    expect_error(train(2, "--grid", "1,2,1,1", "--data", data_dir, "--out", out), "--resume", "--overwrite")
    expect_error(train(2, "--out", tmp_path / "fresh", "--resume"), "nothing to resume")


def test_resume_on_other_data_is_refused_unless_meant(tmp_path):
    """The checkpoint records its data (data/identity.py): data regenerated with another seed
    or count while the run was stopped is refused on --resume (exit 2, one line naming what
    changed); --data-changed-ok trains on it (a note says so, the order starts afresh where the
    count changed), and the next checkpoint records the new data.  --no-quiet undoes --quiet."""
    data, out = tmp_path / "data", tmp_path / "run"

    def datagen(seed, samples):
        subprocess.run([sys.executable, "-m", "refimpl", "datagen", "cosmoflow", "--out", str(data), "--overwrite",
                        "--samples", str(samples), "--val-samples", "4", "--size", "16", "--seed", str(seed),
                        "--quiet"], check=True, cwd=ROOT, timeout=TIMEOUT_S)
    datagen(1, 8)
    common = ("--data", data, "--global-batch", 2, "--no-plot", "--out", out)
    assert train(2, *common, "--steps", 2).returncode == 0
    assert read_file(out / "checkpoint.h5")[1]["data"]["train"]["samples"] == 8
    datagen(1, 8)                                          # the same generator, seed and sizes: the same data
    proc = train(2, *common, "--steps", 3, "--resume")
    assert proc.returncode == 0, proc.stderr
    datagen(2, 8)                                          # another seed: other data
    proc = train(2, *common, "--steps", 4, "--resume")
    expect_error(proc, "--resume: the train data in", "writer's seed 1 -> 2", "--data-changed-ok")
    datagen(2, 12)
    proc = train(2, *common, "--steps", 4, "--resume")
    expect_error(proc, "sample count 8 -> 12")
    proc = train(2, *common, "--steps", 4, "--resume", "--data-changed-ok", "--no-quiet")
    assert proc.returncode == 0, proc.stderr
    assert "training on it (--data-changed-ok)" in proc.stdout and "order starts afresh" in proc.stdout
    meta = read_file(out / "checkpoint.h5")[1]
    assert meta["data"]["train"]["samples"] == 12 and meta["config"]["data_changed_ok"] is False
    assert train(2, *common, "--steps", 5, "--resume").returncode == 0     # the record is the new data now


def test_nan_loss_stops_with_status_3_and_keeps_checkpoint(tmp_path, data_dir):
    out = tmp_path / "run"
    proc = train(2, "--grid", "2,1,1,1", "--data", data_dir, "--optimizer", "sgd", "--lr", "1e38",
                 "--steps", 6, "--checkpoint-every", 1, "--out", out, "--no-plot")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "loss became" in proc.stderr
    arrays, meta = read_file(out / "checkpoint.h5")
    assert all(numpy.isfinite(a).all() for k, a in arrays.items() if k.startswith("model/"))
    assert meta["step"] < 6


def test_unet_trains_on_a_spatial_grid_and_resumes(tmp_path):
    """The 3D U-Net from the CLI: generated segmentation data, 2 x 2 spatial blocks, Dice logged."""
    out = tmp_path / "unet"
    common = ("--model", "unet3d", "--preset", "tiny", "--grid", "1,2,2,1", "--gen-samples", 8,
              "--gen-val-samples", 4, "--global-batch", 2, "--validate-every", 3, "--out", out)
    proc = train(4, *common, "--steps", 3)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = metric_rows(out)
    assert [r["step"] for r in rows if r["split"] == "train"] == [1, 2, 3]
    assert all(0.0 <= r["dice"] <= 1.0 and numpy.isfinite(r["loss"]) for r in rows)
    proc = train(4, *common, "--steps", 5, "--resume")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [r["step"] for r in metric_rows(out) if r["split"] == "train"] == [1, 2, 3, 4, 5]


def test_model_parallel_run_saves_whole_parameters_and_resumes_on_another_grid(tmp_path, data_dir):
    """--grid with a model axis and --model-parallel filter: the checkpoint holds every parameter
    whole (the file does not depend on the grid), and a run resumed on a grid without the model
    axis ends where the uninterrupted model-parallel run ends (not bit for bit: sums reorder)."""
    common = ("--data", data_dir, "--global-batch", 2, "--optimizer", "sgd", "--lr", 0.01,
              "--checkpoint-every", 3, "--no-plot", "--model-parallel", "filter")
    whole, moved = tmp_path / "whole", tmp_path / "moved"
    assert train(2, *common, "--grid", "1,1,1,1,2", "--steps", 6, "--out", whole).returncode == 0
    assert train(2, *common, "--grid", "1,1,1,1,2", "--steps", 3, "--out", moved).returncode == 0
    proc = train(2, "--out", moved, "--resume", "--steps", 6, "--grid", "2,1,1,1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    a, meta_a = model_arrays(whole / "checkpoint.h5")
    b, meta_b = model_arrays(moved / "checkpoint.h5")
    assert meta_a["grid"] == [1, 1, 1, 1, 2] and meta_b["grid"] == [2, 1, 1, 1]
    assert a["model/features.3.weight"].shape == (8, 4, 3, 3, 3)        # whole, not a slice
    for key in a:
        assert numpy.allclose(a[key], b[key], rtol=1e-4, atol=1e-6), key
    narrow = tmp_path / "narrow.toml"                 # a split block of 1 channel on Pm = 2: refused
    narrow.write_text("[model_config]\nconv_size = 1\nn_conv_layers = 1\n")
    proc = train(2, "--config", narrow, "--grid", "1,1,1,1,2", "--data", data_dir, "--model-parallel",
                 "filter", "--out", tmp_path / "bad")
    expect_error(proc, "at most one rank per channel")
    proc = train(2, "--model", "unet3d", "--grid", "1,1,1,1,2", "--model-parallel", "channel",
                 "--gen-samples", 4, "--gen-val-samples", 0, "--global-batch", 2, "--steps", 2,
                 "--out", tmp_path / "u")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_bad_compression_settings(tmp_path, data_dir):
    expect_error(train(2, "--data", data_dir, "--grid", "2,1,1,1", "--steps", 1, "--out", tmp_path / "a",
                       "--compress", "int4"), "compress must be 'none', 'int8' or 'topk:RATIO'")
    expect_error(train(2, "--data", data_dir, "--grid", "2,1,1,1", "--steps", 1, "--out", tmp_path / "b",
                       "--compress", "topk:0", ), "0 < RATIO <= 1")
    expect_error(train(2, "--data", data_dir, "--grid", "2,1,1,1", "--steps", 1, "--out", tmp_path / "c",
                       "--compress", "int8", "--optimizer-sharding"), "do not combine")


def test_priority_input_first_equals_plain_and_resumes_without_it(tmp_path, data_dir):
    """--priority input-first (chunks, input side first, each layer's update deferred to its next
    forward) trains exactly as the plain run: 4 plain steps on (2,1,1,1) equal 2 prioritised steps
    resumed plainly on (1,2,1,1) to 4 (float64, 1e-12; the checkpoint is written after the deferred
    updates are applied); the summary reports the gap from backward to the next forward."""
    common = ["--data", data_dir, "--dtype", "float64", "--optimizer", "adam", "--global-batch", "4",
              "--bucket-mb", "0.05"]
    plain, mixed = tmp_path / "plain", tmp_path / "mixed"
    assert train(2, "--grid", "2,1,1,1", "--steps", 4, "--out", plain, *common).returncode == 0
    proc = train(2, "--grid", "2,1,1,1", "--steps", 2, "--out", mixed, *common, "--priority", "input-first",
                 "--chunk-mb", "0.01")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((mixed / "summary.json").read_text())["backward_to_next_forward_s"] > 0
    off = tmp_path / "off.toml"
    off.write_text('priority = "none"\n')
    proc = train(2, "--grid", "1,2,1,1", "--steps", 4, "--out", mixed, "--resume", "--config", off)
    assert proc.returncode == 0, proc.stderr
    want, _ = model_arrays(plain / "checkpoint.h5")
    got, meta = model_arrays(mixed / "checkpoint.h5")
    assert meta["step"] == 4 and got.keys() == want.keys()
    for key, value in want.items():
        err = numpy.abs(got[key] - value).max() / max(numpy.abs(value).max(), 1e-300)
        assert err <= 1e-12, (key, err)


def test_bad_priority_settings(tmp_path, data_dir):
    base = ("--data", data_dir, "--grid", "2,1,1,1", "--steps", 1)
    expect_error(train(2, *base, "--out", tmp_path / "a", "--priority", "output-first"), "--priority",
                 "invalid choice")
    expect_error(train(2, *base, "--out", tmp_path / "b", "--priority", "input-first", "--compress", "int8"),
                 "does not combine with --compress")
    expect_error(train(2, *base, "--out", tmp_path / "c", "--chunk-mb", "-1"), "chunk_mb must be a number >= 0")
