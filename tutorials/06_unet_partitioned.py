# %% [markdown]
# # Tutorial 6 — A 3D U-Net across a partitioned domain
#
#     mpiexec -n 4 --oversubscribe python tutorials/06_unet_partitioned.py     (any number of ranks; 1 works too)
#
# Tutorial 05 split each U-Net layer kind (max pooling, transposed convolution, batch norm) over
# a spatial grid on its own. Here the layers form the whole network, every activation split
# into the same kind of blocks, and three questions come up that single layers do not raise:
#
# 1. **Blocks shrink with the volume.** Each level halves the volume, so each rank's block
#    halves too. Blocks become uneven, tiny or empty. Which input sizes work on which grid?
# 2. **Skip connections.** The decoder concatenates its up-sampled tensor with an encoder
#    activation saved much earlier. Does that need a message? (No. Section 2 shows why.)
# 3. **Up-sampling.** When does the transposed convolution need a halo, and when not?
#
# Then the check that matters: the partitioned U-Net computes the same forward output, loss and
# gradients as the one-process U-Net, to rounding, and a picture of the prediction shows no seam
# at the block boundaries.

# %%
import matplotlib.pyplot as plt
import numpy as np
from mpi4py import MPI

from refimpl.data.segmentation import generate_segmentation
from refimpl.models import PRESETS, build_model
from refimpl.optim import Adam
from refimpl.parallel.grad_sync import GradientSynchronizer
from refimpl.parallel.grid import ProcessGrid
from refimpl.parallel.partition import (block_range, block_slices, conv_halo_plan, grid_coords,
                                        transposed_conv_halo_plan, transposed_needed_input_range)
from refimpl.parallel.redistribute import gather_spatial

comm = MPI.COMM_WORLD
P = comm.size
say = print if comm.rank == 0 else (lambda *a, **k: None)

# spatial only (Pn = 1): 4 ranks split depth and height, 3 ranks depth only (uneven blocks)
dims = {1: (1, 1, 1, 1), 4: (1, 2, 2, 1)}.get(P, (1, P, 1, 1))
grid = ProcessGrid(comm, dims)
say(f"grid (Pn, Pd, Ph, Pw) = {dims}: every sample split into {P} spatial block(s)")


def show_table(title, row):
    """Gather one line per rank and print them on rank 0, in rank order."""
    rows = comm.gather(row, root=0)
    say(title)
    for line in rows or ():
        say("   " + line)


def ranges(block):
    """(slice, slice, slice) or ((a, b), ...) -> 'D[a,b) H[a,b) W[a,b)'."""
    pairs = [(s.start, s.stop) if isinstance(s, slice) else s for s in block]
    return " ".join(f"{axis}[{a:2d},{b:2d})" for axis, (a, b) in zip("DHW", pairs))


def as_pairs(block):
    return tuple((s.start, s.stop) for s in block)


def check(ok, what):
    """Assert ``ok`` on every rank at once: a rank-local failure fails every rank (no hang)."""
    assert comm.allreduce(bool(ok), op=MPI.LAND), what


# %% [markdown]
# ## 1. The U-Net's shape, and each rank's block at every level
#
# The 3D U-Net (Çiçek et al. 2016) with $L$ levels and widths $w_i = w_0\,2^i$:
#
# | stage | layers | channels | extent |
# |---|---|---|---|
# | encoder level $i = 0..L-1$ | [conv 3³ pad 1 → batch norm → ReLU] × 2 = `enc_i` (kept as skip $i$), then max-pool 2³ stride 2 | $w_i$ | $S/2^i \to S/2^{i+1}$ |
# | bottleneck | [conv → BN → ReLU] × 2 | $w_L$ | $S/2^L$ |
# | decoder level $i = L-1..0$ | transposed conv k2 s2 `up_i`, **concatenate** with skip $i$, [conv → BN → ReLU] × 2 = `dec_i` | $w_{i+1} \to w_i$, $2w_i$, $w_i$ | $S/2^{i+1} \to S/2^i$ |
# | head | conv 1³ | $K$ classes | $S$ |
#
# The extents follow from the window formulas of tutorials 01 and 02: a 3³ conv with padding 1 keeps $n$;
# the pool gives $\lfloor (n-2)/2 \rfloor + 1 = n/2$ for even $n$; the transposed conv gives
# $(n-1)\cdot 2 + (2-1) + 1 = 2n$. The loss is per voxel $v$. Softmax cross-entropy is
# $\mathrm{CE} = -\frac{1}{|V|}\sum_v \log \mathrm{softmax}(z_v)_{y_v}$ over every voxel of the
# global batch, and the config `"loss": "ce+dice"` adds the soft Dice loss
# $1 - \frac1K \sum_k \frac{2 I_k + \epsilon}{P_k + T_k + \epsilon}$, where
# $I_k = \sum_v p_{kv} t_{kv}$, $P_k = \sum_v p_{kv}$ and $T_k = \sum_v t_{kv}$ sum the
# probabilities $p$ and one-hot labels $t$ over every voxel of the global batch. Each rank
# computes these sums over its own block, and **one** allreduce of all of them gives every rank
# the global loss (tutorial 08).
#
# We use the `tiny` preset ($S = 16$, $L = 2$, $w_0 = 4$, $K = 3$): 16³ → 8³ → 4³ → 8³ → 16³.

