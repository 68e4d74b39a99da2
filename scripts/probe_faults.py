#!/usr/bin/env python
"""Re-run the fault probe's failing rows (issue 41) against the real CLI and print one table.

A fault probe run by hand as a cluster user would (43 kinds of fault, about 330 runs on 2-4
ranks) found ten rows where refimpl failed, plus the stumbles of a newcomer's first hour.
Each has its own test since; this script re-runs them the way the probe did — real
subprocesses of ``python -m refimpl``, under ``mpiexec`` where the row is about a job of
several ranks, real FIFOs, device nodes, signals and file-size limits — and checks the
outcome now expected: the exit code *and* the side condition (the node unchanged, no lock or
temporary left, one line naming the file or field, done within the time allowed).

    python scripts/probe_faults.py                 # every row (about a minute on 2 cores)
    python scripts/probe_faults.py --only 1,9,12    # some rows
    python scripts/probe_faults.py --json FILE      # also the numbers as JSON

Columns: the row, what was done, what the probe saw then, what is expected now, the exit
codes seen, seconds, and the verdict: holds, or FAILS with what was seen (a part that cannot
run here is named after the verdict: row 1's device node needs root, for mknod).  Exit status
0 when every row run holds, 1 otherwise, 2 for bad flags.  Everything is written in one
temporary directory, removed at the end; a job a failing row leaves running is killed.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: as the README's commands: Open MPI may run as root; one thread per rank on a small machine
ENV = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_WORLD", "PMI_"))}
ENV.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
           PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
TIMEOUT_S = 180
TINY = ["--model", "cosmoflow", "--preset", "tiny", "--quiet"]


class Outcome(Exception):
    """A row's check failed: the message says what was seen."""


def command(args, ranks=None) -> list:
    """``python -m refimpl ARGS``, under ``mpiexec -n ranks`` when given."""
    cmd = [sys.executable, "-m", "refimpl", *map(str, args)]
    if ranks:
        cmd = [shutil.which("mpiexec") or "mpiexec", "--oversubscribe", "-n", str(ranks)] + cmd
    return cmd


def refimpl(*args, limit=None, timeout=TIMEOUT_S, ranks=None):
    """Run ``python -m refimpl ARGS`` (under ``mpiexec -n ranks`` when given): CompletedProcess
    with ``seconds``.  ``limit``: (resource, bytes) set in the child before it runs; SIGXFSZ is
    ignored there, as a shell's ``ulimit -f`` user sees a write fail rather than the process die."""
    def preexec():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        if limit is not None:
            resource.setrlimit(limit[0], (limit[1], limit[1]))
    start_s = time.monotonic()
    with started(*args, ranks=ranks, preexec_fn=preexec) as job:   # a timeout kills its whole group
        try:
            stdout, stderr = job.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise Outcome(f"still running after {timeout} s: {' '.join(command(args, ranks)[1:])[-200:]}") from None
    proc = subprocess.CompletedProcess(job.args, job.returncode, stdout, stderr)
    proc.seconds = time.monotonic() - start_s
    return proc


@contextlib.contextmanager
def started(*args, ranks=None, preexec_fn=None):
    """A job in the background, in its own session; whatever is left of it is killed on the way out."""
    job = subprocess.Popen(command(args, ranks), cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True, preexec_fn=preexec_fn)
    try:
        yield job
    finally:
        if job.poll() is None:
            job.terminate()                                  # mpiexec ends its ranks on SIGTERM
            try:
                job.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                job.kill()
                job.communicate(timeout=60)
        for pid in in_session(job.pid):                      # ranks left behind: Open MPI gives each rank
            with contextlib.suppress(ProcessLookupError):    # its own process group, in the job's session
                os.kill(pid, signal.SIGKILL)
        for pipe in (job.stdout, job.stderr):
            pipe.close()


def in_session(sid) -> list:
    """The processes of session ``sid`` (from /proc; none where there is no /proc)."""
    pids = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid:                        # after the name: state, ppid, pgrp, session
                pids.append(int(stat_file.parent.name))
    return pids


def finish(job, timeout=60):
    """The job's (exit code, stderr), once it ends by itself within ``timeout`` seconds."""
    try:
        _, err = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise Outcome(f"still running {timeout} s after the signal") from None
    return job.returncode, err


