"""``refimpl plan``: which grid is fastest for a model, sample size, batch and machine, and why.

Enumerates the process grids (Pn, Pd, Ph, Pw, Pm) of --ranks ranks (at most 2^20), predicts
the step time and memory per rank of the most promising of them (--max-grids, those whose
blocks cut the fewest voxels) from the layers' own halo plans and the alpha-beta-gamma cost
of every message (refimpl/plan.py; docs/planner.md), and prints the fastest grids that fit in
--mem-per-rank, with the winner and the runner-up explained layer by layer.  Math only: it
runs in one process, nothing is trained; under mpiexec only with --calibrate, where every
rank measures and ranks 0 and 1 time the link, under the fail-stop watchdog of refimpl train
(--stall-timeout).

Exit status: 0 a plan was printed (even when no grid fits: the table says why); 2 bad
input (an unknown model or preset, a bad memory size, more ranks than the planner searches,
a grid that is not a factorisation of --ranks, a sample the grid or the model cannot take;
under mpiexec every rank exits, rank 0 says why); 4 an output could not be written; 5 a
rank stopped answering for --stall-timeout seconds during --calibrate.

Examples:
    refimpl plan --model cosmoflow --preset mlperf --sample 512 --batch 64 --ranks 2048 --mem-per-rank 16GiB
    refimpl plan --model cosmoflow --preset small --batch 8 --ranks 8 --grid 2,2,2,1
    refimpl plan --model unet3d --preset default --batch 4 --ranks 64 --plot scaling.png --json plan.json
    mpiexec -n 2 --oversubscribe refimpl plan --calibrate --save-machine here.toml     (measures this machine)
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

from ..watchdog import DEFAULT_STALL_TIMEOUT


def add_arguments(parser):
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    required = parser.add_argument_group("required arguments (except with --calibrate alone)")
    required.add_argument("--ranks", type=int, default=None, metavar="P", help="number of ranks (at most 2^20)")
    parser.add_argument("--batch", type=int, required=False, default=None, metavar="B",
                        help="global batch (default: --ranks, one sample per rank, which every grid's sample "
                             "groups can split; give the batch you train with)")
    parser.add_argument("--model", choices=("cosmoflow", "unet3d"), default="cosmoflow",
                        help="the network to plan for (default cosmoflow)")
    parser.add_argument("--preset", default=None,
                        help="a preset of the model: cosmoflow tiny, small, tiny-same, mlperf, mlperf-k3 "
                             "(default mlperf); "
                             "unet3d tiny, small, default (default default)")
    parser.add_argument("--config", default=None, metavar="FILE.toml",
                        help="model config keys (as [model_config] of refimpl train) instead of --preset")
    parser.add_argument("--sample", type=int, default=None, metavar="S",
                        help="cubic sample extent S (overrides the preset's D = H = W)")
    parser.add_argument("--mem-per-rank", default=None, metavar="SIZE",
                        help="memory per rank, e.g. 16GiB (default: the machine file's, else no limit)")
    parser.add_argument("--machine", default=None, metavar="FILE.toml", help="machine constants (docs/planner.md)")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure this machine's constants first: the rate of every conv shape of "
                             "--model/--preset (kept with those of --machine FILE), the memory-bound layers, "
                             "copies and halo packing; under mpiexec -n 2 also the link")
    parser.add_argument("--save-machine", default=None, metavar="FILE.toml", help="write the machine constants")
    parser.add_argument("--grid", default=None, metavar="Pn,Pd,Ph,Pw[,Pm]", help="explain this grid layer by layer")
    parser.add_argument("--top", type=int, default=10, metavar="K", help="grids to list (default 10)")
    parser.add_argument("--max-grids", type=int, default=None, metavar="N",
                        help="price at most N grids, those whose blocks cut the fewest voxels first (default 24: "
                             "a few seconds; each grid takes 10 to 250 ms); the output says how many were left out")
    parser.add_argument("--norm", choices=("batch", "group", "instance"), default=None,
                        help="unet3d: the conv blocks' normalisation (as refimpl train --norm; default: the "
                             "preset's or --config's, batch)")
    parser.add_argument("--model-parallel", choices=("filter", "channel", "off"), default="filter",
                        help="how grids with Pm > 1 split the model (default filter); off: no model axis")
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd",
                        help="the optimizer whose state counts in the memory per rank (default sgd)")
    parser.add_argument("--optimizer-sharding", action="store_true",
                        help="the distributed weight update (refimpl train --optimizer-sharding): each rank "
                             "holds 1/|G| of the optimizer state")
    parser.add_argument("--allreduce", default="native", help="gradient allreduce algorithm (as refimpl train)")
    parser.add_argument("--base-batch", type=int, default=None, metavar="B0",
                        help="the batch the learning rate was tuned for: prints the linear-scaling rule")
    parser.add_argument("--critical-batch", type=int, default=None, metavar="BC",
                        help="warn when --batch exceeds it (Zou et al.: past it, more samples per step "
                             "stop reducing the steps to converge)")
    parser.add_argument("--json", default=None, metavar="FILE", help="write the ranked grids as JSON")
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="predicted step time and memory vs P for the best grid of each family")
    parser.add_argument("--stall-timeout", type=float, default=DEFAULT_STALL_TIMEOUT, metavar="SECONDS",
                        help="with --calibrate under mpiexec: end the job (exit 5) when a rank has sent no "
                             "heartbeat, or no rank has moved on, for this long (default 600; 0 = off)")


#: Grids whose predicted step times are within this fraction of the best one are a tie.  Measured
#: on this machine (one rank per core), the planner ordered alike every pair of grids whose
#: measured times differ by more than 5 %, while grids measured 0.7 % apart swapped places from
#: one run to the next, and its predicted/measured ratio varies by about 3 % between the grids
#: of one model (docs/planner.md, "Predicted vs measured on this machine").  Below this the
#: ranking is not a result of the model.
TIE = 0.05
#: A search (or a --plot's searches) that has run this long reports its progress on stderr.
PROGRESS_AFTER_S = 3.0
UNCALIBRATED = ("uncalibrated: default machine constants (a typical cluster node, not this machine); "
                "run 'refimpl plan --calibrate' for this machine (--save-machine FILE.toml keeps them for "
                "--machine FILE.toml)")


class Progress:
    """``search``'s progress callback: once a search has run ``PROGRESS_AFTER_S`` seconds, how
    many grids are priced, on ``stream`` (stderr: the table on stdout stays clean), rewritten
    in place on a terminal, else one line every few seconds.  Rank 0 only (``answer``)."""

    def __init__(self, stream=None, after=None, clock=time.monotonic):
        self.stream = stream if stream is not None else sys.stderr
        self.after = PROGRESS_AFTER_S if after is None else after
        self.clock, self.start, self.last, self.shown = clock, clock(), None, False
        self.label = "search"
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def __call__(self, done, total):
        now = self.clock()
        elapsed = now - self.start
        final = done >= total
        if elapsed < self.after or (final and not self.shown):
            return
        if not final and self.last is not None and now - self.last < (0.5 if self.tty else 5.0):
            return
        self.last, self.shown = now, True
        line = f"refimpl plan: {self.label}: priced {done} of {total} grids ({elapsed:.0f} s)"
        self.stream.write(("\r" + line + ("\n" if final else "")) if self.tty else line + "\n")
        self.stream.flush()
        if final:
            self.shown = False


def tie_note(feasible):
    """The line that says when the best grids are a tie at the planner's resolution, and how to
    choose among them (None: the best grid is ahead by more than ``TIE``)."""
    best = feasible[0].step_s
    tied = [p for p in feasible if p.step_s <= best * (1 + TIE)]
    if len(tied) < 2:
        return None
    spread = (tied[-1].step_s / best - 1) * 100
    pick = min(tied, key=lambda p: (math.prod(p.dims[1:4]), p.memory_bytes, p.step_s))
    return (f"tie: the top {len(tied)} grids are within {spread:.2g} % of the best, below this model's "
            f"resolution (measured, it orders grids reliably only when they differ by more than {TIE * 100:g} %: "
            f"docs/planner.md); among them pick by fewer spatial ranks Pd*Ph*Pw (larger blocks, fewer halo "
            f"messages), then less memory per rank: {pick.dims}; or calibrate ('refimpl plan --calibrate') "
            f"and time the tied grids (scripts/bench_plan.py)")


def layers_of(args, model_parallel=None):
    from ..plan import model_layers
    return model_layers(args.model, config_of(args, model_parallel))


def priced(args) -> str:
    """What is priced, said first: model, preset (or config), sample (C, D, H, W), batch, ranks."""
    config = config_of(args)
    from ..models import CHECK_CONFIG
    shape = tuple(CHECK_CONFIG[args.model](config)["input_shape"])
    source = f"config {args.config}" if args.config else f"preset {preset_name(args)}"
    batch = f"batch {args.batch}" + (" (the default: one sample per rank)" if args.batch_default else "")
    return f"plan: {args.model} {source}, samples (C, D, H, W) = {shape}, {batch}, {args.ranks} ranks"


def preset_name(args) -> str:
    return args.preset or {"cosmoflow": "mlperf", "unet3d": "default"}[args.model]


def config_of(args, model_parallel=None) -> dict:
    """The model config the plan prices: --config or the preset, --sample, the model axis."""
    from ..models import PRESETS
    if args.config and args.preset:
        raise ValueError("give --preset or --config, not both")
    if args.config:
        from ..config import load_toml
        config = load_toml(args.config)
    else:
        name = preset_name(args)
        if name not in PRESETS[args.model]:
            raise ValueError(f"--preset: no {args.model} preset {name!r}; presets: {sorted(PRESETS[args.model])}")
        config = dict(PRESETS[args.model][name])
    if args.sample is not None:
        if args.sample < 1:
            raise ValueError(f"--sample must be a positive integer, got {args.sample}")
        channels = (config.get("input_shape") or (4 if args.model == "cosmoflow" else 1,))[0]
        config["input_shape"] = (channels, args.sample, args.sample, args.sample)
    if model_parallel:
        config["model_parallel"] = model_parallel
    if getattr(args, "norm", None) is not None:
        config["norm"] = args.norm
    return config


def check(args):
    """Every refusal of bad input, before any work: ValueError, the same on every rank.

    Returns (machine, layers, layers_mp, dims): the machine of --machine and --mem-per-rank,
    the model's layers, and when a plan follows (--batch and --ranks given) its layers with
    the model axis (None for --model-parallel off) and the 5 dims of --grid (None: search)."""
    from ..watchdog import launcher_size
    from ..parallel.grid import parse_grid
    from ..plan import MAX_RANKS, Machine, feasibility, load_machine, parse_bytes
    if launcher_size() > 1 and not args.calibrate:
        raise ValueError("it runs in one process: start it without mpiexec (mpiexec -n 2 only with "
                         "--calibrate, to measure the link)")
    args.batch_default = args.batch is None and args.ranks is not None
    if args.batch_default:
        args.batch = args.ranks                 # one sample per rank: every grid's sample groups split it
    for name in ("ranks", "batch"):               # --ranks first: a defaulted --batch is --ranks
        value = getattr(args, name)
        if value is None and not args.calibrate:
            raise ValueError(f"--{name} is required (--batch defaults to --ranks, one sample per rank)")
        if value is not None and value < 1:
            raise ValueError(f"--{name} must be a positive integer, got {value}")
    if args.ranks is not None and args.ranks > MAX_RANKS:
        raise ValueError(f"--ranks {args.ranks} is more than the {MAX_RANKS} (2^20) ranks refimpl plan searches")
    for name in ("top", "max_grids"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not (math.isfinite(args.stall_timeout) and args.stall_timeout >= 0):
        raise ValueError(f"--stall-timeout must be a number of seconds >= 0 (0: off), got {args.stall_timeout}")
    from ..parallel.allreduce import ALGORITHMS
    if args.allreduce not in ALGORITHMS:
        raise ValueError(f"--allreduce must be one of {', '.join(sorted(ALGORITHMS))}, got {args.allreduce!r}")
    machine = load_machine(args.machine) if args.machine else Machine()
    if args.mem_per_rank is not None:
        from dataclasses import replace
        machine = replace(machine, mem_per_rank=parse_bytes(args.mem_per_rank))
    from ..paths import check_writable
    for path, flag in ((args.json, "--json"), (args.plot, "--plot"), (args.save_machine, "--save-machine")):
        if path:
            check_writable(path, flag)
    layers = layers_of(args)
    if args.batch is None or args.ranks is None:            # --calibrate alone
        return machine, layers, None, None
    layers_mp = None if args.model_parallel == "off" else layers_of(args, args.model_parallel)
    if args.grid is None:
        return machine, layers, layers_mp, None
    grid = parse_grid(args.grid)
    if math.prod(grid) != args.ranks:
        raise ValueError(f"--grid {args.grid} holds {math.prod(grid)} ranks, not --ranks {args.ranks}")
    dims = tuple(grid) + (1,) * (5 - len(grid))
    if dims[4] > 1 and layers_mp is None:
        raise ValueError(f"--grid {args.grid} has a model axis, but --model-parallel off")
    why = feasibility(layers if dims[4] == 1 else layers_mp, dims, args.batch)
    if why:                              # the grid cannot run this model at all: bad input
        raise ValueError(f"--grid {args.grid}: {why}")
    return machine, layers, layers_mp, dims


def run(args) -> int:
    from ..watchdog import launcher_size
    from ..failstop import run_command
    comm = None
    if launcher_size() > 1:              # mpiexec -n 2 refimpl plan --calibrate: every rank measures
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
    return run_command("plan", comm, lambda: plan(args, comm))


def agreed(comm, fn, *args):
    """``fn(*args)`` whose ValueError becomes bad input on every rank alike (``failstop.agree``
    under mpiexec; in one process, that one)."""
    from ..errors import InputError
    from ..failstop import agree
    if comm is not None:
        return agree(comm, fn, *args)
    try:
        return fn(*args)
    except ValueError as err:
        raise InputError(str(err), agreed=True) from None


def columns(header, rows, right):
    """The lines of a table whose every column is as wide as its widest cell, two spaces
    apart, so numbers of any width stay apart; ``right``: the indices of right-aligned columns."""
    widths = [max(len(cells[i]) for cells in [header, *rows]) for i in range(len(header))]
    return ["  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
            for cells in [header, *rows]]


def _ms(s):
    return f"{s * 1e3:.1f}"


def print_table(plans):
    from ..plan import format_bytes
    rows = []
    for i, p in enumerate(plans, 1):
        mem = format_bytes(p.memory_bytes) if p.memory_bytes else "-"
        priced = p.feasible or p.step_s                 # not a grid that cannot run at all
        times = [_ms(t) for t in (p.step_s, p.compute_s, p.halo_s, p.model_s, p.allreduce_s)] if priced else ["-"] * 5
        rows.append([str(i), str(p.dims), p.family, *times, mem, "yes" if p.feasible else "no: " + p.why])
    header = ["#", "grid (Pn,Pd,Ph,Pw,Pm)", "family", "step ms", "compute", "halo", "other", "allreduce",
              "mem/rank", "fits"]
    print("\n".join(columns(header, rows, right={0, 3, 4, 5, 6, 7, 8})))


def explain(plan):
    """One grid, layer by layer, for the rank that decides the step."""
    from ..plan import format_bytes
    print(f"\ngrid {plan.dims} ({plan.family}), slowest rank {plan.critical_rank}: step {plan.step_s * 1e3:.1f} ms "
          f"= compute {plan.compute_s * 1e3:.1f} + halo {plan.halo_s * 1e3:.1f} + model/bn/flatten messages "
          f"{plan.model_s * 1e3:.1f} + gradient allreduce {plan.allreduce_s * 1e3:.1f} ({plan.buckets} buckets, "
          f"{format_bytes(plan.grad_bytes)}); memory {format_bytes(plan.memory_bytes)}")
    header = ["layer", "kind", "GFLOP", "comp ms", "sent KiB", "sent msgs", "halo ms", "model KiB", "other ms",
              "saved MiB"]
    rows = [[c.name, c.kind, f"{c.flops / 1e9:.3f}", f"{c.compute_s * 1e3:.2f}", f"{c.halo_bytes / 1024:.1f}",
             str(c.halo_messages), f"{c.halo_s * 1e3:.3f}", f"{(c.model_bytes + c.model_allreduce_bytes) / 1024:.1f}",
             f"{c.comm_s * 1e3:.3f}", f"{c.saved_bytes / 2**20:.1f}"] for c in plan.layers]
    print("\n".join("  " + line for line in columns(header, rows, right=set(range(2, 10)))))


def compare_two(a, b):
    parts = [("compute", a.compute_s, b.compute_s), ("halo", a.halo_s, b.halo_s),
             ("model/bn/flatten messages", a.model_s, b.model_s), ("gradient allreduce", a.allreduce_s, b.allreduce_s)]
    diff = sorted(parts, key=lambda t: t[2] - t[1], reverse=True)
    text = ", ".join(f"{name} {(y - x) * 1e3:+.1f} ms" for name, x, y in diff)
    print(f"\nwhy {a.dims} beats {b.dims} by {(b.step_s - a.step_s) * 1e3:.1f} ms per step: the runner-up's {text}")


def batch_advice(args, plans):
    best = next((p for p in plans if p.feasible), None)
    if best is not None:
        print(f"\ndata parallelism: {best.dims[0]} sample group(s) of {args.batch // best.dims[0]} sample(s); "
              f"at most {args.batch} groups for a batch of {args.batch}")
    if args.base_batch:
        print(f"learning rate: linear scaling from the batch of {args.base_batch}: lr = base_lr x "
              f"{args.batch}/{args.base_batch} = {args.batch / args.base_batch:g} x base_lr, with a warmup of a few "
              f"epochs (refimpl train --base-batch {args.base_batch} --warmup-steps N, or the config key "
              f"warmup_epochs)")
    if args.critical_batch and args.batch > args.critical_batch:
        print(f"warning: the batch of {args.batch} exceeds the critical batch {args.critical_batch}: past it a "
              f"larger batch no longer cuts the steps to converge (Zou et al. 2017); prefer spatial or model "
              f"parallelism to add ranks")


def plot_scaling(args, path, machine, layers, searching):
    """Predicted step time and memory vs P, best grid of each family (log-log)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..atomic import atomic_write
    from ..progress import phase
    from ..plan import search
    ps = sorted({2 ** i for i in range(int(math.log2(args.ranks)) + 1)} | {args.ranks})
    families = ("data", "spatial", "model", "hybrid")
    series = {f: ([], [], []) for f in families}
    for p in ps:
        if searching.get("progress") is not None:
            searching["progress"].label = f"--plot, P = {p}"
        plans = search(layers, p, args.batch, machine, **searching)
        for family in families:
            best = next((g for g in plans if g.feasible and (g.family.startswith(family) or
                                                              (p == 1 and family == "data"))), None)
            if best is not None:
                series[family][0].append(p)
                series[family][1].append(best.step_s)
                series[family][2].append(best.memory_bytes / 2 ** 30)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for family, (x, t, m) in series.items():
        if x:
            ax1.plot(x, t, "o-", label=family)
            ax2.plot(x, m, "o-", label=family)
    for ax, label in ((ax1, "predicted step time (s)"), (ax2, "memory per rank (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks P")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    if machine.mem_per_rank:
        ax2.axhline(machine.mem_per_rank / 2 ** 30, color="k", ls="--", lw=1)
    fig.suptitle(f"{args.model}, batch {args.batch}: best grid per family (refimpl plan)")
    fig.tight_layout()
    phase(f"writing {path}")
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110), binary=True)
    plt.close(fig)
    print(f"wrote {path}")


