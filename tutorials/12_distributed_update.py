# %% [markdown]
# # Tutorial 12 — The gradient exchange: distributed weight update, compression, priorities
#
#     mpiexec -n 4 --oversubscribe python tutorials/12_distributed_update.py     (any number of ranks; 1 works too)
#
# Data parallelism ends every step with an allreduce of the gradients, then every rank runs the
# same optimizer update on every parameter. An allreduce of n numbers over p ranks is two
# collectives in a row:
#
# - a **reduce-scatter**: rank r ends with the sum of block r (n/p numbers);
# - an **allgather**: every block goes to every rank.
#
# Each moves `(p-1)/p n` numbers per rank. Because the optimizer update is elementwise (SGD
# momentum, Adam), it can run *between* the halves: rank r updates only block r, with only
# block r's optimizer state, and the allgather then ships updated parameters instead of summed
# gradients. Same bytes, 1/p of the optimizer memory and update work: MLSL's distributed update
# (Sridharan et al. 2018), ZeRO stage 1 (Rajbhandari et al. 2020). This tutorial checks the halves
# against MPI, runs the distributed update against the plain one, then looks at the other
# way to spend fewer bytes: compressing what each rank sends, with error feedback; and last at
# *when* each bucket is needed: prioritised buckets, which let the next forward start early.

# %%
import numpy as np
from mpi4py import MPI

from refimpl.models import build_model
from refimpl.optim import make_optimizer
from refimpl.parallel import compress
from refimpl.parallel.collectives import allgather, halves, owned_block, reduce_scatter
from refimpl.parallel.grad_sync import GradientSynchronizer
from refimpl.parallel.grid import ProcessGrid
from refimpl.parallel.partition import block_range
from refimpl.parallel.priority import LayerwiseUpdate
from refimpl.parallel.sharded_update import ShardedOptimizer

comm = MPI.COMM_WORLD
rank, p = comm.Get_rank(), comm.Get_size()


def say(*args):
    if rank == 0:
        print(*args)


# %% [markdown]
# ## 1. The halves
# `reduce_scatter(buf, comm, algorithm)` sums `buf` over the ranks and leaves this rank's block
# of the sum in place; `owned_block` says which block: balanced blocks, block r on rank r, for
# every algorithm. `allgather` is its adjoint: it fills every block from its owner. Together
# they are the allreduce.

# %%
n = 1000
x = np.random.default_rng(rank).standard_normal(n)
exact = x.copy()
comm.Allreduce(MPI.IN_PLACE, exact)
for algorithm in ("native", "ring", "halving_doubling"):
    buf = x.copy()
    lo, hi = reduce_scatter(buf, comm, algorithm)
    assert (lo, hi) == owned_block(n, comm) == block_range(n, p, rank)
    err_rs = float(np.abs(buf[lo:hi] - exact[lo:hi]).max())
    mine = np.zeros(n)
    mine[lo:hi] = buf[lo:hi]
    allgather(mine, comm, algorithm)
    err = comm.allreduce(float(np.abs(mine - exact).max()), op=MPI.MAX)
    say(f"{algorithm:<17} split as {halves(algorithm, p):<17} rank 0 owns [{lo}, {hi}); "
        f"reduce-scatter error {err_rs:.1e}, allgather -> allreduce error {err:.1e}")
    assert err < 1e-12

# %% [markdown]
# ## 2. The distributed update equals the plain one
# `GradientSynchronizer(..., shard=True)` reduce-scatters the gradient buckets instead of
# allreducing them; `ShardedOptimizer(make, params, sync)` builds the optimizer over this rank's
# blocks of the buckets, updates them, and allgathers the parameters. A small CosmoFlow in
# float64, trained 4 steps with Adam both ways on a data-parallel grid: the parameters agree to
# rounding, and each rank holds `1/p` of Adam's state.

# %%
config = {"input_shape": (2, 8, 8, 8), "conv_size": 4, "n_conv_layers": 2, "fc1_size": 16, "fc2_size": 8,
          "dropout": 0.0}
batch = 2 * p
grid = ProcessGrid(comm, (p, 1, 1, 1))
data = np.random.default_rng(7)
x_all = data.standard_normal((batch,) + config["input_shape"])
t_all = data.uniform(-1, 1, (batch, 4))


def train(sharded, steps=4):
    model = build_model("cosmoflow", config, grid, seed=1, dtype=np.float64, global_batch=batch)
    sync = GradientSynchronizer(model.parameters(), grid.data_comm, grid.spatial_comm, shard=sharded)

    def make(params):
        return make_optimizer("adam", params, lr=0.01)
    opt = ShardedOptimizer(make, model.parameters(), sync) if sharded else make(model.parameters())
    lo, hi = block_range(batch, p, rank)
    for _ in range(steps):
        model.zero_grad()
        _, dout, _ = model.loss(model.forward(x_all[lo:hi]), model.local_target(t_all))
        model.backward(dout)
        sync.finish()
        opt.step()
    state = opt.state_bytes() if sharded else sum(a.nbytes for s in opt.state for a in s.values())
    sync.detach()
    return [q.data.copy() for q in model.parameters()], state


