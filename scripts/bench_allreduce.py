#!/usr/bin/env python
"""Allreduce benchmark: refimpl's algorithms vs native MPI, the alpha-beta model, and overlap.

    mpiexec -n P python scripts/bench_allreduce.py [--quick] [--json FILE]

Part 1 -- every algorithm of refimpl.parallel.collectives and MPI's own
Allreduce on float32 buffers from 4 B to 64 MiB (powers of 4; ``--quick``:
powers of 16 up to 4 MiB).  Each row: median time over repeats (every repeat
starts after a barrier and counts the slowest rank), bus bandwidth
``2(p-1)/p * n / t`` (bytes a rank must move in a bandwidth-optimal
allreduce, per second), the ratio to native, the alpha-beta-gamma prediction
and predicted / measured.

The model's constants are measured on this machine by separate
micro-benchmarks, not fitted to the allreduce times (that would be circular):
- alpha_mpi, beta from a native ping-pong between ranks 0 and 1 (Send/Recv
  of float32 buffers, half the round trip): alpha_mpi = one-way time of an
  8-byte message, beta = slope between 4 and 16 MiB messages;
- gamma from the time of ``a += b`` on 16 MiB float32 arrays, per byte;
- alpha_round: one round of our Python state machine (Isend + Irecv of 8
  bytes through ``Messages``, Waitall) between ranks 0 and 1 -- the latency
  our point-to-point algorithms pay per message round (mpi4py and Python
  overhead included, which MPI's C algorithms do not pay);
- c0: the fixed cost of one call (argument checks, tag, generator) measured
  as a ring allreduce on a 1-rank communicator (no messages).
MPI's own rows use alpha_mpi; ours use c0 + the formula with alpha_round.
Ranks sharing cores (more ranks than cores: mpiexec --oversubscribe, or a
busy machine) make every constant an optimistic one-pair figure: the model
then underestimates contended runs.

Part 2 -- one training step of a small CosmoFlow-shaped CNN (3 conv + pool
blocks, 3 dense layers, float32; built from refimpl.nn layers) with
GradientSynchronizer.  Backward alone (T_bwd), the gradient allreduce alone
(T_comm: finish() with overlap off and one bucket, after a barrier) and each
configuration's step time T (backward + finish) are timed round-robin, repeat
by repeat, so a busy machine slows them alike; the best repeat (slowest rank)
is kept, as noise from other processes only ever adds time.  Hidden share =
(T_bwd + T_comm - T) / T_comm: the part of the allreduce that disappeared
behind backward (0 = none, 1 = all).  Python has no progress thread: a bucket
advances only inside the gradient hooks (which test() it) and MPI's own
progress, so overlap is real but partial.

Part 3 -- priorities (MLSL): CosmoFlow ``small`` (refimpl.models, float32, data-parallel grid
(P,1,1,1), local batch ``--local-batch``) trains whole steps (forward, loss, backward, update)
with ``parallel/priority.LayerwiseUpdate`` in three configurations, all with 1 MiB buckets (so
the conv layers' gradients are not in the dense head's bucket), in rounds of 3 consecutive steps
per configuration: plain (``priority="none"``: finish() waits for every bucket, then the whole
update), the same with buckets cut into 256 KiB chunks, and ``priority="input-first"`` (256 KiB
chunks, input side first, each layer's update deferred to just before its next forward).  Per
configuration: the median over steps of the time from the end of backward to the start of the
next forward's first layer (within a round; slowest rank), and of the whole step.  ``--trace FILE`` writes every
chunk's start and finish of every rank and step as JSON lines (plus one "step" line per rank and
step with the end of backward and the next forward's first layer), ``--timeline PNG`` draws rank
0's last traced step of each configuration: one row per bucket, one bar per chunk, times from the
end of backward.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from refimpl.commands.train import allreduce_options  # noqa: E402  (neither imports mpi4py.MPI)
from refimpl.parallel.allreduce import ALGORITHMS as REGISTRY, check_options  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--quick", action="store_true", help="reduced sizes (<= 4 MiB) and repeats (< 1 min)")
ap.add_argument("--max-bytes", type=int, default=None, help="largest message (default 64 MiB, quick 4 MiB)")
ap.add_argument("--repeats", type=int, default=None, help="timed repeats per size (default 15, quick 5)")
for _option in {o.name: o for a in REGISTRY.values() for o in a.options}.values():   # --colors, --group-size
    ap.add_argument("--" + _option.name.replace("_", "-"), default=_option.default,
                    type=lambda text, name=_option.name: allreduce_options([f"{name}={text}"])[name],
                    help=", ".join(a.name for a in REGISTRY.values() if _option in a.options) + f": {_option.allowed}")
ap.add_argument("--skip-train", action="store_true", help="skip part 2 (the training step)")
ap.add_argument("--parts", default="1,2,3", help="which parts to run, e.g. 3 or 1,2 (default 1,2,3)")
ap.add_argument("--steps", type=int, default=None, help="part 3: timed steps per configuration "
                "(default 12, quick 5)")
ap.add_argument("--local-batch", type=int, default=1, help="part 3: samples per rank (default 1)")
ap.add_argument("--trace", metavar="FILE", help="part 3: every chunk's start/finish as JSON lines (rank 0 "
                "gathers)")
ap.add_argument("--timeline", metavar="PNG", help="part 3: the timeline picture of rank 0 (needs matplotlib)")
ap.add_argument("--json", metavar="FILE", help="write the numbers to FILE (rank 0)")
args = ap.parse_args()
PARTS = set()
for part in args.parts.split(","):
    if part.strip() not in ("1", "2", "3"):
        ap.error(f"--parts: {part!r} is not one of 1, 2, 3")
    PARTS.add(int(part))
if args.skip_train:
    PARTS -= {2, 3}
for flag, value in (("--steps", args.steps), ("--local-batch", args.local_batch)):
    if value is not None and value < 1:
        ap.error(f"{flag} must be >= 1, got {value}")
# each algorithm with options: the values given (or defaults) of its options
OPTIONS = {a.name: {o.name: getattr(args, o.name) for o in a.options if getattr(args, o.name) is not None}
           for a in REGISTRY.values() if a.options}
for _name, _options in OPTIONS.items():
    try:
        check_options(_name, _options)
    except ValueError as err:
        ap.error(str(err))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from refimpl.parallel import collectives  # noqa: E402
from refimpl.parallel.collectives import (ALGORITHMS, Messages, allreduce, predicted_time,  # noqa: E402
                                          start_allreduce)
from refimpl.parallel.grad_sync import GradientSynchronizer  # noqa: E402

comm = MPI.COMM_WORLD
rank, p = comm.Get_rank(), comm.Get_size()
MIB = 1 << 20
MAX_BYTES = args.max_bytes or (4 * MIB if args.quick else 64 * MIB)
REPEATS = args.repeats or (5 if args.quick else 15)


def say(*a):
    if rank == 0:
        print(*a, flush=True)


def slowest(times):
    """Per-repeat time of the slowest rank (elementwise max over ranks)."""
    t = np.array(times, dtype=np.float64)
    comm.Allreduce(MPI.IN_PLACE, t, op=MPI.MAX)
    return t


def human(n):
    for unit, size in (("MiB", MIB), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


# ---------------------------------------------------------------- machine constants

def ping_pong(nbytes, repeats):
    """One-way time of a native Send/Recv between ranks 0 and 1 (median of half round trips)."""
    times = collectives.ping_pong(comm, max(nbytes // 4, 1) * 4, repeats)
    return comm.bcast(statistics.median(times) if rank == 0 else None)


def round_trip_python(repeats):
    """One round of our state machine between ranks 0 and 1: Isend + Irecv of 8 bytes, Waitall."""
    send, got = np.zeros(2, np.float32), np.zeros(2, np.float32)
    times = []
    for _ in range(repeats + 1):
        comm.Barrier()
        t0 = time.perf_counter()
        if rank < 2:
            msgs = Messages(comm, tag=1)
            MPI.Request.Waitall([msgs.send(send, 1 - rank), msgs.recv(got, 1 - rank)])
            msgs.land()
        times.append(time.perf_counter() - t0)
    return comm.bcast(statistics.median(times[1:]) if rank == 0 else None)


def call_overhead(repeats):
    """Fixed cost of one call of ours: a ring allreduce on a 1-rank communicator sends nothing."""
    buf = np.zeros(1, np.float32)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        allreduce(buf, MPI.COMM_SELF, "ring")
        times.append(time.perf_counter() - t0)
    return comm.bcast(statistics.median(times) if rank == 0 else None)


def machine_constants():
    """alpha_mpi, beta, gamma, alpha_round, c0 (seconds, seconds per byte)."""
    c0 = call_overhead(200)
    if p == 1:
        return 0.0, 0.0, 0.0, 0.0, c0
    alpha = ping_pong(8, 50)
    big, bigger = 4 * MIB, 16 * MIB
    t_big, t_bigger = ping_pong(big, 5), ping_pong(bigger, 3)
    beta = max((t_bigger - t_big) / (bigger - big), 0.0)
    a, b = np.ones(4 * MIB, np.float32), np.ones(4 * MIB, np.float32)
    reps = []
    for _ in range(5):
        t0 = time.perf_counter()
        a += b
        reps.append(time.perf_counter() - t0)
    gamma = comm.bcast(statistics.median(reps) / a.nbytes)
    return alpha, beta, gamma, round_trip_python(50), c0


# ---------------------------------------------------------------- part 1

def time_allreduce(name, nbytes, repeats):
    x = np.random.default_rng(rank).standard_normal(max(nbytes // 4, 0)).astype(np.float32)
    work = np.empty_like(x)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        work[...] = x
        comm.Barrier()
        t0 = time.perf_counter()
        if name == "MPI Allreduce":
            comm.Allreduce(MPI.IN_PLACE, work)
        elif name == "native Iallreduce":
            start_allreduce(work, comm, "native").wait()
        else:
            allreduce(work, comm, name, **OPTIONS.get(name, {}))
        times.append(time.perf_counter() - t0)
    return float(np.median(slowest(times[1:])))


def part1(alpha, beta, gamma, alpha_round, c0):
    sizes, n = [], 4
    while n <= MAX_BYTES:
        sizes.append(n)
        n *= 16 if args.quick else 4
    names = ["MPI Allreduce", "native Iallreduce"] + list(ALGORITHMS)
    rows = []
    say(f"\n== Part 1: allreduce of float32 buffers on {p} ranks "
        f"(median of {REPEATS} repeats, slowest rank)\nmodel: alpha_mpi={alpha * 1e6:.2f} us, "
        f"beta={beta * 1e9:.4f} ns/B ({1 / beta / 1e9 if beta else float('inf'):.2f} GB/s), "
        f"gamma={gamma * 1e9:.4f} ns/B, alpha_round={alpha_round * 1e6:.2f} us, c0={c0 * 1e6:.2f} us")
    say(f"{'size':>9} {'algorithm':>19} {'time':>10} {'busbw GB/s':>10} {'/native':>8} "
        f"{'predicted':>10} {'pred/meas':>9}")
    for nbytes in sizes:
        repeats = max(3, min(REPEATS, int(REPEATS * 4 * MIB / nbytes))) if nbytes > 4 * MIB else REPEATS
        native_t = None
        for name in names:
            t = time_allreduce(name, nbytes, repeats)
            if name in ("MPI Allreduce", "native Iallreduce", "native"):
                pred = predicted_time("native", nbytes, p, alpha, beta, gamma)
            else:
                pred = c0 + predicted_time(name, nbytes, p, alpha_round, beta, gamma, **OPTIONS.get(name, {}))
            native_t = t if native_t is None else native_t
            busbw = 2 * (p - 1) / p * nbytes / t / 1e9 if p > 1 else float("nan")
            row = dict(bytes=nbytes, algorithm=name, time_s=t, busbw_GBps=busbw, ratio_to_native=t / native_t,
                       predicted_s=pred, predicted_over_measured=pred / t if t > 0 else float("nan"))
            rows.append(row)
            say(f"{human(nbytes):>9} {name:>19} {t * 1e6:>8.1f}us {busbw:>10.3f} {t / native_t:>8.2f} "
                f"{pred * 1e6:>8.1f}us {row['predicted_over_measured']:>9.2f}")
    return rows


# ---------------------------------------------------------------- part 2

def small_cosmoflow(rng):
    """CosmoFlow's shape in miniature: conv-pool blocks, then a heavy dense head."""
    from refimpl.nn.activation import LeakyReLU
    from refimpl.nn.conv import Conv3d
    from refimpl.nn.linear import Flatten, Linear
    from refimpl.nn.module import Sequential
    from refimpl.nn.pooling import MaxPool3d
    layers, c = [], 4
    for out in (16, 32, 64):
        layers += [Conv3d(c, out, 3, padding=1, rng=rng), LeakyReLU(), MaxPool3d(2)]
        c = out
    layers += [Flatten(), Linear(c * 4 * 4 * 4, 1024, rng=rng), LeakyReLU(),
               Linear(1024, 1024, rng=rng), LeakyReLU(), Linear(1024, 4, rng=rng)]
    return Sequential(*layers)


