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

Integrity, in two layers.  The file ends with a trailer, ``TRAILER_MAGIC`` and
the sha256 of every byte before it, checked by ``read_file`` before HDF5
parses anything: a single flipped bit in HDF5's own structures (superblock,
object headers, B-trees, heaps) can send its parser into an endless loop
(found by flipping every byte of a small checkpoint: one bit of 12,116 bytes
hung ``attrs.get``, holding the GIL, so no watchdog thread could even report
it).  Inside the file, ``sha256`` is the hash of the meta JSON and of every
array (name, dtype, shape, bytes) in sorted name order; a file whose hash does
not match, or that is not a readable checkpoint at all, is refused with
CheckpointError.  A file without the trailer (written before it existed, or
with the trailer itself damaged) is read by the inner checks alone.  HDF5
ignores bytes past its end of file, so ``h5py.File(path)`` and ``h5dump`` read
a checkpoint as before.  The file is untrusted until then, and HDF5 declares sizes apart from data (a
6 KB file can declare a 3 GB dataset): ``read_file`` checks the meta's types and
ranges (``META_FIELDS``) and every dataset's dtype and declared size against the
bytes it stores before it reads any array, then reads the arrays one at a time
into the running hash.  Every refusal is one line: "damaged", the file, the field.

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
import math
import os
import time

import numpy

from .backend import to_host
from .data.reader import check_stored
from .atomic import atomic_write
from .errors import describe
from .paths import special_kind
from .parallel.objects import bcast_object

FORMAT = "refimpl-checkpoint"
VERSION = 1
#: the file's last bytes: this, the sha256 (hex) of every byte before it, a newline
TRAILER_MAGIC = b"\nrefimpl-checkpoint sha256 "
TRAILER_LEN = len(TRAILER_MAGIC) + 64 + 1


def _trailer(image) -> bytes:
    return TRAILER_MAGIC + hashlib.sha256(image).hexdigest().encode() + b"\n"


def _check_trailer(path) -> bool:
    """True when the file ends with a trailer whose hash matches every byte before it; False
    when it has none (an older file, or the trailer itself damaged: the inner checks decide);
    CheckpointError when the hash does not match, before HDF5 has parsed a byte."""
    size = os.path.getsize(path)
    if size < TRAILER_LEN:
        return False
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        fh.seek(size - TRAILER_LEN)
        tail = fh.read(TRAILER_LEN)
        if not (tail.startswith(TRAILER_MAGIC) and tail.endswith(b"\n")):
            return False
        fh.seek(0)
        left = size - TRAILER_LEN
        while left > 0:
            chunk = fh.read(min(left, 1 << 24))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
    if h.hexdigest().encode() != tail[len(TRAILER_MAGIC):-1]:
        raise CheckpointError(f"checkpoint {path} is damaged: its sha256 checksum does not match the file's "
                              "bytes (refusing to resume from it)")
    return True


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, damaged, or from another setup."""


# ---------------------------------------------------------------- the file (one process)

def _hash_array(h, name: str, a) -> None:
    a = numpy.ascontiguousarray(a)
    h.update(f"\0{name}\0{a.dtype.str}\0{a.shape}\0".encode())
    h.update(a)


def checksum(arrays: dict, meta_json: str) -> str:
    """sha256 over the meta JSON and every array (name, dtype, shape, bytes), names sorted."""
    h = hashlib.sha256(meta_json.encode())
    for name in sorted(arrays):
        _hash_array(h, name, arrays[name])
    return h.hexdigest()


def write_file(path, arrays: dict, meta: dict) -> None:
    """Write ``arrays`` (name -> host array; '/' makes groups) and ``meta`` atomically.

    The HDF5 file is built in memory first and written with plain Python I/O:
    a disk that fills up (or a file-size limit) then surfaces as one OSError
    (ENOSPC, EFBIG), never as HDF5 error stacks or a crash inside HDF5's close,
    and ``atomic.atomic_write`` leaves the previous checkpoint untouched and no
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
    trailer = _trailer(image.getbuffer())

    def write(fh):
        fh.write(image.getbuffer())
        fh.write(trailer)
    atomic_write(path, write, binary=True, fsync=True)


