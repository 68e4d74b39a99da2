"""Spatially parallel HDF5 reader: each rank reads only its samples' own hyperslab.

Oyama et al. (2021) read 512^3 CosmoFlow samples in parallel: the rank that
computes spatial block (d, h, w) reads exactly that block of every sample it
trains on, so the bytes a rank reads are its share of the sample, and the
sample never has to exist whole on any rank.  Kumar et al. (2017) keep the
data in memory after the first epoch: ``cache=True`` keeps each local block
(after validation and transform) and serves later epochs from memory.

The block is given as three slices (``spatial_block``); ``block_slices`` makes
them from a grid and a rank's coordinates with ``partition.block_slices``, the
row-major map compute uses.  The reader does no MPI: errors are ValueError on
the rank that sees them (the caller makes them collective).  Everything is
host-side NumPy; the caller moves batches to the device (``backend.asarray``).

A file is untrusted input: before any array is read, every dataset's declared size is
checked against the bytes the file stores for it (``check_stored``), so a 6 KB file that
declares 10^7 samples is refused as damaged on open instead of being trained on.

Counters: ``bytes_read`` is the payload of the hyperslabs taken from files
(cache hits excluded), exactly the block's share; ``file_bytes_read`` is what
the HDF5 library actually pulled from the files after opening them (whole
chunks and index metadata included), measured through a counting file object.
"""
from __future__ import annotations

import io
import json
import os

import numpy

from ..functional.args import triple
from ..parallel import partition
from ..paths import refuse_special
from .layout import DATA_KEY, LABEL_KEY, PER_SAMPLE_SUFFIXES, TARGET_KEY


#: deflate (gzip), the strongest filter every h5py build has, packs at most 1032 bytes into one
DEFLATE_MAX_RATIO = 1032


def byte_size(n: int) -> str:
    """'3.2 GB': a byte count for a message (decimal units)."""
    if n < 1000:
        return f"{n} B"
    for unit in ("kB", "MB", "GB", "TB"):
        n /= 1000
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}"


def check_stored(dataset, path) -> None:
    """ValueError unless the bytes ``path`` stores for ``dataset`` can hold what it declares.

    HDF5 declares a dataset's shape apart from its data: a 6 KB file can declare
    3 GB (an unallocated, or a forged, dataset), and reading it allocates the
    whole before any check can look at the values.  Unfiltered data needs its
    full size in the file, filtered data at least 1/``DEFLATE_MAX_RATIO`` of it,
    and no dataset stores more than the file holds.  Call it before reading.
    """
    name = dataset.name.lstrip("/")
    if dataset.shape is None:
        raise ValueError(f"{path} is damaged: dataset '{name}' has no shape (an empty dataspace)")
    stored, file_size = dataset.id.get_storage_size(), os.path.getsize(path)
    if stored > file_size:
        raise ValueError(f"{path} is damaged: dataset '{name}' claims {byte_size(stored)} of storage "
                         f"in a {byte_size(file_size)} file")
    declared = dataset.size * dataset.dtype.itemsize
    packed = dataset.id.get_create_plist().get_nfilters() > 0
    if declared > stored * (DEFLATE_MAX_RATIO if packed else 1):
        raise ValueError(f"{path} is damaged: dataset '{name}' declares {byte_size(declared)} ({dataset.size} "
                         f"{dataset.dtype}, shape {dataset.shape}) but stores {byte_size(stored)}"
                         + (" compressed" if packed else ""))


def block_slices(spatial_shape, grid, coords):
    """Row-major spatial block of the rank at ``coords`` (d, h, w) in ``grid`` (Pd, Ph, Pw):
    ``partition.block_slices`` (the blocks the layers hold), its arguments checked here."""
    shape = triple(spatial_shape, "spatial_shape")
    grid = triple(grid, "grid", minimum=1)
    coords = triple(coords, "coords")
    for axis, (c, p) in enumerate(zip(coords, grid)):
        if c >= p:
            raise ValueError(f"coords[{axis}] = {c} is outside grid {grid}")
    return partition.block_slices(shape, grid, coords)


