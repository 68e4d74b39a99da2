"""Fail-stop under faults, under real mpiexec: every fault ends every rank, quickly, with one message.

Each test injects one fault (tests/fault_inject.py: an exception in a layer's
forward or backward on one rank, a rank that stops (SIGSTOP) or dies (SIGKILL),
a file-size limit that makes writes fail like a full disk, a write that fails)
and asserts

- the exit code (docs/training.md, "Faults": 2 bad input, 3 divergence, 4 I/O,
  5 stall, 70 internal error),
- that every rank has exited within a bound far below the test's own timeout
  (measured from the fault; no process of the job is left),
- one message from refimpl naming the rank and the cause (the launcher adds its
  own banner, which does not start with "refimpl"),
- that nothing is lost: the last checkpoint is intact, no temporary file is left,
  and a resume finishes bit-identical to an uninterrupted run.
"""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy
import pytest

from launcher import run_launched

pytest.importorskip("mpi4py", reason="mpi4py is not installed: pip install 'refimpl[mpi]'")
h5py = pytest.importorskip("h5py")

from refimpl.checkpoint import read_file  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
INJECT = ROOT / "tests" / "fault_inject.py"
TIMEOUT_S = 240            # the test's own limit: a hang fails here, far above every bound below
EXIT_BOUND_S = 15          # fault -> every rank gone (stalls: plus the stall timeout)
STEPS, EVERY = 12, 3       # runs of 12 steps, a checkpoint every 3


