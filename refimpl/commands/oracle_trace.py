"""``refimpl oracle trace``: one training step of a whole model, compared layer by layer.

  layers                       the model's layers in forward order: canonical name (the
                               module names of refimpl's model and its state_dict), kind,
                               inputs and global output shape.
  generate --out TRACE.h5      the reference trace: initial parameters, the batch, and per
                               step and layer y, dx, dw, db (global, and y / dx as every
                               rank's block of --grid with its offset), the loss and the
                               parameters after the update (refimpl's unpartitioned math).
  run-torch TRACE --out RES.h5 the PyTorch twin of the model runs the trace's steps and
                               writes its results in the documented layout; --plant builds
                               one known mistake into one layer (on one rank).
  check TRACE RESULTS          judge each layer on the peer's own input (the previous
                               layer's output as the peer reported it): the first wrong
                               layer, tensor, rank(s), first wrong global cell and a
                               diagnosis; later layers that merely follow are listed as
                               such.

Layouts of both files and a minimal PyTorch writer: docs/oracle.md, "Model traces".
Exit status: 0 everything provided passed; 1 a finding; 2 unusable input (a bad flag, a
results file that cannot be checked); 4 an output could not be written.

Examples:
    refimpl oracle trace layers --model cosmoflow --preset tiny
    refimpl oracle trace generate --model cosmoflow --preset tiny --grid 1,2,2,1 --out trace.h5
    refimpl oracle trace generate --model cosmoflow --preset tiny --grid 1,2,1,1,2 \
        --model-parallel filter --model-parallel-blocks 2 --out trace-mp.h5
    refimpl oracle trace run-torch trace.h5 --out torch.h5
    refimpl oracle trace check trace.h5 torch.h5 --json report.json
    refimpl oracle trace run-torch trace.h5 --out bad.h5 --plant halo:features.3:1
"""
from __future__ import annotations

import argparse
import json

TRACE_ACTIONS = ("layers", "generate", "run-torch", "check")


