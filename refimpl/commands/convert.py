"""``refimpl convert``: the real CosmoFlow data into refimpl's HDF5 layout, without TensorFlow.

Three sources, one output:

- ``mlperf-cosmoflow``: MLPerf's benchmark data (``cosmoUniverse_2019_05_4parE_tf_v2``:
  ``train/`` and ``validation/`` directories of ``*.tfrecord`` files, gzip-compressed or not,
  one ``tf.train.Example`` per sample; ``refimpl/data/tfrecord.py``);
- ``nersc-cosmoflow``: the NERSC universes it was cut from (one HDF5 file per universe,
  (W, W, W, 4) counts; ``refimpl/data/nersc.py``), cut into ``--size``^3 cubes: 128^3 as
  MLPerf's, or 256^3 and 512^3 as the seed paper's volume study; whole universes go to the
  validation split (``--val-files``), so no universe's parameters are in both;
- ``lbann-cosmoflow``: those cubes as LBANN's ``split_cosmoflow_sample.py`` writes them, one
  HDF5 file per sample under ``train/`` and ``validation/`` (``nersc.split_sample``).

Each becomes ``OUT/train.h5`` and ``OUT/val.h5`` (or ``per-sample`` directories), which
``refimpl train --data OUT`` trains on, under any grid: each rank then reads only its own block
of every sample (docs/data.md).  The counts are stored as float32 channels-first (C, D, H, W);
``refimpl train`` takes log(1 + counts), as MLPerf's reference does (``apply_log``).
"""
from __future__ import annotations

import argparse
import glob
import os
import time

EPILOG = """\
examples:
  refimpl convert mlperf-cosmoflow /data/cosmoUniverse_2019_05_4parE_tf_v2 --out data/mlperf
  refimpl convert mlperf-cosmoflow SRC --out data/mlperf_small --samples 1024 --val-samples 128 --workers 4
  refimpl convert nersc-cosmoflow /data/cosmoUniverse_2019_05_4parE --size 256 --val-files 16 --out data/c256
  refimpl convert lbann-cosmoflow /data/cosmoflow_lbann_split --out data/lbann
  mpiexec -n 8 --oversubscribe refimpl train --model cosmoflow --preset mlperf --data data/mlperf \\
      --grid 2,2,2,1 --global-batch 8 --out runs/mlperf

mlperf-cosmoflow: SRC/train/*.tfrecord and SRC/validation/*.tfrecord (SRC/val/ also taken),
        sorted by name; plain or gzip-compressed (told apart by gzip's magic bytes); each
        record a tf.train.Example with 'x' (S, S, S, 4) int16 counts (bytes, C order) and 'y'
        4 floats.  Every record's CRC-32C is checked (--no-verify skips the data's).
nersc-cosmoflow: every *.hdf5 under SRC (sorted by path), each one universe: 'full' (W, W, W, 4)
        counts, channels last (any integer or float type), 'unitPar' (4,).  Each is cut into
        (W/S)^3 cubes of --size S (the first axis outermost, as MLPerf's prepare.py); the last
        --val-files universes (default: one in eight) are the validation split.
lbann-cosmoflow: SRC/train/**/*.hdf5 and SRC/validation/**/*.hdf5 (SRC/val/ also taken), sorted by
        path, as LBANN's split_cosmoflow_sample.py writes them: one sample per file, 'split'
        (or 'full') a (4, S, S, S) cube (or (S, S, S, 4), --no-transpose's) of any numeric
        type, 'unitPar' (4,).
output: OUT/train.h5, OUT/val.h5 ('full' (N, 4, S, S, S) float32, 'unitPar' (N, 4) float32;
        --layout per-sample: OUT/train/000000.hdf5 ...), written atomically as datagen's are.
exit status: 0 written, 2 bad input (a damaged or foreign file or record: named; OUT in
use), 4 a write failed (disk full); 130 interrupted.
"""

