"""Training checkpoints: one HDF5 file, checksummed, written atomically, enough to resume bit for bit.

File layout (format ``refimpl-checkpoint``, version 1)::

    /model/<name>            parameters (PyTorch-style names), from rank 0
    /buffers/<n>/<name>      buffers (batch-norm running stats) of data-parallel rank n
    /optimizer/<slot>.<i>    optimiser state (momentum buffers, Adam moments) of parameter i
    root attributes          format, version, meta (JSON), sha256

``meta`` holds everything that is not an array: step, epoch, the loader
position (``Loader.state_dict``), the dropout seeds and counters (``Dropout.seed``,
``Dropout.step`` per module: masks are counter-based, so these *are* the dropout
RNG state),
the state of every ``numpy.random.Generator`` a module holds, the optimiser's
name / step count / lr, the full run config, the grid and the world size.

Which rank saves what: after gradient synchronisation every rank holds the same
parameters and optimiser state (or, for a layer split over the model axis, the
same slice as the other ranks of its position in the model group: these are
gathered whole first, ``nn.model_parallel.whole_of``), so rank 0 writes them,
and the file is the same whatever the grid; on resume each rank takes its slice.  Buffers may differ
between data-parallel ranks (batch norm with per-sample-group statistics), so
each data rank's buffers are gathered to rank 0 and stored separately (the
models in refimpl.models use global statistics, where they coincide).  Every
rank reads the file on resume and takes its own data rank's buffers.

Integrity: ``sha256`` is the hash of the meta JSON and of every array (name,
dtype, shape, bytes) in sorted name order; a file whose hash does not match,
or that is not a readable checkpoint at all, is refused with CheckpointError.

Atomicity: the file is built in memory, written to ``<path>.tmp-<pid>`` beside
the target, flushed and fsync-ed, then renamed over ``path`` with ``os.replace``
(and the directory fsync-ed).  Until the rename the previous checkpoint is
untouched, so a crash (or SIGKILL) mid-write leaves the last complete checkpoint
in place; a failed write (disk full) removes the temporary and says so.
"""
from __future__ import annotations

import errno
import glob
import hashlib
import json
import os
import time

import numpy

from .backend import to_host
from .failstop import atomic_write, describe
from .parallel.objects import bcast_object

