"""Spatially partitioned layers equal the unpartitioned oracle, under real mpiexec.

Each example draws a global shape (odd, prime, non-divisible extents, small
enough that blocks go empty at 8 ranks), a window (kernel 1-7 odd and even,
stride 1-3, padding 0..k, dilation 1-2), and a grid (Pn, Pd, Ph, Pw) whose
product is the world size (splitting 1, 2 or 3 spatial axes, or samples).
``check_layer`` runs forward and backward partitioned, gathers, and compares
y, dx, dw, db with refimpl.functional on the whole tensor.
"""
from itertools import product

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from refimpl.check import LayerCheck, check_layer
from refimpl.functional.args import transposed_out_size, window_out_size


def grids_for(size):
    """Every (Pn, Pd, Ph, Pw) with product ``size``."""
    divisors = [d for d in range(1, size + 1) if size % d == 0]
    return sorted(g for g in product(divisors, repeat=4) if g[0] * g[1] * g[2] * g[3] == size)


def spec(layer, shape, grid, kernel, stride, padding, dilation, out_channels=None,
         output_padding=(0, 0, 0), dtype="float64", seed=0):
    return LayerCheck(layer=layer, input=shape, grid=grid, out_channels=out_channels, kernel=kernel,
                      stride=stride, padding=padding, dilation=dilation, output_padding=output_padding,
                      dtype=dtype, seed=seed)


