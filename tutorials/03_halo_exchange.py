# %% [markdown]
# # Tutorial 3 — Halo exchange and its adjoint
#
# Run it with any number of ranks:
#
#     mpiexec -n 4 --oversubscribe python tutorials/03_halo_exchange.py     (any number of ranks; 1 works too)
#
# A spatially parallel convolution splits every sample into blocks, one per rank. A 3×3×3
# kernel at the edge of a block reads voxels that a *neighbour* owns: before computing, each
# rank fetches those "ghost" voxels — the **halo exchange**. In backward, the gradient that
# lands on a ghost belongs to its owner: the **adjoint** exchange sends it back, *adds* it
# into the owner's block, and *clears* the ghost. This tutorial runs both (`HaloExchange.forward`
# and `.adjoint` in `refimpl/parallel/halo.py`: read them next to it, each a few dozen lines of
# `Isend`/`Irecv` over the plan of tutorial 02) and checks them. The grid of ranks is a tuple
# `(Pn, Pd, Ph, Pw)`: samples split over Pn groups, each sample's voxels over Pd x Ph x Pw.

# %%
import numpy as np
from mpi4py import MPI

from refimpl.parallel.grid import ProcessGrid
from refimpl.parallel.halo import HaloExchange
from refimpl.parallel.partition import bytes_sent, conv_halo_plan

comm = MPI.COMM_WORLD
say = print if comm.rank == 0 else (lambda *a, **k: None)

# %% [markdown]
# ## 1. A process grid and balanced blocks
#
# The grid is `(Pn, Pd, Ph, Pw)`: here one sample group and all ranks splitting the depth axis
# (with 4 or 8 ranks we also split height). Extent `n` over `p` ranks gives block `i` the
# range starting at `(n//p)*i + min(i, n%p)` with `n//p + (i < n%p)` elements — uneven
# extents are fine, and blocks are empty when `p > n`.

# %%
P = comm.size
dims = (1, P // 2, 2, 1) if P % 2 == 0 and P > 2 else (1, P, 1, 1)
grid = ProcessGrid(comm, dims)
global_dhw = (11, 6, 5)                      # odd, non-divisible on purpose
block = grid.local_block(global_dhw)
print(f"rank {comm.rank}: coords {grid.coords}, owns D{block[0].start}:{block[0].stop} "
      f"H{block[1].start}:{block[1].stop} W{block[2].start}:{block[2].stop}", flush=True)

# %% [markdown]
# ## 2. The plan: which inputs each rank needs
#
# A kernel `k` with stride `s`, padding `p`, dilation `d`: outputs `[o0, o1)` read inputs
# `[s*o0 - p, s*(o1-1) - p + d(k-1)]`. The plan partitions the **output** into balanced blocks,
# derives each rank's needed input range, clips it to the domain (the clipped part is the
# layer's zero padding, never a neighbour's data) and lists who sends what to whom.

# %%
kernel, stride, padding, dilation = (3, 3, 3), (1, 1, 1), (1, 1, 1), (2, 1, 1)
plan = conv_halo_plan(global_dhw, grid.spatial_dims, kernel, stride, padding, dilation)
coords = grid.spatial_coords
print(f"rank {comm.rank}: needs {plan.needed(coords)}, edge padding {plan.padding(coords)}", flush=True)

# %% [markdown]
# ## 3. Forward: fill the ghosts
#
# Every rank makes the same global array (same seed), keeps its block, and exchanges.
# Axes go one at a time — D, then H, then W — and each later message includes the ghosts
# received on earlier axes, so corner voxels travel in two hops without diagonal messages.

# %%
C = 2
x_global = np.random.default_rng(0).standard_normal((C,) + global_dhw)   # (C, D, H, W)
x_local = np.ascontiguousarray(x_global[(slice(None),) + block])         # (C, d, h, w) owned block
halo = HaloExchange(plan, grid)
x_ext = halo.forward(x_local)                                            # (C, needed range)
needed = tuple(slice(a, b) for a, b in plan.needed(coords))
assert np.array_equal(x_ext, x_global[(slice(None),) + needed])
ok = comm.allreduce(1, op=MPI.SUM)
say(f"forward: every rank's extended block equals the global slice ({ok} ranks checked)")

# %% [markdown]
# The bytes sent are exactly what the plan predicts:

# %%
predicted = bytes_sent(plan, x_local.itemsize, channels=C, batch=1)[grid.spatial_rank]
assert halo.bytes_sent == predicted
say(f"bytes sent by rank 0: {halo.bytes_sent} (plan: {predicted})")

# %% [markdown]
# ## 4. Backward is the adjoint: add ghosts back, then clear them
#
# Call the exchange `F` (a linear map from all blocks to all extended blocks). Its adjoint
# `F*` satisfies `<F x, y> = <x, F* y>` for every `x, y`. Forgetting the *add* loses gradient;
# forgetting the *clear* counts it twice. The dot-product test catches both:

# %%
y_ext = np.random.default_rng(100 + comm.rank).standard_normal(x_ext.shape)
lhs = comm.allreduce(float(np.sum(halo.forward(x_local) * y_ext)))
rhs = comm.allreduce(float(np.sum(x_local * halo.adjoint(y_ext))))
say(f"<F x, y> = {lhs:.12f}\n<x, F*y> = {rhs:.12f}   (relative difference {abs(lhs - rhs) / abs(lhs):.1e})")
assert abs(lhs - rhs) <= 1e-12 * abs(lhs)

# %% [markdown]
# Next: `04_spatial_conv.py` wraps this exchange around a local convolution.
