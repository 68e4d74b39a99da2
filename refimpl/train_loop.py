"""The training loop: ``Trainer`` builds one rank's share of a run from its settings, then steps.

One step on every rank of the (Pn, Pd, Ph, Pw) grid::

    batch  = loader.next_batch()       # this sample group's samples, this rank's hyperslab
    out    = model.forward(x)          # halo exchanges inside the spatial layers
    loss, dout, metrics = model.loss(out, y)     # global-batch mean, same on every rank
    model.backward(dout)               # gradient hooks start bucketed allreduces
    sync.finish()                      # sum over spatial, average over data
    optimizer.step()                   # identical update on every rank

Everything built here that can fail on bad input runs in ``agree`` (or is
refused identically on every rank), so every rank takes the same path
(refimpl/failstop.py).  A NaN/Inf loss is decided collectively too and raises
``Diverged`` everywhere before the bad update is applied (exit status 3); the
last checkpoint stays good.

Resume bit for bit.  Nothing in a step is drawn from a sequential random
stream: the data order of epoch e is ``default_rng([seed, e])`` and dropout
masks hash (seed, counter, element index).  A checkpoint at a step boundary
therefore holds the whole state: parameters, buffers, optimiser state, the
loader position, the dropout counters and the compressor's residuals
(refimpl/checkpoint.py); the learning rate is a pure function of the step.

The pieces live apart, each readable alone: the data (refimpl/train_data.py),
the weight update (refimpl/train_update.py), what the run writes and says
(refimpl/train_report.py); refimpl/train.py owns OUT and builds the Trainer.
"""
from __future__ import annotations

import math
import time

from . import checkpoint
from .backend import resolve_dtype, set_backend
from .errors import Diverged, Preempted, WriteError, refuse
from .failstop import agree, decide
from .progress import label_layers, phase, set_step
from .signals import preemption_requested
from .parallel.objects import allreduce_sum
from .data.identity import changes as data_changes
from .precision import refuse_for_float64 as refuse_tf32_for_float64
from .precision import requested as tf32_requested
from .train_data import data_identities, input_normalization, open_data, read_batch
from .train_report import CHECKPOINT, RunReport
from .train_update import (build_optimizer, compressor_state, exchange_summary, make_gradient_sync, make_schedule,
                           restore_compressor_state)


