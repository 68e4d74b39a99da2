#!/usr/bin/env python
"""Training throughput: refimpl on process grids vs. the same CosmoFlow / 3D U-Net in PyTorch (CPU, DDP).

One training step is what ``refimpl train`` does per batch: forward, loss,
backward with the bucketed gradient allreduce (``GradientSynchronizer``), SGD
with momentum 0.9.  The data are synthetic and in memory (one fixed global
batch drawn once, each rank holding its block), so the numbers are compute +
communication, not I/O.  float32; ``--warmup`` untimed steps, then ``--steps``
timed steps.  Measured per run:

- samples/s = global batch x timed steps / the slowest rank's timed wall time;
- step s, cpu s: the slowest rank's wall time per step and its CPU time
  (on a shared machine the wall time includes time spent descheduled);
- numpy peak: tracemalloc's peak of the bytes NumPy held during the first
  warm-up step (parameters, optimiser state, the local batch, activations and
  temporaries), the largest over the ranks; ru_maxrss: the process's peak
  resident set (interpreter, MPI / torch libraries included), largest rank.

Baseline: the same network written with torch.nn, torch.optim.SGD momentum 0.9,
same layer sizes (the driver checks that both count the same parameters before
timing anything), same global batch, same threads per process
(torch.set_num_threads): 1 process, and DistributedDataParallel over gloo with 2
processes (init_method tcp://127.0.0.1:<free port>, one subprocess per rank).

- CosmoFlow: Conv3d / LeakyReLU(0.3) / MaxPool3d blocks, Linear / LeakyReLU /
  Dropout, 1.2 tanh, MSELoss;
- 3D U-Net: [Conv3d k3 p1 no bias / BatchNorm3d / ReLU] x 2 per level, MaxPool3d 2,
  ConvTranspose3d k2 s2, concatenation (upsampled, skip), Conv3d k1 logits,
  CrossEntropyLoss (refimpl's loss "ce": the mean over every voxel of the global
  batch).  Batch norm: refimpl normalises with the statistics of the global batch
  (allreduced over the grid); DDP's BatchNorm3d uses each process's own samples
  (torch's SyncBatchNorm needs a GPU), so DDP-2 skips those small allreduces.

ratio = refimpl samples/s / torch samples/s for matching configs, per model:
1 rank (1,1,1,1) vs 1 process (same threads), (2,1,1,1) vs DDP-2.  torch is
optional: n/a without it.  tracemalloc does not see torch's allocator: torch rows
report ru_maxrss only.

Rounds (``--rounds R``): every run R times, interleaved -- round 1 in the plan's order,
round 2 in reverse, and so on -- so that a machine drifting faster or slower between runs
weighs on both sides of a ratio; each row carries the 1-minute load average at its start,
and a second table gives every ratio per round (with the refimpl and torch runs' load
averages beside it), their median and range.

Threads: one BLAS thread per process when P > 1 (OMP/OPENBLAS/MKL_NUM_THREADS=1);
the 1-rank grid runs with 1 thread and, for a fair comparison with 2 ranks on a
2-core machine, with ``cores`` threads too.  Grids with more ranks than cores
oversubscribe: the ranks time-share the cores (marked in the table).

On a GPU (``--device cuda``, issue 39): refimpl on CuPy against the same torch.nn twin on
the same GPU, same batch, every step synchronised (``backend.synchronize``,
``torch.cuda.synchronize``) after the warm-up; every rank on its node's GPU (one GPU: the
2-rank runs share it), DDP over NCCL where each rank has a GPU of its own, else gloo.
Like for like: full float32 on both sides by default (refimpl/precision.py's policy;
``allow_tf32 = False`` for cuDNN and cuBLAS), ``--tf32 on`` for TF32 on both sides: run once
per setting for the two columns.  Sizes: without ``--quick``, ``--device cuda`` defaults to
CosmoFlow's ``mlperf`` preset (MLPerf's network: 128^3, conv_size 32 x 5 blocks, kernel 2,
fc 128/64) and the U-Net's ``default`` preset (128^3, base_width 32, 3 levels; loss "ce", as
everywhere here), global batch 4, 2 warm-up + 10 timed steps, grids 1,1,1,1 2,1,1,1, and no
extra threads run (BLAS threads do not matter to GPU steps); any size flag overrides its
default.  ``--device strict`` runs refimpl on the host stand-in of a device array (CI) at the
CPU sizes.

    python scripts/bench_train.py [--grids 1,1,1,1 2,1,1,1 1,2,1,1 2,2,1,1 1,2,2,1]
                                  [--model cosmoflow,unet3d] [--quick] [--json FILE]
                                  [--device cpu|cuda|strict] [--tf32 off|on] [--kernel 2|3]
                                  [--rounds R]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MODELS = ("cosmoflow", "unet3d")
DEFAULT_GRIDS = ("1,1,1,1", "2,1,1,1", "1,2,1,1", "2,2,1,1", "1,2,2,1")
# size: D=H=W; width: CosmoFlow conv_size / U-Net base_width; layers: conv blocks / U-Net levels
DEFAULT = dict(size=64, width=16, layers=4, unet_width=4, unet_layers=2, fc1=128, fc2=64,
               batch=4, warmup=1, steps=3)
QUICK = dict(size=16, width=4, layers=2, unet_width=4, unet_layers=2, fc1=32, fc2=16,
             batch=2, warmup=1, steps=2)
DEFAULT_KERNEL = 3          # CosmoFlow's conv kernel on the CPU sizes (--quick and the default)
GPU_GRIDS = ("1,1,1,1", "2,1,1,1")

LR, MOMENTUM = 1e-3, 0.9
ROOT_ENV = dict(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def gpu_sizes() -> dict:
    """``--device cuda``'s defaults (without --quick): CosmoFlow's ``mlperf`` preset and the
    U-Net's ``default`` preset (refimpl/models/presets.py), batch 4, 2 warm-up + 10 timed steps."""
    from refimpl.models.presets import PRESETS
    cosmo, unet = PRESETS["cosmoflow"]["mlperf"], PRESETS["unet3d"]["default"]
    assert cosmo["input_shape"][1:] == unet["input_shape"][1:], "one --size for both models"
    return dict(size=cosmo["input_shape"][1], width=cosmo["conv_size"], layers=cosmo["n_conv_layers"],
                kernel=cosmo["kernel_size"], unet_width=unet["base_width"], unet_layers=unet["levels"],
                fc1=cosmo["fc1_size"], fc2=cosmo["fc2_size"], batch=4, warmup=2, steps=10)