#: The sources ``refimpl convert`` reads.
KINDS = ("mlperf-cosmoflow", "nersc-cosmoflow", "lbann-cosmoflow")
#: Validation directory names MLPerf's releases use, in the order they are looked for.
VALIDATION_DIRS = ("validation", "val")
#: nersc-cosmoflow's default validation share: one universe in this many.
VAL_FILE_SHARE = 8


def add_arguments(parser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("kind", choices=KINDS,
                        help="the source: MLPerf HPC CosmoFlow's TFRecords, the NERSC universes (HDF5), or "
                             "LBANN's split of them (one HDF5 file per sample)")
    parser.add_argument("source", metavar="SRC", help="mlperf-cosmoflow: the directory holding train/ and "
                        "validation/ of *.tfrecord; nersc-cosmoflow: a directory of universes (*.hdf5); "
                        "lbann-cosmoflow: the directory holding train/ and validation/ of split samples (*.hdf5)")
    parser.add_argument("--size", type=int, default=None,
                        help="nersc-cosmoflow: the edge S of the cubes cut from each universe (required; it "
                             "must divide the universe's extents, e.g. 128, 256 or 512 of 512)")
    parser.add_argument("--val-files", type=int, default=None,
                        help="nersc-cosmoflow: the last K universes are the validation split (default: one "
                             "in eight, none of fewer than eight)")
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    parser.add_argument("--samples", type=int, default=None,
                        help="training samples to convert: the first N records (default: all)")
    parser.add_argument("--val-samples", type=int, default=None,
                        help="validation samples: the first M records (default: all; 0 writes no val split)")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip the CRC-32C of each record's data (the length's is always checked)")
    from .dataset_output import add_output_arguments
    add_output_arguments(parser, "convert", "read the source (gunzip, CRC, parse, transpose)")


def run(args) -> int:
    from .dataset_output import run_alone
    return run_alone("convert", lambda: convert(args))


def split_files(source: str, pattern: str = "*.tfrecord") -> list[tuple[str, list[str]]]:
    """``[("train", files), ("val", files)]`` of SRC: the files matching ``pattern`` under its
    ``train/`` and its validation directory (``VALIDATION_DIRS``), each sorted by path; ``**``
    in ``pattern`` reaches into subdirectories.  ValueError where SRC holds no training files."""
    what = "MLPerf's CosmoFlow data" if pattern == "*.tfrecord" else "LBANN's CosmoFlow split"
    if not os.path.isdir(source):
        raise ValueError(f"SRC {source} is not a directory ({what}: a directory with train/ and validation/)")

    def listed(name):
        return sorted(glob.glob(os.path.join(source, name, pattern), recursive=True))
    train = listed("train")
    if not train:
        raise ValueError(f"SRC {source}: no train/{pattern} ({what} has train/ and validation/ directories of "
                         f"{pattern.split('/')[-1]} files)")
    val = []
    for name in VALIDATION_DIRS:
        val = listed(name)
        if val:
            break
    return [("train", train), ("val", val)]


def universe_files(source: str, size: int, val_files) -> list[tuple[str, list[str]]]:
    """``[("train", files), ("val", files)]`` of nersc-cosmoflow's SRC: every ``*.hdf5`` under it
    (sorted by path, as MLPerf's prepare.py finds them), the last ``val_files`` (default one in
    ``VAL_FILE_SHARE``) for validation; the first universe is opened to check it and ``size``."""
    import h5py

    from ..data.nersc import universe_shape
    if size is None:
        raise ValueError("nersc-cosmoflow needs --size S, the edge of the cubes cut from each universe")
    if size < 1:
        raise ValueError(f"--size must be >= 1, got {size}")
    if not os.path.isdir(source):
        raise ValueError(f"SRC {source} is not a directory (the NERSC universes: a directory of *.hdf5)")
    files = sorted(os.path.join(d, n) for d, _, names in os.walk(source) for n in names if n.endswith(".hdf5"))
    if not files:
        raise ValueError(f"SRC {source}: no *.hdf5 universe under it")
    k = len(files) // VAL_FILE_SHARE if val_files is None else val_files
    if not 0 <= k < len(files):
        raise ValueError(f"--val-files must be in [0, {len(files) - 1}] (SRC holds {len(files)} universes and "
                         f"training needs one), got {k}")
    with h5py.File(files[0], "r") as h5:
        shape = universe_shape(h5, files[0])
    if any(w % size for w in shape[:3]):
        raise ValueError(f"--size {size} does not divide the universe's extents {shape[:3]} ({files[0]})")
    return [("train", files[:len(files) - k]), ("val", files[len(files) - k:])]


