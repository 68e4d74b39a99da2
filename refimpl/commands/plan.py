"""``refimpl plan``: which grid is fastest for a model, sample size, batch and machine, and why.

Enumerates the process grids (Pn, Pd, Ph, Pw, Pm) of --ranks ranks, predicts each one's
step time and memory per rank from the layers' own halo plans and the alpha-beta-gamma
cost of every message (refimpl/plan.py; docs/planner.md), and prints the fastest grids
that fit in --mem-per-rank, with the winner and the runner-up explained layer by layer.
Math only: it runs in one process, nothing is trained.

Exit status: 0 a plan was printed (even when no grid fits: the table says why); 2 bad
input (an unknown model or preset, a bad memory size, a grid that is not a factorisation
of --ranks, a sample the grid or the model cannot take); 4 an output could not be
written.

Examples:
    refimpl plan --model cosmoflow --preset mlperf --sample 512 --batch 64 --ranks 2048 --mem-per-rank 16GiB
    refimpl plan --model cosmoflow --preset small --batch 8 --ranks 8 --grid 2,2,2,1
    refimpl plan --model unet3d --preset default --batch 4 --ranks 64 --plot scaling.png --json plan.json
    mpiexec -n 2 refimpl plan --calibrate --save-machine here.toml     (measures this machine)
"""
from __future__ import annotations

import argparse
import json
import math


def add_arguments(parser):
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--model", choices=("cosmoflow", "unet3d"), default="cosmoflow")
    parser.add_argument("--preset", default=None, help="a preset of the model (default: mlperf / default)")
    parser.add_argument("--config", default=None, metavar="FILE.toml",
                        help="model config keys (as [model_config] of refimpl train) instead of --preset")
    parser.add_argument("--sample", type=int, default=None, metavar="S",
                        help="cubic sample extent S (overrides the preset's D = H = W)")
    parser.add_argument("--batch", type=int, required=False, default=None, metavar="B", help="global batch")
    parser.add_argument("--ranks", type=int, default=None, metavar="P", help="number of ranks")
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
    parser.add_argument("--model-parallel", choices=("filter", "channel", "off"), default="filter",
                        help="how grids with Pm > 1 split the model (default filter); off: no model axis")
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
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


def layers_of(args, model_parallel=None):
    from ..models import PRESETS
    from ..plan import model_layers
    default = {"cosmoflow": "mlperf", "unet3d": "default"}[args.model]
    if args.config and args.preset:
        raise ValueError("give --preset or --config, not both")
    if args.config:
        from ..config import load_toml
        config = load_toml(args.config)
    else:
        name = args.preset or default
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
    return model_layers(args.model, config)


def check(args):
    from ..parallel.grid import parse_grid
    from ..plan import Machine, load_machine, parse_bytes
    for name in ("batch", "ranks"):
        value = getattr(args, name)
        if value is None and not args.calibrate:
            raise ValueError(f"--{name} is required")
        if value is not None and value < 1:
            raise ValueError(f"--{name} must be a positive integer, got {value}")
    if args.top < 1:
        raise ValueError(f"--top must be >= 1, got {args.top}")
    from ..parallel.collectives import ALGORITHMS
    if args.allreduce not in ALGORITHMS:
        raise ValueError(f"--allreduce must be one of {', '.join(sorted(ALGORITHMS))}, got {args.allreduce!r}")
    machine = load_machine(args.machine) if args.machine else Machine()
    if args.mem_per_rank is not None:
        from dataclasses import replace
        machine = replace(machine, mem_per_rank=parse_bytes(args.mem_per_rank))
    grid = None
    if args.grid is not None:
        grid = parse_grid(args.grid)
        if math.prod(grid) != args.ranks:
            raise ValueError(f"--grid {args.grid} holds {math.prod(grid)} ranks, not --ranks {args.ranks}")
    return machine, grid


def run(args) -> int:
    from ..failstop import InputError, run_command

    def body():
        try:
            return plan(args)
        except ValueError as err:
            raise InputError(str(err), agreed=True) from None
    return run_command("plan", None, body)


def _ms(s):
    return f"{s * 1e3:9.1f}"


def print_table(plans):
    from ..plan import format_bytes
    print(f"{'#':>3} {'grid (Pn,Pd,Ph,Pw,Pm)':<24}{'family':<22}{'step ms':>9}{'compute':>9}{'halo':>9}"
          f"{'other':>9}{'allreduce':>10}{'mem/rank':>11}  fits")
    for i, p in enumerate(plans, 1):
        mem = format_bytes(p.memory_bytes) if p.memory_bytes else "-"
        if not p.feasible and not p.step_s:
            print(f"{i:>3} {str(p.dims):<24}{p.family:<22}{'':>9}{'':>9}{'':>9}{'':>9}{'':>10}{mem:>11}  no: {p.why}")
            continue
        print(f"{i:>3} {str(p.dims):<24}{p.family:<22}{_ms(p.step_s)}{_ms(p.compute_s)}{_ms(p.halo_s)}"
              f"{_ms(p.model_s)}{_ms(p.allreduce_s):>10}{mem:>11}  {'yes' if p.feasible else 'no: ' + p.why}")


