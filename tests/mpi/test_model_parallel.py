"""The model axis under mpiexec: the 5-entry grid, the channel collectives, model-parallel layers.

- ``ProcessGrid`` with (Pn, Pd, Ph, Pw, Pm): the row-major rank map with the model axis fastest,
  and the model / batch / spatial / data sub-communicators;
- ``allgather_channels`` and ``reduce_scatter_channels`` are each other's adjoint
  (dot-product test, float64), with channel counts that do not divide by Pm or are smaller
  than it (empty slices), and the bytes they count equal ``moved_bytes``;
- filter- and channel-parallel conv3d and conv_transpose3d, channel-split batch norm and pooling equal the
  unpartitioned layer (forward, dx, dw, db; float64, 1e-10) on every grid with a model axis
  of the world size, alone and with spatial and data axes (Hypothesis, same example on every
  rank).
"""

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from refimpl.check import LayerCheck, check_layer
from refimpl.functional.args import transposed_out_size, window_out_size
from refimpl.parallel.channels import TRAFFIC, allgather_channels, channel_range, moved_bytes, reduce_scatter_channels
from refimpl.parallel.grid import ProcessGrid, all_grids
from refimpl.parallel.partition import grid_coords


def model_grids(size):
    """Every (Pn, Pd, Ph, Pw, Pm) of ``size`` ranks (Pm = 1 included: the 5-entry form of a 4-grid)."""
    return all_grids(size, model=True)


def test_five_axis_rank_map_and_subcommunicators(comm, all_ranks_agree):
    size = comm.Get_size()
    for dims in model_grids(size):
        grid = ProcessGrid(comm, dims)
        n, d, h, w, m = grid.coords
        pn, pd, ph, pw, pm = dims
        members = lambda sub: sorted(sub.allgather(comm.Get_rank()))   # noqa: E731
        checks = {
            "row-major, m fastest": comm.Get_rank() == (((n * pd + d) * ph + h) * pw + w) * pm + m,
            "coords": grid.coords == grid_coords(comm.Get_rank(), dims),
            "model group: Pm consecutive ranks": members(grid.model_comm)
            == list(range(comm.Get_rank() - m, comm.Get_rank() - m + pm)),
            "model coord": (grid.model_dims, grid.model_coord) == (pm, m)
            and grid.model_comm.Get_rank() == m,
            "batch group: the same m": all(r % pm == m for r in members(grid.batch_comm))
            and grid.batch_comm.Get_size() == pn * pd * ph * pw,
            "spatial group: same n and m": grid.spatial_comm.Get_size() == pd * ph * pw
            and all(r % pm == m and r // (pm * pd * ph * pw) == n for r in members(grid.spatial_comm)),
            "data group: same d, h, w, m": grid.data_comm.Get_size() == pn
            and all(r % (pm * pd * ph * pw) == comm.Get_rank() % (pm * pd * ph * pw)
                    for r in members(grid.data_comm)),
        }
        all_ranks_agree(all(checks.values()), f"dims={dims}: {[k for k, v in checks.items() if not v]}")
        grid.free()


def test_four_entry_grid_has_a_trivial_model_axis(comm, all_ranks_agree):
    grid = ProcessGrid(comm, (comm.Get_size(), 1, 1, 1))
    ok = (grid.model_dims, grid.model_coord, grid.model_comm.Get_size(), len(grid.coords)) == (1, 0, 1, 4) \
        and grid.batch_comm is grid.comm
    all_ranks_agree(ok, f"{grid}")
    grid.free()


@given(st.data())
def test_channel_collectives_are_adjoint(comm, all_ranks_agree, data):
    dims = data.draw(st.sampled_from([g for g in model_grids(comm.Get_size()) if g[4] > 1] or
                                     model_grids(comm.Get_size())))
    grid = ProcessGrid(comm, dims)
    pm, m = grid.model_dims, grid.model_coord
    channels = data.draw(st.integers(1, 2 * pm + 1))            # not divisible by Pm; below Pm too
    lead, voxels = data.draw(st.integers(1, 2)), tuple(data.draw(st.integers(1, 3)) for _ in range(3))
    seed = data.draw(st.integers(0, 2**16))
    rng = np.random.default_rng([seed, comm.Get_rank()])
    start, stop = channel_range(channels, pm, m)
    x = rng.standard_normal((lead, stop - start) + voxels)      # own slice
    y = rng.standard_normal((lead, channels) + voxels)          # anything on every rank
    before = TRAFFIC.bytes
    ax = allgather_channels(x, channels, grid.model_comm)       # (N, C, ...)
    a_star_y = reduce_scatter_channels(y, grid.model_comm)      # (N, c_m, ...)
    moved = TRAFFIC.bytes - before
    lhs = comm.allreduce(float(np.sum(ax * y)))
    rhs = comm.allreduce(float(np.sum(x * a_star_y)))
    # allgather gives every rank the same whole, whose slices are the ranks' own
    whole = grid.model_comm.allgather(x)
    expected = np.concatenate(whole, axis=1)
    per_channel = lead * int(np.prod(voxels))
    ok = (abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs)) and np.array_equal(ax, expected)
          and a_star_y.shape == x.shape
          and moved == 2 * moved_bytes(channels, pm, m, per_channel, 8))
    all_ranks_agree(ok, f"dims={dims} C={channels}: <Ax,y>={lhs} <x,A*y>={rhs} moved={moved}")
    grid.free()