def blas_env(threads: int) -> dict:
    n = str(threads)
    return dict(OMP_NUM_THREADS=n, OPENBLAS_NUM_THREADS=n, MKL_NUM_THREADS=n)


def cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def model_config(args, name: str) -> dict:
    if name == "cosmoflow":
        return {"input_shape": (4,) + (args.size,) * 3, "conv_size": args.width, "kernel_size": args.kernel,
                "n_conv_layers": args.layers, "fc1_size": args.fc1, "fc2_size": args.fc2, "dropout": 0.5}
    return {"input_shape": (1,) + (args.size,) * 3, "levels": args.unet_layers,
            "base_width": args.unet_width, "num_classes": 3, "loss": "ce"}


def synthetic_batch(name: str, config: dict, batch: int, seed: int):
    """One fixed global batch: inputs N(0, 1); CosmoFlow targets U(-1, 1)^4, U-Net labels in [0, 3)."""
    import numpy
    rng = numpy.random.default_rng(seed)
    x = rng.standard_normal((batch,) + tuple(config["input_shape"]), dtype=numpy.float32)  # (B, C, S, S, S)
    if name == "cosmoflow":
        y = rng.uniform(-1, 1, (batch, 4)).astype(numpy.float32)                           # (B, 4)
    else:
        y = rng.integers(0, config["num_classes"], (batch,) + tuple(config["input_shape"][1:]))  # (B, S, S, S)
    return x, y


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---------------------------------------------------------------------------- refimpl worker (under mpiexec)

def refimpl_worker(args) -> dict | None:
    """Collective over COMM_WORLD; the report on rank 0 (None elsewhere)."""
    import numpy
    from mpi4py import MPI

    from refimpl.backend import tune_allocator
    from refimpl.models import build_model
    from refimpl.optim import SGD
    from refimpl.parallel.grad_sync import GradientSynchronizer
    from refimpl.parallel.grid import ProcessGrid, parse_grid

    from refimpl import backend
    tune_allocator()                       # as `refimpl train` does (and the torch workers)
    if args.device != "cpu":               # every rank on its node's GPU (one GPU: all on device 0)
        backend.set_backend("cupy" if args.device == "cuda" else "strict")
    comm = MPI.COMM_WORLD
    dims = parse_grid(args.grid)
    grid = ProcessGrid(comm, dims)          # raises on every rank if dims do not match the size
    name = args.models[0]
    config = model_config(args, name)
    tracemalloc.start()
    model = build_model(name, config, grid, seed=args.seed, dtype="float32", global_batch=args.batch)
    x_global, y_global = synthetic_batch(name, config, args.batch, args.seed + 1)
    x = backend.asarray(numpy.ascontiguousarray(model.local_input(x_global)))   # (B/Pn, C, local block)
    y = backend.asarray(numpy.ascontiguousarray(model.local_target(y_global)))
    del x_global, y_global
    sync = GradientSynchronizer(model.parameters(), grid.data_comm, grid.spatial_comm)
    optimizer = SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    model.train()

    def step():
        model.zero_grad()
        loss, dout, _ = model.loss(model.forward(x), y)
        model.backward(dout)
        sync.finish()
        optimizer.step()
        backend.synchronize()                  # a device's queued kernels belong to this step's time
        return loss

    comm.Barrier()
    tracemalloc.reset_peak()
    loss = step()                                     # warm-up 1, traced
    numpy_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    for _ in range(args.warmup - 1):
        step()
    if args.watchdog_rounds:
        return watchdog_cost(args, comm, step)
    comm.Barrier()
    t0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        loss = step()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    rows = comm.gather({"rank": comm.rank, "wall_s": wall, "cpu_s": cpu, "numpy_peak_bytes": numpy_peak,
                        "maxrss_bytes": peak_rss()}, root=0)
    if comm.rank != 0:
        return None
    slowest = max(r["wall_s"] for r in rows)
    return {"impl": "refimpl", "model": name, "grid": list(dims), "ranks": comm.size,
            "params": sum(int(p.data.size) for p in model.parameters()), "loss": float(backend.to_host(loss)),
            "samples_per_s": args.batch * args.steps / slowest, "step_s": slowest / args.steps,
            "cpu_s": max(r["cpu_s"] for r in rows) / args.steps,
            "numpy_peak_bytes": max(r["numpy_peak_bytes"] for r in rows),
            "maxrss_bytes": max(r["maxrss_bytes"] for r in rows), "per_rank": rows}


