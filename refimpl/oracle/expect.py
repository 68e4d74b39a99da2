"""Expected arrays of one oracle case: global, and every rank's local blocks.

Pure math on one process (no MPI): the global forward/backward comes from
``refimpl.functional`` on the whole tensor; each rank's view comes from the *same
plan objects the partitioned layers execute* (``partition.conv_halo_plan`` and
``transposed_conv_halo_plan``: owned input block, output block, needed input range)
and ``channels.channel_range`` for the model axis.

A rank's partial quantities (before any exchange or reduction) are derived without
local padding arithmetic, by linearity: the loss is L = sum(y * dy), so the part of
every gradient that flows from rank r's outputs is the global backward of

    dy_r = dy masked to rank r's (samples, output channels, output block)

``dx_needed`` (rank r's input gradient on its needed range, ghost cells included,
before the adjoint halo exchange) is that backward's dx sliced to the needed range;
``dw_partial``/``db_partial`` its dw/db, sliced to r's parameter shard.  Two checks
make the derivation fail loudly instead of writing wrong expectations: dx of dy_r is
zero outside r's needed range (the plan's ranges are large enough), and the ranks'
partials add up to the global gradient (they are a partition of it).

Tensors of rank r (``offset``: the global index of the block's first element):

    x           (N_r, C_r, owned input block)       the input block r holds
    x_needed    (N_r, C_comp, needed range)         its input after the halo exchange (and the
                                                    channel allgather of a filter-parallel conv)
    dy          (N_r, F_r, output block)            the output gradient r receives
    y           (N_r, F_r, output block)            r's output
    y_partial   (N_r, F, output block)              channel-parallel conv: r's partial sums over
                                                    its input channels, no bias, before the
                                                    reduce-scatter
    dx_needed   (N_r, C_comp, needed range)         r's input gradient before the adjoint exchange
    dx          (N_r, C_r, owned input block)       after the adjoint exchange (and reductions)
    dw_partial, db_partial                          r's own share, before the allreduce
    dw, db                                          after the allreduce (r's shard of the whole)
    sum_partial, sumsq_partial                      batch norm: per-channel sums of x, x*x over r's
                                                    block (the quantities to allreduce)

The case's loss sums over the whole global batch (L = sum of y * dy), so dw, db and
batch norm's statistics are sums / statistics over every sample and voxel.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy

from .. import functional as F
from ..parallel.partition import (block_range, channel_range, conv_halo_plan, grid_coords,
                                  transposed_conv_halo_plan, window_output_extent, transposed_output_extent)

CONV_LAYERS = ("conv3d", "conv_transpose3d")
#: expectations are computed by the reference math (refimpl/functional/conv3d.py: pad, one slice
#: per tap, one GEMM), never by a kernel of refimpl/kernels/: the oracle's trust rests on code
#: anyone can read
ALGORITHM = "reference"


@dataclass(frozen=True)
class RankLayout:
    """Where rank ``rank`` sits and which global ranges it holds (half-open (start, stop))."""
    rank: int
    coords: tuple          # (n, d, h, w, m)
    samples: tuple
    in_channels: tuple     # channels of x / dx it holds
    out_channels: tuple    # channels of y / dy it holds
    compute_channels: tuple  # channels of x_needed / dx_needed
    owned: tuple           # 3 ranges: its input block
    outputs: tuple         # 3 ranges: its output block
    needed: tuple          # 3 ranges: input range its outputs read (clipped to the domain)

    def index(self, which: str) -> tuple:
        """Global index (slices) of a block: 'x' owned input, 'needed', 'y' output."""
        ch, spatial = {"x": (self.in_channels, self.owned), "needed": (self.compute_channels, self.needed),
                       "y": (self.out_channels, self.outputs)}[which]
        return (slice(*self.samples), slice(*ch)) + tuple(slice(*r) for r in spatial)

    def as_attrs(self) -> dict:
        return {"coords": list(self.coords), "samples": list(self.samples),
                "in_channels": list(self.in_channels), "out_channels": list(self.out_channels),
                "compute_channels": list(self.compute_channels),
                "owned": [v for r in self.owned for v in r], "outputs": [v for r in self.outputs for v in r],
                "needed": [v for r in self.needed for v in r]}

    @classmethod
    def from_attrs(cls, rank, attrs) -> "RankLayout":
        def pairs(v):
            v = [int(i) for i in v]
            return tuple((v[i], v[i + 1]) for i in range(0, len(v), 2))
        return cls(rank, tuple(int(c) for c in attrs["coords"]), tuple(int(v) for v in attrs["samples"]),
                   tuple(int(v) for v in attrs["in_channels"]), tuple(int(v) for v in attrs["out_channels"]),
                   tuple(int(v) for v in attrs["compute_channels"]), pairs(attrs["owned"]),
                   pairs(attrs["outputs"]), pairs(attrs["needed"]))


def grid5(grid) -> tuple:
    return tuple(grid) + (1,) * (5 - len(grid))


def output_shape(spec) -> tuple:
    """(N, F, Do, Ho, Wo) of the case's layer."""
    n, c, *dhw = spec.input
    if spec.layer == "conv_transpose3d":
        out = [transposed_output_extent(dhw[a], spec.kernel[a], spec.stride[a], spec.padding[a],
                                        spec.dilation[a], spec.output_padding[a]) for a in range(3)]
    elif spec.layer == "batch_norm3d":
        out = dhw
    else:
        out = [window_output_extent(dhw[a], spec.kernel[a], spec.stride[a], spec.padding[a], spec.dilation[a])
               for a in range(3)]
    return (n, spec.out_channels if spec.layer in CONV_LAYERS else c) + tuple(out)


