#!/usr/bin/env python
"""The distributed weight update against plain data parallelism: optimizer memory per rank and
step time (docs/communication.md).

For each rank count P of ``--ranks`` the script runs CosmoFlow (``--preset``, float32) on the
data-parallel grid (P, 1, 1, 1) under mpiexec, once with the plain update (allreduce, every
rank updates everything) and once with ``--optimizer-sharding`` (reduce-scatter, each rank
updates its block, allgather).  Per run: the optimizer state each rank holds after the first
step, measured by tracemalloc around that step (the state is allocated there; the gradient
buckets and parameters exist before) and counted exactly (``state_bytes``), largest rank;
the best of ``--repeats`` step times (slowest rank).

    python scripts/bench_comm.py --ranks 1,2,4 --optimizer adam [--json FILE]

``--compress-study``: CosmoFlow (``--preset``) trained on 2 ranks (2, 1, 1, 1) for ``--steps``
steps on one generated dataset, with the exchange uncompressed, int8 and top-k 1% (error
feedback on), and top-k 1% without error feedback, each for every seed of ``--seeds``; the
table lists the final validation MAE and the gradient bytes each rank sends per step (the
uncompressed row: the bucket bytes an allgather of float32 would send, for comparison).

    python scripts/bench_comm.py --compress-study --steps 150 --seeds 0,1

More ranks than cores time-share the cores: times are then those of an oversubscribed machine
(memory stays exact).
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
    import numpy as np
    from mpi4py import MPI

    from refimpl.backend import tune_allocator
    from refimpl.models import PRESETS, build_model
    from refimpl.optim import make_optimizer
    from refimpl.parallel.grad_sync import GradientSynchronizer
    from refimpl.parallel.grid import ProcessGrid
    from refimpl.parallel.partition import block_range
    from refimpl.parallel.sharded_update import ShardedOptimizer
    tune_allocator()
    comm = MPI.COMM_WORLD
    p = comm.Get_size()
    grid = ProcessGrid(comm, (p, 1, 1, 1))
    config = dict(PRESETS["cosmoflow"][args.preset])
    batch = args.batch * p
    model = build_model("cosmoflow", config, grid, seed=0, global_batch=batch)
    sync = GradientSynchronizer(model.parameters(), grid.data_comm, grid.spatial_comm, shard=args.sharded)

    def make(params):
        return make_optimizer(args.optimizer, params, lr=1e-3, momentum=0.9)
    opt = ShardedOptimizer(make, model.parameters(), sync) if args.sharded else make(model.parameters())
    rng = np.random.default_rng(0)
    shape = tuple(config["input_shape"])
    lo, hi = block_range(batch, p, comm.Get_rank())
    x = rng.standard_normal((hi - lo,) + shape).astype(np.float32)
    t = model.local_target(rng.uniform(-1, 1, (batch, model.num_outputs)).astype(np.float32))

    def step(measure=False):
        model.zero_grad()
        out = model.forward(x)
        _, dout, _ = model.loss(out, t)
        model.backward(dout)
        sync.finish()
        if not measure:
            opt.step()
            return 0
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        opt.step()
        grown = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        return grown

    traced = step(measure=True)
    state = opt.state_bytes() if args.sharded else sum(a.nbytes for s in opt.state for a in s.values())
    times = []
    for _ in range(args.repeats):
        comm.Barrier()
        start = time.perf_counter()
        step()
        times.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    traced, state = comm.allreduce(traced, op=MPI.MAX), comm.allreduce(state, op=MPI.MAX)
    params = sum(int(q.data.nbytes) for q in model.parameters())
    if comm.Get_rank() == 0:
        print(json.dumps({"ranks": p, "sharded": args.sharded, "state_traced_bytes": traced,
                          "state_bytes": state, "param_bytes": params, "step_s": min(times)}), flush=True)


def run(args, p, sharded) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [shutil.which("mpiexec") or "mpiexec", "--oversubscribe", "-n", str(p), sys.executable, __file__,
           "--worker", "--preset", args.preset, "--batch", str(args.batch), "--optimizer", args.optimizer,
           "--repeats", str(args.repeats)] + (["--sharded"] if sharded else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"P={p} sharded={sharded} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compress_study(args) -> None:
    import tempfile
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    seeds = [int(v) for v in args.seeds.split(",")]
    work = tempfile.mkdtemp(prefix="bench_comm_")
    data = os.path.join(work, "data")
    subprocess.run([sys.executable, "-m", "refimpl", "datagen", "cosmoflow", "--out", data, "--samples",
                    str(args.samples), "--val-samples", str(args.samples // 4), "--size", str(args.size),
                    "--quiet"], check=True, env=env)
    configs = [("none", True), ("int8", True), ("topk:0.01", True), ("topk:0.01", False)]
    rows = []
    print(f"# cosmoflow {args.preset} at {args.size}^3, {args.samples} training samples, 2 ranks (2,1,1,1), "
          f"{args.steps} steps, seeds {seeds}; load average {os.getloadavg()[0]:.2f}")
    print(f"{'exchange':<12}{'error feedback':>15}{'seed':>6}{'val MAE':>9}{'bytes/step':>12}{'x none':>8}")
    for spec, feedback in configs:
        for seed in seeds:
            out = os.path.join(work, f"{spec.replace(':', '')}_{int(feedback)}_{seed}")
            cmd = [shutil.which("mpiexec") or "mpiexec", "--oversubscribe", "-n", "2", sys.executable, "-m",
                   "refimpl", "train", "--model", "cosmoflow", "--preset", args.preset, "--data", data,
                   "--grid", "2,1,1,1", "--steps", str(args.steps), "--seed", str(seed), "--quiet", "--no-plot",
                   "--validate-every", str(args.steps), "--out", out, "--compress", spec]
            if not feedback:
                cmd.append("--no-error-feedback")
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
            if proc.returncode != 0:
                raise SystemExit(f"{spec} seed {seed} failed:\n{proc.stderr[-2000:]}")
            with open(os.path.join(out, "summary.json")) as f:
                summary = json.load(f)
            exchange = summary.get("gradient_exchange")
            sent = exchange["bytes_sent_per_step"] if exchange else None
            full = exchange["bytes_uncompressed"] if exchange else None
            row = {"compress": spec, "error_feedback": feedback, "seed": seed,
                   "val_mae": summary["final_val"]["mae"], "bytes_sent_per_step": sent, "bytes_uncompressed": full}
            rows.append(row)
            ratio = f"{sent / full:8.3f}" if sent else f"{'1':>8}"
            print(f"{spec:<12}{'yes' if feedback else 'no':>15}{seed:>6}{row['val_mae']:>9.4f}"
                  f"{(sent if sent else 0):>12}{ratio}")
    print("# val MAE: after the last step, on the generated validation split; bytes/step: one rank's compressed "
          "messages (each sent to the other rank); x none: / the float32 bucket bytes")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "rows": rows}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="1,2,4", help="comma-separated rank counts (default 1,2,4)")
    ap.add_argument("--preset", default="small", help="CosmoFlow preset (default small)")
    ap.add_argument("--batch", type=int, default=2, help="samples per rank (default 2)")
    ap.add_argument("--optimizer", choices=("sgd", "adam"), default="adam")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--compress-study", action="store_true",
                    help="train with none / int8 / top-k 1%% (and top-k without error feedback) instead")
    ap.add_argument("--steps", type=int, default=150, help="compress study: training steps (default 150)")
    ap.add_argument("--seeds", default="0,1", help="compress study: seeds (default 0,1)")
    ap.add_argument("--samples", type=int, default=64, help="compress study: training samples (default 64)")
    ap.add_argument("--size", type=int, default=64, help="compress study: sample extent (the preset's)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sharded", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.compress_study:
        return compress_study(args)
    try:
        ranks = [int(r) for r in args.ranks.split(",")]
    except ValueError:
        raise SystemExit(f"--ranks must be comma-separated integers, got {args.ranks!r}") from None
    if any(r < 1 for r in ranks) or args.batch < 1 or args.repeats < 1:
        raise SystemExit("--ranks, --batch and --repeats must be positive")
    rows = []
    print(f"# cosmoflow {args.preset}, {args.batch} samples per rank, {args.optimizer}, float32; load average "
          f"{os.getloadavg()[0]:.2f}; {os.cpu_count()} cores")
    print(f"{'P':>3} {'update':<12}{'state MiB (traced)':>19}{'state MiB':>10}{'x plain':>8}{'x 1/P':>7}"
          f"{'step s':>9}{'x plain':>8}")
    for p in ranks:
        plain, shard = run(args, p, False), run(args, p, True)
        for name, r in (("plain", plain), ("distributed", shard)):
            share = r["state_bytes"] / plain["state_bytes"]
            r.update(update=name, state_vs_plain=share, state_vs_ideal=share * p,
                     step_vs_plain=r["step_s"] / plain["step_s"])
            rows.append(r)
            print(f"{p:>3} {name:<12}{r['state_traced_bytes'] / 2**20:>19.2f}{r['state_bytes'] / 2**20:>10.2f}"
                  f"{share:>8.3f}{share * p:>7.3f}{r['step_s']:>9.4f}{r['step_s'] / plain['step_s']:>8.2f}")
    print("# state: optimizer state of the largest rank (exact; traced: tracemalloc's growth over the first "
          "update); x 1/P: state / (plain state / P), 1.0 = an exact 1/P share; step: best of "
          f"{args.repeats} (slowest rank)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