def units_of(kind, files, size):
    """The units of reading, in order, each ``(path, cubes)``: a whole TFRecord file
    (mlperf-cosmoflow; ``cubes`` None), one LBANN split file (lbann-cosmoflow) or one cube of
    a universe (nersc-cosmoflow: ``(i,)``, its count from the file's own shape, so a worker
    holds one cube, not a universe)."""
    if kind != "nersc-cosmoflow":
        yield from ((path, None) for path in files)
        return
    import h5py

    from ..data.nersc import cubes_per_universe, universe_shape
    from ..errors import describe
    for path in files:
        try:
            with h5py.File(path, "r") as h5:
                n = cubes_per_universe(universe_shape(h5, path), size)
        except OSError as err:
            raise ValueError(f"{path}: cannot be read as HDF5 ({describe(err)})") from None
        yield from ((path, (i,)) for i in range(n))


def unit_samples(kind, verify, size, unit):
    """``(full, unitPar, where)`` of each sample of one unit (``units_of``), ``where`` naming its
    file and record or cube; a source that cannot be read is a ValueError naming it (not the
    writer's OSError)."""
    from ..data.nersc import split_sample, subvolumes
    from ..data.tfrecord import mlperf_sample, records
    from ..errors import describe
    path, cubes = unit
    try:
        if kind == "lbann-cosmoflow":
            yield split_sample(path) + (path,)
        elif kind == "mlperf-cosmoflow":
            for i, record in enumerate(records(path, verify=verify)):
                where = f"{path}: record {i}"
                yield mlperf_sample(record, where) + (where,)
        else:
            for i, (full, target) in zip(cubes, subvolumes(path, size, cubes)):
                yield full, target, f"{path}: cube {i}"
    except OSError as err:
        raise ValueError(f"{path}: cannot be read ({describe(err)})") from None


def unit_sample_list(kind, verify, size, unit) -> list:
    """``unit_samples`` as a list: what a worker thread returns (its reading done on that thread)."""
    return list(unit_samples(kind, verify, size, unit))


def samples_of(kind, files, limit, args, seen):
    """``(full, unitPar)`` of the records (mlperf-cosmoflow), split files (lbann-cosmoflow) or
    cubes (nersc-cosmoflow) of ``files`` in order, at most ``limit`` (None: all), read on
    ``args.workers`` threads (``ordered_map``: the same samples in the same order for any
    count); ``seen["shape"]`` the first sample's, which every later one must have."""
    import contextlib
    import functools

    from ..data.ordered_pool import ordered_map
    read = unit_samples if args.workers == 1 else unit_sample_list       # one thread streams a file's records
    n = 0
    with contextlib.closing(ordered_map(functools.partial(read, kind, args.verify, args.size),
                                        units_of(kind, files, args.size), args.workers)) as units:
        for unit in units:
            for full, target, where in unit:
                if limit is not None and n >= limit:
                    return
                if seen.setdefault("shape", full.shape) != full.shape:
                    raise ValueError(f"{where} is a sample of {full.shape}, the first one {seen['shape']}: one "
                                     "dataset holds one sample shape")
                yield full, target
                n += 1


