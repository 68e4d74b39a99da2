"""``refimpl check-layer``: one partitioned layer vs. the unpartitioned oracle, under mpiexec.

Every rank draws the same global input, parameters and output gradient from
``--seed``; each takes its block (samples split over Pn, volume over
Pd x Ph x Pw), runs the spatially partitioned layer forward and backward, and
rank 0 gathers y and dx, sums dw and db over all ranks (the unpartitioned
gradient sums over the whole batch) and compares with ``refimpl.functional`` on
the whole tensor.  One JSON line reports the max relative error
``max|a - b| / max|b|`` of each array; the exit status is 1 above tolerance.
``--save`` writes the gathered global arrays to an .npz for independent checks.
The check itself is refimpl/check.py; the layers it knows, refimpl/layers/.

Exit status: 0 every array within tolerance; 1 a mismatch; 2 bad input (one
line, every rank; a --save path that cannot be written included); 4 --save
failed while writing; 70 an internal error.  A failure on any one rank ends
every rank with one message (refimpl/failstop.py).

Example:
    mpiexec -n 4 --oversubscribe refimpl check-layer conv3d --input 2,3,11,9,7 --out-channels 5 \\
        --kernel 3,2,5 --stride 2,1,1 --padding 1,0,2 --dilation 1,2,1 --grid 1,2,2,1
"""
from __future__ import annotations

import argparse
import json
import math
import os

import numpy

from .. import layers
from ..check import ALGORITHMS, TOLERANCE, LayerCheck, check_layer
from ..atomic import atomic_write
from ..paths import check_writable

#: every --model-parallel mode some layer kind takes, 'none' first
MODEL_MODES = tuple(dict.fromkeys(mode for name in layers.names() for mode in layers.lookup(name).model_modes))


def _ints(text, name):
    """'3' or '3,2,5' as a tuple of ints (how many it needs is LayerCheck's rule)."""
    try:
        return tuple(int(t) for t in str(text).split(","))
    except ValueError:
        raise ValueError(f"--{name} must be comma-separated integers, got {text!r}") from None


def _padding(text):
    """'same', 'valid', or 1, 3 or 6 comma-separated integers (LayerCheck checks the count)."""
    text = str(text).strip()
    return text if text in ("same", "valid") else _ints(text, "padding")


def _and(names) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _model_parallel_help() -> str:
    """Which kinds take which modes, from the registry."""
    takes = {}
    for name in layers.names():
        modes = tuple(m for m in layers.lookup(name).model_modes if m != "none")
        if modes:
            takes.setdefault(modes, []).append(name)
    return ("split the layer over the model axis Pm by 'filter' (output channels) or 'channel' (input "
            "channels; of a channel-wise layer: channel-split activations): "
            + "; ".join(f"{_and(names)} take {_and(modes)}" for modes, names in takes.items())
            + "; 'none': every model rank computes the whole layer (default)")


def option_help(option) -> str:
    """An option's help with the kinds that take it (``{kinds}`` in it, else appended)."""
    kinds = " / ".join(layers.names_taking(option.name))
    return option.help.format(kinds=kinds) if "{kinds}" in option.help else f"{option.help} ({kinds})"


def add_option_flags(parser) -> None:
    """A flag per option of the registered kinds (``LayerKind.options``): ``--X`` / ``--no-X`` for
    a bool, ``--X VALUE`` otherwise; its default is the option's."""
    for option in layers.all_options().values():
        if option.type is bool:
            parser.add_argument(option.flag, dest=option.name, action=argparse.BooleanOptionalAction,
                                default=option.default, help=option_help(option))
        else:
            parser.add_argument(option.flag, dest=option.name, type=option.type, default=option.default,
                                metavar=option.metavar or option.name.upper(), help=option_help(option))


