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
    "oracle": ("refimpl.commands.oracle",
               "reference cases per layer, grid and rank; check another implementation's results shard by shard"),
    "plan": ("refimpl.commands.plan",
             "predict step time and memory of every grid for a model, batch and machine, and explain the best"),
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
        p.add_argument("--debug", action="store_true",
                       help="show Python tracebacks on failures (also REFIMPL_DEBUG=1)")
        p.set_defaults(_module=module)
    return parser


def check_settings() -> None:
    """Validate every REFIMPL_* variable (unknown names too), then apply REFIMPL_ALLOCATOR.

    ValueError naming the variable; every rank sees the same environment, so every
    rank refuses alike, before any message.
    """
    from .backend import tune_allocator
    from .settings import check_environment
    check_environment()
    tune_allocator()


def launcher_rank() -> int:
    """This process's rank as the launcher set it (0 when not under one), without starting MPI."""
    import os
    for name in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def launcher_size() -> int:
    """How many processes the launcher started (1 when not under one), without starting MPI."""
    import os
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 1


def main(argv=None) -> int:
    from . import failstop
    from .settings import env_setting
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:                      # the settings, checked before any command (and any message)
        check_settings()
    except ValueError as err:             # every rank refuses; rank 0 says why
        if launcher_rank() == 0:
            print(f"refimpl: error: {err}", file=sys.stderr)
        return failstop.EXIT_BAD_INPUT
    failstop.DEBUG = bool(args.debug or env_setting("REFIMPL_DEBUG"))
    failstop.install_excepthook(args.command)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
