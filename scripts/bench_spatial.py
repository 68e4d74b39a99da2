#!/usr/bin/env python
"""Spatial-parallel benchmark: a CosmoFlow conv stack on one sample split over P ranks.

The stack is CosmoFlow's convolutional trunk: per block Conv3d(k=3, padding 1)
-> LeakyReLU(0.3) -> MaxPool3d(2), channels ``--channels`` (default
4,16,32,64,128: half of CosmoFlow's 4,32,64,128,256, which ``--full`` selects),
built from the spatially partitioned layers of ``refimpl.nn.spatial``.  ONE
float32 sample of ``--size``^3 voxels, forward + backward, one warm-up step then
``--repeats`` timed steps (best kept).  Measured per rank:

- peak memory: tracemalloc's peak of the bytes allocated during one forward +
  backward (NumPy reports its buffers to tracemalloc: saved activations, halo
  work arrays, im2col tiles, gradients, the step's outputs; the input block and
  the parameters, allocated before, are not counted), taken in the warm-up
  step, next to the ideal ``1/P`` of the 1-rank number; ``ru_maxrss`` (the
  process's peak resident set, interpreter and MPI included) for context;
- halo time share: time inside ``HaloExchange.forward`` / ``.adjoint`` of every
  layer over the step time.  It includes waiting for slower neighbours;
- bytes sent: ``HaloExchange.bytes_sent`` summed over the layers for one step
  (forward exchange + adjoint), next to ``partition.bytes_sent`` of the same
  halo plans (forward + adjoint): they must be equal, exactly;
- strong-scaling efficiency ``t1 / (P * tP)`` of the step time (slowest rank),
  reported only where P ranks fit on the cores (one BLAS thread per rank): with
  more ranks than cores the ranks time-share the cores and their times say
  nothing about scaling (memory and bytes stay exact).  Each rank's CPU time of
  the step goes next to it: on a shared machine the wall time includes time
  spent descheduled, the CPU time does not.

A checksum ``sum(y * dy)`` (allreduced, float64) must agree across P up to
float32 rounding: every P computes the same function.

Two ways to run it:

    python scripts/bench_spatial.py --ranks 1,2,4,8 [--quick] [--json FILE]
        driver: launches ``mpiexec --oversubscribe -n P`` for each P with
        OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 (and OMPI_ALLOW_RUN_AS_ROOT*)
        and prints one row per P;
    mpiexec -n P python scripts/bench_spatial.py [--grid Pd,Ph,Pw] [--json FILE]
        one P: prints one row per rank (set the BLAS thread variables yourself).

The spatial grid of P ranks is ``--split cube`` (default: the most cubic
Pd x Ph x Pw with Pd >= Ph >= Pw, e.g. 2x2x2 for 8) or ``--split slab``
(P x 1 x 1); ``--grid`` fixes it for a single-P run.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

FULL_CHANNELS = (4, 32, 64, 128, 256)         # CosmoFlow's conv trunk
DEFAULT_CHANNELS = (4, 16, 32, 64, 128)       # half width: ranks 1,2,4,8 at 128^3 in about a minute
QUICK = dict(size=64, channels=(4, 8, 16, 32, 64), ranks="1,2,4,8", repeats=3)
NEGATIVE_SLOPE = 0.3
BLAS_ENV = dict(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
ROOT_ENV = dict(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default=None, metavar="P,P,...",
                    help="driver mode: run mpiexec -n P for each P and print one row per P")
    ap.add_argument("--size", type=int, default=None, help=f"sample extent D=H=W (default 128; quick {QUICK['size']})")
    ap.add_argument("--channels", default=None, metavar="C0,C1,...",
                    help=f"channels of the stack, one conv block per step (default "
                         f"{','.join(map(str, DEFAULT_CHANNELS))})")
    ap.add_argument("--full", action="store_true",
                    help=f"CosmoFlow's full width {','.join(map(str, FULL_CHANNELS))}")
    ap.add_argument("--split", choices=("cube", "slab"), default="cube",
                    help="grid of P ranks: most cubic Pd x Ph x Pw (default) or P x 1 x 1")
    ap.add_argument("--grid", default=None, metavar="Pd,Ph,Pw",
                    help="spatial grid of a single-P run (overrides --split)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed steps after the warm-up, best kept (default 1; quick 3)")
    ap.add_argument("--quick", action="store_true",
                    help=f"size {QUICK['size']}, channels {','.join(map(str, QUICK['channels']))} "
                         "(about a minute for ranks 1,2,4,8)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="driver: run the --ranks list this many times, interleaved (1,2,1,2,...), "
                         "and keep each P's fastest run: the machine's drift between runs then "
                         "biases no P (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=1800, help="driver: seconds allowed per mpiexec run")
    ap.add_argument("--json", metavar="FILE", help="write the numbers to FILE")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be a positive integer, got {args.rounds}")
    if args.full and args.channels:
        ap.error("--full and --channels are exclusive")
    channels = FULL_CHANNELS if args.full else QUICK["channels"] if args.quick and not args.channels \
        else DEFAULT_CHANNELS if not args.channels else _ints(ap, args.channels, "--channels")
    if len(channels) < 2 or min(channels) < 1:
        ap.error("--channels needs at least two positive integers (input channels, then one per block)")
    args.channels = tuple(channels)
    if args.size is None:
        args.size = QUICK["size"] if args.quick else 128
    if args.repeats is None:
        args.repeats = QUICK["repeats"] if args.quick else 1
    if args.size < 1 or args.repeats < 1:
        ap.error("--size and --repeats must be >= 1")
    if args.ranks is None and args.quick and os.environ.get("OMPI_COMM_WORLD_SIZE") is None:
        args.ranks = QUICK["ranks"]                 # plain `python ... --quick`: the driver
    if args.ranks is not None:
        args.ranks = _ints(ap, args.ranks, "--ranks")
        if min(args.ranks) < 1:
            ap.error("--ranks must be positive integers")
    if args.grid is not None and args.ranks is not None:
        ap.error("--grid is for a single-P run under mpiexec; with --ranks use --split")
    if args.grid is not None:
        args.grid = _ints(ap, args.grid, "--grid")
        if len(args.grid) != 3 or min(args.grid) < 1:
            ap.error("--grid needs three positive integers Pd,Ph,Pw")
    return args


def _ints(ap, text, name):
    try:
        return tuple(int(t) for t in text.split(","))
    except ValueError:
        ap.error(f"{name} must be comma-separated integers, got {text!r}")


def cubic_grid(p: int) -> tuple[int, int, int]:
    """The most cubic Pd x Ph x Pw = p with Pd >= Ph >= Pw (smallest largest factor)."""
    best = None
    for pd in range(1, p + 1):
        for ph in range(1, pd + 1):
            if p % (pd * ph) == 0 and p // (pd * ph) <= ph:
                dims = (pd, ph, p // (pd * ph))
                if best is None or max(dims) < max(best):
                    best = dims
    return best


def spatial_grid(p: int, split: str, grid=None) -> tuple[int, int, int]:
    if grid is not None:
        if grid[0] * grid[1] * grid[2] != p:
            raise ValueError(f"--grid {grid} holds {grid[0] * grid[1] * grid[2]} ranks, mpiexec gave {p}")
        return tuple(grid)
    return cubic_grid(p) if split == "cube" else (p, 1, 1)


def cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def mib(nbytes) -> str:
    return f"{nbytes / 2**20:.1f}"


# ---------------------------------------------------------------------------- one P (under mpiexec)

def build_stack(channels, grid, rng):
    """Conv3d(k3, p1) -> LeakyReLU(0.3) -> MaxPool3d(2) per block; returns (stack, halo layers).

    ``halo layers`` pairs every layer that exchanges halos with its input channels
    (what ``partition.bytes_sent`` needs to turn the plan's volumes into bytes).
    """
    from refimpl.nn.activation import LeakyReLU
    from refimpl.nn.module import Sequential
    from refimpl.nn.spatial import SpatialConv3d, SpatialMaxPool3d
    layers, halo_layers = [], []
    for c_in, c_out in zip(channels[:-1], channels[1:]):
        conv = SpatialConv3d(c_in, c_out, 3, 1, 1, grid=grid, rng=rng)
        pool = SpatialMaxPool3d(2, grid=grid)
        layers += [conv, LeakyReLU(NEGATIVE_SLOPE), pool]
        halo_layers += [(conv, c_in), (pool, c_out)]
    return Sequential(*layers), halo_layers


class HaloClock:
    """Times every call of the halo layers' ``HaloExchange.forward`` / ``.adjoint``."""

    def __init__(self, halos):
        self.forward_s = self.adjoint_s = 0.0
        for halo in halos:
            halo.forward = self._timed(halo.forward, "forward_s")
            halo.adjoint = self._timed(halo.adjoint, "adjoint_s")

    def _timed(self, call, field):
        def timed_call(a):
            t0 = time.perf_counter()
            try:
                return call(a)
            finally:
                setattr(self, field, getattr(self, field) + time.perf_counter() - t0)
        return timed_call

    def reset(self):
        self.forward_s = self.adjoint_s = 0.0


def predicted_bytes(halo_layers, grid, batch, itemsize) -> int:
    """What the halo plans say this rank sends in one step: forward exchange + adjoint."""
    from refimpl.parallel.partition import bytes_sent
    rank = grid.spatial_rank
    return sum(bytes_sent(layer.halo.plan, itemsize, channels, batch)[rank]
               + bytes_sent(layer.halo.plan, itemsize, channels, batch, adjoint=True)[rank]
               for layer, channels in halo_layers)


def run_one_p(args) -> dict | None:
    """Collective over COMM_WORLD; returns the report on rank 0 (None elsewhere)."""
    import numpy
    from mpi4py import MPI

    from refimpl.kernels import _im2col
    from refimpl.parallel.grid import ProcessGrid

    comm = MPI.COMM_WORLD
    dims = spatial_grid(comm.size, args.split, args.grid)   # same on every rank: raises on all
    grid = ProcessGrid(comm, (1,) + dims)
    stack, halo_layers = build_stack(args.channels, grid, numpy.random.default_rng(args.seed))
    size = (args.size,) * 3
    out_dhw = stack.setup(size)
    halos = [layer.halo for layer, _ in halo_layers]
    clock = HaloClock(halos)

    rng = numpy.random.default_rng([args.seed, 1])
    x_global = rng.standard_normal((1, args.channels[0]) + size, dtype=numpy.float32)   # (1, C0, S, S, S)
    dy_global = rng.standard_normal((1, args.channels[-1]) + out_dhw, dtype=numpy.float32)
    x = numpy.ascontiguousarray(x_global[(Ellipsis,) + grid.local_block(size)])         # (1, C0, block)
    dy = numpy.ascontiguousarray(dy_global[(Ellipsis,) + grid.local_block(out_dhw)])
    del x_global, dy_global

    def step():
        stack.zero_grad()
        y = stack.forward(x)
        dx = stack.backward(dy)
        return y, dx

    # warm-up step, traced: the peak of what one forward + backward allocates
    comm.Barrier()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    y, dx = step()
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    checksum = comm.allreduce(float(numpy.sum(y.astype(numpy.float64) * dy)))
    del y, dx

    best = None
    for _ in range(args.repeats):
        sent_before = sum(h.bytes_sent for h in halos)
        clock.reset()
        comm.Barrier()
        t0, cpu0 = time.perf_counter(), time.process_time()
        step()
        t_step, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        if best is None or t_step < best["step_s"]:
            best = {"step_s": t_step, "cpu_s": cpu, "halo_forward_s": clock.forward_s,
                    "halo_adjoint_s": clock.adjoint_s,
                    "bytes_sent": sum(h.bytes_sent for h in halos) - sent_before}
    rank_row = dict(best, rank=comm.rank, coords=list(grid.spatial_coords),
                    block=[s.stop - s.start for s in grid.local_block(size)],
                    peak_bytes=peak, maxrss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                    bytes_predicted=predicted_bytes(halo_layers, grid, 1, numpy.dtype(numpy.float32).itemsize))
    rank_row["halo_share"] = (rank_row["halo_forward_s"] + rank_row["halo_adjoint_s"]) / rank_row["step_s"]
    rows = comm.gather(rank_row, root=0)
    if comm.rank != 0:
        return None
    return {"ranks": comm.size, "grid": list(dims), "size": args.size, "channels": list(args.channels),
            "out_extent": list(out_dhw), "dtype": "float32", "repeats": args.repeats,
            "checksum": checksum, "cores": cpu_cores(), "oversubscribed": comm.size > cpu_cores(),
            "blas_env": {k: os.environ.get(k) for k in BLAS_ENV},
            "max_temp_bytes": _im2col.MAX_TEMP_BYTES, "numpy": numpy.__version__,
            "per_rank": rows, **summarize(rows)}


def summarize(rows) -> dict:
    """One row per P: the slowest rank's step, halo shares, the largest memory, exact-bytes check."""
    return {"step_s": max(r["step_s"] for r in rows), "cpu_s": max(r["cpu_s"] for r in rows),
            "halo_share_mean": sum(r["halo_share"] for r in rows) / len(rows),
            "halo_share_max": max(r["halo_share"] for r in rows),
            "peak_bytes": max(r["peak_bytes"] for r in rows),
            "maxrss_bytes": max(r["maxrss_bytes"] for r in rows),
            "bytes_sent_max": max(r["bytes_sent"] for r in rows),
            "bytes_predicted_max": max(r["bytes_predicted"] for r in rows),
            "bytes_sent_total": sum(r["bytes_sent"] for r in rows),
            "bytes_match": all(r["bytes_sent"] == r["bytes_predicted"] for r in rows)}


def print_ranks(report):
    print(f"# P={report['ranks']} grid {'x'.join(map(str, report['grid']))}  size {report['size']}^3  "
          f"channels {','.join(map(str, report['channels']))}  float32  checksum {report['checksum']:.6e}")
    head = (f"{'rank':>4} {'coords':>9} {'block':>12} {'step s':>8} {'cpu s':>7} {'halo fwd s':>10} {'halo adj s':>10} "
            f"{'halo %':>6} {'peak MiB':>9} {'maxrss MiB':>10} {'sent B':>11} {'plan B':>11} {'match':>5}")
    print(head)
    print("-" * len(head))
    for r in report["per_rank"]:
        print(f"{r['rank']:>4} {','.join(map(str, r['coords'])):>9} {'x'.join(map(str, r['block'])):>12} "
              f"{r['step_s']:8.2f} {r['cpu_s']:7.2f} {r['halo_forward_s']:10.3f} {r['halo_adjoint_s']:10.3f} "
              f"{100 * r['halo_share']:6.1f} {mib(r['peak_bytes']):>9} {mib(r['maxrss_bytes']):>10} "
              f"{r['bytes_sent']:>11} {r['bytes_predicted']:>11} "
              f"{'yes' if r['bytes_sent'] == r['bytes_predicted'] else 'NO':>5}")


def worker(args) -> int:
    from mpi4py import MPI

    from refimpl.backend import tune_allocator
    tune_allocator()                       # as `refimpl train` does
    try:
        report = run_one_p(args)
    except ValueError as err:      # raised identically on every rank, before any message
        if MPI.COMM_WORLD.rank == 0:
            print(f"bench_spatial: error: {err}", file=sys.stderr)
        return 2
    if report is not None:
        print_ranks(report)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(report, fh, indent=1)
    return 0


# ---------------------------------------------------------------------------- driver (one mpiexec per P)

def launch(p, args, json_path) -> dict:
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        raise SystemExit("bench_spatial: mpiexec not found (pip install 'refimpl[mpi]')")
    cmd = [mpiexec, "--oversubscribe", "-n", str(p), sys.executable, os.path.abspath(__file__),
           "--size", str(args.size), "--channels", ",".join(map(str, args.channels)),
           "--split", args.split, "--repeats", str(args.repeats), "--seed", str(args.seed),
           "--json", json_path]
    env = dict(os.environ, **BLAS_ENV, **ROOT_ENV)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"bench_spatial: mpiexec -n {p} failed (rc={proc.returncode})\n"
                         f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    with open(json_path) as fh:
        report = json.load(fh)
    report["wall_s"] = time.perf_counter() - t0
    return report


def add_comparisons(reports):
    """Ideal memory (1-rank peak / P), efficiency t1 / (P tP) where P fits the cores, checksum drift."""
    one = next((r for r in reports if r["ranks"] == 1), None)
    for r in reports:
        p = r["ranks"]
        r["peak_ideal_bytes"] = one["peak_bytes"] / p if one else None
        r["peak_over_ideal"] = r["peak_bytes"] / r["peak_ideal_bytes"] if one else None
        r["efficiency"] = (one["step_s"] / (p * r["step_s"])
                           if one and not r["oversubscribed"] else None)
        r["checksum_rel_diff"] = (abs(r["checksum"] - one["checksum"]) / abs(one["checksum"])
                                  if one and one["checksum"] else None)


def print_table(reports):
    head = (f"{'P':>2} {'grid':>6} {'step s':>7} {'cpu s':>7} {'halo % mean/max':>15} {'peak MiB':>9} "
            f"{'ideal 1/P':>9} {'peak/ideal':>10} {'maxrss MiB':>10} {'sent MiB/rank':>13} "
            f"{'plan MiB/rank':>13} {'match':>5} {'efficiency':>18}")
    print(head)
    print("-" * len(head))
    for r in reports:
        eff = (f"{r['efficiency']:.2f}" if r["efficiency"] is not None
               else "n/a (oversubscr.)" if r["oversubscribed"] else "n/a")
        ideal = mib(r["peak_ideal_bytes"]) if r["peak_ideal_bytes"] is not None else "n/a"
        ratio = f"{r['peak_over_ideal']:.2f}" if r["peak_over_ideal"] is not None else "n/a"
        print(f"{r['ranks']:>2} {'x'.join(map(str, r['grid'])):>6} {r['step_s']:7.3f} {r['cpu_s']:7.3f} "
              f"{100 * r['halo_share_mean']:7.1f}/{100 * r['halo_share_max']:<7.1f} "
              f"{mib(r['peak_bytes']):>9} {ideal:>9} {ratio:>10} {mib(r['maxrss_bytes']):>10} "
              f"{r['bytes_sent_max'] / 2**20:13.3f} {r['bytes_predicted_max'] / 2**20:13.3f} "
              f"{'yes' if r['bytes_match'] else 'NO':>5} {eff:>18}")


def driver(args) -> int:
    cores, load_start = cpu_cores(), os.getloadavg()[0]
    print(f"# bench_spatial: one {args.size}^3 sample, channels {','.join(map(str, args.channels))}, "
          f"float32, fwd+bwd, split {args.split}, {cores} cores, 1 BLAS thread per rank, "
          f"warm-up + {args.repeats} timed step(s), {args.rounds} round(s), load average "
          f"{load_start:.1f}", flush=True)
    fastest = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for p in args.ranks:
                report = launch(p, args, os.path.join(tmp, f"p{p}.json"))
                report["rounds"] = args.rounds
                print(f"#   P={p} done in {report['wall_s']:.0f} s (step {report['step_s']:.3f} s"
                      f"{f', round {rnd + 1}' if args.rounds > 1 else ''})", flush=True)
                if p not in fastest or report["step_s"] < fastest[p]["step_s"]:
                    fastest[p] = report
    reports = [fastest[p] for p in dict.fromkeys(args.ranks)]
    add_comparisons(reports)
    print_table(reports)
    drift = [r["checksum_rel_diff"] for r in reports if r["checksum_rel_diff"] is not None]
    print(f"# step s: slowest rank's wall time; cpu s: largest CPU time of a rank in the step "
          f"(includes MPI polling); halo %: time in HaloExchange.forward+adjoint / step time (incl. "
          f"waiting for neighbours); sent/plan: largest rank, fwd+adjoint; efficiency t1/(P tP) only "
          f"for P <= {cores} cores; checksum drift vs P=1: {max(drift) if drift else 0:.1e}; "
          f"load average at the end {os.getloadavg()[0]:.1f} (above {cores}: other processes "
          f"share the cores and the times are noisy)")
    ok = all(r["bytes_match"] for r in reports)
    if not ok:
        print("# MISMATCH: bytes sent differ from the halo plan's prediction", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"size": args.size, "channels": list(args.channels), "split": args.split,
                       "cores": cores, "repeats": args.repeats, "rounds": args.rounds, "blas_env": BLAS_ENV,
                       "load_average": [load_start, os.getloadavg()[0]],
                       "bytes_match": ok, "rows": reports}, fh, indent=1)
    return 0 if ok else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    return driver(args) if args.ranks is not None else worker(args)


if __name__ == "__main__":
    sys.exit(main())
