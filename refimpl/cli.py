"""The ``refimpl`` command: one subcommand per module under refimpl/commands/.

Each command module defines ``add_arguments(parser)`` and ``run(args) -> int``;
it imports heavy modules (mpi4py, h5py) inside ``run`` so that ``refimpl --help``
stays fast and works without MPI.
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

COMMANDS = {
    "check-layer": ("refimpl.commands.check_layer",
                    "run one spatially partitioned layer under mpiexec and compare it with the unpartitioned oracle"),
    "convert": ("refimpl.commands.convert",
                "turn the real CosmoFlow data (MLPerf's TFRecords, the NERSC universes, LBANN's split) into "
                "refimpl's HDF5 layout"),
    "datagen": ("refimpl.commands.datagen", "write a synthetic CosmoFlow or segmentation dataset (HDF5, train/val)"),
    "oracle": ("refimpl.commands.oracle",
               "reference cases per layer, grid and rank; check another implementation's results shard by shard"),
    "plan": ("refimpl.commands.plan",
             "predict step time and memory of every grid for a model, batch and machine, and explain the best"),
    "train": ("refimpl.commands.train",
              "train CosmoFlow or 3D U-Net data x spatial parallel under mpiexec (checkpoints, metrics, plot)"),
}


def load_kinds() -> None:
    """The layer kinds of the files ``$REFIMPL_KINDS`` names, registered before the flags are
    built (check-layer offers them, the oracle reads their cases); a bad value, or a file that
    fails or registers no kind, ends the command with one line (exit 2, as bad input)."""
    from . import layers
    try:
        layers.load_kinds()
    except ValueError as err:
        print(f"refimpl: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def build_parser() -> argparse.ArgumentParser:
    load_kinds()
    parser = argparse.ArgumentParser(
        prog="refimpl",
        description="Hybrid-parallel training of 3D CNNs (CosmoFlow, 3D U-Net) in NumPy/CuPy + mpi4py. "
                    "Run distributed commands under mpiexec, e.g. "
                    "'mpiexec -n 4 --oversubscribe refimpl check-layer conv3d --input 1,2,9,9,9 --grid 1,2,2,1' "
                    "(--oversubscribe: more ranks than cores).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_line) in COMMANDS.items():
        p = sub.add_parser(name, help=help_line, description=help_line)
        importlib.import_module(module).add_arguments(p)
        p.add_argument("--debug", action="store_true",
                       help="show Python tracebacks on failures (also REFIMPL_DEBUG=1)")
        p.set_defaults(_module=module)
        plain_help(p)
    strict_parsing(parser)
    return parser


def strict_parsing(parser: argparse.ArgumentParser) -> None:
    """Every parser, sub-commands included, takes flags only as written (no abbreviations:
    ``--step 10`` is not silently ``--steps``), and remembers itself (``_parser``) so that an
    unknown flag is reported with the usage of the (sub)command it was given to."""
    parser.allow_abbrev = False
    parser.set_defaults(_parser=parser)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                strict_parsing(sub)


def unknown_arguments(parser: argparse.ArgumentParser, extras: list) -> str:
    """'unrecognized arguments: ...' with the closest flag of ``parser`` for each unknown one."""
    import difflib
    flags = [f for a in parser._actions for f in a.option_strings if f.startswith("--")]
    hints = []
    for extra in extras:
        name = extra.split("=", 1)[0]
        if name.startswith("-"):       # compared without the dashes, which every flag shares
            close = difflib.get_close_matches(name.lstrip("-"), [f[2:] for f in flags], n=1, cutoff=0.6)
            if close:
                hints.append(f"{name}: did you mean --{close[0]}?")
    return f"unrecognized arguments: {' '.join(extras)}" + (f" ({'; '.join(hints)})" if hints else "")


#: reST inline literals (``x``) in the command modules' docstrings, which are also their --help
_LITERAL = re.compile(r"``([^`]+)``")


def plain_help(parser: argparse.ArgumentParser) -> None:
    """Help as a terminal shows it: the command modules' docstrings double as their
    ``--help`` text, so their reST literals are written as plain text (``x`` -> x) in the
    description and every option's help, sub-commands included; and the options that must
    be given (``required=True``) are listed as "required arguments", after the positional
    ones and before the options that may be left out."""
    required = [a for a in parser._optionals._group_actions if a.required]
    if required:                          # options that must be given: argparse lists them under "options"
        group = next((g for g in parser._action_groups if (g.title or "").startswith("required")), None) \
            or parser.add_argument_group("required arguments")
        for action in required:
            parser._optionals._group_actions.remove(action)
            group._group_actions.append(action)
    parser._action_groups.sort(key=lambda g: (g is not parser._positionals,
                                              not (g.title or "").startswith("required")))
    if parser.description:
        parser.description = _LITERAL.sub(r"\1", parser.description)
    for action in parser._actions:
        if action.help and action.help is not argparse.SUPPRESS:
            action.help = _LITERAL.sub(r"\1", action.help)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                plain_help(sub)


#: Commands that compute on host arrays only (the planner: cost formulas, and its calibration
#: times the host's convs): the device backend is neither needed nor used, so
#: REFIMPL_BACKEND=cupy, set for a whole job or a shell, does not stop them where CuPy finds
#: no GPU.  Its value is still checked as a name (a typo is refused as everywhere).
HOST_COMMANDS = frozenset({"plan"})


def check_settings(command: str | None = None) -> dict:
    """Validate every REFIMPL_* variable (unknown names too), then apply REFIMPL_ALLOCATOR.

    Returns the parsed values; ValueError naming the variable.  Pure and local: ranks
    may see different environments (a per-node profile), so a command under mpiexec
    agrees on the outcome in its first collective (``failstop.agree_settings``).
    For a command of ``HOST_COMMANDS`` the backend is numpy whatever REFIMPL_BACKEND names.
    """
    from . import precision
    from .backend import set_backend, tune_allocator
    from .settings import SETTINGS, check_environment, parse_setting
    precision.apply(command)        # before anything imports CuPy (REFIMPL_BACKEND=cupy's check does)
    environ = os.environ
    host = command in HOST_COMMANDS
    if host:
        text = environ.get("REFIMPL_BACKEND", "")
        if text.strip() not in SETTINGS["REFIMPL_BACKEND"].choices:
            parse_setting("REFIMPL_BACKEND", text)          # empty: the default; else its one-line refusal
        environ = {k: v for k, v in environ.items() if k != "REFIMPL_BACKEND"}
    values = check_environment(environ)
    if host:
        set_backend("numpy")
        values["REFIMPL_BACKEND"] = "numpy"
    tune_allocator()
    return values


def main(argv=None) -> int:
    """Parse, check the settings, run the command.

    Nothing here starts MPI (building the parser imports no ``mpi4py.MPI``): a
    command initialises it when it takes its communicator, and its first
    collective (``failstop.run_command``) agrees on every rank's settings before
    any other message, so a rank whose ``REFIMPL_*`` value is bad or different
    ends every rank with one line instead of leaving the others blocked.
    """
    from . import failstop
    from .errors import EXIT_BAD_INPUT
    from .settings import env_setting
    from .watchdog import launcher_size
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:                # told with the usage of the (sub)command they were given to
        args._parser.error(unknown_arguments(args._parser, extras))
    if getattr(args, "tf32", None):
        os.environ["REFIMPL_TF32"] = "1"      # train --tf32: the same as REFIMPL_TF32=1 (refimpl/precision.py)
    if args.command is None:
        parser.print_help()
        return 2
    try:                      # the settings, checked before any command (and any message)
        values, error = check_settings(args.command), None
    except ValueError as err:
        values, error = None, str(err)
    failstop.note_settings(error, values)
    if error is not None and launcher_size() == 1:
        print(f"refimpl: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    failstop.DEBUG = bool(args.debug or (error is None and env_setting("REFIMPL_DEBUG")))
    failstop.install_excepthook(args.command)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
