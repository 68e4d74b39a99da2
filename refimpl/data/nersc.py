"""The NERSC CosmoFlow universes (HDF5), cut into sub-volumes: the data the seed paper trains on.

The CosmoFlow simulations hosted at NERSC (``cosmoUniverse_2019_05_4parE``, the source of
MLPerf's TFRecords) are one HDF5 file per universe: ``full``, the (W, W, W, 4) particle counts
(W = 512; channels last: 4 redshifts), and ``unitPar``, its 4 target parameters.  Training
samples are cubes cut from it: MLPerf's ``prepare.py`` cuts 128^3 (64 per universe) and LBANN's
``split_cosmoflow_sample.py`` any width dividing 512; Oyama et al.'s volume study trains on 128^3,
256^3 and 512^3 cuts of the same universes.  ``subvolumes`` cuts them in ``prepare.py``'s
order (the first axis outermost), reading one cube at a time (a universe of 512^3 x 4 int16 is
1 GiB), channels first (refimpl's (C, D, H, W), D the file's first axis); every cube of a
universe carries its parameters.  ``refimpl convert nersc-cosmoflow`` writes them in refimpl's
layout, whole universes to either split (a universe's cubes share its parameters: split across
train and validation they would leak them).

LBANN's ``split_cosmoflow_sample.py`` writes those cubes one per file (``train/000/<universe>_000.hdf5``
...: ``split``, the cube channels first -- its default transpose, (C, S, S, S) with S the
universe's first axis after C, as here -- or channels last with ``--no-transpose``, in the
universe's dtype, and ``unitPar``); ``split_sample`` reads one (``refimpl convert
lbann-cosmoflow``), so a Distconv user trains refimpl on the very samples LBANN reads.
"""
from __future__ import annotations

import itertools

import numpy

DATA_KEY, TARGET_KEY = "full", "unitPar"


def universe_shape(h5, path: str) -> tuple:
    """``(W0, W1, W2, C)`` of the universe in open file ``h5``; ValueError naming ``path`` for a
    file that is not one (no ``full`` / ``unitPar``, other ranks, a non-numeric dtype)."""
    import h5py
    for key in (DATA_KEY, TARGET_KEY):
        if key not in h5 or not isinstance(h5[key], h5py.Dataset):
            raise ValueError(f"{path}: no dataset '{key}' (a NERSC CosmoFlow universe holds 'full' "
                             f"(W, W, W, 4) counts and 'unitPar' (4,)); found {sorted(h5.keys())}")
    full, target = h5[DATA_KEY], h5[TARGET_KEY]
    if full.ndim != 4 or full.dtype.kind not in "iuf":
        raise ValueError(f"{path}: 'full' must be 4-D (W, W, W, C) numbers, channels last; got {full.dtype} "
                         f"{full.shape}")
    if target.ndim != 1 or target.dtype.kind not in "iuf":
        raise ValueError(f"{path}: 'unitPar' must be a 1-D vector of numbers, got {target.dtype} {target.shape}")
    return tuple(full.shape)


def cubes_per_universe(shape, size: int) -> int:
    """How many ``size``^3 cubes ``subvolumes`` cuts from a universe of ``shape`` (W0, W1, W2, C)."""
    return int(numpy.prod([w // size for w in shape[:3]]))


def subvolumes(path: str, size: int, cubes=None):
    """``(full (C, size, size, size) float32, unitPar (T,) float32)`` of every ``size``^3 cube of
    the universe in ``path``, the first axis outermost (MLPerf's ``prepare.py``), or of the cubes
    numbered ``cubes`` in that order; ValueError for a universe whose extents ``size`` does not
    divide, or non-finite parameters."""
    import h5py
    with h5py.File(path, "r") as h5:
        shape = universe_shape(h5, path)
        if any(w % size for w in shape[:3]):
            raise ValueError(f"{path}: --size {size} does not divide the universe's extents {shape[:3]} "
                             "(cubes must tile it)")
        target = numpy.asarray(h5[TARGET_KEY][()], dtype=numpy.float32)
        if not numpy.isfinite(target).all():
            raise ValueError(f"{path}: 'unitPar' holds a NaN or infinity")
        full = h5[DATA_KEY]
        corners = list(itertools.product(*(range(0, w, size) for w in shape[:3])))
        for i in range(len(corners)) if cubes is None else cubes:
            a, b, c = corners[i]
            cube = full[a:a + size, b:b + size, c:c + size, :]                 # (S, S, S, C)
            yield numpy.ascontiguousarray(cube.transpose(3, 0, 1, 2), dtype=numpy.float32), target.copy()


#: The data key of an LBANN split file (``split_cosmoflow_sample.py``); ``full`` is read too.
SPLIT_KEY = "split"


def split_sample(path: str):
    """``(full (C, S, S, S) float32, unitPar (T,) float32)`` of one LBANN split file: ``split``
    (or ``full``) a 4-D cube of any numeric type, channels first (``split_cosmoflow_sample.py``'s
    default) or, where only the last axis differs from the other three, channels last
    (``--no-transpose``; a cube of S = C, e.g. (4, 4, 4, 4), is read as channels first);
    ValueError naming ``path`` for anything else."""
    import h5py
    with h5py.File(path, "r") as h5:
        key = next((k for k in (SPLIT_KEY, DATA_KEY) if isinstance(h5.get(k), h5py.Dataset)), None)
        if key is None or not isinstance(h5.get(TARGET_KEY), h5py.Dataset):
            raise ValueError(f"{path}: an LBANN CosmoFlow sample holds 'split' (or 'full'), a (4, S, S, S) cube, "
                             f"and 'unitPar'; found {sorted(h5.keys())}")
        data, target = h5[key], h5[TARGET_KEY]
        if data.ndim != 4 or data.dtype.kind not in "iuf" or target.ndim != 1 or target.dtype.kind not in "iuf":
            raise ValueError(f"{path}: '{key}' must be a 4-D cube of numbers and 'unitPar' a vector, got "
                             f"{data.dtype} {data.shape} and {target.dtype} {target.shape}")
        shape = data.shape
        if len(set(shape[1:])) == 1:                                           # (C, S, S, S)
            full = numpy.asarray(data[()], dtype=numpy.float32)
        elif len(set(shape[:3])) == 1:                                         # (S, S, S, C)
            full = numpy.ascontiguousarray(data[()].transpose(3, 0, 1, 2), dtype=numpy.float32)
        else:
            raise ValueError(f"{path}: '{key}' of {shape} is not a cube (C, S, S, S) or (S, S, S, C)")
        target = numpy.asarray(target[()], dtype=numpy.float32)
    if not numpy.isfinite(target).all():
        raise ValueError(f"{path}: 'unitPar' holds a NaN or infinity")
    return full, target


__all__ = ["universe_shape", "cubes_per_universe", "subvolumes", "split_sample", "SPLIT_KEY"]
