"""The data side of a training run: which files, generated or given; this rank's readers; batches.

Every rank reads its own hyperslab of every sample of its sample group
(``HDF5Reader(path, spatial_block=grid.local_block(...))``, refimpl/data/), so
the files must exist and fit the model on every rank.  What the directory holds
(is there generated data? a validation split?) is decided on rank 0 and
broadcast (``decide``); what can be wrong with the files or their values is
found in ``agree``: a bad file on any rank is one InputError on every rank
(refimpl/failstop.py).  Without --data, rank 0 generates a small dataset for the
model preset into OUT/data first (``generate_data``), so ``refimpl train`` works
on a fresh machine.

Inputs are standardised per channel with the mean and std of the first
``NORMALIZATION_SAMPLES`` training samples (``input_normalization``), computed
once and kept in the checkpoint, so a resumed run feeds the same values.
"""
from __future__ import annotations

import json
import os

from .backend import asarray
from .data.layout import split_paths
from .errors import WriteError, describe, refuse
from .failstop import agree, decide, on_root
from .progress import phase
from .parallel.objects import allreduce_sum

NORMALIZATION_SAMPLES = 32        # the training samples the input statistics are taken from


def open_data(config: dict, comm, model, grid, global_batch: int, say):
    """(train reader, validation reader or None, notes) of this rank; collective.

    Without --data the data is OUT/data, generated there first unless it exists
    (``say`` tells what is generated) and ``config["data"]`` set to it.
    """
    notes = []
    directory = config["data"]
    if directory is None:
        directory = os.path.join(config["out"], "data")
        missing = not decide(comm, os.path.exists, os.path.join(directory, "train.h5"))
        if config["generate"] is False and missing:
            refuse("no --data given and --no-generate: nothing to train on")
        if missing:
            phase("generating data (rank 0)")
            counts = generated_counts(config, model.input_shape)
            say(f"generating a {config['model']} dataset for preset {config['preset']!r} ({counts[0]} + "
                f"{counts[1]} samples of {tuple(model.input_shape)}) in {directory}")
            on_root(comm, generate_data, config, model, directory)   # doubles as the barrier: files complete
        config["data"] = directory
    phase("opening the data")
    train_path = split_path(comm, directory, "train")
    if train_path is None:
        single, per_sample = split_paths(directory, "train")
        refuse(f"--data: {single} does not exist, nor a per-sample directory {per_sample}/ (write one with "
               "'refimpl datagen', or leave --data out to generate a small dataset)")
    train = agree(comm, open_split, train_path, model, grid, config)
    val_path = split_path(comm, directory, "val")
    val = agree(comm, open_split, val_path, model, grid, config) if val_path is not None else None
    if train.num_samples < global_batch:
        refuse(f"{train.path} holds {train.num_samples} samples, fewer than the global batch {global_batch}")
    if val is not None and val.num_samples < global_batch:
        notes.append(f"{val.path} holds fewer samples than the global batch: no validation")
        val = None
    if config["check_data"] == "full":
        phase("checking every sample")
        for reader in (train, val):
            if reader is not None:
                agree(comm, check_all_samples, reader)
    return train, val, notes


def split_path(comm, directory, name):
    """Where split ``name`` ("train", "val") of ``directory`` is, as rank 0 finds it: ``name.h5``
    (the ``single`` layout) or the directory ``name/`` (``per-sample``: one file per sample, as
    LBANN reads them; docs/data.md; ``layout.split_paths``), None where neither is; both is
    refused on every rank (which one is meant cannot be told)."""
    def look():
        single, per_sample = split_paths(directory, name)
        return [p for p, there in ((single, os.path.exists(single)), (per_sample, os.path.isdir(per_sample)))
                if there]
    found = decide(comm, look)
    if len(found) > 1:
        refuse(f"--data: {directory} holds both {found[0]} and {found[1]}/: one split, two layouts; move one away")
    return found[0] if found else None


def data_identities(train, val) -> dict:
    """{"train": identity, "val": identity or None} of the opened splits (data/identity.py):
    what the checkpoint records, and what --resume compares with it."""
    from .data.identity import data_identity
    return {"train": data_identity(train.path), "val": None if val is None else data_identity(val.path)}


