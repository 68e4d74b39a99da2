# %% [markdown]
# # Tutorial 2 — Splitting a sample: blocks, needed ranges and halos
#
#     mpiexec -n 4 --oversubscribe python tutorials/02_splitting_a_sample.py     (any number of ranks; 1 works too)
#
# A 3D CNN sample (say 4 x 128^3 voxels) can be too big for one device, and one sample per rank
# leaves ranks idle when the batch is small. Spatial parallelism cuts **one sample** into blocks,
# one block per rank of a (Pd, Ph, Pw) grid. Before any message is sent, three questions have
# to be answered by pure index math (`refimpl/parallel/partition.py`, no MPI):
#
# 1. **Which block does each rank own?** Balanced blocks, numbered row-major over the grid.
# 2. **Which inputs does a rank need?** A convolution's output voxel reads a window of inputs;
#    the rank owns a block of the *output*, so it needs a slightly larger block of the input.
#    The part of that range outside the domain is the layer's zero padding.
# 3. **Who sends what to whom?** The parts of the needed range that other ranks own are the
#    *ghost* (halo) layers: the **halo plan** lists every transfer.
#
# Every formula is written out, checked against refimpl's function and against brute force.
# The last section runs the plans for real with MPI on this job's ranks.

# %%
import numpy as np
from mpi4py import MPI

from refimpl import functional as F
from refimpl.parallel.grid import ProcessGrid, all_grids
from refimpl.parallel.halo import HaloExchange
from refimpl.parallel.partition import (axis_halo_plan, block_range, block_slices, bytes_sent,
                                        conv_halo_plan, grid_coords, grid_rank, needed_input_range,
                                        window_output_extent)

comm = MPI.COMM_WORLD
say = print if comm.rank == 0 else (lambda *a, **k: None)


def r(a, b):
    """A half-open range, printed."""
    return f"[{a},{b})"


# %% [markdown]
# ## 1. Balanced blocks
#
# An extent of $n$ voxels over $p$ ranks: with $q = \lfloor n/p \rfloor$ and $r = n \bmod p$,
# the first $r$ blocks get $q+1$ voxels and the others $q$. Block $i$ is the half-open range
#
# $$\text{start}_i = q\,i + \min(i, r), \qquad \text{size}_i = q + [\,i < r\,].$$
#
# Sizes differ by at most one, so no rank waits much longer than the others. When $p > n$ the
# last $p - n$ blocks are **empty** (size 0), which every part of refimpl must survive. We write
# the formula by hand and check it against `block_range` for every $n \le 40$, $p \le 12$.

# %%
def block_by_hand(n, p, i):
    q, rem = divmod(n, p)
    start = q * i + min(i, rem)
    return start, start + q + (i < rem)


for n in range(41):
    for p in range(1, 13):
        blocks = [block_range(n, p, i) for i in range(p)]
        assert blocks == [block_by_hand(n, p, i) for i in range(p)]
        sizes = [b - a for a, b in blocks]
        assert blocks[0][0] == 0 and blocks[-1][1] == n                        # covers [0, n)
        assert all(blocks[i][1] == blocks[i + 1][0] for i in range(p - 1))     # contiguous
        assert max(sizes) - min(sizes) <= 1                                    # balanced
say("block_range == the formula, blocks tile [0, n) and differ by <= 1, for n <= 40, p <= 12")
for n, p in ((10, 3), (10, 4), (3, 4)):
    blocks = [block_range(n, p, i) for i in range(p)]
    say(f"  n={n:2d} over p={p}: " + "  ".join(r(a, b) for a, b in blocks)
        + f"   sizes {[b - a for a, b in blocks]}")
