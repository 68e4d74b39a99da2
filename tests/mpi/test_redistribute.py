"""Redistribution under real MPI on every (Pn, Pd, Ph, Pw) grid of the world size:
gather(scatter(x)) == x, allgather == the whole array, and a dot-product test
<F x, y> == <x, F* y> (float64, summed over ranks) for every operator/adjoint pair."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi4py import MPI

from refimpl.parallel import buffers, fake_device
from refimpl.parallel.redistribute import (allgather_spatial, broadcast, gather_spatial,
                                           reduce_scatter_spatial, scatter_spatial, sum_reduce)


def agree(comm, all_ranks_agree, checks, context):
    failed = comm.allgather([name for name, ok in checks.items() if not ok])
    all_ranks_agree(not any(failed), f"{context}: failed per rank {failed}")


def world_sum(*values):
    return MPI.COMM_WORLD.allreduce(np.array(values, dtype=float))


def close(a, b):
    return abs(a - b) <= 1e-12 * max(abs(a), abs(b), 1e-300)


def check_pairs(grid, shape, seed):
    """All operator/adjoint checks on one grid; the same keys on every rank."""
    comm = grid.spatial_comm
    rank = comm.Get_rank()
    root = (seed + 1) % comm.Get_size()
    rng = np.random.default_rng([seed, MPI.COMM_WORLD.Get_rank()])  # different data per rank
    whole = rng.standard_normal(shape)
    block = whole[(Ellipsis,) + grid.local_block(shape[-3:])]
    y_block = rng.standard_normal(block.shape)

    # scatter <-> gather: root's whole array vs. every rank's block
    scattered = scatter_spatial(whole if rank == root else None, grid, root)
    gathered = gather_spatial(y_block, grid, root)
    round_trip = gather_spatial(scattered, grid, root)
    sg = world_sum(np.vdot(scattered, y_block), np.vdot(whole, gathered) if rank == root else 0.0)

    # allgather <-> reduce-scatter
    everything = allgather_spatial(block, grid)
    y_whole = rng.standard_normal(shape)
    mine = reduce_scatter_spatial(y_whole, grid)
    ar = world_sum(np.vdot(everything, y_whole), np.vdot(block, mine))
    total = comm.allreduce(y_whole)  # the reduce-scatter's result, via a plain allreduce

    # broadcast <-> sum_reduce
    copies = broadcast(whole if rank == root else None, comm, root)
    summed = sum_reduce(y_whole, comm, root)
    bs = world_sum(np.vdot(copies, y_whole), np.vdot(whole, summed) if rank == root else 0.0)
    root_whole = comm.bcast(whole, root)
    return {
        "scatter = own block of root's array": np.array_equal(scattered, root_whole[(Ellipsis,) + grid.local_block(shape[-3:])]),
        "gather(scatter(x)) == x": (round_trip is None) if rank != root else np.array_equal(round_trip, whole),
        f"scatter/gather dot {sg}": close(*sg),
        "allgather holds the own block": np.array_equal(everything[(Ellipsis,) + grid.local_block(shape[-3:])], block),
        "reduce-scatter = own block of the sum": np.allclose(mine, total[(Ellipsis,) + grid.local_block(shape[-3:])],
                                                             rtol=1e-13, atol=1e-13),
        f"allgather/reduce-scatter dot {ar}": close(*ar),
        "broadcast = root's array": np.array_equal(copies, root_whole),
        f"broadcast/sum-reduce dot {bs}": close(*bs),
    }


@settings(max_examples=8)
@given(shape=st.tuples(st.integers(1, 2), st.integers(1, 2), st.integers(1, 7), st.integers(1, 6),
                       st.integers(1, 5)),
       seed=st.integers(0, 2**20))
def test_operator_adjoint_pairs(comm, all_ranks_agree, grids, shape, seed):
    for grid in grids:
        agree(comm, all_ranks_agree, check_pairs(grid, shape, seed), f"grid={grid.dims} shape={shape}")


def test_allgather_assembles_the_whole_array(comm, all_ranks_agree, grids):
    shape = (2, 3, 5, 2, 3)  # D=3 over up to 8 ranks: empty blocks
    x = np.arange(np.prod(shape), dtype=float).reshape(shape)  # the same everywhere
    for grid in grids:
        block = x[(Ellipsis,) + grid.local_block(shape[-3:])]
        gathered = gather_spatial(block, grid, root=0)  # collective: every rank calls it
        on_root = grid.spatial_comm.Get_rank() == 0
        agree(comm, all_ranks_agree, {"allgather": np.array_equal(allgather_spatial(block, grid), x),
                                      "gather": np.array_equal(gathered, x) if on_root else gathered is None},
              f"grid={grid.dims}")


def test_blocks_that_do_not_tile_raise_on_every_rank(comm, all_ranks_agree, grids):
    grid = grids[0]  # (1, 1, 1, size): all ranks in one spatial group
    block = np.zeros((1, 1) + tuple(s.stop - s.start for s in grid.local_block((4, 4, 4))))
    bad = np.zeros((1, 1, 5) + block.shape[-2:]) if grid.spatial_comm.Get_rank() == 0 else block
    try:
        gather_spatial(bad, grid)
        message = ""
    except ValueError as err:
        message = str(err)
    all_ranks_agree("balanced blocks" in message or grid.spatial_comm.Get_size() == 1 and message == "",
                    message)


@pytest.mark.parametrize("aware", [True, False], ids=["cuda-aware", "staged"])
def test_device_buffers(comm, all_ranks_agree, grids, monkeypatch, aware):
    """The same operators on fake device arrays (host memory behind __cuda_array_interface__)."""
    monkeypatch.setattr(buffers, "array_module", fake_device.array_module)
    was = buffers.cuda_aware()
    buffers.set_cuda_aware(aware)
    try:
        grid = grids[0]
        comm_s = grid.spatial_comm
        x = np.arange(24.0).reshape(1, 2, 3, 2, 2)
        summed = sum_reduce(fake_device.HostDeviceArray(x), comm_s, 0)
        ok = (summed is None) if comm_s.Get_rank() else np.array_equal(summed.host, x * comm_s.Get_size())
    finally:
        buffers.set_cuda_aware(was)
    all_ranks_agree(ok, f"aware={aware}")
