# %% [markdown]
# # Tutorial 8 — One hybrid-parallel training step, and why it equals the one-process step
#
#     mpiexec -n 4 --oversubscribe python tutorials/08_hybrid_training_step.py     (any number of ranks; 1 works too)
#
# The grid `(Pn, Pd, Ph, Pw)` combines **data parallelism** (Pn groups, each with its own samples)
# and **spatial parallelism** (each sample split over Pd x Ph x Pw ranks). One training step is:
#
# 1. each rank takes its samples and its spatial block of them;
# 2. forward: every window layer exchanges halos, the dense head starts with one allreduce of
#    partial products over the spatial group;
# 3. the loss is reduced over the global batch, so every rank sees the same number;
# 4. backward: adjoint halo exchanges; each parameter gradient is a *partial* sum;
# 5. gradient synchronisation: **sum over spatial shards, average over data replicas** — one
#    bucketed allreduce over the whole grid, started while backward is still running;
# 6. the optimizer step, identical on every rank.
#
# At the end we compare with the same model trained on one process.

# %%
import numpy as np
from mpi4py import MPI

from refimpl.models import PRESETS, build_model
from refimpl.parallel.grad_sync import GradientSynchronizer
from refimpl.parallel.grid import ProcessGrid

comm = MPI.COMM_WORLD
say = print if comm.rank == 0 else (lambda *a, **k: None)
P = comm.size
pn = 2 if P % 2 == 0 and P > 2 else 1          # two sample groups when P is even (P > 2),
dims = (pn, P // pn, 1, 1)                     # each sample split over the rest along depth
grid = ProcessGrid(comm, dims)
say(f"grid (Pn, Pd, Ph, Pw) = {dims}")

# %% [markdown]
# ## 1. The model on the grid, and the same model on one process
# Weights come from the seed alone, so both start identical. float64 to compare tightly.
#
# The `GradientSynchronizer` is what turns each rank's partial weight gradients into the true
# ones. It packs the gradients into a few flat **buckets** in the order backward produces them
# (output side first); a hook on each parameter starts a bucket's allreduce over the data x
# spatial ranks as soon as its last gradient is written, while backward goes on with the earlier
# layers; `sync.finish()` after backward waits for every bucket and divides by Pn (an average over
# the sample groups; over the spatial ranks the partial sums just add up). `bucket_bytes` caps a
# bucket's size. (Tutorial 06 passes `reduce_comm`: the product communicator when the caller has
# it already; tutorial 12 reorders and splits the exchange.)

# %%
config = dict(PRESETS["cosmoflow"]["tiny"], dropout=0.5)   # dropout on: masks must line up too
batch = 4                                                   # global batch, divisible by Pn
model = build_model("cosmoflow", config, grid, seed=3, dtype=np.float64, global_batch=batch)
single = build_model("cosmoflow", config, None, seed=3, dtype=np.float64, global_batch=batch)
sync = GradientSynchronizer(model.parameters(), grid.data_comm, grid.spatial_comm,
                            bucket_bytes=64 * 1024, first_bucket_bytes=8 * 1024)

rng = np.random.default_rng(0)
x = rng.standard_normal((batch,) + model.input_shape)      # (B, C, D, H, W) global batch
target = rng.uniform(-1, 1, (batch, 4))
x_local = model.local_input(x)                              # (B/Pn, C, local block)
print(f"rank {comm.rank}: coords {grid.coords}, local input {x_local.shape}", flush=True)

# %% [markdown]
# ## 2. The step, on the grid

# %%
lr = 0.05
out = model.forward(x_local)
loss, dout, metrics = model.loss(out, model.local_target(target))
model.backward(dout)        # gradient hooks start bucket allreduces as gradients become ready
sync.finish()               # wait for them; sum over spatial shards, average over data replicas
for p in model.parameters():
    p.data -= lr * p.grad
say(f"grid step:   loss {loss:.12f}  mae {metrics['mae']:.12f}")

# %% [markdown]
# ## 3. The same step on one process (every rank can do it: no messages)

# %%
out1 = single.forward(x)
loss1, dout1, metrics1 = single.loss(out1, target)
single.backward(dout1)
for p in single.parameters():
    p.data -= lr * p.grad
say(f"single step: loss {loss1:.12f}  mae {metrics1['mae']:.12f}")

worst = max(np.abs(a - b).max() / np.abs(b).max()
            for a, b in zip(model.state_dict().values(), single.state_dict().values()))
worst = comm.allreduce(worst, op=MPI.MAX)
say(f"largest relative difference of any parameter after the step: {worst:.1e}")
assert worst < 1e-10

# %% [markdown]
# The same holds for any grid and for the 3D U-Net (batch norm then reduces its statistics
# over the whole grid); `tests/mpi/test_models_grid_invariance.py` checks it on data x spatial
# grids of 1, 2, 3, 4 and 8 ranks (pure data, pure spatial and mixed; uneven and empty blocks
# included) and on grids with a model axis of 2, 3, 4, 6 and 8 ranks. To train for real:
# `refimpl train --help`.