# %%
config = dict(PRESETS["unet3d"]["tiny"], loss="ce+dice")
S, L = config["input_shape"][1], config["levels"]
B, SEED = 2, 7                                          # global batch (Pn = 1), weight seed
model = build_model("unet3d", config, grid, seed=SEED, dtype=np.float64, global_batch=B)


def global_out(layer):
    """The global (D, H, W) output extent of a partitioned window layer (from its halo plan)."""
    return tuple(ax.outputs[-1][1] for ax in layer.halo.plan.axes)


rows = [("input", config["input_shape"][0], tuple(config["input_shape"][1:]))]
for i in range(L):
    rows += [(f"enc{i}: conv, conv", model.widths[i], global_out(model.enc[i][3])),
             (f"pool{i}", model.widths[i], global_out(model.pool[i]))]
rows.append(("bottleneck: conv, conv", model.widths[L], global_out(model.bottleneck[3])))
for i in reversed(range(L)):
    rows += [(f"up{i}: transposed conv k2 s2", model.widths[i], global_out(model.up[i])),
             (f"concat(up{i}, skip{i})", 2 * model.widths[i], global_out(model.up[i])),
             (f"dec{i}: conv, conv", model.widths[i], global_out(model.dec[i][3]))]
rows.append(("out: conv 1x1x1 -> logits", model.num_classes, global_out(model.out)))
say(f"{'layer':<30}{'channels':>9}  global extent")
for name, channels, extent in rows:
    say(f"{name:<30}{channels:>9}  {extent}")
