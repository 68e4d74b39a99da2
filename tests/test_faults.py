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
import signal
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


def assert_resumes_bit_identical(tmp_path_factory, data_dir, n, grid, out, checkpoint_step=None):
    """The interrupted run in ``out``: its checkpoint is intact (at ``checkpoint_step``, or one
    of the scheduled ones), no temporary is left, and a resume finishes with exactly the
    uninterrupted run's parameters and optimiser state."""
    assert not [p.name for p in Path(out).iterdir() if ".tmp" in p.name]
    _, meta = read_file(Path(out) / "checkpoint.h5")                # readable, checksum good
    if checkpoint_step is None:
        assert meta["step"] % EVERY == 0 and meta["step"] < STEPS
    else:
        assert meta["step"] == checkpoint_step
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

@pytest.mark.parametrize("n, grid, rank", [(4, "1,2,2,1", 3), (2, "2,1,1,1", 0), (4, "1,2,2,1", 0)])
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
    expect(proc, 2, "refimpl train: error:", fragment)


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


# ---------------------------------------------------------------- decisions taken once, settings agreed, a lock

def test_overwrite_twenty_times_in_a_row(tmp_path, data_dir):
    """Every rank used to look for the files rank 0 was deleting: 4 of 5 runs deadlocked."""
    for n, grid in ((2, "1,2,1,1"), (3, "1,3,1,1")):
        out = tmp_path / f"run{n}"
        args = common(data_dir, grid, out) + ["--steps", 1, "--validate-every", 100]
        for attempt in range(20):
            proc = launch(n, args + ["--overwrite"])
            assert proc.returncode == 0, f"{n} ranks, attempt {attempt + 1}:\n{proc.stderr}"
            assert proc.elapsed < 30, proc.elapsed
        assert read_file(out / "checkpoint.h5")[1]["step"] == 1
        assert sorted(p.name for p in out.iterdir()) == ["checkpoint.h5", "config.json", "metrics.jsonl",
                                                         "summary.json"]


def test_a_rank_that_sees_out_late_follows_rank_0(tmp_path, tmp_path_factory, data_dir):
    """Rank 1 sees nothing under OUT (exists / glob / listdir): a branch it decided alone on what OUT
    holds (a run to refuse, to clear, to resume; generated data; a validation split) would part from
    rank 0's, and the job would deadlock or fail; decided on rank 0 and broadcast, all runs end 0."""
    out = tmp_path / "run"
    blind = {"FAULT_BLIND": out, "FAULT_RANK": 1}
    args = common(data_dir, "1,2,1,1", out)
    assert launch(2, args + ["--steps", 6], mpi_env(**blind)).returncode == 0
    proc = launch(2, args + ["--steps", 6], mpi_env(**blind))        # OUT holds a run: refused everywhere
    expect(proc, 2, "already holds a run")
    proc = launch(2, args + ["--steps", 6, "--overwrite"], mpi_env(**blind))
    assert proc.returncode == 0, proc.stderr
    proc = launch(2, ["--out", out, "--resume", "--steps", STEPS], mpi_env(**blind))
    assert proc.returncode == 0, proc.stderr
    arrays, meta = read_file(out / "checkpoint.h5")
    want, want_meta = reference(tmp_path_factory, data_dir, 2, "1,2,1,1")
    assert meta["step"] == want_meta["step"] == STEPS
    for key in want:
        assert numpy.array_equal(arrays[key], want[key]), key
    generated = tmp_path / "generated"                              # OUT/data generated by rank 0
    proc = launch(2, ["--grid", "1,2,1,1", "--gen-samples", 4, "--gen-val-samples", 2, "--global-batch", 2,
                      "--steps", 2, "--no-plot", "--out", generated], mpi_env(FAULT_BLIND=generated, FAULT_RANK=1))
    assert proc.returncode == 0, proc.stderr
    assert (generated / "data" / "val.h5").exists()


WRAPPER = """#!/bin/sh
# set one variable on one rank only, as a per-node profile or a module load would
if [ "$OMPI_COMM_WORLD_RANK" = "$ONE_RANK" ]; then export "$ONE_SETTING"; fi
exec "$@"
"""


