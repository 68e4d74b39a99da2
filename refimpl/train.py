"""Hybrid-parallel training loop: data x spatial parallel CosmoFlow / 3D U-Net under mpiexec.

One step on every rank of the (Pn, Pd, Ph, Pw) grid::

    batch  = loader.next_batch()       # this sample group's samples, this rank's hyperslab
    out    = model.forward(x)          # halo exchanges inside the spatial layers
    loss, dout, metrics = model.loss(out, y)     # global-batch mean, same on every rank
    model.backward(dout)               # gradient hooks start bucketed allreduces
    sync.finish()                      # sum over spatial, average over data
    optimizer.step()                   # identical update on every rank

Errors (refimpl/failstop.py).  Every rank must take the same path, or the ranks
that went on wait forever in a collective.  So everything that can fail on bad
input (config, grid, model, data files, data values, checkpoint) runs in
``agree``: each rank tries, the outcomes are allgathered, and if any rank failed
*every* rank raises ``InputError`` with the first message (exit status 2).
Every path the run writes is checked writable on every rank before the first
message (``preflight``).  What rank 0 writes for everyone (config, metrics,
plot, checkpoint, summary, generated data) runs in ``on_root``: the outcome is
broadcast and a failure raises ``WriteError`` on every rank (status 4).  A
NaN/Inf loss is decided collectively too and raises ``Diverged`` everywhere
before the bad update is applied (status 3); the last checkpoint stays good.
What escapes all that (an exception on one rank inside a layer) ends the job
from that rank, and a rank that stops answering is named by the watchdog
(status 5): ``failstop.run_command``, which ``refimpl train`` runs under.

Resume bit for bit.  Nothing in a step is drawn from a sequential random
stream: the data order of epoch e is ``default_rng([seed, e])`` and dropout
masks hash (seed, counter, element index).  A checkpoint at a step boundary
therefore holds the whole state: parameters, buffers, optimiser state, the
loader position and the dropout counters (refimpl/checkpoint.py); the learning
rate is a pure function of the step.
"""
from __future__ import annotations

import json
import statistics
import math
import os
import sys
import time

from . import checkpoint
from .backend import asarray, resolve_dtype, set_backend
from .config import effective_settings
from .failstop import (PROGRESS, Diverged, InputError, WriteError, agree, atomic_write, check_writable,
                       decide, describe, label_layers, on_root, phase, refuse, set_step)
from .optim import Schedule, make_optimizer, parse_decay, scaled_lr
from .parallel.objects import allreduce_sum

CHECKPOINT = "checkpoint.h5"
METRICS = "metrics.jsonl"
PLOT = "loss.png"
CONFIG = "config.json"
SUMMARY = "summary.json"
RUN_FILES = (CHECKPOINT, METRICS, PLOT, CONFIG, SUMMARY)      # what a run writes into OUT


def preflight(config: dict) -> None:
    """Every path the run will write can be written (ValueError otherwise); pure, on every rank.

    OUT must be (or be creatable as) a writable directory, and each run file in it
    (checkpoint, metrics, plot, config, summary) a regular file or absent: a bad
    --out is bad input found before the first message, not an I/O error at step 1.
    """
    out = config["out"]
    check_writable(out, "--out", directory=True)
    for name in RUN_FILES + (() if config["data"] else ("data",)):
        check_writable(os.path.join(out, name), f"--out: {name}", directory=name == "data")


def clear_run(out: str) -> None:
    """``--overwrite``: remove the old run's files before anything new is written.

    Each file is first renamed into ``OUT/.overwritten-PID/`` (checkpoint first:
    from that instant OUT holds no run that ``--resume`` could pick up), then that
    directory is deleted.  A crash in between leaves OUT without a checkpoint and
    the stale ``.overwritten-*`` directory, removed by the next ``--overwrite``.
    Generated data (OUT/data) is input, not output: it is kept.
    """
    import glob
    import shutil
    for stale in glob.glob(os.path.join(glob.escape(out), ".overwritten-*")):
        shutil.rmtree(stale, ignore_errors=True)
    aside = os.path.join(out, f".overwritten-{os.getpid()}")
    os.makedirs(aside, exist_ok=True)
    for name in RUN_FILES:
        if os.path.exists(os.path.join(out, name)):
            os.replace(os.path.join(out, name), os.path.join(aside, name))
    shutil.rmtree(aside)


# ---------------------------------------------------------------- setup pieces