def watchdog_cost(args, comm, step) -> dict | None:
    """Step time with and without the fail-stop machinery (refimpl/failstop.py), interleaved.

    ``--watchdog-rounds`` rounds of ``--steps`` steps with what ``refimpl train`` runs
    beside the steps: the watchdog thread (stall timeout 600 s, the default: heartbeats
    every 5 s, the inbox polled every 0.2 s), the signal thread, and the run directory's
    lock held by rank 0 (``run_lock.RunLock``, refreshed by its own thread); and
    ``--steps`` without any of them, the order alternating so drifts of the machine hit
    both alike.  The phase marks (``progress.phase``) run in both: they are part of every step.
    """
    from refimpl.signals import handle_signals
    from refimpl.watchdog import DEFAULT_STALL_TIMEOUT, Watchdog
    from refimpl.run_lock import RunLock
    totals = {"on": 0.0, "off": 0.0}
    lock_dir = tempfile.mkdtemp() if comm.rank == 0 else None
    for r in range(args.watchdog_rounds):
        for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
            watchdog = signals = lock = None
            if mode == "on":
                watchdog = Watchdog(comm, "bench", DEFAULT_STALL_TIMEOUT).start()
                signals = handle_signals("bench")
                lock = RunLock(lock_dir).acquire() if comm.rank == 0 else None
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            comm.Barrier()
            totals[mode] += time.perf_counter() - t0
            if watchdog is not None:
                watchdog.stop()
                if signals is not None:
                    signals.close()
                if lock is not None:
                    lock.release()
    if lock_dir is not None:
        os.rmdir(lock_dir)
    if comm.rank != 0:
        return None
    n = args.watchdog_rounds * args.steps
    return {"impl": "watchdog", "model": args.models[0], "grid": [int(t) for t in args.grid.split(",")],
            "ranks": comm.size, "steps": n, "step_s_off": totals["off"] / n, "step_s_on": totals["on"] / n,
            "overhead": totals["on"] / totals["off"] - 1.0}


def watchdog_driver(args) -> int:
    """``--watchdog``: the watchdog's cost per step, for each model and grid (ratio from one run)."""
    load_start = os.getloadavg()
    print(f"# bench_train --watchdog: {args.watchdog_rounds} rounds x {args.steps} steps with and without "
          f"the watchdog, interleaved; {args.size}^3; global batch {args.batch}; load average "
          f"{' '.join(f'{v:.2f}' for v in load_start)}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            for grid in args.grids:
                rows.append(launch_refimpl(args, model, grid, 1, tmp))
    print(f"{'model':>9} {'grid':>9} {'P':>2} {'steps':>5} {'step s off':>10} {'step s on':>9} {'cost':>7}")
    for r in rows:
        print(f"{r['model']:>9} {','.join(map(str, r['grid'])):>9} {r['ranks']:>2} {r['steps']:>5} "
              f"{r['step_s_off']:10.4f} {r['step_s_on']:9.4f} {100 * r['overhead']:6.2f}%")
    print(f"# cost = step time with the watchdog / without - 1 (negative: below the noise); load average at "
          f"the end {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"watchdog": rows, "load_average": {"start": list(load_start),
                                                          "end": list(os.getloadavg())}}, fh, indent=1)
    return 0


# ---------------------------------------------------------------------------- torch worker (one process per rank)

def torch_model(name: str, config: dict):
    """(network, loss) of the torch baseline: refimpl's PyTorch twin of ``name``
    (refimpl/oracle/model_twins.py: the same layers and names) and the same loss."""
    from torch import nn
    from refimpl.models import CHECK_CONFIG
    from refimpl.oracle.model_twins import torch_model as twin
    net = twin(name, CHECK_CONFIG[name](config))
    return net, (nn.MSELoss() if name == "cosmoflow" else nn.CrossEntropyLoss())   # U-Net: loss "ce", no class weights


#: --torch-layout: the memory layout of the torch baseline's 5-D activations and conv weights
TORCH_LAYOUTS = ("ncdhw", "channels_last")


def torch_layout(net, x, layout: str):
    """(net, x) in ``layout``: "ncdhw" as built; "channels_last" converts the network and the
    5-D input to ``torch.channels_last_3d``.  Why: on some CPUs oneDNN's NCDHW weight gradient
    of a narrow conv (CosmoFlow's 4 -> 16 at 64^3) is 50x slower than its channels-last one
    (docs/benchmarks.md), so the default layout alone would flatter refimpl."""
    import torch
    if layout == "channels_last" and x.dim() == 5:
        return net.to(memory_format=torch.channels_last_3d), x.contiguous(memory_format=torch.channels_last_3d)
    return net, x


