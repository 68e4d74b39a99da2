"""``refimpl train``'s run: OUT locked and checked, a new run or a resumed one, the settings resolved, trained.

The loop is refimpl/train_loop.py (``Trainer``), the data it reads
refimpl/train_data.py, its weight update refimpl/train_update.py, what it
writes and says refimpl/train_report.py; this module owns OUT around them.

Errors (refimpl/failstop.py).  Every rank must take the same path, or the ranks
that went on wait forever in a collective.  So everything that can fail on bad
input (config, grid, model, data files, data values, checkpoint) runs in
``agree``: each rank tries, the outcomes are allgathered, and if any rank failed
*every* rank raises ``InputError`` with the first message (exit status 2).
Every path the run writes is checked writable on every rank before the first
message (``preflight``).  What rank 0 writes for everyone (config, metrics,
plot, checkpoint, summary, generated data) runs in ``on_root``: the outcome is
broadcast and a failure raises ``WriteError`` on every rank (status 4).  Every
branch on what OUT holds (a checkpoint to resume, an old run to clear) is
decided on rank 0 and broadcast (``decide``): another rank may see the shared
file system change under it.  A NaN/Inf loss raises ``Diverged`` on every rank
(status 3, refimpl/train_loop.py).  What escapes all that (an exception on one
rank inside a layer) ends the job from that rank, and a rank that stops
answering is named by the watchdog (status 5): ``failstop.run_command``, which
``refimpl train`` runs under.

A job owns its OUT: rank 0 takes ``OUT/.lock`` (refimpl/run_lock.py) before
anything is written there, and releases it on every way out.
"""
from __future__ import annotations

import math
import os
import sys

from . import checkpoint
from .config import effective_settings
from .errors import InputError, WriteError, refuse
from .failstop import agree, decide, on_root
from .paths import check_writable
from .progress import phase
from .optim import parse_decay, scaled_lr
from .train_loop import Trainer
from .train_report import CHECKPOINT, RUN_FILES


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
    phase("building the model and the data pipeline")
    run = agree(comm, resolve_run, config, comm.Get_size())
    trainer = Trainer(config, comm, run, resume_state, notes)
    if trainer.step == trainer.total_steps and resume_state is not None:
        trainer.report.say(f"refimpl train: {config['out']} is already at step {trainer.step} of "
                           f"{trainer.total_steps}: nothing to train (give more --steps to continue)")
        return None
    return trainer.run()


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


def take_lock(config: dict):
    """OUT/.lock for this job (rank 0, before anything is written); LockHeld names the holder."""
    from .run_lock import RunLock
    return RunLock(config["out"]).acquire(break_lock=bool(config["break_lock"] or config["overwrite"]),
                                          how_to_break="--break-lock (or --overwrite to start over)")


def run_directory(out: str) -> dict:
    """What OUT holds (rank 0 looks, ``decide``): a checkpoint, any run file, stale clear-outs."""
    import glob
    return {"checkpoint": os.path.exists(os.path.join(out, CHECKPOINT)),
            "run_files": any(os.path.exists(os.path.join(out, name)) for name in RUN_FILES),
            "stale_clear_out": bool(glob.glob(os.path.join(glob.escape(out), ".overwritten-*")))}


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


def resolve_run(config: dict, world_size: int) -> dict:
    """Pure, identical on every rank: grid dims, global batch, lr, schedule settings.

    The defaults resolved here (optimizer, lr, base batch, warmup epochs), the
    global batch and the grid are written back into ``config``, so config.json
    and the checkpoint say what ran.
    """
    from .parallel.grid import format_grid, parse_grid, world_mismatch
    dims = parse_grid(config["grid"]) if config["grid"] else (world_size, 1, 1, 1)
    product = math.prod(dims)
    if product != world_size:
        raise ValueError(world_mismatch(format_grid(dims), product, world_size))
    batch = config["global_batch"]
    if batch is None:
        batch = dims[0] * max(1, -(-4 // dims[0]))      # 4 samples, rounded up to a multiple of Pn
    if batch % dims[0]:
        raise ValueError(f"--global-batch {batch} must be divisible by Pn={dims[0]} (the grid's "
                         "sample groups each take an equal share)")
    effective = effective_settings(config)        # MLPerf CosmoFlow: SGD; otherwise Adam, ...
    for key in ("optimizer", "lr", "base_batch", "warmup_epochs"):
        config[key] = effective[key]
    config["global_batch"], config["grid"] = batch, ",".join(map(str, dims))
    lr, base_batch = config["lr"], config["base_batch"]
    return {"dims": dims, "global_batch": batch, "base_lr": lr, "base_batch": base_batch,
            "peak_lr": scaled_lr(lr, batch, base_batch), "decay": parse_decay(effective["decay"]),
            "model_config": effective["model_config"]}


__all__ = ["main", "preflight", "take_lock", "run_directory", "clear_run", "resolve_run"]