def resolve_run(config: dict, world_size: int) -> dict:
    """Pure, identical on every rank: grid dims, global batch, lr, schedule settings.

    The defaults resolved here (optimizer, lr, base batch, warmup epochs) are
    written back into ``config``, so config.json and the checkpoint say what ran.
    """
    from .parallel.grid import format_grid, parse_grid
    dims = parse_grid(config["grid"]) if config["grid"] else (world_size, 1, 1, 1)
    product = math.prod(dims)
    if product != world_size:
        raise ValueError(f"--grid {format_grid(dims)} holds {product} ranks but mpiexec started "
                         f"{world_size}; run 'mpiexec -n {product} ...' or change --grid")
    batch = config["global_batch"]
    if batch is None:
        batch = dims[0] * max(1, -(-4 // dims[0]))      # 4 samples, rounded up to a multiple of Pn
    if batch % dims[0]:
        raise ValueError(f"--global-batch {batch} must be divisible by Pn={dims[0]} (the grid's "
                         "sample groups each take an equal share)")
    effective = effective_settings(config)        # MLPerf CosmoFlow: SGD; otherwise Adam, ...
    for key in ("optimizer", "lr", "base_batch", "warmup_epochs"):
        config[key] = effective[key]
    lr, base_batch = config["lr"], config["base_batch"]
    return {"dims": dims, "global_batch": batch, "base_lr": lr, "base_batch": base_batch,
            "peak_lr": scaled_lr(lr, batch, base_batch), "decay": parse_decay(effective["decay"]),
            "model_config": effective["model_config"]}


def make_schedule(config, run, steps_per_epoch) -> Schedule:
    if config["schedule"] == "mlperf":
        return Schedule("mlperf", run["peak_lr"], base_lr=run["base_lr"], steps_per_epoch=steps_per_epoch,
                        warmup_epochs=config["warmup_epochs"], decay_epochs=run["decay"])
    return Schedule(config["schedule"], run["peak_lr"], warmup_steps=config["warmup_steps"],
                    milestones=run["decay"])


def generated_counts(config, input_shape) -> tuple[int, int]:
    """(train, val) samples to generate: given, or about 128 MiB of float32 (16 to 256 train, 1/8 val)."""
    voxels = input_shape[0] * input_shape[1] * input_shape[2] * input_shape[3]
    n_train = config["gen_samples"] or max(16, min(256, (1 << 25) // voxels))
    n_val = config["gen_val_samples"] if config["gen_val_samples"] is not None else max(4, n_train // 8)
    return n_train, n_val


def generate_data(config, model, directory) -> None:
    """Write train.h5 / val.h5 for ``model`` into ``directory`` (one process)."""
    import functools

    from . import __version__
    from .data.cosmo import PARAM_NAMES, generate_universe
    from .data.layout import write_split
    from .data.segmentation import generate_segmentation
    channels, size = model.input_shape[0], tuple(model.input_shape[1:])
    if model.task == "regression":
        make = functools.partial(generate_universe, seed=config["gen_seed"], size=size, channels=channels)
        kind, params = "cosmoflow", {"size": list(size), "channels": channels, "mean_count": 64.0,
                                     "targets": list(PARAM_NAMES)}
    else:
        classes = model.num_classes
        make = functools.partial(generate_segmentation, seed=config["gen_seed"], size=size,
                                 channels=channels, classes=classes)
        kind, params = "segmentation", {"size": list(size), "channels": channels, "classes": classes,
                                        "noise": 0.3}
    attrs = {"generator": kind, "params": params, "seed": config["gen_seed"],
             "refimpl_version": __version__}
    os.makedirs(directory, exist_ok=True)
    n_train, n_val = generated_counts(config, model.input_shape)
    write_split(os.path.join(directory, "train.h5"), make, n_train, 0, attrs)
    if n_val:
        write_split(os.path.join(directory, "val.h5"), make, n_val, n_train, attrs)


def open_split(path, model, grid, config):
    """HDF5Reader of this rank's block, checked against the model (``path`` exists: rank 0 said so)."""
    import h5py

    from .data.reader import HDF5Reader
    reader = HDF5Reader(path)                      # validates the layout; whole-sample block
    if reader.sample_shape != tuple(model.input_shape):
        raise ValueError(f"{path}: samples are (C, D, H, W) = {reader.sample_shape} but the {config['model']} "
                         f"preset {config['preset']!r} expects {tuple(model.input_shape)}; set "
                         "[model_config] input_shape in --config or use matching data")
    reader.close()
    log1p = config["log1p"]
    if log1p == "auto":       # MLPerf CosmoFlow trains on log(1 + counts)
        with h5py.File(path, "r") as f:
            params = json.loads(f.attrs["params"]) if "params" in f.attrs else {}
        log1p = model.task == "regression" and params.get("mean_count") is not None
    classes = getattr(model, "num_classes", None)
    reader = HDF5Reader(path, spatial_block=grid.local_block(model.input_shape[1:]),
                        cache=config["cache"], log1p=log1p)
    if model.task == "regression" and reader.kind != "cosmoflow":
        raise ValueError(f"{path}: holds '{reader.kind}' data (labels) but {config['model']} regresses "
                         "targets (dataset 'unitPar')")
    if model.task == "regression" and reader.target_shape != (model.num_outputs,):
        raise ValueError(f"{path}: targets are {reader.target_shape}, the model has {model.num_outputs} outputs")
    if model.task == "segmentation":
        if reader.kind != "segmentation":
            raise ValueError(f"{path}: holds '{reader.kind}' data (unitPar) but unet3d needs labels")
        reader.classes = classes
    return reader


def check_all_samples(reader) -> None:
    """Read (and with cache=True keep) this rank's block of every sample: NaN/Inf/labels checked."""
    for i in range(reader.num_samples):
        reader.read(i)


def channel_stats(reader, count: int):
    """Per-channel (sums, sums of squares, voxels) of this rank's block of samples [0, count), float64."""
    import numpy
    sums = numpy.zeros((3, reader.sample_shape[0]))
    for i in range(count):
        x, _ = reader.read(i)                                  # (C, d, h, w) local block
        x = x.astype(numpy.float64)
        sums[0] += x.sum(axis=(1, 2, 3))
        sums[1] += (x * x).sum(axis=(1, 2, 3))
        sums[2] += x[0].size
    return sums


def input_normalization(reader, grid, comm, count: int):
    """Per-channel (mean, 1/std) of the first ``count`` training samples, the same on every rank.

    Inputs are standardised with them: MLPerf CosmoFlow's log(1 + counts) has a
    mean near 4 and a spread near 0.4, an offset that stalls a small network.
    Every sample group reads the same samples, so the spatial sum is identical
    on every rank (same values, same reduction).
    """
    import numpy
    local = agree(comm, channel_stats, reader, count)
    total = allreduce_sum(grid.spatial_comm, local)                 # sum of the blocks: whole samples
    mean = total[0] / total[2]
    std = numpy.sqrt(numpy.maximum(total[1] / total[2] - mean * mean, 0.0))
    return [float(m) for m in mean], [float(1.0 / s) if s > 0 else 1.0 for s in std]


def truncate_metrics(path, step: int) -> None:
    """Drop metric lines written after ``step`` (by a run killed after its last checkpoint)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    keep = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line)
        except (ValueError, KeyError):
            pass
    atomic_write(path, lambda f: f.writelines(keep))


def plot_metrics(metrics_path, png_path, metric_name) -> None:
    """Loss and metric vs step (train and val) as a PNG (matplotlib, Agg backend)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [json.loads(line) for line in open(metrics_path) if line.strip()]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key in zip(axes, ("loss", metric_name)):
        train = [(r["step"], r[key]) for r in rows if r["split"] == "train" and key in r]
        if train:
            steps, values = zip(*train)
            ax.plot(steps, values, "-", color="C0", alpha=0.3, label="train (per step)")
            window = max(1, len(values) // 20)     # running mean over ~5% of the run
            smooth = [sum(values[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1))
                      for i in range(len(values))]
            ax.plot(steps, smooth, "-", color="C0", label=f"train (mean of {window})")
        val = [(r["step"], r[key]) for r in rows if r["split"] == "val" and key in r]
        if val:
            ax.plot(*zip(*val), "o-", color="C1", label="val", markersize=4)
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.set_yscale("log" if key == "loss" else "linear")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(os.path.basename(os.path.dirname(os.path.abspath(png_path))))
    fig.tight_layout()
    try:
        atomic_write(png_path, lambda f: fig.savefig(f, dpi=90, format="png"), binary=True)
    finally:
        plt.close(fig)


# ---------------------------------------------------------------- the run

class Trainer:
    """Builds everything from a config (collectively checked) and runs the loop."""

    def __init__(self, config: dict, comm, resume_state=None, notes=()):
        from .models import build_model
        from .parallel.buffers import set_cuda_aware
        from .parallel.grad_sync import MIB, GradientSynchronizer
        from .parallel.grid import ProcessGrid

        self.config, self.comm = config, comm
        self.rank = comm.Get_rank()
        self.out = config["out"]
        self.notes = list(notes)
        phase("building the model and the data pipeline")
        run = agree(comm, resolve_run, config, comm.Get_size())
        self.global_batch = run["global_batch"]
        config["global_batch"] = self.global_batch
        config["grid"] = ",".join(map(str, run["dims"]))
        agree(comm, set_backend, config["backend"])
        set_cuda_aware(config["cuda_aware"])
        if config["backend"] != "numpy":            # how device buffers meet MPI, said once
            from .parallel.buffers import device_path_report, mpi_cuda_support
            from .parallel.objects import bcast_object
            # the MPI library is the same on every rank: rank 0 asks it (ompi_info is a process)
            support = None if config["backend"] == "strict" else \
                bcast_object(comm, mpi_cuda_support() if self.rank == 0 else None)
            self.notes.append(agree(comm, device_path_report, config["backend"], support))
        self.dtype = resolve_dtype(config["dtype"])
        self.grid = ProcessGrid(comm, run["dims"])
        self.model = agree(comm, build_model, config["model"], run["model_config"], self.grid,
                           config["seed"], self.dtype, self.global_batch)
        label_layers(self.model)
        self.metric_name = "mae" if self.model.task == "regression" else "dice"
        self._prepare_data()
        self.steps_per_epoch = self.train_reader.num_samples // self.global_batch
        self.total_steps = config["steps"] if config["steps"] is not None else \
            (config["epochs"] or 1) * self.steps_per_epoch
        self.schedule = agree(comm, make_schedule, config, run, self.steps_per_epoch)
        compressor = None
        if config["compress"] != "none":
            from .parallel.compress import Compressor
            from .parallel.grad_sync import product_comm
            if config["optimizer_sharding"]:
                refuse("--compress and --optimizer-sharding do not combine (the distributed update needs "
                       "the reduce-scatter of the exact gradients)")
            compressor = Compressor(config["compress"], product_comm(self.grid.data_comm, self.grid.spatial_comm),
                                    config["error_feedback"])
        if config["priority"] != "none":
            other = [flag for flag, on in (("--optimizer-sharding", config["optimizer_sharding"]),
                                           ("--compress", compressor is not None),
                                           ("--no-overlap", not config["overlap"])) if on]
            if other:
                refuse(f"--priority {config['priority']} does not combine with {' and '.join(other)}: it "
                       "reorders the overlapped allreduce of exact gradients and defers their update")
        chunk_mb = config["chunk_mb"] if config["chunk_mb"] is not None else \
            (1.0 if config["priority"] != "none" else 0.0)
        self.sync = GradientSynchronizer(self.model.parameters(), self.grid.data_comm,
                                         self.grid.spatial_comm, bucket_bytes=int(config["bucket_mb"] * MIB),
                                         algorithm=config["allreduce"], overlap=config["overlap"],
                                         shard=config["optimizer_sharding"], compressor=compressor,
                                         reduce_comm=compressor.comm if compressor else None,
                                         priority=config["priority"],
                                         chunk_bytes=int(chunk_mb * MIB))

        def optimizer_over(params):
            return make_optimizer(config["optimizer"], params, lr=self.schedule(0), momentum=config["momentum"],
                                  nesterov=config["nesterov"], weight_decay=config["weight_decay"],
                                  betas=tuple(config["betas"]), eps=config["eps"])
        if config["optimizer_sharding"]:           # the update of this rank's block (ZeRO-1)
            from .parallel.sharded_update import ShardedOptimizer
            self.optimizer = agree(comm, ShardedOptimizer, optimizer_over, self.model.parameters(), self.sync)
        else:
            self.optimizer = agree(comm, optimizer_over, self.model.parameters())
        from .parallel.priority import LayerwiseUpdate
        self.update = LayerwiseUpdate(self.model, self.sync, self.optimizer)   # finish + step
        from .data.loader import Loader
        self.loader = Loader(self.train_reader, self.global_batch, self.grid.sample_coord,
                             self.grid.dims[0], seed=config["seed"])
        self.step = 0
        self.input_norm = None
        if resume_state is not None:
            self.input_norm = resume_state[1].get("input_norm")
        elif config["normalize"]:
            self.input_norm = input_normalization(self.train_reader, self.grid, comm,
                                                  min(self.train_reader.num_samples, 32))
        if resume_state is not None:
            arrays, meta = resume_state
            self.notes += agree(comm, checkpoint.restore, arrays, meta, self.model,
                                self.optimizer, self.grid)
            agree(comm, self._restore_rank_state, arrays, meta)
            agree(comm, self.loader.load_state_dict, meta["loader"])
            self.step = int(meta["step"])
            if self.total_steps < self.step:
                length = f"--steps {config['steps']}" if config["steps"] is not None else \
                    f"--epochs {config['epochs'] or 1} ({self.total_steps} steps)"
                refuse(f"--resume: {length} is below the {self.step} steps the checkpoint has done; "
                       f"give more than {self.step} steps to train further")

    # ------------------------------------------------------------ data
    def _prepare_data(self):
        config, comm = self.config, self.comm
        directory = config["data"]
        if directory is None:
            directory = os.path.join(self.out, "data")
            missing = not decide(comm, os.path.exists, os.path.join(directory, "train.h5"))
            if config["generate"] is False and missing:
                refuse("no --data given and --no-generate: nothing to train on")
            if missing:
                phase("generating data (rank 0)")
                if self.rank == 0:
                    counts = generated_counts(config, self.model.input_shape)
                    self._say(f"generating a {config['model']} dataset for preset {config['preset']!r} "
                              f"({counts[0]} + {counts[1]} samples of "
                              f"{tuple(self.model.input_shape)}) in {directory}")
                on_root(comm, self._generate, directory)    # doubles as the barrier: files are complete
            config["data"] = directory
        phase("opening the data")
        train_path = os.path.join(directory, "train.h5")
        if not decide(comm, os.path.exists, train_path):
            refuse(f"--data: {train_path} does not exist (write it with 'refimpl datagen', "
                   "or leave --data out to generate a small dataset)")
        self.train_reader = agree(comm, open_split, train_path, self.model, self.grid, config)
        val_path = os.path.join(directory, "val.h5")
        self.val_reader = agree(comm, open_split, val_path, self.model, self.grid, config) \
            if decide(comm, os.path.exists, val_path) else None
        if self.train_reader.num_samples < self.global_batch:
            refuse(f"{self.train_reader.path} holds {self.train_reader.num_samples} samples, "
                   f"fewer than the global batch {self.global_batch}")
        if self.val_reader is not None and self.val_reader.num_samples < self.global_batch:
            self.notes.append(f"{self.val_reader.path} holds fewer samples than the global batch: "
                              "no validation")
            self.val_reader = None
        if config["check_data"] == "full":
            phase("checking every sample")
            for reader in (self.train_reader, self.val_reader):
                if reader is not None:
                    agree(comm, check_all_samples, reader)

    def _generate(self, directory):
        try:
            generate_data(self.config, self.model, directory)
        except (ValueError, OSError) as err:
            raise WriteError(f"generating data in {directory} failed: {describe(err)}") from None

    def _batch(self, loader):
        """Next (x, y) on this rank, as model-dtype device arrays; read errors made collective."""
        phase("reading a batch")
        if self.config["check_data"] == "full":
            batch = loader.next_batch()
        else:
            batch = agree(self.comm, loader.next_batch)
        y = batch.y.astype(self.dtype) if self.model.task == "regression" else batch.y.astype("int64")
        x = batch.x
        if self.input_norm is not None:
            import numpy
            mean, inv_std = (numpy.asarray(v, dtype=numpy.float32)[:, None, None, None] for v in self.input_norm)
            x = (x - mean) * inv_std                           # (n, C, d, h, w), per channel
        return asarray(x, dtype=self.dtype), asarray(y)

    # ------------------------------------------------------------ output (rank 0 writes, all agree)
    def _say(self, line: str) -> None:
        if self.rank == 0 and not self.config["quiet"]:
            print(line, flush=True)

    def _path(self, name: str) -> str:
        return os.path.join(self.out, name)

    def _start_outputs(self) -> None:
        """OUT created, metrics cut back to the step the run (re)starts from, config.json written."""
        os.makedirs(self.out, exist_ok=True)
        truncate_metrics(self._path(METRICS), self.step)
        write_json(self._path(CONFIG), self.config, indent=2, sort_keys=True)

    def _write_metrics(self, record: dict) -> None:
        phase("writing metrics (rank 0)")
        on_root(self.comm, append_line, self._path(METRICS), json.dumps(record), error=WriteError)

    def _plot(self) -> None:
        if self.config["plot"] and os.path.exists(self._path(METRICS)):
            plot_metrics(self._path(METRICS), self._path(PLOT), self.metric_name)

    def save(self) -> None:
        phase("applying the deferred updates")
        self.update.flush()
        phase("checkpoint write (rank 0 writes, the others wait)")
        meta = {"step": self.step, "epoch": self.loader.epoch, "loader": self.loader.state_dict(),
                "config": self.config, "input_norm": self.input_norm}
        try:
            checkpoint.save(self._path(CHECKPOINT), self.model, self.optimizer, self.grid, meta,
                            rank_state=self._rank_state())
        except checkpoint.CheckpointError as err:
            raise WriteError(str(err), agreed=True) from None
        phase("plotting (rank 0)")
        on_root(self.comm, self._plot, error=WriteError)

    def _rank_state(self) -> dict:
        """This rank's own arrays for the checkpoint: the compressor's residuals."""
        compressor = self.sync.compressor
        if compressor is None:
            return {}
        return {f"compress/{key}": value for key, value in compressor.state().items()}

    def _restore_rank_state(self, arrays, meta) -> None:
        """The compressor's residuals of this rank, when the checkpoint was written on this grid."""
        compressor = self.sync.compressor
        if compressor is None:
            return
        prefix = f"rank/{self.rank}/compress/"
        saved = {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}
        if list(meta.get("grid", [])) == list(self.grid.dims) and meta.get("world_size") == self.comm.Get_size():
            compressor.load_state(saved)
        elif any(k.startswith("rank/") for k in arrays):
            self.notes.append("the compressor's residuals (error feedback) were saved on another grid: "
                              "they start at zero")

    # ------------------------------------------------------------ the loop
    def train_step(self) -> dict:
        x, y = self._batch(self.loader)
        self.model.train()
        self.model.zero_grad()
        out = self.model.forward(x)
        phase("loss allreduce")
        loss, dout, metrics = self.model.loss(out, y)
        phase("checking the loss")
        bad = allreduce_sum(self.comm, 0 if math.isfinite(loss) else 1)
        if bad:
            kept = f"the last good checkpoint (step {self._checkpoint_step()}) is in {self.out}" \
                if os.path.exists(self._path(CHECKPOINT)) else "no checkpoint was written yet"
            raise Diverged(f"the loss became {loss} at step {self.step + 1} (on {bad} rank(s)); stopped "
                           f"before the update: {kept}. Lower --lr or add --warmup-steps", agreed=True)
        self.model.backward(dout)
        phase("gradient allreduce and optimizer step")
        self.update.step(self.schedule(self.step))     # --priority input-first: deferred per layer
        self.step += 1
        return {"loss": float(loss), **{k: float(v) for k, v in metrics.items()}, "lr": self.optimizer.lr}

    def _saved(self, step) -> None:
        """The last checkpoint is at ``step`` (None: none yet); an interruption's message says so."""
        self.last_saved = step
        PROGRESS.saved = (f"the last checkpoint is step {step} ({self._path(CHECKPOINT)})" if step is not None
                          else "no checkpoint was written yet")

    def _checkpoint_step(self):
        return self.last_saved if self.last_saved is not None else "?"

    def validate(self) -> dict | None:
        if self.val_reader is None:
            return None
        from .data.loader import Loader
        loader = Loader(self.val_reader, self.global_batch, self.grid.sample_coord, self.grid.dims[0],
                        seed=self.config["seed"], shuffle=False)
        self.model.eval()
        totals, count = {}, 0
        for _ in range(loader.steps_per_epoch):
            x, y = self._batch(loader)
            phase("validation forward")
            loss, _, metrics = self.model.loss(self.model.forward(x), y)
            for k, v in {"loss": loss, **metrics}.items():
                totals[k] = totals.get(k, 0.0) + float(v)
            count += 1
        self.model.train()
        return {k: v / count for k, v in totals.items()}

    def run(self) -> dict:
        from tqdm import tqdm
        cfg = self.config
        self._saved(self.step if self.step else None)
        phase("writing config.json (rank 0)")
        on_root(self.comm, self._start_outputs, error=WriteError)
        for note in self.notes:
            self._say(f"note: {note}")
        n_params = sum(int(p.data.size) for p in self.model.parameters())
        self._say(f"refimpl train: {cfg['model']} ({cfg['preset']}, {n_params} parameters) on grid "
                  f"{self.grid.dims} = {self.comm.Get_size()} ranks, global batch {self.global_batch}, "
                  f"{cfg['optimizer']} lr {self.schedule(self.step):.3g} ({cfg['schedule']}), "
                  f"{self.total_steps} steps ({self.steps_per_epoch} per epoch), out {self.out}"
                  + (f", resumed at step {self.step}" if self.step else ""))
        # the bar only on a terminal: redirected into a job log its redraws would fill the file
        # (the log lines on stdout, every --log-every steps, report the progress there)
        bar = tqdm(total=self.total_steps, initial=self.step, unit="step", dynamic_ncols=True,
                   disable=self.rank != 0 or cfg["quiet"] or not sys.stderr.isatty(), file=sys.stderr)
        started, last, val = time.perf_counter(), None, None
        steps_run = 0
        while self.step < self.total_steps:
            set_step(self.step + 1)
            t0 = time.perf_counter()
            epoch = self.loader.epoch
            last = self.train_step()
            steps_run += 1
            dt = time.perf_counter() - t0
            record = {"split": "train", "step": self.step, "epoch": epoch, **last,
                      "samples_per_s": self.global_batch / dt, "step_s": dt}
            if self.sync.compressor is not None:     # what this rank's compressed messages held
                record["grad_bytes_sent"] = self.sync.history[-1]["bytes_sent"]
            self._write_metrics(record)
            bar.update(1)
            bar.set_postfix(loss=f"{last['loss']:.4g}", **{self.metric_name: f"{last[self.metric_name]:.4g}"})
            if self.step % cfg["log_every"] == 0 and self.rank == 0 and not cfg["quiet"]:
                bar.write(f"step {self.step:>5}/{self.total_steps} | epoch {epoch} | loss {last['loss']:.5g} | "
                          f"{self.metric_name} {last[self.metric_name]:.4g} | lr {last['lr']:.3g} | "
                          f"{record['samples_per_s']:.1f} samples/s", file=sys.stdout)
            final = self.step == self.total_steps
            if self.step % cfg["validate_every"] == 0 or final:
                val = self.validate()
                if val is not None:
                    self._write_metrics({"split": "val", "step": self.step, "epoch": epoch, **val})
                    if self.rank == 0 and not cfg["quiet"]:
                        bar.write(f"  val @ step {self.step}: loss {val['loss']:.5g} | {self.metric_name} "
                                  f"{val[self.metric_name]:.4g}", file=sys.stdout)
            if self.step % cfg["checkpoint_every"] == 0 or final:
                self.save()
                self._saved(self.step)
        bar.close()
        set_step(None)
        elapsed = time.perf_counter() - started
        summary = {"steps": self.step, "steps_this_run": steps_run, "epochs": self.step / self.steps_per_epoch,
                   "seconds": elapsed, "samples_per_s": steps_run * self.global_batch / max(elapsed, 1e-9),
                   "final_train": last, "final_val": val, "out": self.out,
                   "checkpoint": self._path(CHECKPOINT), "metrics": self._path(METRICS),
                   "plot": self._path(PLOT) if cfg["plot"] else None}
        if self.update.gaps:         # end of backward -> the next forward's first layer
            summary["backward_to_next_forward_s"] = statistics.median(self.update.gaps)
        if self.sync.compressor is not None and steps_run:
            summary["gradient_exchange"] = {
                "compress": cfg["compress"], "error_feedback": cfg["error_feedback"],
                "bytes_sent_per_step": self.sync.history[-1]["bytes_sent"],
                "bytes_uncompressed": sum(int(b.flat.nbytes) for b in self.sync.buckets)}
        if steps_run:                  # a resume with nothing left to do keeps the old summary
            phase("writing summary.json (rank 0)")
            on_root(self.comm, write_json, self._path(SUMMARY), summary, indent=2, error=WriteError)
        return summary


def write_json(path, value, **dump_options) -> None:
    """Write ``value`` as JSON to ``path`` atomically (never half-written)."""
    atomic_write(path, lambda f: json.dump(value, f, **dump_options))


def append_line(path, line: str) -> None:
    """Append one line (flushed at close): metrics survive a crash up to the last step written."""
    try:
        with open(path, "a") as f:
            f.write(line + "\n")
    except OSError as err:           # name the file: a write error carries no filename
        raise OSError(err.errno, err.strerror, path) from None


def summary_line(summary: dict, metric_name: str) -> str:
    parts = [f"done: {summary['steps']} steps ({summary['epochs']:.2f} epochs) in {summary['seconds']:.1f} s",
             f"{summary['samples_per_s']:.1f} samples/s over the whole run (start-up, validation and "
             "checkpoints included)"]
    if summary["final_train"]:
        t = summary["final_train"]
        parts.append(f"train loss {t['loss']:.5g} {metric_name} {t[metric_name]:.4g}")
    if summary["final_val"]:
        v = summary["final_val"]
        parts.append(f"val loss {v['loss']:.5g} {metric_name} {v[metric_name]:.4g}")
    parts.append(f"checkpoint {summary['checkpoint']}, metrics {summary['metrics']}"
                 + (f", plot {summary['plot']}" if summary["plot"] else ""))
    return " | ".join(parts)


def run_directory(out: str) -> dict:
    """What OUT holds (rank 0 looks, ``decide``): a checkpoint, any run file, stale clear-outs."""
    import glob
    return {"checkpoint": os.path.exists(os.path.join(out, CHECKPOINT)),
            "run_files": any(os.path.exists(os.path.join(out, name)) for name in RUN_FILES),
            "stale_clear_out": bool(glob.glob(os.path.join(glob.escape(out), ".overwritten-*")))}


def take_lock(config: dict):
    """OUT/.lock for this job (rank 0, before anything is written); LockHeld names the holder."""
    from .run_lock import RunLock
    return RunLock(config["out"]).acquire(break_lock=bool(config["break_lock"] or config["overwrite"]),
                                          how_to_break="--break-lock (or --overwrite to start over)")


def main(config: dict, given: dict, comm) -> dict:
    """Lock OUT, resolve resume, build, train.  Collective; raises InputError / Diverged / WriteError on
    every rank.  Every branch on what OUT holds is decided on rank 0 and broadcast (``decide``)."""
    agree(comm, preflight, config)
    phase("locking the run directory (rank 0)")
    lock = on_root(comm, take_lock, config, error=InputError)      # rank 0 holds it, None elsewhere
    try:
        if lock is not None and lock.note:
            print(f"refimpl train: note: {lock.note}", file=sys.stderr, flush=True)
        return _main_locked(config, given, comm)
    finally:
        if lock is not None:
            lock.release()


def _main_locked(config: dict, given: dict, comm) -> dict:
    from .config import resume_config
    resume_state, notes = None, []
    path = os.path.join(config["out"], CHECKPOINT)
    held = decide(comm, run_directory, config["out"])
    if config["resume"]:
        if not held["checkpoint"]:
            refuse(f"--resume: {path} does not exist: nothing to resume (drop --resume to start a new run)")
        phase("reading the checkpoint")
        resume_state = agree(comm, checkpoint.read_file, path)
        config, notes = agree(comm, resume_config, resume_state[1]["config"],
                              dict(given, resume=True, out=config["out"]))
    elif held["checkpoint"] and not config["overwrite"]:
        refuse(f"{config['out']} already holds a run ({CHECKPOINT}): pass --resume to continue it, "
               "--overwrite to start over, or another --out")
    elif config["overwrite"] and (held["run_files"] or held["stale_clear_out"]):
        phase("clearing the old run (--overwrite, rank 0)")
        on_root(comm, clear_run, config["out"], error=WriteError)
    trainer = Trainer(config, comm, resume_state, notes)
    if trainer.step == trainer.total_steps and resume_state is not None:
        trainer._say(f"refimpl train: {config['out']} is already at step {trainer.step} of "
                     f"{trainer.total_steps}: nothing to train (give more --steps to continue)")
        return None
    summary = trainer.run()
    if trainer.rank == 0 and not config["quiet"]:
        print(summary_line(summary, trainer.metric_name), flush=True)
    return summary


__all__ = ["InputError", "Diverged", "WriteError", "preflight", "clear_run", "resolve_run", "make_schedule",
           "generate_data", "open_split", "truncate_metrics", "plot_metrics", "Trainer", "summary_line",
           "write_json", "append_line", "main", "CHECKPOINT", "METRICS", "PLOT", "CONFIG", "SUMMARY",
           "RUN_FILES"]
