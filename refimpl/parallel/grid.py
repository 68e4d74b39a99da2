"""The process grid: (sample, depth, height, width[, model]) over MPI Cartesian communicators.

World ranks are laid out row-major over ``dims = (Pn, Pd, Ph, Pw)`` or, with a
model axis, ``(Pn, Pd, Ph, Pw, Pm)``::

    rank = ((n*Pd + d)*Ph + h)*Pw + w                     4 entries (Pm = 1)
    rank = (((n*Pd + d)*Ph + h)*Pw + w)*Pm + m            5 entries

(MPI's own Cartesian order, with ``reorder=False`` so a rank keeps its world
number).  The model axis is the fastest: the Pm ranks of a model group are
neighbours in the world numbering, hence on one node when ranks fill nodes in
order, where the channel/filter collectives (the heaviest traffic per layer)
are cheapest.  A 4-entry grid is exactly the grid of before the model axis:
same ranks, same coordinates (4 of them), Pm = 1.  Three sub-communicators:

- ``spatial_comm``: the Pd*Ph*Pw ranks sharing ``n`` (and ``m``); they hold the
  blocks of one (mini-batch of) sample(s) and one channel slice: halo exchange,
  spatial gathers and batch-norm statistics run here.  Its rank is the
  row-major rank of ``spatial_coords`` (``partition.grid_rank``), the same map
  as ``local_block``.
- ``data_comm``: the Pn ranks sharing ``(d, h, w[, m])``; they hold the same
  block of different samples: data-parallel gradient averaging runs here.
- ``model_comm``: the Pm ranks sharing ``(n, d, h, w)``; they hold the same
  block of the same samples, each a slice of the channels of a model-parallel
  layer (refimpl/parallel/channels.py).  Size 1 on a 4-entry grid.
- ``batch_comm``: the Pn*Pd*Ph*Pw ranks sharing ``m``: together they hold the
  whole global batch of one channel slice (statistics over the global batch,
  batch norm's and the losses', are reduced here; the whole grid on 4 entries).
"""
from __future__ import annotations

from .partition import block_slices, grid_rank

GRID_AXES = ("n", "d", "h", "w", "m")


def parse_grid(text: str) -> tuple[int, ...]:
    """'2,1,1,2' -> (2, 1, 1, 2); '1,2,1,1,4' -> (1, 2, 1, 1, 4): every entry an integer >= 1."""
    parts = [t.strip() for t in str(text).split(",")]
    try:
        dims = tuple(int(t) for t in parts)
    except ValueError:
        raise ValueError(f"grid must be 4 or 5 comma-separated integers Pn,Pd,Ph,Pw[,Pm], got {text!r}") from None
    return check_dims(dims)


def check_dims(dims) -> tuple[int, ...]:
    """Validate grid dims: (Pn, Pd, Ph, Pw) or (Pn, Pd, Ph, Pw, Pm), integers >= 1."""
    dims = tuple(dims)
    if len(dims) not in (4, 5):
        raise ValueError(f"grid dims must have 4 entries (Pn, Pd, Ph, Pw) or 5 (Pn, Pd, Ph, Pw, Pm), got {dims}")
    for name, p in zip(GRID_AXES, dims):
        if isinstance(p, bool) or int(p) != p or p < 1:
            raise ValueError(f"grid dims entry P{name} must be an integer >= 1, got {p!r} in {dims}")
    return tuple(int(p) for p in dims)


def world_mismatch(grid_text: str, product: int, world_size: int) -> str:
    """What to say when ``--grid`` does not hold the ranks the launcher started (a ValueError's text)."""
    if world_size == 1:
        return (f"--grid {grid_text} holds {product} ranks but this process is 1 rank (not started by "
                f"mpiexec, or with -n 1): run it as 'mpiexec -n {product} --oversubscribe refimpl ...'")
    return (f"--grid {grid_text} holds {product} ranks but mpiexec started {world_size}; run "
            f"'mpiexec -n {product} ...' or change --grid")


def format_grid(dims) -> str:
    """'2,1,1,1' (or '1,2,1,1,4'): the text form ``parse_grid`` reads, as long as given."""
    return ",".join(str(p) for p in check_dims(dims))


def all_grids(size: int, model: bool = False) -> list[tuple[int, ...]]:
    """Every (Pn, Pd, Ph, Pw) (``model``: every (Pn, Pd, Ph, Pw, Pm)) whose product is ``size``,
    in lexicographic order."""
    divisors = [q for q in range(1, size + 1) if size % q == 0]
    grids = [(pn, pd, ph, size // (pn * pd * ph)) for pn in divisors for pd in divisors for ph in divisors
             if size % (pn * pd * ph) == 0]
    if not model:
        return grids
    return sorted((pn, pd, ph, pw // pm, pm) for pn, pd, ph, pw in grids for pm in divisors if pw % pm == 0)


class ProcessGrid:
    """A (Pn, Pd, Ph, Pw[, Pm]) Cartesian grid over ``comm`` with its spatial, data and model
    sub-communicators."""

    def __init__(self, comm, dims=None):
        size = comm.Get_size()
        dims = check_dims((size, 1, 1, 1) if dims is None else dims)
        product = 1
        for p in dims:
            product *= p
        if product != size:
            # every rank knows size and dims: all raise here, before any message
            raise ValueError(f"grid dims {dims} hold {product} ranks but the communicator has {size}")
        self.dims = dims
        k = len(dims)
        self.comm = comm.Create_cart(list(dims), periods=[False] * k, reorder=False)
        self.rank = self.comm.Get_rank()
        self.coords = tuple(self.comm.Get_coords(self.rank))
        model = [False] * 4 + ([True] if k == 5 else [])
        self.spatial_comm = self.comm.Sub([False, True, True, True] + [False] * (k - 4))
        self.data_comm = self.comm.Sub([True, False, False, False] + [False] * (k - 4))
        self.model_comm = self.comm.Sub(model) if k == 5 else self.comm.Split(self.rank, 0)
        self.batch_comm = self.comm.Sub([True] * 4 + [False] * (k - 4)) if k == 5 else self.comm

    @property
    def model_dims(self) -> int:
        """Pm: ranks splitting the channels of a model-parallel layer (1 on a 4-entry grid)."""
        return self.dims[4] if len(self.dims) == 5 else 1

    @property
    def model_coord(self) -> int:
        return self.coords[4] if len(self.coords) == 5 else 0

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

    def local_block(self, global_shape_dhw) -> tuple[slice, slice, slice]:
        """Slices of this rank's balanced block of a (D, H, W) volume."""
        return block_slices(tuple(global_shape_dhw), self.spatial_dims, self.spatial_coords)

    def free(self) -> None:
        """Release the communicators (collective over the grid)."""
        extra = [self.batch_comm] if self.batch_comm is not self.comm else []
        for c in extra + [self.model_comm, self.data_comm, self.spatial_comm, self.comm]:
            c.Free()

    def __repr__(self) -> str:
        return f"ProcessGrid(dims={self.dims}, rank={self.rank}, coords={self.coords})"
