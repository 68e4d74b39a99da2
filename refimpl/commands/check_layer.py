"""``refimpl check-layer``: one partitioned layer vs. the unpartitioned oracle, under mpiexec.

Every rank draws the same global input, parameters and output gradient from
``--seed``; each takes its block (samples split over Pn, volume over
Pd x Ph x Pw), runs the spatially partitioned layer forward and backward, and
rank 0 gathers y and dx, sums dw and db over all ranks (the unpartitioned
gradient sums over the whole batch) and compares with ``refimpl.functional`` on
the whole tensor.  One JSON line reports the max relative error
``max|a - b| / max|b|`` of each array; the exit status is 1 above tolerance.
``--save`` writes the gathered global arrays to an .npz for independent checks.

Exit status: 0 every array within tolerance; 1 a mismatch; 2 bad input (one
line, every rank; a --save path that cannot be written included); 4 --save
failed while writing; 70 an internal error.  A failure on any one rank ends
every rank with one message (refimpl/failstop.py).

Example:
    mpiexec -n 4 refimpl check-layer conv3d --input 2,3,11,9,7 --out-channels 5 \\
        --kernel 3,2,5 --stride 2,1,1 --padding 1,0,2 --dilation 1,2,1 --grid 1,2,2,1
"""
from __future__ import annotations

import json
import os
import sys

import numpy

from ..failstop import atomic_write, check_writable

LAYERS = ("conv3d", "conv_transpose3d", "max_pool3d", "avg_pool3d", "batch_norm3d")
MODEL_MODES = ("none", "filter", "channel")
#: the --model-parallel modes each layer can take
LAYER_MODES = {"conv3d": MODEL_MODES, "conv_transpose3d": MODEL_MODES, "max_pool3d": ("none", "channel"),
               "avg_pool3d": ("none", "channel"), "batch_norm3d": ("none", "channel")}
TOLERANCE = {"float64": 1e-10, "float32": 1e-5}
#: float32 tolerance where a conv may run Winograd: its rounding depends on where the
#: 4x4x4 tiles fall, which differs between a rank's block and the whole volume
#: (refimpl/kernels/winograd.py documents ~1e-4 of a typical output).
WINOGRAD_FLOAT32_TOLERANCE = 1e-3


def _ints(text, name, count=None):
    try:
        values = tuple(int(t) for t in str(text).split(","))
    except ValueError:
        raise ValueError(f"--{name} must be comma-separated integers, got {text!r}") from None
    if count is not None and len(values) not in ((1, count) if count == 3 else (count,)):
        raise ValueError(f"--{name} needs {count} comma-separated integers, got {text!r}")
    return values[0] if len(values) == 1 else values


def add_arguments(parser):
    parser.description = __doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n", 1)[1]
    parser.formatter_class = __import__("argparse").RawDescriptionHelpFormatter
    parser.add_argument("layer", choices=LAYERS, help="which layer to check")
    parser.add_argument("--input", required=True, metavar="N,C,D,H,W", help="global input shape")
    parser.add_argument("--out-channels", type=int, default=None, metavar="F",
                        help="output channels of conv3d / conv_transpose3d (default: C)")
    parser.add_argument("--kernel", default="3", metavar="k|kd,kh,kw", help="kernel size (default 3)")
    parser.add_argument("--stride", default=None, metavar="s|sd,sh,sw",
                        help="stride (default 1; pooling: the kernel size)")
    parser.add_argument("--padding", default="0", metavar="p|pd,ph,pw", help="padding (default 0)")
    parser.add_argument("--dilation", default="1", metavar="d|dd,dh,dw",
                        help="dilation (conv3d, conv_transpose3d, max_pool3d; default 1)")
    parser.add_argument("--output-padding", default="0", metavar="op|opd,oph,opw",
                        help="output_padding of conv_transpose3d (default 0)")
    parser.add_argument("--grid", required=True, metavar="Pn,Pd,Ph,Pw[,Pm]",
                        help="process grid; run under mpiexec -n Pn*Pd*Ph*Pw[*Pm] (Pm: model axis)")
    parser.add_argument("--model-parallel", choices=MODEL_MODES, default="none",
                        help="split the layer over the model axis Pm: conv3d and conv_transpose3d by "
                             "'filter' (output channels) or 'channel' (input channels); batch_norm3d and "
                             "the poolings "
                             "by 'channel' (channel-split activations); 'none': every model rank "
                             "computes the whole layer (default)")
    parser.add_argument("--dtype", choices=sorted(TOLERANCE), default="float64",
                        help="float64 (tolerance 1e-10) or float32 (1e-5; 1e-3 for a conv that may "
                             "run Winograd)")
    parser.add_argument("--algorithm", choices=("auto", "im2col", "winograd", "reference"), default=None,
                        help="conv algorithm of the partitioned layer (default: $REFIMPL_CONV_ALGORITHM, else "
                             "auto: Winograd for wide 3x3x3 stride-1 convs); the oracle always computes "
                             "with the reference (refimpl/functional/conv3d.py)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the global arrays")
    parser.add_argument("--save", default=None, metavar="FILE.npz",
                        help="write the gathered global x, w, b, dy, y, dx, dw, db")