#: no run takes 2**53 steps (and beyond it a float no longer holds every integer)
MAX_COUNT = 2 ** 53


def _utf8(text) -> bool:
    """Whether ``text`` is a string of UTF-8 (h5py escapes undecodable bytes as surrogates)."""
    if not isinstance(text, str):
        return False
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _count(v) -> bool:
    return type(v) is int and 0 <= v <= MAX_COUNT


def _norm(v) -> bool:
    return v is None or (isinstance(v, list) and len(v) == 2 and all(isinstance(r, list) for r in v)
                         and len(v[0]) == len(v[1])
                         and all(type(x) in (int, float) and math.isfinite(x) for r in v for x in r))


COUNT = (_count, "a count (an integer in [0, 2**53])")
POSITIVE = (lambda v: _count(v) and v > 0, "a positive count")
SEED = (lambda v: type(v) is int and 0 <= v < 2 ** 64, "a seed (an integer in [0, 2**64))")
TABLE = (lambda v: isinstance(v, dict), "a table")

#: the meta fields training computes with, each with what it must be where present ('*': any
#: key of a table); "step" and "config" every checkpoint has
META_FIELDS = {
    "step": COUNT, "epoch": COUNT, "config": TABLE,
    "loader": TABLE, "loader.epoch": COUNT, "loader.step": COUNT, "loader.seed": SEED,
    "loader.global_batch": POSITIVE, "loader.num_samples": POSITIVE,
    "loader.shuffle": (lambda v: isinstance(v, bool), "true or false"),
    "optimizer": TABLE, "optimizer.name": (_utf8, "a name"), "optimizer.step_count": COUNT,
    "optimizer.lr": (lambda v: type(v) in (int, float) and math.isfinite(v), "a finite number"),
    "dropout": TABLE, "dropout.*": TABLE, "dropout.*.seed": SEED, "dropout.*.step": COUNT,
    "generators": TABLE, "generators.*": TABLE,
    "grid": (lambda v: isinstance(v, list) and all(POSITIVE[0](d) for d in v), "a list of positive counts"),
    "world_size": POSITIVE,
    "input_norm": (_norm, "null or two equal-length lists of finite numbers (mean, 1/std)"),
}
REQUIRED_META = ("step", "config")


def _fields(meta: dict, dotted: str) -> list:
    """(name, value) of every field of ``meta`` that ``dotted`` names ('*': any key of a table)."""
    found = [("", meta)]
    for key in dotted.split("."):
        found = [(f"{name}.{k}" if name else k, table[k]) for name, table in found if isinstance(table, dict)
                 for k in (table if key == "*" else [key] if key in table else [])]
    return found


def _check_meta(meta, path) -> None:
    """CheckpointError unless ``meta`` has the fields and the types and ranges training relies on
    (a negative step would divide by zero long after the file was accepted)."""
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {path} is damaged: attribute 'meta' is not a JSON table")
    for field in REQUIRED_META:
        if field not in meta:
            raise CheckpointError(f"checkpoint {path} is damaged: meta has no field '{field}'")
    for pattern, (valid, want) in META_FIELDS.items():
        for name, value in _fields(meta, pattern):
            if not valid(value):
                raise CheckpointError(f"checkpoint {path} is damaged: meta field '{name}' is "
                                      f"{json.dumps(value)[:80]}, not {want}")


def _text(f, key, path) -> str:
    """A string root attribute, refused as damaged unless it is UTF-8 text."""
    value = f.attrs[key]
    if not _utf8(value):
        raise CheckpointError(f"checkpoint {path} is damaged: attribute '{key}' is not UTF-8 text")
    return value


