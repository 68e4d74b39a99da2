# %% [markdown]
# # Tutorial 11 — Model parallelism: filters, channels and Gholami's 1.5-D dense layers
#
#     mpiexec -n 4 --oversubscribe python tutorials/11_model_parallel.py     (any number of ranks; 1 works too)
#
# Spatial parallelism splits a sample's voxels; data parallelism splits the batch. Both stop
# paying where the activations are small and the weights are big: CosmoFlow's deep blocks
# (256-512 channels on 8^3-4^3 voxels) and its dense head (a 16384 x 128 weight, replicated on
# every rank). There the **channels** are split instead, over a fifth grid axis:
# `(Pn, Pd, Ph, Pw, Pm)`, with the model axis fastest in the rank numbering, so the Pm ranks
# of a model group are neighbours (`grid.model_comm`).
#
# Two collectives carry everything (`refimpl/parallel/channels.py`), each the adjoint of the
# other:
#
# | operator | what it does | adjoint (its backward) |
# |---|---|---|
# | `allgather_channels` | own channel slice -> all C channels on every model rank | `reduce_scatter_channels` |
# | `reduce_scatter_channels` | partial sums of all C -> own slice, summed over the group | `allgather_channels` |
#
# Each moves `(C - c_m) * N * V * itemsize` bytes per rank (`c_m`: the rank's slice, `V`: the
# voxels of its block): Gholami et al.'s bandwidth term `beta (p-1)/p n` when the slices are
# even. This tutorial runs a filter-parallel conv and a 1.5-D dense layer against the
# unpartitioned oracle and prints, per message, the bytes that formula predicts next to the
# bytes the call handed to MPI.

# %%
import numpy as np
from mpi4py import MPI

from refimpl.nn.conv import Conv3d
from refimpl.nn.linear import Linear
from refimpl.nn.model_parallel import FilterParallelConv3d, RowParallelLinear
from refimpl.parallel.channels import TRAFFIC, channel_range, moved_bytes
from refimpl.parallel.grid import ProcessGrid

