"""``refimpl oracle``: reference cases for checking another implementation shard by shard.

  generate SUITE --out DIR     write one HDF5 case file per (case, grid) of a suite: the
                               layer and its arguments, global inputs and expected outputs
                               and gradients, and every rank's expected local blocks
                               (float64 and float32).  SUITE: 'hard' (shipped) or a TOML file.
  run-torch CASES --out DIR    run PyTorch on the cases (global, and per rank by slicing with
                               the cases' ranges) and write results files: the model for
                               your own adapter; --plant injects a known mistake.
  check CASES RESULTS          compare results with the cases, per tensor and rank: errors,
                               tolerance and why, first mismatching global index and its
                               rank, and a diagnosis of known mistakes.

CASES is a case file or a directory of them; RESULTS a results file or a directory with
the same file names.  Layout of both files, the tolerances and a minimal writer:
docs/oracle.md.  One process (no mpiexec needed).

Exit status: 0 all passed; 1 a mismatch (check); 2 unusable input (a bad flag or suite,
a missing, truncated or mismatched results file, NaNs, wrong shapes or dtypes); 4 an
output could not be written; 70 an internal error.

Examples:
    refimpl oracle generate hard --out cases/
    refimpl oracle run-torch cases/ --out torch/
    refimpl oracle check cases/ torch/ --json report.json
    refimpl oracle run-torch cases/ --out bad/ --plant halo:1 && refimpl oracle check cases/ bad/
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ACTIONS = ("generate", "run-torch", "check")


def add_arguments(parser):
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    gen = sub.add_parser("generate", help="write the case files of a suite",
                         description="Write one HDF5 case file per (case, grid) of SUITE into DIR.")
    gen.add_argument("suite", metavar="SUITE", help="'hard' (shipped with refimpl) or a suite TOML file")
    gen.add_argument("--out", required=True, metavar="DIR", help="directory for the case files (created)")
    gen.add_argument("--case", action="append", default=None, metavar="NAME",
                     help="only this case of the suite (repeatable)")
    gen.add_argument("--break-lock", action="store_true",
                     help="take over DIR/.lock left by a generate that is gone (a live one is never broken)")
    run = sub.add_parser("run-torch", help="PyTorch's results on the cases (the model adapter)",
                         description="Run PyTorch on every case, globally and per rank by slicing with the "
                                     "case's ranges, and write one results file per case into DIR.")
    run.add_argument("cases", metavar="CASES", help="a case file or a directory of case files")
    run.add_argument("--out", required=True, metavar="DIR", help="directory for the results files (created)")
    run.add_argument("--plant", default=None, metavar="BUG",
                     help="inject a known mistake: halo:R, ghost-clear, padding:D|H|W, bn-local-stats, "
                          "dw-unsummed (see refimpl/oracle/torch_adapter.py)")
    run.add_argument("--global", dest="global_mode", choices=("whole", "gathered", "none"), default="whole",
                     help="global results: PyTorch on the whole tensor (default), the ranks' blocks "
                          "gathered, or none")
    run.add_argument("--no-ranks", action="store_true", help="write no per-rank results")
    chk = sub.add_parser("check", help="compare results with the cases",
                         description="Compare RESULTS with CASES tensor by tensor and rank by rank.")
    chk.add_argument("cases", metavar="CASES", help="a case file or a directory of case files")
    chk.add_argument("results", metavar="RESULTS", help="a results file, or a directory with the cases' names")
    chk.add_argument("--json", default=None, metavar="FILE", help="also write the full report as JSON")
    chk.add_argument("--tolerance-factor", type=float, default=1.0, metavar="F",
                     help="multiply every tolerance by F (>= 1; for inexact algorithms such as Winograd)")
    chk.add_argument("--verbose", action="store_true", help="one line per tensor, passing ones too")
    for p in (gen, run, chk):           # --debug after the action too ('refimpl oracle check ... --debug')
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show Python tracebacks on failures (also REFIMPL_DEBUG=1)")


def case_paths(path: str) -> list[str]:
    """The case files named by CASES (a file, or every .h5 of a directory)."""
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".h5"))
        if not files:
            raise ValueError(f"{path}: no case files (*.h5) in this directory")
        return files
    if not os.path.exists(path):
        raise ValueError(f"{path}: no such case file or directory")
    return [path]


def results_path(results: str, case_path: str, single: bool) -> str:
    if os.path.isdir(results):
        return os.path.join(results, os.path.basename(case_path))
    if not single:
        raise ValueError(f"{results}: CASES is a directory, so RESULTS must be a directory of results "
                         f"files with the cases' names")
    return results


def make_out_dir(path: str) -> None:
    """Create the --out directory; ValueError (exit 2) if a file is in the way or it cannot be made."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--out {path}: exists and is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--out {path}: cannot create the directory ({err.strerror})") from None


