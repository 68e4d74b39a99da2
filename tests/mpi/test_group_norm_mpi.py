"""Group norm and instance norm on every grid of the world equal the unpartitioned functional op.

- ``SpatialGroupNorm3d`` / ``SpatialInstanceNorm3d`` on every (Pn, Pd, Ph, Pw) grid, with
  uneven blocks and (where the world allows) empty ones: y and dx blocks, and dw, db summed
  over the ranks, equal ``functional.group_norm3d`` on the whole tensor (float64, 1e-10), the
  blocks computed by the reference's whole-array math or by the blocked kernel route
  (``kernels.group_norm`` on tiny blocks), the whole tensor by the reference;
- with the statistics allreduce removed (``global_sums``/``global_count`` patched to the
  identity) they differ on every grid that splits space, so the test can fail;
- ``ModelParallelGroupNorm3d`` / ``ModelParallelInstanceNorm3d`` on every grid with a model
  axis: equal where each model rank's channel slice holds whole groups, a ValueError on
  every rank (before any message) where the split would cut a group.
"""
import numpy as np
import pytest

from refimpl.functional import reference_only
from refimpl.functional.group_norm import group_norm3d, group_norm3d_backward
from refimpl.kernels import batch_norm as bn_kernel
from refimpl.nn.model_parallel import ModelParallelGroupNorm3d, ModelParallelInstanceNorm3d
from refimpl.nn.spatial import SpatialGroupNorm3d, SpatialInstanceNorm3d
from refimpl.parallel.channels import channel_range
from refimpl.parallel.grid import ProcessGrid, all_grids

#: (global shape per 2 samples of a sample group, num_groups): uneven blocks on most grids;
#: extents of 1 and 2 leave some ranks an empty block on every grid that splits that axis wider
SHAPES = [((2, 6, 5, 3, 7), 3), ((2, 4, 1, 2, 3), 2)]


def rel_err(a, b):
    return float(np.max(np.abs(a - b), initial=0.0) / max(np.max(np.abs(b), initial=0.0), 1e-300))


def global_case(shape, pn, seed):
    """Every rank draws the same arrays: (x, gamma, beta, dy) for 2 samples per sample group."""
    rng = np.random.default_rng(seed)
    full = (shape[0] * pn,) + shape[1:]
    c = shape[1]
    x = rng.standard_normal(full) * rng.uniform(0.5, 3, (1, c, 1, 1, 1)) + rng.uniform(-2, 2, (1, c, 1, 1, 1))
    return x, rng.uniform(0.5, 1.5, c), rng.standard_normal(c), rng.standard_normal(full)


def make_layer(kind, grid, channels, groups):
    model = len(grid.dims) == 5 and grid.model_dims > 1
    if kind == "instance":
        cls = ModelParallelInstanceNorm3d if model else SpatialInstanceNorm3d
        layer = cls(channels, grid=grid, dtype="float64")
    else:
        cls = ModelParallelGroupNorm3d if model else SpatialGroupNorm3d
        layer = cls(groups, channels, grid=grid, dtype="float64")
    return layer


def run_grid(grid, kind, shape, groups, seed, patch_out_allreduce=False):
    """(y, dx, dw, db errors) of this rank's blocks against the unpartitioned op."""
    x, gamma, beta, dy = global_case(shape, grid.dims[0], seed)
    groups = shape[1] if kind == "instance" else groups
    with reference_only():
        y_ref, cache = group_norm3d(x, groups, gamma, beta, 1e-5)
        dx_ref, dw_ref, db_ref = group_norm3d_backward(dy, cache)
    layer = make_layer(kind, grid, shape[1], groups)
    c0, c1 = channel_range(shape[1], grid.model_dims, grid.model_coord)
    layer.weight.data[...] = gamma[c0:c1]
    layer.bias.data[...] = beta[c0:c1]
    if patch_out_allreduce:                  # the plant: statistics of each rank's own block
        layer.global_sums = lambda *sums: sums
        layer.global_count = lambda count: count
    layer.setup(x.shape[2:])
    n = shape[0]
    index = (slice(grid.sample_coord * n, (grid.sample_coord + 1) * n), slice(c0, c1)) \
        + tuple(grid.local_block(x.shape[2:]))
    y = layer.forward(np.ascontiguousarray(x[index]))
    dx = layer.backward(np.ascontiguousarray(dy[index]))
    dw = grid.batch_comm.allreduce(layer.weight.grad)   # summed over the ranks holding these channels
    db = grid.batch_comm.allreduce(layer.bias.grad)
    return {"y": rel_err(y, y_ref[index]), "dx": rel_err(dx, dx_ref[index]),
            "dw": rel_err(dw, dw_ref[c0:c1]), "db": rel_err(db, db_ref[c0:c1])}


