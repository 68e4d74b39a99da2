# %% [markdown]
# # Tutorial 7 — Allreduce algorithms, from point-to-point messages
#
#     mpiexec -n 4 --oversubscribe python tutorials/07_allreduce.py     (any number of ranks; 1 works too)
#
# Data-parallel training sums gradients over ranks. `refimpl.parallel.collectives` runs the
# classic algorithms built from `Isend`/`Irecv` (each a short generator in its own module of
# `refimpl/parallel/allreduce/`, with its cost formula and its options beside it: read one next
# to this tutorial); "native" is MPI's own
# `MPI_Allreduce`. Costs use the alpha-beta(-gamma) model: a message of n bytes takes
# alpha + beta n (alpha: latency, beta: seconds per byte), adding n bytes takes gamma n. With more
# ranks than cores (mpiexec --oversubscribe) the measured times exceed the predictions: the ranks
# take turns on the cores.
#
# | algorithm | alpha-beta cost (p ranks, n bytes) |
# |---|---|
# | ring (reduce-scatter + allgather) | 2(p-1)α + 2(p-1)/p·nβ |
# | recursive doubling | lg p·(α + nβ) |
# | halving-doubling (Rabenseifner) | 2 lg p·α + 2(p-1)/p·nβ |
# | multi-colour (IBM) | k trees, each reducing n/k |
# | hierarchical (2-D) | within groups, across, within |
#
# Each equals MPI's own `Allreduce` (bit for bit on integers).

# %%
import time

import numpy as np
from mpi4py import MPI

from refimpl.parallel.collectives import ALGORITHMS, allreduce, predicted_time

comm = MPI.COMM_WORLD
say = print if comm.rank == 0 else (lambda *a, **k: None)

# %% [markdown]
# ## 1. Same answer as MPI
# An odd size (not divisible by the rank count) of integers: every algorithm must match exactly.

# %%
n = 1_000_003
data = np.random.default_rng(comm.rank).integers(-1000, 1000, n, dtype=np.int64)
reference = np.empty_like(data)
comm.Allreduce(data, reference)
for name in ALGORITHMS:
    result = allreduce(data.copy(), comm, algorithm=name)
    same = comm.allreduce(int(np.array_equal(result, reference)), op=MPI.MIN)
    say(f"{name:>20}: equal to MPI Allreduce: {bool(same)}")
    assert same

# %% [markdown]
# ## 2. Measured time next to the model's prediction
# alpha and beta here are rough guesses for shared memory on one machine
# (`scripts/bench_allreduce.py` fits them from measurements).

# %%
alpha, beta = 5e-6, 1.0 / 2e9
buf = np.random.default_rng(comm.rank).standard_normal(2**20)   # 8 MiB of float64
for name in ALGORITHMS:
    allreduce(buf.copy(), comm, algorithm=name)                  # warm-up: first-touch costs
    comm.Barrier()
    t0 = time.perf_counter()
    allreduce(buf.copy(), comm, algorithm=name)
    elapsed = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    say(f"{name:>20}: {elapsed * 1e3:8.2f} ms measured, "
        f"{predicted_time(name, buf.nbytes, comm.size, alpha, beta) * 1e3:8.2f} ms predicted")