def torch_worker(args) -> dict:
    import torch

    from refimpl.backend import tune_allocator
    tune_allocator()                       # the same malloc settings as the refimpl workers
    torch.set_num_threads(args.threads)
    world, rank = args.world, args.rank
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    if device.type == "cuda":                 # like for like: TF32 exactly as refimpl's (--tf32)
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = args.tf32 == "on"
        torch.cuda.set_device(rank % torch.cuda.device_count())
    ddp = ddp_backend(args.device, world)
    if world > 1:
        import torch.distributed as dist
        dist.init_process_group(ddp, init_method=f"tcp://127.0.0.1:{args.port}", rank=rank,
                                world_size=world)
    torch.manual_seed(args.seed)
    name = args.models[0]
    config = model_config(args, name)
    model, loss_fn = torch_model(name, config)
    x_global, y_global = synthetic_batch(name, config, args.batch, args.seed + 1)
    n = args.batch // world
    x = torch.from_numpy(x_global[rank * n:(rank + 1) * n].copy())      # (B/world, C, S, S, S)
    y = torch.from_numpy(y_global[rank * n:(rank + 1) * n].copy())      # (B/world, 4) or (B/world, S, S, S)
    model, x = torch_layout(model.to(device), x.to(device), args.torch_layout)   # before DDP registers them
    y = y.to(device)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[torch.cuda.current_device()] if device.type == "cuda" else None)
    del x_global, y_global
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    model.train()

    def step():
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()                 # DDP: bucketed gloo allreduce overlapped with backward
        optimizer.step()
        return loss.item()

    for _ in range(args.warmup):
        step()
    if world > 1:
        dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        loss = step()                   # loss.item() waits for the step's kernels
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    if world > 1:
        wall = _max_over_ranks(dist, wall)
        dist.destroy_process_group()
    return {"impl": "torch", "model": name, "world": world, "rank": rank, "loss": loss, "ddp": ddp,
            "params": sum(p.numel() for p in model.parameters()), "wall_s": wall, "cpu_s": cpu,
            "maxrss_bytes": peak_rss(), "torch": torch.__version__}


def ddp_backend(device: str, world: int) -> str:
    """torch.distributed's backend for DDP: NCCL on GPUs when every rank has a GPU of its own
    (NCCL refuses two ranks on one device), else gloo (which also reduces CUDA tensors)."""
    if device != "cuda":
        return "gloo"
    import torch
    import torch.distributed as dist
    return "nccl" if dist.is_nccl_available() and torch.cuda.device_count() >= world else "gloo"


def _max_over_ranks(dist, value: float) -> float:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return max(out)


# ---------------------------------------------------------------------------- driver

def size_args(args) -> list:
    return ["--size", str(args.size), "--width", str(args.width), "--layers", str(args.layers),
            "--unet-width", str(args.unet_width), "--unet-layers", str(args.unet_layers),
            "--fc1", str(args.fc1), "--fc2", str(args.fc2), "--batch", str(args.batch),
            "--warmup", str(args.warmup), "--steps", str(args.steps), "--seed", str(args.seed),
            "--watchdog-rounds", str(args.watchdog_rounds), "--device", args.device, "--tf32", args.tf32,
            "--kernel", str(args.kernel)]


def tf32_env(args) -> dict:
    """The launched runs' precision switches (refimpl/precision.py): full float32 unless
    ``--tf32 on`` (then TF32 for refimpl's CuPy GEMMs and, in the worker, for cuDNN/cuBLAS)."""
    if args.tf32 == "on":
        return dict(REFIMPL_TF32="1", CUPY_TF32="1")
    return dict(REFIMPL_TF32="0", CUPY_TF32="0", NVIDIA_TF32_OVERRIDE="0")


def set_tf32_env(env, args):
    """``env`` (a dict, or ``os.environ`` before CuPy is imported) given ``tf32_env``'s switches;
    with ``--tf32 on`` an inherited ``NVIDIA_TF32_OVERRIDE`` is dropped (it would keep TF32 off)."""
    env.update(tf32_env(args))
    if args.tf32 == "on":
        env.pop("NVIDIA_TF32_OVERRIDE", None)
    return env


def launch_env(args, threads) -> dict:
    return set_tf32_env(dict(os.environ, **blas_env(threads)), args)


def param_counts(args, name: str) -> tuple:
    """(refimpl, torch) parameter counts of ``name`` at the benchmark's sizes (nothing runs)."""
    from refimpl.models import build_model
    config = model_config(args, name)
    net, _ = torch_model(name, config)
    return (sum(int(p.data.size) for p in build_model(name, config, seed=args.seed).parameters()),
            sum(p.numel() for p in net.parameters()))


def run_checked(cmd, env, timeout, what):
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"bench_train: {what} failed (rc={proc.returncode})\n"
                         f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")