def part2():
    model = small_cosmoflow(np.random.default_rng(0))
    params = model.parameters()
    x = np.random.default_rng(rank).standard_normal((2, 4, 32, 32, 32)).astype(np.float32)
    y = model(x)
    dy = np.ones_like(y) / y.size
    grad_bytes = sum(q.data.nbytes for q in params)
    repeats = 5 if args.quick else 11

    configs = [("no overlap, one bucket", False, 1 << 40, 1 << 40, "native"),
               ("no overlap, 256 KiB buckets", False, 256 << 10, 64 << 10, "native"),
               ("overlap, one bucket", True, 1 << 40, 1 << 40, "native"),
               ("overlap, default buckets (25 MiB / 1 MiB)", True, 25 * MIB, MIB, "native"),
               ("overlap, 256 KiB buckets (first 64 KiB)", True, 256 << 10, 64 << 10, "native"),
               ("overlap, one bucket per param", True, 0, 0, "native"),
               ("overlap, 256 KiB buckets, ring", True, 256 << 10, 64 << 10, "ring")]

    def step(label, sync, comm_only=False):
        """Seconds of backward (+ finish); with comm_only, of finish alone after a barrier."""
        if sync is None or comm_only:
            alone.detach()  # no hooks: plain backward
        else:
            sync.attach()
        model.zero_grad()
        model(x)
        comm.Barrier()
        t0 = time.perf_counter()
        model.backward(dy)
        if comm_only:  # finish() starts every bucket itself
            comm.Barrier()
            t0 = time.perf_counter()
        if sync is not None:
            sync.finish()
        times.setdefault(label, []).append(time.perf_counter() - t0)

    syncs = {label: GradientSynchronizer(params, comm, bucket_bytes=b, first_bucket_bytes=f, overlap=o,
                                         algorithm=a) for label, o, b, f, a in configs}
    alone = GradientSynchronizer(params, comm, bucket_bytes=1 << 40, first_bucket_bytes=1 << 40, overlap=False)
    times = {}
    for _ in range(repeats + 1):
        step("backward", None)
        step("allreduce", alone, comm_only=True)
        for label, sync in syncs.items():
            step(label, sync)
    best = {label: float(np.min(slowest(t[1:]))) for label, t in times.items()}
    t_bwd, t_comm = best["backward"], best["allreduce"]
    say(f"\n== Part 2: one training step, small CosmoFlow-shaped CNN on {p} ranks "
        f"({len(params)} params, {human(grad_bytes)} of float32 gradients, local batch 2 x 4 x 32^3; "
        f"best of {repeats}, round-robin)")
    say(f"backward alone T_bwd = {t_bwd * 1e3:.1f} ms; gradient allreduce alone T_comm = {t_comm * 1e3:.1f} ms "
        f"(finish(): copy in, native Iallreduce, average out; one bucket)")
    say(f"{'configuration':>42} {'buckets':>7} {'step':>9} {'wait':>9} {'hidden':>7}")
    rows = []
    for label, overlap, bucket_bytes, first, algorithm in configs:
        sync, t = syncs[label], best[label]
        wait = float(np.min(slowest([r["wait_s"] for r in sync.history[1:]])))
        hidden = (t_bwd + t_comm - t) / t_comm if t_comm > 0 else float("nan")
        rows.append(dict(configuration=label, algorithm=algorithm, overlap=overlap, bucket_bytes=bucket_bytes,
                         first_bucket_bytes=first, buckets=len(sync.buckets), step_s=t, wait_s=wait,
                         hidden_share=hidden))
        say(f"{label:>42} {len(sync.buckets):>7} {t * 1e3:>7.1f}ms {wait * 1e3:>7.1f}ms {hidden:>7.2f}")
    return dict(backward_s=t_bwd, allreduce_s=t_comm, gradient_bytes=grad_bytes, configurations=rows)