plain, plain_state = train(False)
dist, dist_state = train(True)
err = max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(dist, plain))
say(f"distributed vs plain update after 4 Adam steps on {p} rank(s): max relative difference {err:.1e}")
say(f"Adam state per rank: plain {plain_state} B, distributed {dist_state} B (1/{p} = {plain_state / p:.0f} B)")
assert err < 1e-12
assert abs(dist_state - plain_state / p) <= 64 * 8

# %% [markdown]
# `refimpl train --optimizer-sharding` does this in a training run; its checkpoints hold the
# plain optimizer's state (gathered whole), so a run resumes with or without it, on any grid.
#
# ## 3. Fewer bytes: compressing the exchange
# The other lever is the message size. `--compress int8` sends each gradient block-wise
# quantised to 8 bits (one float32 scale per 256 values): about 1/4 of the bytes.
# `--compress topk:0.01` sends the 1% of entries of largest magnitude as (index, value) pairs:
# 2% of the bytes. Both lose information, so each rank keeps what it did not send (the
# residual) and adds it to the next step's gradient: **error feedback** (Lin et al. 2018). Over
# steps nothing is lost: what was applied plus the residual equals the sum of the gradients.
# Compressed messages cannot be summed on the way (int8 overflows, ranks keep different
# indices), so the exchange is an allgather of the messages, each rank adding them in rank order.

# %%
grads = [np.random.default_rng([step, rank]).standard_normal(2000).astype(np.float32) for step in range(5)]
for spec in ("int8", "topk:0.01"):
    c = compress.Compressor(spec, comm)
    applied = np.zeros(2000)
    for g in grads:
        out = g.copy()
        c.exchange(out, key=0)                      # the sum over ranks of the decompressed messages
        applied += out
    total = np.sum(grads, axis=0, dtype=np.float64)
    comm.Allreduce(MPI.IN_PLACE, total)
    everything = applied + comm.allreduce(c.residuals[0])          # + what every rank still holds
    kind, ratio = compress.parse(spec)
    say(f"{spec:<10} {c.bytes_sent // len(grads)} B per step per rank instead of {2000 * 4} "
        f"({compress.message_bytes(kind, 2000, ratio) / 8000:.3f}); applied + residuals vs the sum of the "
        f"gradients: {float(np.abs(everything - total).max()):.1e}")
    assert np.abs(everything - total).max() < 1e-3

# %% [markdown]
# ## 4. Priorities: the input side first
# Backward writes the output side's gradients first and the input side's last, but the next
# forward needs the input side first. With `priority="input-first"` the synchroniser cuts each
# bucket into chunks, starts the ready chunks best first (a bucket's priority is its position in
# backward order, so the input side's is highest) and holds a few back, so the input-side
# bucket, ready last, overtakes them. `LayerwiseUpdate` then returns right after backward and
# applies each layer's update in a hook just before that layer's next forward: the first layer
# waits only for its own bucket. The update is the same, so the parameters agree with the plain
# run; `trace=True` records when each chunk started.

# %%
def train_prioritised(priority, steps=4):
    model = build_model("cosmoflow", config, grid, seed=1, dtype=np.float64, global_batch=batch)
    sync = GradientSynchronizer(model.parameters(), grid.data_comm, grid.spatial_comm, priority=priority,
                                bucket_bytes=4096, first_bucket_bytes=1024, chunk_bytes=1024, trace=True)
    update = LayerwiseUpdate(model, sync, make_optimizer("adam", model.parameters(), lr=0.01))
    lo, hi = block_range(batch, p, rank)
    for _ in range(steps):
        model.zero_grad()
        _, dout, _ = model.loss(model.forward(x_all[lo:hi]), model.local_target(t_all))
        model.backward(dout)
        update.step(0.01)              # input-first: returns at once, the updates are owed
    update.flush()                     # apply what is still owed (a checkpoint does this too)
    sync.detach()
    return [q.data.copy() for q in model.parameters()], sync


first, sync = train_prioritised("input-first")
err = max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(first, plain))
last_step = [r for r in sync.trace if r["step"] == 4]
order = [r["bucket"] for r in sorted(last_step, key=lambda r: r["start"])]
say(f"{len(sync.buckets)} buckets in {len(last_step)} chunks; start order of the buckets' chunks "
    f"(0 = output side, ready first in backward; {len(sync.buckets) - 1} = input side, ready last): {order}")
say("the output side's chunks held back at the end of backward start last: the input side overtook them")
say(f"input-first vs plain after 4 Adam steps: max relative difference {err:.1e}")
assert err < 1e-12
top = len(sync.buckets) - 1
assert any(b < top for b in order[order.index(top):])   # the input side overtook held chunks

# %% [markdown]
# `refimpl train --priority input-first` does this in a training run. docs/communication.md has
# the costs of each scheme and the measurements: the optimizer memory per rank at 1/P,
# CosmoFlow trained with none / int8 / top-k 1% (and top-k without error feedback) to the same
# step budget, and the time from the end of backward to the next forward's first layer with and
# without priorities, with the timeline that shows why.