def spec(layer, shape, grid, kernel, stride, padding, dilation, out_channels, mode, seed=0,
         output_padding=(0, 0, 0)):
    return LayerCheck(layer=layer, input=shape, grid=grid, out_channels=out_channels, kernel=kernel,
                      stride=stride, padding=padding, dilation=dilation, output_padding=output_padding,
                      dtype="float64", seed=seed, model_parallel=mode)


@st.composite
def model_cases(draw, size):
    grid = draw(st.sampled_from(model_grids(size)))
    pm = grid[4]
    layer, mode = draw(st.sampled_from([("conv3d", "filter"), ("conv3d", "channel"), ("conv3d", "none"),
                                        ("conv_transpose3d", "filter"), ("conv_transpose3d", "channel"),
                                        ("batch_norm3d", "channel"), ("max_pool3d", "channel")]))
    c = draw(st.integers(pm if mode != "filter" else 1, pm + 3))
    f = draw(st.integers(pm if mode == "filter" else 1, pm + 3))
    n = draw(st.integers(grid[0], grid[0] + 1))
    extent = tuple(draw(st.sampled_from([2, 3, 5, 7])) for _ in range(3))
    output_padding = (0, 0, 0)
    if layer.startswith("conv"):
        kernel = tuple(draw(st.integers(1, 3)) for _ in range(3))
        stride = tuple(draw(st.integers(1, 2)) for _ in range(3))
        dilation = tuple(draw(st.integers(1, 2)) for _ in range(3))
        padding = tuple(draw(st.integers(0, k)) for k in kernel)
        if layer == "conv_transpose3d":
            output_padding = tuple(draw(st.integers(0, max(s, d) - 1)) for s, d in zip(stride, dilation))
    elif layer == "max_pool3d":
        kernel, dilation = (2, 2, 2), (1, 1, 1)
        stride, padding = kernel, (0, 0, 0)
    else:
        kernel = stride = dilation = (1, 1, 1)
        padding = (0, 0, 0)
    if layer == "conv_transpose3d":
        out = [transposed_out_size(e, k, s, p, d, op) for e, k, s, p, d, op
               in zip(extent, kernel, stride, padding, dilation, output_padding)]
    else:
        out = [window_out_size(e, k, s, p, d) for e, k, s, p, d in zip(extent, kernel, stride, padding, dilation)]
    assume(min(out) >= 1 and n * extent[0] * extent[1] * extent[2] >= 2)
    return dict(layer=layer, shape=(n, c) + extent, grid=grid, kernel=kernel, stride=stride, padding=padding,
                dilation=dilation, out_channels=f, mode=mode, output_padding=output_padding)


@given(model_cases(__import__("mpi4py.MPI").MPI.COMM_WORLD.Get_size()))
def test_model_parallel_layers_equal_unpartitioned(comm, all_ranks_agree, case):
    report = check_layer(spec(**case), comm)
    report = comm.allgather(report)[0]
    all_ranks_agree(report["ok"], f"{case}: {report['max_rel_err']}")


def test_model_split_wider_than_the_channels_is_refused_on_every_rank(comm, all_ranks_agree):
    size = comm.Get_size()
    if size == 1:
        pytest.skip("Pm > channels needs two ranks")
    grid = (1, 1, 1, 1, size)
    for mode, c, f in (("filter", 3, size - 1), ("channel", size - 1, 3)):
        try:
            spec("conv3d", (1, c, 3, 3, 3), grid, (1, 1, 1), (1, 1, 1), (0, 0, 0), (1, 1, 1), f, mode)
            raised = ""
        except ValueError as err:
            raised = str(err)
        all_ranks_agree("at most one rank per channel" in raised, f"{mode}: {raised!r}")
    try:
        spec("avg_pool3d", (1, 2, 3, 3, 3), grid, (1, 1, 1), (1, 1, 1), (0, 0, 0), (1, 1, 1), 2, "filter")
        raised = ""
    except ValueError as err:
        raised = str(err)
    all_ranks_agree("does not apply to avg_pool3d" in raised, raised)