def generate(args) -> int:
    """Write the suite's case files into --out, holding --out/.lock (a second generate there exits 2)."""
    from ..failstop import WriteError, check_writable, describe
    from ..run_lock import RunLock
    from ..oracle.casefile import write_case
    from ..oracle.suite import load_suite
    specs = load_suite(args.suite)
    if args.case:
        unknown = sorted(set(args.case) - {s.name for s in specs})
        if unknown:
            raise ValueError(f"--case {unknown[0]}: not in suite {args.suite} "
                             f"(it has: {', '.join(sorted({s.name for s in specs}))})")
        specs = [s for s in specs if s.name in args.case]
    make_out_dir(args.out)
    check_writable(os.path.join(args.out, specs[0].file_name), "--out")
    start, size = time.perf_counter(), 0
    try:
        with RunLock(args.out).acquire(break_lock=args.break_lock) as lock:   # LockHeld: exit 2
            if lock.note:
                print(f"refimpl oracle generate: note: {lock.note}", file=sys.stderr, flush=True)
            for spec in specs:
                path = write_case(spec, args.out)
                size += os.path.getsize(path)
                print(f"wrote {path}  ({spec.layer}, input {list(spec.input)}, grid {list(spec.grid)}, "
                      f"{spec.ranks} rank{'s' * (spec.ranks > 1)})", flush=True)
    except OSError as err:          # disk full, ...: the failed case file left no temporary
        raise WriteError(f"writing {args.out} failed: {describe(err)}", agreed=True) from None
    print(f"{len(specs)} case file{'s' * (len(specs) != 1)}, {size / 2**20:.1f} MiB, in {time.perf_counter() - start:.1f} s")
    return 0


def run_torch(args) -> int:
    from ..failstop import check_writable
    from ..oracle import casefile, torch_adapter
    paths = case_paths(args.cases)
    cases = [casefile.load_case(p) for p in paths]
    plants = [torch_adapter.parse_plant(args.plant, case) for case in cases]
    if args.global_mode == "none" and args.no_ranks:
        raise ValueError("--global none and --no-ranks leave nothing to write")
    make_out_dir(args.out)
    check_writable(os.path.join(args.out, os.path.basename(paths[0])), "--out")
    for case, plant in zip(cases, plants):
        glob, ranks = torch_adapter.run_case(case, plant, args.global_mode, not args.no_ranks)
        out = os.path.join(args.out, case.name)
        casefile.write_results(out, case, glob, ranks)
        print(f"wrote {out}", flush=True)
    return 0


def _fmt(finding) -> str:
    where = "global" if finding.rank is None else f"rank {finding.rank}"
    text = (f"    {finding.dtype} {finding.tensor:<13} {where:<8} max_rel {finding.max_rel:.2e} "
            f"{'<=' if finding.ok else '>'} tol {finding.tolerance:.2e} ({finding.why})")
    if not finding.ok:
        text += (f"\n        {finding.mismatches} element(s) off; first at global index "
                 f"{list(finding.first_index)}, owned by rank {finding.owner}")
        text += f"\n        diagnosis: {finding.diagnosis or 'no known pattern'}"
    return text


def check(args) -> int:
    from ..failstop import EXIT_CHECK_FAILED, atomic_write, check_writable
    from ..oracle import casefile
    from ..oracle.compare import compare, root_cause
    if not args.tolerance_factor >= 1.0:
        raise ValueError(f"--tolerance-factor must be >= 1, got {args.tolerance_factor}")
    if args.json:
        check_writable(args.json, "--json")
    paths = case_paths(args.cases)
    single = not os.path.isdir(args.cases)
    if not os.path.exists(args.results):
        raise ValueError(f"{args.results}: no such results file or directory")
    loaded = []
    for path in paths:     # everything is read and validated before anything is reported
        case = casefile.load_case(path)
        loaded.append((case, casefile.load_results(results_path(args.results, path, single), case)))
    reports = [compare(case, results, args.tolerance_factor) for case, results in loaded]
    for report in reports:
        print(f"{'PASS' if report.ok else 'FAIL'} {report.case}")
        cause = root_cause(report)
        if cause is not None:
            where = "global" if cause.rank is None else f"rank {cause.rank}"
            print(f"    most likely cause ({cause.dtype} {cause.tensor}, {where}): {cause.diagnosis}")
        worst, consequences = {}, {}
        for f in report.findings:                 # compare() lists them in causal order
            ratio = f.max_rel / f.tolerance if f.tolerance else 0.0
            if f.dtype not in worst or ratio > worst[f.dtype][0]:
                worst[f.dtype] = (ratio, f)
            if not f.ok and f.diagnosis and f.diagnosis.startswith("follows") and not args.verbose:
                consequences.setdefault((f.dtype, f.tensor, f.diagnosis), []).append(
                    "global" if f.rank is None else f"rank {f.rank}")
            elif not f.ok or args.verbose:
                print(_fmt(f))
        for (dtype, tensor, diagnosis), where in consequences.items():
            print(f"    {dtype} {tensor:<13} {', '.join(where)}: {diagnosis}")
        if report.ok and not args.verbose:
            print("    " + "; ".join(f"{d}: worst {f.tensor}{'' if f.rank is None else f'[rank {f.rank}]'} "
                                     f"max_rel {f.max_rel:.1e} = {r:.2f} of its tolerance"
                                     for d, (r, f) in worst.items()))
    failed = sum(not r.ok for r in reports)
    print(f"{len(reports)} case(s): {len(reports) - failed} passed, {failed} failed")
    if args.json:
        text = json.dumps({"ok": not failed, "cases": [r.as_dict() for r in reports]}, indent=1)
        atomic_write(args.json, lambda f: f.write(text))
    return EXIT_CHECK_FAILED if failed else 0


def run(args) -> int:
    from ..failstop import launcher_size
    from ..failstop import InputError, run_command

    def body():
        if launcher_size() > 1:
            raise InputError("refimpl oracle runs in one process: start it without mpiexec", agreed=True)
        try:
            return {"generate": generate, "run-torch": run_torch, "check": check}[args.action](args)
        except ValueError as err:          # UnusableInput included: exit 2, one line
            raise InputError(str(err), agreed=True) from None
    return run_command(f"oracle {args.action}", None, body)