def explain(plan):
    """One grid, layer by layer, for the rank that decides the step."""
    from ..plan import format_bytes
    print(f"\ngrid {plan.dims} ({plan.family}), slowest rank {plan.critical_rank}: step {plan.step_s * 1e3:.1f} ms "
          f"= compute {plan.compute_s * 1e3:.1f} + halo {plan.halo_s * 1e3:.1f} + model/bn/flatten messages "
          f"{plan.model_s * 1e3:.1f} + gradient allreduce {plan.allreduce_s * 1e3:.1f} ({plan.buckets} buckets, "
          f"{format_bytes(plan.grad_bytes)}); memory {format_bytes(plan.memory_bytes)}")
    print(f"  {'layer':<16}{'kind':<15}{'GFLOP':>8}{'comp ms':>9}{'halo KiB':>10}{'msgs':>6}{'halo ms':>9}"
          f"{'model KiB':>10}{'other ms':>9}{'saved MiB':>10}")
    for c in plan.layers:
        print(f"  {c.name:<16}{c.kind:<15}{c.flops / 1e9:8.3f}{c.compute_s * 1e3:9.2f}{c.halo_bytes / 1024:10.1f}"
              f"{c.halo_messages:6d}{c.halo_s * 1e3:9.3f}{(c.model_bytes + c.model_allreduce_bytes) / 1024:10.1f}"
              f"{c.comm_s * 1e3:9.3f}{c.saved_bytes / 2**20:10.1f}")


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


def plot_scaling(args, path, machine):
    """Predicted step time and memory vs P, best grid of each family (log-log)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..failstop import atomic_write
    from ..plan import search
    layers, layers_mp = layers_of(args), (None if args.model_parallel == "off" else
                                          layers_of(args, args.model_parallel))
    ps = sorted({2 ** i for i in range(int(math.log2(args.ranks)) + 1)} | {args.ranks})
    families = ("data", "spatial", "model", "hybrid")
    series = {f: ([], [], []) for f in families}
    for p in ps:
        plans = search(layers, p, args.batch, machine, layers_mp=layers_mp, optimizer=args.optimizer, optimizer_sharding=args.optimizer_sharding,
                       algorithm=args.allreduce)
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
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110), binary=True)
    plt.close(fig)
    print(f"wrote {path}")


def plan(args) -> int:
    from ..failstop import atomic_write, check_writable
    from ..plan import plan_grid, save_machine, search
    from ..cli import launcher_rank, launcher_size
    machine, grid = check(args)
    if launcher_size() > 1 and not args.calibrate:
        raise ValueError("refimpl plan runs in one process: start it without mpiexec (mpiexec -n 2 only "
                         "with --calibrate, to measure the link)")
    for path, flag in ((args.json, "--json"), (args.plot, "--plot"), (args.save_machine, "--save-machine")):
        if path:
            check_writable(path, flag)
    if args.calibrate:
        from ..plan import calibrate
        machine = calibrate(machine, layers=layers_of(args), report=print if launcher_rank() == 0 else None)
        if machine is None:              # a helper rank of the ping-pong: rank 0 reports
            return 0
        print(f"calibrated: {machine.summary()}")
        if args.save_machine:
            atomic_write(args.save_machine, lambda f: f.write(save_machine(machine)))
            print(f"wrote {args.save_machine}")
        if args.batch is None or args.ranks is None:
            return 0
    layers = layers_of(args)
    layers_mp = None if args.model_parallel == "off" else layers_of(args, args.model_parallel)
    kw = dict(optimizer=args.optimizer, optimizer_sharding=args.optimizer_sharding, algorithm=args.allreduce)
    if grid is not None:
        from ..plan import feasibility
        dims = tuple(grid) + (1,) * (5 - len(grid))
        if dims[4] > 1 and layers_mp is None:
            raise ValueError(f"--grid {args.grid} has a model axis, but --model-parallel off")
        chosen_layers = layers if dims[4] == 1 else layers_mp
        why = feasibility(chosen_layers, dims, args.batch)
        if why:                          # the grid cannot run this model at all: bad input
            raise ValueError(f"--grid {args.grid}: {why}")
        chosen = plan_grid(chosen_layers, dims, args.batch, machine, **kw)
        print_table([chosen])
        if chosen.layers:
            explain(chosen)
        plans = [chosen]
    else:
        plans = search(layers, args.ranks, args.batch, machine, layers_mp=layers_mp, **kw)
        feasible = [p for p in plans if p.feasible]
        print(f"{args.model}: {len(plans)} grids of {args.ranks} ranks, {len(feasible)} fit"
              f"{' in ' + args.mem_per_rank if args.mem_per_rank else ''}; batch {args.batch}; {machine.summary()}")
        print_table(plans[:args.top])
        if feasible:
            explain(feasible[0])
            if len(feasible) > 1:
                explain(feasible[1])
                compare_two(feasible[0], feasible[1])
        batch_advice(args, plans)
    if args.json:
        text = json.dumps({"model": args.model, "batch": args.batch, "ranks": args.ranks,
                           "machine": machine.__dict__, "grids": [p.as_dict() for p in plans[:max(args.top, 1)]]},
                          indent=1)
        atomic_write(args.json, lambda f: f.write(text))
    if args.plot:
        plot_scaling(args, args.plot, machine)
    return 0
