"""The process grid: (sample, depth, height, width) over MPI Cartesian communicators.

World ranks are laid out row-major over ``dims = (Pn, Pd, Ph, Pw)``:
``rank = ((n*Pd + d)*Ph + h)*Pw + w`` (MPI's own Cartesian order, with
``reorder=False`` so a rank keeps its world number).  Two sub-communicators:

- ``spatial_comm``: the Pd*Ph*Pw ranks sharing the sample coordinate ``n``; they
  hold the blocks of one (mini-batch of) sample(s): halo exchange, spatial
  gathers and batch-norm statistics run here.  Its rank is the row-major rank of
  ``spatial_coords`` (``partition.grid_rank``), the same map as ``local_block``.
- ``data_comm``: the Pn ranks sharing ``(d, h, w)``; they hold the same block of
  different samples: data-parallel gradient averaging runs here.

A channel/filter axis can be appended to ``dims`` later; nothing here assumes 4.
"""
from __future__ import annotations

from .partition import block_slices, grid_rank

GRID_AXES = ("n", "d", "h", "w")


def parse_grid(text: str) -> tuple[int, int, int, int]:
    """'2,1,1,2' -> (2, 1, 1, 2): (Pn, Pd, Ph, Pw), every entry an integer >= 1."""
    parts = [t.strip() for t in str(text).split(",")]
    try:
        dims = tuple(int(t) for t in parts)
    except ValueError:
        raise ValueError(f"grid must be 4 comma-separated integers Pn,Pd,Ph,Pw, got {text!r}") from None
    return check_dims(dims)


def check_dims(dims) -> tuple[int, ...]:
    """Validate grid dims: a 4-sequence (Pn, Pd, Ph, Pw) of integers >= 1."""
    dims = tuple(dims)
    if len(dims) != len(GRID_AXES):
        raise ValueError(f"grid dims must have {len(GRID_AXES)} entries (Pn, Pd, Ph, Pw), got {dims}")
    for name, p in zip(GRID_AXES, dims):
        if isinstance(p, bool) or int(p) != p or p < 1:
            raise ValueError(f"grid dims entry P{name} must be an integer >= 1, got {p!r} in {dims}")
    return tuple(int(p) for p in dims)


def all_grids(size: int) -> list[tuple[int, int, int, int]]:
    """Every (Pn, Pd, Ph, Pw) whose product is ``size``, in lexicographic order."""
    divisors = [q for q in range(1, size + 1) if size % q == 0]
    return [(pn, pd, ph, size // (pn * pd * ph)) for pn in divisors for pd in divisors for ph in divisors
            if size % (pn * pd * ph) == 0]


class ProcessGrid:
    """A (Pn, Pd, Ph, Pw) Cartesian grid over ``comm`` with its spatial and data sub-communicators."""

    def __init__(self, comm, dims=None):
        size = comm.Get_size()
        dims = check_dims((size, 1, 1, 1) if dims is None else dims)
        product = dims[0] * dims[1] * dims[2] * dims[3]
        if product != size:
            # every rank knows size and dims: all raise here, before any message
            raise ValueError(f"grid dims {dims} hold {product} ranks but the communicator has {size}")
        self.dims = dims
        self.comm = comm.Create_cart(list(dims), periods=[False] * 4, reorder=False)
        self.rank = self.comm.Get_rank()
        self.coords = tuple(self.comm.Get_coords(self.rank))
        self.spatial_comm = self.comm.Sub([False, True, True, True])
        self.data_comm = self.comm.Sub([True, False, False, False])

    @property
    def spatial_dims(self) -> tuple[int, int, int]:
        return self.dims[1:4]

    @property
    def spatial_coords(self) -> tuple[int, int, int]:
        return self.coords[1:4]

    @property
    def sample_coord(self) -> int:
        return self.coords[0]

    @property
    def spatial_rank(self) -> int:
        return grid_rank(self.spatial_coords, self.spatial_dims)

    def rank_of(self, coords) -> int:
        """Row-major world rank of grid ``coords`` (n, d, h, w)."""
        return grid_rank(coords, self.dims)

    def local_block(self, global_shape_dhw) -> tuple[slice, slice, slice]:
        """Slices of this rank's balanced block of a (D, H, W) volume."""
        return block_slices(tuple(global_shape_dhw), self.spatial_dims, self.spatial_coords)

    def free(self) -> None:
        """Release the communicators (collective over the grid)."""
        for c in (self.data_comm, self.spatial_comm, self.comm):
            c.Free()

    def __repr__(self) -> str:
        return f"ProcessGrid(dims={self.dims}, rank={self.rank}, coords={self.coords})"