FORMAT = "refimpl-checkpoint"
VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, damaged, or from another setup."""


# ---------------------------------------------------------------- the file (one process)

def checksum(arrays: dict, meta_json: str) -> str:
    """sha256 over the meta JSON and every array (name, dtype, shape, bytes), names sorted."""
    h = hashlib.sha256(meta_json.encode())
    for name in sorted(arrays):
        a = numpy.ascontiguousarray(arrays[name])
        h.update(f"\0{name}\0{a.dtype.str}\0{a.shape}\0".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def write_file(path, arrays: dict, meta: dict) -> None:
    """Write ``arrays`` (name -> host array; '/' makes groups) and ``meta`` atomically.

    The HDF5 file is built in memory first and written with plain Python I/O:
    a disk that fills up (or a file-size limit) then surfaces as one OSError
    (ENOSPC, EFBIG), never as HDF5 error stacks or a crash inside HDF5's close,
    and ``failstop.atomic_write`` leaves the previous checkpoint untouched and no
    temporary behind.
    """
    import io

    import h5py
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    for stale in glob.glob(glob.escape(path) + ".tmp-*"):   # left by a run killed mid-write
        os.remove(stale)
    meta_json = json.dumps(meta, sort_keys=True)
    image = io.BytesIO()
    with h5py.File(image, "w") as f:
        f.attrs["format"] = FORMAT
        f.attrs["version"] = VERSION
        f.attrs["meta"] = meta_json
        for name in sorted(arrays):
            f.create_dataset(name, data=numpy.ascontiguousarray(arrays[name]))
        f.attrs["sha256"] = checksum(arrays, meta_json)
    atomic_write(path, lambda fh: fh.write(image.getbuffer()), binary=True, fsync=True)


def read_file(path):
    """(arrays, meta) of a checkpoint; CheckpointError if it is missing, foreign or damaged."""
    import h5py
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        with h5py.File(path, "r") as f:
            if f.attrs.get("format") != FORMAT:
                raise CheckpointError(f"{path} is not a refimpl checkpoint "
                                      f"(format attribute {f.attrs.get('format')!r})")
            version = int(f.attrs.get("version", -1))
            if version != VERSION:
                raise CheckpointError(f"{path} has checkpoint format version {version}; "
                                      f"this refimpl reads version {VERSION}")
            meta_json, stored = str(f.attrs["meta"]), str(f.attrs["sha256"])
            arrays = {}
            f.visititems(lambda name, obj: arrays.__setitem__(name, obj[()])
                         if isinstance(obj, h5py.Dataset) else None)
    except CheckpointError:
        raise
    except Exception as err:   # truncated / overwritten bytes: HDF5 raises OSError, KeyError, ...
        raise CheckpointError(f"checkpoint {path} is damaged and cannot be read "
                              f"({type(err).__name__}: {err})") from None
    if checksum(arrays, meta_json) != stored:
        raise CheckpointError(f"checkpoint {path} is damaged: its sha256 checksum does not match "
                              "the contents (refusing to resume from it)")
    return arrays, json.loads(meta_json)


# ---------------------------------------------------------------- the training state

def dropout_state(model) -> dict:
    """{module name: {"seed", "step"}} of every Dropout: its whole random state (counter-based masks)."""
    from .nn.dropout import Dropout
    return {name: {"seed": int(m.seed), "step": int(m.step)}
            for name, m in model.named_modules() if isinstance(m, Dropout)}


def generator_states(model) -> dict:
    """State of every numpy.random.Generator held as a module attribute ('<module>:<attr>')."""
    out = {}
    for name, m in model.named_modules():
        for attr, value in vars(m).items():
            if isinstance(value, numpy.random.Generator):
                out[f"{name}:{attr}"] = value.bit_generator.state
    return out


def _set_generators(model, states: dict) -> None:
    modules = dict(model.named_modules())
    for key, state in states.items():
        name, _, attr = key.rpartition(":")
        modules[name].__dict__[attr].bit_generator.state = state


def save(path, model, optimizer, grid, meta: dict, rank_state=None) -> None:
    """Collective over ``grid.comm``: gather buffers per data rank, rank 0 writes ``path``.

    ``meta`` (JSON-serialisable): step, epoch, loader, config, ... ; the
    optimiser, dropout and generator states and the grid are added here.
    ``rank_state``: host arrays local to this rank (the compressor's residuals), saved as
    ``rank/<world rank>/<name>``.
    Returns after the file is complete on every rank (barrier).
    """
    from .nn.model_parallel import buffer_shards, whole_of
    split = buffer_shards(model)
    buffers = {name: to_host(whole_of(b, split.get(name), grid.model_comm)).copy()
               for name, b in model.named_buffers()}
    per_data_rank = grid.data_comm.gather(buffers, root=0)       # data rank 0 of each spatial group
    # parameters split over the model axis (and their optimiser state) are saved whole:
    # gathered over the model group, in the same order on every rank
    shards = [p.shard for p in model.parameters()]
    whole = {name: to_host(whole_of(p.data, p.shard, grid.model_comm)).copy()
             for name, p in model.named_parameters()}
    opt = optimizer.state_dict()
    opt_arrays = {key: to_host(whole_of(a, shards[int(key.rpartition(".")[2])], grid.model_comm))
                  for key, a in sorted(opt["arrays"].items())}
    per_rank = grid.comm.gather(dict(rank_state or {}), root=0)
    if grid.rank == 0:
        arrays = {f"model/{name}": a for name, a in whole.items()}
        arrays.update({f"rank/{r}/{name}": a for r, state in enumerate(per_rank) for name, a in state.items()})
        for n, bufs in enumerate(per_data_rank):
            arrays.update({f"buffers/{n}/{name}": b for name, b in bufs.items()})
        arrays.update({f"optimizer/{key}": a for key, a in opt_arrays.items()})
        meta = dict(meta, optimizer={"name": opt["name"], "step_count": opt["step_count"], "lr": opt["lr"]},
                    dropout=dropout_state(model), generators=generator_states(model),
                    grid=list(grid.dims), world_size=grid.comm.Get_size(),
                    saved_at=time.strftime("%Y-%m-%dT%H:%M:%S"))
        error = None
        try:
            write_file(path, arrays, meta)
        except OSError as err:
            full = err.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
            error = (f"checkpoint not written: {'disk full' if full else 'write failed'} at {path} "
                     f"({describe(err)}); the previous checkpoint, if any, is untouched")
    else:
        error = None
    error = bcast_object(grid.comm, error, root=0)
    if error:
        raise CheckpointError(error)


def restore(arrays: dict, meta: dict, model, optimizer, grid) -> list[str]:
    """Load a checkpoint read by ``read_file`` into model and optimiser on this rank.

    Raises CheckpointError on a mismatch (the same on every rank: every rank read
    the same file).  Returns notes (e.g. buffers taken from another data rank).
    """
    notes = []
    params = {k[len("model/"):]: a for k, a in arrays.items() if k.startswith("model/")}
    saved_pn = len({k.split("/")[1] for k in arrays if k.startswith("buffers/")})
    n = grid.sample_coord if saved_pn == grid.dims[0] else 0
    if saved_pn and saved_pn != grid.dims[0]:
        notes.append(f"checkpoint has buffers of {saved_pn} data-parallel ranks, this grid has "
                     f"{grid.dims[0]}: using data rank {n}'s")
    buffers = {k[len(f"buffers/{n}/"):]: a for k, a in arrays.items() if k.startswith(f"buffers/{n}/")}
    from .nn.model_parallel import buffer_shards, slice_of
    shards = [p.shard for p in model.parameters()]
    own = {name: p.shard for name, p in model.named_parameters()}
    own.update(buffer_shards(model))
    params = {name: slice_of(a, own.get(name)) for name, a in params.items()}   # split: this rank's slice
    buffers = {name: slice_of(a, own.get(name)) for name, a in buffers.items()}
    try:
        model.load_state_dict({**params, **buffers})
        opt_arrays = {k[len("optimizer/"):]: a for k, a in arrays.items() if k.startswith("optimizer/")}
        index = {k: int(k.rpartition(".")[2]) for k in opt_arrays}      # "<slot>.<parameter index>"
        opt_arrays = {k: slice_of(a, shards[index[k]]) if 0 <= index[k] < len(shards) else a
                      for k, a in opt_arrays.items()}
        optimizer.load_state_dict(dict(meta["optimizer"], arrays=opt_arrays))
    except ValueError as err:
        raise CheckpointError(f"checkpoint does not fit this model / optimizer: {err}") from None
    modules = dict(model.named_modules())
    for name, state in meta.get("dropout", {}).items():
        if name not in modules:
            raise CheckpointError(f"checkpoint has dropout state for {name!r}, not in this model")
        modules[name].seed, modules[name].step = int(state["seed"]), int(state["step"])
    _set_generators(model, meta.get("generators", {}))
    return notes


__all__ = ["FORMAT", "VERSION", "CheckpointError", "checksum", "write_file", "read_file",
           "dropout_state", "generator_states", "save", "restore"]