class LayerSpec:
    """The parsed, validated request: identical on every rank, checked before any message."""

    def __init__(self, args, world_size: int):
        from ..backend import resolve_dtype
        from ..functional._args import triple
        from ..parallel.grid import parse_grid
        shape = _ints(args.input, "input", 5)
        if not isinstance(shape, tuple) or len(shape) != 5 or min(shape) < 1:
            raise ValueError(f"--input must be 5 positive integers N,C,D,H,W, got {args.input!r}")
        self.layer, self.shape = args.layer, shape
        self.grid_dims = parse_grid(args.grid)
        if numpy.prod(self.grid_dims) != world_size:
            raise ValueError(f"--grid {args.grid} holds {int(numpy.prod(self.grid_dims))} ranks but mpiexec "
                             f"started {world_size}")
        self.dtype = resolve_dtype(args.dtype)
        self.tolerance = TOLERANCE[args.dtype]
        self.kernel = triple(_ints(args.kernel, "kernel", 3), "kernel", 1)
        pool = self.layer in ("max_pool3d", "avg_pool3d")
        self.stride = (self.kernel if pool else (1, 1, 1)) if args.stride is None \
            else triple(_ints(args.stride, "stride", 3), "stride", 1)
        self.padding = triple(_ints(args.padding, "padding", 3), "padding", 0)
        self.dilation = triple(_ints(args.dilation, "dilation", 3), "dilation", 1)
        self.output_padding = triple(_ints(args.output_padding, "output-padding", 3), "output-padding", 0)
        self.out_channels = shape[1] if args.out_channels is None else args.out_channels
        if self.out_channels < 1:
            raise ValueError(f"--out-channels must be >= 1, got {self.out_channels}")
        if self.layer == "avg_pool3d" and self.dilation != (1, 1, 1):
            raise ValueError("--dilation is not supported by avg_pool3d (PyTorch has none either)")
        if self.layer != "conv_transpose3d" and self.output_padding != (0, 0, 0):
            raise ValueError("--output-padding applies to conv_transpose3d only")
        if pool and any(2 * p > k for p, k in zip(self.padding, self.kernel)):
            raise ValueError(f"--padding {self.padding} must be at most half the kernel {self.kernel} "
                             "for pooling (as in PyTorch)")
        if self.layer == "batch_norm3d" and shape[0] * shape[2] * shape[3] * shape[4] < 2:
            raise ValueError("batch_norm3d needs more than one value per channel (N*D*H*W >= 2)")
        if shape[0] < self.grid_dims[0]:
            raise ValueError(f"--grid puts {self.grid_dims[0]} sample groups on a batch of {shape[0]}: "
                             "every data-parallel rank needs at least one sample")
        self.model_parallel = getattr(args, "model_parallel", "none") or "none"
        if self.model_parallel not in LAYER_MODES[self.layer]:
            raise ValueError(f"--model-parallel {self.model_parallel} does not apply to {self.layer} "
                             f"(it takes: {', '.join(LAYER_MODES[self.layer])})")
        pm = self.grid_dims[4] if len(self.grid_dims) == 5 else 1
        split = {"filter": self.out_channels, "channel": shape[1]}.get(self.model_parallel)
        if split is not None and pm > split:
            raise ValueError(f"--grid puts Pm={pm} model ranks on a layer that splits {split} channels "
                             f"(--model-parallel {self.model_parallel}): at most one rank per channel")
        self.seed, self.save = args.seed, args.save
        if self.save is not None:
            check_writable(self.save, "--save")
        self.algorithm = getattr(args, "algorithm", None)
        if self.algorithm is not None:            # the partitioned layers read the variable
            os.environ["REFIMPL_CONV_ALGORITHM"] = self.algorithm
        if self.dtype == numpy.float32 and self.may_use_winograd():
            self.tolerance = WINOGRAD_FLOAT32_TOLERANCE

    def may_use_winograd(self):
        """Whether a conv of this request may run Winograd (on a block or on the whole)."""
        from ..kernels import winograd
        from ..functional.conv3d import algorithm_setting
        if not self.layer.startswith("conv") or not winograd.applicable(
                self.kernel, self.stride, self.dilation):
            return False
        algorithm = algorithm_setting()
        c, f = self.shape[1], self.out_channels
        return algorithm == "winograd" or (algorithm == "auto" and
                                           winograd.wide_enough(c, f, weight_grad=True))

    def make_layer(self, grid, rng):
        from ..nn import model_parallel, spatial
        n, c = self.shape[:2]
        dt = self.dtype
        if self.layer == "conv3d" and self.model_parallel != "none":
            cls = model_parallel.FilterParallelConv3d if self.model_parallel == "filter" else \
                model_parallel.ChannelParallelConv3d
            return cls(c, self.out_channels, self.kernel, self.stride, self.padding, self.dilation,
                       grid=grid, rng=rng, dtype=dt)
        if self.layer == "conv_transpose3d" and self.model_parallel != "none":
            cls = model_parallel.FilterParallelConvTranspose3d if self.model_parallel == "filter" else \
                model_parallel.ChannelParallelConvTranspose3d
            return cls(c, self.out_channels, self.kernel, self.stride, self.padding, self.output_padding,
                       self.dilation, grid=grid, rng=rng, dtype=dt)
        if self.layer == "batch_norm3d" and self.model_parallel == "channel":
            return model_parallel.ModelParallelBatchNorm3d(c, grid=grid, dtype=dt)
        if self.layer == "conv3d":
            return spatial.SpatialConv3d(c, self.out_channels, self.kernel, self.stride, self.padding,
                                         self.dilation, grid=grid, rng=rng, dtype=dt)
        if self.layer == "conv_transpose3d":
            return spatial.SpatialConvTranspose3d(c, self.out_channels, self.kernel, self.stride,
                                                  self.padding, self.output_padding, self.dilation,
                                                  grid=grid, rng=rng, dtype=dt)
        if self.layer == "max_pool3d":
            return spatial.SpatialMaxPool3d(self.kernel, self.stride, self.padding, self.dilation, grid=grid)
        if self.layer == "avg_pool3d":
            return spatial.SpatialAvgPool3d(self.kernel, self.stride, self.padding, grid=grid)
        return spatial.SpatialBatchNorm3d(c, grid=grid, global_stats=True, dtype=dt)

    def oracle(self, x, w, b, dy):
        """Unpartitioned forward and backward with refimpl.functional's reference: (y, dx, dw, db)."""
        from .. import functional as F
        k, s, p, d = self.kernel, self.stride, self.padding, self.dilation
        ref = "reference"
        if self.layer == "conv3d":
            return (F.conv3d(x, w, b, s, p, d, algorithm=ref),) + F.conv3d_backward(dy, x, w, s, p, d,
                                                                                     algorithm=ref)
        if self.layer == "conv_transpose3d":
            op = self.output_padding
            return (F.conv_transpose3d(x, w, b, s, p, op, d, algorithm=ref),) + \
                F.conv_transpose3d_backward(dy, x, w, s, p, op, d, algorithm=ref)
        if self.layer == "max_pool3d":
            return F.max_pool3d(x, k, s, p, d), F.max_pool3d_backward(dy, x, k, s, p, d), None, None
        if self.layer == "avg_pool3d":
            return F.avg_pool3d(x, k, s, p), F.avg_pool3d_backward(dy, x, k, s, p), None, None
        y, cache = F.batch_norm3d(x, w, b, training=True)
        return (y,) + tuple(F.batch_norm3d_backward(dy, cache))


