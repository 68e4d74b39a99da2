#!/usr/bin/env python
"""Does CosmoFlow's validation error fall as the sample volume grows?  (cf. Oyama et al.)

Oyama et al. ("The case for strong scaling in deep learning: training large 3D
CNNs with hybrid parallelism", IEEE TPDS 2021) trained CosmoFlow on 128^3, 256^3
and 512^3 crops of the same simulations and found the larger volumes predict the
cosmological parameters better: a larger volume holds more Fourier modes, so
its power spectrum -- which the parameters set -- is measured with less
sampling noise.  refimpl's generator has that property by construction (the
variance of a binned P(k) estimate falls like 1 / volume, docs/data.md), so the
experiment asks whether a small CosmoFlow trained with a fixed budget sees it.

For every size S in ``--sizes``:

1. ``refimpl datagen cosmoflow --size S --samples N --val-samples V --seed SEED``:
   the same seed at every size, so sample i has the *same* four target
   parameters at every size (only the volume differs);
2. ``mpiexec -n R refimpl train --grid R,1,1,1`` with the same small CosmoFlow
   recipe: conv_size ``--width``, as many conv blocks as bring S down to 4^3
   (log2(S / 4): 2 at 16^3, 3 at 32^3, 4 at 64^3, as Oyama et al. deepen the
   network for larger inputs, so the dense head sees 4^3 x channels), dense
   ``--fc1`` / ``--fc2``; the same global batch, epochs (hence steps), optimiser
   (Adam), learning rate and seed;
3. the validation MAE (mean over the 4 unit-scaled targets in [-1, 1]) after
   every epoch, read from the run's metrics.jsonl.

The table gives the final and the best validation MAE per size next to the MAE
of the constant predictor (the training targets' median), which a network that
learned nothing matches.

    python scripts/experiment_volume.py [--sizes 16,32,64] [--samples 256] [--epochs 15] \
        [--out runs/volume] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time

ROOT_ENV = dict(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
FINAL_EXTENT = 4          # conv blocks halve S until 4^3 remains


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16,32,64", help="sample extents S (powers of 2, >= 8)")
    ap.add_argument("--samples", type=int, default=256, help="training samples (same at every size)")
    ap.add_argument("--val-samples", type=int, default=64, help="validation samples")
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--batch", type=int, default=8, help="global batch")
    ap.add_argument("--width", type=int, default=4, help="conv_size: channels of the first block")
    ap.add_argument("--fc1", type=int, default=64)
    ap.add_argument("--fc2", type=int, default=32)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    ap.add_argument("--ranks", type=int, default=2, help="data-parallel ranks (grid R,1,1,1)")
    ap.add_argument("--seed", type=int, default=1, help="data seed (the training seed is 0)")
    ap.add_argument("--out", default="runs/volume", help="data and runs go here")
    ap.add_argument("--json", metavar="FILE", help="write the numbers to FILE")
    args = ap.parse_args(argv)
    try:
        args.sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        ap.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")
    for s in args.sizes:
        if s < 2 * FINAL_EXTENT or s & (s - 1):
            ap.error(f"--sizes: {s} must be a power of 2 >= {2 * FINAL_EXTENT}")
    if args.batch % args.ranks or args.samples < args.batch or args.val_samples < args.batch:
        ap.error("--batch must be a multiple of --ranks and at most --samples and --val-samples")
    return args


def run(cmd, env=None):
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"experiment_volume: {' '.join(cmd)} failed (rc={proc.returncode})\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def model_config(args, size: int) -> dict:
    return {"input_shape": [4, size, size, size], "conv_size": args.width,
            "n_conv_layers": int(math.log2(size // FINAL_EXTENT)), "fc1_size": args.fc1,
            "fc2_size": args.fc2, "dropout": args.dropout}


def write_config(path, args, size: int) -> None:
    steps_per_epoch = args.samples // args.batch
    lines = ['model = "cosmoflow"', f"grid = \"{args.ranks},1,1,1\"", f"global_batch = {args.batch}",
             f"epochs = {args.epochs}", 'optimizer = "adam"', f"lr = {args.lr}", "seed = 0",
             f"validate_every = {steps_per_epoch}", f"checkpoint_every = {steps_per_epoch * args.epochs}",
             "[model_config]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in model_config(args, size).items()]
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")


def constant_predictor_mae(data_dir: str) -> float:
    """MAE on val.h5 of predicting the training targets' per-parameter median (the best constant)."""
    import h5py
    import numpy
    with h5py.File(os.path.join(data_dir, "train.h5"), "r") as f:
        median = numpy.median(f["unitPar"][...], axis=0)
    with h5py.File(os.path.join(data_dir, "val.h5"), "r") as f:
        return float(numpy.mean(numpy.abs(f["unitPar"][...] - median)))