def plan(args, comm) -> int:
    """Refuse bad input on every rank alike, calibrate on every rank (``comm``: under mpiexec),
    then answer from rank 0 while the others wait for its outcome (``failstop.on_root``)."""
    from ..failstop import on_root, set_stall_timeout
    from ..progress import phase
    machine, layers, layers_mp, dims = agreed(comm, check, args)
    set_stall_timeout(args.stall_timeout)
    if args.calibrate:
        from ..plan import calibrate
        root = comm is None or comm.Get_rank() == 0
        machine = calibrate(machine, layers=layers, report=print if root else None, comm=comm)
    if comm is None:
        answer(args, machine, layers, layers_mp, dims)
    else:
        phase("rank 0's report")
        on_root(comm, answer, args, machine, layers, layers_mp, dims)
    return 0


def answer(args, machine, layers, layers_mp, dims) -> None:
    """What rank 0 prints and writes: the calibrated machine, then the plan of one grid (``dims``)
    or of the search."""
    from ..atomic import atomic_write
    from ..progress import phase
    from ..plan import MAX_PRICED, plan_grid, save_machine, search
    if args.calibrate:
        print(f"calibrated: {machine.summary()}")
        if args.save_machine:
            phase(f"writing {args.save_machine}")
            atomic_write(args.save_machine, lambda f: f.write(save_machine(machine)))
            print(f"wrote {args.save_machine}")
        if args.batch is None or args.ranks is None:
            return
    print(priced(args))
    if not args.calibrate and not args.machine:
        print(UNCALIBRATED)
    kw = dict(optimizer=args.optimizer, optimizer_sharding=args.optimizer_sharding, algorithm=args.allreduce)
    searching = dict(kw, layers_mp=layers_mp, max_grids=args.max_grids or MAX_PRICED)
    progress = Progress()
    searched = None                      # what the search looked at (not for an explicit --grid)
    if dims is not None:
        phase(f"pricing grid {dims}")
        chosen = plan_grid(layers if dims[4] == 1 else layers_mp, dims, args.batch, machine, **kw)
        print_table([chosen])
        if chosen.layers:
            explain(chosen)
        plans = [chosen]
    else:
        plans = search(layers, args.ranks, args.batch, machine, progress=progress, **searching)
        searched = {"grids": plans.grids, "runnable": plans.runnable, "priced": plans.priced}
        feasible = [p for p in plans if p.feasible]
        left_out = (f"priced the {plans.priced} whose blocks cut the fewest voxels (--max-grids N for more)"
                    if plans.priced < plans.runnable else "all priced")
        print(f"{args.model}: {plans.grids} grids of {args.ranks} ranks, {plans.runnable} can run it, {left_out}; "
              f"{len(feasible)} fit{' in ' + args.mem_per_rank if args.mem_per_rank else ''}")
        tie = tie_note(feasible) if feasible else None
        if tie:
            print(tie)
        print_table(plans[:args.top])
        if feasible:
            explain(feasible[0])
            if len(feasible) > 1:
                explain(feasible[1])
                compare_two(feasible[0], feasible[1])
        batch_advice(args, plans)
    print(f"\nmachine: {machine.summary()}")
    if args.json:
        text = json.dumps({"model": args.model, "batch": args.batch, "ranks": args.ranks, "searched": searched,
                           "machine": machine.__dict__, "grids": [p.as_dict() for p in plans[:args.top]]},
                          indent=1)
        phase(f"writing {args.json}")
        atomic_write(args.json, lambda f: f.write(text))
    if args.plot:
        plot_scaling(args, args.plot, machine, layers, dict(searching, progress=progress))
