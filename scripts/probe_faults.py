#!/usr/bin/env python
"""Re-run the fault probe's failing rows (issue 41) against the real CLI and print one table.

A fault probe run by hand as a cluster user would (43 kinds of fault, about 330 runs on 2-4
ranks) found ten rows where refimpl failed, plus the stumbles of a newcomer's first hour.
Each has its own test since; this script re-runs them the way the probe did — real
subprocesses of ``python -m refimpl``, under ``mpiexec`` where the row is about a job of
several ranks, real FIFOs, device nodes, signals and file-size limits — and checks the
outcome now expected: the exit code *and* the side condition (the node unchanged, no lock or
temporary left, one line naming the file or field, done within the time allowed).

    python scripts/probe_faults.py                 # every row (about 2 minutes on 2 cores)
    python scripts/probe_faults.py --only 1,9,12    # some rows
    python scripts/probe_faults.py --json FILE      # also the numbers as JSON

Columns: the row, what was done, what the probe saw then, what is expected now, the exit
codes seen, seconds, and the verdict (holds / FAILS, or skipped with the reason: a device
node needs root).  Exit status 0 when every row run holds, 1 otherwise, 2 for bad flags.
Everything is written in a temporary directory, removed at the end.
"""
from __future__ import annotations

import argparse
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
    """Run ``command(ARGS, ranks)``: CompletedProcess with ``seconds``.  ``limit``: (resource,
    bytes) set in the child before it runs."""
    cmd = command(args, ranks)

    def preexec():
        if limit is not None:
            resource.setrlimit(limit[0], (limit[1], limit[1]))
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=preexec)
    proc.seconds = time.monotonic() - start
    return proc


