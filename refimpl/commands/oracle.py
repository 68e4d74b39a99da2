"""``refimpl oracle``: reference cases for checking another implementation shard by shard.

  generate SUITE --out DIR     write one HDF5 case file per (case, grid) of a suite: the
                               layer and its arguments, global inputs and expected outputs
                               and gradients, and every rank's expected local blocks
                               (float64 and float32).  SUITE: 'hard' (shipped) or a TOML file.
  run-torch CASES --out DIR    run PyTorch on the cases (global, and per rank by slicing with
                               the cases' ranges) and write results files: the model for
                               your own adapter; --plant injects a known mistake.
  run-dtensor CASES --out DIR  run PyTorch DTensor (torch.distributed.tensor, gloo, CPU) on
                               the cases, one process per rank, and write each rank's
                               local shards in DTensor's own layout (an 'offset' per
                               dataset) plus DIR/dtensor_summary.json: per case and
                               tensor ok / refused / crashed (docs/peers.md).
  check CASES RESULTS          compare results with the cases, per tensor and rank: errors,
                               tolerance and why, first mismatching global index and its
                               rank, and a diagnosis of known mistakes.  Results may be in
                               any block layout (an 'offset' attribute per block) and
                               partial (some tensors, some ranks, some cases: the rest is
                               'not provided' / 'not run'; --require makes it a failure).
  trace ACTION                 one training step of a whole model (CosmoFlow, U-Net) compared
                               layer by layer: 'trace layers', 'trace generate' (the reference
                               trace), 'trace run-torch' (the PyTorch twin), 'trace check'
                               (each layer judged on the peer's own input; the first wrong
                               layer, rank and cell): refimpl oracle trace --help.

CASES is a case file or a directory of them; RESULTS a results file or a directory with
the same file names.  Layout of both files, the tolerances and a minimal writer:
docs/oracle.md.  One process (no mpiexec needed).

Exit status: 0 all passed (check: everything provided passed); 1 a mismatch (NaN/inf,
wrong shapes, a block past the tensor's end and cells no rank's block covers included), a
case incomplete (a tensor some ranks hold is absent on others: a crashed rank; see
--allow-missing-ranks), or a piece --require asks for is missing; 2 unusable input
(a bad flag or suite, a results or case file that cannot be checked: truncated, for
another case, a wrong dtype, an unknown dataset; every other case is still judged and
reported); 4 an output could not be written; 70 an internal error.

Examples:
    refimpl oracle generate hard --out cases/
    refimpl oracle run-torch cases/ --out torch/
    refimpl oracle check cases/ torch/ --json report.json
    refimpl oracle check cases/ mine/ --require forward     # y must be there for every case
    refimpl oracle run-torch cases/ --out bad/ --plant halo:1 && refimpl oracle check cases/ bad/
    refimpl oracle run-dtensor cases/ --out dtensor/ && refimpl oracle check cases/ dtensor/
    refimpl oracle trace generate --model cosmoflow --preset tiny --grid 1,2,2,1 --out trace.h5
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ACTIONS = ("generate", "run-torch", "run-dtensor", "check", "trace")


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
                     help="inject a known mistake: halo:R, ghost-clear, padding:D|H|W, local-stats, "
                          "dw-unsummed (see refimpl/oracle/torch_adapter.py)")
    run.add_argument("--global", dest="global_mode", choices=("whole", "gathered", "none"), default="whole",
                     help="global results: PyTorch on the whole tensor (default), the ranks' blocks "
                          "gathered, or none")
    run.add_argument("--no-ranks", action="store_true", help="write no per-rank results")
    # --- run-dtensor (refimpl/oracle/dtensor_adapter.py) ---
    dt = sub.add_parser(
        "run-dtensor", help="PyTorch DTensor's results on the cases (a peer under test)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="""\