def _rel_err(a, b):
    """max|a - b| / max|b| over finite entries; equal entries (a max-pool window lying
    wholly in the padding is -inf in both) count as no difference."""
    if b is None:
        return None
    if not b.size:
        return 0.0
    with numpy.errstate(invalid="ignore"):
        diff = numpy.where(a == b, 0.0, numpy.abs(a - b))
    finite = numpy.abs(b[numpy.isfinite(b)])
    scale = float(finite.max()) if finite.size else 0.0
    worst = float(diff.max())
    return worst / scale if scale > 0 else worst


def check_layer(spec: LayerSpec, comm):
    """Run the partitioned layer on ``comm`` (collective); returns the report dict on rank 0."""
    from ..backend import asarray, to_host
    from ..parallel.collectives import allreduce
    from ..parallel.grid import ProcessGrid
    from ..parallel.channels import channel_range
    from ..parallel.partition import block_range

    grid = ProcessGrid(comm, spec.grid_dims)   # ValueError on every rank if the sizes differ
    layer = spec.make_layer(grid, numpy.random.default_rng(spec.seed))
    out_dhw = layer.setup(spec.shape[2:])      # pure index math; raises the same on every rank

    rng = numpy.random.default_rng([spec.seed, 1])
    x = rng.standard_normal(spec.shape).astype(spec.dtype)                 # (N, C, D, H, W) global
    params = [p for p in (getattr(layer, "weight", None), getattr(layer, "bias", None)) if p is not None]
    if spec.layer == "batch_norm3d":         # random scale and shift, not the identity init
        for p in params:    # drawn whole (the same on every rank), then this rank's slice
            full = rng.uniform(0.5, 1.5, (p.shard[3],) if p.shard else p.shape).astype(spec.dtype)
            p.data[...] = asarray(full[p.shard[1]:p.shard[2]] if p.shard else full)
    n_out = spec.out_channels if spec.layer.startswith("conv") else spec.shape[1]
    # dy has mean 1: db sums dy over the whole batch, and a sum that cancels to near zero
    # would make its float32 relative error measure luck rather than correctness
    dy = (1.0 + rng.standard_normal((spec.shape[0], n_out) + tuple(out_dhw))).astype(spec.dtype)

    samples = slice(*block_range(spec.shape[0], grid.dims[0], grid.sample_coord))
    pm, m = grid.model_dims, grid.model_coord
    split_in = spec.model_parallel != "none"                   # every mode here takes split input
    in_channels = slice(*channel_range(spec.shape[1], pm, m)) if split_in else slice(None)
    out_channels = slice(*channel_range(n_out, pm, m)) if split_in else slice(None)
    in_block = (samples, in_channels) + tuple(grid.local_block(spec.shape[2:]))
    out_block = (samples, out_channels) + tuple(grid.local_block(out_dhw))
    y_local = layer.forward(asarray(x[in_block]))
    dx_local = layer.backward(asarray(dy[out_block]))

    def whole(p, a):
        """A parameter-shaped array of this rank placed into the unsplit shape (zeros elsewhere)."""
        if p.shard is None:
            return a
        axis, start, stop, size = p.shard
        out = numpy.zeros(a.shape[:axis] + (size,) + a.shape[axis + 1:], spec.dtype)
        out[(slice(None),) * axis + (slice(start, stop),)] = to_host(a)
        return asarray(out)

    grads, values = [], []
    for p in params:   # the unpartitioned gradient sums over every sample and voxel
        g = p.grad if p.grad is not None else asarray(numpy.zeros(p.shape, spec.dtype))
        # slices of a split parameter are disjoint: summed over the whole grid they make the
        # whole; an unsplit one is the same on every model rank: summed over one copy's ranks
        grads.append(to_host(allreduce(whole(p, g), grid.comm if p.shard else grid.batch_comm)))
        values.append(to_host(allreduce(whole(p, p.data.copy()), grid.model_comm)) if p.shard else
                      to_host(p.data))
    pieces = grid.comm.gather((in_block, out_block, to_host(y_local), to_host(dx_local)), root=0)
    if grid.rank != 0:
        return None
    y = numpy.zeros(dy.shape, spec.dtype)
    dx = numpy.zeros(x.shape, spec.dtype)
    for ib, ob, yl, dxl in pieces:
        y[ob], dx[ib] = yl, dxl
    w = values[0] if params else None
    b = values[1] if len(params) > 1 else None
    dw, db = (grads + [None, None])[:2]
    ref = spec.oracle(x, w, b, dy)
    names = ("y", "dx", "dw", "db")
    errors = {k: _rel_err(got, want) for k, got, want in zip(names, (y, dx, dw, db), ref)}
    report = {"layer": spec.layer, "input": list(spec.shape), "grid": list(grid.dims),
              "model_parallel": spec.model_parallel,
              "dtype": numpy.dtype(spec.dtype).name, "tolerance": spec.tolerance,
              "conv_algorithm": os.environ.get("REFIMPL_CONV_ALGORITHM", "auto"),
              "max_rel_err": errors,
              "ok": all(e is None or e <= spec.tolerance for e in errors.values())}
    if spec.save:
        arrays = dict(x=x, dy=dy, y=y, dx=dx)
        arrays.update({k: v for k, v in (("w", w), ("b", b), ("dw", dw), ("db", db)) if v is not None})
        report["saved"] = spec.save
        report["arrays"] = arrays
    return report


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
    from ..failstop import EXIT_CHECK_FAILED, WriteError, agree, on_root
    from ..parallel.objects import bcast_object
    spec = agree(comm, LayerSpec, args, comm.Get_size())       # bad input: the same error on every rank, exit 2
    report = check_layer(spec, comm)
    if spec.save:
        on_root(comm, save_arrays, spec.save, report and report.pop("arrays"), error=WriteError)
    ok = bcast_object(comm, report["ok"] if comm.Get_rank() == 0 else None, root=0)
    if comm.Get_rank() == 0:
        print(json.dumps(report))
    return 0 if ok else EXIT_CHECK_FAILED
