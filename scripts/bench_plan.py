#!/usr/bin/env python
"""The planner against measured runs: predicted vs measured step time and peak memory per grid.

For a model preset and a global batch, every grid of ``--ranks`` ranks (or ``--grids``) is
run for real under ``mpiexec`` (float32, one BLAS thread per rank): build the model, an
SGD-momentum optimizer and the gradient synchroniser, one warm-up training step (forward,
loss, backward, gradient allreduce, update) and ``--repeats`` timed steps (best kept;
slowest rank); with ``--rounds R`` every grid is run R times, round-robin (every other round in reverse
order), the best kept.  Memory: tracemalloc's peak over the warm-up step, started before the
model is built (weights, gradients, optimizer state, activations, halo buffers and
temporaries; NumPy reports its buffers to tracemalloc), max over ranks.  Next to each,
``refimpl.plan``'s prediction for the same grid with the machine constants of
``--machine FILE`` (default: ``refimpl plan --calibrate`` values measured here, see
docs/planner.md).  The table ends with the two rankings (by measured and by predicted
step time) and whether they agree.

    python scripts/bench_plan.py --model cosmoflow --preset small --batch 4 --ranks 2 [--json FILE]
    python scripts/bench_plan.py --model unet3d --preset tiny --batch 4 --ranks 4 --grids 4,1,1,1 2,2,1,1

With more ranks than cores the ranks time-share the cores: times then measure the
oversubscribed machine (report them separately); memory and bytes stay exact.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import tracemalloc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def worker(args) -> None:
    """One grid under mpiexec: prints one JSON line on rank 0."""
    import numpy as np
    from mpi4py import MPI

    from refimpl.models import build_model
    from refimpl.optim import make_optimizer
    from refimpl.parallel.grad_sync import GradientSynchronizer
    from refimpl.parallel.grid import ProcessGrid, parse_grid
    from refimpl.parallel.partition import block_range

    comm = MPI.COMM_WORLD
    dims = parse_grid(args.grid)
    grid = ProcessGrid(comm, dims)
    # the batch first (the data loader's, not the step's memory): this rank's block of it
    from refimpl.models import PRESETS
    c, *dhw = PRESETS[args.model][args.preset]["input_shape"]
    rng = np.random.default_rng(0)
    samples = slice(*block_range(args.batch, grid.dims[0], grid.sample_coord))
    x = rng.standard_normal((args.batch, c) + tuple(dhw)).astype(np.float32)
    x_local = np.ascontiguousarray(x[(samples, slice(None)) + grid.local_block(dhw)])
    del x
    tracemalloc.start()
    model = build_model(args.model, config_of(args, dims), grid, seed=0, global_batch=args.batch)
    optimizer = make_optimizer("sgd", model.parameters(), lr=1e-3, momentum=0.9)
    sync = GradientSynchronizer(model.parameters(), grid.data_comm, grid.spatial_comm)
    if args.model == "cosmoflow":
        target = rng.uniform(-1, 1, (args.batch, model.num_outputs)).astype(np.float32)
    else:
        target = rng.integers(0, model.num_classes, (args.batch,) + tuple(dhw))
    target_local = model.local_target(target)

    def step():
        model.zero_grad()
        out = model.forward(x_local)
        _, dout, _ = model.loss(out, target_local)
        model.backward(dout)
        sync.finish()
        optimizer.step()

    step()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    times = []
    for _ in range(args.repeats):
        comm.Barrier()
        start = time.perf_counter()
        step()
        times.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    peaks = comm.gather(peak, root=0)
    if comm.Get_rank() == 0:
        print(json.dumps({"grid": list(dims), "step_s": min(times), "peak_bytes": max(peaks)}), flush=True)


def config_of(args, dims):
    """The preset, with the model axis switched on for grids with Pm > 1 (--model-parallel)."""
    from refimpl.models import PRESETS
    config = dict(PRESETS[args.model][args.preset])
    if len(dims) == 5 and dims[4] > 1:
        config["model_parallel"] = args.model_parallel
    return config


def run_grid(args, dims) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    n = 1
    for p in dims:
        n *= p
    cmd = [shutil.which("mpiexec") or "mpiexec", "--oversubscribe", "-n", str(n), sys.executable, __file__,
           "--worker", "--grid", ",".join(map(str, dims)), "--model", args.model, "--preset", args.preset,
           "--batch", str(args.batch), "--repeats", str(args.repeats), "--model-parallel", args.model_parallel]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"grid {dims} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def same_order(a, b) -> bool:
    """Whether a and b sort the grids in the same order."""
    return sorted(range(len(a)), key=a.__getitem__) == sorted(range(len(b)), key=b.__getitem__)


def concordance(measured, predicted, noise) -> tuple[int, int]:
    """(pairs whose measured times differ by more than ``noise``, of those the pairs the
    prediction orders the same way): ties within the run-to-run noise carry no ranking."""
    pairs = concordant = 0
    for i in range(len(measured)):
        for j in range(i + 1, len(measured)):
            if abs(measured[i] - measured[j]) > noise * min(measured[i], measured[j]):
                pairs += 1
                concordant += (measured[i] < measured[j]) == (predicted[i] < predicted[j])
    return pairs, concordant


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("cosmoflow", "unet3d"), default="cosmoflow")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--grids", nargs="*", default=None, metavar="Pn,Pd,Ph,Pw",
                        help="grids to run (default: every 4-entry grid of --ranks ranks the model takes)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every grid this many times, round-robin, every other round in reverse order (the "
                             "best kept): drift in the machine's speed then hits every grid alike (default 1)")
    parser.add_argument("--model-parallel", choices=("none", "filter", "channel"), default="none",
                        help="also run grids with a model axis Pm > 1, split this way")
    parser.add_argument("--noise", type=float, default=0.05,
                        help="relative step-time difference below which two grids count as tied (default 0.05)")
    parser.add_argument("--machine", default=None, help="machine TOML for the predictions")
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--grid", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    from refimpl.parallel.grid import all_grids, parse_grid
    from refimpl.plan import Machine, feasibility, load_machine, model_layers, plan_grid
    machine = load_machine(args.machine) if args.machine else Machine()
    grids = [parse_grid(g) for g in args.grids] if args.grids else \
        [g for g in all_grids(args.ranks, model=args.model_parallel != "none")
         if not feasibility(model_layers(args.model, config_of(args, g)), g, args.batch)]
    load = os.getloadavg()[0]
    rows = []
    print(f"# {args.model} {args.preset}, batch {args.batch}, {args.ranks} rank(s), load average {load:.2f}, "
          f"machine {machine.summary()}")
    print(f"{'grid':<14}{'measured s':>11}{'predicted s':>12}{'ratio':>7}{'peak MiB':>10}{'predicted':>10}"
          f"{'ratio':>7}")
    if args.rounds < 1 or args.repeats < 1:
        raise SystemExit("--rounds and --repeats must be positive")
    runs = {tuple(dims): [] for dims in grids}
    for round_ in range(args.rounds):
        # forward, then backward: a drift of the machine's speed within a round (these guests move
        # 10-40 % in minutes) does not always fall on the grids run last
        for dims in (grids if round_ % 2 == 0 else grids[::-1]):
            runs[tuple(dims)].append(run_grid(args, dims))
    for dims in grids:
        got = min(runs[tuple(dims)], key=lambda r: r["step_s"])
        got = dict(got, peak_bytes=max(r["peak_bytes"] for r in runs[tuple(dims)]))
        plan = plan_grid(model_layers(args.model, config_of(args, dims)), dims, args.batch, machine, every_rank=True)
        row = {"grid": list(dims), "measured_s": got["step_s"], "predicted_s": plan.step_s,
               "measured_peak_bytes": got["peak_bytes"], "predicted_peak_bytes": plan.memory_bytes}
        rows.append(row)
        print(f"{str(tuple(dims)):<14}{row['measured_s']:>11.4f}{row['predicted_s']:>12.4f}"
              f"{row['predicted_s'] / row['measured_s']:>7.2f}{row['measured_peak_bytes'] / 2**20:>10.1f}"
              f"{row['predicted_peak_bytes'] / 2**20:>10.1f}"
              f"{row['predicted_peak_bytes'] / row['measured_peak_bytes']:>7.2f}")
    measured = [r["measured_s"] for r in rows]
    predicted = [r["predicted_s"] for r in rows]
    order = lambda v: [tuple(rows[i]["grid"]) for i in sorted(range(len(v)), key=v.__getitem__)]  # noqa: E731
    agree = same_order(measured, predicted)
    pairs, concordant = concordance(measured, predicted, args.noise)
    print(f"# measured ranking:  {order(measured)}\n# predicted ranking: {order(predicted)}\n"
          f"# rankings identical: {agree}; pairs of grids whose measured times differ by more than "
          f"{args.noise:.0%}: {pairs}, ordered alike by the planner: {concordant}\n# memory within 15%: "
          f"{all(abs(r['predicted_peak_bytes'] / r['measured_peak_bytes'] - 1) <= 0.15 for r in rows)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "load_average": load, "rows": rows, "rankings_identical": agree,
                   "distinguishable_pairs": pairs, "concordant_pairs": concordant}, f,
                      indent=1)


if __name__ == "__main__":
    main()
