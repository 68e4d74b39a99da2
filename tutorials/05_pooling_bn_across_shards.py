# %% [markdown]
# # Tutorial 5 — Pooling, transposed convolution and batch norm across shards
#
#     mpiexec -n 4 --oversubscribe python tutorials/05_pooling_bn_across_shards.py     (any number of ranks; 1 works too)
#
# Tutorial 04 split a convolution over a spatial grid. A 3D U-Net has three more layer kinds that
# see more than one voxel at a time, and each needs something different when a sample is cut
# into blocks:
#
# | layer | what crosses a block boundary | messages |
# |---|---|---|
# | max pooling 2x2x2, stride 2 | a window, when a block has an odd size | halo exchange (forward), adjoint (backward) |
# | transposed conv k2 s2 (up-sampling) | the two outputs of one input | halo exchange of inputs, adjoint of it |
# | batch norm | the statistics of *every* voxel of *every* sample | allreduce of per-channel sums, both directions |
#
# Each is checked against the one-process layer on the whole tensor, in float64. The grid is
# `(Pn, Pd, Ph, Pw)`: data x spatial where the world size allows (4 ranks: 2 sample groups x 2
# depth blocks; 3 ranks: 3 depth blocks; 1 rank: nothing split).

# %%
import matplotlib.pyplot as plt
import numpy as np
from mpi4py import MPI

from refimpl import functional as F
from refimpl.nn.batch_norm import BatchNorm3d
from refimpl.nn.spatial import SpatialBatchNorm3d, SpatialConvTranspose3d, SpatialMaxPool3d
from refimpl.parallel.grid import ProcessGrid
from refimpl.parallel.partition import (block_range, conv_halo_plan, needed_input_range,
                                        transposed_needed_input_range)