Run PyTorch DTensor (torch.distributed.tensor: DeviceMesh, Shard, Replicate,
distribute_tensor; gloo on the CPU) on every case, as the implementation under test:
N processes (N: the case's rank count), a mesh shaped like the case's grid, x sharded
along the split axes with Shard(dim), parameters Replicate (sharded on the model axis
for model-parallel cases), the layer's torch.nn.functional call on the DTensors, then a
backward with the case's dy.

Each rank's local shards of y and dx are written in DTensor's own layout: every dataset
has an 'offset' attribute, the global index of its first element (torch.chunk splits:
W = 6 over 4 ranks is 2, 2, 2, 0); dw and db are written once (/<dtype>/global).
Forward and backward run in separate try blocks.  What DTensor refused or crashed on is
left out of the results file and listed in DIR/dtensor_summary.json (case, dtype,
tensor, ok / refused / crashed, the exception's first line).

Then: refimpl oracle check CASES DIR.  What it finds in DTensor: docs/peers.md.

With --trace TRACE (from 'refimpl oracle trace generate') instead of CASES: a whole
model's training step under DTensor.  The model's PyTorch twin (the trace's module
names) with the trace's initial parameters, every parameter Replicate, the batch
distribute_tensor'd per the trace's grid (Shard on n, d, h, w), and hooks that write
every layer's local shards of y and dx with their offsets, the gathered dw and db, the
loss and the parameters after the update into --out (one results file, the trace
results layout).  What fails (refused, crashed) ends the step there; what was written
stays.  Then: refimpl oracle trace check TRACE RESULTS names the first layer that goes
wrong, on which rank, and why (docs/peers.md, "A whole CosmoFlow step").""")
    dt.add_argument("cases", metavar="CASES", nargs="?", default=None,
                    help="a case file or a directory of case files (or --trace)")
    dt.add_argument("--trace", default=None, metavar="TRACE",
                    help="a trace file: run one training step of its model under DTensor instead of cases")
    dt.add_argument("--out", required=True, metavar="DIR",
                    help="directory for the results files (created); with --trace, the results file")
    dt.add_argument("--nproc", type=int, default=None, metavar="N",
                    help="world size; default: each case's rank count.  Cases whose grid has another "
                         "rank count are skipped (listed as such)")
    dt.add_argument("--timeout", type=float, default=120.0, metavar="S",
                    help="seconds one case's ranks may take before they are killed (default 120); "
                         "what they wrote before stays, the rest is reported crashed")
    dt.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                    help="show Python tracebacks on failures (also REFIMPL_DEBUG=1)")
    # --- end run-dtensor ---
    chk = sub.add_parser("check", help="compare results with the cases",
                         description="Compare RESULTS with CASES tensor by tensor and rank by rank.")
    chk.add_argument("cases", metavar="CASES", help="a case file or a directory of case files")
    chk.add_argument("results", metavar="RESULTS", help="a results file, or a directory with the cases' names")
    chk.add_argument("--json", default=None, metavar="FILE", help="also write the full report as JSON")
    chk.add_argument("--tolerance-factor", type=float, default=1.0, metavar="F",
                     help="multiply every tolerance by F (>= 1; for inexact algorithms such as Winograd)")
    chk.add_argument("--verbose", action="store_true", help="one line per tensor, passing ones too")
    chk.add_argument("--require", default=None, metavar="WHAT",
                     help="make missing results a failure: all (y, dx and the parameter gradients in every "
                          "dtype of the case), forward (y), backward (dx, dw, db), params (dw, db), or tensor "
                          "names y, dx, dw, db; comma-separated.  Default: judge what is there")
    chk.add_argument("--allow-missing-ranks", action="store_true",
                     help="the peer runs on fewer ranks on purpose: a tensor some ranks hold and others lack "
                          "is judged on the ranks that hold it (default: the case is 'incomplete', exit 1 — "
                          "the mark of a rank that crashed)")
    from . import oracle_trace         # the 'trace' action: refimpl/commands/oracle_trace.py
    oracle_trace.add_parser(sub)
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
    from ..errors import WriteError, describe
    from ..paths import check_writable
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
    from ..paths import check_writable
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


def run_dtensor(args) -> int:
    """refimpl oracle run-dtensor: DTensor on every case, results in DIR, a summary of refusals."""
    from ..paths import check_writable
    from ..oracle import casefile, dtensor_adapter
    if args.nproc is not None and args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout}")
    dtensor_adapter.torch_version()                      # exit 2 without PyTorch
    if (args.cases is None) == (args.trace is None):
        raise ValueError("run-dtensor needs CASES (layer cases) or --trace TRACE (a model's step), not both "
                         "or neither")
    if args.trace is not None:
        return run_dtensor_trace(args)
    cases = [casefile.load_case(p) for p in case_paths(args.cases)]
    run_cases = [c for c in cases if args.nproc is None or c.spec.ranks == args.nproc]   # in CASES order
    if not run_cases:
        raise ValueError(f"--nproc {args.nproc}: none of the {len(cases)} case(s) has a grid of "
                         f"{args.nproc} rank(s)")
    make_out_dir(args.out)
    check_writable(os.path.join(args.out, run_cases[0].name), "--out")
    entries = [{"case": c.name, "layer": c.spec.layer, "grid": list(c.spec.grid), "world": c.spec.ranks,
                "skipped": f"grid needs {c.spec.ranks} ranks, --nproc {args.nproc}", "tensors": []}
               for c in cases if c.spec.ranks != args.nproc and args.nproc is not None]
    for entry in entries:
        print(f"skipped {entry['case']} (grid {entry['grid']}: {entry['world']} ranks)", flush=True)

    def report(entry):
        status = dtensor_adapter.tensor_status(entry)
        print(f"wrote {os.path.join(args.out, entry['case'])}  ({entry['world']} ranks; "
              + ", ".join(f"{t} {s}" for t, s in status.items()) + ")", flush=True)
        for rec in entry["tensors"]:
            if rec["status"] != "ok":
                print(f"    {rec['dtype']} {rec['tensor']:<3} {rec['status']}: {rec['error']}", flush=True)
            elif rec.get("shape_disagrees"):         # a DTensor finding of its own: its label is wrong
                ranks = rec["shape_disagrees"]
                print(f"    {rec['dtype']} {rec['tensor']:<3} DTensor's placements {rec['placements']} claim another "
                      f"local shape than rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))} "
                      f"hold{'s' * (len(ranks) == 1)}: placed by the shard's shape and torch.chunk's rule", flush=True)
    entries += dtensor_adapter.run_cases(run_cases, args.out, args.timeout, report=report)
    print(f"summary: {dtensor_adapter.write_summary(args.out, entries, args.nproc)}")
    return 0


def run_dtensor_trace(args) -> int:
    """run-dtensor --trace: DTensor runs the trace's steps; one results file, and what failed."""
    from ..paths import check_writable
    from ..oracle import dtensor_adapter
    from ..oracle.trace import load_trace
    if args.nproc is not None:
        raise ValueError("--nproc does not apply to --trace: the world size is the trace grid's rank count")
    trace = load_trace(args.trace)
    if os.path.isdir(args.out):
        raise ValueError(f"--out {args.out}: a directory; with --trace, --out is the results file to write")
    check_writable(args.out, "--out")
    timeout = args.timeout if args.timeout != 120.0 else 300.0
    events = dtensor_adapter.run_trace(trace, args.out, timeout)
    print(f"wrote {args.out}  ({trace.spec.model} {trace.spec.preset}, grid {list(trace.spec.grid)}, "
          f"{trace.spec.ranks} rank{'s' * (trace.spec.ranks > 1)}, {trace.spec.steps} step"
          f"{'s' * (trace.spec.steps > 1)})", flush=True)
    for e in events:
        if e.get("failure"):
            f = e["failure"]
            where = f"{f['stage']}" + (f" of {f['layer']}" if f.get("layer") else "")
            print(f"    {e['dtype']} rank {e['rank']}: {f['status']} in the {where}: {f['error']}", flush=True)
        elif e.get("exit"):
            print(f"    {e['dtype']} rank {e['rank']}: {e['exit']}: {e['log']}", flush=True)
    labels = {}
    for e in events:
        if e.get("mislabelled"):
            labels.setdefault((e["dtype"], e["mislabelled"]), []).append(e["rank"])
    for (dtype, name), ranks in list(labels.items())[:8]:
        print(f"    {dtype} {name}: DTensor's placements claim another local shape than rank"
              f"{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))} hold{'s' * (len(ranks) == 1)} "
              f"(placed by the shard's shape)", flush=True)
    if len(labels) > 8:
        print(f"    ... {len(labels) - 8} more tensors whose placements contradict their shapes", flush=True)
    print(f"then: refimpl oracle trace check {args.trace} {args.out}")
    return 0


def _fmt(finding) -> str:
    where = "global" if finding.rank is None else f"rank {finding.rank}"
    if finding.problem == "uncovered":
        return f"    {finding.dtype} {finding.tensor:<13} {'blocks':<8} {finding.message}"
    if finding.problem == "excess":
        text = f"    {finding.dtype} {finding.tensor:<13} {where:<8} block past the end: {finding.message}"
        if finding.diagnosis and finding.diagnosis != finding.message:
            text += f"\n        diagnosis: {finding.diagnosis}"
        return text
    if finding.problem == "shape":
        text = (f"    {finding.dtype} {finding.tensor:<13} {where:<8} wrong shape {list(finding.shape)}"
                f"\n        {finding.message}")
        if finding.diagnosis and finding.diagnosis != finding.message:
            text += f"\n        diagnosis: {finding.diagnosis}"
        return text
    error = (f"max_rel {finding.max_rel:.2e}" if not finding.nonfinite else
             f"max_rel inf ({finding.nonfinite} NaN/inf; finite values: {finding.finite_max_rel:.2e})")
    text = (f"    {finding.dtype} {finding.tensor:<13} {where:<8} {error} "
            f"{'<=' if finding.ok else '>'} tol {finding.tolerance:.2e} ({finding.why})")
    if not finding.ok:
        owner = "no rank of the results" if finding.owner is None else f"rank {finding.owner}"
        text += (f"\n        {finding.mismatches} element{'s' * (finding.mismatches != 1)} off; first at global index "
                 f"{list(finding.first_index)}, owned by {owner}")
        text += f"\n        diagnosis: {finding.diagnosis or 'no known pattern'}"
    return text


def _gaps(entries) -> str:
    """'float64 dx, dw; float32 (nothing)' from coverage entries."""
    by_dtype = {}
    for g in entries:
        part = g["tensor"] if not g["covered"] else f"{g['tensor']} ({g['covered']} of {g['total']} elements)"
        by_dtype.setdefault(g["dtype"], []).append(part)
    return "; ".join(f"{d} {', '.join(parts)}" for d, parts in by_dtype.items())


def _print_case(report, verbose):
    from ..oracle.compare import root_cause
    if report.status == "unusable":
        print(f"UNUSABLE {report.case}\n    {report.error}")
        return
    if not report.run:
        print(f"{'FAIL' if report.missing else 'NOT RUN'} {report.case}: no results file")
        if report.missing:
            print(f"    missing (--require): {_gaps(report.missing)}")
        return
    print(f"{report.status.upper()} {report.case}")
    if report.incomplete:
        lacking = {}                          # ranks -> ({tensor}, {dtype}), in the report's order
        for g in report.incomplete:
            tensors, dtypes = lacking.setdefault(tuple(g["ranks"]), ({}, {}))
            tensors[g["tensor"]] = dtypes[g["dtype"]] = None
        print("    incomplete: " + "; ".join(
            f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))} lack{'s' * (len(ranks) == 1)} "
            f"{', '.join(tensors)} ({', '.join(dtypes)})" for ranks, (tensors, dtypes) in lacking.items())
            + ", which other ranks hold: a rank that crashed?  (--allow-missing-ranks if the peer runs on "
              "fewer ranks on purpose)")
    if report.layout_note:
        print(f"    note: {report.layout_note}")
    cause = root_cause(report)
    if cause is not None:
        where = "global" if cause.rank is None else f"rank {cause.rank}"
        print(f"    most likely cause ({cause.dtype} {cause.tensor}, {where}): {cause.diagnosis}")
    worst, consequences = {}, {}
    for f in report.findings:                 # compare() lists them in causal order
        ratio = f.max_rel / f.tolerance if f.tolerance and f.max_rel is not None else 0.0
        if f.ok and (f.dtype not in worst or ratio > worst[f.dtype][0]):
            worst[f.dtype] = (ratio, f)
        if not f.ok and f.diagnosis and f.diagnosis.startswith("follows") and not verbose:
            consequences.setdefault((f.dtype, f.tensor, f.diagnosis), []).append(
                "global" if f.rank is None else f"rank {f.rank}")
        elif not f.ok or verbose:
            print(_fmt(f))
    for (dtype, tensor, diagnosis), where in consequences.items():
        print(f"    {dtype} {tensor:<13} {', '.join(where)}: {diagnosis}")
    for first in report.first_wrong:
        if first["ranks"] and sum(f.tensor == first["tensor"] and f.dtype == first["dtype"] and not f.ok
                                  for f in report.findings) > 1:
            print(f"    {first['dtype']} {first['tensor']}: first wrong cell over all ranks at global index "
                  f"{first['index']} (rank{'s' * (len(first['ranks']) > 1)} "
                  f"{', '.join(str(r) for r in first['ranks'])})")
    if report.missing:
        print(f"    missing (--require): {_gaps(report.missing)}")
    elif report.not_provided:
        print(f"    not provided: {_gaps(report.not_provided)}")
    if report.unchecked:
        print("    not checked: " + "; ".join(f"{u['dtype']} {u['tensor']} rank {u['rank']} ({u['why']})"
                                              for u in report.unchecked[:4])
              + (f"; ... ({len(report.unchecked)} in all)" if len(report.unchecked) > 4 else ""))
    if report.ok and not verbose and worst:
        print("    " + "; ".join(f"{d}: worst {f.tensor}{'' if f.rank is None else f'[rank {f.rank}]'} "
                                 f"max_rel {f.max_rel:.1e} = {r:.2f} of its tolerance"
                                 for d, (r, f) in worst.items()))