def start(*args, ranks=None):
    return subprocess.Popen(command(args, ranks), cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def wait_for(predicate, what, timeout=90.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise Outcome(f"timed out waiting for {what}")
        time.sleep(0.05)


def refimpl_lines(stderr: str) -> list:
    return [line for line in stderr.splitlines() if line.startswith("refimpl")]


def expect(proc, code, *fragments, one_line=True, within=None):
    """The exit ``code``, every fragment in stderr, one refimpl line, done ``within`` seconds."""
    text = proc.stderr.strip()
    if proc.returncode != code:
        raise Outcome(f"exit {proc.returncode}, expected {code}: {text[-300:]}")
    missing = [f for f in fragments if f not in proc.stderr]
    if missing:
        raise Outcome(f"stderr lacks {missing}: {text[-300:]}")
    if one_line and len(refimpl_lines(proc.stderr)) != 1:
        raise Outcome(f"{len(refimpl_lines(proc.stderr))} refimpl lines: {text[-300:]}")
    if within is not None and proc.seconds > within:
        raise Outcome(f"took {proc.seconds:.1f} s, more than {within} s")
    return proc.returncode


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
    """A character device like /dev/null (1, 3) in the temporary directory; None without root."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        return None
    return path


def node_kept(path, before):
    after = os.stat(path)
    if stat.S_IFMT(after.st_mode) != stat.S_IFMT(before.st_mode) or after.st_ino != before.st_ino:
        raise Outcome(f"{path} was replaced")


# ---------------------------------------------------------------------------- the rows

def row_outputs_onto_special_files(tmp):
    case, codes = a_case(tmp), []
    fifo = tmp / "out.fifo"
    os.mkfifo(fifo)
    targets = [fifo] + [p for p in [a_char_device(tmp / "null")] if p]
    for target in targets:
        for args in (["oracle", "check", case, case, "--json", target],
                     ["check-layer", "conv3d", "--input", "1,2,6,6,6", "--grid", "1,1,1,1", "--save", target],
                     ["plan", "--model", "cosmoflow", "--ranks", "2", "--batch", "4", "--json", target],
                     ["plan", "--model", "cosmoflow", "--ranks", "2", "--batch", "4", "--plot", target]):
            before = os.stat(target)
            codes.append(expect(refimpl(*args, timeout=60), 2, "not a regular file", within=30))
            node_kept(target, before)
    note = "" if len(targets) == 2 else " (no device node: not root)"
    return codes, note


def row_data_identity(tmp):
    out, codes = tmp / "live", []
    job = start("train", *TINY, "--steps", 100000, "--out", out, "--checkpoint-every", 1000)
    try:
        wait_for(lambda: (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").stat().st_size > 0,
                 "the live job's first metrics")
        proc = refimpl("datagen", "cosmoflow", "--out", out / "data", "--samples", 8, "--size", 16, "--overwrite",
                       "--quiet")
        codes.append(expect(proc, 2, "running", one_line=False))
    finally:
        os.killpg(job.pid, signal.SIGTERM)
        job.communicate(timeout=60)
    data, run = a_dataset(tmp / "data", 1000), tmp / "run"
    expect(refimpl("train", *TINY, "--data", data, "--steps", 2, "--global-batch", 2, "--out", run), 0, one_line=False)
    a_dataset(data, 5000)                                        # the same files, other universes
    proc = refimpl("train", "--out", run, "--resume", "--steps", 3)
    codes.append(expect(proc, 2, "changed"))
    proc = refimpl("train", "--out", run, "--resume", "--steps", 3, "--data-changed-ok")
    codes.append(expect(proc, 0, one_line=False))
    return codes, ""


def row_generate_on_a_full_disk(tmp):
    codes = []
    for fsize in (20_000, 50_000, 100_000, 200_000):
        out = tmp / f"cases-{fsize}"
        proc = refimpl("oracle", "generate", "hard", "--out", out, limit=(resource.RLIMIT_FSIZE, fsize))
        codes.append(expect(proc, 4, "File too large"))
        nothing_left(out)
    return codes, ""


HUGE_SUITES = ['grids = [[1, 100000, 100000, 1]]\ninput = [1, 2, 8, 8, 8]',
               'padding = 1000\ngrids = [[1, 1, 1, 1]]\ninput = [1, 2, 8, 8, 8]',
               'padding = [0, 99999999999, 0, 0, 0, 0]\ngrids = [[1, 1, 1, 1]]\ninput = [1, 2, 8, 8, 8]',
               'input = [100000, 2, 800, 800, 800]\ngrids = [[1, 1, 1, 1]]',
               'kernel = 1000000\npadding = "same"\ngrids = [[1, 1, 1, 1]]\ninput = [1, 2, 8, 8, 8]']


def row_huge_suites(tmp):
    codes = []
    for i, extra in enumerate(HUGE_SUITES):
        suite = tmp / f"huge{i}.toml"
        suite.write_text('[[case]]\nname = "x"\nlayer = "conv3d"\nout_channels = 2\n' + extra + "\n")
        proc = refimpl("oracle", "generate", suite, "--out", tmp / f"huge{i}", limit=(resource.RLIMIT_AS, 4 * 2**30),
                       timeout=60)
        codes.append(expect(proc, 2, "at most", within=10))
    return codes, ""


def row_fifos_as_inputs(tmp):
    case, codes = a_case(tmp), []
    fifo = tmp / "in.fifo"
    os.mkfifo(fifo)
    codes.append(expect(refimpl("oracle", "check", case, fifo, timeout=30), 2, "FIFO", within=10))
    codes.append(expect(refimpl("oracle", "check", fifo, case, timeout=30), 2, "FIFO", within=10))
    results = tmp / "results"
    results.mkdir()
    os.mkfifo(results / os.path.basename(case))
    proc = refimpl("oracle", "check", os.path.dirname(case), results, timeout=30)
    if proc.returncode != 2 or "UNUSABLE" not in proc.stdout or proc.seconds > 10:
        raise Outcome(f"a FIFO in a results directory: exit {proc.returncode} in {proc.seconds:.1f} s")
    codes.append(2)
    out = tmp / "fiforun"
    out.mkdir()
    os.mkfifo(out / "metrics.jsonl")
    codes.append(expect(refimpl("train", *TINY, "--steps", 1, "--out", out, timeout=60), 2, "metrics.jsonl", "FIFO",
                        within=30))
    return codes, ""


def signal_when_writing(args, out, sig):
    job = start(*args)
    try:
        wait_for(lambda: out.exists() and any(".tmp-" in p.name for p in out.rglob("*")), "a temporary file")
        job.send_signal(sig)
        _, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    return job.returncode, err


def row_signals_to_writers(tmp):
    codes = []
    for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        out = tmp / f"data-{sig.name}"
        code, err = signal_when_writing(["datagen", "cosmoflow", "--out", out, "--samples", 2000, "--size", 32,
                                         "--quiet"], out, sig)
        if code != 128 + sig or f"interrupted by {sig.name}" not in err:
            raise Outcome(f"datagen, {sig.name}: exit {code}: {err.strip()[-300:]}")
        nothing_left(out)
        codes.append(code)
    out = tmp / "cases-signal"
    code, err = signal_when_writing(["oracle", "generate", "hard", "--out", out], out, signal.SIGUSR1)
    if code != 138 or "interrupted by SIGUSR1" not in err:
        raise Outcome(f"oracle generate, SIGUSR1: exit {code}: {err.strip()[-300:]}")
    nothing_left(out)
    return codes + [code], ""


def row_sigusr1_after_the_last_step(tmp):
    codes = []
    for attempt in range(4):
        out = tmp / f"last-{attempt}"
        metrics = out / "metrics.jsonl"
        job = start("train", *TINY, "--steps", 3, "--out", out)
        wait_for(lambda: metrics.exists() and '"step": 3' in metrics.read_text(), "step 3's metrics")
        job.send_signal(signal.SIGUSR1)
        _, err = job.communicate(timeout=60)
        if job.returncode != 0:
            raise Outcome(f"try {attempt + 1}: exit {job.returncode}: {err.strip()[-300:]}")
        codes.append(0)
    return codes, ""


def row_check_layer_huge_sizes(tmp):
    codes = []
    for flags in (["--padding", "100000000"], ["--kernel", "1000000,1,1", "--padding", "same"],
                  ["--padding", "99999999999"]):
        proc = refimpl("check-layer", "conv3d", "--input", "1,2,8,8,8", "--grid", "1,1,1,1", *flags,
                       limit=(resource.RLIMIT_AS, 4 * 2**30), timeout=60)
        codes.append(expect(proc, 2, "at most", within=10))
    proc = refimpl("check-layer", "conv3d", "--input", "100000,2,800,800,800", "--grid", "1,1,1,1",
                   limit=(resource.RLIMIT_AS, 4 * 2**30), timeout=60)
    codes.append(expect(proc, 2, "at most", within=10))
    return codes, ""


def row_digest_as_an_array(tmp):
    import h5py
    import numpy
    case, path = a_case(tmp), tmp / "digest.h5"
    with h5py.File(path, "w") as h5:
        h5.attrs["case_digest"] = numpy.asarray([1, 2])
        h5.create_dataset("float64/global/y", data=numpy.zeros(1))
    return [expect(refimpl("oracle", "check", case, path), 2, str(path), "'case_digest' must be one string")], ""


def row_no_quiet_on_resume(tmp):
    out = tmp / "quiet"
    expect(refimpl("train", *TINY, "--steps", 2, "--out", out), 0, one_line=False)
    proc = refimpl("train", "--out", out, "--resume", "--steps", 2, "--no-quiet")
    if proc.returncode != 0 or "already at step 2" not in proc.stdout + proc.stderr:
        raise Outcome(f"exit {proc.returncode}, printed {(proc.stdout + proc.stderr).strip()[-300:]!r}")
    return [0], ""


def row_ctrl_c_then_resume(tmp):
    out = tmp / "ctrlc"
    metrics = out / "metrics.jsonl"
    job = start("train", *TINY, "--grid", "1,2,1,1", "--steps", 100000, "--checkpoint-every", 2, "--out", out,
                ranks=2)
    try:
        wait_for(lambda: (out / "checkpoint.h5").exists() and metrics.exists(), "the first checkpoint")
        job.send_signal(signal.SIGINT)                                # what a terminal's Ctrl-C sends mpiexec
        job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    at = max(json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip())
    proc = refimpl("train", "--out", out, "--resume", "--steps", at + 2, ranks=2)  # at once
    return [job.returncode, expect(proc, 0, one_line=False)], ""


def row_newcomer_cli(tmp):
    codes = [expect(refimpl("train", "--bogus"), 2, "usage: refimpl train", "unrecognized arguments: --bogus",
                    one_line=False),
             expect(refimpl("train", "--step", "10"), 2, "did you mean --steps?", one_line=False),
             expect(refimpl("check-layer", "conv3d", "--input", "1,2,8,8,8", "--grid", "1,1,1,2"), 2,
                    "this process is 1 rank", "mpiexec -n 2")]
    return codes, ""


#: (number, what was done, what the probe saw then, expected now, function)
ROWS = [
    (1, "--json/--save/--plot onto a FIFO and a char device", "exit 0, /dev/full replaced by a file",
     "2, one line, node unchanged", row_outputs_onto_special_files),
    (2, "datagen into a live run's data; --resume on regenerated data", "0; resume trained on other data",
     "2 naming the job; 2 'changed'; 0 with --data-changed-ok", row_data_identity),
    (3, "oracle generate at file-size limits 20-200 KB", "70 (SystemError in flush) at some",
     "4 at every limit, nothing left", row_generate_on_a_full_disk),
    (4, "suites of 10^10 ranks, huge padding, input or kernel", "hang > 60 s or MemoryError (70)",
     "2 within 10 s under 4 GB of address space", row_huge_suites),
    (5, "FIFO as results, case, results entry, metrics.jsonl", "hang", "2 at once (UNUSABLE for the entry)",
     row_fifos_as_inputs),
    (6, "SIGUSR1/TERM/INT to datagen; SIGUSR1 to oracle generate", "killed, .lock and *.tmp-* left",
     "138/143/130, one line, nothing left", row_signals_to_writers),
    (7, "SIGUSR1 just after train's last step, 4 tries", "1 of 4 exited 138 with no line", "0 every time",
     row_sigusr1_after_the_last_step),
    (8, "check-layer with huge padding, kernel or input", "MemoryError, numpy's message, > 60 s",
     "2 within 10 s under 4 GB", row_check_layer_huge_sizes),
    (9, "a case_digest stored as an array", "2, 'truth value of an array is ambiguous'",
     "2 naming the file and the attribute", row_digest_as_an_array),
    (10, "--resume of a finished --quiet run with --no-quiet", "no --no-quiet: nothing printed",
     "0, 'already at step 2'", row_no_quiet_on_resume),
    (11, "Ctrl-C (SIGINT to mpiexec), then --resume at once", "once exit 2 (the dead job's lock)",
     "0: the lock taken over", row_ctrl_c_then_resume),
    (12, "train --bogus, train --step 10, check-layer without mpiexec", "top-level usage; --steps taken; "
     "'mpiexec started 1'", "2 with train's usage; 'did you mean --steps?'; 'this process is 1 rank'",
     row_newcomer_cli),
]


def run_rows(numbers) -> list:
    results = []
    with tempfile.TemporaryDirectory(prefix="refimpl-probe-") as tmp:
        for number, what, then, now, fn in ROWS:
            if number not in numbers:
                continue
            work = Path(tmp) / f"row{number}"
            work.mkdir()
            # the shared case file lives in the row's directory: rows stay independent
            start_s = time.monotonic()
            try:
                codes, note = fn(work)
                verdict, detail = "holds", note.strip()
            except Outcome as err:
                codes, verdict, detail = [], "FAILS", str(err)
            except subprocess.TimeoutExpired as err:
                codes, verdict, detail = [], "FAILS", f"timed out: {' '.join(map(str, err.cmd))[-200:]}"
            results.append(dict(row=number, done=what, then=then, expected=now, exit_codes=codes,
                                seconds=round(time.monotonic() - start_s, 1), verdict=verdict, detail=detail))
            r = results[-1]
            print(f"# row {number}: {verdict} in {r['seconds']} s" + (f" ({detail})" if detail else ""), flush=True)
    return results


def print_table(results) -> None:
    print("\n| row | done | the probe saw then | expected now | exit codes now | s | verdict |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        codes = ", ".join(map(str, r["exit_codes"])) or "-"
        verdict = r["verdict"] + (f": {r['detail']}" if r["detail"] else "")
        print(f"| {r['row']} | {r['done']} | {r['then']} | {r['expected']} | {codes} | {r['seconds']} | {verdict} |")


def parse_only(text: str) -> list:
    known = [number for number, *_ in ROWS]
    try:
        numbers = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--only takes row numbers separated by commas (1-{len(ROWS)}), "
                                         f"got {text!r}") from None
    bad = [n for n in numbers if n not in known]
    if bad or len(set(numbers)) != len(numbers):
        raise argparse.ArgumentTypeError(f"--only: rows are 1-{len(ROWS)}, each once; got {text!r}")
    return numbers


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    ap.add_argument("--only", type=parse_only, metavar="N[,N...]", help="run only these rows (default: all)")
    ap.add_argument("--json", metavar="FILE", help="also write the results to FILE")
    args = ap.parse_args(argv)
    if shutil.which("mpiexec") is None:
        ap.error("mpiexec not found: pip install 'refimpl[mpi]' (rows 11 runs under mpiexec)")
    numbers = args.only or [number for number, *_ in ROWS]
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