def add_parser(sub):
    """The ``trace`` action of ``refimpl oracle`` and its own actions."""
    from ..config import CHOICES              # not refimpl.models: building the CLI starts no MPI
    parser = sub.add_parser("trace", help="one training step of a whole model, compared layer by layer",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = parser.add_subparsers(dest="trace_action", metavar="TRACE_ACTION", required=True)

    def model_args(p):
        p.add_argument("--model", required=True, choices=CHOICES["model"], help="the model")
        p.add_argument("--preset", default="tiny", metavar="P", help="the model's preset (default tiny)")
        p.add_argument("--input", default=None, metavar="N,C,D,H,W",
                       help="the global batch shape (default: 2 samples of the preset's input)")
        p.add_argument("--model-parallel", default="none", metavar="none|filter|channel",
                       help="split the model over a model axis Pm (a 5-entry --grid): CosmoFlow its last "
                            "--model-parallel-blocks conv blocks and its dense head, the U-Net its bottleneck (and its "
                            "deepest --model-config model_parallel_levels levels); "
                            "the split model's names include its gather layers (docs/model_parallel.md; "
                            "default none)")
        p.add_argument("--model-parallel-blocks", type=int, default=1, metavar="K",
                       help="CosmoFlow: how many of its last conv blocks the model axis splits (default 1)")
        p.add_argument("--norm", default="batch", metavar="batch|group|instance",
                       help="the U-Net's normalisation layers (default batch; group: the preset's num_groups)")
        p.add_argument("--model-config", default=None, metavar="FILE.toml",
                       help="model config keys over the preset's, to trace the configuration your model has "
                            "(widths, kernel_size, dropout, global_pool, ...): the file's [model_config] "
                            "table (a refimpl train --config file: only that table is read), or its keys "
                            "when it has none; an unknown key or value is refused")

    lay = actions.add_parser("layers", help="the model's layers in forward order",
                             description="Print the model's canonical layer names in forward order, with "
                                         "each layer's kind, inputs and global output shape.")
    model_args(lay)
    lay.add_argument("--json", action="store_true", help="print JSON instead of a table")
    gen = actions.add_parser("generate", help="write the reference trace",
                             description="Compute one or more training steps of the model with refimpl's "
                                         "unpartitioned reference and write the trace (HDF5).")
    model_args(gen)
    gen.add_argument("--grid", required=True, metavar="Pn,Pd,Ph,Pw[,Pm]",
                     help="the process grid the blocks are cut for; a fifth entry Pm is the model axis "
                          "(rank = (((n*Pd + d)*Ph + h)*Pw + w)*Pm + m)")
    gen.add_argument("--steps", type=int, default=1, metavar="K", help="training steps (default 1)")
    gen.add_argument("--dtype", default="float64,float32", metavar="D",
                     help="float64, float32 or both, comma-separated (default both)")
    gen.add_argument("--seed", type=int, default=0, metavar="S", help="weights, batch and dropout seed (default 0)")
    gen.add_argument("--optimizer", default="sgd", metavar="sgd|adam",
                     help="sgd (lr 0.01, momentum 0.9) or adam (lr 1e-3); default sgd")
    gen.add_argument("--out", required=True, metavar="TRACE.h5", help="the trace file to write")
    run = actions.add_parser(
        "run-torch", help="the PyTorch twin's results on a trace", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="""\
Run the trace's steps with the model's PyTorch twin (refimpl/oracle/model_twins.py)
and write every rank's blocks in the results layout (docs/oracle.md, Model traces).

--plant KIND:LAYER[:RANK] builds one known mistake into one layer (on one rank):
  halo:LAYER:R           rank R's block computed with zeros beyond its first internal face
  inner-padding:LAYER    every rank pads its block at its internal faces (no halo)
  adjoint-halo:LAYER:R   rank R's dx lacks the ghost gradients its neighbours send back
  stride-phase:LAYER:R   rank R's strided windows restart at its own block's first cell
  local-stats:LAYER      batch / group / instance norm normalises each rank's block by its
                         own statistics (not reduced over the ranks)
  dw-unsummed:LAYER:R    rank R reports its own share of dw/db (no allreduce there)
  dw-count:LAYER         dw/db divided by the number of ranks P (and the update uses them)
  loss-count             the loss (so every gradient) multiplied by P
  update-skip:LAYER:R    rank R does not update LAYER's parameters""")
    run.add_argument("trace", metavar="TRACE", help="a trace file (trace generate)")
    run.add_argument("--out", required=True, metavar="RESULTS.h5", help="the results file to write")
    run.add_argument("--plant", default=None, metavar="KIND:LAYER[:RANK]",
                     help="build one known mistake into one layer (the kinds above)")
    chk = actions.add_parser("check", help="judge a peer's results layer by layer",
                             description="Judge RESULTS against TRACE: each layer on the peer's own input, "
                                         "forward in order, the loss, backward in reverse, the update.")
    chk.add_argument("trace", metavar="TRACE", help="a trace file (trace generate)")
    chk.add_argument("results", metavar="RESULTS", help="the peer's results file (docs/oracle.md, Model traces)")
    chk.add_argument("--json", default=None, metavar="REPORT", help="also write the full report as JSON")
    chk.add_argument("--names", default=None, metavar="FILE",
                     help="TOML map of the peer's layer / parameter names: peer_name = \"canonical.name\"")
    chk.add_argument("--verbose", action="store_true", help="print passing tensors too")
    for p in (parser, lay, gen, run, chk):
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show Python tracebacks on failures (also REFIMPL_DEBUG=1)")


def _ints(text, flag, *counts):
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) not in counts or any(v < 1 for v in values):
        raise ValueError(f"{flag} must be {' or '.join(map(str, counts))} positive integers separated by commas, "
                         f"got {text!r}")
    return values


def _model_parallel(args):
    from ..oracle.trace import MODEL_MODES
    if args.model_parallel not in MODEL_MODES:
        raise ValueError(f"--model-parallel must be one of {', '.join(MODEL_MODES)}, got {args.model_parallel!r}")
    if args.model_parallel_blocks < 1:
        raise ValueError(f"--model-parallel-blocks must be a positive integer, got {args.model_parallel_blocks}")
    if args.model != "cosmoflow" and args.model_parallel_blocks != 1:
        raise ValueError("--model-parallel-blocks is CosmoFlow's (the U-Net's split levels: --model-config's "
                         "model_parallel_levels)")
    from ..oracle.trace import NORMS
    if args.norm not in NORMS:
        raise ValueError(f"--norm must be one of {', '.join(NORMS)}, got {args.norm!r}")
    if args.model != "unet3d" and args.norm != "batch":
        raise ValueError("--norm is the U-Net's (CosmoFlow has no normalisation layers)")
    return args.model_parallel, args.model_parallel_blocks, args.norm


def _input(args):
    return None if args.input is None else _ints(args.input, "--input", 5)


def _overrides(args) -> dict:
    """--model-config: the file's [model_config] table, or its top-level keys without one."""
    if args.model_config is None:
        return {}
    from ..config import load_toml
    table = load_toml(args.model_config, "--model-config")
    section = table.get("model_config")
    if section is not None and not isinstance(section, dict):
        raise ValueError(f"--model-config {args.model_config}: 'model_config' must be a table")
    return dict(section) if section is not None else table


