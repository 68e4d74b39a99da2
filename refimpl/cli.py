"""The ``refimpl`` command: one subcommand per module under refimpl/commands/.

Each command module defines ``add_arguments(parser)`` and ``run(args) -> int``;
it imports heavy modules (mpi4py, h5py) inside ``run`` so that ``refimpl --help``
stays fast and works without MPI.
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "check-layer": ("refimpl.commands.check_layer",
                    "run one spatially partitioned layer under mpiexec and compare it with the unpartitioned oracle"),
    "datagen": ("refimpl.commands.datagen", "write a synthetic CosmoFlow or segmentation dataset (HDF5, train/val)"),
    "train": ("refimpl.commands.train",
              "train CosmoFlow or 3D U-Net data x spatial parallel under mpiexec (checkpoints, metrics, plot)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="refimpl",
        description="Hybrid-parallel training of 3D CNNs (CosmoFlow, 3D U-Net) in NumPy/CuPy + mpi4py. "
                    "Run distributed commands under mpiexec, e.g. "
                    "'mpiexec -n 4 refimpl check-layer conv3d --input 1,2,9,9,9 --grid 1,2,2,1'.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_line) in COMMANDS.items():
        p = sub.add_parser(name, help=help_line, description=help_line)
        importlib.import_module(module).add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def check_speed_settings() -> None:
    """Validate REFIMPL_CONV_ALGORITHM and REFIMPL_THREADS, then apply REFIMPL_ALLOCATOR
    (ValueError naming the variable; every rank sees the same environment)."""
    from .backend import tune_allocator
    from .functional import _threads
    from .functional.conv3d import algorithm_setting
    algorithm_setting()
    _threads.thread_count()
    tune_allocator()


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:                      # the speed settings, checked before any command (and any message)
        check_speed_settings()
    except ValueError as err:
        print(f"refimpl: error: {err}", file=sys.stderr)
        return 2
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
