"""``refimpl convert``: MLPerf HPC CosmoFlow's TFRecord data into refimpl's HDF5 layout, without TensorFlow.

MLPerf's CosmoFlow benchmark data (``cosmoUniverse_2019_05_4parE_tf_v2``: ``train/`` and
``validation/`` directories of ``*.tfrecord`` files, gzip-compressed or not, one
``tf.train.Example`` per sample; ``refimpl/data/tfrecord.py``) becomes ``OUT/train.h5`` and
``OUT/val.h5`` (or ``per-sample`` directories), which ``refimpl train --data OUT`` trains on,
under any grid: each rank then reads only its own block of every sample (docs/data.md).
The counts are stored as float32 channels-first (C, D, H, W), D being the record's first
axis; ``refimpl train`` takes log(1 + counts), as MLPerf's reference does (``apply_log``).
"""
from __future__ import annotations

import argparse
import glob
import os
import sys

EPILOG = """\
examples:
  refimpl convert mlperf-cosmoflow /data/cosmoUniverse_2019_05_4parE_tf_v2 --out data/mlperf
  refimpl convert mlperf-cosmoflow SRC --out data/mlperf_small --samples 1024 --val-samples 128
  mpiexec -n 8 --oversubscribe refimpl train --model cosmoflow --preset mlperf --data data/mlperf \\
      --grid 2,2,2,1 --global-batch 8 --out runs/mlperf

input:  SRC/train/*.tfrecord and SRC/validation/*.tfrecord (SRC/val/ also taken), sorted by name;
        plain or gzip-compressed (told apart by gzip's magic bytes); each record a
        tf.train.Example with 'x' (S, S, S, 4) int16 counts (bytes, C order) and 'y' 4 floats.
output: OUT/train.h5, OUT/val.h5 ('full' (N, 4, S, S, S) float32, 'unitPar' (N, 4) float32;
        --layout per-sample: OUT/train/000000.hdf5 ...), written atomically as datagen's are.
        Every record's CRC-32C is checked (--no-verify skips the data's).
exit status: 0 written, 2 bad input (a damaged or foreign record: its file and record
named; OUT in use), 4 a write failed (disk full).
"""

#: Validation directory names MLPerf's releases use, in the order they are looked for.
VALIDATION_DIRS = ("validation", "val")


def add_arguments(parser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("kind", choices=("mlperf-cosmoflow",),
                        help="the source format: MLPerf HPC CosmoFlow's TFRecords")
    parser.add_argument("source", metavar="SRC", help="directory holding train/ and validation/ of *.tfrecord")
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    parser.add_argument("--samples", type=int, default=None,
                        help="training samples to convert: the first N records (default: all)")
    parser.add_argument("--val-samples", type=int, default=None,
                        help="validation samples: the first M records (default: all; 0 writes no val split)")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip the CRC-32C of each record's data (the length's is always checked)")
    from .datagen import add_output_arguments
    add_output_arguments(parser, "convert")


def run(args) -> int:
    from ..failstop import run_command
    return run_command("convert", None, lambda: convert(args))


def split_files(source: str) -> list[tuple[str, list[str]]]:
    """``[("train", files), ("val", files)]`` of SRC: its ``train/`` and its validation directory
    (``VALIDATION_DIRS``), each's ``*.tfrecord`` sorted; ValueError where SRC holds no training
    files."""
    if not os.path.isdir(source):
        raise ValueError(f"SRC {source} is not a directory (MLPerf's data: a directory with train/ and "
                         "validation/ of *.tfrecord)")
    train = sorted(glob.glob(os.path.join(source, "train", "*.tfrecord")))
    if not train:
        raise ValueError(f"SRC {source}: no train/*.tfrecord (MLPerf's CosmoFlow data has train/ and validation/ "
                         "directories of *.tfrecord files)")
    val = []
    for name in VALIDATION_DIRS:
        val = sorted(glob.glob(os.path.join(source, name, "*.tfrecord")))
        if val:
            break
    return [("train", train), ("val", val)]


def samples_of(files, limit, verify, seen):
    """``(full, unitPar)`` of the records of ``files`` in order, at most ``limit`` (None: all);
    ``seen["shape"]`` the first sample's, which every later one must have."""
    from ..data.tfrecord import mlperf_sample, records
    n = 0
    for path in files:
        for index, record in enumerate(records(path, verify=verify)):
            if limit is not None and n >= limit:
                return
            full, target = mlperf_sample(record, f"{path}: record {index}")
            if seen.setdefault("shape", full.shape) != full.shape:
                raise ValueError(f"{path}: record {index} is a sample of {full.shape}, the first one "
                                 f"{seen['shape']}: one dataset holds one sample shape")
            yield full, target
            n += 1


def convert(args) -> int:
    """Write the splits; bad input is exit 2, a failed write exit 4."""
    import h5py  # noqa: F401  (fail early with a clear ImportError when h5py is absent)
    from tqdm import tqdm

    from refimpl import __version__
    from refimpl.data.layout import write_samples
    from refimpl.errors import WriteError, describe, refuse
    from refimpl.paths import check_writable
    from refimpl.progress import phase
    from refimpl.run_lock import RunLock, describe_holder, live_lock_above

    for flag, value, least in (("--samples", args.samples, 1), ("--val-samples", args.val_samples, 0)):
        if value is not None and value < least:
            refuse(f"{flag} must be >= {least}, got {value}")
    if args.chunk < 1:
        refuse(f"--chunk must be >= 1, got {args.chunk}")
    try:
        splits = split_files(args.source)
        check_writable(args.out, "--out", directory=True)
    except ValueError as err:
        refuse(str(err))
    limits = {"train": args.samples, "val": args.val_samples}
    splits = [(name, files) for name, files in splits if files and limits[name] != 0]
    suffix = ".h5" if args.layout == "single" else ""
    targets = [os.path.join(args.out, name + suffix) for name, _ in splits]
    above = live_lock_above(args.out)
    if above is not None:
        refuse(f"--out {args.out} lies in the directory of a running job ({describe_holder(above[1])}; lock: "
               f"{above[0]}), which may be reading this data: wait for it to end, or choose another --out")
    seen = {}
    params = {"source": "mlperf-cosmoflow-tfrecord", "channels": 4, "counts": True}
    written = []
    try:
        with RunLock(args.out).acquire(break_lock=args.break_lock or args.overwrite,
                                       how_to_break="--break-lock (or --overwrite)") as lock:
            if lock.note:
                print(f"refimpl convert: note: {lock.note}", file=sys.stderr, flush=True)
            existing = [t for t in targets if os.path.exists(t)]
            if existing and not args.overwrite:
                refuse(f"{', '.join(existing)} exists; pass --overwrite to replace")
            first = 0
            for (name, files), target in zip(splits, targets):
                phase(f"writing {target}")
                with tqdm(total=limits[name], unit="sample", desc=f"convert {name}", disable=args.quiet) as bar:
                    count = write_samples(target, samples_of(files, limits[name], args.verify, seen), first,
                                          {"generator": "mlperf-cosmoflow", "params": params,
                                           "refimpl_version": __version__},
                                          layout=args.layout, chunk_edge=args.chunk, progress=bar.update)
                written.append((target, count, len(files)))
                first += count
    except ValueError as err:  # a damaged or foreign record, OUT in use: the split being written left nothing
        refuse(str(err))
    except OSError as err:
        raise WriteError(f"writing {args.out} failed: {describe(err)}", agreed=True) from None
    if not args.quiet:
        for target, count, n_files in written:
            print(f"wrote {target}: {count} samples of {seen['shape']} from {n_files} files")
    return 0