def layers(args) -> int:
    from ..oracle.trace import layer_table
    rows = layer_table(args.model, args.preset, _input(args), *_model_parallel(args), overrides=_overrides(args))
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    width = max(len(r["name"]) for r in rows)
    split = args.model_parallel != "none"
    inputs = max(len(", ".join(r["inputs"])) for r in rows) if split else 0
    print(f"{'layer':<{width}}  {'kind':<16} {'output (global)':<22} {'inputs':<{inputs}}"
          + ("  model axis" if split else ""))
    for r in rows:
        print(f"{r['name']:<{width}}  {r['kind']:<16} {str(r['shape']):<22} {', '.join(r['inputs']):<{inputs}}"
              + (("  channels split" if r["split"] else "  replicated") if split else ""))
    print(f"{len(rows)} layers of {args.model} preset {args.preset}"
          + (f", model_parallel {args.model_parallel}" if split else ""))
    return 0


def _check_out(path, flag):
    import os

    from ..paths import check_writable
    check_writable(path, flag)
    if not path.endswith((".h5", ".hdf5")):
        raise ValueError(f"{flag} {path}: give an HDF5 file name ending in .h5")
    return os.path.abspath(path)


def generate(args) -> int:
    from ..errors import WriteError, describe
    from ..oracle.trace import DTYPES, TraceSpec, check_spec, default_input, write_trace
    dtypes = tuple(d.strip() for d in args.dtype.split(","))
    grid = _ints(args.grid, "--grid", 4, 5)
    shape = _input(args) or default_input(args.model, args.preset)
    spec = check_spec(TraceSpec(args.model, args.preset, shape, grid, args.steps, dtypes, args.seed,
                                args.optimizer, *_model_parallel(args), _overrides(args)))
    assert set(spec.dtypes) <= set(DTYPES)
    _check_out(args.out, "--out")
    try:
        summary = write_trace(spec, args.out)
    except OSError as err:
        raise WriteError(f"writing {args.out} failed: {describe(err)}", agreed=True) from None
    split = "" if spec.model_parallel == "none" else f", model_parallel {spec.model_parallel}"
    if spec.overrides:
        split += f", {', '.join(f'{k} = {v!r}' for k, v in sorted(spec.overrides.items()))}"
    print(f"wrote {args.out}  ({args.model} {args.preset}{split}, input {list(spec.input)}, grid {list(spec.grid)}, "
          f"{spec.ranks} rank{'s' * (spec.ranks > 1)}, {summary['layers']} layers, {spec.steps} step{'s' * (spec.steps != 1)}, "
          f"{', '.join(spec.dtypes)}, {spec.optimizer})")
    return 0


def run_torch(args) -> int:
    from ..errors import WriteError, describe
    from ..oracle.trace import load_trace
    from ..oracle.trace_torch import parse_plant, run_trace, write_results
    trace = load_trace(args.trace)
    plant = parse_plant(args.plant, trace)
    _check_out(args.out, "--out")
    results = run_trace(trace, plant)
    try:
        write_results(args.out, trace, results)
    except OSError as err:
        raise WriteError(f"writing {args.out} failed: {describe(err)}", agreed=True) from None
    print(f"wrote {args.out}" + (f"  (planted: {args.plant})" if args.plant else ""))
    return 0


def _line(f) -> str:
    where = "global" if f.ranks == [None] else ", ".join("global" if r is None else f"rank {r}" for r in f.ranks)
    if f.note == "shape":
        return f"    {f.dtype} step {f.step} {f.phase:<8} {f.layer:<14} {f.tensor:<6} {where}: wrong shape: {f.diagnosis}"
    text = (f"    {f.dtype} step {f.step} {f.phase:<8} {f.layer:<14} {f.tensor:<6} {where or 'all'}   "
            f"max_rel {f.max_rel:.2e} {'<=' if f.status != 'fail' else '>'} tol {f.tolerance:.2e} ({f.why})")
    if f.status == "fail":
        if f.first_index is not None:
            owner = "global" if f.owner is None else f"rank {f.owner}"
            text += f"\n        {f.mismatches} element{'s' * (f.mismatches != 1)} off; first at global index {f.first_index} ({owner})"
        text += f"\n        diagnosis: {f.diagnosis or 'no known pattern'}"
        if f.note:
            text += f"\n        note: {f.note}"
    return text


#: Tensors a "follows from" line names in full before it shortens to the first and last ones.
FOLLOWS_LISTED = 8