def mpi_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAULT", "REFIMPL_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def launch(n, args, env=None, command="train"):
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        pytest.fail("mpiexec not found: pip install 'refimpl[mpi]'")
    cmd = [mpiexec, "--oversubscribe", "-n", str(n), sys.executable, str(INJECT), command, *map(str, args)]
    if command == "train":
        cmd.append("--quiet")
    started = time.time()
    try:
        proc = run_launched(cmd, cwd=ROOT, env=env or mpi_env(), timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{command} {args} hung for {TIMEOUT_S}s (a rank did not exit)\n{err.stdout}\n{err.stderr}")
    proc.elapsed, proc.ended = time.time() - started, time.time()
    return proc


def refimpl_lines(proc):
    """The lines refimpl printed on stderr (the launcher's banner excluded)."""
    return [line for line in proc.stderr.splitlines() if line.startswith("refimpl")]


def expect(proc, code, *fragments):
    text = f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == code, text
    lines = refimpl_lines(proc)
    assert len(lines) == 1, f"expected one refimpl message:\n{text}"
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    assert "Traceback" not in proc.stderr, text
    return lines[0]


def faulty(tmp_path, n, args, fault=None, rank=0, fsize=None):
    """Run ``train args`` on n ranks with one fault; returns the process, checks no rank survived."""
    log = tmp_path / f"log-{time.monotonic_ns()}"
    log.mkdir()
    extra = {"FAULT_LOG": log, "FAULT_RANK": rank}
    if fault:
        extra["FAULT"] = fault
    if fsize:
        extra["FAULT_FSIZE"] = fsize
    proc = launch(n, args, mpi_env(**extra))
    for pid_file in log.glob("pid-*"):                  # every rank of the job is gone
        pid = int(pid_file.read_text())
        if alive(pid):
            pytest.fail(f"rank process {pid} ({pid_file.name}) survived the job:\n{proc.stderr}")
    fault_file = log / "fault"
    proc.fault_to_exit = proc.ended - float(fault_file.read_text()) if fault_file.exists() else None
    return proc


def alive(pid, wait_s=2.0):
    """Whether ``pid`` still runs ``wait_s`` after the job ended (a zombie awaiting its reaper is dead)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return False
        if state in ("Z", "X"):
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.05)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    subprocess.run([sys.executable, "-m", "refimpl", "datagen", "cosmoflow", "--out", str(out),
                    "--samples", "16", "--val-samples", "4", "--size", "16", "--quiet"],
                   check=True, cwd=ROOT, timeout=TIMEOUT_S, env=mpi_env())
    return out


def common(data_dir, grid, out):
    return ["--grid", grid, "--data", data_dir, "--global-batch", 2, "--optimizer", "sgd", "--lr", 0.01,
            "--checkpoint-every", EVERY, "--validate-every", 6, "--no-plot", "--out", out]


_reference = {}


def reference(tmp_path_factory, data_dir, n, grid):
    """The uninterrupted run's final checkpoint arrays on ``grid`` (one per grid, cached)."""
    if (n, grid) not in _reference:
        out = tmp_path_factory.mktemp(f"reference-{grid.replace(',', '')}")
        proc = launch(n, common(data_dir, grid, out) + ["--steps", STEPS])
        assert proc.returncode == 0, proc.stderr
        _reference[(n, grid)] = read_file(out / "checkpoint.h5")
    return _reference[(n, grid)]


def assert_resumes_bit_identical(tmp_path_factory, data_dir, n, grid, out):
    """The interrupted run in ``out``: its checkpoint is intact, no temporary is left, and a resume
    finishes with exactly the uninterrupted run's parameters and optimiser state."""
    assert not [p.name for p in Path(out).iterdir() if ".tmp" in p.name]
    _, meta = read_file(Path(out) / "checkpoint.h5")                # readable, checksum good
    assert meta["step"] % EVERY == 0 and meta["step"] < STEPS
    proc = launch(n, ["--out", out, "--resume", "--steps", STEPS])
    assert proc.returncode == 0, proc.stderr
    arrays, meta = read_file(Path(out) / "checkpoint.h5")
    want, want_meta = reference(tmp_path_factory, data_dir, n, grid)
    assert meta["step"] == want_meta["step"] == STEPS
    assert sorted(arrays) == sorted(want)
    for key in want:
        assert numpy.array_equal(arrays[key], want[key]), key
    steps = [json.loads(x)["step"] for x in open(Path(out) / "metrics.jsonl")
             if x.strip() and json.loads(x)["split"] == "train"]
    assert steps == list(range(1, STEPS + 1))


# ---------------------------------------------------------------- an exception on one rank only

@pytest.mark.parametrize("n, grid, fault, rank", [
    (2, "1,2,1,1", "forward:5", 1),
    (3, "1,3,1,1", "backward:4", 2),
    (4, "2,2,1,1", "forward:8", 0),
])
def test_exception_in_one_ranks_layer_ends_every_rank(tmp_path, tmp_path_factory, data_dir, n, grid, fault, rank):
    out = tmp_path / "run"
    proc = faulty(tmp_path, n, common(data_dir, grid, out) + ["--steps", STEPS], fault=fault, rank=rank)
    # forward reaches the first conv (features.0) first, backward the last one (features.3)
    where = "forward of features.0" if fault.startswith("forward") else "backward of features.3"
    expect(proc, 70, f"internal error on rank {rank}", where,
           f"step {fault.split(':')[1]}", "RuntimeError: injected fault", "--debug")
    assert proc.fault_to_exit < EXIT_BOUND_S, proc.fault_to_exit
    assert_resumes_bit_identical(tmp_path_factory, data_dir, n, grid, out)


def test_debug_shows_the_traceback(tmp_path, data_dir):
    proc = faulty(tmp_path, 2, common(data_dir, "1,2,1,1", tmp_path / "run") + ["--steps", 4, "--debug"],
                  fault="forward:2", rank=1)
    assert proc.returncode == 70
    assert "Traceback" in proc.stderr and "injected fault" in proc.stderr


# ---------------------------------------------------------------- a rank that stops answering / dies

@pytest.mark.parametrize("n, grid, rank", [(4, "1,2,2,1", 3), (2, "2,1,1,1", 0)])
def test_stopped_rank_is_named_and_the_job_ends(tmp_path, tmp_path_factory, data_dir, n, grid, rank):
    out = tmp_path / "run"
    timeout = 3
    proc = faulty(tmp_path, n, common(data_dir, grid, out) + ["--steps", STEPS, "--stall-timeout", timeout],
                  fault="stop:5", rank=rank)
    line = expect(proc, 5, "stalled", f"rank {rank} stopped answering", "at step 5",
                  f"--stall-timeout {timeout}")
    if rank != 0:          # rank 0 names where the others wait
        assert "wait in" in line and "features.0" in line, line
    assert proc.fault_to_exit < timeout + EXIT_BOUND_S, proc.fault_to_exit
    if rank != 0:
        assert_resumes_bit_identical(tmp_path_factory, data_dir, n, grid, out)


def test_killed_rank_ends_the_job_and_resumes(tmp_path, tmp_path_factory, data_dir):
    out = tmp_path / "run"
    proc = faulty(tmp_path, 3, common(data_dir, "1,3,1,1", out) + ["--steps", STEPS], fault="kill:7", rank=1)
    assert proc.returncode != 0
    assert proc.fault_to_exit < EXIT_BOUND_S, proc.fault_to_exit
    assert_resumes_bit_identical(tmp_path_factory, data_dir, 3, "1,3,1,1", out)


# ---------------------------------------------------------------- writes that fail mid-run

def test_disk_full_during_a_checkpoint(tmp_path, tmp_path_factory, data_dir):
    """Rank 0 may write 60 kB per file: the 6-step checkpoint fits before, not the next one...
    because it is written with the limit only from the resume on."""
    out = tmp_path / "run"
    args = common(data_dir, "1,2,1,1", out)
    proc = launch(2, args + ["--steps", 6])
    assert proc.returncode == 0, proc.stderr
    size = (out / "checkpoint.h5").stat().st_size
    before = (out / "checkpoint.h5").read_bytes()
    proc = faulty(tmp_path, 2, ["--out", out, "--resume", "--steps", STEPS], rank=0, fsize=size // 2)
    expect(proc, 4, "I/O error", "checkpoint not written: disk full at", "checkpoint.h5",
           "File too large")
    assert "HDF5" not in proc.stderr and "Segmentation" not in proc.stderr
    assert (out / "checkpoint.h5").read_bytes() == before           # the previous one, untouched
    assert_resumes_bit_identical(tmp_path_factory, data_dir, 2, "1,2,1,1", out)


def test_metrics_write_fails_mid_run(tmp_path, data_dir):
    out = tmp_path / "run"
    args = common(data_dir, "1,2,1,1", out) + ["--steps", 40, "--checkpoint-every", 100]
    proc = faulty(tmp_path, 2, args, rank=0, fsize=4000)
    expect(proc, 4, "I/O error", "metrics.jsonl", "File too large")
    assert 4000 - 400 < (out / "metrics.jsonl").stat().st_size <= 4000   # every line up to the limit


def test_plot_write_fails(tmp_path, data_dir):
    out = tmp_path / "run"
    args = common(data_dir, "1,2,1,1", out) + ["--steps", 6]
    args.remove("--no-plot")
    proc = faulty(tmp_path, 2, args, fault="plot:6", rank=0)
    expect(proc, 4, "I/O error", "No space left on device", "loss.png")
    assert read_file(out / "checkpoint.h5")[1]["step"] == 6          # written before the plot


# ---------------------------------------------------------------- paths that cannot be written: bad input

def test_out_that_cannot_be_written_is_bad_input(tmp_path, data_dir):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for out, fragment in ((a_file, "exists and is not a directory"), (a_file / "sub", "is not a directory")):
        proc = launch(2, common(data_dir, "1,2,1,1", out) + ["--steps", 2])
        expect(proc, 2, "refimpl train: error: --out", fragment)
    out = tmp_path / "run"
    (out / "metrics.jsonl").mkdir(parents=True)
    proc = launch(2, common(data_dir, "1,2,1,1", out) + ["--steps", 2])
    expect(proc, 2, "metrics.jsonl", "is a directory")


def test_check_layer_save_paths(tmp_path):
    args = ["conv3d", "--input", "1,2,6,6,6", "--out-channels", 3, "--grid", "1,2,1,1"]
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for save, fragment in ((a_file / "x.npz", "is not a directory"), (tmp_path, "is a directory")):
        proc = launch(2, args + ["--save", save], command="check-layer")
        expect(proc, 2, "refimpl check-layer: error: --save", fragment)
    save = tmp_path / "new" / "dir" / "x.npz"        # missing directories are created
    proc = launch(2, args + ["--save", save], command="check-layer")
    assert proc.returncode == 0, proc.stderr
    assert set(numpy.load(save)) >= {"x", "y", "dx", "w", "dw"}


# ---------------------------------------------------------------- settings, resume and run directories

@pytest.mark.parametrize("variable, value, fragment", [
    ("REFIMPL_BACKEND", "bogus", "REFIMPL_BACKEND"),
    ("REFIMPL_BACKEND", "cupy", "REFIMPL_BACKEND"),
    ("REFIMPL_CUDA_AWARE", "maybe", "REFIMPL_CUDA_AWARE"),
    ("REFIMPL_THREAD", "2", "REFIMPL_THREADS"),
])
def test_bad_environment_is_exit_2_on_every_rank(tmp_path, data_dir, variable, value, fragment):
    proc = launch(2, common(data_dir, "1,2,1,1", tmp_path / "o") + ["--steps", 1],
                  env=mpi_env(**{variable: value}))
    expect(proc, 2, "refimpl: error:", fragment)


def test_train_honours_the_backend_variables(tmp_path, data_dir):
    out = tmp_path / "run"
    proc = launch(2, common(data_dir, "1,2,1,1", out) + ["--steps", 1],
                  env=mpi_env(REFIMPL_BACKEND="numpy", REFIMPL_CUDA_AWARE="1"))
    assert proc.returncode == 0, proc.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["backend"] == "numpy" and config["cuda_aware"] is True


def test_bad_model_settings_are_one_line(tmp_path, data_dir):
    proc = launch(2, ["--model", "unet3d", "--preset", "mlperf", "--out", tmp_path / "o"])
    expect(proc, 2, "preset", "mlperf")
    cfg = tmp_path / "run.toml"
    cfg.write_text('[model_config]\ndropout = "high"\n')
    proc = launch(2, ["--config", cfg, "--data", data_dir, "--out", tmp_path / "o"])
    expect(proc, 2, "dropout", "high")


def test_overwrite_clears_the_old_run_before_anything_new(tmp_path, data_dir):
    out = tmp_path / "run"
    args = common(data_dir, "1,2,1,1", out)
    assert launch(2, args + ["--steps", 3]).returncode == 0
    # the new run fails (NaN at once) before its first checkpoint
    bad = [a if a != 0.01 else "1e38" for a in args] + ["--steps", 6, "--overwrite"]
    proc = launch(2, bad)
    line = expect(proc, 3, "loss became", "no checkpoint was written yet")
    assert "last good checkpoint" not in line
    assert not (out / "checkpoint.h5").exists()             # the old run is gone, not mixed in
    assert not list(out.glob(".overwritten-*"))
    proc = launch(2, ["--out", out, "--resume", "--steps", 6])
    expect(proc, 2, "nothing to resume")


def test_resume_length_and_repeated_defaults(tmp_path, data_dir):
    out = tmp_path / "run"
    args = ["--grid", "1,2,1,1", "--data", data_dir, "--global-batch", 2, "--checkpoint-every", 3,
            "--no-plot", "--out", out]
    assert launch(2, args + ["--steps", 6]).returncode == 0
    summary = (out / "summary.json").read_text()
    proc = launch(2, ["--out", out, "--resume", "--steps", 4])
    expect(proc, 2, "--steps 4 is below the 6 steps")
    assert (out / "summary.json").read_text() == summary           # untouched
    proc = launch(2, ["--out", out, "--resume", "--steps", 6])     # nothing left: fine, no rewrite
    assert proc.returncode == 0, proc.stderr
    assert (out / "summary.json").read_text() == summary
    proc = launch(2, ["--out", out, "--resume", "--steps", 8, "--lr", 0.001, "--optimizer", "adam"])
    assert proc.returncode == 0, proc.stderr                       # Adam's default lr, repeated
    proc = launch(2, ["--out", out, "--resume", "--steps", 10, "--lr", 0.002])
    expect(proc, 2, "lr = 0.002 differs")


def test_no_gil_holding_object_collectives_in_the_package():
    """mpi4py's pickle bcast/scatter/reduce/allreduce keep the GIL while blocked, freezing the
    watchdog thread (refimpl/parallel/objects.py): refimpl must use its own."""
    import re
    pattern = re.compile(r"\b(comm|[a-z_]*_comm)\.(bcast|scatter|reduce|allreduce)\(")
    offenders = []
    for path in (ROOT / "refimpl").rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