@st.composite
def window_cases(draw, comm_size, layer):
    grid = draw(st.sampled_from(grids_for(comm_size)))
    n = draw(st.integers(grid[0], grid[0] + 1))
    c = draw(st.integers(1, 3))
    kernel = tuple(draw(st.integers(1, 7)) for _ in range(3))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(3))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(3)) if layer != "avg_pool3d" else (1, 1, 1)
    if layer in ("max_pool3d", "avg_pool3d"):
        padding = tuple(draw(st.integers(0, k // 2)) for k in kernel)
    else:
        padding = tuple(draw(st.integers(0, k)) for k in kernel)
    extent = tuple(draw(st.sampled_from([1, 2, 3, 5, 7, 11, 13])) for _ in range(3))
    output_padding = (0, 0, 0)
    if layer == "conv_transpose3d":
        output_padding = tuple(draw(st.integers(0, max(s, d) - 1)) for s, d in zip(stride, dilation))
        out = [transposed_out_size(e, k, s, p, d, op) for e, k, s, p, d, op
               in zip(extent, kernel, stride, padding, dilation, output_padding)]
    else:
        out = [window_out_size(e, k, s, p, d) for e, k, s, p, d in zip(extent, kernel, stride, padding, dilation)]
    assume(min(out) >= 1 and out[0] * out[1] * out[2] <= 4000)
    return dict(layer=layer, shape=(n, c) + extent, grid=grid, kernel=kernel, stride=stride,
                padding=padding, dilation=dilation, output_padding=output_padding,
                out_channels=draw(st.integers(1, 3)))


def run_case(comm, all_ranks_agree, case, dtype="float64"):
    report = check_layer(spec(**case, dtype=dtype), comm)
    report = comm.bcast(report, root=0)
    all_ranks_agree(report["ok"], f"{case}: {report['max_rel_err']}")


@pytest.mark.parametrize("layer", ["conv3d", "conv_transpose3d", "max_pool3d", "avg_pool3d"])
def test_window_layer_equals_unpartitioned(comm, all_ranks_agree, layer):
    @given(window_cases(comm.size, layer))
    def check(case):
        run_case(comm, all_ranks_agree, case)
    check()


@given(st.data())
def test_float32_within_1e5(comm, all_ranks_agree, data):
    layer = data.draw(st.sampled_from(["conv3d", "conv_transpose3d", "max_pool3d", "avg_pool3d"]))
    run_case(comm, all_ranks_agree, data.draw(window_cases(comm.size, layer)), dtype="float32")


@pytest.mark.parametrize("seed", [0, 1])
def test_batch_norm_float32_within_1e5(comm, all_ranks_agree, seed):
    """Fixed seeds: dgamma = sum(dy * xhat) cancels by construction (xhat sums to zero), so
    on a few random elements its float32 relative error can be large by chance alone."""
    grid = grids_for(comm.size)[seed % len(grids_for(comm.size))]
    case = dict(layer="batch_norm3d", shape=(grid[0] * 2, 3, 7, 6, 5), grid=grid, kernel=(1, 1, 1),
                stride=(1, 1, 1), padding=(0, 0, 0), dilation=(1, 1, 1))
    report = comm.bcast(check_layer(spec(**case, dtype="float32", seed=seed), comm), root=0)
    all_ranks_agree(report["ok"], f"{case}: {report['max_rel_err']}")


@given(st.data())
def test_batch_norm_equals_unpartitioned(comm, all_ranks_agree, data):
    grid = data.draw(st.sampled_from(grids_for(comm.size)))
    extent = tuple(data.draw(st.sampled_from([1, 2, 3, 5, 7])) for _ in range(3))
    shape = (data.draw(st.integers(grid[0], grid[0] + 2)), data.draw(st.integers(1, 4))) + extent
    assume(shape[0] * extent[0] * extent[1] * extent[2] >= 2)
    case = dict(layer="batch_norm3d", shape=shape, grid=grid, kernel=(1, 1, 1), stride=(1, 1, 1),
                padding=(0, 0, 0), dilation=(1, 1, 1))
    run_case(comm, all_ranks_agree, case)


@given(st.data())
def test_group_instance_and_layer_norm_equal_unpartitioned(comm, all_ranks_agree, data):
    """Statistics per (sample, group) reduced over the spatial ranks: uneven and empty blocks,
    sample splits (nothing to reduce), G from 1 (layer norm) to C (instance norm)."""
    layer = data.draw(st.sampled_from(["group_norm3d", "instance_norm3d", "layer_norm3d"]))
    grid = data.draw(st.sampled_from(grids_for(comm.size)))
    extent = tuple(data.draw(st.sampled_from([1, 2, 3, 5, 7])) for _ in range(3))
    c = data.draw(st.integers(1, 6))
    groups = data.draw(st.sampled_from([g for g in range(1, c + 1) if c % g == 0]))
    options = {"num_groups": groups} if layer == "group_norm3d" else {}
    check = LayerCheck(layer=layer, input=(data.draw(st.integers(grid[0], grid[0] + 1)), c) + extent, grid=grid,
                       options=options)     # float64 (float32: dgamma cancels, as batch norm's)
    report = comm.bcast(check_layer(check, comm), root=0)
    all_ranks_agree(report["ok"], f"{check}: {report['max_rel_err']}")


def test_layer_norm_on_a_d_split_equals_unpartitioned(comm, all_ranks_agree):
    """Layer norm (one statistic per sample over C, D, H, W) with D split over every rank,
    5 cells unevenly (empty blocks beyond 5 ranks): the per-sample sums reduced over them."""
    check = LayerCheck(layer="layer_norm3d", input=(2, 3, 5, 4, 3), grid=(1, comm.size, 1, 1))
    report = comm.bcast(check_layer(check, comm), root=0)
    all_ranks_agree(report["ok"], f"{check}: {report['max_rel_err']}")


def test_halo_wider_than_neighbour_block(comm, all_ranks_agree):
    """Kernel 7 with dilation 2 on 1-voxel blocks: the halo reaches several owners away."""
    grid = (1, comm.size, 1, 1)
    case = dict(layer="conv3d", shape=(1, 2, comm.size, 3, 3), grid=grid, kernel=(7, 1, 1),
                stride=(1, 1, 1), padding=(6, 0, 0), dilation=(2, 1, 1), out_channels=2)
    run_case(comm, all_ranks_agree, case)


def test_bad_requests_fail_on_every_rank(comm, all_ranks_agree):
    """Errors are raised identically on every rank before any message: no rank hangs."""
    bad = [
        dict(layer="conv3d", shape=(1, 1, 5, 5, 5), grid=(comm.size + 1, 1, 1, 1), kernel=(3, 3, 3),
             stride=(1, 1, 1), padding=(0, 0, 0), dilation=(1, 1, 1)),           # grid != world size
        dict(layer="conv3d", shape=(comm.size, 1, 2, 2, 2), grid=(comm.size, 1, 1, 1), kernel=(5, 5, 5),
             stride=(1, 1, 1), padding=(0, 0, 0), dilation=(1, 1, 1)),           # kernel > padded input
        dict(layer="max_pool3d", shape=(comm.size, 1, 5, 5, 5), grid=(comm.size, 1, 1, 1), kernel=(2, 2, 2),
             stride=(2, 2, 2), padding=(2, 0, 0), dilation=(1, 1, 1)),           # pool padding > k/2
    ]
    for case in bad:
        try:
            check_layer(spec(**case), comm)
            raised = ""
        except ValueError as err:
            raised = str(err)
        all_ranks_agree(bool(raised), f"{case} did not raise")


@st.composite
def winograd_cases(draw, comm_size):
    """3x3x3 stride-1 convs wide enough for "auto" to pick Winograd on every block."""
    grid = draw(st.sampled_from(grids_for(comm_size)))
    extent = tuple(draw(st.sampled_from([3, 5, 7, 8, 11, 13])) for _ in range(3))
    return dict(layer=draw(st.sampled_from(["conv3d", "conv_transpose3d"])),
                shape=(draw(st.integers(grid[0], grid[0] + 1)), draw(st.integers(4, 8))) + extent,
                grid=grid, kernel=(3, 3, 3), stride=(1, 1, 1),
                padding=tuple(draw(st.integers(0, 2)) for _ in range(3)), dilation=(1, 1, 1),
                output_padding=(0, 0, 0), out_channels=draw(st.integers(4, 8)))


@given(data=st.data())
def test_winograd_layers_equal_unpartitioned(comm, all_ranks_agree, data, monkeypatch):
    """Winograd on every rank's block (tiles aligned to the block, not the volume) and on
    the whole volume: the same numbers in float64, forward and backward."""
    monkeypatch.setenv("REFIMPL_CONV_ALGORITHM", "winograd")
    run_case(comm, all_ranks_agree, data.draw(winograd_cases(comm.size)))