@pytest.mark.parametrize("n, rank, setting, fragments", [
    (2, 1, "REFIMPL_THREADS=-3", ("REFIMPL_THREADS must be a positive integer", "(rank 1)")),
    (4, 0, "REFIMPL_THREADS=2", ("REFIMPL_THREADS differs between ranks", "rank 1 has the default", "rank 0 has 2")),
    (4, 2, "REFIMPL_CONV_ALGORITHM=im2col", ("REFIMPL_CONV_ALGORITHM differs", "rank 2 has 'im2col'")),
])
@pytest.mark.parametrize("stall", [None, 5])
def test_a_setting_on_one_rank_ends_every_rank_at_once(tmp_path, data_dir, n, rank, setting, fragments, stall):
    wrapper = tmp_path / "one_rank.sh"
    wrapper.write_text(WRAPPER)
    wrapper.chmod(0o755)
    grid = f"1,{n},1,1"
    args = common(data_dir, grid, tmp_path / "o") + ["--steps", 2] + (["--stall-timeout", stall] if stall else [])
    cmd = [shutil.which("mpiexec"), "--oversubscribe", "-n", str(n), str(wrapper), sys.executable, "-m",
           "refimpl", "train", *map(str, args), "--quiet"]
    started = time.time()
    proc = run_launched(cmd, cwd=ROOT, env=mpi_env(ONE_RANK=rank, ONE_SETTING=setting), timeout=TIMEOUT_S)
    assert time.time() - started < 30, proc.stderr
    expect(proc, 2, "refimpl train: error:", *fragments)
    assert not (tmp_path / "o").exists()                # decided before anything was written


