"""The HDF5 layout (docs/data.md) and its writer, with atomic replacement.

Two layouts hold the same samples:

- ``single``: one file per split (``train.h5``), datasets ``full`` (N, C, D, H, W)
  float32 and ``unitPar`` (N, T) float32 (cosmoflow) or ``labels`` (N, D, H, W)
  uint8 (segmentation), chunked per sample and spatial block.
- ``per-sample``: one directory per split (``train/``) of files ``000000.hdf5``,
  ... each with ``full`` (C, D, H, W) and ``unitPar`` (T,) or ``labels``
  (D, H, W): the layout LBANN's CosmoFlow HDF5 reader reads.

Root attributes: ``format`` ("refimpl-hdf5"), ``version``, ``generator``,
``params`` (JSON), ``seed``, ``first_index`` (global index of the first sample:
sample i used ``default_rng(seed + first_index + i)``), ``layout``; per-sample
files also carry ``sample_index``.

Writes are atomic, through ``atomic.atomic_write`` as checkpoints are: every
file is built under a temporary name beside its target, fsync-ed and renamed
(``os.replace``) only once complete; a ``per-sample`` directory is built as a
temporary directory and renamed as a whole.  A crash never leaves a half-written
file under a final name, and a failed write (a full disk, a file-size limit)
removes the temporary and raises one ``OSError`` naming the target, at the
sample where it happened.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil

from ..atomic import atomic_write, forget_on_abort, hdf5_file, remove_on_abort

FORMAT = "refimpl-hdf5"
VERSION = 1
DATA_KEY = "full"
TARGET_KEY = "unitPar"
LABEL_KEY = "labels"
LAYOUTS = ("single", "per-sample")
PER_SAMPLE_SUFFIXES = (".hdf5", ".h5")
DEFAULT_CHUNK_EDGE = 32


def sample_file_name(i: int) -> str:
    return f"{i:06d}.hdf5"


def chunk_shape(sample_shape, edge: int = DEFAULT_CHUNK_EDGE):
    """Chunk of one sample (C, D, H, W): all channels, spatial cubes of ``edge`` voxels.

    Spatial blocks that are multiples of ``edge`` (e.g. 128 split 2 or 4 ways)
    then read whole chunks only; a chunk is C * edge^3 * 4 bytes (512 KiB for
    C = 4, edge = 32), under HDF5's default 1 MiB chunk cache.
    """
    c, *spatial = sample_shape
    return (c,) + tuple(min(n, edge) for n in spatial)


@contextlib.contextmanager
def atomic_target(path):
    """Yield a temporary path beside ``path``; on success rename it to ``path``.

    For a ``per-sample`` directory (a file goes through ``atomic.atomic_write``).
    On an exception the temporary directory is removed and ``path`` is left as
    it was.  An existing directory target is swapped out and deleted after the
    rename (a directory cannot be replaced in one step).
    """
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    _remove(tmp)
    remove_on_abort(tmp)                   # a signal or fail-stop meanwhile removes it too
    try:
        yield tmp
    except BaseException:
        _remove(tmp)
        raise
    finally:
        forget_on_abort(tmp)
    if os.path.isdir(path) and not os.path.islink(path):
        old = f"{path}.old-{os.getpid()}"
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old)
    else:
        os.replace(tmp, path)


def split_paths(out, name: str) -> tuple:
    """Where split ``name`` ("train", "val") of a dataset directory can be: ``OUT/name.h5``
    (``single``) and ``OUT/name/`` (``per-sample``)."""
    return os.path.join(out, f"{name}.h5"), os.path.join(out, name)


def stale_splits(out, targets) -> list:
    """The splits ``OUT`` holds that a write of ``targets`` would not replace: a split of the
    other layout, or one this write leaves out (no validation samples).  Left there, they would
    mix another dataset into this one (``refimpl train`` reads ``val.h5`` or ``val/``)."""
    targets = {os.path.abspath(t) for t in targets}
    return [p for name in ("train", "val") for p in split_paths(out, name)
            if os.path.lexists(p) and os.path.abspath(p) not in targets]


def remove_splits(paths) -> None:
    """Remove the split files and directories ``paths`` (``stale_splits``)."""
    for path in paths:
        _remove(path)


def _remove(path) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _root_attrs(f, attrs: dict) -> None:
    f.attrs["format"] = FORMAT
    f.attrs["version"] = VERSION
    for key, value in attrs.items():
        f.attrs[key] = json.dumps(value) if isinstance(value, dict) else value


def write_split(path, make_sample, count: int, first_index: int, attrs: dict,
                layout: str = "single", chunk_edge: int = DEFAULT_CHUNK_EDGE,
                progress=None, workers: int = 1) -> None:
    """Write samples ``first_index .. first_index + count - 1`` to ``path`` atomically.

    ``make_sample(global_index) -> (full (C, D, H, W) float32, target)``;
    ``target`` is unitPar (T,) float32 or labels (D, H, W) uint8, picked by
    dtype.  ``attrs`` become root attributes (dicts as JSON).  One sample is in
    memory at a time.  Chunks are ``chunk_shape(sample, chunk_edge)``.
    ``progress`` is called with 1 after each sample.  A failed write raises its
    ``OSError`` (naming the file) at the first sample it hits: nothing is left
    under ``path`` or a temporary name.  ``workers`` threads make the samples
    (``ordered_pool.ordered_map``: in order, each from its own index, so the
    files are the same for any count), up to two each in memory.
    """
    import contextlib

    from .ordered_pool import ordered_map
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    with contextlib.closing(ordered_map(make_sample, range(first_index, first_index + count), workers)) as samples:
        write_samples(path, samples, first_index, attrs, layout, chunk_edge, progress, count=count)


def write_samples(path, samples, first_index: int, attrs: dict, layout: str = "single",
                  chunk_edge: int = DEFAULT_CHUNK_EDGE, progress=None, count=None) -> int:
    """``write_split`` for samples that come as an iterable of ``(full, target)`` (a conversion
    that learns how many there are by reading them); returns how many were written.  Without
    ``count`` the ``single`` layout's datasets grow as samples come (chunked: nothing copied).
    No sample at all is a ValueError, and nothing is left under ``path``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if chunk_edge < 1:
        raise ValueError(f"chunk_edge must be >= 1, got {chunk_edge}")
    attrs = dict(attrs, first_index=first_index, layout=layout)
    if layout == "single":
        written = []
        atomic_write(path, lambda fh: written.append(_write_single(fh, samples, count, attrs, chunk_edge, progress)),
                     binary=True, fsync=True)
        return written[0]
    n = 0
    with atomic_target(path) as tmp:
        os.makedirs(tmp)
        for i, (full, target) in enumerate(samples):
            try:
                atomic_write(os.path.join(tmp, sample_file_name(i)),
                             lambda fh: _write_sample(fh, full, target, dict(attrs, sample_index=first_index + i),
                                                      chunk_edge), binary=True, fsync=True)
            except OSError as err:                 # name the file meant, not the temporary directory
                raise OSError(err.errno, err.strerror, os.path.join(path, sample_file_name(i))) from None
            if progress is not None:
                progress(1)
            n = i + 1
        if not n:
            raise ValueError(f"{path}: no sample to write")
    return n


