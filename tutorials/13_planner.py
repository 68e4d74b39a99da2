# %% [markdown]
# # Tutorial 13 — Planning a grid: where the time and memory go
#
#     python tutorials/13_planner.py        (one process; pure math, nothing is trained)
#
# Under mpiexec, every rank runs the whole tutorial on its own and prints the same thing.
#
# The earlier tutorials split one training step over a process grid `(Pn, Pd, Ph, Pw, Pm)`: samples
# over Pn, voxels over Pd x Ph x Pw, channels over Pm. Which grid should you pick for a given
# number of ranks? The answer depends on the model, the sample size, the batch and the
# machine. The planner (`refimpl.plan`, `refimpl plan` on the command line) predicts, for
# every rank of a grid and every layer:
#
# - the FLOPs of forward and backward;
# - the halo bytes and messages, read off the same halo plans the layers execute;
# - the model-axis collectives, the batch-norm and flatten-layer allreduces;
# - the gradient allreduce, packed into buckets as `GradientSynchronizer` packs them;
# - the memory: saved activations, the largest work array, weights, gradients, optimizer state.
#
# It then prices every message at `alpha + bytes * beta`. The slowest rank decides the step
# time. docs/planner.md derives every formula. This tutorial looks inside one prediction,
# checks the halo bytes against the halo plan by hand, and then reproduces two paper results:
# Gholami et al.'s model-axis optimum and Oyama et al.'s 512^3 memory wall.

# %%
import math

from refimpl.models import PRESETS
from refimpl.parallel.collectives import predicted_time
from refimpl.parallel.partition import block_range, conv_halo_plan, pack_buckets
from refimpl.plan import (GRAD_BUCKET_BYTES, FIRST_BUCKET_BYTES, Machine, format_bytes, halo_plan_of,
                          model_layers, plan_grid, rank_costs, search)

GIB = 2 ** 30
machine = Machine()          # the default constants: 50 GFLOP/s, 1 us / 10 GB/s on a node, 4 ranks a node
print(machine.summary())     # (conv rates per shape, measured by --calibrate: none here)

# %% [markdown]
# ## 1. The model as the planner sees it
# `model_layers` gives the layer list of CosmoFlow or the U-Net. It is the same architecture
# `refimpl.models` builds: tests/test_plan.py checks that every layer with parameters has the
# built module's name and parameter count. Each `Layer` keeps *global* extents. The grid is
# applied later. CosmoFlow `small` has four blocks of conv (3^3, 'same' padding), LeakyReLU
# and 2^3 max-pool, on a 4 x 64^3 input, then a dense head. The first conv has
# `input_grad=False`: nothing flows back into the input sample, so it has no dX and no
# adjoint halo exchange.

# %%
layers = model_layers("cosmoflow", "small")
print(f"{'name':<13}{'kind':<16}{'C in':>8}{'C out':>7}  {'input D,H,W':<15}{'kernel':<11}{'weights':>9}  dX")
for lay in layers:
    print(f"{lay.name:<13}{lay.kind:<16}{lay.c_in:>8}{lay.c_out:>7}  {str(lay.in_dhw):<15}{str(lay.kernel):<11}"
          f"{lay.weights:>9}  {lay.input_grad}")

# %% [markdown]
# ## 2. One rank of one grid, layer by layer
# Take 8 ranks as `(Pn, Pd, Ph, Pw, Pm) = (2, 2, 2, 1, 1)` and a global batch of 8. Each
# sample group holds `N_r = 4` samples, and each rank holds a 32 x 32 x 64 block of every
# sample. `rank_costs` gives one `LayerCost` per layer for the rank at `coords`. A conv's FLOPs
# are `2 N_r F C k^3 V_out` for forward and twice that for backward (dW and dX). The first
# conv has no dX, so it gets twice the forward count, not three times.