@given(st.data())
def test_one_point_five_d_head_equals_unpartitioned(comm, all_ranks_agree, data):
    """flatten -> fc1 (rows over Pm, columns over the spatial blocks) -> LeakyReLU -> fc2 (1.5-D:
    allgather / reduce-scatter) -> gather the features: outputs, dx and every weight gradient
    equal the unpartitioned head's (float64), on every model grid of the world size."""
    from refimpl.nn.activation import LeakyReLU
    from refimpl.nn.linear import FlattenLinear, Linear
    from refimpl.nn.model_parallel import GatherFeatures, RowParallelFlattenLinear, RowParallelLinear
    from refimpl.parallel.collectives import allreduce

    dims = data.draw(st.sampled_from(model_grids(comm.Get_size())))
    grid = ProcessGrid(comm, dims)
    pm = grid.model_dims
    c, f1, f2 = data.draw(st.integers(1, 3)), data.draw(st.integers(pm, pm + 4)), data.draw(st.integers(pm, pm + 3))
    batch = data.draw(st.integers(1, 2)) * dims[0]
    extent = tuple(data.draw(st.sampled_from([1, 2, 3, 4])) for _ in range(3))
    seed = data.draw(st.integers(0, 2**16))
    features = c * extent[0] * extent[1] * extent[2]

    def head(parallel):
        rng = np.random.default_rng(seed)
        if parallel:
            layers = [RowParallelFlattenLinear(c, features, f1, grid=grid, rng=rng, dtype=np.float64),
                      LeakyReLU(0.3), RowParallelLinear(f1, f2, grid=grid, rng=rng, dtype=np.float64),
                      GatherFeatures(f2, grid=grid)]
            layers[0].setup(extent)
        else:
            layers = [FlattenLinear(c, features, f1, rng=rng, dtype=np.float64), LeakyReLU(0.3),
                      Linear(f1, f2, rng=rng, dtype=np.float64)]
        return layers

    def run(layers, x, dy):
        for layer in layers:
            x = layer.forward(x)
        out = x
        for layer in reversed(layers):
            dy = layer.backward(dy)
        return out, dy

    try:                      # local work first: an exception on one rank cannot split the collectives
        pieces, failure = local_heads(grid, dims, head, run, batch, c, f2, extent, seed), ""
    except Exception as err:  # noqa: BLE001
        pieces, failure = None, f"rank {comm.Get_rank()}: {type(err).__name__}: {err}"
    failures = [f for f in comm.allgather(failure) if f]
    errors = {} if failures else compare_heads(grid, pieces)
    ok = not failures and all(e <= 1e-10 for e in errors.values())
    failure = "; ".join(failures)
    all_ranks_agree(ok, f"dims={dims} c={c} f1={f1} f2={f2} batch={batch} extent={extent}: {errors} {failure}")
    grid.free()


def local_heads(grid, dims, head, run, batch, c, f2, extent, seed):
    """Both heads on this rank: output and dx errors, and each gradient placed in its whole shape."""
    rng = np.random.default_rng([seed, 7])
    x = rng.standard_normal((batch, c) + extent)
    g = rng.standard_normal((batch, f2))
    ref_layers = head(False)
    ref_out, ref_dx = run(ref_layers, x, g)
    samples = slice(grid.sample_coord * batch // dims[0], (grid.sample_coord + 1) * batch // dims[0])
    block = (samples, slice(None)) + tuple(grid.local_block(extent))
    layers = head(True)
    out, dx = run(layers, np.ascontiguousarray(x[block]), np.ascontiguousarray(g[samples]))
    errors = {"out": np.abs(out - ref_out[samples]).max(initial=0.0),
              "dx": np.abs(dx - ref_dx[block]).max(initial=0.0)}     # a block may be empty
    grads = []
    for name, layer, ref in (("fc1", layers[0], ref_layers[0]), ("fc2", layers[2], ref_layers[2])):
        for mine, want in ((layer.weight, ref.weight), (layer.bias, ref.bias)):
            axis, start, stop, whole = mine.shard
            full = np.zeros((whole,) + mine.grad.shape[1:])
            full[start:stop] = mine.grad
            grads.append((f"{name} {mine.name}", full, mine.spatial_replicated, want.grad))
    return errors, grads


def compare_heads(grid, pieces):
    """Sum the placed gradients over the grid (rows disjoint over m, summed over the batch; a
    spatially replicated one counted once) and compare with the unpartitioned gradients."""
    from refimpl.parallel.collectives import allreduce
    errors, grads = pieces
    spatial = grid.spatial_comm.Get_size()
    for key, full, replicated, want in grads:
        total = allreduce(full, grid.comm) / (spatial if replicated else 1)
        errors[key] = np.abs(total - want).max() / max(1e-300, np.abs(want).max())
    return errors