def rank_layouts(spec) -> list[RankLayout]:
    """Every rank's ranges, from the halo plan the partitioned layer builds."""
    dims = grid5(spec.grid)
    n, c = spec.input[:2]
    f = output_shape(spec)[1]
    if spec.layer == "conv_transpose3d":
        plan = transposed_conv_halo_plan(spec.input[2:], dims[1:4], spec.kernel, spec.stride, spec.padding,
                                         spec.dilation, spec.output_padding)
    elif spec.layer == "batch_norm3d":
        plan = None
    else:
        plan = conv_halo_plan(spec.input[2:], dims[1:4], spec.kernel, spec.stride, spec.padding, spec.dilation)
    layouts = []
    for rank in range(spec.ranks):
        coords = grid_coords(rank, dims)
        pm, m = dims[4], coords[4]
        split = spec.model_parallel != "none"
        cin = channel_range(c, pm, m) if split else (0, c)
        cout = channel_range(f, pm, m) if split else (0, f)
        ccomp = cin if spec.model_parallel == "channel" else (0, c)
        spatial = coords[1:4]
        if plan is None:
            owned = tuple(block_range(spec.input[2 + a], dims[1 + a], spatial[a]) for a in range(3))
            outputs = needed = owned
        else:
            owned, outputs, needed = plan.owned(spatial), plan.outputs(spatial), plan.needed(spatial)
        layouts.append(RankLayout(rank, coords, block_range(n, dims[0], coords[0]), cin, cout, ccomp,
                                  tuple(owned), tuple(outputs), tuple(needed)))
    return layouts


def draw_inputs(spec) -> dict:
    """Global float64 inputs of the case (x, dy, and w, b where the layer has them)."""
    rng = numpy.random.default_rng([spec.seed, 11])
    n, c = spec.input[:2]
    shape_out = output_shape(spec)
    if spec.values == "ties":   # small integers: many windows hold equal maxima
        x = rng.integers(-3, 4, spec.input).astype(numpy.float64)
    else:
        x = rng.standard_normal(spec.input)
    arrays = {"x": x}
    if spec.layer in CONV_LAYERS:
        f, kvol = shape_out[1], int(numpy.prod(spec.kernel))
        wshape = (f, c) if spec.layer == "conv3d" else (c, f)
        arrays["w"] = rng.standard_normal(wshape + tuple(spec.kernel)) / numpy.sqrt(c * kvol)
        arrays["b"] = rng.standard_normal(f)
    elif spec.layer == "batch_norm3d":
        arrays["w"] = rng.uniform(0.5, 1.5, c)
        arrays["b"] = rng.standard_normal(c)
    # dy has mean 1: dw and db sum dy over the whole batch; a sum that cancels to near zero
    # would make a relative error measure luck
    arrays["dy"] = 1.0 + rng.standard_normal(shape_out)
    return arrays


