"""Halo exchange under real MPI, on every (Pn, Pd, Ph, Pw) grid of the world size.

For Hypothesis-drawn window ops (kernels 1-7 incl. even, strides 1-3, paddings
0..k, dilations 1-2) on small odd/prime/uneven volumes (tiny ones leave blocks
empty at 8 ranks):
- forward fills exactly the slice of the global array the rank needs, and a local
  correlation on it (with the plan's explicit padding) equals the owned block of
  the global correlation;
- adjoint: <F x, y> == <x, F* y> in float64, dot products summed over all ranks;
- the bytes handed to MPI equal the plan's prediction (forward, then adjoint).
"""
import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi4py import MPI

from refimpl.parallel.halo import HaloExchange
from refimpl.parallel.partition import bytes_sent, conv_halo_plan, window_output_extent


@st.composite
def windows(draw):
    """Per-axis (n, k, s, p, d) with n small, odd, prime or uneven."""
    axes = []
    for _ in range(3):
        k, s, d = draw(st.integers(1, 7)), draw(st.integers(1, 3)), draw(st.integers(1, 2))
        p = draw(st.integers(0, k))
        low = max(1, d * (k - 1) + 1 - 2 * p)
        axes.append((draw(st.integers(low, max(low, 9))), k, s, p, d))
    return tuple(zip(*axes))  # (shape, kernel, stride, padding, dilation), each a 3-tuple


def correlate(x, taps, stride, dilation, out_shape):
    """Unpadded strided dilated 3-D correlation of (..., D, H, W) with one (kd, kh, kw) filter."""
    y = np.zeros(x.shape[:-3] + tuple(out_shape))
    if 0 in out_shape:
        return y
    for j in itertools.product(*(range(k) for k in taps.shape)):
        index = tuple(slice(jj * d, jj * d + s * (o - 1) + 1, s)
                      for jj, d, s, o in zip(j, dilation, stride, out_shape))
        y += taps[j] * x[(Ellipsis,) + index]
    return y


def at(region):
    return (Ellipsis,) + tuple(slice(a, b) for a, b in region)


def agree(comm, all_ranks_agree, checks, context):
    """Collective verdict naming every rank's failed checks."""
    failed = comm.allgather([name for name, ok in checks.items() if not ok])
    all_ranks_agree(not any(failed), f"{context}: failed per rank {failed}")


def check_halo(grid, shape, kernel, stride, padding, dilation, seed, lead):
    """All checks of one window op on one grid; returns {check name: ok} (same keys on every rank)."""
    rng = np.random.default_rng(seed)  # identical global data on every rank
    x = rng.standard_normal(lead + shape)
    taps = rng.standard_normal(kernel)
    out_shape = tuple(window_output_extent(*a) for a in zip(shape, kernel, stride, padding, dilation))
    pad = [(0, 0)] * len(lead) + [(p, p) for p in padding]
    y_global = correlate(np.pad(x, pad), taps, stride, dilation, out_shape)

    plan = conv_halo_plan(shape, grid.spatial_dims, kernel, stride, padding, dilation)
    halo = HaloExchange(plan, grid)
    c = grid.spatial_coords
    local = x[at(plan.owned(c))]
    ext = halo.forward(local)
    forward_bytes = halo.bytes_sent
    local_pad = [(0, 0)] * len(lead) + list(plan.padding(c))
    outputs = plan.outputs(c)
    y_local = correlate(np.pad(ext, local_pad), taps, stride, dilation, tuple(b - a for a, b in outputs))

    my_rng = np.random.default_rng([seed, MPI.COMM_WORLD.Get_rank()])
    x_probe, y_probe = my_rng.standard_normal(local.shape), my_rng.standard_normal(ext.shape)
    fx = halo.forward(x_probe)
    halo.bytes_sent = 0
    fty = halo.adjoint(y_probe)
    adjoint_bytes = halo.bytes_sent
    frame = halo.adjoint_frame(y_probe)
    ghosts = frame.copy()
    ghosts[at([(a - f, b - f) for (a, b), (f, _) in zip(plan.owned(c), halo.frame)])] = 0
    dots = MPI.COMM_WORLD.allreduce(np.array([np.vdot(fx, y_probe), np.vdot(x_probe, fty)]))
    predicted = bytes_sent(plan, itemsize=8, channels=lead[1], batch=lead[0])[grid.spatial_rank]
    predicted_adjoint = bytes_sent(plan, 8, lead[1], lead[0], adjoint=True)[grid.spatial_rank]
    return {
        "forward = global slice": ext.shape == x[at(plan.needed(c))].shape
                                  and np.array_equal(ext, x[at(plan.needed(c))]),
        "local op = global op": y_local.shape == y_global[at(outputs)].shape
                                and np.allclose(y_local, y_global[at(outputs)], rtol=1e-12, atol=1e-12),
        "adjoint shape": fty.shape == local.shape,
        "ghosts cleared": not ghosts.any(),
        f"dot test {dots}": abs(dots[0] - dots[1]) <= 1e-12 * max(abs(dots[0]), 1e-300),
        f"bytes forward {forward_bytes} vs plan {predicted}": forward_bytes == predicted,
        f"bytes adjoint {adjoint_bytes} vs plan {predicted_adjoint}": adjoint_bytes == predicted_adjoint,
    }


@settings(max_examples=10)
@given(op=windows(), seed=st.integers(0, 2**31), lead=st.sampled_from([(1, 1), (2, 1), (1, 2)]))
def test_halo_forward_adjoint_and_bytes(comm, all_ranks_agree, grids, op, seed, lead):
    for grid in grids:
        agree(comm, all_ranks_agree, check_halo(grid, *op, seed, lead), f"grid={grid.dims} op={op}")


def test_wide_halo_and_empty_blocks(comm, all_ranks_agree, grids):
    """Needs reaching several blocks away and empty blocks (D=2, W=3 over up to 8 ranks)."""
    op = ((2, 5, 3), (5, 3, 7), (1, 1, 1), (3, 1, 3), (1, 2, 1))  # shape, kernel, stride, padding, dilation
    for grid in grids:
        agree(comm, all_ranks_agree, check_halo(grid, *op, seed=1, lead=(1, 2)), f"grid={grid.dims}")


def test_float32_and_plan_mismatch(comm, all_ranks_agree, grids):
    grid = grids[0]  # (1, 1, 1, size)
    plan = conv_halo_plan((5, 4, 3), grid.spatial_dims, 3, 1, 1, 1)
    halo = HaloExchange(plan, grid)
    local = np.ones((1, 1) + tuple(b - a for a, b in plan.owned(grid.spatial_coords)), np.float32)
    ext = halo.forward(local)
    try:
        HaloExchange(conv_halo_plan((5, 4, 3), (1, 1, 7), 3), grid)
        mismatch = ""
    except ValueError as err:
        mismatch = str(err)
    try:
        halo.forward(np.ones((1, 1, 9, 9, 9), np.float32))
        bad_shape = ""
    except ValueError as err:
        bad_shape = str(err)
    all_ranks_agree(ext.dtype == np.float32 and (ext == 1).all() and "grid" in mismatch
                    and "local_block" in bad_shape, f"{ext.dtype} {mismatch!r} {bad_shape!r}")
