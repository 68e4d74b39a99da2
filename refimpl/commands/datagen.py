"""``refimpl datagen``: write a synthetic train/val dataset in the documented HDF5 layout.

Examples::

    refimpl datagen cosmoflow --out data/cosmo64 --samples 64 --val-samples 16 --size 64
    refimpl datagen segmentation --out data/seg --size 64,64,32 --channels 1 --classes 4
    refimpl datagen cosmoflow --out data/lbann --layout per-sample    # LBANN-style directories

Train sample i is drawn from seed + i and val sample j from seed + samples + j,
so the splits never share a universe and any sample can be regenerated alone.
Files appear under their final names only when complete (tmp + fsync +
os.replace, ``atomic.atomic_write``).  OUT belongs to one datagen at a time
(``OUT/.lock``, ``run_lock.RunLock``): two writing the same files would each
rename a complete file over the other's, mixing two datasets.
"""
from __future__ import annotations

import argparse
import functools
import os

EPILOG = """\
examples:
  refimpl datagen cosmoflow --out data/cosmo64 --samples 64 --val-samples 16 --size 64
  refimpl datagen segmentation --out data/seg --size 64,64,32 --classes 4
  refimpl datagen cosmoflow --out data/lbann --layout per-sample --chunk 32

train sample i is drawn from seed + i, val sample j from seed + samples + j; files
appear under their final names only once complete (tmp file + os.replace).  OUT/.lock
is held while writing: a second datagen into the same OUT exits 2 naming the first.
exit status: 0 written, 2 bad input (or OUT in use), 4 a write failed (disk full).

output (docs/data.md):
  --layout single       OUT/train.h5, OUT/val.h5 with 'full' (N,C,D,H,W) float32 and
                        'unitPar' (N,4) float32 (cosmoflow) or 'labels' (N,D,H,W) uint8
  --layout per-sample   OUT/train/000000.hdf5 ... each with 'full' (C,D,H,W) and
                        'unitPar' (4,) or 'labels' (D,H,W), as LBANN's reader expects

cosmoflow: Gaussian random field with P(k) = A (k/0.5)^n_s exp(-(k/k_d)^2), lognormal
  densities at C redshifts in [0, 3], Poisson counts; unitPar = (sigma, n_s, log10 k_d,
  growth index) mapped to [-1, 1].  Train on log1p of the counts.
segmentation: K-1 classes of rotated ellipsoids on background 0; image = class mean
  per channel + Gaussian noise.
"""


def _size(text: str):
    parts = [int(p) for p in text.split(",")]
    if len(parts) == 1:
        parts *= 3
    if len(parts) != 3 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"--size must be S or D,H,W of positive ints, got {text!r}")
    return tuple(parts)


def add_arguments(parser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("kind", choices=("cosmoflow", "segmentation"), help="which generator")
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    parser.add_argument("--samples", type=int, default=32, help="training samples (default 32)")
    parser.add_argument("--val-samples", type=int, default=8,
                        help="validation samples (default 8; 0 writes no val split)")
    parser.add_argument("--size", type=_size, default=(32, 32, 32),
                        help="spatial size S (cube) or D,H,W (default 32)")
    parser.add_argument("--channels", type=int, default=None,
                        help="channels C (default 4 for cosmoflow: 4 redshifts; 1 for segmentation)")
    parser.add_argument("--seed", type=int, default=0, help="base seed: sample i uses seed + i")
    parser.add_argument("--classes", type=int, default=4,
                        help="segmentation classes K including background (default 4)")
    parser.add_argument("--noise", type=float, default=0.3,
                        help="segmentation image noise std (default 0.3)")
    parser.add_argument("--mean-count", type=float, default=64.0,
                        help="cosmoflow mean particles per voxel (default 64); 0 stores densities")
    from .dataset_output import add_output_arguments
    add_output_arguments(parser, "datagen", "generate the samples")


def run(args) -> int:
    from .dataset_output import run_alone
    return run_alone("datagen", lambda: generate(args))


def generate(args) -> int:
    """Write the splits; bad input is exit 2, a write that fails (disk full) exit 4."""
    import h5py  # noqa: F401  (fail early with a clear ImportError when h5py is absent)
    from tqdm import tqdm

    from refimpl import __version__
    from refimpl.data.cosmo import PARAM_NAMES, generate_universe
    from refimpl.data.layout import write_split
    from refimpl.data.segmentation import generate_segmentation
    from refimpl.errors import WriteError, describe, refuse
    from refimpl.paths import check_writable
    from refimpl.progress import phase

    from .dataset_output import worker_count, writing_into

    if args.samples < 1 or args.val_samples < 0:
        refuse("--samples must be >= 1 and --val-samples >= 0")
    workers = worker_count(args)
    if args.kind == "cosmoflow":
        channels = 4 if args.channels is None else args.channels
        mean_count = args.mean_count if args.mean_count > 0 else None
        make = functools.partial(generate_universe, seed=args.seed, size=args.size,
                                 channels=channels, mean_count=mean_count)
        params = {"size": args.size, "channels": channels, "mean_count": mean_count,
                  "targets": list(PARAM_NAMES)}
    else:
        channels = 1 if args.channels is None else args.channels
        make = functools.partial(generate_segmentation, seed=args.seed, size=args.size,
                                 channels=channels, classes=args.classes, noise=args.noise)
        params = {"size": args.size, "channels": channels, "classes": args.classes,
                  "noise": args.noise}
    suffix = ".h5" if args.layout == "single" else ""
    splits = [("train", args.samples, 0), ("val", args.val_samples, args.samples)]
    splits = [s for s in splits if s[1] > 0]
    targets = [os.path.join(args.out, name + suffix) for name, _, _ in splits]
    try:
        check_writable(args.out, "--out", directory=True)
    except ValueError as err:
        refuse(str(err))
    attrs = {"generator": args.kind, "params": params, "seed": args.seed,
             "refimpl_version": __version__}
    try:
        with writing_into(args, "datagen", targets):
            with tqdm(total=sum(n for _, n, _ in splits), unit="sample", desc=f"datagen {args.kind}",
                      disable=args.quiet) as bar:
                for (_, count, first), target in zip(splits, targets):
                    phase(f"writing {target}")          # what an interrupt or a failure names
                    write_split(target, make, count, first, attrs, layout=args.layout,
                                chunk_edge=args.chunk, progress=bar.update, workers=workers)
    except ValueError as err:  # OUT in use (LockHeld), bad generator arguments: nothing written
        refuse(str(err))
    except OSError as err:     # disk full, ...: the split that failed left nothing, not even a temporary
        raise WriteError(f"writing {args.out} failed: {describe(err)}", agreed=True) from None
    if not args.quiet:
        for target in targets:
            print(f"wrote {target}")
    return 0