class _CountingFile(io.FileIO):
    """A read-only file that counts the bytes HDF5 reads through it."""

    bytes_read = 0

    def readinto(self, buffer):
        n = super().readinto(buffer)
        self.bytes_read += n or 0
        return n

    def read(self, size=-1):
        data = super().read(size)
        self.bytes_read += len(data)
        return data


class _OpenFile:
    """h5py.File on a counting file object; closes both."""

    def __init__(self, path):
        import h5py
        self.path = path
        self.raw = _CountingFile(path, "r")
        try:
            self.h5 = h5py.File(self.raw, "r")
        except OSError as err:
            self.raw.close()
            raise ValueError(f"{path}: not a readable HDF5 file ({err})") from None
        self.opened_at = self.raw.bytes_read

    def close(self):
        self.h5.close()
        self.raw.close()


class HDF5Reader:
    """Read samples' local hyperslabs from one file (``single``) or a directory (``per-sample``).

    ``read(i)`` returns ``(x, y)``: x (C, d, h, w) float32 is the block of
    ``full``; y is ``unitPar`` (T,) float32 (cosmoflow) or the same block of
    ``labels`` (d, h, w) (segmentation).  ``samples`` restricts which sample
    indices this rank may read; ``divisible_by`` requires D, H, W divisible
    (e.g. 32 for five 2x poolings); ``log1p`` applies x -> log(1 + x) to the
    inputs (MLPerf CosmoFlow's transform of counts).
    """

    def __init__(self, path, spatial_block=None, cache: bool = False, divisible_by=1,
                 log1p: bool = False, samples=None):
        self.path = os.fspath(path)
        self.cache = {} if cache else None
        self.log1p = bool(log1p)
        self.bytes_read = 0
        self.file_bytes_read = 0
        self.cache_hits = 0
        if os.path.isdir(self.path):
            self.layout = "per-sample"
            self.files = sorted(os.path.join(self.path, n) for n in os.listdir(self.path)
                                if n.endswith(PER_SAMPLE_SUFFIXES))
            if not self.files:
                raise ValueError(f"{self.path}: directory holds no *.hdf5 / *.h5 sample files")
            for name in self.files:               # a FIFO among them would block the first read
                refuse_special(name, "sample file")
            self._file = None
            first = _OpenFile(self.files[0])
        elif os.path.isfile(self.path):
            self.layout = "single"
            self.files = [self.path]
            first = self._file = _OpenFile(self.path)
        else:
            refuse_special(self.path, "data")
            raise ValueError(f"path {self.path!r} is neither an HDF5 file nor a directory")
        try:
            self._describe(first.h5)
        except ValueError:
            first.close()
            raise
        except (OSError, KeyError, TypeError, RuntimeError) as err:   # h5py on metadata it cannot decode
            first.close()
            raise ValueError(f"{first.path} is damaged: its metadata cannot be read "
                             f"({type(err).__name__}: {err})") from None
        if self._file is None:
            first.close()
        self._checked = {0} if self.layout == "per-sample" else set()
        self._check_divisible(divisible_by)
        self.block = self._check_block(spatial_block)
        self.samples = None if samples is None else frozenset(self._check_index(i) for i in samples)

    # -- validation on open ---------------------------------------------------------------

    def _describe(self, h5) -> None:
        """Shapes, dtypes and kind from the (first) file; ValueError on any mismatch."""
        per_sample = self.layout == "per-sample"
        lead = 0 if per_sample else 1
        name = self.files[0]
        full = self._dataset(h5, DATA_KEY, name)
        check_stored(full, name)
        if full.ndim != 4 + lead:
            layout = "(C, D, H, W)" if per_sample else "(N, C, D, H, W)"
            raise ValueError(f"{name}: dataset '{DATA_KEY}' must be {4 + lead}-D {layout}, "
                             f"got shape {full.shape}")
        if full.dtype != numpy.float32:
            raise ValueError(f"{name}: dataset '{DATA_KEY}' must be float32, got {full.dtype}")
        self.num_samples = len(self.files) if per_sample else full.shape[0]
        self.sample_shape = tuple(full.shape[lead:])                      # (C, D, H, W)
        if TARGET_KEY in h5:
            self.kind, self.target_key = "cosmoflow", TARGET_KEY
        elif LABEL_KEY in h5:
            self.kind, self.target_key = "segmentation", LABEL_KEY
        else:
            raise ValueError(f"{name}: missing dataset '{TARGET_KEY}' (cosmoflow) or "
                             f"'{LABEL_KEY}' (segmentation); found {sorted(h5.keys())}")
        target = self._dataset(h5, self.target_key, name)
        check_stored(target, name)
        if self.kind == "cosmoflow" and (target.ndim != 1 + lead or target.dtype != numpy.float32):
            raise ValueError(f"{name}: dataset '{TARGET_KEY}' must be float32 of "
                             f"{'(T,)' if per_sample else '(N, T)'}, got {target.dtype} {target.shape}")
        if self.kind == "segmentation" and (target.shape[lead:] != self.sample_shape[1:]
                                            or target.dtype.kind not in "iu"):
            raise ValueError(f"{name}: dataset '{LABEL_KEY}' must be integer of spatial shape "
                             f"{self.sample_shape[1:]}, got {target.dtype} {target.shape[lead:]}")
        if not per_sample and target.shape[0] != self.num_samples:
            raise ValueError(f"{name}: dataset '{self.target_key}' holds {target.shape[0]} samples "
                             f"but '{DATA_KEY}' holds {self.num_samples}")
        self.target_shape = tuple(target.shape[lead:])
        self.target_dtype = target.dtype
        self.attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in h5.attrs.items()}
        params = self.attrs.get("params")
        self.classes = json.loads(params).get("classes") if isinstance(params, str) else None

    @staticmethod
    def _dataset(h5, key, name):
        import h5py
        if key not in h5:
            raise ValueError(f"{name}: missing dataset '{key}'; found {sorted(h5.keys())}")
        if not isinstance(h5[key], h5py.Dataset):
            raise ValueError(f"{name}: '{key}' must be a dataset, found a group")
        return h5[key]

    def _check_divisible(self, divisible_by) -> None:
        divisor = triple(divisible_by, "divisible_by", minimum=1)
        spatial = self.sample_shape[1:]
        if any(n % q for n, q in zip(spatial, divisor)):
            raise ValueError(f"{self.path}: sample spatial size {spatial} is not divisible by "
                             f"divisible_by={divisor}")

    def _check_block(self, spatial_block):
        spatial = self.sample_shape[1:]
        if spatial_block is None:
            return tuple(slice(0, n) for n in spatial)
        if len(spatial_block) != 3:
            raise ValueError(f"spatial_block must be 3 slices (d, h, w), got {spatial_block!r}")
        block = []
        for axis, (s, n) in enumerate(zip(spatial_block, spatial)):
            start = 0 if s.start is None else s.start
            stop = n if s.stop is None else s.stop
            if s.step not in (None, 1) or not 0 <= start <= stop <= n:
                raise ValueError(f"spatial_block[{axis}] = {s} must be a unit-step slice within "
                                 f"[0, {n}] (sample spatial size {spatial})")
            block.append(slice(start, stop))
        return tuple(block)

    def _check_index(self, i) -> int:
        if not 0 <= int(i) < self.num_samples:
            raise ValueError(f"sample index {i} is outside [0, {self.num_samples}) of {self.path}")
        return int(i)

    # -- reading --------------------------------------------------------------------------

    @property
    def local_shape(self):
        """(C, d, h, w) of one sample's local block."""
        return (self.sample_shape[0],) + tuple(s.stop - s.start for s in self.block)

    @property
    def local_target_shape(self):
        return self.target_shape if self.kind == "cosmoflow" else self.local_shape[1:]

    @property
    def cache_bytes(self) -> int:
        return 0 if self.cache is None else sum(x.nbytes + y.nbytes for x, y in self.cache.values())

    def read(self, i):
        """(x (C, d, h, w) float32, y) of sample ``i``'s local block; validated on first read.

        With ``cache=True`` the returned arrays are the cached ones: do not modify
        them in place (``read_batch`` copies).
        """
        i = self._check_index(i)
        if self.samples is not None and i not in self.samples:
            raise ValueError(f"sample {i} is not among this reader's samples")
        if self.cache is not None and i in self.cache:
            self.cache_hits += 1
            return self.cache[i]
        x, y = self._read_block(i)
        if self.log1p:
            x = numpy.log1p(x)
        if self.cache is not None:
            self.cache[i] = (x, y)
        return x, y

    def read_batch(self, indices):
        """Stacked local blocks: x (n, C, d, h, w), y (n, T) or (n, d, h, w)."""
        pairs = [self.read(i) for i in indices]
        x = numpy.empty((len(pairs),) + self.local_shape, dtype=numpy.float32)
        y = numpy.empty((len(pairs),) + self.local_target_shape, dtype=self.target_dtype)
        for j, (xj, yj) in enumerate(pairs):
            x[j], y[j] = xj, yj
        return x, y

    def _read_block(self, i):
        if self.layout == "single":
            f, lead, name = self._file, (i,), self.path
        else:
            name = self.files[i]
            f, lead = _OpenFile(name), ()
        try:
            if self.layout == "per-sample" and i not in self._checked:
                self._check_same_layout(f.h5, name)
                self._checked.add(i)
            start = f.raw.bytes_read
            x = numpy.empty(self.local_shape, dtype=numpy.float32)
            if x.size:
                f.h5[DATA_KEY].read_direct(x, source_sel=lead + (slice(None),) + self.block)
            if self.kind == "cosmoflow":
                y = f.h5[TARGET_KEY][lead]
            else:
                y = numpy.empty(self.local_shape[1:], dtype=self.target_dtype)
                if y.size:
                    f.h5[LABEL_KEY].read_direct(y, source_sel=lead + self.block)
            self.file_bytes_read += f.raw.bytes_read - start
        finally:
            if f is not self._file:
                f.close()
        self.bytes_read += x.nbytes + y.nbytes
        self._check_values(x, y, i, name)
        return x, numpy.asarray(y)

    def _check_same_layout(self, h5, name) -> None:
        full = self._dataset(h5, DATA_KEY, name)
        check_stored(full, name)
        if full.shape != self.sample_shape or full.dtype != numpy.float32:
            raise ValueError(f"{name}: dataset '{DATA_KEY}' is {full.dtype} {full.shape}, expected "
                             f"float32 {self.sample_shape} like {self.files[0]}")
        target = self._dataset(h5, self.target_key, name)
        check_stored(target, name)
        if target.shape != self.target_shape or target.dtype != self.target_dtype:
            raise ValueError(f"{name}: dataset '{self.target_key}' is {target.dtype} {target.shape}, "
                             f"expected {self.target_dtype} {self.target_shape}")

    def _check_values(self, x, y, i, name) -> None:
        where = f"in block {tuple((s.start, s.stop) for s in self.block)}"
        if not numpy.isfinite(x).all():
            raise ValueError(f"{name}: dataset '{DATA_KEY}' sample {i} holds NaN or Inf {where}")
        if self.kind == "cosmoflow" and not numpy.isfinite(y).all():
            raise ValueError(f"{name}: dataset '{TARGET_KEY}' sample {i} holds NaN or Inf")
        if self.kind == "segmentation" and y.size:
            top = self.classes if self.classes is not None else numpy.iinfo(y.dtype).max + 1
            if y.min() < 0 or y.max() >= top:
                raise ValueError(f"{name}: dataset '{LABEL_KEY}' sample {i} holds labels outside "
                                 f"[0, {top}) {where}")

    # -- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


__all__ = ["DEFLATE_MAX_RATIO", "byte_size", "check_stored", "block_slices", "HDF5Reader"]