def wait_for(predicate, what, timeout=90.0, job=None):
    deadline = time.monotonic() + timeout
    while not predicate():
        if job is not None and job.poll() is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                raise Outcome(f"the job ended (exit {job.returncode}) before {what}: "
                              f"{job.communicate(timeout=10)[1].strip()[-300:]}")
            raise Outcome(f"the job ended (exit {job.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise Outcome(f"timed out waiting for {what}")
        time.sleep(0.02)


def refimpl_lines(stderr: str) -> list:
    return [line for line in stderr.splitlines() if line.startswith("refimpl")]


def expect(proc, code, *fragments, one_line=True, within=None):
    """The exit ``code``, every fragment in stderr (in its one refimpl line), done ``within`` seconds."""
    return expect_code(proc.returncode, proc.stderr, code, *fragments, one_line=one_line,
                       seconds=proc.seconds, within=within)


def expect_code(returncode, stderr, code, *fragments, one_line=True, seconds=None, within=None):
    text = stderr.strip()
    if returncode != code:
        raise Outcome(f"exit {returncode}, expected {code}: {text[-300:]}")
    lines = refimpl_lines(stderr)
    if one_line and len(lines) != 1:
        raise Outcome(f"{len(lines)} refimpl lines: {text[-300:]}")
    missing = [f for f in fragments if f not in (lines[0] if one_line else stderr)]
    if missing:
        raise Outcome(f"the message lacks {missing}: {text[-300:]}")
    if within is not None and seconds > within:
        raise Outcome(f"took {seconds:.1f} s, more than {within} s")
    return returncode


def nothing_left(directory):
    left = [p.name for p in Path(directory).rglob("*") if ".tmp-" in p.name or p.name == ".lock"]
    if left:
        raise Outcome(f"left behind: {left}")


# ---------------------------------------------------------------------------- shared fixtures

def a_case(tmp):
    """One small oracle case file (conv3d on 2 ranks), made once."""
    path = tmp / "case"
    if not path.exists():
        suite = tmp / "suite.toml"
        suite.write_text('[[case]]\nname = "c"\nlayer = "conv3d"\ninput = [1, 1, 3, 3, 4]\nout_channels = 1\n'
                         'kernel = 3\npadding = 1\ngrids = [[1, 1, 1, 2]]\ndtypes = ["float64"]\n')
        expect(refimpl("oracle", "generate", suite, "--out", path), 0, one_line=False)
    return str(next(path.glob("*.h5")))


def a_dataset(directory, seed, samples=8):
    expect(refimpl("datagen", "cosmoflow", "--out", directory, "--samples", samples, "--val-samples", 4,
                   "--size", 16, "--seed", seed, "--overwrite", "--quiet"), 0, one_line=False)
    return directory


def a_char_device(path):
    """A character device with /dev/full's numbers (1, 7) in the temporary directory, as the probe
    used /dev/full itself; None where mknod is not permitted (not root)."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 7))
    except OSError:
        return None
    return path


def node_kept(path, before):
    after = os.stat(path)
    if (after.st_mode, after.st_rdev, after.st_ino) != (before.st_mode, before.st_rdev, before.st_ino):
        raise Outcome(f"{path} was replaced or changed: mode {before.st_mode:o} -> {after.st_mode:o}, "
                      f"rdev {before.st_rdev} -> {after.st_rdev}")


# ---------------------------------------------------------------------------- the rows

def row_outputs_onto_special_files(tmp, codes):
    case = a_case(tmp)
    fifo = tmp / "out.fifo"
    os.mkfifo(fifo)
    targets = [fifo] + [p for p in [a_char_device(tmp / "full")] if p]
    for target in targets:
        for args in (["oracle", "check", case, case, "--json", target],
                     ["check-layer", "conv3d", "--input", "1,2,6,6,6", "--grid", "1,1,1,1", "--save", target],
                     ["plan", "--model", "cosmoflow", "--ranks", "2", "--batch", "4", "--json", target],
                     ["plan", "--model", "cosmoflow", "--ranks", "2", "--batch", "4", "--plot", target]):
            before = os.stat(target)
            codes.append(expect(refimpl(*args, timeout=60), 2, str(target), "not a regular file", within=10))
            node_kept(target, before)
    note = "" if len(targets) == 2 else "FIFO only: mknod of the device node not permitted (not root)"
    return note


def row_data_identity(tmp, codes):
    out = tmp / "live"
    with started("train", *TINY, "--grid", "1,2,1,1", "--steps", 100000, "--out", out, "--checkpoint-every", 1000,
                 ranks=2) as job:
        wait_for(lambda: (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").stat().st_size > 0,
                 "the live job's first metrics", job=job)
        before = {p.name: p.stat().st_mtime_ns for p in (out / "data").iterdir()}
        proc = refimpl("datagen", "cosmoflow", "--out", out / "data", "--samples", 8, "--size", 16, "--overwrite",
                       "--quiet")
        codes.append(expect(proc, 2, "lies in the directory of a running job", str(out / ".lock")))
        if job.poll() is not None:
            raise Outcome(f"the live job ended (exit {job.returncode})")
        if {p.name: p.stat().st_mtime_ns for p in (out / "data").iterdir()} != before:
            raise Outcome("the live job's data changed")
    data, run = a_dataset(tmp / "data", 1000), tmp / "run"
    expect(refimpl("train", *TINY, "--data", data, "--steps", 2, "--global-batch", 2, "--out", run), 0, one_line=False)
    a_dataset(data, 5000)                                        # the same files, other universes
    proc = refimpl("train", "--out", run, "--resume", "--steps", 3)
    codes.append(expect(proc, 2, "changed", "writer's seed 1000 -> 5000", "--data-changed-ok"))
    proc = refimpl("train", "--out", run, "--resume", "--steps", 3, "--data-changed-ok")
    codes.append(expect(proc, 0, one_line=False))
    return ""


def row_generate_on_a_full_disk(tmp, codes):
    for fsize in (20_000, 50_000, 100_000, 200_000):
        out = tmp / f"cases-{fsize}"
        proc = refimpl("oracle", "generate", "hard", "--out", out, limit=(resource.RLIMIT_FSIZE, fsize))
        codes.append(expect(proc, 4, "File too large", str(out)))
        nothing_left(out)
    return ""


#: a suite's case (besides layer and channels), and what its one line must name
HUGE_SUITES = [('grids = [[1, 100000, 100000, 1]]\ninput = [1, 2, 8, 8, 8]', "10,000,000,000 ranks"),
               ('padding = 1000\ngrids = [[1, 1, 1, 1]]\ninput = [1, 2, 8, 8, 8]', "(input, padding)"),
               ('padding = [0, 99999999999, 0, 0, 0, 0]\ngrids = [[1, 1, 1, 1]]\ninput = [1, 2, 8, 8, 8]',
                "(input, padding)"),
               ('input = [100000, 2, 800, 800, 800]\ngrids = [[1, 1, 1, 1]]', "(input)"),
               ('kernel = 1000000\npadding = "same"\ngrids = [[1, 1, 1, 1]]\ninput = [1, 2, 8, 8, 8]', "kernel")]


def row_huge_suites(tmp, codes):
    for i, (extra, field) in enumerate(HUGE_SUITES):
        suite = tmp / f"huge{i}.toml"
        suite.write_text('[[case]]\nname = "x"\nlayer = "conv3d"\nout_channels = 2\n' + extra + "\n")
        proc = refimpl("oracle", "generate", suite, "--out", tmp / f"huge{i}", limit=(resource.RLIMIT_AS, 4 * 2**30),
                       timeout=60)
        codes.append(expect(proc, 2, str(suite), field, "at most", within=10))
    return ""


def row_fifos_as_inputs(tmp, codes):
    case = a_case(tmp)
    fifo = tmp / "in.fifo"
    os.mkfifo(fifo)
    codes.append(expect(refimpl("oracle", "check", case, fifo, timeout=30), 2, str(fifo), "FIFO", within=10))
    codes.append(expect(refimpl("oracle", "check", fifo, case, timeout=30), 2, str(fifo), "FIFO", within=10))
    results = tmp / "results"
    results.mkdir()
    os.mkfifo(results / os.path.basename(case))
    proc = refimpl("oracle", "check", os.path.dirname(case), results, timeout=30)
    if proc.returncode != 2 or "UNUSABLE" not in proc.stdout or proc.seconds > 10:
        raise Outcome(f"a FIFO in a results directory: exit {proc.returncode} in {proc.seconds:.1f} s: "
                      f"{(proc.stdout + proc.stderr).strip()[-300:]}")
    codes.append(2)
    out = tmp / "fiforun"
    out.mkdir()
    os.mkfifo(out / "metrics.jsonl")
    codes.append(expect(refimpl("train", *TINY, "--steps", 1, "--out", out, timeout=60), 2,
                        str(out / "metrics.jsonl"), "FIFO", within=10))
    return ""


def signal_when_writing(args, out, sig):
    """Start ``refimpl ARGS``, send ``sig`` once a temporary file appears in ``out``: (code, stderr)."""
    with started(*args) as job:
        wait_for(lambda: out.exists() and any(".tmp-" in p.name for p in out.rglob("*")), "a temporary file",
                 job=job)
        job.send_signal(sig)
        return finish(job)


def row_signals_to_writers(tmp, codes):
    for what, args in (("datagen", ["datagen", "cosmoflow", "--samples", 2000, "--size", 32, "--quiet"]),
                       ("oracle generate", ["oracle", "generate", "hard"])):
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            out = tmp / f"{args[0]}-{sig.name}"
            code, err = signal_when_writing(args + ["--out", out], out, sig)
            try:
                codes.append(expect_code(code, err, 128 + sig, f"refimpl {what}: interrupted by {sig.name}"))
                nothing_left(out)
            except Outcome as e:
                raise Outcome(f"{what}, {sig.name}: {e}") from None
    return ""


def row_sigusr1_after_the_last_step(tmp, codes):
    for attempt in range(8):
        ranks = 2 if attempt % 2 else None          # one process (the signal to it), and 2 ranks (to mpiexec)
        out = tmp / f"last-{attempt}"
        metrics = out / "metrics.jsonl"
        grid = ["--grid", "1,2,1,1"] if ranks else []
        with started("train", *TINY, *grid, "--steps", 3, "--out", out, ranks=ranks) as job:
            wait_for(lambda: metrics.exists() and '"step": 3' in metrics.read_text(), "step 3's metrics", job=job)
            job.send_signal(signal.SIGUSR1)
            code, err = finish(job)
        if code != 0 or "pre-empted" in err or "Traceback" in err:
            raise Outcome(f"try {attempt + 1} ({ranks or 1} rank(s)): exit {code}: {err.strip()[-300:]}")
        nothing_left(out)
        codes.append(code)
    return ""


def row_check_layer_huge_sizes(tmp, codes):
    for flags, field in ((["--padding", "100000000"], "(--input, --padding)"),
                         (["--padding", "99999999999"], "(--input, --padding)"),
                         (["--kernel", "1000000,1,1", "--padding", "same"], "--kernel 1000000,1,1"),
                         (["--input", "100000,2,800,800,800"], "(--input)")):
        args = ["check-layer", "conv3d", "--input", "1,2,8,8,8", "--grid", "1,1,1,1", *flags]
        proc = refimpl(*args, limit=(resource.RLIMIT_AS, 4 * 2**30), timeout=60)
        codes.append(expect(proc, 2, field, "at most", within=10))
    return ""


def row_digest_as_an_array(tmp, codes):
    import h5py
    import numpy
    case, path = a_case(tmp), tmp / "digest.h5"
    with h5py.File(path, "w") as h5:
        h5.attrs["case_digest"] = numpy.asarray([1, 2])
        h5.create_dataset("float64/global/y", data=numpy.zeros(1))
    proc = refimpl("oracle", "check", case, path)
    if "ambiguous" in proc.stderr:
        raise Outcome(f"numpy's message: {proc.stderr.strip()[-300:]}")
    codes.append(expect(proc, 2, str(path), "'case_digest' must be one string"))
    return ""


def row_no_quiet_on_resume(tmp, codes):
    out = tmp / "quiet"
    expect(refimpl("train", *TINY, "--steps", 2, "--out", out), 0, one_line=False)
    proc = refimpl("train", "--out", out, "--resume", "--steps", 2, "--no-quiet")
    if proc.returncode != 0 or "already at step 2" not in proc.stdout + proc.stderr:
        raise Outcome(f"exit {proc.returncode}, printed {(proc.stdout + proc.stderr).strip()[-300:]!r}")
    codes.append(0)
    return ""


def row_ctrl_c_then_resume(tmp, codes):
    out = tmp / "ctrlc"
    metrics = out / "metrics.jsonl"
    with started("train", *TINY, "--grid", "1,2,1,1", "--steps", 100000, "--checkpoint-every", 2, "--out", out,
                 ranks=2) as job:
        wait_for(lambda: (out / "checkpoint.h5").exists() and metrics.exists(), "the first checkpoint", job=job)
        os.killpg(job.pid, signal.SIGINT)                       # what a terminal's Ctrl-C sends: the whole group
        code, _ = finish(job)
    at = max(json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip())
    proc = refimpl("train", "--out", out, "--resume", "--steps", at + 2, ranks=2)  # at once
    codes.append(code)
    codes.append(expect(proc, 0, one_line=False))
    nothing_left(out)
    return "the lock was taken over with a note" if "taken over" in proc.stderr else ""


def row_newcomer_cli(tmp, codes):
    proc = refimpl("train", "--bogus")
    codes.append(expect(proc, 2, "refimpl train: error: unrecognized arguments: --bogus"))
    if "usage: refimpl train" not in proc.stderr:
        raise Outcome(f"train --bogus does not print train's usage: {proc.stderr.strip()[-300:]}")
    codes.append(expect(refimpl("train", "--step", "10"), 2, "--step 10", "did you mean --steps?"))
    codes.append(expect(refimpl("check-layer", "conv3d", "--input", "1,2,8,8,8", "--grid", "1,1,1,2"), 2,
                        "this process is 1 rank", "mpiexec -n 2"))
    return ""


#: (number, what was done, what the probe saw then, expected now, function)
ROWS = [
    (1, "--json/--save/--plot onto a FIFO and a char device (1, 7)", "exit 0, /dev/full replaced by a file",
     "2, one line naming it, node unchanged (mode, rdev, inode)", row_outputs_onto_special_files),
    (2, "datagen into a live 2-rank run's data; --resume on regenerated data", "0; resume trained on other data",
     "2 naming the job's lock, job and data untouched; 2 naming the seed change; 0 with --data-changed-ok",
     row_data_identity),
    (3, "oracle generate at file-size limits 20, 50, 100, 200 KB", "70 (SystemError in flush) at some",
     "4 at every limit, one line, nothing left", row_generate_on_a_full_disk),
    (4, "oracle generate: suites of 10^10 ranks, huge padding, input or kernel", "hang > 60 s or MemoryError (70)",
     "2 within 10 s under 4 GB of address space, naming the field and the limit", row_huge_suites),
    (5, "FIFO as results, case, results entry, metrics.jsonl", "hang",
     "2 within 10 s naming the file (UNUSABLE for the entry)", row_fifos_as_inputs),
    (6, "SIGUSR1/TERM/INT to datagen and oracle generate mid-write", "killed, `.lock` and `*.tmp-*` left",
     "138/143/130, one line, nothing left", row_signals_to_writers),
    (7, "SIGUSR1 just after train's last step, 8 tries (1 process, 2 ranks)", "1 of 4 exited 138 with no line",
     "0 every time, nothing left", row_sigusr1_after_the_last_step),
    (8, "check-layer with huge padding, kernel or input", "MemoryError, numpy's message, > 60 s",
     "2 within 10 s under 4 GB, naming the flag and the limit", row_check_layer_huge_sizes),
    (9, "a case_digest stored as an array", "2, 'truth value of an array is ambiguous'",
     "2 naming the file and the attribute", row_digest_as_an_array),
    (10, "--resume of a finished --quiet run with --no-quiet", "no --no-quiet: nothing printed",
     "0, 'already at step 2'", row_no_quiet_on_resume),
    (11, "Ctrl-C (SIGINT to mpiexec's group), then --resume at once", "once exit 2 (the dead job's lock)",
     "0, nothing left", row_ctrl_c_then_resume),
    (12, "train --bogus, train --step 10, check-layer without mpiexec", "top-level usage; --steps taken; "
     "'mpiexec started 1'", "2, one line each: train's usage; 'did you mean --steps?'; 'this process is 1 rank'",
     row_newcomer_cli),
]


def run_rows(numbers) -> list:
    results = []
    with tempfile.TemporaryDirectory(prefix="refimpl-probe-") as tmp:
        # the children's own temporaries (Open MPI's session directories) go there too
        (Path(tmp) / "tmp").mkdir()
        ENV["TMPDIR"] = str(Path(tmp) / "tmp")
        for number, what, then, now, fn in ROWS:
            if number not in numbers:
                continue
            work = Path(tmp) / f"row{number}"
            work.mkdir()
            # the shared case file lives in the row's directory: rows stay independent
            start_s = time.monotonic()
            codes = []
            try:
                verdict, detail = "holds", (fn(work, codes) or "").strip()
            except Outcome as err:
                verdict, detail = "FAILS", str(err)
            except Exception as err:                                     # the probe's own trouble
                verdict, detail = "FAILS", f"probe error: {type(err).__name__}: {err}"
            results.append(dict(row=number, done=what, then=then, expected=now, exit_codes=codes,
                                seconds=round(time.monotonic() - start_s, 1), verdict=verdict, detail=detail))
            r = results[-1]
            print(f"# row {number}: {verdict} in {r['seconds']} s" + (f" ({detail})" if detail else ""), flush=True)
    return results


def cell(text) -> str:
    """A markdown table cell: one line, no bare column separators."""
    return " ".join(str(text).split()).replace("|", "\\|")


def print_table(results) -> None:
    print("\n| row | done | the probe saw then | expected now | exit codes now | s | verdict |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        codes = ", ".join(map(str, r["exit_codes"])) or "-"
        verdict = r["verdict"] + (f": {r['detail']}" if r["detail"] else "")
        print("| " + " | ".join(cell(c) for c in (r["row"], r["done"], r["then"], r["expected"], codes, r["seconds"],
                                                  verdict)) + " |")


def parse_only(text: str) -> list:
    known = [number for number, *_ in ROWS]
    try:
        numbers = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes row numbers separated by commas (1-{len(ROWS)}), "
                                         f"got {text!r}") from None
    bad = [n for n in numbers if n not in known]
    if bad or len(set(numbers)) != len(numbers):
        raise argparse.ArgumentTypeError(f"rows are 1-{len(ROWS)}, each once; got {text!r}")
    return numbers


#: the rows that run jobs of several ranks under mpiexec
MPI_ROWS = (2, 7, 11)


def main(argv=None) -> int:
    rows = "\n".join(f"  {number:2d}  {what}" for number, what, *_ in ROWS)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1] + "\nThe rows:\n" + rows,
                                 formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    ap.add_argument("--only", type=parse_only, metavar="N[,N...]", help="run only these rows (default: all)")
    ap.add_argument("--json", metavar="FILE", help="also write the results to FILE")
    args = ap.parse_args(argv)
    numbers = args.only or [number for number, *_ in ROWS]
    needs_mpi = [n for n in numbers if n in MPI_ROWS]
    if needs_mpi and shutil.which("mpiexec") is None:
        ap.error(f"mpiexec not found, and rows {', '.join(map(str, needs_mpi))} run under it: "
                 "pip install 'refimpl[mpi]', or leave them out with --only")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        ap.error(f"--json {args.json}: no directory {Path(args.json).resolve().parent}")
    load = os.getloadavg()
    start_s = time.monotonic()
    results = run_rows(numbers)
    total = time.monotonic() - start_s
    print_table(results)
    print(f"\n# {sum(r['verdict'] == 'holds' for r in results)} of {len(results)} rows hold; {total:.0f} s; "
          f"load average {load[0]:.2f} at the start")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(rows=results, seconds=round(total, 1),
                                                   load_average=list(load)), indent=1))
    return 0 if all(r["verdict"] == "holds" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