def forward_backward(spec, a, dy) -> tuple:
    """(y, dx, dw, db) of the whole layer in float64 (dw, db None where it has none)."""
    k, s, p, d = spec.kernel, spec.stride, spec.padding, spec.dilation
    if spec.layer == "conv3d":
        y = F.conv3d(a["x"], a["w"], a["b"], s, p, d, algorithm=ALGORITHM)
        return (y,) + tuple(F.conv3d_backward(dy, a["x"], a["w"], s, p, d, algorithm=ALGORITHM))
    if spec.layer == "conv_transpose3d":
        op = spec.output_padding
        y = F.conv_transpose3d(a["x"], a["w"], a["b"], s, p, op, d, algorithm=ALGORITHM)
        return (y,) + tuple(F.conv_transpose3d_backward(dy, a["x"], a["w"], s, p, op, d, algorithm=ALGORITHM))
    if spec.layer == "max_pool3d":
        return F.max_pool3d(a["x"], k, s, p, d), F.max_pool3d_backward(dy, a["x"], k, s, p, d), None, None
    if spec.layer == "avg_pool3d":
        return F.avg_pool3d(a["x"], k, s, p), F.avg_pool3d_backward(dy, a["x"], k, s, p), None, None
    y, cache = F.batch_norm3d(a["x"], a["w"], a["b"], training=True)
    return (y,) + tuple(F.batch_norm3d_backward(dy, cache))


def weight_shard(spec, layout) -> tuple | None:
    """(axis, start, stop) of the weight slice rank ``layout`` holds; None: the whole weight."""
    mode = spec.model_parallel
    if mode == "none":
        return None
    if spec.layer == "batch_norm3d":
        return (0,) + layout.in_channels
    out_axis = 0 if spec.layer == "conv3d" else 1
    if mode == "filter":
        return (out_axis,) + layout.out_channels
    return (1 - out_axis,) + layout.in_channels


def take(array, shard):
    """The shard (axis, start, stop) of an array, and the global offset of its first element."""
    offset = [0] * array.ndim
    if shard is None:
        return array, offset
    axis, start, stop = shard
    index = [slice(None)] * array.ndim
    index[axis] = slice(start, stop)
    offset[axis] = start
    return array[tuple(index)], offset


def bias_shard(spec, layout):
    return None if spec.model_parallel == "none" else (0,) + (
        layout.in_channels if spec.layer == "batch_norm3d" else layout.out_channels)