def expected_samples(args, files, limit) -> int:
    """The progress bar's total: ``limit`` or fewer; MLPerf's files hold one record each (its
    ``prepare.py``), LBANN's one sample; a universe (nersc-cosmoflow) holds (W/S)^3 cubes, W from its first file."""
    if args.kind != "nersc-cosmoflow":
        total = len(files)
    else:
        import h5py

        from ..data.nersc import cubes_per_universe, universe_shape
        with h5py.File(files[0], "r") as h5:
            total = len(files) * cubes_per_universe(universe_shape(h5, files[0]), args.size)
    return total if limit is None else min(limit, total)


def convert(args) -> int:
    """Write the splits; bad input is exit 2, a failed write exit 4."""
    import h5py  # noqa: F401  (fail early with a clear ImportError when h5py is absent)
    from tqdm import tqdm

    from refimpl import __version__
    from refimpl.data.layout import write_samples
    from refimpl.errors import WriteError, describe, refuse
    from refimpl.paths import check_writable
    from refimpl.progress import phase

    from .dataset_output import worker_count, writing_into

    for flag, value, least in (("--samples", args.samples, 1), ("--val-samples", args.val_samples, 0)):
        if value is not None and value < least:
            refuse(f"{flag} must be >= {least}, got {value}")
    if args.chunk < 1:
        refuse(f"--chunk must be >= 1, got {args.chunk}")
    args.workers = worker_count(args)
    try:
        if args.kind != "nersc-cosmoflow":
            for flag, value in (("--size", args.size), ("--val-files", args.val_files)):
                if value is not None:
                    raise ValueError(f"{flag} is nersc-cosmoflow's ({args.kind}'s samples are cut already, and "
                                     "split); leave it out")
        if args.kind != "mlperf-cosmoflow" and not args.verify:
            raise ValueError("--no-verify is mlperf-cosmoflow's (TFRecords carry CRCs; HDF5 files do not); "
                             "leave it out")
        if args.kind == "mlperf-cosmoflow":
            splits = split_files(args.source)
        elif args.kind == "lbann-cosmoflow":
            splits = split_files(args.source, os.path.join("**", "*.hdf5"))
        else:
            splits = universe_files(args.source, args.size, args.val_files)
        check_writable(args.out, "--out", directory=True)
    except ValueError as err:
        refuse(str(err))
    limits = {"train": args.samples, "val": args.val_samples}
    splits = [(name, files) for name, files in splits if files and limits[name] != 0]
    suffix = ".h5" if args.layout == "single" else ""
    targets = [os.path.join(args.out, name + suffix) for name, _ in splits]
    seen = {}
    params = {"source": args.kind, "counts": True}
    if args.kind == "nersc-cosmoflow":
        params["cube"] = args.size
    written = []
    try:
        with writing_into(args, "convert", targets):
            first = 0
            for (name, files), target in zip(splits, targets):
                phase(f"writing {target}")
                started = time.perf_counter()
                with tqdm(total=expected_samples(args, files, limits[name]), unit="sample", desc=f"convert {name}",
                          disable=args.quiet) as bar:
                    count = write_samples(target, samples_of(args.kind, files, limits[name], args, seen), first,
                                          {"generator": args.kind, "params": params,
                                           "refimpl_version": __version__},
                                          layout=args.layout, chunk_edge=args.chunk, progress=bar.update)
                written.append((target, count, len(files), time.perf_counter() - started))
                first += count
    except ValueError as err:  # a damaged or foreign record, OUT in use: the split being written left nothing
        refuse(str(err))
    except OSError as err:
        raise WriteError(f"writing {args.out} failed: {describe(err)}", agreed=True) from None
    if not args.quiet:
        for target, count, n_files, seconds in written:
            print(f"wrote {target}: {count} samples of {seen['shape']} from {n_files} "
                  f"{'universes' if args.kind == 'nersc-cosmoflow' else 'files'} in {seconds:.1f} s "
                  f"({count / max(seconds, 1e-9):.1f} samples/s, {args.workers} reader threads)")
    return 0