expected = [S, S, S // 2] + [S // 2, S // 4] * (L - 1) + [S // 2 ** L] + \
    [e for i in reversed(range(L)) for e in [S // 2 ** i] * 3] + [S]
assert [r[2] for r in rows] == [(e, e, e) for e in expected]

# %% [markdown]
# Every layer partitions its **output** into balanced blocks of its global extent on the same
# grid (tutorial 02: extent $n$ over $p$ ranks, block $c$ starts at
# $\lfloor n/p\rfloor c + \min(c, n \bmod p)$). So at level $i$ every rank holds the balanced
# block of an $(S/2^i)^3$ volume. The block depends only on the level, not on the layer. Here is
# each rank's block at every level, checked against the output block that each layer of the
# model planned.

# %%
level_extents = [(S >> i,) * 3 for i in range(L + 1)]   # (16,16,16), (8,8,8), (4,4,4)
my_blocks = [as_pairs(grid.local_block(e)) for e in level_extents]
check(all(my_blocks[i] == model.enc[i][3].out_block == model.dec[i][3].out_block
          and my_blocks[i + 1] == model.pool[i].out_block for i in range(L))
      and my_blocks[L] == model.bottleneck[3].out_block, "a layer's block differs from its level's block")
show_table("rank (coords): its block at level 0, 1, ... (global voxel ranges) -> block shape",
           f"rank {comm.rank} {grid.spatial_coords}: " + "  |  ".join(
               f"L{i} {ranges(b)} -> {tuple(hi - lo for lo, hi in b)}" for i, b in enumerate(my_blocks)))

# %% [markdown]
# ### Uneven, tiny and empty blocks, and the one constraint
#
# The model checks one thing about the input size (`check_input_shape`, called from
# `unet3d.check_config`): **every spatial extent must be divisible by $2^L$**. Otherwise some
# pool sees an odd extent, drops its last plane (the floor in the extent formula), and the
# up-sampled tensor $2\lfloor n/2 \rfloor \neq n$ no longer fits its skip. The check runs before
# any layer is built, with the same answer on every rank, so every rank raises together:

# %%
try:
    build_model("unet3d", dict(config, input_shape=(1, 18, 16, 16)), grid, seed=SEED)
    message = None
except ValueError as err:
    message = str(err)
say(f"input_shape (1, 18, 16, 16) -> ValueError: {message}")
assert message is not None and "divisible by 4" in message

# %% [markdown]
# The grid adds **no** constraint of its own. Blocks are balanced independently at each level, so
# a level's blocks may be uneven (16 planes over 3 ranks: 6 + 5 + 5), tiny (a 3³ conv on a block
# one plane deep reads a ghost plane from each neighbour, twice the data it owns) or empty (4
# planes over 8 ranks: 4 ranks hold nothing). Those ranks still join every exchange and
# allreduce with empty buffers, and the window layers fetch what they need from whichever ranks
# own it. `tests/mpi/test_models_grid_invariance.py` trains this model on the (1, 8, 1, 1) grid,
# whose deepest level has 4 ranks with empty blocks. That is correct but wasteful. Below are the
# blocks along the depth axis at each level for a few depth splits $P_d$. This is pure index
# math and does not depend on how many ranks run this tutorial.

# %%
say(f"depth S = {S}, L = {L}: blocks [start, stop) per rank at each level")
for pd in (2, 3, 4, 6, 8):
    levels = [[block_range(S >> i, pd, c) for c in range(pd)] for i in range(L + 1)]
    sizes = [sorted({b - a for a, b in lv}) for lv in levels]
    notes = [("empty " if s[0] == 0 else "") + ("uneven" if len(s) > 1 else "") for s in sizes]
    say(f"  Pd={pd}: " + "  |  ".join(f"{S >> i}: {[b - a for a, b in lv]} {n}".rstrip()
                                       for i, (lv, n) in enumerate(zip(levels, notes))))

# %% [markdown]
# **Alignment** is what matters for messages. Pooling and up-sampling need *no* halo exactly when
# each block at level $i+1$ is the block at level $i$ halved, i.e. the level-$i$ block
# boundaries are twice the level-$(i+1)$ ones. With $n = 2m$ and $m = qp + r$, the boundary
# $b_c(n) = \lfloor n/p\rfloor c + \min(c, n \bmod p)$ equals $2 b_c(m)$ for every $c$ only when
# $r = 0$. So pooling and up-sampling are halo-free at every level iff
#
# $$S/2^L \text{ is divisible by } P_\text{axis} \text{ on every split axis}\qquad (\text{i.e. } S \text{ divisible by } 2^L P_\text{axis}).$$
#
# We check this claim against the halo plans refimpl builds (no plan transfers ⇔ condition), for
# $L = 1, 2, 3$, every valid $S \le 64$ and $P \le 8$. The 3³ convs exchange a one-plane halo
# whenever an axis is split, aligned or not.

# %%
mismatches, cases = [], 0
for levels in (1, 2, 3):
    for n in range(2 ** levels, 65, 2 ** levels):
        for p in range(1, 9):
            pools = [conv_halo_plan((n >> i, 2, 2), (p, 1, 1), 2, 2) for i in range(levels)]
            ups = [transposed_conv_halo_plan((n >> (i + 1), 2, 2), (p, 1, 1), 2, 2) for i in range(levels)]
            halo_free = not any(plan.axes[0].transfers for plan in pools + ups)
            cases += 1
            if halo_free != ((n >> levels) % p == 0):
                mismatches.append((levels, n, p))
say(f"pool/up halo-free <=> S/2^L divisible by P: holds in {cases - len(mismatches)} of {cases} cases")
assert not mismatches, mismatches
aligned = all((S >> L) % p == 0 for p in grid.spatial_dims)
say(f"this run's grid {grid.spatial_dims} with S/2^L = {S >> L}: " + (
    "aligned, so pool and up-sampling need no halo" if aligned
    else "NOT aligned, so pool and up-sampling exchange halos"))

# %% [markdown]
# ## 2. Skip connections on split blocks: concatenation is local
#
# At decoder level $i$ the network concatenates, along the channel axis, two tensors:
#
# - the **skip**: the output of `enc_i`, a conv output, hence this rank's balanced block of the
#   $(S/2^i)^3$ volume;
# - the **up-sampled** tensor: the output of `up_i`. refimpl partitions a transposed conv's
#   *output* into balanced blocks, like every window layer, so this is this rank's balanced block
#   of the same $(S/2^i)^3$ volume on the same grid.
#
# Same extent, same grid and same block formula give the same global voxel ranges, on every
# rank, whether the blocks are even or not. Voxel $(d, h, w)$ of the up-sampled tensor sits next
# to voxel $(d, h, w)$ of the skip in the same rank's memory, so `concatenate(axis=1)` is a purely
# local copy and needs no message. Backward is local too: the gradient of the concatenation is
# split on the channel axis, and its skip half is added to the gradient flowing into the encoder
# output. (Had the up-sampling kept the *input's* partition, scaled by 2, the blocks would
# differ wherever the levels are misaligned, and a redistribution would be needed before every
# concatenation.)
#
# Every rank reports both ranges at every level, and all ranks check them.

# %%
mine = [(i, model.enc[i][3].out_block, model.up[i].out_block) for i in range(L)]
everyone = comm.allgather((comm.rank, grid.spatial_coords, mine))
say("rank, level: skip block (enc_i output)  vs  up-sampled block (up_i output)")
for r, coords, levels in everyone:
    for i, skip, up in levels:
        say(f"   rank {r} {coords}, level {i}: skip {ranges(skip)}  up {ranges(up)}  "
            f"{'same' if skip == up else 'DIFFERENT'}")
assert all(skip == up for _, _, levels in everyone for _, skip, up in levels)
say("on every rank and level the skip and the up-sampled tensor cover the same global voxels")

# %% [markdown]
# ## 3. Up-sampling on split blocks: when is a halo needed?
#
# The transposed conv sends input $i$ through tap $j$ to output $o = s\,i - p + d\,j$. The U-Net's
# up-sampling has $k = s = 2$ and $p = 0$, so output $o$ comes from the single input $\lfloor o/2 \rfloor$
# (tap $o \bmod 2$). refimpl *gathers*: outputs $[o_0, o_1)$ need the inputs
# (`transposed_needed_input_range`)
#
# $$\Big[\Big\lceil \tfrac{o_0 + p - d(k-1)}{s} \Big\rceil,\;
#        \Big\lfloor \tfrac{o_1 - 1 + p}{s} \Big\rfloor\Big]
#   = \big[\lceil (o_0 - 1)/2 \rceil,\; \lfloor (o_1 - 1)/2 \rfloor\big].$$
#
# When $o_0$ and $o_1$ are even this is exactly $[o_0/2,\; o_1/2)$, half-open. When the blocks are
# **aligned** (section 1), the rank's block one level down is exactly $[o_0/2, o_1/2)$, so the
# layer reads only what it owns: no halo in forward, no adjoint exchange in backward. Otherwise
# a block starts or ends on an odd output, whose input lies in the neighbour's coarser block,
# and a one-plane ghost travels (its gradient comes home in backward). Here is this rank's
# computation, checked against the plan the layer built:

# %%
lines, has_ghosts, agrees = [], False, True
for i in range(L):
    up = model.up[i]
    n_in = S >> (i + 1)
    owned = as_pairs(grid.local_block((n_in,) * 3))              # this rank's block one level down
    need = tuple(transposed_needed_input_range(o0, o1, 2, 2, 0, 1, n_in) for o0, o1 in up.out_block)
    agrees &= need == up.in_needed                               # the formula = the layer's plan
    ghosts = {axis: [v for v in range(a, b) if not lo <= v < hi]
              for axis, (a, b), (lo, hi) in zip("DHW", need, owned)}
    ghosts = {axis: g for axis, g in ghosts.items() if g}
    has_ghosts |= bool(ghosts)
    receives = any(up.halo.plan.recvs(grid.spatial_coords, a) for a in range(3))
    agrees &= receives == bool(ghosts)                           # ghosts <=> the plan receives
    lines.append(f"up{i}: outputs {ranges(up.out_block)} need {ranges(need)}, own {ranges(owned)}: "
                 f"ghost planes {ghosts or 'none'}")
show_table("rank: transposed conv outputs -> inputs needed vs owned",
           f"rank {comm.rank}: " + "; ".join(lines))
check(agrees, "transposed_needed_input_range disagrees with the layer's halo plan")
any_ghosts = comm.allreduce(has_ghosts, op=MPI.LOR)
assert any_ghosts == (not aligned)

# %% [markdown]
# The misaligned case along depth with $P_d = 3$ (pure index math, whatever the world size).
# Level 0 has 16 planes, blocks $[0,6), [6,11), [11,16)$; level 1 has 8, blocks
# $[0,3), [3,6), [6,8)$. The rank computing up-sampled outputs $[11, 16)$ starts on output
# $11 = 2\cdot 5 + 1$, tap 1 of input 5, which the middle rank owns, so input plane 5 is a
# ghost. Max pooling (tutorial 05) has the mirror problem: the middle rank pools outputs
# $[3, 6)$ from inputs $[6, 12)$ and input 11 lives on the last rank.

# %%
for i in range(L):
    pool_plan = conv_halo_plan((S >> i, 2, 2), (3, 1, 1), 2, 2).axes[0]
    up_plan = transposed_conv_halo_plan((S >> (i + 1), 2, 2), (3, 1, 1), 2, 2).axes[0]
    for what, plan in ((f"pool{i}", pool_plan), (f"up{i}  ", up_plan)):
        say(f"  Pd=3 {what}: " + "; ".join(
            f"outputs {plan.outputs[c]} need {plan.needed[c]} own {plan.owned[c]}" for c in range(3))
            + f"  -> transfers (src, dst, planes) {[(s, d, (a, b)) for s, d, a, b in plan.transfers]}")
up0 = transposed_conv_halo_plan((S // 2, 2, 2), (3, 1, 1), 2, 2).axes[0]
assert up0.outputs[2] == (11, 16) and up0.needed[2] == (5, 8) and (1, 2, 5, 6) in up0.transfers

# %% [markdown]
# ## 4. Grid invariance: the partitioned U-Net is the one-process U-Net
#
# Every rank also builds the plain model (`grid=None`: unpartitioned layers, no messages) from
# the same seed. Weights are drawn in the same order from the same generator, so both start
# identical. The partitioned model's batch norm reduces its statistics over the whole grid
# (`global_stats=True`), and the loss sums are reduced over the grid, so the two compute the
# same function of the global batch. We check the forward output, the loss, every parameter
# gradient (after the gradient synchroniser sums the per-block contributions over the spatial
# ranks), then an Adam step, then the loss again. The data are synthetic ellipsoids of 2 classes
# on background, with noise (`refimpl.data.segmentation`), in float64.

# %%
single = build_model("unet3d", config, None, seed=SEED, dtype=np.float64, global_batch=B)
sync = GradientSynchronizer(model.parameters(), grid.data_comm, grid.spatial_comm,
                            reduce_comm=grid.batch_comm)
samples = [generate_segmentation(i, seed=11, size=S, channels=1, classes=model.num_classes)
           for i in range(B)]
x = np.stack([image for image, _ in samples]).astype(np.float64)     # (B, 1, S, S, S) global
target = np.stack([labels for _, labels in samples]).astype(np.int64)  # (B, S, S, S) global
x_local, target_local = model.local_input(x), model.local_target(target)


def rel(got, ref):
    """max |got - ref| / max |ref| (0 when both are 0)."""
    scale = float(np.abs(ref).max())
    return float(np.abs(got - ref).max()) / scale if scale else float(np.abs(got).max())


def max_error_over_ranks(got_local, ref_global):
    """Relative error of every rank's block against the same block of the one-process tensor."""
    ref_local = ref_global[(slice(None), slice(None)) + grid.local_block(ref_global.shape[2:])]
    scale = comm.allreduce(float(np.abs(ref_global).max()), op=MPI.MAX)
    return comm.allreduce(float(np.abs(got_local - ref_local).max()) if got_local.size else 0.0,
                          op=MPI.MAX) / scale


out_local = model.forward(x_local)                                    # (B, K, local block)
loss, dout, metrics = model.loss(out_local, target_local)
model.backward(dout)
sync.finish()                                         # sum the block gradients over the grid

out1 = single.forward(x)                                              # (B, K, S, S, S)
loss1, dout1, metrics1 = single.loss(out1, target)
single.backward(dout1)

err_out = max_error_over_ranks(out_local, out1)
err_loss = abs(loss - loss1) / abs(loss1)
grads = {name: rel(p.grad, q.grad) for (name, p), (_, q) in
         zip(model.named_parameters(), single.named_parameters())}
worst_name = max(grads, key=grads.get)
err_grad = comm.allreduce(grads[worst_name], op=MPI.MAX)
same_loss = comm.allgather(loss)
say(f"forward output: max relative error {err_out:.1e}")
say(f"loss (ce + soft dice): grid {loss:.15f}, one process {loss1:.15f}, relative error {err_loss:.1e}; "
    f"hard Dice {metrics['dice']:.6f} vs {metrics1['dice']:.6f}")
say(f"{len(grads)} parameter gradients: worst relative error {err_grad:.1e} (rank 0: {worst_name})")
assert all(v == same_loss[0] for v in same_loss)                       # one float on every rank
assert max(err_out, err_loss, err_grad, abs(metrics["dice"] - metrics1["dice"])) <= 1e-10

# %% [markdown]
# The halo messages of that forward and backward, per pooling and up-sampling layer. In forward a
# layer sends the pieces its plan lists as its sends. In backward, its adjoint exchange sends
# back the gradient of every ghost it received. So the number of messages it sent is the number
# of sends plus the number of receives in its plan. On an aligned grid both are zero.

# %%
def planned_messages(layer):
    plan, coords = layer.halo.plan, grid.spatial_coords
    return sum(len(plan.sends(coords, a)) + len(plan.recvs(coords, a)) for a in range(3))


window = [(f"pool{i}", model.pool[i]) for i in range(L)] + [(f"up{i}", model.up[i]) for i in range(L)]
counts = {name: layer.halo.messages_sent for name, layer in window}
check(all(counts[name] == planned_messages(layer) for name, layer in window),
      "a layer sent another number of messages than its plan lists")
show_table("rank: halo messages sent by pool/up layers in one forward + backward",
           f"rank {comm.rank}: {counts}")
total = comm.allreduce(sum(counts.values()))
assert (total == 0) == aligned

# %% [markdown]
# One Adam step on both models, then the loss of the updated models on the same batch.
# `refimpl.optim` updates in place and needs no message: every rank holds the same synchronised
# gradients, so every rank computes the same update. A few more steps follow, each checked the
# same way, so that the prediction in the picture has learned something.

# %%
LR, STEPS = 0.02, 10
opt, opt1 = Adam(model.parameters(), lr=LR), Adam(single.parameters(), lr=LR)
history = []
for step in range(STEPS):
    opt.step()
    opt1.step()
    model.zero_grad()
    single.zero_grad()
    out_local = model.forward(x_local)
    loss, dout, metrics = model.loss(out_local, target_local)
    model.backward(dout)
    sync.finish()
    out1 = single.forward(x)
    loss1, dout1, _ = single.loss(out1, target)
    single.backward(dout1)
    history.append((loss, loss1, abs(loss - loss1) / abs(loss1)))
    if step == 0:
        say(f"after one Adam step: loss grid {loss:.15f}, one process {loss1:.15f}, "
            f"relative error {history[0][2]:.1e}")
err_params = comm.allreduce(max(rel(p.data, q.data) for p, q in zip(model.parameters(), single.parameters())),
                            op=MPI.MAX)
err_out = max_error_over_ranks(out_local, out1)
say(f"losses over {STEPS} steps: {[round(g, 4) for g, _, _ in history]}; worst relative error "
    f"{max(e for _, _, e in history):.1e}; parameters {err_params:.1e}; output {err_out:.1e}")
assert max(e for _, _, e in history) <= 1e-10 and err_params <= 1e-10 and err_out <= 1e-10
assert history[-1][0] < history[0][0]                    # it learns (same decision on every rank)

# %% [markdown]
# ## 5. The picture: no seam at the block boundaries
#
# A central slice (fixed $w = S/2$, the $d \times h$ plane) of the input and of the predicted
# class map $\arg\max_k z_{kv}$, assembled on rank 0 from the blocks (`gather_spatial`), with each
# rank's block outlined; the true labels sit in between for reference. A missing or wrong halo
# would show as a discontinuity along the outlines (a prediction that changes at the block edge
# rather than at an object's edge). We also check that the gathered class map equals the
# one-process class map at every voxel whose two largest logits differ by more than $10^{-8}$:
# at those voxels rounding (≤ 1e-10 relative) cannot change the argmax.

# %%
pred_local = np.ascontiguousarray(out_local.argmax(axis=1))           # (B, local block)
pred = gather_spatial(pred_local, grid)                                # (B, S, S, S) on rank 0
image = gather_spatial(np.ascontiguousarray(x_local[:, 0]), grid)     # (B, S, S, S) on rank 0
if comm.rank == 0:
    top2 = np.sort(out1, axis=1)[:, -2:]
    decided = (top2[:, 1] - top2[:, 0]) > 1e-8
    mismatched = int(np.count_nonzero((pred != out1.argmax(axis=1)) & decided))
    accuracy = float((pred == target).mean())
    background = float((target == 0).mean())          # what predicting background everywhere scores
    say(f"class map: {mismatched} of {int(decided.sum())} decided voxels differ from the one-process "
        f"map; voxel accuracy {accuracy:.3f} after {STEPS} steps (all-background would score "
        f"{background:.3f}: {STEPS} steps teach little -- the point here is that the map is the same)")
else:
    mismatched = None
mismatched = comm.bcast(mismatched, root=0)
assert mismatched == 0

if comm.rank == 0:
    w = S // 2
    fig, axes = plt.subplots(1, 3, figsize=(11, 4))
    classes = {"cmap": plt.get_cmap("viridis", model.num_classes), "vmin": 0, "vmax": model.num_classes - 1}
    panels = ((image[0, :, :, w], f"input (sample 0), slice w = {w}", {"cmap": "gray"}),
              (target[0, :, :, w], "true labels", classes),
              (pred[0, :, :, w], f"predicted class (argmax) after {STEPS} steps", classes))
    colours = plt.get_cmap("tab10").colors
    for ax, (data, title, style) in zip(axes, panels):
        ax.imshow(data, origin="lower", interpolation="nearest", **style)
        for r in range(P):                                             # outline every block that
            (d0, d1), (h0, h1), (w0, w1) = (                           # the slice passes through
                (s.start, s.stop) for s in block_slices((S,) * 3, grid.spatial_dims,
                                                        grid_coords(r, grid.spatial_dims)))
            if w0 <= w < w1 and d1 > d0 and h1 > h0:
                ax.add_patch(plt.Rectangle((h0 - 0.5, d0 - 0.5), h1 - h0, d1 - d0, fill=False,
                                           ec=colours[r % 10], lw=2.5))
                ax.text(h0 + 0.2, d1 - 1.0, f"rank {r}", color=colours[r % 10], fontsize=8,
                        bbox={"fc": "white", "alpha": 0.7, "pad": 1, "lw": 0})
        ax.set_xlabel("h")
        ax.set_ylabel("d")
        ax.set_title(title, fontsize=9)
    fig.suptitle(f"3D U-Net on grid {dims}: blocks outlined; the class map equals the one-process one",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig("06_unet_partitioned.png", dpi=90)
    plt.close(fig)
    say("saved 06_unet_partitioned.png")

# %% [markdown]
# What to take away:
#
# - every activation of the U-Net is the rank's balanced block of its level's volume, so the
#   skip and the up-sampled tensor always coincide and concatenation needs no message;
# - the model requires only that each input extent be divisible by $2^L$. Any grid runs, even
#   with uneven or empty blocks, and $S$ divisible by $2^L P_\text{axis}$ additionally makes
#   pooling and up-sampling halo-free (the 3³ convs always exchange one plane);
# - with batch norm over the global batch and losses reduced over the grid, the partitioned
#   network *is* the one-process network. `tests/mpi/test_models_grid_invariance.py` checks this
#   over several steps on data x spatial grids of 1, 2, 3, 4 and 8 ranks (pure data, pure spatial
#   and mixed; uneven and empty blocks included) and on grids with a model axis of 2, 3, 4, 6 and
#   8 ranks. The widest, smallest activations, those of the bottleneck, can also be split by
#   channels over a model axis (config `"model_parallel": "filter"` or `"channel"`, on a 5-entry
#   grid; `"model_parallel_levels": K` splits the deepest K levels' blocks too; tutorial 11
#   shows those layers).

# %%
grid.free()