def rank_arrays(spec, a, expected, layout) -> dict:
    """{name: (array, offset)} of one rank, float64 (see the module docstring)."""
    x, dy = a["x"], a["dy"]
    y, dx, dw, db = expected
    lo = layout
    start = lambda index: [s.start for s in index]          # noqa: E731
    out = {"x": (x[lo.index("x")], start(lo.index("x"))),
           "dy": (dy[lo.index("y")], start(lo.index("y"))),
           "y": (y[lo.index("y")], start(lo.index("y"))),
           "dx": (dx[lo.index("x")], start(lo.index("x")))}
    if dw is not None:
        out["dw"] = take(dw, weight_shard(spec, lo))
        out["db"] = take(db, bias_shard(spec, lo))
    if spec.layer == "batch_norm3d":
        xs, dys = x[lo.index("x")], dy[lo.index("x")]
        axes = (0, 2, 3, 4)
        count = x.shape[0] * numpy.prod(x.shape[2:])
        mean = x.mean(axis=axes, keepdims=True)
        var = x.var(axis=axes, keepdims=True)
        xhat = (xs - mean[:, slice(*lo.in_channels)]) / numpy.sqrt(var[:, slice(*lo.in_channels)] + 1e-5)
        offset = [lo.in_channels[0]]
        out["sum_partial"] = (xs.sum(axis=axes), offset)
        out["sumsq_partial"] = ((xs * xs).sum(axis=axes), offset)
        out["dw_partial"] = ((dys * xhat).sum(axis=axes), offset)
        out["db_partial"] = (dys.sum(axis=axes), offset)
        assert count > 1
        return out
    # the part of the backward that flows from this rank's outputs (see the docstring)
    dy_r = numpy.zeros_like(dy)
    masked = list(lo.index("y"))
    if spec.model_parallel == "channel" and spec.layer in CONV_LAYERS:
        masked[1] = slice(None)          # dy allgathered over the model group: every filter
    dy_r[tuple(masked)] = dy[tuple(masked)]
    _, dx_r, dw_r, db_r = forward_backward(spec, a, dy_r)
    needed = lo.index("needed")
    outside = dx_r.copy()
    outside[(slice(None), slice(None)) + needed[2:]] = 0
    if numpy.any(outside):
        raise RuntimeError(f"internal error: rank {lo.rank}'s outputs reach inputs outside its needed "
                           f"range {lo.needed} ({spec.name})")
    out["x_needed"] = (x[needed], start(needed))
    out["dx_needed"] = (dx_r[needed], start(needed))
    if dw_r is not None:
        out["dw_partial"] = take(dw_r, weight_shard(spec, lo))
        out["db_partial"] = take(db_r, bias_shard(spec, lo))
    if spec.model_parallel == "channel" and spec.layer in CONV_LAYERS:
        w_c, _ = take(a["w"], weight_shard(spec, lo))
        x_c = x[:, slice(*lo.in_channels)]
        args = (spec.stride, spec.padding, spec.output_padding, spec.dilation) \
            if spec.layer == "conv_transpose3d" else (spec.stride, spec.padding, spec.dilation)
        fn = F.conv3d if spec.layer == "conv3d" else F.conv_transpose3d
        y_part = fn(x_c, w_c, None, *args, algorithm=ALGORITHM)
        index = (slice(*lo.samples), slice(0, y.shape[1])) + lo.index("y")[2:]
        out["y_partial"] = (y_part[index], start(index))
    return out


def embed(shape, pieces):
    """Sum of (array, offset) pieces placed into a zero array of ``shape``."""
    total = numpy.zeros(shape)
    for array, offset in pieces:
        total[tuple(slice(o, o + n) for o, n in zip(offset, array.shape))] += array
    return total


def self_check(spec, expected, ranks) -> None:
    """The rank partials must add up to the global gradients (they partition them)."""
    y, dx, dw, db = expected
    copies = grid5(spec.grid)[4] if spec.model_parallel == "none" else 1
    checks = [("dx_needed", dx), ("dw_partial", dw), ("db_partial", db)]
    if spec.layer == "batch_norm3d":
        checks = [("dw_partial", dw), ("db_partial", db)]
    for name, whole in checks:
        if whole is None:
            continue
        total = embed(whole.shape, [r[name] for r in ranks]) / copies
        scale = max(float(numpy.abs(whole).max()), 1e-300)
        if float(numpy.abs(total - whole).max()) > 1e-12 * scale * max(1, len(ranks)):
            raise RuntimeError(f"internal error: the ranks' {name} do not add up to the global "
                               f"gradient ({spec.name}, grid {spec.grid})")


def expectations(spec, dtype: str) -> tuple[dict, dict, list[dict]]:
    """(inputs, global expected, per-rank arrays) in ``dtype``.

    float32 expectations are computed in float64 from the float32-rounded inputs and
    rounded once at the end: the reference carries no float32 arithmetic error of its own.
    """
    inputs = draw_inputs(spec)
    if dtype == "float32":
        inputs = {k: v.astype(numpy.float32).astype(numpy.float64) for k, v in inputs.items()}
    expected = forward_backward(spec, inputs, inputs["dy"])
    ranks = [rank_arrays(spec, inputs, expected, layout) for layout in rank_layouts(spec)]
    self_check(spec, expected, ranks)
    cast = numpy.dtype(dtype)
    glob = dict(zip(("y", "dx", "dw", "db"), expected))
    glob = {k: v.astype(cast) for k, v in glob.items() if v is not None}
    ranks = [{k: (v.astype(cast), off) for k, (v, off) in r.items()} for r in ranks]
    return {k: v.astype(cast) for k, v in inputs.items()}, glob, ranks