# %%
dims, batch, coords = (2, 2, 2, 1, 1), 8, (0, 0, 0, 0, 0)
costs = rank_costs(layers, dims, coords, batch, 4, machine)
print(f"rank at {coords} of {dims}, batch {batch}")
print(f"{'layer':<13}{'kind':<16}{'GFLOP':>8}{'halo bytes':>12}{'msgs':>6}{'saved MiB':>11}")
for c in costs:
    print(f"{c.name:<13}{c.kind:<16}{c.flops / 1e9:8.3f}{c.halo_bytes:>12}{c.halo_messages:>6}"
          f"{c.saved_bytes / 2 ** 20:>11.2f}")

n_r = block_range(batch, dims[0], coords[0])[1] - block_range(batch, dims[0], coords[0])[0]
by_name = {lay.name: lay for lay in layers}
for name, passes in (("features.0", 2), ("features.3", 3)):
    lay = by_name[name]
    v_out = math.prod(b - a for a, b in halo_plan_of(lay, dims[1:4]).outputs(coords[1:4]))
    expected = 2 * n_r * lay.c_out * lay.c_in * math.prod(lay.kernel) * v_out * passes
    print(f"{name}: 2 x {n_r} x {lay.c_out} x {lay.c_in} x {math.prod(lay.kernel)} x {v_out} x {passes} = "
          f"{expected / 1e9:.3f} GFLOP")
    assert [c.flops for c in costs if c.name == name] == [expected]

# %% [markdown]
# ## 3. Where the halo bytes come from
# The planner does not estimate halo sizes with a surface formula. It asks the layer's own
# halo plan, `partition.conv_halo_plan(input extent, (Pd, Ph, Pw), kernel, stride, padding)`.
# That is the same object `SpatialConv3d` builds and executes. For each axis, `plan.sends(coords, axis)`
# lists the messages the rank sends in the exchange along that axis. Each message has a peer
# and a region of global ranges. The region is the *needed* range on the earlier axes (so
# corners travel), the piece on this axis, and the *owned* block on the later axes. One
# message carries `volume x channels x local samples x itemsize` bytes.
#
# The adjoint exchange in backward returns the ghost gradients along the same routes in
# reverse. A rank therefore sends back exactly what it received in forward, which is
# `plan.recvs(coords, axis)`. For `features.0` (no adjoint) the forward sends are all of it.
# For `features.3` they are half of it.

# %%
def message_bytes(messages, channels, samples, itemsize=4):
    return sum(m.volume * channels * samples * itemsize for m in messages)


for name in ("features.0", "features.3"):
    lay = by_name[name]
    plan = conv_halo_plan(lay.in_dhw, dims[1:4], lay.kernel, lay.stride, lay.padding)
    assert plan == halo_plan_of(lay, dims[1:4])  # the planner's plan is the layer's plan
    scoords = coords[1:4]
    print(f"{name}: input {lay.in_dhw}, owned block {plan.owned(scoords)}, needed {plan.needed(scoords)}")
    sends = [m for axis in range(3) for m in plan.sends(scoords, axis)]
    recvs = [m for axis in range(3) for m in plan.recvs(scoords, axis)]
    for m in sends:
        print(f"   send along axis {'DHW'[m.axis]} to spatial peer {m.peer}: region {m.region} = {m.volume} voxels"
              f" x {lay.c_in} channels x {n_r} samples x 4 B = {message_bytes([m], lay.c_in, n_r)} B")
    total = message_bytes(sends, lay.c_in, n_r)
    count = len(sends)
    if lay.input_grad:                           # the adjoint sends back what forward received
        total += message_bytes(recvs, lay.c_in, n_r)
        count += len(recvs)
    planned = next(c for c in costs if c.name == name)
    print(f"   forward{' + adjoint' if lay.input_grad else ''}: {total} B in {count} messages; "
          f"planner: {planned.halo_bytes} B in {planned.halo_messages} messages")
    assert (total, count) == (planned.halo_bytes, planned.halo_messages)

# %% [markdown]
# ## 3b. From counts to time: rates per layer shape, and the halo's copies
# Bytes and FLOPs are exact; time needs rates. A conv's rate depends on its shape: on this
# kind of machine a 4 -> 16 channel conv runs at a fraction of a 32 -> 64 one (its columns,
# not its GEMM, take the time), and a small block runs slower than a big one.
# `refimpl plan --calibrate` therefore times every conv shape of the model on two inputs and
# stores the rates in `Machine.conv_gflops`; `Machine.conv_rate(layer, voxels)` interpolates
# between them in log-log. Batch norm, activations and pooling are memory-bound and get a
# rate per element. Here a made-up machine with two measurements of `features.3`'s shape:

# %%
from dataclasses import replace

from refimpl.plan import conv_key

lay = by_name["features.3"]
measured = Machine(conv_gflops=((conv_key(lay, (16, 32, 32)), 60.0), (conv_key(lay, (32, 32, 32)), 120.0)))
for voxels in (8 * 32 * 32, 16 * 32 * 32, 24 * 32 * 32, 32 * 32 * 32, 64 * 32 * 32):
    print(f"{conv_key(lay)} on {voxels:>6} voxels: {measured.conv_rate(lay, voxels):6.1f} GFLOP/s")
assert math.isclose(measured.conv_rate(lay, 16 * 32 * 32), 60.0) and math.isclose(measured.conv_rate(lay, 64 * 32 * 32), 120.0)

# %% [markdown]
# A halo exchange also copies. `HaloExchange` zeroes a work array (the hull of the owned and
# needed ranges), copies the block in, packs every piece it sends into a contiguous buffer and
# unpacks every piece it receives. Packing a face cut across W reads one element per row,
# across D one contiguous run per sample and channel: on this machine W packs about 20x
# slower. So the planner charges a W split more than a D split at equal bytes:

# %%
pack = replace(machine, pack_bandwidth_d=30e9, pack_bandwidth_h=13e9, pack_bandwidth_w=1.5e9)
halo_ms = {g: plan_grid(layers, g, 4, pack).halo_s * 1e3 for g in [(1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2)]}
for g, ms in halo_ms.items():
    print(f"grid {g}: halo {ms:.2f} ms (messages + copies)")
assert halo_ms[(1, 2, 1, 1)] < halo_ms[(1, 1, 2, 1)] < halo_ms[(1, 1, 1, 2)]

# %% [markdown]
# tests/mpi/test_plan_mpi.py closes the loop. On every grid of 1 to 8 ranks it runs a real
# forward and backward. It checks that the bytes and messages every `HaloExchange` handed to
# MPI equal `rank_costs`, rank by rank and layer by layer. It checks the channel
# collectives' bytes the same way.
#
# ## 4. The gradient allreduce
# After backward, every parameter's gradient is reduced over the ranks that hold the same
# parameter slice: the data x spatial group of `Pn x Ps` ranks. The planner lists the rank's
# parameter bytes in backward order (the layers reversed, and each layer's bias before its
# weight, as `model.parameters()` reversed). It packs them with `partition.pack_buckets`, which is
# the function `GradientSynchronizer` uses: a 1 MiB first bucket, then 25 MiB buckets. Each
# bucket is priced with `collectives.predicted_time`, the Thakur-Rabenseifner-Gropp
# alpha-beta-gamma cost. "native" is priced as the cheapest of ring, recursive doubling and
# halving-doubling. The group here spans ranks 0..7, two nodes of 4, so the inter-node
# constants apply. The synchroniser also copies every gradient into its bucket and the
# averaged result back: twice the bytes at `mem_bandwidth`.

# %%
grid_plan = plan_grid(layers, dims, batch, machine)
sizes = [b for c in reversed(grid_plan.layers) for b in reversed(c.param_bytes)]   # bias, weight, layer by layer
buckets = pack_buckets(sizes, [0] * len(sizes), GRAD_BUCKET_BYTES, FIRST_BUCKET_BYTES)
p = math.prod(dims[:4])
by_hand = sum(predicted_time("native", sum(sizes[i] for i in b), p, machine.alpha_inter, machine.beta_inter,
                             machine.gamma) for b in buckets) + 2 * sum(sizes) / machine.mem_bandwidth
print(f"{len(buckets)} buckets of {[format_bytes(sum(sizes[i] for i in b)) for b in buckets]} over {p} ranks: "
      f"{by_hand * 1e3:.3f} ms by hand, {grid_plan.allreduce_s * 1e3:.3f} ms planned")