# ---------------------------------------------------------------- part 3

PRIORITY_CONFIGS = [("plain (none)", "none", 0), ("none, 256 KiB chunks", "none", MIB // 4),
                    ("input-first, 256 KiB chunks", "input-first", MIB // 4)]
ROUND = 3           # consecutive steps of one configuration: the gaps inside a round are its own


def part3():
    from refimpl.models import build_model
    from refimpl.models.presets import PRESETS
    from refimpl.optim import make_optimizer
    from refimpl.parallel.grid import ProcessGrid
    from refimpl.parallel.priority import LayerwiseUpdate

    steps = args.steps or (5 if args.quick else 12)
    grid = ProcessGrid(comm, (p, 1, 1, 1))
    config = dict(PRESETS["cosmoflow"]["small"], dropout=0.0)
    batch = args.local_batch * p
    rng = np.random.default_rng(rank)
    runs = {}
    for label, priority, chunk in PRIORITY_CONFIGS:
        model = build_model("cosmoflow", config, grid, seed=0, dtype=np.float32, global_batch=batch)
        sync = GradientSynchronizer(model.parameters(), grid.data_comm, grid.spatial_comm, priority=priority,
                                    bucket_bytes=MIB, first_bucket_bytes=MIB, chunk_bytes=chunk, trace=True)
        opt = make_optimizer("adam", model.parameters(), lr=1e-4)
        runs[label] = (model, sync, LayerwiseUpdate(model, sync, opt), [], [])
    x = rng.standard_normal((args.local_batch,) + tuple(config["input_shape"])).astype(np.float32)
    y = rng.uniform(-1, 1, (args.local_batch, runs[PRIORITY_CONFIGS[0][0]][0].num_outputs)).astype(np.float32)

    def one_step(model, update):
        model.zero_grad()
        _, dout, _ = model.loss(model.forward(x), y)
        model.backward(dout)
        update.step(1e-4)

    rounds = -(-steps // (ROUND - 1)) + 1         # the first round warms up
    for number in range(rounds):
        for label, (model, sync, update, times, gaps) in runs.items():
            comm.Barrier()
            seen = len(update.marks)
            for _ in range(ROUND):
                t0 = time.perf_counter()
                one_step(model, update)
                times.append(time.perf_counter() - t0)
            if number:                            # the round's first mark closes the last round
                gaps += update.gaps[seen + 1:]
    rows, trace = [], []
    for label, (model, sync, update, times, gaps) in runs.items():
        update.flush()
        gaps = slowest(gaps)
        step_s = slowest(times[ROUND:])
        first = sync.buckets[-1]
        rows.append(dict(configuration=label, buckets=len(sync.buckets),
                         chunks=sum(len(b.chunks) for b in sync.buckets), input_bucket_bytes=first.nbytes,
                         gap_s=float(np.median(gaps)), step_s=float(np.median(step_s))))
        for (end, start), number in zip(update.marks, range(1, len(update.marks) + 1)):
            trace.append({"configuration": label, "rank": rank, "step": number, "event": "step",
                          "backward_end": end, "first_layer_start": start})
        trace += [dict(r, configuration=label, rank=rank, event="chunk") for r in sync.trace]
        sync.detach()
    grid.free()
    base = rows[0]
    say(f"\n== Part 3: priorities, CosmoFlow small on grid ({p},1,1,1), local batch {args.local_batch}, "
        f"float32, Adam; median of {steps} steps (slowest rank), round-robin")
    say(f"{'configuration':>28} {'buckets':>7} {'chunks':>6} {'bwd->next fwd':>14} {'vs plain':>8} "
        f"{'step':>9} {'vs plain':>8}")
    for row in rows:
        say(f"{row['configuration']:>28} {row['buckets']:>7} {row['chunks']:>6} {row['gap_s'] * 1e3:>12.1f}ms "
            f"{row['gap_s'] / base['gap_s']:>8.2f} {row['step_s'] * 1e3:>7.0f}ms {row['step_s'] / base['step_s']:>8.3f}")
    everything = comm.gather(trace, root=0)
    if rank == 0:
        everything = [r for part in everything for r in part]
        if args.trace:
            with open(args.trace, "w") as f:
                for record in everything:
                    f.write(json.dumps(record) + "\n")
            print(f"wrote {args.trace} ({len(everything)} records)")
        if args.timeline:
            draw_timeline(everything, args.timeline)
            print(f"wrote {args.timeline}")
    return dict(model="cosmoflow small", local_batch=args.local_batch, steps=steps, configurations=rows)


def draw_timeline(records, path):
    """Rank 0's last step of each configuration: a bar per chunk (bucket on the y axis), times
    from the end of backward; the dashed line is where the next forward's first layer started."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [label for label, _, _ in PRIORITY_CONFIGS]
    fig, axes = plt.subplots(len(labels), 1, figsize=(9, 2.2 * len(labels)), sharex=True)
    for ax, label in zip(axes, labels):
        mine = [r for r in records if r["configuration"] == label and r["rank"] == 0]
        last = max(r["step"] for r in mine if r["event"] == "step")
        mark = next(r for r in mine if r["event"] == "step" and r["step"] == last)
        chunks = [r for r in mine if r["event"] == "chunk" and r["step"] == last]
        t0 = mark["backward_end"]
        buckets = max(r["bucket"] for r in chunks) + 1
        for r in chunks:
            ax.barh(r["bucket"], (r["finish"] - r["start"]) * 1e3, left=(r["start"] - t0) * 1e3, height=0.7,
                    color=plt.cm.viridis(r["bucket"] / max(buckets - 1, 1)), edgecolor="k", lw=0.3)
        ax.axvline(0, color="k", lw=1)
        ax.axvline((mark["first_layer_start"] - t0) * 1e3, color="r", ls="--", lw=1.2)
        ax.set_ylabel("bucket")
        ax.set_yticks(range(buckets))
        ax.set_title(f"{label}: next forward starts {1e3 * (mark['first_layer_start'] - t0):.1f} ms "
                     "after backward", fontsize=9)
    axes[-1].set_xlabel("ms from the end of backward (black line); bars: a chunk's allreduce from its start "
                        "to when it was seen finished;\nbucket 0 = output side (ready first), the last = input side; "
                        "red: the next forward's first layer starts")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main():
    result = dict(ranks=p, options=OPTIONS)
    if 1 in PARTS:
        alpha, beta, gamma, alpha_round, c0 = machine_constants()
        result.update(alpha_mpi_s=alpha, beta_s_per_byte=beta, gamma_s_per_byte=gamma,
                      alpha_round_s=alpha_round, call_overhead_s=c0,
                      allreduce=part1(alpha, beta, gamma, alpha_round, c0))
    if 2 in PARTS:
        result["training_step"] = part2()
    if 3 in PARTS:
        result["priorities"] = part3()
    if args.json and rank == 0:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