def test_building_the_command_line_starts_no_mpi():
    """MPI starts when a command takes its communicator: a rank that refuses its flags or settings
    before then leaves no other rank waiting in MPI_Init's collectives or in MPI_Finalize."""
    code = ("import sys; from refimpl.cli import build_parser; build_parser(); "
            "sys.exit(1 if 'mpi4py.MPI' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=mpi_env()).returncode == 0
    from refimpl.config import CHOICES
    from refimpl.parallel.collectives import ALGORITHMS
    assert sorted(CHOICES["allreduce"]) == sorted(ALGORITHMS)


def test_a_second_job_into_the_same_out_is_refused(tmp_path, tmp_path_factory, data_dir):
    """A requeued or resubmitted job must not write into a running job's OUT: the second exits 2 at once
    naming the first; the first's outputs are exactly a lone run's."""
    out = tmp_path / "run"
    log = tmp_path / "log"
    log.mkdir()
    first_cmd = [shutil.which("mpiexec"), "--oversubscribe", "-n", "2", sys.executable, str(INJECT), "train",
                 *map(str, common(data_dir, "1,2,1,1", out) + ["--steps", STEPS]), "--quiet"]
    first = subprocess.Popen(first_cmd, cwd=ROOT, env=mpi_env(FAULT="slow:1", FAULT_LOG=log),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while not (out / ".lock").exists():
            assert first.poll() is None and time.time() < deadline, first.communicate()
            time.sleep(0.05)
        holder = json.loads((out / ".lock").read_text())
        second = launch(2, common(data_dir, "1,2,1,1", out) + ["--steps", STEPS, "--seed", 1, "--overwrite"])
        expect(second, 2, "is in use by another job", f"PID {holder['pid']}")
        assert second.elapsed < 10, second.elapsed
        assert first.poll() is None, "the first job ended before the second was refused: no overlap tested"
        stdout, stderr = first.communicate(timeout=TIMEOUT_S)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, stderr
    assert not (out / ".lock").exists()                                 # released at the end
    arrays, meta = read_file(out / "checkpoint.h5")
    want, want_meta = reference(tmp_path_factory, data_dir, 2, "1,2,1,1")
    assert meta["step"] == want_meta["step"]
    for key in want:
        assert numpy.array_equal(arrays[key], want[key]), key
    steps = [json.loads(x)["step"] for x in open(out / "metrics.jsonl") if json.loads(x)["split"] == "train"]
    assert steps == list(range(1, STEPS + 1))


def test_a_lock_left_by_a_killed_job(tmp_path, data_dir):
    """SIGKILL leaves the lock and a temporary; the holder ran on this host and its process is
    gone, so the next --resume takes the lock over at once, removes the temporary and says so
    (no --break-lock needed: a Ctrl-C followed at once by --resume just works).  A lock of
    another host that is merely old still needs --break-lock."""
    out = tmp_path / "run"
    args = common(data_dir, "1,2,1,1", out)
    proc = faulty(tmp_path, 2, args + ["--steps", STEPS], fault="kill:5", rank=0)
    assert proc.returncode != 0
    assert (out / ".lock").exists()
    holder = json.loads((out / ".lock").read_text())
    (out / f"checkpoint.h5.tmp-{holder['pid']}").write_bytes(b"half a checkpoint")
    proc = launch(2, ["--out", out, "--resume", "--steps", STEPS])
    assert proc.returncode == 0, proc.stderr
    assert "took over the lock of a job that is gone" in proc.stderr and "no longer runs" in proc.stderr
    assert f"removed the temporary it left: checkpoint.h5.tmp-{holder['pid']}" in proc.stderr
    assert not (out / ".lock").exists() and not list(out.glob("*.tmp-*"))
    (out / ".lock").write_text(json.dumps(dict(holder, host="another-host")))
    old = time.time() - 3600
    os.utime(out / ".lock", (old, old))
    proc = launch(2, ["--out", out, "--resume", "--steps", STEPS + 1])
    expect(proc, 2, "locked by a job that is gone", "last refreshed", "--break-lock")
    proc = launch(2, ["--out", out, "--resume", "--steps", STEPS + 1, "--break-lock"])
    assert proc.returncode == 0, proc.stderr


def test_out_names_the_file_system_cannot_hold_are_bad_input(tmp_path, data_dir):
    """Found by the pre-flight check (exit 2, nothing written), not mid-run (exit 4)."""
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    for out, fragment in ((tmp_path / ("x" * 300), "NAME_MAX"), (dangling, "dangling symbolic link"),
                          (dangling / "run", "dangling symbolic link")):
        proc = launch(2, common(data_dir, "1,2,1,1", out) + ["--steps", 2])
        expect(proc, 2, "refimpl train: error: --out", fragment)
    out = tmp_path / "run"
    assert launch(2, common(data_dir, "1,2,1,1", out) + ["--steps", 3]).returncode == 0
    kept = tmp_path / "kept.h5"
    (out / "checkpoint.h5").rename(kept)
    (out / "checkpoint.h5").symlink_to(kept)                        # a symlinked checkpoint: refused
    proc = launch(2, ["--out", out, "--resume", "--steps", 6])
    expect(proc, 2, "checkpoint.h5", "is a symbolic link")
    assert (out / "checkpoint.h5").is_symlink()


# ---------------------------------------------------------------- signals

@pytest.mark.parametrize("rank", [1, 0])
def test_sigterm_to_one_rank_ends_the_job_and_resumes(tmp_path, tmp_path_factory, data_dir, rank):
    """A scheduler's cancel of one rank: one line, 143, the checkpoint untouched, then a bit-identical resume."""
    out = tmp_path / "run"
    proc = faulty(tmp_path, 2, common(data_dir, "1,2,1,1", out) + ["--steps", STEPS], fault="sigterm:5", rank=rank)
    expect(proc, 143, f"interrupted by SIGTERM on rank {rank} at step 5", "the last checkpoint is step 3")
    assert proc.fault_to_exit < EXIT_BOUND_S, proc.fault_to_exit
    assert not (out / ".lock").exists()
    assert_resumes_bit_identical(tmp_path_factory, data_dir, 2, "1,2,1,1", out)


@pytest.mark.parametrize("n, grid, rank", [(2, "1,2,1,1", 1), (3, "1,3,1,1", 0)])
def test_a_preemption_warning_checkpoints_every_rank_at_one_step_and_resumes(tmp_path, tmp_path_factory,
                                                                            data_dir, n, grid, rank):
    """SIGUSR1 to one rank during step 5 (``sbatch --signal=USR1@60`` sends it before the time
    limit): the ranks agree on it at the end of that step, write the checkpoint there (off the
    every-3 schedule), end with one line and 138, and a resume is bit-identical."""
    out = tmp_path / "run"
    proc = faulty(tmp_path, n, common(data_dir, grid, out) + ["--steps", STEPS], fault="sigusr1:5", rank=rank)
    expect(proc, 138, "pre-empted: a pre-emption warning (SIGUSR1) arrived",
           f"checkpoint written at step 5 of {STEPS}", "--resume")
    assert not (out / ".lock").exists()
    steps = [json.loads(x)["step"] for x in open(out / "metrics.jsonl") if x.strip()
             and json.loads(x)["split"] == "train"]
    assert steps == [1, 2, 3, 4, 5]
    assert_resumes_bit_identical(tmp_path_factory, data_dir, n, grid, out, checkpoint_step=5)


def test_a_preemption_warning_in_the_last_step_finishes_the_run(tmp_path, data_dir):
    """SIGUSR1 during the last step: nothing is left to save a step for, so the run finishes as
    usual (its final checkpoint, exit 0) instead of ending as pre-empted."""
    out = tmp_path / "run"
    proc = faulty(tmp_path, 2, common(data_dir, "1,2,1,1", out) + ["--steps", STEPS], fault=f"sigusr1:{STEPS}",
                  rank=1)
    assert proc.returncode == 0, proc.stderr
    assert "pre-empted" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert read_file(out / "checkpoint.h5")[1]["step"] == STEPS


@pytest.mark.parametrize("preemptible", [False, True])
def test_sigusr1_is_a_preemption_warning_only_where_asked_for(preemptible):
    """Only `refimpl train` (``run_command(..., preemptible=True)``) takes SIGUSR1 as a pre-emption
    warning, a flag for the loop; other commands end on it as on SIGTERM (one line, 138, their
    temporaries removed), never silently ignoring it."""
    code = ("import os, signal, sys, time\n"
            "from refimpl import signals\n"
            f"signals.handle_signals('x', {preemptible})\n"
            "os.kill(os.getpid(), signal.SIGUSR1)\n"
            "deadline = time.time() + 5\n"
            "while not signals.preemption_requested() and time.time() < deadline:\n"
            "    time.sleep(0.01)\n"
            "print(signals.preemption_requested())\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=mpi_env(), capture_output=True, text=True,
                          timeout=60)
    if preemptible:
        assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr
    else:
        assert proc.returncode == 128 + signal.SIGUSR1, (proc.returncode, proc.stdout, proc.stderr)
        assert "refimpl x: interrupted by SIGUSR1 on rank 0" in proc.stderr, proc.stderr


def test_sigusr1_to_datagen_removes_its_temporary_and_lock(tmp_path):
    """SIGUSR1 (a scheduler's warning) to a command that cannot checkpoint: one line, 138,
    neither the half-written split nor the lock left behind."""
    out = tmp_path / "data"
    proc = subprocess.Popen([sys.executable, "-m", "refimpl", "datagen", "cosmoflow", "--out", str(out),
                             "--samples", "2000", "--size", "32", "--quiet"], cwd=ROOT, env=mpi_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not list(out.glob("*.tmp-*")) and time.monotonic() < deadline:
        time.sleep(0.05)                        # writing its first split
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 138, err
    assert "refimpl datagen: interrupted by SIGUSR1 on rank 0 during writing" in err
    assert sorted(p.name for p in out.iterdir()) == [], list(out.iterdir())


@pytest.mark.parametrize("fault", ["ctrl-c", "sigterm-launcher"])
def test_ctrl_c_at_the_terminal_ends_every_rank_and_resumes(tmp_path, tmp_path_factory, data_dir, fault):
    """SIGINT to mpiexec's process group, as a terminal sends it, or SIGTERM to mpiexec (a scheduler's
    cancel of the launcher).  Open MPI's mpiexec answers by sending the
    ranks SIGCONT, SIGTERM 0.25 s later and SIGKILL 0.25 s after that, stops forwarding their output and
    exits 1 (docs/training.md, "Signals"): so no refimpl line reaches the terminal here; what must hold is
    that every rank is gone at once, nothing is left half-written (no temporary, no lock) and the run
    resumes bit for bit."""
    out = tmp_path / "run"
    log = tmp_path / "log"
    log.mkdir()
    cmd = [shutil.which("mpiexec"), "--oversubscribe", "-n", "3", sys.executable, str(INJECT), "train",
           *map(str, common(data_dir, "1,3,1,1", out) + ["--steps", STEPS]), "--quiet"]
    proc = run_launched(cmd, cwd=ROOT, env=mpi_env(FAULT=f"{fault}:5", FAULT_RANK=2, FAULT_LOG=log),
                        timeout=TIMEOUT_S, start_new_session=True)
    ended = time.time()
    assert proc.returncode != 0
    assert ended - float((log / "fault").read_text()) < EXIT_BOUND_S
    for pid_file in log.glob("pid-*"):
        assert not alive(int(pid_file.read_text())), pid_file.name
    assert "Traceback" not in proc.stderr
    assert not (out / ".lock").exists()
    assert_resumes_bit_identical(tmp_path_factory, data_dir, 3, "1,3,1,1", out)


def test_ctrl_c_of_a_one_process_run(tmp_path, data_dir):
    """Without a launcher the line and the code are refimpl's own: 130, the checkpoint kept."""
    out = tmp_path / "run"
    log = tmp_path / "log"
    log.mkdir()
    proc = subprocess.Popen([sys.executable, str(INJECT), "train", *map(str, common(data_dir, "1,1,1,1", out)),
                             "--steps", "400", "--quiet"], cwd=ROOT, env=mpi_env(FAULT_LOG=log),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 60
    while not (out / "checkpoint.h5").exists() and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 130, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("refimpl")]
    assert len(lines) == 1 and "interrupted by SIGINT on rank 0" in lines[0], stderr
    assert "the last checkpoint is step" in lines[0] and "Traceback" not in stderr, stderr
    assert not [p.name for p in out.iterdir() if ".tmp" in p.name or p.name == ".lock"]
    read_file(out / "checkpoint.h5")                                 # intact