def one_size(args, size: int) -> dict:
    data, out = os.path.join(args.out, f"data_{size}"), os.path.join(args.out, f"run_{size}")
    t0 = time.perf_counter()
    if not os.path.exists(os.path.join(data, "val.h5")):
        run([sys.executable, "-m", "refimpl", "datagen", "cosmoflow", "--out", data, "--size", str(size),
             "--samples", str(args.samples), "--val-samples", str(args.val_samples), "--seed", str(args.seed),
             "--overwrite", "--quiet"])
    t_data = time.perf_counter() - t0
    os.makedirs(out, exist_ok=True)
    config = os.path.join(args.out, f"config_{size}.toml")
    write_config(config, args, size)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1", **ROOT_ENV)
    t0 = time.perf_counter()
    run([shutil.which("mpiexec"), "--oversubscribe", "-n", str(args.ranks), sys.executable, "-m", "refimpl",
         "train", "--config", config, "--data", data, "--out", out, "--overwrite", "--quiet", "--no-plot"], env)
    t_train = time.perf_counter() - t0
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if line.strip()]
    val = [r for r in rows if r["split"] == "val"]
    train = [r for r in rows if r["split"] == "train"]
    last_epoch = [r for r in train if r["epoch"] == train[-1]["epoch"]]
    return {"size": size, "n_conv_layers": model_config(args, size)["n_conv_layers"],
            "steps": train[-1]["step"], "val_mae_per_epoch": [r["mae"] for r in val],
            "val_mae_final": val[-1]["mae"], "val_mae_best": min(r["mae"] for r in val),
            "val_loss_final": val[-1]["loss"],
            "train_mae_last_epoch": sum(r["mae"] for r in last_epoch) / len(last_epoch),
            "constant_mae": constant_predictor_mae(data), "data_s": t_data, "train_s": t_train}


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    load = os.getloadavg()
    print(f"# experiment_volume: sizes {args.sizes}, {args.samples} train / {args.val_samples} val samples "
          f"(data seed {args.seed}), global batch {args.batch}, {args.epochs} epochs "
          f"({args.epochs * (args.samples // args.batch)} steps), Adam lr {args.lr}, conv_size {args.width}, "
          f"fc {args.fc1}/{args.fc2}, dropout {args.dropout}, {args.ranks} ranks; load average "
          f"{' '.join(f'{v:.2f}' for v in load)}", flush=True)
    results = []
    for size in args.sizes:
        results.append(one_size(args, size))
        r = results[-1]
        print(f"#   {size}^3: val MAE {r['val_mae_final']:.4f} (data {r['data_s']:.0f} s, train {r['train_s']:.0f} s)",
              flush=True)
    head = (f"{'size':>6} {'conv blocks':>11} {'steps':>5} {'val MAE final':>13} {'val MAE best':>12} "
            f"{'train MAE (last epoch)':>22} {'constant MAE':>12} {'train s':>7}  val MAE per epoch")
    print(head)
    print("-" * len(head))
    for r in results:
        print(f"{r['size']:>4}^3 {r['n_conv_layers']:>11} {r['steps']:>5} {r['val_mae_final']:13.4f} "
              f"{r['val_mae_best']:12.4f} {r['train_mae_last_epoch']:22.4f} {r['constant_mae']:12.4f} "
              f"{r['train_s']:7.0f}  {' '.join(f'{m:.3f}' for m in r['val_mae_per_epoch'])}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"settings": {k: v for k, v in vars(args).items() if k != "json"},
                       "load_average": {"start": list(load), "end": list(os.getloadavg())},
                       "results": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