comm = MPI.COMM_WORLD
say = print if comm.rank == 0 else (lambda *a, **k: None)
size = comm.Get_size()
dims = (1, 2, 1, 1, size // 2) if size % 2 == 0 and size >= 4 else (1, 1, 1, 1, size)
grid = ProcessGrid(comm, dims)
pm, m = grid.model_dims, grid.model_coord
say(f"grid (Pn, Pd, Ph, Pw, Pm) = {dims}: model groups of {pm} ranks, {size // pm} spatial/data positions")

# %% [markdown]
# ## 1. A filter-parallel conv
# Model rank m owns the filters `W[f_m]` of its output slice. Its input arrives channel-split
# (the previous layer's output), so it first gathers every input channel; then the spatial halo
# exchange and a local conv produce `y[f_m]`. In backward, its `dx` uses only its own filters: a
# partial sum over the group, so the adjoint of the allgather, a reduce-scatter, sums and hands
# each rank its channel slice. C = 5 and F = 7 do not divide by Pm: the slices are balanced
# (the first `C % Pm` one longer), as the spatial blocks are.

# %%
n, c, f, extent = 2, 5, max(7, pm), (6, 5, 4)
rng = np.random.default_rng(0)                       # the same global arrays on every rank
x = rng.standard_normal((n, c) + extent)
layer = FilterParallelConv3d(c, f, 3, padding=1, grid=grid, rng=np.random.default_rng(1), dtype=np.float64)
layer.setup(extent)
reference = Conv3d(c, f, 3, padding=1, rng=np.random.default_rng(1), dtype=np.float64)   # same draws, whole
dy = rng.standard_normal((n, f) + extent)

c_m, f_m = slice(*channel_range(c, pm, m)), slice(*channel_range(f, pm, m))
block = tuple(grid.local_block(extent))
voxels = int(np.prod([s.stop - s.start for s in block]))
before = TRAFFIC.bytes
y_local = layer.forward(np.ascontiguousarray(x[(slice(None), c_m) + block]))
sent_forward = TRAFFIC.bytes - before
dx_local = layer.backward(np.ascontiguousarray(dy[(slice(None), f_m) + block]))
sent_backward = TRAFFIC.bytes - before - sent_forward

y_ref = reference.forward(x)
dx_ref = reference.backward(dy)
ok = np.allclose(y_local, y_ref[(slice(None), f_m) + block], rtol=0, atol=1e-12) and \
    np.allclose(dx_local, dx_ref[(slice(None), c_m) + block], rtol=0, atol=1e-12)
predicted = moved_bytes(c, pm, m, n * voxels, 8)
rows = comm.gather((comm.rank, grid.coords, sent_forward, sent_backward, predicted, ok), root=0)
say("rank  coords           allgather(x) sent / predicted   reduce-scatter(dx) sent / predicted   equal")
for r, coords, fwd, bwd, pred, good in rows or []:
    say(f"{r:>4}  {str(coords):<16} {fwd:>10} / {pred:<10}             {bwd:>10} / {pred:<10}              {good}")
assert all(row[-1] for row in comm.allgather((ok,))) and sent_forward == sent_backward == predicted

# %% [markdown]
# ## 2. Gholami's 1.5-D dense layer
# For `Y = W X` (W: d_out x d_in, a batch of B samples) on a Pr x Pc grid, Gholami et al. split
# W by rows over Pr (here the model axis, Pm) and the batch over Pc (the data axis, Pn). Every
# message, with its alpha-beta cost:
#
# - forward: allgather X over Pr, `alpha log Pr + beta (Pr-1)/Pr d_in B/Pc`;
# - backward, dX = W^T dY: a partial sum over Pr, reduce-scattered, the same cost;
# - backward, dW = dY X^T: summed over the batch, allreduced over Pc,
#   `2 alpha log Pc + 2 beta (Pc-1)/Pc d_out d_in / Pr`.
#
# The first two shrink with Pc, the last with Pr: for a fixed batch the cheapest grid is
# usually neither pure data nor pure model parallel. (On this tutorial's grid Pn = 1, so the dW
# allreduce over Pc moves nothing; run it on a grid with Pn > 1 to see it.) Two such layers in a row, against the
# unpartitioned pair:

# %%
d_in, d_hidden, d_out, batch = 11, max(9, pm), max(6, pm), 4
x = rng.standard_normal((batch, d_in))
g = rng.standard_normal((batch, d_out))
first = RowParallelLinear(d_in, d_hidden, grid=grid, rng=np.random.default_rng(2), dtype=np.float64)
second = RowParallelLinear(d_hidden, d_out, grid=grid, rng=np.random.default_rng(3), dtype=np.float64)
ref_first = Linear(d_in, d_hidden, rng=np.random.default_rng(2), dtype=np.float64)
ref_second = Linear(d_hidden, d_out, rng=np.random.default_rng(3), dtype=np.float64)

in_m, hid_m, out_m = (slice(*channel_range(d, pm, m)) for d in (d_in, d_hidden, d_out))
sent = []
for step in ("forward 1", "forward 2"):
    before = TRAFFIC.bytes
    if step == "forward 1":
        h = first.forward(np.ascontiguousarray(x[:, in_m]))          # (B, d_hidden/Pm)
    else:
        y = second.forward(h)                                        # (B, d_out/Pm)
    sent.append(TRAFFIC.bytes - before)
before = TRAFFIC.bytes
dh = second.backward(np.ascontiguousarray(g[:, out_m]))
sent.append(TRAFFIC.bytes - before)
before = TRAFFIC.bytes
dx = first.backward(dh)
sent.append(TRAFFIC.bytes - before)
predicted = [moved_bytes(d_in, pm, m, batch, 8), moved_bytes(d_hidden, pm, m, batch, 8),
             moved_bytes(d_hidden, pm, m, batch, 8), moved_bytes(d_in, pm, m, batch, 8)]
y_ref = ref_second.forward(ref_first.forward(x))
dx_ref = ref_first.backward(ref_second.backward(g))
ok = np.allclose(y, y_ref[:, out_m], rtol=0, atol=1e-12) and np.allclose(dx, dx_ref[:, in_m], rtol=0, atol=1e-12)
grads_ok = np.allclose(first.weight.grad, ref_first.weight.grad[hid_m], rtol=0, atol=1e-12)
names = ("allgather X (layer 1)", "allgather H (layer 2)", "reduce-scatter dH (layer 2)",
         "reduce-scatter dX (layer 1)")
if comm.rank == 0:
    for name, s, p in zip(names, sent, predicted):
        print(f"rank 0 {name:<28} sent {s:>6} B, predicted {p:>6} B")
assert all(comm.allgather(ok and grads_ok and sent == predicted))
say("1.5-D layers equal the unpartitioned pair (output, dX, dW), bytes as predicted: True")

# %% [markdown]
# ## 3. Where next
# `refimpl check-layer conv3d ... --grid 1,2,1,1,2 --model-parallel filter` (or `channel`) runs
# the same comparison for any shape, stride, padding and dilation; docs/model_parallel.md
# describes the layouts and the conventions for replicated tensors. Inside the models,
# `model_parallel="filter"` or `"channel"` places CosmoFlow's and the U-Net's widest layers on the
# model axis, and `refimpl train --grid Pn,Pd,Ph,Pw,Pm --model-parallel filter` trains with it
# (`tests/mpi/test_models_grid_invariance.py` checks both models on such grids).

# %%
grid.free()
