"""ProcessGrid under real MPI: bad grids fail on every rank, communicators and the row-major map."""
import pytest

from refimpl.parallel.grid import ProcessGrid, all_grids, parse_grid
from refimpl.parallel.partition import block_range, grid_coords, grid_rank


def test_parse_grid():
    assert parse_grid("2,1,1,2") == (2, 1, 1, 2)
    assert parse_grid(" 1, 3,1 ,1") == (1, 3, 1, 1)
    for bad in ("2,1,1", "2,1,1,a", "1,0,1,1", "1,1,1,-2", ""):
        with pytest.raises(ValueError, match="grid"):
            parse_grid(bad)


def test_all_grids():
    assert all_grids(1) == [(1, 1, 1, 1)]
    grids = all_grids(8)
    assert len(grids) == 20 and len(set(grids)) == 20  # C(3+3, 3) ordered factorisations of 2^3
    assert all(a * b * c * d == 8 for a, b, c, d in grids) and (1, 2, 2, 2) in grids
    assert all_grids(3) == [(1, 1, 1, 3), (1, 1, 3, 1), (1, 3, 1, 1), (3, 1, 1, 1)]


def test_bad_grid_raises_on_every_rank(comm, all_ranks_agree):
    size = comm.Get_size()
    for dims in ((size + 1, 1, 1, 1), (1, 2 * size, 1, 1), (size, 1, 1, 0), (size, 1, 1)):
        try:
            ProcessGrid(comm, dims)
            raised = ""
        except ValueError as err:
            raised = str(err)
        all_ranks_agree("dims" in raised, f"dims={dims}: {raised!r}")
    comm.Barrier()  # nobody is stuck in a collective the others skipped


def test_communicators_and_row_major_map(comm, all_ranks_agree):
    size, rank = comm.Get_size(), comm.Get_rank()
    for dims in all_grids(size):
        grid = ProcessGrid(comm, dims)
        n, d, h, w = grid.coords
        pn, pd, ph, pw = dims
        checks = {
            "rank": grid.rank == rank,
            "row-major": rank == ((n * pd + d) * ph + h) * pw + w == grid_rank(grid.coords, dims),
            "coords": grid.coords == grid_coords(rank, dims),
            "spatial size": grid.spatial_comm.Get_size() == pd * ph * pw,
            "data size": grid.data_comm.Get_size() == pn,
            "spatial rank": grid.spatial_comm.Get_rank() == grid.spatial_rank
                            == grid_rank((d, h, w), (pd, ph, pw)),
            "data rank": grid.data_comm.Get_rank() == n,
            "spatial peers share n": set(grid.spatial_comm.allgather(n)) == {n},
            "spatial peers' coords": grid.spatial_comm.allgather(grid.spatial_coords)
                                     == [grid_coords(r, (pd, ph, pw)) for r in range(pd * ph * pw)],
            "data peers share dhw": set(grid.data_comm.allgather((d, h, w))) == {(d, h, w)},
            "local block": grid.local_block((7, 5, 3))
                           == tuple(slice(*block_range(e, p, c)) for e, p, c in zip((7, 5, 3), (pd, ph, pw), (d, h, w))),
        }
        grid.free()
        all_ranks_agree(all(checks.values()), f"dims={dims}: {[k for k, v in checks.items() if not v]}")


def test_default_grid_is_pure_data_parallel(comm, all_ranks_agree):
    grid = ProcessGrid(comm)
    ok = grid.dims == (comm.Get_size(), 1, 1, 1) and grid.spatial_comm.Get_size() == 1
    grid.free()
    all_ranks_agree(ok, f"dims={grid.dims}")