def launch_refimpl(args, model, grid, threads, tmp) -> dict:
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        raise SystemExit("bench_train: mpiexec not found (pip install 'refimpl[mpi]')")
    dims = [int(t) for t in grid.split(",")]
    p = dims[0] * dims[1] * dims[2] * dims[3]
    out = os.path.join(tmp, f"{model}_{grid.replace(',', '')}_{threads}.json")
    cmd = [mpiexec, "--oversubscribe", "-n", str(p), sys.executable, os.path.abspath(__file__),
           "--worker", "refimpl", "--model", model, "--grid", grid, "--json", out] + size_args(args)
    t0 = time.perf_counter()
    run_checked(cmd, dict(launch_env(args, threads), **ROOT_ENV), args.timeout,
                f"mpiexec -n {p} {model} grid {grid}")
    with open(out) as fh:
        report = json.load(fh)
    if report["impl"] == "watchdog":
        return report
    report.update(threads=threads, oversubscribed=p * threads > cpu_cores(), wall_total_s=time.perf_counter() - t0)
    return report


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_torch(args, model, world, threads, tmp) -> dict:
    port, outs, procs = free_port(), [], []
    env = launch_env(args, threads)
    t0 = time.perf_counter()
    for rank in range(world):
        outs.append(os.path.join(tmp, f"torch_{model}_{world}_{threads}_{rank}.json"))
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "torch", "--model", model,
               "--world", str(world), "--rank", str(rank), "--port", str(port), "--threads", str(threads),
               "--json", outs[-1], "--torch-layout", args.torch_layout] + size_args(args)
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for rank, proc in enumerate(procs):
        stdout, stderr = proc.communicate(timeout=args.timeout)
        if proc.returncode != 0:
            for other in procs:
                if other.poll() is None:
                    other.kill()
            raise SystemExit(f"bench_train: torch {model} rank {rank}/{world} failed (rc={proc.returncode})\n"
                             f"{stdout[-4000:]}\n{stderr[-4000:]}")
    rows = [json.load(open(path)) for path in outs]
    slowest = max(r["wall_s"] for r in rows)
    return {"impl": "torch", "model": model, "grid": None, "ranks": world, "threads": threads,
            "label": "1 process" if world == 1 else f"DDP {rows[0]['ddp']} x{world}", "params": rows[0]["params"],
            "loss": rows[0]["loss"], "samples_per_s": args.batch * args.steps / slowest,
            "step_s": slowest / args.steps, "cpu_s": max(r["cpu_s"] for r in rows) / args.steps,
            "numpy_peak_bytes": None, "maxrss_bytes": max(r["maxrss_bytes"] for r in rows),
            "oversubscribed": world * threads > cpu_cores(), "torch": rows[0]["torch"],
            "per_rank": rows, "wall_total_s": time.perf_counter() - t0}


def torch_available() -> bool:
    try:
        import importlib.util
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


def add_ratios(reports) -> None:
    """ratio = refimpl samples/s / torch samples/s of the same model: 1 rank vs 1 process (same threads),
    (2,1,1,1) vs DDP-2."""
    torch_rows = {(r["model"], r["ranks"], r["threads"]): r for r in reports if r["impl"] == "torch"}
    for r in reports:
        r["ratio_vs_torch"] = None
        key = (r["model"], r["ranks"], r["threads"])
        if r["impl"] == "refimpl" and r["grid"] in ([1, 1, 1, 1], [2, 1, 1, 1]) and key in torch_rows:
            match = torch_rows[key]
            r["ratio_vs_torch"] = r["samples_per_s"] / match["samples_per_s"]
            r["torch_match"], r["torch_load_1min"] = match["label"], match.get("load_1min")


def mib(nbytes) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2**20:.1f}"


def config_label(r) -> str:
    return ",".join(map(str, r["grid"])) if r["grid"] else r["label"]


def print_table(reports, models, torch_note, rounds=1) -> None:
    """One row per run, model by model and round by round; ``load``: the 1-minute load average
    when the run started."""
    head = (("round " if rounds > 1 else "") +
            f"{'impl':>7} {'model':>9} {'grid / config':>15} {'params':>10} {'P':>2} {'thr':>3} "
            f"{'samples/s':>9} {'step s':>7} {'cpu s':>6} {'numpy peak MiB':>14} {'maxrss MiB':>10} "
            f"{'refimpl/torch':>13} {'load':>5}  note")
    print(head)
    print("-" * len(head))
    for r in sorted(reports, key=lambda r: (models.index(r["model"]), r["round"], r["plan_index"])):
        ratio = f"{r['ratio_vs_torch']:.2f}" if r.get("ratio_vs_torch") is not None else ""
        note = "oversubscribed" if r["oversubscribed"] else ""
        print((f"{r['round']:>5} " if rounds > 1 else "") +
              f"{r['impl']:>7} {r['model']:>9} {config_label(r):>15} {r['params']:>10,} {r['ranks']:>2} "
              f"{r['threads']:>3} {r['samples_per_s']:9.2f} {r['step_s']:7.3f} {r['cpu_s']:6.2f} "
              f"{mib(r['numpy_peak_bytes']):>14} {mib(r['maxrss_bytes']):>10} {ratio:>13} "
              f"{r['load_1min']:5.2f}  {note}")
    if torch_note:
        for model in models:
            print(f"{'torch':>7} {model:>9} {'n/a':>15}  ({torch_note})")


