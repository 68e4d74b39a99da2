"""Expected arrays of one oracle case: global, and every rank's local blocks.

Pure math on one process (no MPI), through the case's kind of the layer registry
(refimpl/layers): the global forward/backward is the kind's reference (``refimpl.functional``
on the whole tensor, convs with the reference algorithm); each rank's view comes from the
*same plan objects the partitioned layers execute* (the kind's ``halo_plan``:
``partition.conv_halo_plan`` or ``transposed_conv_halo_plan``: owned input block, output
block, needed input range) and ``channels.channel_range`` for the model axis.

A rank's partial quantities (before any exchange or reduction) are derived without
local padding arithmetic, by linearity: the loss is L = sum(y * dy), so the part of
every gradient that flows from rank r's outputs is the global backward of

    dy_r = dy masked to rank r's (samples, output channels, output block)

``dx_needed`` (rank r's input gradient on its needed range, ghost cells included,
before the adjoint halo exchange) is that backward's dx sliced to the needed range;
``dw_partial``/``db_partial`` its dw/db, sliced to r's parameter shard.  Two checks
make the derivation fail loudly instead of writing wrong expectations: dx of dy_r is
zero outside r's needed range (the plan's ranges are large enough), and the ranks'
partials add up to the global gradient (they are a partition of it).  A kind whose outputs
depend on whole-tensor statistics (batch norm) derives its partials itself (``rank_partials``).

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
    <statistic>                                     a kind's partial statistics (``LayerKind.statistics``,
                                                    shaped as it says; batch norm: per-channel sums
                                                    of x, x*x over r's block), before the allreduce

The case's loss sums over the whole global batch (L = sum of y * dy), so dw, db and
batch norm's statistics are sums / statistics over every sample and voxel.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy

from .. import functional as F, layers
from ..parallel.partition import block_range, channel_range, grid_coords


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


def grid5(grid) -> tuple:
    return tuple(grid) + (1,) * (5 - len(grid))


def output_shape(spec) -> tuple:
    """(N, F, Do, Ho, Wo) of the case's layer."""
    kind = layers.lookup(spec.layer)
    return (spec.input[0], kind.output_channels(spec)) + tuple(kind.output_extent(spec))


def rank_layouts(spec) -> list[RankLayout]:
    """Every rank's ranges, from the halo plan the partitioned layer builds."""
    dims = grid5(spec.grid)
    n, c = spec.input[:2]
    f = output_shape(spec)[1]
    plan = layers.lookup(spec.layer).halo_plan(spec, dims[1:4])
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
    if spec.values == "ties":   # small integers: many windows hold equal maxima
        x = rng.integers(-3, 4, spec.input).astype(numpy.float64)
    else:
        x = rng.standard_normal(spec.input)
    arrays = {"x": x}
    arrays.update(layers.lookup(spec.layer).draw_parameters(rng, spec))
    # dy has mean 1: dw and db sum dy over the whole batch; a sum that cancels to near zero
    # would make a relative error measure luck
    arrays["dy"] = 1.0 + rng.standard_normal(output_shape(spec))
    return arrays


def weight_shard(spec, layout) -> tuple | None:
    """(axis, start, stop) of the weight slice rank ``layout`` holds; None: the whole weight."""
    if spec.model_parallel == "none":
        return None
    out_axis, in_axis = layers.lookup(spec.layer).weight_axes
    if spec.model_parallel == "filter":
        return (out_axis,) + layout.out_channels
    return (in_axis,) + layout.in_channels


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
    """The bias follows the output channels (batch norm's too: they are its input channels)."""
    return None if spec.model_parallel == "none" else (0,) + layout.out_channels


def rank_arrays(spec, a, expected, layout) -> dict:
    """{name: (array, offset)} of one rank, float64 (see the module docstring)."""
    kind = layers.lookup(spec.layer)
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
    partials = kind.rank_partials(spec, a, lo)
    if partials is not None:
        check_statistics(kind, spec, lo, {name: array for name, (array, _) in partials.items()}, "rank_partials")
        out.update(partials)
        return out
    # the part of the backward that flows from this rank's outputs (see the docstring)
    partial_sums = spec.model_parallel == "channel" and kind.mixes_channels
    dy_r = numpy.zeros_like(dy)
    masked = list(lo.index("y"))
    if partial_sums:
        masked[1] = slice(None)          # dy allgathered over the model group: every filter
    dy_r[tuple(masked)] = dy[tuple(masked)]
    _, dx_r, dw_r, db_r = kind.reference(spec, x, a.get("w"), a.get("b"), dy_r)
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
    if partial_sums:                     # over this rank's input channels, no bias, before the reduce-scatter
        w_c, _ = take(a["w"], weight_shard(spec, lo))
        y_part, _ = kind.forward(spec, x[:, slice(*lo.in_channels)], w_c, None)
        index = (slice(*lo.samples), slice(0, y.shape[1])) + lo.index("y")[2:]
        out["y_partial"] = (y_part[index], start(index))
    return out


def check_statistics(kind, spec, layout, arrays, hook) -> None:
    """A kind's statistics as it declares them (``LayerKind.statistics``): every one in ``arrays``
    (what its ``hook`` gave for rank ``layout``), of the declared shape; RuntimeError otherwise
    (a case file, or a run-torch result, must never disagree with the declaration)."""
    for stat in kind.statistics:
        want = tuple(stat.shape(spec, layout))
        got = arrays.get(stat.name)
        if got is None or tuple(got.shape) != want:
            raise RuntimeError(f"internal error: layer kind {kind.name}: its {hook} gives rank {layout.rank} "
                               f"{stat.name} " + ("no value" if got is None else f"of shape {tuple(got.shape)}")
                               + f", its Statistic declares {want}")


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
    for name, whole in (("dx_needed", dx), ("dw_partial", dw), ("db_partial", db)):
        if whole is None or name not in ranks[0]:
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
    with F.reference_only():                 # every expectation from the math, no kernel
        expected = layers.lookup(spec.layer).reference(spec, inputs["x"], inputs.get("w"), inputs.get("b"),
                                                       inputs["dy"])
        ranks = [rank_arrays(spec, inputs, expected, layout) for layout in rank_layouts(spec)]
    self_check(spec, expected, ranks)
    cast = numpy.dtype(dtype)
    glob = dict(zip(("y", "dx", "dw", "db"), expected))
    glob = {k: v.astype(cast) for k, v in glob.items() if v is not None}
    ranks = [{k: (v.astype(cast), off) for k, (v, off) in r.items()} for r in ranks]
    return {k: v.astype(cast) for k, v in inputs.items()}, glob, ranks