class Trainer:
    """One rank's model, data, gradient exchange and optimiser (built collectively), and the loop."""

    def __init__(self, config: dict, comm, run: dict, resume_state=None, notes=()):
        """``run``: ``train.resolve_run``'s settings; ``resume_state``: ``checkpoint.read_file``'s result."""
        from .data.loader import Loader
        from .models import build_model
        from .parallel.grid import ProcessGrid
        from .parallel.priority import LayerwiseUpdate

        self.config, self.comm = config, comm
        self.global_batch = run["global_batch"]
        self.notes = list(notes) + select_backend(config, comm)
        self.dtype = resolve_dtype(config["dtype"])
        agree(comm, refuse_tf32_for_float64, config["dtype"])
        tf32 = tf32_requested()
        if tf32 is not None:
            self.notes.append(f"{tf32}: float32 matrix products on a GPU may round to TF32 (10 mantissa bits)")
        self.grid = ProcessGrid(comm, run["dims"])
        self.model = agree(comm, build_model, config["model"], run["model_config"], self.grid,
                           config["seed"], self.dtype, self.global_batch)
        label_layers(self.model)
        self.report = RunReport(config, comm, "mae" if self.model.task == "regression" else "dice")
        self.train_reader, self.val_reader, data_notes = open_data(config, comm, self.model, self.grid,
                                                                   self.global_batch, self.report.say)
        self.notes += data_notes
        self.data_identity = decide(comm, data_identities, self.train_reader, self.val_reader)
        self.steps_per_epoch = self.train_reader.num_samples // self.global_batch
        self.total_steps = config["steps"] if config["steps"] is not None else \
            (config["epochs"] or 1) * self.steps_per_epoch
        self.schedule = agree(comm, make_schedule, config, run, self.steps_per_epoch)
        phase("building the gradient synchronizer")     # a bad --allreduce-option is refused here
        self.sync = make_gradient_sync(config, self.model, self.grid)
        self.optimizer = build_optimizer(config, comm, self.model, self.sync, self.schedule(0))
        self.update = LayerwiseUpdate(self.model, self.sync, self.optimizer)   # finish + step
        self.loader = Loader(self.train_reader, self.global_batch, self.grid.sample_coord,
                             self.grid.dims[0], seed=config["seed"])
        self.step, self.input_norm = 0, None
        if resume_state is not None:
            self._resume(*resume_state)
        elif config["normalize"]:
            self.input_norm = input_normalization(self.train_reader, self.grid, comm)

    def _resume(self, arrays, meta) -> None:
        """Parameters, optimiser, residuals, input statistics, loader position and step of the checkpoint."""
        comm, config = self.comm, self.config
        self._check_data(meta.get("data"))
        self.input_norm = meta.get("input_norm")
        self.notes += agree(comm, checkpoint.restore, arrays, meta, self.model, self.optimizer, self.grid)
        self.notes += agree(comm, restore_compressor_state, self.sync, arrays, meta, self.grid, comm)
        loader = meta["loader"]
        if loader["num_samples"] != self.train_reader.num_samples and config["data_changed_ok"]:
            loader = dict(loader, num_samples=self.train_reader.num_samples, step=0, epoch=loader["epoch"] + 1)
            self.notes.append(f"the training data holds {self.train_reader.num_samples} samples where the "
                              f"checkpoint's held {meta['loader']['num_samples']}: its order starts afresh with "
                              f"epoch {loader['epoch']}")
        agree(comm, self.loader.load_state_dict, loader)
        self.step = int(meta["step"])
        if self.total_steps < self.step:
            length = f"--steps {config['steps']}" if config["steps"] is not None else \
                f"--epochs {config['epochs'] or 1} ({self.total_steps} steps)"
            refuse(f"--resume: {length} is below the {self.step} steps the checkpoint has done; "
                   f"give more than {self.step} steps to train further")

    def _check_data(self, recorded) -> None:
        """Refuse (every rank alike) to resume on data other than the checkpoint's, unless
        --data-changed-ok; a checkpoint without a record (an older refimpl) is noted."""
        if recorded is None:
            self.notes.append("the checkpoint records no data identity (written by an older refimpl): "
                              "the data cannot be checked against it")
            return
        for split in ("train", "val"):
            was, now = recorded.get(split), self.data_identity.get(split)
            if was is None and now is None:
                continue
            found = ["the split was absent" if was is None else "the split is gone" if now is None else ""] \
                if (was is None) != (now is None) else data_changes(was, now)
            if not found:
                continue
            what = f"--resume: the {split} data in {self.config['data']} is not the data the checkpoint trained on " \
                   f"({'; '.join(found)})"
            if not self.config["data_changed_ok"]:
                refuse(f"{what}: restore that data, or pass --data-changed-ok to train on this data anyway")
            self.notes.append(f"{what}; training on it (--data-changed-ok)")

    # ------------------------------------------------------------ the loop
    def run(self) -> dict:
        """Train from ``step`` to ``total_steps``, validating and checkpointing on schedule; the summary."""
        config = self.config
        self.report.saved(self.step if self.step else None)
        self.report.start(self.step, self.total_steps, [f"note: {n}" for n in self.notes] + [self._banner()])
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
            self.report.train_step(record, self.total_steps)
            final = self.step == self.total_steps
            if self.step % config["validate_every"] == 0 or final:
                val = self.validate()
                if val is not None:
                    self.report.validation({"split": "val", "step": self.step, "epoch": epoch, **val})
            saved = self.step % config["checkpoint_every"] == 0 or final
            if saved:
                self.save()
            if not final and self.preempted():
                if not saved:
                    self.save()
                raise Preempted(f"a pre-emption warning (SIGUSR1) arrived; checkpoint written at step {self.step} "
                                f"of {self.total_steps} ({self.report.path(CHECKPOINT)}): run the same command "
                                f"with --resume to continue", agreed=True)
        set_step(None)
        elapsed = time.perf_counter() - started
        summary = {"steps": self.step, "steps_this_run": steps_run, "epochs": self.step / self.steps_per_epoch,
                   "seconds": elapsed, "samples_per_s": steps_run * self.global_batch / max(elapsed, 1e-9),
                   "final_train": last, "final_val": val, **self.report.files(),
                   **exchange_summary(config, self.update, self.sync, steps_run)}
        self.report.finish(summary)
        return summary

    def preempted(self) -> bool:
        """Whether SIGUSR1 reached any rank: decided together at the step boundary, so that every
        rank writes the checkpoint at the same step (one small allreduce per step)."""
        phase("agreeing on a pre-emption warning")
        return allreduce_sum(self.comm, 1 if preemption_requested() else 0) > 0

    def _banner(self) -> str:
        config = self.config
        n_params = sum(int(p.data.size) for p in self.model.parameters())
        return (f"refimpl train: {config['model']} ({config['preset']}, {n_params} parameters) on grid "
                f"{self.grid.dims} = {self.comm.Get_size()} ranks, global batch {self.global_batch}, "
                f"{config['optimizer']} lr {self.schedule(self.step):.3g} ({config['schedule']}), "
                f"{self.total_steps} steps ({self.steps_per_epoch} per epoch), out {config['out']}"
                + (f", resumed at step {self.step}" if self.step else ""))

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
            raise Diverged(f"the loss became {loss} at step {self.step + 1} (on {bad} rank(s)); stopped before "
                           f"the update: {self.report.kept()}. Lower --lr or add --warmup-steps", agreed=True)
        self.model.backward(dout)
        phase("gradient allreduce and optimizer step")
        self.update.step(self.schedule(self.step))     # --priority input-first: deferred per layer
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
            phase("validation forward")
            loss, _, metrics = self.model.loss(self.model.forward(x), y)
            for k, v in {"loss": loss, **metrics}.items():
                totals[k] = totals.get(k, 0.0) + float(v)
            count += 1
        self.model.train()
        return {k: v / count for k, v in totals.items()}

    def _batch(self, loader):
        return read_batch(loader, self.comm, self.model.task, self.dtype, self.input_norm,
                          agreed=self.config["check_data"] != "full")

    # ------------------------------------------------------------ checkpoints
    def save(self) -> None:
        """checkpoint.h5 (rank 0 writes, every rank gives its part), then loss.png redrawn."""
        phase("applying the deferred updates")
        self.update.flush()
        phase("checkpoint write (rank 0 writes, the others wait)")
        meta = {"step": self.step, "epoch": self.loader.epoch, "loader": self.loader.state_dict(),
                "config": {**self.config, "data_changed_ok": False},    # a change is allowed once, not forever
                "input_norm": self.input_norm, "data": self.data_identity}
        try:
            checkpoint.save(self.report.path(CHECKPOINT), self.model, self.optimizer, self.grid, meta,
                            rank_state=compressor_state(self.sync))
        except checkpoint.CheckpointError as err:
            raise WriteError(str(err), agreed=True) from None
        self.report.plot()
        self.report.saved(self.step)


# ---------------------------------------------------------------- what a Trainer is built from

def select_backend(config: dict, comm) -> list[str]:
    """The array module and how device buffers meet MPI, on every rank; the notes to say (device only)."""
    from .parallel.buffers import set_cuda_aware
    agree(comm, set_backend, config["backend"])
    set_cuda_aware(config["cuda_aware"])
    if config["backend"] == "numpy":
        return []
    from .parallel.buffers import device_path_report, mpi_cuda_support
    from .parallel.objects import bcast_object
    # the MPI library is the same on every rank: rank 0 asks it (ompi_info is a process)
    support = None if config["backend"] == "strict" else \
        bcast_object(comm, mpi_cuda_support() if comm.Get_rank() == 0 else None)
    return [agree(comm, device_path_report, config["backend"], support)]


__all__ = ["Trainer", "select_backend"]