assert math.isclose(by_hand, grid_plan.allreduce_s) and len(buckets) == grid_plan.buckets
print(f"step {grid_plan.step_s * 1e3:.1f} ms = compute {grid_plan.compute_s * 1e3:.1f} + halo "
      f"{grid_plan.halo_s * 1e3:.2f} + other messages {grid_plan.model_s * 1e3:.2f} + allreduce "
      f"{grid_plan.allreduce_s * 1e3:.2f}; memory {format_bytes(grid_plan.memory_bytes)} (slowest rank "
      f"{grid_plan.critical_rank})")

# %% [markdown]
# ## 5. A few grids of 8 ranks
# `plan_grid` evaluates a few representative ranks of the grid. Per spatial axis it takes the
# first, second and last coordinate: the largest block, an interior block with halos on both
# sides, and the last block. It reports the slowest rank's time and the fullest rank's
# memory. A grid the model cannot run comes back with `feasible=False` and the reason: here
# `Pn = 8` does not divide a batch of 4.

# %%
batch = 4
print(f"{'grid':<18}{'family':<22}{'step ms':>9}{'compute':>9}{'halo':>8}{'allreduce':>10}{'memory':>11}")
for g in ((4, 2, 1, 1, 1), (2, 2, 2, 1, 1), (1, 2, 2, 2, 1), (1, 8, 1, 1, 1), (8, 1, 1, 1, 1)):
    gp = plan_grid(layers, g, batch, machine)
    if not gp.feasible:
        print(f"{str(g):<18}{gp.family:<22}  cannot run: {gp.why}")
        continue
    print(f"{str(g):<18}{gp.family:<22}{gp.step_s * 1e3:9.1f}{gp.compute_s * 1e3:9.1f}{gp.halo_s * 1e3:8.2f}"
          f"{gp.allreduce_s * 1e3:10.2f}{format_bytes(gp.memory_bytes):>11}")

# %% [markdown]
# The compute column is the same on every grid, because the same FLOPs are split eight ways.
# The halo grows with the number of spatial cuts; the gradient allreduce is the same size on
# every grid (every rank holds every weight: `head.0`, the flatten layer, keeps its whole
# 4 MiB weight on every spatial rank and allreduces its whole gradient), and the memory grows
# a little with the cuts (each cut adds halo-extended inputs). All four grids are within a few percent of each other: at this size
# the planner says "any of these".
#
# ## 6. Searching every grid
# `search` enumerates every factorisation of the ranks into `(Pn, Pd, Ph, Pw, Pm)`. It keeps
# the spatial splits in canonical order `Pd >= Ph >= Pw`, since the other orders are
# rotations of a cubic sample. It takes grids with `Pm > 1` only when given the
# model-parallel layer list `layers_mp`. It sorts feasible grids by step time and puts the
# infeasible ones after them.

# %%
layers_mp = model_layers("cosmoflow", dict(PRESETS["cosmoflow"]["small"], model_parallel="filter"))
plans = search(layers, 8, batch, machine, layers_mp=layers_mp)
print(f"{len(plans)} grids, {sum(p.feasible for p in plans)} feasible; the first five and the last:")
for gp in plans[:5] + plans[-1:]:
    print(f"  {str(gp.dims):<18}{gp.family:<28}" + (f"{gp.step_s * 1e3:8.1f} ms {format_bytes(gp.memory_bytes):>10}"
                                                     if gp.feasible else f"no: {gp.why}"))
assert plans[0].feasible and plans[0].step_s == min(p.step_s for p in plans if p.feasible)

# %% [markdown]
# ## 7. Gholami et al.: a dense-heavy model wants a model axis
# Gholami et al. (SPAA'18) split a dense layer `W` (d_out x d_in) by rows over `Pr` (our
# `Pm`) and the batch over `Pc` (our `Pn`). The model axis moves activations: an allgather
# and a reduce-scatter of `d_in B/Pn` words. The data axis moves weights: an allreduce of
# `d_out d_in / Pm` words. With a big dense layer and a modest batch, the weight allreduce
# dominates at `Pm = 1`. Raising Pm shrinks it, while the layers that are not split are then
# computed on fewer sample groups. The optimum is in between.
#
# The configuration is the one tests/test_plan.py uses: 64^3 inputs, two conv blocks of 8 and
# 16 channels, and a 65536 x 2048 first dense layer. The grid is 16 ranks as
# `(16/Pm, 1, 1, 1, Pm)`, with a batch of 16.