assert [block_range(10, 3, i) for i in range(3)] == [(0, 4), (4, 7), (7, 10)]
assert [block_range(10, 4, i) for i in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
assert block_range(3, 4, 3) == (3, 3)                                          # an empty block

# %% [markdown]
# ### A 3-D grid of ranks
#
# A spatial grid $(P_d, P_h, P_w)$ numbers its ranks **row-major** (the last axis fastest):
#
# $$\text{rank} = (c_d P_h + c_h) P_w + c_w .$$
#
# `grid_rank` and `grid_coords` are this map and its inverse, and `block_slices` applies
# `block_range` on each axis. The same map is used by compute (`ProcessGrid.local_block`),
# HDF5 hyperslab reads and gathers: if any of them numbered ranks differently, a rank would
# read one block and compute on another. Below: a (10, 7, 5) volume over a 2 x 3 x 2 grid.

# %%
dims, shape = (2, 3, 2), (10, 7, 5)
count = np.zeros(shape, dtype=int)
say(f"\n{shape} over grid {dims}:\n rank  coords     D       H       W     block")
for rank in range(np.prod(dims)):
    c = grid_coords(rank, dims)
    assert grid_rank(c, dims) == rank == (c[0] * dims[1] + c[1]) * dims[2] + c[2]
    sl = block_slices(shape, dims, c)
    count[sl] += 1
    say(f"  {rank:2d}  {c}  " + "  ".join(f"{r(s.start, s.stop):6s}" for s in sl)
        + f"  {tuple(s.stop - s.start for s in sl)}")
assert np.all(count == 1)
say("every voxel lies in exactly one block")

# %% [markdown]
# ## 2. Output-driven needed input ranges
#
# A convolution with kernel $k$, stride $s$, padding $p$ and dilation $d$ (per axis) has
# output extent
#
# $$n_\text{out} = \left\lfloor \frac{n + 2p - d(k-1) - 1}{s} \right\rfloor + 1 .$$
#
# Output $o$ reads the zero-padded input at positions $s\,o + d\,j$, $j = 0 \dots k-1$; in
# **unpadded** coordinates (subtract $p$) that is $s\,o - p + d\,j$. Each rank owns a balanced
# block $[o_0, o_1)$ of the **output** (the output, not the input, is what must be split
# evenly: it is the work). The smallest input index it reads is $j = 0$ of output $o_0$, the
# largest is $j = k-1$ of output $o_1 - 1$:
#
# $$\text{first} = s\,o_0 - p, \qquad \text{last} = s\,(o_1 - 1) - p + d\,(k-1)
# \quad(\text{inclusive}).$$
#
# (With $s > d(k-1)+1$ the windows leave gaps: this interval is then the hull of what is read.)
# `needed_input_range(o0, o1, k, s, p, d, n)` returns this interval as half-open
# $[\text{first}, \text{last}+1)$ **clipped** to the domain $[0, n)$, plus the amounts clipped on
# each side, `(pad_low, pad_high)`. Those are positions below $0$ or at $n$ and beyond: they hold
# the layer's **zero padding**, not a neighbour's data (for max pooling the padding is
# $-\infty$). We check the formula against brute-force enumeration of every window's reads.

# %%
def needed_by_hand(o0, o1, k, s, p, d):
    """Half-open [first, last + 1) in unpadded input coordinates (not clipped)."""
    return s * o0 - p, s * (o1 - 1) - p + d * (k - 1) + 1


cases = 0
for n in range(1, 10):
    for k in range(1, 4):
        for s in range(1, 4):
            for p in range(3):
                for d in range(1, 3):
                    if d * (k - 1) + 1 > n + 2 * p:
                        continue                               # the kernel does not fit
                    n_out = window_output_extent(n, k, s, p, d)
                    assert n_out == (n + 2 * p - d * (k - 1) - 1) // s + 1
                    for o0 in range(n_out):
                        for o1 in range(o0 + 1, n_out + 1):
                            reads = [s * o - p + d * j for o in range(o0, o1) for j in range(k)]
                            lo, stop = needed_by_hand(o0, o1, k, s, p, d)
                            assert (lo, stop) == (min(reads), max(reads) + 1)
                            (i0, i1), (pl, ph) = needed_input_range(o0, o1, k, s, p, d, n)
                            assert (i0, i1) == (min(max(lo, 0), n), max(min(stop, n), min(max(lo, 0), n)))
                            assert pl + (i1 - i0) + ph == stop - lo  # clipped part = padding
                            cases += 1
say(f"\nneeded_input_range == [s*o0 - p, s*(o1-1) - p + d(k-1)] clipped, for {cases} "
    "(n, k, s, p, d, [o0, o1)) cases")

# %% [markdown]
# Two examples: a 'same' 3-wide conv of 12 voxels, and a strided, dilated one of 11 voxels,
# both with their output split over 3 ranks. The first and last rank read into the padding.

# %%
examples = {"k=3 s=1 p=1 d=1, n=12": (12, 3, 1, 1, 1), "k=3 s=2 p=2 d=2, n=11": (11, 3, 2, 2, 2)}
for name, (n, k, s, p, d) in examples.items():
    n_out = window_output_extent(n, k, s, p, d)
    say(f"{name}: n_out = {n_out}")
    for i in range(3):
        o0, o1 = block_range(n_out, 3, i)
        lo, stop = needed_by_hand(o0, o1, k, s, p, d)
        (i0, i1), pad = needed_input_range(o0, o1, k, s, p, d, n)
        say(f"  rank {i}: outputs {r(o0, o1):8s} read {r(lo, stop):8s} -> input {r(i0, i1):8s}"
            f" + padding (low, high) = {pad}")
assert needed_input_range(0, 4, 3, 1, 1, 1, 12) == ((0, 5), (1, 0))
assert needed_input_range(4, 6, 3, 2, 2, 2, 11) == ((6, 11), (0, 2))

# %% [markdown]
# ### The padding is added locally
#
# Because the clipped part is exactly the padding, a rank can run its local convolution with
# **no padding of its own** on `pad(x[i0:i1], (pad_low, pad_high))`, and this array is exactly
# the slice $[\text{first} + p, \text{last} + 1 + p)$ of the globally zero-padded input. Its
# output is then the rank's block of the global output. Checked in 1-D (the W axis of a
# `refimpl.functional.conv3d`) for the strided, dilated example:

# %%
n, k, s, p, d = examples["k=3 s=2 p=2 d=2, n=11"]
rng = np.random.default_rng(2)
x1 = rng.standard_normal((1, 1, 1, 1, n))                      # (N, C, D, H, W): a 1-D signal
w1 = rng.standard_normal((1, 1, 1, 1, k))
x1_pad = np.pad(x1, [(0, 0)] * 4 + [(p, p)])
y1 = F.conv3d(x1, w1, None, (1, 1, s), (0, 0, p), (1, 1, d))   # the global conv
n_out = y1.shape[-1]
for i in range(3):
    o0, o1 = block_range(n_out, 3, i)
    (i0, i1), (pl, ph) = needed_input_range(o0, o1, k, s, p, d, n)
    lo, stop = needed_by_hand(o0, o1, k, s, p, d)
    local = np.pad(x1[..., i0:i1], [(0, 0)] * 4 + [(pl, ph)])
    assert np.array_equal(local, x1_pad[..., lo + p:stop + p])
    y_local = F.conv3d(local, w1, None, (1, 1, s), 0, (1, 1, d))
    err = np.abs(y_local - y1[..., o0:o1]).max()
    assert y_local.shape[-1] == o1 - o0 and err <= 1e-14
say("pad(x[i0:i1], padding) == slice of the zero-padded input; local conv without padding == "
    "the rank's block of the global conv")

# %% [markdown]
# ## 3. Halos: the plan of who sends what
#
# Now put the two maps together. Along one axis split over $P$ ranks, coordinate $c$
#
# - **owns** the balanced input block `owned[c]` (the input is split like everything else),
# - **computes** the balanced output block `outputs[c]` and so **needs** `needed[c]`,
# - adds `padding[c]` zeros at the domain edge,
# - and **receives** $\text{owned}[c'] \cap \text{needed}[c]$ from every other $c'$ where that
#   is not empty: its ghost layers. The owned part of the need is a local copy.
#
# `axis_halo_plan(n, P, needed, outputs, padding)` computes the owners and the transfers
# `(src, dst, start, stop)`; `conv_halo_plan(shape, grid, k, s, p, d)` does it for the three
# axes of a conv. A helper checks every promise of an axis plan, so that the printed plans below
# are also verified:

# %%
def check_axis_plan(ax, k, s, p, d):
    """Assert that the axis plan's owners, outputs, needs, padding and transfers fit together."""
    n_out = window_output_extent(ax.n, k, s, p, d)
    assert list(ax.owned) == [block_range(ax.n, ax.parts, c) for c in range(ax.parts)]
    assert list(ax.outputs) == [block_range(n_out, ax.parts, c) for c in range(ax.parts)]
    for c in range(ax.parts):
        (o0, o1), (n0, n1), (pl, ph) = ax.outputs[c], ax.needed[c], ax.padding[c]
        if o1 > o0:                                            # padding + input = the read interval
            lo, stop = needed_by_hand(o0, o1, k, s, p, d)
            assert (n0 - pl, n1 + ph) == (lo, stop)
        cover = np.zeros(ax.n, dtype=int)                      # own part + received pieces
        a, b = max(n0, ax.owned[c][0]), min(n1, ax.owned[c][1])
        cover[a:b] += 1
        for src, a, b in ax.recvs(c):
            assert src != c and ax.owned[src][0] <= a < b <= ax.owned[src][1]
            assert (c, a, b) in ax.sends(src)                  # the sender knows it too
            cover[a:b] += 1
        assert np.all(cover[n0:n1] == 1) and cover.sum() == n1 - n0   # each needed cell once


def show_axis_plan(ax, title):
    say(title)
    for c in range(ax.parts):
        recvs = ", ".join(f"{r(a, b)} from {src}" for src, a, b in ax.recvs(c)) or "nothing"
        sends = ", ".join(f"{r(a, b)} to {dst}" for dst, a, b in ax.sends(c)) or "nothing"
        say(f"  coord {c}: owns {r(*ax.owned[c]):7s} outputs {r(*ax.outputs[c]):7s} needs "
            f"{r(*ax.needed[c]):7s} edge padding {ax.padding[c]}\n"
            f"           receives {recvs};  sends {sends}")


# a 'same' 3-wide conv along W: 12 voxels over 4 ranks; D and H are not split
plan_1d = conv_halo_plan((1, 1, 12), (1, 1, 4), kernel=(1, 1, 3), stride=1, padding=(0, 0, 1))
ax_w = plan_1d.axes[2]
check_axis_plan(ax_w, 3, 1, 1, 1)
assert ax_w == axis_halo_plan(12, 4, list(ax_w.needed), list(ax_w.outputs), list(ax_w.padding))
show_axis_plan(ax_w, "\nk=3, p=1, n=12 over 4 ranks (one ghost layer per side, padding at the ends):")
assert ax_w.transfers == ((1, 0, 3, 4), (0, 1, 2, 3), (2, 1, 6, 7), (1, 2, 5, 6), (3, 2, 9, 10),
                          (2, 3, 8, 9))

# %% [markdown]
# ## 4. A picture: one rank's ghosts in 2-D
#
# A 12 x 12 (H x W) slice over a 2 x 3 grid, a 3 x 3 kernel with padding 1. In 3-D the plan
# exchanges **one axis at a time** (D, then H, then W); a message along an axis covers the
# *needed* range on the earlier axes, so the corner ghosts a rank received from below are
# forwarded sideways in the next step: corners travel in two hops, without diagonal messages.
# `HaloPlan.recvs(coords, axis)` lists a rank's messages with their 3-D regions. We replay them
# for rank 1 (top middle) and mark, for every ghost cell, its **owner** and the rank that
# **sent** it.

# %%
pic_shape, pic_dims = (1, 12, 12), (1, 2, 3)
pic = conv_halo_plan(pic_shape, pic_dims, kernel=(1, 3, 3), stride=1, padding=(0, 1, 1))
for a in (1, 2):
    check_axis_plan(pic.axes[a], 3, 1, 1, 1)
owner = np.zeros(pic_shape[1:], dtype=int)                      # global (H, W) owner map
for rank in range(np.prod(pic_dims)):
    owner[block_slices(pic_shape, pic_dims, grid_coords(rank, pic_dims))[1:]] = rank
me = 1
coords = grid_coords(me, pic_dims)
(_, _), (h0, h1), (w0, w1) = pic.needed(coords)
_, (ph_lo, ph_hi), (pw_lo, pw_hi) = pic.padding(coords)
sender = np.full((h1 - h0, w1 - w0), -1)                        # who filled each needed cell
own = tuple(slice(a - o, b - o) for (a, b), o in zip(pic.owned(coords)[1:], (h0, w0)))
sender[own] = me
say(f"\nrank {me} {coords}: owns H{r(*pic.owned(coords)[1])} W{r(*pic.owned(coords)[2])}, needs "
    f"H{r(h0, h1)} W{r(w0, w1)}, edge padding H{(ph_lo, ph_hi)} W{(pw_lo, pw_hi)}")
for axis in range(3):
    for m in pic.recvs(coords, axis):
        (_, _), (a, b), (c0, c1) = m.region
        assert np.all(sender[a - h0:b - h0, c0 - w0:c1 - w0] == -1)   # nothing is received twice
        sender[a - h0:b - h0, c0 - w0:c1 - w0] = grid_rank(m.peer, pic_dims)
        say(f"  exchange along {'DHW'[axis]}: from rank {grid_rank(m.peer, pic_dims)} {m.peer}: "
            f"H{r(a, b)} x W{r(c0, c1)}  ({m.volume} voxels)")
assert np.all(sender >= 0)                                      # every needed cell is filled
ghost_owner = owner[h0:h1, w0:w1]
forwarded = (sender != ghost_owner)
assert sorted(set(ghost_owner[sender != me].tolist())) == [0, 2, 3, 4, 5]   # five neighbours
assert forwarded.sum() == 2 and set(ghost_owner[forwarded].tolist()) == {3, 5}  # the two corners
say(f"  ghosts owned by ranks {sorted(set(ghost_owner[sender != me].tolist()))}; the corners owned "
    f"by 3 and 5 arrive via ranks {sorted(set(sender[forwarded].tolist()))}")

if comm.rank == 0:
    import matplotlib.pyplot as plt

    colours = plt.get_cmap("tab10").colors
    H, W = pic_shape[1:]
    fig, axes = plt.subplots(1, 2, figsize=(11, 5.2), gridspec_kw={"width_ratios": [1.35, 1]})
    ax = axes[0]                                                # the whole padded slice
    for i in range(-1, H + 1):
        for j in range(-1, W + 1):
            if 0 <= i < H and 0 <= j < W:
                ax.add_patch(plt.Rectangle((j, i), 1, 1, fc=colours[owner[i, j]], alpha=0.35, ec="w"))
            else:
                ax.add_patch(plt.Rectangle((j, i), 1, 1, fc="0.85", hatch="///", ec="0.6", lw=0.3))
    for rank in range(np.prod(pic_dims)):
        _, hs, ws = block_slices(pic_shape, pic_dims, grid_coords(rank, pic_dims))
        ax.add_patch(plt.Rectangle((ws.start, hs.start), ws.stop - ws.start, hs.stop - hs.start,
                                   fill=False, ec="k", lw=1.2))
        ax.text((ws.start + ws.stop) / 2, (hs.start + hs.stop) / 2, f"rank {rank}\n{grid_coords(rank, pic_dims)[1:]}",
                ha="center", va="center", fontsize=9)
    ax.add_patch(plt.Rectangle((w0 - pw_lo, h0 - ph_lo), w1 - w0 + pw_lo + pw_hi, h1 - h0 + ph_lo + ph_hi,
                               fill=False, ec=colours[me], lw=3, ls="--"))
    ax.set_xlim(-1.1, W + 1.1)
    ax.set_ylim(H + 1.1, -1.1)
    ax.set_aspect("equal")
    ax.set_xticks(np.arange(-1, W + 1) + 0.5, range(-1, W + 1), fontsize=7)
    ax.set_yticks(np.arange(-1, H + 1) + 0.5, range(-1, H + 1), fontsize=7)
    ax.set_xlabel("W index")
    ax.set_ylabel("H index")
    ax.set_title(f"12 x 12 over a 2 x 3 grid, 3x3 kernel, padding 1 (hatched)\n"
                 f"dashed: what rank {me} reads (needed range + edge padding)", fontsize=9)
    ax = axes[1]                                                # rank 1's padded block, zoomed
    for i in range(h0 - ph_lo, h1 + ph_hi):
        for j in range(w0 - pw_lo, w1 + pw_hi):
            if not (h0 <= i < h1 and w0 <= j < w1):
                ax.add_patch(plt.Rectangle((j, i), 1, 1, fc="0.85", hatch="///", ec="0.5"))
                ax.text(j + 0.5, i + 0.5, "0", ha="center", va="center", fontsize=8, color="0.4")
                continue
            o, snd = owner[i, j], sender[i - h0, j - w0]
            ghost = o != me
            ax.add_patch(plt.Rectangle((j, i), 1, 1, fc=colours[o], alpha=0.55 if ghost else 0.9,
                                       ec="k", lw=0.5))
            if ghost:
                ax.text(j + 0.5, i + 0.5, f"{o}" if snd == o else f"{o}\nvia {snd}", ha="center",
                        va="center", fontsize=7)
    (oh0, oh1), (ow0, ow1) = pic.owned(coords)[1:]
    ax.add_patch(plt.Rectangle((ow0, oh0), ow1 - ow0, oh1 - oh0, fill=False, ec="k", lw=2.5))
    ax.set_xlim(w0 - pw_lo, w1 + pw_hi)
    ax.set_ylim(h1 + ph_hi, h0 - ph_lo)
    ax.set_aspect("equal")
    ax.set_xticks(np.arange(w0 - pw_lo, w1 + pw_hi) + 0.5, range(w0 - pw_lo, w1 + pw_hi), fontsize=7)
    ax.set_yticks(np.arange(h0 - ph_lo, h1 + ph_hi) + 0.5, range(h0 - ph_lo, h1 + ph_hi), fontsize=7)
    ax.set_xlabel("messages: " + "; ".join(
        f"along {'DHW'[a]} from rank {grid_rank(m.peer, pic_dims)}: H{r(*m.region[1])} x W{r(*m.region[2])}"
        for a in range(3) for m in pic.recvs(coords, a)).replace("; along W from rank 0", ";\nalong W from rank 0"),
        fontsize=8)
    ax.set_title(f"rank {me}'s padded input block: owned (bold frame), ghosts labelled\n"
                 f"by owner (colour = owner; 'via': forwarded), zero padding hatched", fontsize=9)
    fig.tight_layout()
    fig.savefig("02_splitting_a_sample.png", dpi=90)
    plt.close(fig)
    print("saved 02_splitting_a_sample.png")

# %% [markdown]
# ## 5. Edge cases the planner handles
#
# ### A halo wider than the neighbour's block
#
# Small blocks (many ranks, or deep layers where the volume has shrunk) and wide kernels (large
# $k$ or dilation) give a need that reaches **past the direct neighbour**. The planner does not
# assume "one neighbour per side": it intersects the need with *every* owner. Here 6 voxels over
# 4 ranks (blocks of 2, 2, 1, 1) with a 3-tap kernel of dilation 3 and padding 3 (it spans 7
# voxels, like a $k = 7$ kernel): coordinate 3 receives from coordinate 1, **two ranks away**,
# and coordinate 0 from coordinate 2.

# %%
n, k, s, p, d = 6, 3, 1, 3, 3
ax_wide = conv_halo_plan((1, 1, n), (1, 1, 4), (1, 1, k), s, (0, 0, p), (1, 1, d)).axes[2]
check_axis_plan(ax_wide, k, s, p, d)
show_axis_plan(ax_wide, f"\nk={k}, d={d}, p={p}, n={n} over 4 ranks (the window spans {d * (k - 1) + 1}):")
far = [(src, dst, a, b) for src, dst, a, b in ax_wide.transfers if abs(src - dst) >= 2]
say(f"  transfers between non-neighbours (src, dst, start, stop): {far}")
assert (1, 3, 2, 4) in far and (2, 0, 4, 5) in far
assert ax_wide == conv_halo_plan((1, 1, n), (1, 1, 4), (1, 1, 7), 1, (0, 0, 3)).axes[2]  # same as k=7

# %% [markdown]
# ### Empty blocks
#
# With more ranks than voxels along an axis, balanced blocks leave ranks with nothing: 3 voxels
# over 4 ranks. Coordinate 3 owns no input and computes no output, so it needs nothing, sends
# nothing and receives nothing: its needed range is empty (`[2,2)`, an empty range placed at
# $s\,o_0 - p$) and so is its padding `(0, 0)`; the high-end padding belongs to coordinate 2,
# the last rank with outputs.
#
# A rank can also own input but compute **no output**: with a stride-2, 2-wide kernel
# (a pooling layer) over 8 voxels and 6 ranks, there are 4 outputs for 6 ranks. Coordinates
# 4 and 5 compute nothing, yet they own voxels 6 and 7, which coordinate 3 needs: they only
# *send*. And coordinate 3 needs none of what it owns (it owns voxel 5 and reads 6 and 7): it sends
# voxel 5 to coordinate 2 and receives its whole input. The plan makes no assumption that a rank's
# needed range contains its owned block.

# %%
ax_empty = conv_halo_plan((1, 1, 3), (1, 1, 4), (1, 1, 3), 1, (0, 0, 1)).axes[2]
check_axis_plan(ax_empty, 3, 1, 1, 1)
show_axis_plan(ax_empty, "\nk=3, p=1, n=3 over 4 ranks (coordinate 3 is empty):")
assert ax_empty.owned[3] == ax_empty.outputs[3] == (3, 3) and ax_empty.needed[3] == (2, 2)
assert ax_empty.sends(3) == [] and ax_empty.recvs(3) == [] and ax_empty.padding[2] == (0, 1)

ax_pool = conv_halo_plan((1, 1, 8), (1, 1, 6), (1, 1, 2), (1, 1, 2), 0).axes[2]
check_axis_plan(ax_pool, 2, 2, 0, 1)
show_axis_plan(ax_pool, "\nk=2, s=2, p=0, n=8 over 6 ranks (4 outputs: coordinates 4 and 5 compute none):")
assert ax_pool.outputs[4] == ax_pool.outputs[5] == (4, 4) and ax_pool.needed[4] == (8, 8)
assert ax_pool.sends(4) == [(3, 6, 7)] and ax_pool.sends(5) == [(3, 7, 8)]
assert ax_pool.needed[3] == (6, 8) and ax_pool.owned[3] == (5, 6) and ax_pool.sends(3) == [(2, 5, 6)]
assert ax_pool.recvs(4) == ax_pool.recvs(5) == [] and ax_pool.recvs(3) == [(4, 6, 7), (5, 7, 8)]

# %% [markdown]
# ## 6. Making it real: the halo exchange on this job's ranks
#
# `HaloExchange(plan, grid)` (`refimpl/parallel/halo.py`, tutorial 03) carries out a plan with
# MPI: each rank passes its owned block and gets back its **needed** range, ghosts filled. Padding
# it with `plan.padding(coords)` gives the rank's padded block, which must be **exactly** (float64,
# bit for bit: only copies happen) the slice of the globally zero-padded array. We run three plans
# on grids built from the world size (1, 3 or 4 ranks all work):
#
# - the 2-D picture setup on the squarest $(1, 1, P_h, P_w)$ grid;
# - the wide-halo case along W: $P + 2$ voxels over $P$ ranks, dilation 3 (ghosts from two
#   ranks away when $P \ge 3$);
# - the empty-block case along W: $\max(P - 1, 1)$ voxels over $P$ ranks (the last rank empty
#   when $P > 1$).
#
# Errors are reduced with `allreduce` before any assert, so every rank takes the same decision.
# As a last step each rank runs the conv locally on its padded block and compares with its
# block of the global conv.

# %%
P = comm.size
square = min((g for g in all_grids(P) if g[0] == g[1] == 1), key=lambda g: (abs(g[2] - g[3]), g[2]))
grids = {"2-D": ProcessGrid(comm, square), "1-D": ProcessGrid(comm, (1, 1, 1, P))}
runs = [  # name, grid, global (D, H, W), kernel, padding, dilation
    ("picture setup", "2-D", (2, 12, 12), (1, 3, 3), (0, 1, 1), 1),
    ("wide halo", "1-D", (2, 3, P + 2), (1, 1, 3), (0, 0, 3), (1, 1, 3)),
    ("empty block", "1-D", (2, 3, max(P - 1, 1)), (1, 1, 3), (0, 0, 1), 1),
]
N, C = 1, 2
say(f"\n{P} rank(s):")
for name, gname, dhw, kernel, padding, dilation in runs:
    grid = grids[gname]
    same_map = grid.local_block(dhw) == block_slices(dhw, grid.spatial_dims, grid.spatial_coords)
    plan = conv_halo_plan(dhw, grid.spatial_dims, kernel, 1, padding, dilation)
    coords = grid.spatial_coords
    rng = np.random.default_rng(7)                              # same data on every rank
    x = rng.standard_normal((N, C) + dhw)
    w = rng.standard_normal((3, C) + kernel)
    x_pad = np.pad(x, [(0, 0), (0, 0)] + [(q, q) for q in padding])   # the global zero-padded input
    x_local = np.ascontiguousarray(x[(slice(None), slice(None)) + grid.local_block(dhw)])

    halo = HaloExchange(plan, grid)
    x_ext = halo.forward(x_local)                               # (N, C, needed range)
    pads = plan.padding(coords)
    x_padded = np.pad(x_ext, [(0, 0), (0, 0)] + list(pads))    # + zero padding at the domain edge
    ref = x_pad[(slice(None), slice(None)) + tuple(slice(a - lo + q, b + hi + q) for (a, b), (lo, hi), q
                                                   in zip(plan.needed(coords), pads, padding))]
    same_shape = x_padded.shape == ref.shape                    # (never raise on one rank alone)
    err = float(np.abs(x_padded - ref).max()) if same_shape and ref.size else (0.0 if same_shape else np.inf)
    sent_ok = halo.bytes_sent == bytes_sent(plan, x.itemsize, C, N)[grid.spatial_rank]

    outs = plan.outputs(coords)                                 # the local conv, no padding
    y_ref = F.conv3d(x, w, None, 1, padding, dilation)
    if same_shape and all(b > a for a, b in outs):
        y_local = F.conv3d(x_padded, w, None, 1, 0, dilation)
        conv_err = float(np.abs(y_local - y_ref[(slice(None), slice(None)) + tuple(slice(*o) for o in outs)]).max())
    else:
        conv_err = 0.0                                          # an empty output block: nothing to compute

    err, conv_err = comm.allreduce(err, op=MPI.MAX), comm.allreduce(conv_err, op=MPI.MAX)
    all_ok = comm.allreduce(int(same_map and same_shape and sent_ok), op=MPI.MIN)
    info = sorted(comm.allgather((grid.spatial_rank, x_local.shape[2:], sorted(
        {grid_rank(m.peer, plan.grid_dims) for a in range(3) for m in plan.recvs(coords, a)}), halo.bytes_sent)))
    say(f"  {name}: {dhw} over spatial grid {grid.spatial_dims}, kernel {kernel}, padding {padding}, "
        f"dilation {dilation}")
    for srank, block, sources, nbytes in info:
        say(f"    rank {srank}: block {block}, receives from ranks {sources}, {nbytes} bytes sent")
    say(f"    padded block == global zero-padded slice on every rank: max |diff| = {err:.1e}; "
        f"local conv vs global conv: max |diff| = {conv_err:.1e}")
    assert all_ok == 1 and err == 0.0 and conv_err <= 1e-12
    if name == "wide halo" and P >= 3:                          # ghosts came from two ranks away
        assert any(abs(src - srank) >= 2 for srank, _, sources, _ in info for src in sources)
    if name == "empty block" and P > 1:                         # the last rank was empty and idle
        srank, block, sources, nbytes = info[-1]
        assert srank == P - 1 and block[2] == 0 and sources == [] and nbytes == 0

for g in grids.values():
    g.free()
say("\nall plans ran on the real ranks: every padded block is exact.")

# %% [markdown]
# ## Summary
#
# | question | formula | refimpl |
# |---|---|---|
# | which block? | start $= \lfloor n/p\rfloor i + \min(i, n \bmod p)$, size $= \lfloor n/p\rfloor + [i < n \bmod p]$ | `block_range`, `block_slices` |
# | which rank? | row-major $(c_d P_h + c_h) P_w + c_w$ | `grid_rank`, `grid_coords` |
# | which inputs? | $[s o_0 - p,\ s(o_1-1) - p + d(k-1)]$, clipped; the clipped part is padding | `needed_input_range` |
# | who sends what? | $\text{owned}[c'] \cap \text{needed}[c]$ for every $c' \ne c$ | `axis_halo_plan`, `conv_halo_plan` |
#
# Next: tutorial 03 builds the exchange itself and its adjoint (the backward pass), and
# tutorial 04 wraps it around a convolution.