def check(args) -> int:
    """Judge every case that has results; a case without is 'not run', a file that cannot be
    checked makes its case 'unusable' (exit 2 at the end), the others are still judged."""
    from ..atomic import atomic_write
    from ..errors import EXIT_BAD_INPUT, EXIT_CHECK_FAILED
    from ..paths import check_writable
    from ..oracle import casefile
    from ..oracle.compare import CaseReport, apply_require, compare, parse_require
    if not args.tolerance_factor >= 1.0:
        raise ValueError(f"--tolerance-factor must be >= 1, got {args.tolerance_factor}")
    require = parse_require(args.require)
    if args.json:
        check_writable(args.json, "--json")
    paths = case_paths(args.cases)
    single = not os.path.isdir(args.cases)
    if not os.path.exists(args.results):
        raise ValueError(f"{args.results}: no such results file or directory")
    reports, absent = [], []
    for path in paths:
        report = CaseReport(os.path.basename(path))
        try:
            case = casefile.load_case(path)
        except casefile.UnusableInput as err:
            report.error = str(err)
            reports.append(report)
            continue
        where = results_path(args.results, path, single)
        if not single and not os.path.exists(where):
            report.run = False
            absent.append(where)
            apply_require(case, report, require, None)
            reports.append(report)
            continue
        try:
            results = casefile.load_results(where, case)
        except casefile.UnusableInput as err:
            report.error = str(err)
            reports.append(report)
            continue
        report = compare(case, results, args.tolerance_factor, args.allow_missing_ranks)
        apply_require(case, report, require, results)
        reports.append(report)
    if len(absent) == len(reports):
        raise ValueError(f"results directory {args.results} holds none of the {len(reports)} case(s)' results "
                         f"files (no such file: {absent[0]}{', ...' if len(absent) > 1 else ''})")
    if single and len(reports) == 1 and reports[0].error is not None:
        raise ValueError(reports[0].error)      # one file, unusable: one line, as ever
    quiet = [r.case for r in reports if r.status == "not run" and not args.verbose]
    for report in reports:
        if report.case in quiet:
            continue
        _print_case(report, args.verbose)
        if report.error is not None:
            print(f"refimpl oracle check: error: {report.error}", file=sys.stderr, flush=True)
    if quiet:
        print(f"NOT RUN (no results file in {args.results}): {', '.join(quiet)}")
    counts = {s: sum(r.status == s for r in reports) for s in ("pass", "fail", "incomplete", "not run", "unusable")}
    line = f"{len(reports)} case{'s' * (len(reports) != 1)}: {counts['pass']} passed, {counts['fail']} failed"
    line += "".join(f", {counts[s]} {s}" for s in ("incomplete", "not run", "unusable") if counts[s])
    print(line)
    code = EXIT_BAD_INPUT if counts["unusable"] else EXIT_CHECK_FAILED if counts["fail"] + counts["incomplete"] else 0
    if args.json:
        text = json.dumps({"ok": code == 0, "exit": code, "require": args.require, "summary": counts,
                           "cases": [r.as_dict() for r in reports]}, indent=1)
        atomic_write(args.json, lambda f: f.write(text))
    return code


def run(args) -> int:
    from ..errors import InputError
    from ..failstop import run_command
    from ..watchdog import launcher_size

    def body():
        if launcher_size() > 1:
            raise InputError("refimpl oracle runs in one process: start it without mpiexec", agreed=True)
        try:
            if args.action == "trace":
                from . import oracle_trace
                return oracle_trace.run(args)
            return {"generate": generate, "run-torch": run_torch, "run-dtensor": run_dtensor,
                    "check": check}[args.action](args)
        except ValueError as err:          # UnusableInput included: exit 2, one line
            raise InputError(str(err), agreed=True) from None
    return run_command(f"oracle {args.action}", None, body)