def _follow_lines(follows, steps, verbose) -> list[str]:
    """One line per source of the following tensors (a wrong layer, the loss, a drifted
    update): its dtypes together where they list the same tensors, then per step the tensors
    in the order they were judged.  A step of more than ``FOLLOWS_LISTED`` is shortened to its
    first and last few and a count (a wrong early layer makes every later one follow: a line of
    a hundred names hides the finding above it); ``--verbose`` and ``--json`` list them all."""
    by_note = {}
    for f in follows:
        by_note.setdefault(f.note, {}).setdefault(f.dtype, {}).setdefault(f.step, []).append(f"{f.layer} {f.tensor}")
    lines, shortened = [], False
    for note, by_dtype in by_note.items():
        groups = {}                                   # the same tensors per step: one line for both dtypes
        for dtype, by_step in by_dtype.items():
            key = tuple((s, tuple(w)) for s, w in sorted(by_step.items()))
            groups.setdefault(key, []).append(dtype)
        for key, dtypes in groups.items():
            parts = []
            for s, where in key:
                if len(where) > FOLLOWS_LISTED and not verbose:
                    shortened = True
                    listed = f"{', '.join(where[:3])}, ... {', '.join(where[-2:])} ({len(where)} tensors)"
                else:
                    listed = ", ".join(where)
                parts.append(f"step {s}: {listed}" if steps > 1 else listed)
            lines.append(f"    {' and '.join(dtypes)} {note}: {'; '.join(parts)}")
    if shortened:
        lines.append("    (--verbose or --json lists every following tensor)")
    return lines


def check(args) -> int:
    from ..atomic import atomic_write
    from ..oracle.trace import load_trace
    from ..oracle.trace_check import check_trace, load_names, load_peer
    trace = load_trace(args.trace)
    names = load_names(args.names, trace)
    if args.json:
        _check_out_json(args.json)
    peer = load_peer(args.results, trace, names)
    findings = check_trace(trace, peer)
    if not findings:
        raise ValueError(f"results file {args.results} holds nothing to judge: no loss, no update and no "
                         f"layer tensor of the trace (layout: docs/oracle.md, Model traces)")
    fails = [f for f in findings if f.status == "fail"]
    follows = [f for f in findings if f.status == "follows"]
    split = "" if trace.spec.model_parallel == "none" else f", model_parallel {trace.spec.model_parallel}"
    print(f"{'FAIL' if fails else 'PASS'} {args.results} against {args.trace} ({trace.spec.model} "
          f"{trace.spec.preset}{split}, grid {list(trace.spec.grid)})")
    for f in findings:
        if f.phase == "convention":
            print(f"    note: {f.dtype} step {f.step}: {f.note}")
    if fails:
        first = fails[0]
        print(f"    first finding: {first.where}: {first.diagnosis or 'no known pattern'}")
    for f in findings:
        if f.status == "fail" or (args.verbose and f.status == "pass" and f.phase != "convention"):
            print(_line(f))
    for line in _follow_lines(follows, trace.spec.steps, args.verbose):
        print(line)
    passed = sum(f.status == "pass" and f.phase != "convention" for f in findings)
    worst = {}
    for f in findings:
        if f.status == "pass" and f.max_rel is not None and f.tolerance:
            ratio = f.max_rel / f.tolerance
            if f.dtype not in worst or ratio > worst[f.dtype][0]:
                worst[f.dtype] = (ratio, f)
    if worst:
        print("    passing: " + "; ".join(f"{d} worst {w.layer} {w.tensor} = {r:.2f} of its tolerance"
                                          for d, (r, w) in sorted(worst.items())))
    total = passed + len(fails) + len(follows)
    print(f"{total} tensor{'s' * (total != 1)}: {passed} passed, {len(fails)} finding{'s' * (len(fails) != 1)}, "
          f"{len(follows)} following")
    code = 1 if fails else 0
    if args.json:
        text = json.dumps({"ok": code == 0, "exit": code, "trace": args.trace, "results": args.results,
                           "first_finding": fails[0].as_dict() if fails else None,
                           "summary": {"passed": passed, "findings": len(fails), "follows": len(follows)},
                           "findings": [f.as_dict() for f in findings]}, indent=1)
        atomic_write(args.json, lambda fh: fh.write(text))
    return code


def _check_out_json(path):
    from ..paths import check_writable
    check_writable(path, "--json")


def run(args) -> int:
    """Dispatch a trace action (called inside ``refimpl oracle``'s fail-stop wrapper)."""
    if args.trace_action == "run-torch":
        import importlib.util
        if importlib.util.find_spec("torch") is None:
            raise ValueError("run-torch needs PyTorch: pip install -e '.[oracle]'")
    return {"layers": layers, "generate": generate, "run-torch": run_torch, "check": check}[args.trace_action](args)


__all__ = ["add_parser", "run", "TRACE_ACTIONS"]
