"""Hybrid-parallel training loop: data x spatial parallel CosmoFlow / 3D U-Net under mpiexec.

One step on every rank of the (Pn, Pd, Ph, Pw) grid::

    batch  = loader.next_batch()       # this sample group's samples, this rank's hyperslab
    out    = model.forward(x)          # halo exchanges inside the spatial layers
    loss, dout, metrics = model.loss(out, y)     # global-batch mean, same on every rank
    model.backward(dout)               # gradient hooks start bucketed allreduces
    sync.finish()                      # sum over spatial, average over data
    optimizer.step()                   # identical update on every rank

Errors.  Every rank must take the same path, or the ranks that went on wait
forever in a collective.  So everything that can fail on bad input (config,
grid, model, data files, data values, checkpoint) runs in ``collective``: each
rank tries, the outcomes are allgathered, and if any rank failed *every* rank
raises ``InputError`` with the first message (the command exits with status 2).
A NaN/Inf loss is decided collectively too and raises ``Diverged`` everywhere
before the bad update is applied (status 3); the last checkpoint stays good.

Resume bit for bit.  Nothing in a step is drawn from a sequential random
stream: the data order of epoch e is ``default_rng([seed, e])`` and dropout
masks hash (seed, counter, element index).  A checkpoint at a step boundary
therefore holds the whole state: parameters, buffers, optimiser state, the
loader position and the dropout counters (refimpl/checkpoint.py); the learning
rate is a pure function of the step.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time

from . import checkpoint
from .backend import asarray, resolve_dtype, set_backend
from .config import DEFAULT_LR
from .optim import MLPERF_COSMOFLOW, Schedule, make_optimizer, parse_decay, scaled_lr

CHECKPOINT = "checkpoint.h5"
METRICS = "metrics.jsonl"
PLOT = "loss.png"


class InputError(Exception):
    """Bad input found before (or while) training; raised on every rank with the same message."""


class Diverged(RuntimeError):
    """The loss became NaN or Inf; raised on every rank, before the update is applied."""


def collective(comm, fn, *args, **kwargs):
    """Run ``fn`` on every rank; if it raised anywhere, raise InputError on every rank.

    ``fn`` must not itself make collective calls that a failing rank would skip.
    """
    try:
        result, error = fn(*args, **kwargs), None
    except (ValueError, OSError, KeyError, RuntimeError) as err:
        result, error = None, str(err) or type(err).__name__
    errors = comm.allgather(error)
    failed = [(rank, e) for rank, e in enumerate(errors) if e]
    if failed:
        rank, message = failed[0]
        where = "" if len({e for _, e in failed}) == 1 and len(failed) == len(errors) else f" (rank {rank})"
        raise InputError(message + where)
    return result


# ---------------------------------------------------------------- setup pieces

def resolve_run(config: dict, world_size: int) -> dict:
    """Pure, identical on every rank: grid dims, global batch, lr, schedule settings."""
    from .parallel.grid import parse_grid
    dims = parse_grid(config["grid"]) if config["grid"] else (world_size, 1, 1, 1)
    product = dims[0] * dims[1] * dims[2] * dims[3]
    if product != world_size:
        raise ValueError(f"--grid {','.join(map(str, dims))} holds {product} ranks but mpiexec started "
                         f"{world_size}; run 'mpiexec -n {product} ...' or change --grid")
    batch = config["global_batch"]
    if batch is None:
        batch = dims[0] * max(1, -(-4 // dims[0]))      # 4 samples, rounded up to a multiple of Pn
    if batch % dims[0]:
        raise ValueError(f"--global-batch {batch} must be divisible by Pn={dims[0]} (the grid's "
                         "sample groups each take an equal share)")
    mlperf = config["schedule"] == "mlperf"
    if config["optimizer"] is None:       # MLPerf CosmoFlow trains with SGD; otherwise Adam
        config["optimizer"] = MLPERF_COSMOFLOW["optimizer"] if mlperf else "adam"
    lr = config["lr"] if config["lr"] is not None else \
        (MLPERF_COSMOFLOW["lr"] if mlperf else DEFAULT_LR[config["optimizer"]])
    base_batch = config["base_batch"] if config["base_batch"] is not None else \
        (MLPERF_COSMOFLOW["base_batch"] if mlperf else None)
    return {"dims": dims, "global_batch": batch, "base_lr": lr, "base_batch": base_batch,
            "peak_lr": scaled_lr(lr, batch, base_batch), "decay": parse_decay(config["decay"])}


def make_schedule(config, run, steps_per_epoch) -> Schedule:
    if config["schedule"] == "mlperf":
        warmup = config["warmup_epochs"]
        decay = run["decay"] or parse_decay(MLPERF_COSMOFLOW["decay_epochs"])
        return Schedule("mlperf", run["peak_lr"], base_lr=run["base_lr"], steps_per_epoch=steps_per_epoch,
                        warmup_epochs=MLPERF_COSMOFLOW["warmup_epochs"] if warmup is None else warmup,
                        decay_epochs=decay)
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


def open_split(path, model, grid, config, required: bool):
    """HDF5Reader of this rank's block, checked against the model; None if absent and optional."""
    import h5py

    from .data.reader import HDF5Reader
    if not os.path.exists(path):
        if required:
            raise ValueError(f"--data: {path} does not exist (write it with 'refimpl datagen', "
                             "or leave --data out to generate a small dataset)")
        return None
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
    local = collective(comm, channel_stats, reader, count)
    total = grid.spatial_comm.allreduce(local)                 # sum of the blocks: whole samples
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
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(keep)
    os.replace(tmp, path)


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
    tmp = png_path + ".tmp.png"
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, png_path)


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
        run = collective(comm, resolve_run, config, comm.Get_size())
        self.global_batch = run["global_batch"]
        config["global_batch"] = self.global_batch
        config["grid"] = ",".join(map(str, run["dims"]))
        collective(comm, set_backend, config["backend"])
        set_cuda_aware(config["cuda_aware"])
        self.dtype = resolve_dtype(config["dtype"])
        self.grid = ProcessGrid(comm, run["dims"])
        self.model = collective(comm, build_model, config["model"],
                                {**_preset(config), **config["model_config"]}, self.grid,
                                config["seed"], self.dtype, self.global_batch)
        self.metric_name = "mae" if self.model.task == "regression" else "dice"
        self._prepare_data()
        self.steps_per_epoch = self.train_reader.num_samples // self.global_batch
        self.total_steps = config["steps"] if config["steps"] is not None else \
            (config["epochs"] or 1) * self.steps_per_epoch
        self.schedule = collective(comm, make_schedule, config, run, self.steps_per_epoch)
        self.optimizer = collective(comm, make_optimizer, config["optimizer"], self.model.parameters(),
                                    lr=self.schedule(0), momentum=config["momentum"],
                                    nesterov=config["nesterov"], weight_decay=config["weight_decay"],
                                    betas=tuple(config["betas"]), eps=config["eps"])
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
            self.notes += collective(comm, checkpoint.restore, arrays, meta, self.model,
                                     self.optimizer, self.grid)
            collective(comm, self.loader.load_state_dict, meta["loader"])
            self.step = int(meta["step"])
        self.sync = GradientSynchronizer(self.model.parameters(), self.grid.data_comm,
                                         self.grid.spatial_comm, bucket_bytes=int(config["bucket_mb"] * MIB),
                                         algorithm=config["allreduce"], overlap=config["overlap"])

    # ------------------------------------------------------------ data
    def _prepare_data(self):
        config, comm = self.config, self.comm
        directory = config["data"]
        if directory is None:
            directory = os.path.join(self.out, "data")
            missing = not os.path.exists(os.path.join(directory, "train.h5"))
            if config["generate"] is False and missing:
                raise InputError("no --data given and --no-generate: nothing to train on")
            if missing:
                error = None
                if self.rank == 0:
                    counts = generated_counts(config, self.model.input_shape)
                    self._say(f"generating a {config['model']} dataset for preset {config['preset']!r} "
                              f"({counts[0]} + {counts[1]} samples of "
                              f"{tuple(self.model.input_shape)}) in {directory}")
                    try:
                        generate_data(config, self.model, directory)
                    except (ValueError, OSError) as err:
                        error = f"generating data in {directory} failed: {err}"
                error = comm.bcast(error, root=0)   # doubles as the barrier: files are complete
                if error:
                    raise InputError(error)
            config["data"] = directory
        self.train_reader = collective(comm, open_split, os.path.join(directory, "train.h5"), self.model,
                                       self.grid, config, True)
        self.val_reader = collective(comm, open_split, os.path.join(directory, "val.h5"), self.model,
                                     self.grid, config, False)
        if self.train_reader.num_samples < self.global_batch:
            raise InputError(f"{self.train_reader.path} holds {self.train_reader.num_samples} samples, "
                             f"fewer than the global batch {self.global_batch}")
        if self.val_reader is not None and self.val_reader.num_samples < self.global_batch:
            self.notes.append(f"{self.val_reader.path} holds fewer samples than the global batch: "
                              "no validation")
            self.val_reader = None
        if config["check_data"] == "full":
            for reader in (self.train_reader, self.val_reader):
                if reader is not None:
                    collective(comm, check_all_samples, reader)

    def _batch(self, loader):
        """Next (x, y) on this rank, as model-dtype device arrays; read errors made collective."""
        if self.config["check_data"] == "full":
            batch = loader.next_batch()
        else:
            batch = collective(self.comm, loader.next_batch)
        y = batch.y.astype(self.dtype) if self.model.task == "regression" else batch.y.astype("int64")
        x = batch.x
        if self.input_norm is not None:
            import numpy
            mean, inv_std = (numpy.asarray(v, dtype=numpy.float32)[:, None, None, None] for v in self.input_norm)
            x = (x - mean) * inv_std                           # (n, C, d, h, w), per channel
        return asarray(x, dtype=self.dtype), asarray(y)

    # ------------------------------------------------------------ output
    def _say(self, line: str) -> None:
        if self.rank == 0 and not self.config["quiet"]:
            print(line, flush=True)

    def _write_metrics(self, record: dict) -> None:
        if self.rank == 0:
            with open(os.path.join(self.out, METRICS), "a") as f:
                f.write(json.dumps(record) + "\n")

    def _plot(self) -> None:
        if self.rank == 0 and self.config["plot"] and os.path.exists(os.path.join(self.out, METRICS)):
            plot_metrics(os.path.join(self.out, METRICS), os.path.join(self.out, PLOT), self.metric_name)

    def save(self) -> None:
        meta = {"step": self.step, "epoch": self.loader.epoch, "loader": self.loader.state_dict(),
                "config": self.config, "input_norm": self.input_norm}
        checkpoint.save(os.path.join(self.out, CHECKPOINT), self.model, self.optimizer, self.grid, meta)
        self._plot()

    # ------------------------------------------------------------ the loop
    def train_step(self) -> dict:
        x, y = self._batch(self.loader)
        self.model.train()
        self.model.zero_grad()
        out = self.model.forward(x)
        loss, dout, metrics = self.model.loss(out, y)
        bad = self.comm.allreduce(0 if math.isfinite(loss) else 1)
        if bad:
            raise Diverged(f"the loss became {loss} at step {self.step + 1} (on {bad} rank(s)); stopped "
                           f"before the update: the last good checkpoint is in {self.out}. Lower --lr "
                           "or add --warmup-steps")
        self.model.backward(dout)
        self.sync.finish()
        self.optimizer.lr = self.schedule(self.step)
        self.optimizer.step()
        self.step += 1
        return {"loss": float(loss), **{k: float(v) for k, v in metrics.items()}, "lr": self.optimizer.lr}

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
            loss, _, metrics = self.model.loss(self.model.forward(x), y)
            for k, v in {"loss": loss, **metrics}.items():
                totals[k] = totals.get(k, 0.0) + float(v)
            count += 1
        self.model.train()
        return {k: v / count for k, v in totals.items()}

    def run(self) -> dict:
        from tqdm import tqdm
        cfg = self.config
        if self.rank == 0:
            os.makedirs(self.out, exist_ok=True)
            truncate_metrics(os.path.join(self.out, METRICS), self.step)
            with open(os.path.join(self.out, "config.json"), "w") as f:
                json.dump(cfg, f, indent=2, sort_keys=True)
        for note in self.notes:
            self._say(f"note: {note}")
        n_params = sum(int(p.data.size) for p in self.model.parameters())
        self._say(f"refimpl train: {cfg['model']} ({cfg['preset']}, {n_params} parameters) on grid "
                  f"{self.grid.dims} = {self.comm.Get_size()} ranks, global batch {self.global_batch}, "
                  f"{cfg['optimizer']} lr {self.schedule(self.step):.3g} ({cfg['schedule']}), "
                  f"{self.total_steps} steps ({self.steps_per_epoch} per epoch), out {self.out}"
                  + (f", resumed at step {self.step}" if self.step else ""))
        bar = tqdm(total=self.total_steps, initial=self.step, unit="step", dynamic_ncols=True,
                   disable=self.rank != 0 or cfg["quiet"], file=sys.stderr)
        started, last, val = time.perf_counter(), None, None
        steps_run = 0
        while self.step < self.total_steps:
            t0 = time.perf_counter()
            epoch = self.loader.epoch
            last = self.train_step()
            steps_run += 1
            dt = time.perf_counter() - t0
            record = {"split": "train", "step": self.step, "epoch": epoch, **last,
                      "samples_per_s": self.global_batch / dt, "step_s": dt}
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
        bar.close()
        elapsed = time.perf_counter() - started
        summary = {"steps": self.step, "steps_this_run": steps_run, "epochs": self.step / self.steps_per_epoch,
                   "seconds": elapsed, "samples_per_s": steps_run * self.global_batch / max(elapsed, 1e-9),
                   "final_train": last, "final_val": val, "out": self.out,
                   "checkpoint": os.path.join(self.out, CHECKPOINT), "metrics": os.path.join(self.out, METRICS),
                   "plot": os.path.join(self.out, PLOT) if cfg["plot"] else None}
        if self.rank == 0:
            with open(os.path.join(self.out, "summary.json"), "w") as f:
                json.dump(summary, f, indent=2)
        return summary