def generated_counts(config, input_shape) -> tuple[int, int]:
    """(train, val) samples to generate: given, or about 128 MiB of float32 (16 to 256 train, 1/8 val)."""
    voxels = input_shape[0] * input_shape[1] * input_shape[2] * input_shape[3]
    n_train = config["gen_samples"] or max(16, min(256, (1 << 25) // voxels))
    n_val = config["gen_val_samples"] if config["gen_val_samples"] is not None else max(4, n_train // 8)
    return n_train, n_val


def generate_data(config, model, directory) -> None:
    """Write train.h5 / val.h5 for ``model`` into ``directory`` (one process); WriteError if that fails."""
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
    n_train, n_val = generated_counts(config, model.input_shape)
    try:
        os.makedirs(directory, exist_ok=True)
        write_split(os.path.join(directory, "train.h5"), make, n_train, 0, attrs)
        if n_val:
            write_split(os.path.join(directory, "val.h5"), make, n_val, n_train, attrs)
    except (ValueError, OSError) as err:
        raise WriteError(f"generating data in {directory} failed: {describe(err)}") from None


def open_split(path, model, grid, config):
    """HDF5Reader of this rank's block, checked against the model (``path`` exists: rank 0 said so)."""
    from .data.reader import HDF5Reader
    reader = HDF5Reader(path)                      # validates the layout; whole-sample block
    if reader.sample_shape != tuple(model.input_shape):
        raise ValueError(f"{path}: samples are (C, D, H, W) = {reader.sample_shape} but the {config['model']} "
                         f"preset {config['preset']!r} expects {tuple(model.input_shape)}; set "
                         "[model_config] input_shape in --config or use matching data")
    reader.close()
    log1p = config["log1p"]
    if log1p == "auto":       # MLPerf CosmoFlow trains on log(1 + counts)
        log1p = model.task == "regression" and counts_data(reader.attrs)
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


def counts_data(attrs) -> bool:
    """Whether a split's root attributes (the first file's, for ``per-sample``) say its inputs
    are particle counts, which MLPerf CosmoFlow trains on as log(1 + counts): refimpl datagen's
    ``params.mean_count`` set (not None), or ``params.counts`` true (refimpl convert's MLPerf data)."""
    params = attrs.get("params")
    try:
        params = json.loads(params) if isinstance(params, str) else {}
    except ValueError:
        return False
    return isinstance(params, dict) and (params.get("mean_count") is not None or params.get("counts") is True)


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


def input_normalization(reader, grid, comm):
    """Per-channel (mean, 1/std) of the first training samples, the same on every rank.

    Inputs are standardised with them: MLPerf CosmoFlow's log(1 + counts) has a
    mean near 4 and a spread near 0.4, an offset that stalls a small network.
    Every sample group reads the same samples, so the spatial sum is identical
    on every rank (same values, same reduction).
    """
    import numpy
    local = agree(comm, channel_stats, reader, min(reader.num_samples, NORMALIZATION_SAMPLES))
    total = allreduce_sum(grid.spatial_comm, local)                 # sum of the blocks: whole samples
    mean = total[0] / total[2]
    std = numpy.sqrt(numpy.maximum(total[1] / total[2] - mean * mean, 0.0))
    return [float(m) for m in mean], [float(1.0 / s) if s > 0 else 1.0 for s in std]


def read_batch(loader, comm, task: str, dtype, input_norm, agreed: bool):
    """Next (x, y) on this rank as model-dtype device arrays, x standardised with ``input_norm``.

    ``agreed``: a read error is made collective (--check-data lazy: the samples
    were not all read and checked before training).
    """
    phase("reading a batch")
    batch = agree(comm, loader.next_batch) if agreed else loader.next_batch()
    y = batch.y.astype(dtype) if task == "regression" else batch.y.astype("int64")
    x = batch.x
    if input_norm is not None:
        import numpy
        mean, inv_std = (numpy.asarray(v, dtype=numpy.float32)[:, None, None, None] for v in input_norm)
        x = (x - mean) * inv_std                           # (n, C, d, h, w), per channel
    return asarray(x, dtype=dtype), asarray(y)


__all__ = ["NORMALIZATION_SAMPLES", "open_data", "generated_counts", "generate_data", "open_split",
           "check_all_samples", "channel_stats", "input_normalization", "read_batch"]