def _target_key(target) -> str:
    return TARGET_KEY if target.dtype.kind == "f" else LABEL_KEY


def _write_single(binary_file, samples, count, attrs, chunk_edge, progress) -> int:
    """Every sample into one file, (N, ...) datasets created from the first sample's shapes
    (N = ``count``, or growing by one per sample without it); returns N."""
    import numpy

    n = 0
    with hdf5_file(binary_file) as (f, check):
        _root_attrs(f, attrs)
        for i, (full, target) in enumerate(samples):
            key = _target_key(target)
            if i == 0:
                rows, most = (count, count) if count is not None else (1, None)
                data = f.create_dataset(DATA_KEY, (rows,) + full.shape, maxshape=(most,) + full.shape,
                                        dtype=numpy.float32, chunks=(1,) + chunk_shape(full.shape, chunk_edge))
                targets = f.create_dataset(key, (rows,) + target.shape, maxshape=(most,) + target.shape,
                                           dtype=target.dtype,
                                           chunks=(1,) + (target.shape if key == TARGET_KEY else
                                                          chunk_shape((1,) + target.shape, chunk_edge)[1:]))
            elif count is None:
                if full.shape != data.shape[1:] or target.shape != targets.shape[1:]:
                    raise ValueError(f"sample {i} has shapes {full.shape} and {target.shape}, sample 0 "
                                     f"{data.shape[1:]} and {targets.shape[1:]}: one split holds one shape")
                data.resize(i + 1, axis=0)
                targets.resize(i + 1, axis=0)
            data[i] = full
            targets[i] = target
            n = i + 1
            check()                                # end at the first failed write, not the last sample
            if progress is not None:
                progress(1)
        if not n:
            raise ValueError("no sample to write")
    return n


def _write_sample(binary_file, full, target, attrs, chunk_edge) -> None:
    with hdf5_file(binary_file) as (f, _):
        _root_attrs(f, attrs)
        f.create_dataset(DATA_KEY, data=full, chunks=chunk_shape(full.shape, chunk_edge))
        f.create_dataset(_target_key(target), data=target)


__all__ = ["FORMAT", "VERSION", "DATA_KEY", "TARGET_KEY", "LABEL_KEY", "LAYOUTS",
           "sample_file_name", "chunk_shape", "atomic_target", "write_split", "write_samples", "split_paths",
           "stale_splits", "remove_splits"]