def _preset(config):
    from .models import PRESETS
    presets = PRESETS[config["model"]]
    if config["preset"] not in presets:
        raise ValueError(f"--preset {config['preset']!r} is not a {config['model']} preset; "
                         f"choose one of {sorted(presets)}")
    return presets[config["preset"]]


def summary_line(summary: dict, metric_name: str) -> str:
    parts = [f"done: {summary['steps']} steps ({summary['epochs']:.2f} epochs) in {summary['seconds']:.1f} s",
             f"{summary['samples_per_s']:.1f} samples/s"]
    if summary["final_train"]:
        t = summary["final_train"]
        parts.append(f"train loss {t['loss']:.5g} {metric_name} {t[metric_name]:.4g}")
    if summary["final_val"]:
        v = summary["final_val"]
        parts.append(f"val loss {v['loss']:.5g} {metric_name} {v[metric_name]:.4g}")
    parts.append(f"checkpoint {summary['checkpoint']}, metrics {summary['metrics']}"
                 + (f", plot {summary['plot']}" if summary["plot"] else ""))
    return " | ".join(parts)


def main(config: dict, given: dict, comm) -> int:
    """Resolve resume, build, train.  Collective; raises InputError / Diverged on every rank."""
    from .config import resume_config
    resume_state, notes = None, []
    if config["resume"]:
        path = os.path.join(config["out"], CHECKPOINT)
        if not os.path.exists(path):
            raise InputError(f"--resume: {path} does not exist: nothing to resume (drop --resume "
                             "to start a new run)")
        resume_state = collective(comm, checkpoint.read_file, path)
        config, notes = collective(comm, resume_config, resume_state[1]["config"],
                                   dict(given, resume=True, out=config["out"]))
    elif os.path.exists(os.path.join(config["out"], CHECKPOINT)) and not config["overwrite"]:
        raise InputError(f"{config['out']} already holds a run ({CHECKPOINT}): pass --resume to continue "
                         "it, --overwrite to start over, or another --out")
    trainer = Trainer(config, comm, resume_state, notes)
    summary = trainer.run()
    if trainer.rank == 0 and not config["quiet"]:
        print(summary_line(summary, trainer.metric_name), flush=True)
    return summary


__all__ = ["InputError", "Diverged", "collective", "resolve_run", "make_schedule", "generate_data",
           "open_split", "truncate_metrics", "plot_metrics", "Trainer", "summary_line", "main",
           "CHECKPOINT", "METRICS", "PLOT"]