def ratio_summary(reports) -> list:
    """Per model and matched config, refimpl/torch in every round with both runs' load averages
    beside it, and the median and range over the rounds."""
    rows = {}
    for r in reports:
        if r.get("ratio_vs_torch") is None:
            continue
        key = (r["model"], config_label(r), r["threads"], r["torch_match"])
        rows.setdefault(key, []).append({"round": r["round"], "ratio": r["ratio_vs_torch"],
                                         "load_refimpl": r["load_1min"], "load_torch": r["torch_load_1min"]})
    return [{"model": m, "config": c, "threads": t, "torch": tm, "rounds": rs,
             "median": statistics.median(x["ratio"] for x in rs), "min": min(x["ratio"] for x in rs),
             "max": max(x["ratio"] for x in rs)} for (m, c, t, tm), rs in rows.items()]


def print_ratio_summary(summary, rounds) -> None:
    print(f"\n## refimpl/torch per round (load averages when the refimpl / torch runs started)")
    head = f"{'model':>9} {'config':>9} {'vs torch':>12} {'thr':>3} " + " ".join(
        f"{f'round {i}':>17}" for i in range(1, rounds + 1)) + f" {'median':>6} {'min':>5} {'max':>5}"
    print(head)
    print("-" * len(head))
    for row in summary:
        cells = " ".join(f"{x['ratio']:5.2f} ({x['load_refimpl']:.1f}/{x['load_torch']:.1f})".rjust(17)
                         for x in row["rounds"])
        print(f"{row['model']:>9} {row['config']:>9} {row['torch']:>12} {row['threads']:>3} {cells} "
              f"{row['median']:6.2f} {row['min']:5.2f} {row['max']:5.2f}")


def driver(args) -> int:
    cores, load_start = cpu_cores(), os.getloadavg()
    use_torch = not args.no_torch and torch_available()
    torch_note = None if use_torch else ("--no-torch" if args.no_torch else "PyTorch not installed")
    print(f"# bench_train: models {' '.join(args.models)}, {args.size}^3, CosmoFlow conv_size {args.width} x "
          f"{args.layers} blocks, fc {args.fc1}/{args.fc2}; U-Net base_width {args.unet_width} x "
          f"{args.unet_layers} levels, cross-entropy; global batch {args.batch}; float32; synthetic in-memory "
          f"data; {args.warmup} warm-up + {args.steps} timed steps; torch layout {args.torch_layout}; {cores} cores; "
          f"load average {' '.join(f'{v:.2f}' for v in load_start)}", flush=True)
    gpu = gpu_name() if args.device == "cuda" else None
    ddp = ddp_backend(args.device, 2) if use_torch and "2,1,1,1" in args.grids else None
    print(f"# device {args.device}" + (f" ({gpu}; every rank on it: a 2-rank run shares one GPU when there is one)"
                                       if gpu else "") +
          f"; TF32 {args.tf32} on both sides" + ("" if args.device == "cuda" else " (no TF32 off a GPU)") +
          f"; CosmoFlow kernel {args.kernel}" + (f"; torch DDP backend {ddp}" if ddp else ""), flush=True)
    if use_torch:                  # the same network in both, or the ratios compare different work
        for model in args.models:
            ours, theirs = param_counts(args, model)
            if ours != theirs:
                raise SystemExit(f"bench_train: {model}: refimpl has {ours:,} parameters, the torch baseline "
                                 f"{theirs:,}: not the same network")
            print(f"# {model}: {ours:,} parameters in refimpl and in torch", flush=True)
    plan = []      # (what, run(tmp) -> report), model by model: refimpl grids, then the torch baseline
    for model in args.models:
        for grid in args.grids:
            p = ranks_of(grid)
            plan.append((f"refimpl {model} {grid} threads 1",
                         lambda tmp, m=model, g=grid: launch_refimpl(args, m, g, 1, tmp)))
            if p == 1 and cores > 1 and not args.no_threads_run and args.device != "cuda":
                plan.append((f"refimpl {model} {grid} threads {cores}",
                             lambda tmp, m=model, g=grid: launch_refimpl(args, m, g, cores, tmp)))
        if not use_torch:
            continue
        plan.append((f"torch {model} 1 process threads 1", lambda tmp, m=model: launch_torch(args, m, 1, 1, tmp)))
        if cores > 1 and not args.no_threads_run and args.device != "cuda":
            plan.append((f"torch {model} 1 process threads {cores}",
                         lambda tmp, m=model: launch_torch(args, m, 1, cores, tmp)))
        if "2,1,1,1" in args.grids:
            plan.append((f"torch {model} DDP-2 threads 1", lambda tmp, m=model: launch_torch(args, m, 2, 1, tmp)))
    reports = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_no in range(1, args.rounds + 1):
            # interleaved: every run once per round, the order reversed every other round, so that a
            # drift of the machine's speed falls on both sides of a ratio, not on whichever runs last
            order = list(enumerate(plan))
            for index, (what, run) in (order if round_no % 2 else order[::-1]):
                load = os.getloadavg()[0]
                report = run(tmp)
                report.update(round=round_no, load_1min=load, plan_index=index)
                reports.append(report)
                print(f"#   {'' if args.rounds == 1 else f'round {round_no}: '}{what}: "
                      f"{report['samples_per_s']:.2f} samples/s ({report['wall_total_s']:.0f} s, load "
                      f"{load:.2f})", flush=True)
    for round_no in range(1, args.rounds + 1):
        add_ratios([r for r in reports if r["round"] == round_no])
    print_table(reports, args.models, torch_note, args.rounds)
    summary = ratio_summary(reports) if args.rounds > 1 else []
    if summary:
        print_ratio_summary(summary, args.rounds)
    load_end = os.getloadavg()
    print(f"# params: trainable parameters; samples/s: global batch x timed steps / slowest rank's wall "
          f"time; thr: BLAS/torch threads per process; oversubscribed: processes x threads > {cores} cores "
          f"(they time-share the cores); numpy peak: tracemalloc peak in a step (torch: n/a); refimpl/torch: "
          f"samples/s ratio vs the torch run of the same model with the same processes and threads; load "
          f"average at the end "
          f"{' '.join(f'{v:.2f}' for v in load_end)} (above {cores}: other jobs share the cores)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"settings": {k: getattr(args, k) for k in
                                    ("models", "grids", "size", "width", "layers", "unet_width", "unet_layers",
                                     "fc1", "fc2", "batch", "warmup", "steps", "seed", "torch_layout",
                                     "device", "tf32", "kernel", "rounds")},
                       "gpu": gpu, "torch_ddp_backend": ddp, "cores": cores,
                       "load_average": {"start": list(load_start), "end": list(load_end)},
                       "torch": "ok" if use_torch else torch_note, "rows": reports,
                       "ratio_summary": summary}, fh, indent=1)
    return 0