# %%
cfg = {"input_shape": (4, 64, 64, 64), "conv_size": 8, "n_conv_layers": 2, "fc1_size": 2048, "fc2_size": 1024}
plain, split = model_layers("cosmoflow", cfg), model_layers("cosmoflow", dict(cfg, model_parallel="filter"))
times = {}
print(f"{'grid':<18}{'step ms':>9}{'compute':>9}{'model axis':>11}{'allreduce':>10}{'grad bytes':>12}")
for pm in (1, 2, 4, 8, 16):
    gp = plan_grid(plain if pm == 1 else split, (16 // pm, 1, 1, 1, pm), 16, machine)
    times[pm] = gp.step_s
    print(f"{str(gp.dims):<18}{gp.step_s * 1e3:9.1f}{gp.compute_s * 1e3:9.1f}{gp.model_s * 1e3:11.2f}"
          f"{gp.allreduce_s * 1e3:10.1f}{format_bytes(gp.grad_bytes):>12}")
best = min(times, key=times.get)
print(f"fastest: Pm = {best}, {times[best] / times[1]:.2f} x the pure data-parallel step")
assert 1 < best < 16

# %% [markdown]
# ## 8. Oyama et al.: a 512^3 sample does not fit one rank
# Oyama et al. (TPDS 2021) trained CosmoFlow on 512^3 samples. One sample's activations do not
# fit a 16 GiB accelerator, so the sample itself has to be split. Data parallelism cannot
# help: each rank still holds at least one whole sample. The planner's memory per rank
# counts each layer's saved input (halo included), the largest transient work array, and the
# weights x (weight + gradient + bucket copy + 1 SGD momentum copy). With a 16 GiB limit the
# data-only grids are marked infeasible, and a 2 x 2 x 2 split fits.

# %%
big = model_layers("cosmoflow", dict(PRESETS["cosmoflow"]["mlperf"], input_shape=(4, 512, 512, 512)))
limited = Machine(mem_per_rank=16 * GIB)
for g, b in (((1, 1, 1, 1, 1), 1), ((8, 1, 1, 1, 1), 8), ((1, 2, 2, 2, 1), 1), ((1, 4, 4, 4, 1), 1)):
    gp = plan_grid(big, g, b, limited)
    print(f"{str(g):<18}batch {b:<3} {format_bytes(gp.memory_bytes):>10} per rank  "
          f"{'fits' if gp.feasible else 'no: ' + gp.why}")
    assert gp.feasible == (g[1] > 1)

# %% [markdown]
# ## 9. The same from the command line
# `refimpl plan` runs in one process (it refuses mpiexec except with `--calibrate`). It searches
# every grid and prints the fastest ones that fit. It then explains the winner and the
# runner-up layer by layer and says what separates them:
#
#     refimpl plan --model cosmoflow --preset mlperf --sample 512 --batch 64 --ranks 2048 --mem-per-rank 16GiB --top 5
#     refimpl plan --model cosmoflow --preset small --batch 8 --ranks 8 --grid 2,2,2,1        # one grid, explained
#     refimpl plan --model unet3d --preset small --batch 4 --ranks 8 --plot scaling.png --json plan.json
#     refimpl plan --preset small --batch 256 --ranks 64 --base-batch 32 --critical-batch 128  # batch advice
#     mpiexec -n 2 --oversubscribe refimpl plan --calibrate --preset small --save-machine here.toml         # this machine's constants
#     refimpl plan --machine here.toml --preset small --batch 8 --ranks 8
#
# docs/planner.md has the formulas and their sources, the machine file, and the limits of the
# model. scripts/bench_plan.py runs the grids for real and prints the predicted step time and
# memory next to the measured ones.