def _datasets(f, path) -> list:
    """(name, dataset) of every dataset, names sorted, each refused as damaged unless its name is
    text, its dtype numeric and its declared size stored in the file (``check_stored``)."""
    import h5py
    found = []
    f.visititems(lambda name, obj: found.append((name, obj)) if isinstance(obj, h5py.Dataset) else None)
    for name, dataset in found:
        if not _utf8(name):
            raise CheckpointError(f"checkpoint {path} is damaged: a dataset name is not UTF-8 text ({name!r})")
        if dataset.dtype.kind not in "biufc":
            raise CheckpointError(f"checkpoint {path} is damaged: dataset '{name}' has dtype "
                                  f"{dataset.dtype}, not a number")
        try:
            check_stored(dataset, path)
        except ValueError as err:
            raise CheckpointError(f"checkpoint {err}") from None
    return sorted(found, key=lambda item: item[0])


def read_file(path):
    """(arrays, meta) of a checkpoint; CheckpointError if it is missing, foreign or damaged.

    Everything is checked before it is used (module docstring, "Integrity"): the
    attributes, the meta's fields, every dataset's dtype and stored size; then the
    arrays are read one by one into the hash, which must match.
    """
    import h5py
    path = os.fspath(path)
    if not os.path.isfile(path):
        kind = special_kind(path)
        raise CheckpointError(f"checkpoint {path} " + (f"is {kind}, not a regular file" if kind else "does not exist"))
    try:
        _check_trailer(path)                  # before HDF5 parses a byte of it
    except OSError as err:
        raise CheckpointError(f"checkpoint {path} cannot be read ({describe(err)})") from None
    try:
        with h5py.File(path, "r") as f:
            if f.attrs.get("format") != FORMAT:
                raise CheckpointError(f"{path} is not a refimpl checkpoint "
                                      f"(format attribute {f.attrs.get('format')!r})")
            version = int(f.attrs.get("version", -1))
            if version != VERSION:
                raise CheckpointError(f"{path} has checkpoint format version {version}; "
                                      f"this refimpl reads version {VERSION}")
            meta_json, stored = _text(f, "meta", path), _text(f, "sha256", path)
            try:
                meta = json.loads(meta_json)
            except (ValueError, RecursionError) as err:
                raise CheckpointError(f"checkpoint {path} is damaged: attribute 'meta' is not JSON "
                                      f"({str(err).splitlines()[0]})") from None
            _check_meta(meta, path)
            h, arrays = hashlib.sha256(meta_json.encode()), {}
            for name, dataset in _datasets(f, path):
                arrays[name] = dataset[()]
                _hash_array(h, name, arrays[name])
    except CheckpointError:
        raise
    except Exception as err:   # truncated / overwritten bytes: HDF5 raises OSError, KeyError, ...
        raise CheckpointError(f"checkpoint {path} is damaged and cannot be read "
                              f"({type(err).__name__}: {describe(err)})") from None
    if h.hexdigest() != stored:
        raise CheckpointError(f"checkpoint {path} is damaged: its sha256 checksum does not match "
                              "the contents (refusing to resume from it)")
    return arrays, meta


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
        generator = vars(modules[name]).get(attr) if name in modules else None
        if not isinstance(generator, numpy.random.Generator):
            raise CheckpointError(f"checkpoint has generator state for {key!r}, not in this model")
        try:
            generator.bit_generator.state = state
        except (KeyError, TypeError, ValueError) as err:      # numpy's checks of a state table
            raise CheckpointError(f"checkpoint is damaged: generator state {key!r} is not one numpy "
                                  f"accepts ({type(err).__name__}: {err})") from None


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
    norm = meta.get("input_norm")
    if norm is not None and len(norm[0]) != model.input_shape[0]:
        raise CheckpointError(f"checkpoint does not fit this model: its input normalisation has "
                              f"{len(norm[0])} channels, the model takes {model.input_shape[0]}")
    modules = dict(model.named_modules())
    for name, state in meta.get("dropout", {}).items():
        if name not in modules:
            raise CheckpointError(f"checkpoint has dropout state for {name!r}, not in this model")
        modules[name].seed, modules[name].step = int(state["seed"]), int(state["step"])
    _set_generators(model, meta.get("generators", {}))
    return notes


__all__ = ["FORMAT", "VERSION", "CheckpointError", "checksum", "write_file", "read_file",
           "dropout_state", "generator_states", "save", "restore"]