def gpu_name() -> str:
    from refimpl import backend
    cupy = backend._cupy()
    return cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()


def device_missing(device: str, use_torch: bool = True) -> str | None:
    """Why ``--device`` cannot run here (checked before anything is launched), or None;
    ``use_torch``: the PyTorch baseline runs too (it needs a CUDA build of torch)."""
    if device != "cuda":
        return None
    from refimpl import settings
    reason = settings.cupy_unavailable()
    if reason:
        return f"--device cuda: {reason}"
    if use_torch and torch_available():
        import torch
        if not torch.cuda.is_available():
            return "--device cuda: this PyTorch has no CUDA device (the baseline runs on the same GPU); --no-torch skips it"
    return None


def ranks_of(grid: str) -> int:
    dims = [int(t) for t in grid.split(",")]
    return dims[0] * dims[1] * dims[2] * dims[3]


# ---------------------------------------------------------------------------- arguments

def model_list(text: str) -> list:
    """``--model`` value: comma-separated names from MODELS ("cosmoflow,unet3d")."""
    names = text.split(",")
    for name in names:
        if name not in MODELS:
            what = f"empty name in {text!r}" if not name else f"unknown model {name!r}"
            raise argparse.ArgumentTypeError(f"{what} (choose from {', '.join(MODELS)}, comma-separated)")
    return names


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grids", nargs="+", default=None, metavar="Pn,Pd,Ph,Pw",
                    help=f"driver: grids to run (default {' '.join(DEFAULT_GRIDS)}; quick 1,1,1,1 2,1,1,1)")
    ap.add_argument("--model", "--models", dest="models", nargs="+", type=model_list, default=None,
                    metavar="NAME[,NAME]", help=f"models to run, comma- or space-separated, each once "
                    f"(default {','.join(MODELS)})")
    ap.add_argument("--quick", action="store_true", help="tiny sizes for a smoke run: " +
                    ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    gpu = gpu_sizes()
    for key, help_text in (("size", "sample extent D=H=W"), ("width", "CosmoFlow conv_size"),
                           ("layers", "CosmoFlow conv blocks"), ("unet_width", "U-Net base_width"),
                           ("unet_layers", "U-Net levels"), ("fc1", "CosmoFlow fc1_size"),
                           ("fc2", "CosmoFlow fc2_size"), ("batch", "global batch"),
                           ("warmup", "untimed warm-up steps (>= 1)"), ("steps", "timed steps")):
        ap.add_argument("--" + key.replace("_", "-"), type=int, default=None,
                        help=f"{help_text} (default {DEFAULT[key]}; quick {QUICK[key]}; --device cuda {gpu[key]})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch baseline")
    ap.add_argument("--torch-layout", choices=TORCH_LAYOUTS, default="ncdhw",
                    help="memory layout of the PyTorch baseline: its default NCDHW, or channels_last "
                         "(torch.channels_last_3d: oneDNN's faster path for narrow convs on some CPUs)")
    ap.add_argument("--device", choices=("cpu", "cuda", "strict"), default="cpu",
                    help="cpu: NumPy vs PyTorch CPU (default); cuda: CuPy vs PyTorch CUDA on the same GPU "
                         "(every rank on its node's GPU: with one GPU every rank of a 2-rank run uses device 0; "
                         "DDP over NCCL when each rank has a GPU of its own, else gloo), each step synchronised, "
                         "at MLPerf's CosmoFlow and the default U-Net sizes unless --quick or size flags say "
                         "otherwise, grids 1,1,1,1 2,1,1,1 by default; strict: refimpl on the device stand-in "
                         "(REFIMPL_BACKEND=strict, a CI smoke of the device path) vs PyTorch CPU")
    ap.add_argument("--tf32", choices=("off", "on"), default="off",
                    help="with --device cuda: off (default) compares full float32 on both sides (refimpl and CuPy "
                         "without TF32, torch.backends.cudnn/cuda.matmul.allow_tf32 = False, "
                         "NVIDIA_TF32_OVERRIDE=0); on lets both round float32 matrix products to TF32 "
                         "(REFIMPL_TF32=1; docs/gpu.md, Precision). Run it once per setting for the two "
                         "columns of a like-for-like table")
    ap.add_argument("--kernel", type=int, choices=(2, 3), default=None,
                    help=f"CosmoFlow's conv kernel: 3 (padding 1) or 2 (MLPerf's, padding 'same') (default "
                         f"{DEFAULT_KERNEL}; --device cuda {gpu['kernel']}); MLPerf's sizes: --size 128 --width 32 "
                         f"--layers 5 --kernel 2")
    ap.add_argument("--no-threads-run", action="store_true",
                    help="skip the 1-process runs with one thread per core (never run with --device cuda)")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds allowed per launched run")
    ap.add_argument("--rounds", type=int, default=1, metavar="R",
                    help="run every configuration R times, interleaved: round by round, the order of the "
                         "runs reversed every other round; then each ratio per round, with the load "
                         "averages, and their median (default 1)")
    ap.add_argument("--json", metavar="FILE", help="write the numbers to FILE")
    ap.add_argument("--watchdog", action="store_true",
                    help="measure the cost per step of the fail-stop machinery (watchdog, signal thread, run lock) instead (grids default 2,1,1,1 "
                         "1,2,1,1; --watchdog-rounds rounds of --steps steps with it and without it)")
    ap.add_argument("--watchdog-rounds", type=int, default=0, metavar="R",
                    help="rounds for --watchdog (default 6)")
    # internal: one run, launched by the driver
    ap.add_argument("--worker", choices=("refimpl", "torch"), help=argparse.SUPPRESS)
    ap.add_argument("--grid", default="1,1,1,1", help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tf32 == "on" and args.device != "cuda":
        ap.error("--tf32 on needs --device cuda (NumPy's BLAS and PyTorch CPU have no TF32)")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if args.watchdog and args.rounds != 1:
        ap.error("--rounds is for the throughput table; --watchdog takes --watchdog-rounds")
    if args.watchdog_rounds < 0:
        ap.error("--watchdog-rounds must be >= 0")
    if args.watchdog and not args.watchdog_rounds:
        args.watchdog_rounds = 6
    if args.watchdog and args.grids is None:
        args.grids = ["2,1,1,1", "1,2,1,1"]
    args.models = [name for names in args.models for name in names] if args.models else list(MODELS)
    for name in MODELS:
        if args.models.count(name) > 1:
            ap.error(f"--model: {name} is listed more than once")
    if args.worker and len(args.models) != 1:
        ap.error("--worker runs one --model")
    on_gpu = args.device == "cuda" and not args.quick      # the issue's sizes: MLPerf's CosmoFlow, the U-Net's
    preset = gpu if on_gpu else dict(QUICK if args.quick else DEFAULT, kernel=DEFAULT_KERNEL)
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
        if getattr(args, key) < 1:
            ap.error(f"--{key.replace('_', '-')} must be a positive integer")
    if args.grids is None:
        args.grids = ["1,1,1,1", "2,1,1,1"] if args.quick else list(GPU_GRIDS if on_gpu else DEFAULT_GRIDS)
    from refimpl.parallel.grid import parse_grid
    try:
        args.grids = [",".join(map(str, parse_grid(g))) for g in args.grids]
    except ValueError as err:
        ap.error(f"--grids: {err}")
    if any(args.batch % int(g.split(",")[0]) for g in args.grids):
        ap.error(f"--batch {args.batch} must be divisible by every grid's Pn")
    for model, key in (("cosmoflow", "layers"), ("unet3d", "unet_layers")):   # each level halves the size
        if model in args.models and args.size % 2 ** getattr(args, key):
            ap.error(f"--size {args.size} must be divisible by 2^{getattr(args, key)} for {model} "
                     f"(--{key.replace('_', '-')} {getattr(args, key)})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is None:
        missing = device_missing(args.device, use_torch=not args.no_torch)   # before anything is launched
        if missing:
            print(f"bench_train: {missing}", file=sys.stderr)
            return 2
        return watchdog_driver(args) if args.watchdog else driver(args)
    report = refimpl_worker(args) if args.worker == "refimpl" else torch_worker(args)
    if report is not None and args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    if args.worker == "torch" and args.world > 1:
        # now and then gloo's threads abort the interpreter's shutdown ("terminate called without an
        # active exception", SIGABRT) even after destroy_process_group: the report is written, skip it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
