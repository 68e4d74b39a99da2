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

Writes are atomic: everything goes to a temporary name beside the target and is
renamed (``os.replace``) only once complete, so a crash never leaves a
half-written file under the final name.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil

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

    On an exception the temporary file or directory is removed and ``path`` is
    left as it was.  An existing directory target is swapped out and deleted
    after the rename (a directory cannot be replaced in one step).
    """
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    _remove(tmp)
    try:
        yield tmp
    except BaseException:
        _remove(tmp)
        raise
    if os.path.isdir(path) and not os.path.islink(path):
        old = f"{path}.old-{os.getpid()}"
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old)
    else:
        os.replace(tmp, path)


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
                progress=None) -> None:
    """Write samples ``first_index .. first_index + count - 1`` to ``path`` atomically.

    ``make_sample(global_index) -> (full (C, D, H, W) float32, target)``;
    ``target`` is unitPar (T,) float32 or labels (D, H, W) uint8, picked by
    dtype.  ``attrs`` become root attributes (dicts as JSON).  One sample is in
    memory at a time.  Chunks are ``chunk_shape(sample, chunk_edge)``.
    ``progress`` is called with 1 after each sample.
    """
    import h5py
    import numpy

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if chunk_edge < 1:
        raise ValueError(f"chunk_edge must be >= 1, got {chunk_edge}")
    attrs = dict(attrs, first_index=first_index, layout=layout)
    with atomic_target(path) as tmp, contextlib.ExitStack() as open_files:
        if layout == "per-sample":
            os.makedirs(tmp)
        f = None
        for i in range(count):
            full, target = make_sample(first_index + i)
            target_key = TARGET_KEY if target.dtype.kind == "f" else LABEL_KEY
            if layout == "per-sample":
                with h5py.File(os.path.join(tmp, sample_file_name(i)), "w") as g:
                    _root_attrs(g, dict(attrs, sample_index=first_index + i))
                    g.create_dataset(DATA_KEY, data=full,
                                     chunks=chunk_shape(full.shape, chunk_edge))
                    g.create_dataset(target_key, data=target)
            else:
                if f is None:
                    f = open_files.enter_context(h5py.File(tmp, "w"))
                    _root_attrs(f, attrs)
                    f.create_dataset(DATA_KEY, (count,) + full.shape, dtype=numpy.float32,
                                     chunks=(1,) + chunk_shape(full.shape, chunk_edge))
                    f.create_dataset(target_key, (count,) + target.shape, dtype=target.dtype,
                                     chunks=(1,) + (target.shape if target_key == TARGET_KEY else
                                                    chunk_shape((1,) + target.shape, chunk_edge)[1:]))
                f[DATA_KEY][i] = full
                f[target_key][i] = target
            if progress is not None:
                progress(1)


__all__ = ["FORMAT", "VERSION", "DATA_KEY", "TARGET_KEY", "LABEL_KEY", "LAYOUTS",
           "sample_file_name", "chunk_shape", "atomic_target", "write_split"]