comm = MPI.COMM_WORLD
P = comm.size
say = print if comm.rank == 0 else (lambda *a, **k: None)
dims = {1: (1, 1, 1, 1), 2: (1, 2, 1, 1), 3: (1, 3, 1, 1), 4: (2, 2, 1, 1)}.get(
    P, (2, P // 2, 1, 1) if P % 2 == 0 else (1, P, 1, 1))
grid = ProcessGrid(comm, dims)
say(f"grid (Pn, Pd, Ph, Pw) = {dims}: {dims[0]} sample group(s) x {P // dims[0]} spatial block(s)")

B = 4                                                    # global batch, divisible by Pn
samples = slice(*block_range(B, grid.dims[0], grid.sample_coord))   # this sample group's samples


def local(a, dhw):
    """This rank's piece of a global (B, C, D, H, W) array: its samples, its spatial block."""
    return np.ascontiguousarray(a[(samples, slice(None)) + grid.local_block(dhw)])


def max_error(got, ref):
    """max |got - ref| / max |ref| over every rank (the same number on every rank)."""
    scale = comm.allreduce(float(np.abs(ref).max()) if ref.size else 0.0, op=MPI.MAX)
    err = float(np.abs(got - ref).max()) if ref.size else 0.0
    return comm.allreduce(err, op=MPI.MAX) / scale


def show_table(title, row):
    """Gather one line per rank and print them on rank 0, in rank order."""
    rows = comm.gather(row, root=0)
    say(title)
    for line in rows or ():
        say("   " + line)


def rng_of(seed):
    return np.random.default_rng(seed)                   # same seed on every rank: same global data


# %% [markdown]
# ## 1. Max pooling 2x2x2, stride 2, on blocks of odd size
#
# A window op partitions its **output** into balanced blocks. Outputs $[o_0, o_1)$ of a window
# with kernel $k$, stride $s$, padding $p$, dilation $d$ read the inputs
#
# $$\big[\,s\,o_0 - p,\;\; s(o_1-1) - p + d(k-1)\,\big]\quad\text{(inclusive)},$$
#
# for our pool ($k=s=2$, $p=0$, $d=1$) inputs $[2o_0,\; 2o_1)$. The **input** is split in
# balanced blocks too, independently. If every input block had an even size the two splits
# would line up and no message would be needed; but a depth of 13 over 2 ranks is 7 + 6, over 3
# ranks 5 + 4 + 4. The window of output 3 is inputs {6, 7}: with blocks [0, 7) and [7, 13) it
# straddles the boundary, so one rank must receive a ghost plane from its neighbour — a halo of
# width 1, on one side only. (Conversely a rank may own inputs it never reads: they belong to a
# window computed next door, or, like input 12, to no window at all — the floor in the output
# extent $\lfloor (13-2)/2 \rfloor + 1 = 6$ drops it.)

# %%
dhw, C = (13, 6, 5), 3
pool = SpatialMaxPool3d(2, grid=grid)                    # kernel 2, stride = kernel
out_dhw = pool.setup(dhw)                                # the halo plan: pure index math
say(f"global input {dhw} -> global output {out_dhw}")

owned = tuple((s.start, s.stop) for s in grid.local_block(dhw))
(o0, o1), _, _ = pool.out_block
(i0, i1), pad = needed_input_range(o0, o1, 2, 2, 0, 1, dhw[0])   # depth axis, by the formula
assert (i0, i1) == pool.in_needed[0] and pad == (0, 0)
ghost_planes = [i for i in range(i0, i1) if not owned[0][0] <= i < owned[0][1]]
show_table("rank: owns depth [a, b) -> computes outputs [o0, o1) -> reads inputs [2 o0, 2 o1): ghosts",
           f"rank {comm.rank} {grid.coords}: owns {owned[0]} -> outputs {(o0, o1)} -> reads "
           f"{(i0, i1)}: ghost planes {ghost_planes}")

# %% [markdown]
# A picture of the depth axis for 2 and 3 spatial ranks (pure index math, the same on any world
# size): cells are input planes coloured by owner, bars are pooling windows coloured by the rank
# that computes them; a hatched cell is a ghost, read by a rank that does not own it. Rank 0
# saves it as `05_pooling_bn_across_shards.png` in the directory you run the tutorial from.

# %%
if comm.rank == 0:
    colours = plt.get_cmap("tab10").colors
    fig, axes = plt.subplots(2, 1, figsize=(8, 3.2))
    for ax, parts in zip(axes, (2, 3)):
        plan = conv_halo_plan(dhw, (parts, 1, 1), 2, 2).axes[0]
        for r, (a, b) in enumerate(plan.owned):
            for i in range(a, b):
                ax.add_patch(plt.Rectangle((i, 1), 1, 1, fc=colours[r], alpha=0.45, ec="k"))
                ax.text(i + 0.5, 1.5, str(i), ha="center", va="center", fontsize=8)
        for r, ((a, b), (n0, n1)) in enumerate(zip(plan.outputs, plan.needed)):
            for o in range(a, b):
                ax.add_patch(plt.Rectangle((2 * o + 0.08, 0.25), 1.84, 0.5, fc=colours[r], ec="k"))
                ax.text(2 * o + 1, 0.5, f"y{o}", ha="center", va="center", fontsize=8)
            for i in range(n0, n1):
                if not plan.owned[r][0] <= i < plan.owned[r][1]:
                    ax.add_patch(plt.Rectangle((i, 1), 1, 1, fill=False, hatch="///", ec=colours[r], lw=2))
        ax.set_xlim(-0.2, dhw[0] + 0.2)
        ax.set_ylim(0, 2.1)
        ax.axis("off")
        ax.set_title(f"{parts} depth blocks: owners {plan.owned}", fontsize=9)
    fig.text(0.5, 0.01, "cells: input planes, colour = owner   bars: windows, colour = computing rank\n"
             "hatched: a ghost, read by the rank of the hatch colour   plane 12: read by no window",
             ha="center", fontsize=7)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig("05_pooling_bn_across_shards.png", dpi=90)
    plt.close(fig)

# %% [markdown]
# Forward and backward of the partitioned layer, against `refimpl.functional` on the whole
# global batch (every rank can compute the oracle: the tensors are small). Max pooling only
# copies values, and with stride = kernel every input belongs to at most one window, so the
# gradient is copied too: the comparison is **exact** (error 0, not merely small).

# %%
x = rng_of(1).standard_normal((B, C) + dhw)
dy = rng_of(2).standard_normal((B, C) + out_dhw)
x_local, dy_local = local(x, dhw), local(dy, out_dhw)

y_local = pool.forward(x_local)
dx_local = pool.backward(dy_local)

y_ref = F.max_pool3d(x, 2, 2)
dx_ref = F.max_pool3d_backward(dy, x, 2, 2)
err_y, err_dx = max_error(y_local, local(y_ref, out_dhw)), max_error(dx_local, local(dx_ref, dhw))
say(f"max pool: forward error {err_y:.1e}, backward error {err_dx:.1e}  (exact)")
assert err_y == 0.0 and err_dx == 0.0

# %% [markdown]
# ### The mask kept from forward
#
# The gradient of a max goes to the position of the maximum (the *first* one in (d, h, w) scan
# order when there are ties, as in PyTorch). Rather than recompute it, `max_pool3d(...,
# return_masks=True)` returns it and `MaxPool3d` keeps it until backward: the pool is separable
# (a 1-D max along W, then H, then D), and each stage keeps, for each of its $k$ taps, a boolean
# map "this tap held the first maximum". Exactly one tap is true per output of a stage. With
# $k = s = 2$ that is 2 booleans per output of each stage: the W stage has $n/2$ outputs for $n$
# inputs, H $n/4$, D $n/8$, so $2(1/2 + 1/4 + 1/8) = 1.75$ bytes per input read — kept instead of
# a second pass over the input in backward. Those are the reference's masks, the math as this
# page writes it, so the cell below asks for the reference alone (`F.reference_only()`); the
# fast routes keep the same information in their own form (a small pool whose windows tile its
# input keeps the flat index of each window's first maximum: 8 bytes per output, 1 per input).
#
# On a block, the masks are taken on the **halo-extended** input. So when the maximum of a
# boundary window sits in a ghost plane, backward writes the gradient onto the ghost, and the
# adjoint exchange carries it home and adds it into the owner's block. Below, the layer's steps
# are redone by hand with public pieces (`pool.halo`, `F.max_pool3d`, `F.max_pool3d_backward`)
# to look at that gradient before it travels.

# %%
x_ext = pool.halo.forward(x_local)                       # own block + ghosts: the needed range
assert x_ext.shape[2:] == tuple(b - a for a, b in pool.in_needed)
with F.reference_only():                                 # the math as written: its stage masks
    y_hand, masks = F.max_pool3d(x_ext, 2, 2, return_masks=True)
    for stages in masks:                                 # one entry per block of the work
        for first, _ in stages:                          # stages W, H, D: k = 2 boolean maps each
            assert np.all(sum(m.astype(int) for m in first) == 1)
    dx_ext = F.max_pool3d_backward(dy_local, x_ext, 2, 2, masks=masks)
dx_hand = pool.halo.adjoint(dx_ext)                      # ghost gradients -> their owners
assert np.array_equal(y_hand, y_local) and np.array_equal(dx_hand, dx_local)

is_ghost = np.ones(x_ext.shape[2:], dtype=bool)          # positions of x_ext this rank does not own
is_ghost[tuple(slice(a - n0, b - n0) for (a, b), (n0, _) in zip(owned, pool.in_needed))] = False
needed_ref = dx_ref[(samples, slice(None)) + tuple(slice(a, b) for a, b in pool.in_needed)]
sent_home = int(np.count_nonzero(dx_ext[..., is_ghost]))
assert sent_home == np.count_nonzero(needed_ref[..., is_ghost])      # the oracle's argmaxes agree
assert np.array_equal(dx_ext[..., is_ghost], needed_ref[..., is_ghost])
mask_bytes = sum(m.nbytes for stages in masks for first, _ in stages for m in first)
assert mask_bytes == 1.75 * x_ext.size                 # windows tile the needed range exactly
total_sent = comm.allreduce(sent_home)
say(f"masks kept from forward on rank 0: {mask_bytes} bytes for {x_ext.size} inputs "
    f"({mask_bytes / x_ext.size:.2f} bytes per input)")
say(f"{total_sent} window maxima (all ranks) lay in a ghost plane: their gradient went home "
    "in the adjoint exchange")
assert total_sent > 0 or all(len(g) == 0 for g in comm.allgather(ghost_planes))

# %% [markdown]
# ## 2. Transposed convolution k2 s2: the U-Net's up-sampling
#
# A transposed convolution sends input $i$ through tap $j$ to output $o = s\,i - p + d\,j$. With
# $k = s = 2$, $p = 0$: each input feeds exactly two outputs, $2i$ and $2i+1$, and each output
# $o$ comes from the single input $\lfloor o/2 \rfloor$ (tap $o \bmod 2$). refimpl again
# partitions the **output** in balanced blocks and *gathers*: the outputs $[o_0, o_1)$ need
#
# $$\Big[\Big\lceil \tfrac{o_0 + p - d(k-1)}{s} \Big\rceil,\;
#        \Big\lfloor \tfrac{o_1 - 1 + p}{s} \Big\rfloor\Big] = \big[\lceil (o_0-1)/2 \rceil,\; \lfloor (o_1-1)/2\rfloor\big]$$
#
# (`transposed_needed_input_range`). When $o_0$ is odd the block starts with the second output of
# an input whose first output belongs to the previous rank: that input is a ghost. In backward
# $dx_i = \sum_j W_j^\top dy_{2i+j}$ collects from both outputs, i.e. from two ranks: the ghost's
# part comes home through the adjoint exchange. $dW$ and $db$ are sums over every output voxel of
# every sample, so each rank's are partial: summed over the grid (spatial shards *and* sample
# groups) they equal the one-process gradients — the gradient synchroniser of tutorial 08 does
# this sum in training. (Tutorial 08 says it *averages* over the sample groups: both hold, because
# in training each group's loss gradient is scaled by Pn, so the average of the scaled partial
# gradients is the sum of the unscaled ones.)

# %%
C_in, C_out, up_in = 4, 3, (7, 3, 5)
up = SpatialConvTranspose3d(C_in, C_out, kernel_size=2, stride=2, grid=grid, rng=rng_of(3),
                            dtype=np.float64)
up_out = up.setup(up_in)
say(f"global input {up_in} -> global output {up_out}")
up_owned = tuple((s.start, s.stop) for s in grid.local_block(up_in))
(o0, o1), _, _ = up.out_block
need = transposed_needed_input_range(o0, o1, 2, 2, 0, 1, up_in[0])
assert need == up.in_needed[0]
show_table("rank: computes outputs [o0, o1) -> needs inputs -> owns: ghosts",
           f"rank {comm.rank} {grid.coords}: outputs {(o0, o1)} -> needs {need} -> owns {up_owned[0]}: "
           f"ghosts {[i for i in range(*need) if not up_owned[0][0] <= i < up_owned[0][1]]}")

# %%
x = rng_of(4).standard_normal((B, C_in) + up_in)
dy = rng_of(5).standard_normal((B, C_out) + up_out)
y_local = up.forward(local(x, up_in))
dx_local = up.backward(local(dy, up_out))
dw = comm.allreduce(up.weight.grad)                      # sum over every rank of the grid
db = comm.allreduce(up.bias.grad)

w, b = up.weight.data, up.bias.data                      # the same on every rank (same seed)
y_ref = F.conv_transpose3d(x, w, b, 2)
dx_ref, dw_ref, db_ref = F.conv_transpose3d_backward(dy, x, w, 2)
errors = {"y": max_error(y_local, local(y_ref, up_out)), "dx": max_error(dx_local, local(dx_ref, up_in)),
          "dW": max_error(dw, dw_ref), "db": max_error(db, db_ref)}
say("transposed conv: " + ", ".join(f"{k} error {v:.1e}" for k, v in errors.items()))
assert max(errors.values()) < 1e-12

# %% [markdown]
# ## 3. Batch norm across shards
#
# In training, batch norm normalises channel $c$ with the mean and variance of **all**
# $M = N \cdot D \cdot H \cdot W$ values of that channel — every voxel of every sample of the
# global batch. No rank holds them: they are spread over the spatial blocks and the sample
# groups. But a sum over a union of disjoint blocks is the sum of the blocks' sums, so it is
# enough to allreduce a few per-channel sums.
#
# **Forward.** refimpl uses *shifted* sums with a per-channel shift $K$:
#
# $$S_1 = \sum (x - K), \qquad S_2 = \sum (x - K)^2, \qquad
#   \mu = K + \frac{S_1}{M}, \qquad \sigma^2 = \frac{S_2}{M} - \Big(\frac{S_1}{M}\Big)^2 .$$
#
# The textbook centred form $\sum (x-\mu)^2$ is exact but needs $\mu$ first: two allreduces.
# Plain $\sum x, \sum x^2$ needs one but cancels catastrophically when $|\mu| \gg \sigma$. The
# shift keeps one allreduce and removes most of the cancellation if $K \approx \mu$: refimpl passes
# the **running mean** as $K$ — identical on every rank (no message) and close to the batch mean
# after a few steps. One message of shape $(2, C)$ carries $[S_1; S_2]$; the count $M$ is
# allreduced too (once, as a Python integer). Then
#
# $$\hat x = (x - \mu)\,s, \quad s = (\sigma^2 + \epsilon)^{-1/2}, \qquad y = \gamma \hat x + \beta .$$
#
# **Biased here, unbiased in the running variance.** $\sigma^2$ divides by $M$: it is the actual
# second moment of the values being normalised, so the normalised batch has mean exactly 0 and
# mean square $\sigma^2/(\sigma^2+\epsilon)$, and the backward below differentiates exactly this
# function of the batch (PyTorch, training mode, does the same). The running variance has another
# job: at evaluation it stands in for the variance of the *data distribution*, and a sample
# variance divided by $M$ underestimates that by the factor $(M-1)/M$ on average, hence
#
# $$\text{running\_var} \leftarrow (1-m)\,\text{running\_var} + m\,\sigma^2 \frac{M}{M-1}.$$
#
# With shards, $M$ must be the **global** count: a rank using its own count $m$ would apply a
# different Bessel factor $m/(m-1)$ — one more reason the count is reduced.
#
# **Backward.** Every $\hat x_i$ depends on every $x_j$ of the channel through $\mu$ and $s$:
# $\partial\mu/\partial x_j = 1/M$, $\partial\sigma^2/\partial x_j = 2(x_j-\mu)/M$, so
#
# $$\frac{\partial \hat x_i}{\partial x_j} = s\Big(\delta_{ij} - \frac1M - \frac{\hat x_i \hat x_j}{M}\Big)
# \quad\Longrightarrow\quad
# dx_j = \gamma\,s\Big(dy_j - \frac{1}{M}\sum_i dy_i - \hat x_j\,\frac{1}{M}\sum_i dy_i \hat x_i\Big).$$
#
# (The $1/M$ of the last term is the $1/M$ of the biased variance.) The two sums, $\sum dy$ and
# $\sum dy\,\hat x$, run over all $M$ values again: one more allreduce of shape $(2, C)$ in
# backward. They are also $d\beta$ and $d\gamma$; the layer hands out its *local* contributions
# for those, summed by the gradient synchroniser like every other parameter gradient.
#
# `SpatialBatchNorm3d(..., global_stats=True)` (what the U-Net builds) reduces over
# `grid.batch_comm`, the whole grid; `global_stats=False` only over the spatial group, i.e. the
# statistics of each sample group's own samples. To watch the messages we subclass it and log
# what goes through its two reduction hooks.

# %%
class LoggedBN(SpatialBatchNorm3d):
    def forward(self, x):
        self.direction = "forward"
        return super().forward(x)

    def backward(self, dy):
        self.direction = "backward"
        return super().backward(dy)

    def global_count(self, count):
        self.log.append((self.direction, "count M", "1 int"))
        return super().global_count(count)

    def global_sums(self, *sums):
        what = "[S1, S2] = shifted sum x, sum x^2" if self.direction == "forward" else "[sum dy, sum dy*xhat]"
        self.log.append((self.direction, what, f"({len(sums)}, {sums[0].shape[0]}) float64, "
                                                f"{len(sums) * sums[0].nbytes} bytes"))
        return super().global_sums(*sums)


C, bn_dhw = 3, (13, 6, 5)
bn = LoggedBN(C, grid=grid, global_stats=True, dtype=np.float64)
bn.log = []
single = BatchNorm3d(C, dtype=np.float64)
gamma, beta = rng_of(6).uniform(0.5, 2.0, C), rng_of(7).standard_normal(C)
for layer in (bn, single):
    layer.weight.data[...], layer.bias.data[...] = gamma, beta
    layer.setup(bn_dhw)
offsets, scales = np.array([3.0, -1.5, 0.4]), np.array([2.0, 0.5, 1.3])   # |mean| > std on purpose

# %% [markdown]
# Two training steps, so that the second one runs with a non-zero shift (the running mean of the
# first). Before each step we also compute the local shifted sums by hand and check that their
# allreduce is the sum over the global tensor.

# %%
for step in range(2):
    x = offsets.reshape(1, C, 1, 1, 1) + scales.reshape(1, C, 1, 1, 1) * rng_of(10 + step).standard_normal((B, C) + bn_dhw)
    dy = rng_of(20 + step).standard_normal((B, C) + bn_dhw)
    x_local, dy_local = local(x, bn_dhw), local(dy, bn_dhw)
    K = bn.running_mean.copy().reshape(1, C, 1, 1, 1)      # the shift: same on every rank
    s = np.stack([(x_local - K).sum(axis=(0, 2, 3, 4)), ((x_local - K) ** 2).sum(axis=(0, 2, 3, 4))])
    s_global = grid.batch_comm.allreduce(s)
    s_ref = np.stack([(x - K).sum(axis=(0, 2, 3, 4)), ((x - K) ** 2).sum(axis=(0, 2, 3, 4))])
    M = B * np.prod(bn_dhw)
    mu, var = K.ravel() + s_global[0] / M, s_global[1] / M - (s_global[0] / M) ** 2
    err_sums = max(max_error(s_global, s_ref), max_error(mu, x.mean(axis=(0, 2, 3, 4))),
                   max_error(var, x.var(axis=(0, 2, 3, 4))))
    assert err_sums < 1e-12

    for layer in (bn, single):
        layer.zero_grad()
    y_local = bn.forward(x_local)
    dx_local = bn.backward(dy_local)
    y_ref = single.forward(x)
    dx_ref = single.backward(dy)
    errors = {"y": max_error(y_local, local(y_ref, bn_dhw)), "dx": max_error(dx_local, local(dx_ref, bn_dhw)),
              "dgamma": max_error(comm.allreduce(bn.weight.grad), single.weight.grad),
              "dbeta": max_error(comm.allreduce(bn.bias.grad), single.bias.grad),
              "running_mean": max_error(bn.running_mean, single.running_mean),
              "running_var": max_error(bn.running_var, single.running_var)}
    say(f"step {step} (shift K = {np.round(K.ravel(), 3)}): hand sums error {err_sums:.1e}; "
        + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    assert max(errors.values()) < 1e-10

# %% [markdown]
# The explicit backward formula, on the whole last batch, against the one-process layer; and the
# biased / unbiased bookkeeping of the running variance, redone by hand from the start values
# (running mean 0, running variance 1).

# %%
mu, var = x.mean(axis=(0, 2, 3, 4)), x.var(axis=(0, 2, 3, 4))     # np.var: divides by M (biased)
inv = (1 / np.sqrt(var + bn.eps)).reshape(1, C, 1, 1, 1)
xhat = (x - mu.reshape(1, C, 1, 1, 1)) * inv
mean_dy = dy.mean(axis=(0, 2, 3, 4), keepdims=True)
mean_dy_xhat = (dy * xhat).mean(axis=(0, 2, 3, 4), keepdims=True)
dx_formula = gamma.reshape(1, C, 1, 1, 1) * inv * (dy - mean_dy - xhat * mean_dy_xhat)
err_formula = np.abs(dx_formula - dx_ref).max() / np.abs(dx_ref).max()
err_moments = max(np.abs(xhat.mean(axis=(0, 2, 3, 4))).max(),
                  np.abs((xhat ** 2).mean(axis=(0, 2, 3, 4)) - var / (var + bn.eps)).max())
say(f"dx by the formula vs BatchNorm3d: {err_formula:.1e}; normalised batch: mean 0, "
    f"mean square var/(var+eps) to {err_moments:.1e}")
assert err_formula < 1e-12 and err_moments < 1e-12

m = bn.momentum
x0 = offsets.reshape(1, C, 1, 1, 1) + scales.reshape(1, C, 1, 1, 1) * rng_of(10).standard_normal((B, C) + bn_dhw)
rm, rv = np.zeros(C), np.ones(C)
for batch in (x0, x):
    rm = (1 - m) * rm + m * batch.mean(axis=(0, 2, 3, 4))
    rv = (1 - m) * rv + m * batch.var(axis=(0, 2, 3, 4)) * M / (M - 1)
err_running = max(max_error(bn.running_mean, rm), max_error(bn.running_var, rv))
m_local = x_local.shape[0] * np.prod(x_local.shape[2:])
say(f"running stats by hand (Bessel factor M/(M-1) with the global M = {M}: {M / (M - 1):.6f}) "
    f"match to {err_running:.1e}; rank 0's own count m = {m_local} would give {m_local / (m_local - 1):.6f}")
assert err_running < 1e-12
assert (m_local == M) == (P == 1)

# %% [markdown]
# What went through the reduction hooks, in order (the same on every rank):

# %%
say(f"allreduced over grid.batch_comm ({grid.batch_comm.Get_size()} ranks) in the two steps:")
for direction, what, size in bn.log:
    say(f"   {direction:>8}: {what:<36} {size}")
assert [d for d, _, _ in bn.log] == ["forward", "forward", "backward"] * 2

# %% [markdown]
# Finally `global_stats=False`: the sums are reduced over the spatial group only. Every sample
# group then normalises with the statistics of *its own* samples — still independent of how the
# samples are cut into blocks (it equals the one-process layer on those samples), but with
# Pn > 1 no longer the statistics of the global batch.

# %%
bn_spatial = SpatialBatchNorm3d(C, grid=grid, global_stats=False, dtype=np.float64)
own = BatchNorm3d(C, dtype=np.float64)
y_local = bn_spatial.forward(x_local)
y_own = own.forward(x[samples])
err_own = max_error(y_local, y_own[(slice(None), slice(None)) + grid.local_block(bn_dhw)])
say(f"global_stats=False equals one-process batch norm on each sample group's own samples: {err_own:.1e}")
assert err_own < 1e-10

# %% [markdown]
# Summary: pooling and up-sampling need a halo only where a block boundary cuts a window (an odd
# block size here), and their backward sends the ghosts' gradients home; batch norm needs no halo
# but two small allreduces of per-channel sums per step (plus the count), and with them the
# partitioned layer equals the one-process one. `tests/mpi/` checks the same for every grid;
# `refimpl check-layer` does it for one layer from the command line.