@pytest.mark.parametrize("block", [None, 16])
@pytest.mark.parametrize("kind", ["group", "instance"])
@pytest.mark.parametrize("shape,groups", SHAPES)
def test_spatial_norm_equals_unpartitioned(comm, all_ranks_agree, grids, kind, shape, groups, block,
                                           monkeypatch):
    """``block``: None, the default route (the reference, on these small blocks); 16, the
    kernel's blocks of 16 elements (any block of more than 16 takes the kernel route)."""
    if block is not None:
        monkeypatch.setattr(bn_kernel, "BLOCK_ELEMENTS", block)
    for seed, grid in enumerate(grids):
        errors = run_grid(grid, kind, shape, groups, seed)
        all_ranks_agree(max(errors.values()) <= 1e-10, f"grid {grid.dims}, {kind}, {shape}: {errors}")


@pytest.mark.parametrize("kind", ["group", "instance"])
def test_statistics_not_reduced_differ(comm, all_ranks_agree, grids, kind):
    """Without the spatial allreduce every grid that splits space (non-empty blocks) is wrong."""
    shape, groups = SHAPES[0]
    tried = 0
    for grid in grids:
        if grid.dims[1:4] == (1, 1, 1) or any(p > n for p, n in zip(grid.dims[1:4], shape[2:])):
            continue
        tried += 1
        errors = run_grid(grid, kind, shape, groups, 3, patch_out_allreduce=True)
        wrong = comm.allreduce(errors["y"] > 1e-6, op=_lor())
        all_ranks_agree(wrong, f"grid {grid.dims}: local statistics went unnoticed ({errors})")
        good = run_grid(grid, kind, shape, groups, 3)
        all_ranks_agree(max(good.values()) <= 1e-10, f"grid {grid.dims}: {good}")
    all_ranks_agree(tried > 0 or comm.Get_size() == 1, "no grid splits space")


def _lor():
    from mpi4py import MPI
    return MPI.LOR


@pytest.mark.parametrize("kind", ["group", "instance"])
def test_model_parallel_norm(comm, all_ranks_agree, kind):
    """Channel-split: whole groups per model rank equal the unpartitioned op; a cut group is refused."""
    shape, groups = (2, 12, 3, 2, 5), 3          # groups of 4 channels
    size = comm.Get_size()
    for seed, dims in enumerate(d for d in all_grids(size, model=True) if d[4] > 1):
        grid = ProcessGrid(comm, dims)
        whole = kind == "instance" or all(edge % (shape[1] // groups) == 0 for m in range(dims[4])
                                           for edge in channel_range(shape[1], dims[4], m))
        if whole:
            errors = run_grid(grid, kind, shape, groups, seed)
            all_ranks_agree(max(errors.values()) <= 1e-10, f"grid {dims}, {kind}: {errors}")
        else:
            with pytest.raises(ValueError, match="cuts a group"):
                make_layer(kind, grid, shape[1], groups)
        grid.free()


def test_bad_num_groups_refused_on_every_rank(comm, grids):
    with pytest.raises(ValueError, match="num_groups=4 must divide"):
        SpatialGroupNorm3d(4, 6, grid=grids[0], dtype="float64")