def add_arguments(parser):
    parser.description = __doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n", 1)[1]
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("layer", choices=layers.names(), help="which layer to check")
    parser.add_argument("--input", required=True, metavar="N,C,D,H,W", help="global input shape")
    parser.add_argument("--out-channels", type=int, default=None, metavar="F",
                        help=f"output channels of {' / '.join(layers.names_taking('out_channels'))} (default: C)")
    parser.add_argument("--kernel", default="3", metavar="k|kd,kh,kw", help="kernel size (default 3)")
    parser.add_argument("--stride", default=None, metavar="s|sd,sh,sw",
                        help="stride (default 1; pooling: the kernel size)")
    parser.add_argument("--padding", default="0", metavar="p|pd,ph,pw|d_lo,d_hi,h_lo,h_hi,w_lo,w_hi|same|valid",
                        help="padding (default 0): one value, one per axis, one per side (asymmetric), "
                             "'valid' (0) or 'same' (stride 1: total dilation*(k-1) per axis, the odd "
                             "cell after; conv_transpose3d: 1 or 3 values)")
    parser.add_argument("--dilation", default="1", metavar="d|dd,dh,dw",
                        help=f"dilation ({', '.join(layers.names_taking('dilation'))}; default 1)")
    parser.add_argument("--output-padding", default="0", metavar="op|opd,oph,opw",
                        help=f"output_padding of {' / '.join(layers.names_taking('output_padding'))} (default 0)")
    add_option_flags(parser)
    parser.add_argument("--grid", required=True, metavar="Pn,Pd,Ph,Pw[,Pm]",
                        help="process grid; run under mpiexec -n Pn*Pd*Ph*Pw[*Pm] (Pm: model axis)")
    parser.add_argument("--model-parallel", choices=MODEL_MODES, default="none", help=_model_parallel_help())
    parser.add_argument("--dtype", choices=sorted(TOLERANCE), default="float64",
                        help="float64 (tolerance 1e-10) or float32 (1e-5; 1e-3 for a conv that may "
                             "run Winograd)")
    parser.add_argument("--algorithm", choices=ALGORITHMS, default=None,
                        help="conv algorithm of the partitioned layer (default: $REFIMPL_CONV_ALGORITHM, else "
                             "auto: Winograd for wide 3x3x3 and 2x2x2 stride-1 convs); the oracle always computes "
                             "with the reference (refimpl/functional/conv3d.py)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the global arrays")
    parser.add_argument("--save", default=None, metavar="FILE.npz",
                        help="write the gathered global x, w, b, dy, y, dx, dw, db")


def parse_check(args, world_size: int) -> LayerCheck:
    """The flags as a validated ``LayerCheck`` for ``world_size`` ranks: the same on every
    rank, refused (ValueError) before any message."""
    from ..parallel.grid import parse_grid, world_mismatch
    shape = _ints(args.input, "input")
    grid = parse_grid(args.grid)
    if math.prod(grid) != world_size:
        raise ValueError(world_mismatch(args.grid, math.prod(grid), world_size))
    check = LayerCheck(
        layer=args.layer, input=shape, grid=grid, out_channels=args.out_channels,
        kernel=_ints(args.kernel, "kernel"), stride=None if args.stride is None else _ints(args.stride, "stride"),
        padding=_padding(args.padding), dilation=_ints(args.dilation, "dilation"),
        output_padding=_ints(args.output_padding, "output-padding"),
        options={name: getattr(args, name, option.default) for name, option in layers.all_options().items()},
        model_parallel=getattr(args, "model_parallel", "none") or "none", dtype=args.dtype, seed=args.seed,
        algorithm=getattr(args, "algorithm", None))
    if args.save is not None:
        check_writable(args.save, "--save")
    return check


def save_arrays(path, arrays) -> None:
    """The gathered global arrays as an .npz, written atomically (parent directories created)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write(path, lambda f: numpy.savez(f, **arrays), binary=True)


def run(args) -> int:
    from mpi4py import MPI

    from ..failstop import run_command
    comm = MPI.COMM_WORLD
    return run_command("check-layer", comm, lambda: check(args, comm))


def check(args, comm) -> int:
    from ..errors import EXIT_CHECK_FAILED, WriteError
    from ..failstop import agree, on_root
    from ..parallel.objects import bcast_object
    request = agree(comm, parse_check, args, comm.Get_size())   # bad input: the same error on every rank, exit 2
    report = check_layer(request, comm, keep_arrays=bool(args.save))
    if args.save:
        arrays = report and report.pop("arrays")
        if report is not None:
            report["saved"] = args.save
        on_root(comm, save_arrays, args.save, arrays, error=WriteError)
    ok = bcast_object(comm, report["ok"] if comm.Get_rank() == 0 else None, root=0)
    if comm.Get_rank() == 0:
        print(json.dumps(report))
    return 0 if ok else EXIT_CHECK_FAILED
