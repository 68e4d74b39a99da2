"""Spatially parallel reads under mpiexec: the ranks' hyperslabs reassemble every sample.

For each (Pn, Pd, Ph, Pw) arrangement of the world (rank = ((n Pd + d) Ph + h) Pw + w,
computed here without ProcessGrid), every rank reads its data rank's part of a
global batch through ``Loader`` and its spatial block through ``HDF5Reader``;
rank 0 gathers the blocks and checks that they tile each sample of the global
batch exactly once and equal the sample read whole, and that the bytes read
add up to the samples' size.  Extents are small and uneven, so some grids have
empty blocks and some data ranks an empty local batch.
"""
import numpy
import pytest

pytest.importorskip("h5py", reason="h5py is not installed: pip install 'refimpl[test]'")

from refimpl.data.cosmo import generate_universe  # noqa: E402
from refimpl.data.layout import write_split  # noqa: E402
from refimpl.data.loader import Loader  # noqa: E402
from refimpl.data.reader import HDF5Reader, block_slices  # noqa: E402

SIZE = (6, 5, 4)
SAMPLES, GLOBAL_BATCH = 6, 4


def arrangements(p: int):
    """(Pn, Pd, Ph, Pw) grids with Pn Pd Ph Pw = p: spatial along each axis, data only, mixed."""
    grids = [(1, p, 1, 1), (1, 1, p, 1), (1, 1, 1, p), (p, 1, 1, 1)]
    if p % 2 == 0:
        grids.append((2, p // 2, 1, 1))
    if p % 4 == 0:
        grids += [(1, 2, 2, p // 4), (p // 4, 1, 2, 2)]
    return list(dict.fromkeys(grids))


def coords_of(rank: int, dims):
    """Row-major coordinates of ``rank`` in ``dims`` (the last axis varies fastest)."""
    coords = []
    for extent in reversed(dims):
        coords.append(rank % extent)
        rank //= extent
    return tuple(reversed(coords))


@pytest.fixture(params=["single", "per-sample"])
def dataset(request, comm, tmp_path):
    """Rank 0 writes the dataset; every rank gets its path (or rank 0's error)."""
    path, error = None, None
    if comm.rank == 0:
        path = str(tmp_path / ("train.h5" if request.param == "single" else "train"))
        try:
            write_split(path, lambda i: generate_universe(i, 3, SIZE, channels=2), SAMPLES, 0,
                        {"generator": "cosmoflow", "seed": 3}, layout=request.param, chunk_edge=2)
        except Exception as err:  # reported on every rank below, never a bare raise before bcast
            error = repr(err)
    return comm.bcast((path, error), root=0)


def test_hyperslabs_reassemble_the_global_batch(comm, all_ranks_agree, dataset):
    path, error = dataset
    all_ranks_agree(error is None, f"writing the dataset failed: {error}")
    for dims in arrangements(comm.size):
        n, d, h, w = coords_of(comm.rank, dims)
        block = block_slices(SIZE, dims[1:], (d, h, w))
        problem = None
        try:
            with HDF5Reader(path, spatial_block=block, cache=True) as reader:
                loader = Loader(reader, GLOBAL_BATCH, data_rank=n, data_size=dims[0], seed=5,
                                epoch=1)
                batch = loader.next_batch()
                payload = reader.bytes_read - batch.y.nbytes
        except ValueError as err:
            problem, batch, payload = repr(err), None, 0
        all_ranks_agree(problem is None, f"dims={dims} rank={comm.rank}: {problem}")
        pieces = comm.gather((block, batch.indices, batch.x, payload), root=0)
        ok, message = True, ""
        if comm.rank == 0:
            with HDF5Reader(path) as whole:
                expected = loader.global_indices(1, 0).tolist()
                out = {i: numpy.zeros(whole.sample_shape, numpy.float32) for i in expected}
                hits = {i: numpy.zeros(SIZE, int) for i in expected}
                for piece_block, indices, x, _ in pieces:
                    for j, i in enumerate(indices):
                        out[i][(slice(None),) + piece_block] = x[j]
                        hits[i][piece_block] += 1
                spatial = dims[1] * dims[2] * dims[3]
                seen = sorted(i for _, indices, _, _ in pieces for i in indices)
                ok = seen == sorted(expected * spatial)
                ok = ok and all(numpy.all(hits[i] == 1) for i in expected)
                ok = ok and all(numpy.array_equal(out[i], whole.read(i)[0]) for i in expected)
                total = sum(p[3] for p in pieces)
                ok = ok and total == GLOBAL_BATCH * whole.read(0)[0].nbytes
                message = f"dims={dims}: seen={seen} expected={expected} bytes={total}"
        all_ranks_agree(comm.bcast(ok, root=0), message)


def test_blocks_are_the_row_major_map(comm, all_ranks_agree):
    """Gathered (rank -> block) equals the row-major map computed on rank 0 alone."""
    dims = (1, 2, 2, comm.size // 4) if comm.size % 4 == 0 else (1, comm.size, 1, 1)
    n, d, h, w = coords_of(comm.rank, dims)
    mine = block_slices(SIZE, dims[1:], (d, h, w))
    blocks = comm.allgather(mine)
    expected = [block_slices(SIZE, dims[1:], coords_of(r, dims)[1:]) for r in range(comm.size)]
    all_ranks_agree(blocks == expected and comm.rank == ((n * dims[1] + d) * dims[2] + h) * dims[3] + w,
                    f"{blocks} != {expected}")
