# %% [markdown]
# # Tutorial 9 — Spatially parallel I/O: each rank reads its hyperslab
#
#     mpiexec -n 4 --oversubscribe python tutorials/09_spatial_io.py     (any number of ranks; 1 works too)
#
# Spatial parallelism (tutorials 02–04) splits one sample over a `(Pd, Ph, Pw)` group of ranks
# because the sample is too big for one device. That argument holds for *reading* it too: a
# CosmoFlow universe of $4 \times 512^3$ float32 voxels is
#
# $$4 \cdot 512^3 \cdot 4\ \text{bytes} = 2^{31}\ \text{bytes} = 2\ \text{GiB},$$
#
# so a rank that read the whole sample and then kept its block would move 2 GiB per sample
# through its memory (and its file system link) to keep $1/P_\text{spatial}$ of it. Instead
# (Oyama et al. 2021) each rank asks HDF5 for exactly its block of the sample — a **hyperslab**
# selection — and no rank ever holds the whole sample.
#
# This tutorial:
#
# 1. writes a small CosmoFlow-shaped dataset with `refimpl datagen`'s own code, and looks at the
#    HDF5 layout (datasets, shapes, dtypes, chunks);
# 2. lets every rank read its hyperslab with `HDF5Reader` and checks it against the sample read
#    whole by one process;
# 3. counts the bytes each rank reads: together exactly one sample, each about $1/P_\text{spatial}$;
# 4. looks at what the *disk* sees: HDF5 reads whole chunks, so blocks that cut chunks cost more;
# 5. runs the `Loader` on a grid with a data axis: every rank of a spatial group shuffles with the
#    same seed, so the blocks they read belong to the same sample;
# 6. draws each rank's hyperslab on a slice of the sample.

# %%
import argparse
import math
import os
import shutil
import tempfile

import h5py
import matplotlib.pyplot as plt
import numpy as np
from mpi4py import MPI

from refimpl.commands import datagen
from refimpl.data.cosmo import generate_universe
from refimpl.data.layout import DATA_KEY, TARGET_KEY, chunk_shape
from refimpl.data.loader import Loader
from refimpl.data.reader import HDF5Reader, block_slices
from refimpl.parallel.grid import ProcessGrid

comm = MPI.COMM_WORLD
rank, P = comm.Get_rank(), comm.Get_size()
say = print if rank == 0 else (lambda *a, **k: None)


def agree(ok: bool, what: str) -> None:
    """Assert ``ok`` on every rank at once: all pass or all fail, so no rank hangs."""
    assert comm.allreduce(bool(ok), op=MPI.LAND), what


def rng_text(s: slice) -> str:
    return f"{s.start}:{s.stop}"


# %% [markdown]
# ## 1. The data format, and a small dataset
#
# `refimpl datagen cosmoflow` writes one HDF5 file per split (`docs/data.md`), with dataset
# names from LBANN's CosmoFlow reader:
#
# | dataset   | shape              | dtype   | chunks                                  |
# |-----------|--------------------|---------|-----------------------------------------|
# | `full`    | (N, C, D, H, W)    | float32 | (1, C, e, e, e), e = `--chunk`          |
# | `unitPar` | (N, 4)             | float32 | (1, 4)                                  |
#
# `full` holds particle counts at C = 4 redshifts (channel first), `unitPar` the 4 cosmological
# parameters mapped to $[-1, 1]$. A **chunk** is the unit HDF5 stores (and reads) contiguously:
# one sample, all channels, a cube of $e^3$ voxels. Sample $i$ is drawn from
# `default_rng(seed + i)` alone, so any sample can be regenerated on its own.
#
# We call the very function behind the command line (`refimpl.commands.datagen.generate`, which
# runs `cosmo.generate_universe` through `layout.write_split`) with a small size: 8 samples of
# $4 \times 32^3$ (512 KiB each), chunk edge $e = 8$. **Rank 0 writes**; a temporary directory in
# the current directory (a file system every rank can see, unlike a node-local `/tmp` on a cluster)
# holds it, and its path is **broadcast** so all ranks open the same file. Rank 0's error, if any,
# is broadcast too, so no rank waits forever for a file that will never come.

# %%
N, C, S, EDGE, SEED = 8, 4, 32, 8, 7
argv = ["cosmoflow", "--out", "OUT", "--samples", str(N), "--val-samples", "0", "--size", str(S),
        "--channels", str(C), "--chunk", str(EDGE), "--seed", str(SEED), "--quiet"]
workdir, error = None, None
if rank == 0:
    workdir = tempfile.mkdtemp(prefix="09_spatial_io_", dir=os.getcwd())
    argv[2] = os.path.join(workdir, "cosmo")
    parser = argparse.ArgumentParser(prog="refimpl datagen")
    datagen.add_arguments(parser)
    try:
        datagen.generate(parser.parse_args(argv))
    except Exception as err:          # reported on every rank below
        error = f"{type(err).__name__}: {err}"
workdir, error = comm.bcast((workdir, error), root=0)
agree(error is None, f"datagen failed on rank 0: {error}")
comm.Barrier()                        # the file is complete (renamed into place) before anyone opens it
path = os.path.join(workdir, "cosmo", "train.h5")
say("refimpl datagen " + " ".join(argv[:2] + ["<tmp>/cosmo"] + argv[3:]))
say(f"wrote {os.path.relpath(path)}: {os.path.getsize(path)} bytes\n")

# %% [markdown]
# Every rank looks at the file with plain h5py: the two datasets, their chunking, the root
# attributes. The chunk shape is `layout.chunk_shape` of one sample. Then one check of the
# determinism rule: sample 5 read from the file equals `generate_universe(5, seed, size)`, bit
# for bit.

# %%
with h5py.File(path, "r") as f:
    full, unit = f[DATA_KEY], f[TARGET_KEY]
    for name in (DATA_KEY, TARGET_KEY):
        d = f[name]
        say(f"  {name:<8} shape {str(d.shape):<22} {str(d.dtype):<8} chunks {d.chunks}")
    attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}
    say("  attributes: " + ", ".join(f"{k}={attrs[k]}" for k in ("format", "version", "generator",
                                                                   "seed", "first_index", "layout")))
    sample_shape = (C, S, S, S)
    ok = (full.shape == (N,) + sample_shape and full.dtype == np.float32
          and full.chunks == (1,) + chunk_shape(sample_shape, EDGE)
          and unit.shape == (N, 4) and unit.dtype == np.float32 and unit.chunks == (1, 4)
          and attrs["format"] == "refimpl-hdf5" and attrs["seed"] == SEED and attrs["layout"] == "single")
    x5, y5 = generate_universe(5, seed=SEED, size=S, channels=C)
    same = np.array_equal(full[5], x5) and np.array_equal(unit[5], y5)
agree(ok, "the file does not have the documented layout")
agree(same, "sample 5 in the file differs from generate_universe(5)")
chunk_bytes = math.prod(chunk_shape(sample_shape, EDGE)) * 4
sample_bytes = math.prod(sample_shape) * 4
say(f"layout as documented; one chunk = {chunk_shape(sample_shape, EDGE)} float32 = {chunk_bytes} bytes, "
    f"one sample = {sample_bytes} bytes = {sample_bytes // chunk_bytes} chunks")
say("sample 5 in the file == generate_universe(5, seed=7, size=32): bit for bit")

# %% [markdown]
# ## 2. Each rank reads its hyperslab
#
# The grid decides the blocks. Here it is spatial only: `(1, P, 1, 1)` (depth split P ways), or
# `(1, 2, 2, 1)` with 4 ranks. The reader uses the **same balanced, row-major map as the compute**:
# extent $n$ over $p$ ranks gives coordinate $i$ the range
#
# $$[\,s_i,\ s_i + \lfloor n/p \rfloor + [i < n \bmod p]\,), \qquad s_i = \lfloor n/p\rfloor\, i + \min(i,\ n \bmod p),$$
#
# per axis (`partition.block_range`); `reader.block_slices(spatial_shape, grid, coords)` returns
# the three slices, and they must be what `ProcessGrid.local_block` gives the layers, or the
# data would land on the wrong rank.
#
# `HDF5Reader(path, spatial_block=block)` then reads, for sample $i$, the hyperslab
# `full[i, :, d0:d1, h0:h1, w0:w1]` straight into an array of the block's shape
# (h5py `read_direct` with a source selection): the rest of the sample never enters the
# process. To check it, every rank also reads the *whole* sample with an unrestricted reader
# and compares its slice — only for the check: in training nobody does that.

# %%
dims = (1, 2, 2, 1) if P == 4 else (1, P, 1, 1)
grid = ProcessGrid(comm, dims)
block = block_slices((S, S, S), grid.spatial_dims, grid.spatial_coords)
assert block == grid.local_block((S, S, S))      # the I/O block is the compute block

s = 5                                            # the sample we look at
with HDF5Reader(path, spatial_block=block) as reader:
    x, y = reader.read(s)                        # x: (C, d, h, w) float32, y: unitPar (4,)
    bytes_read, file_bytes_read = reader.bytes_read, reader.file_bytes_read
with HDF5Reader(path) as whole:                  # one process reading everything: the reference
    x_all, y_all = whole.read(s)
exact = np.array_equal(x, x_all[(slice(None),) + block]) and np.array_equal(y, y_all)
agree(exact, "a rank's hyperslab differs from the slice of the whole sample")

rows = comm.gather((rank, grid.coords, block, x.shape), root=0)
say(f"grid (Pn, Pd, Ph, Pw) = {dims}; sample {s} has shape {sample_shape}")
say(f"{'rank':>4}  {'coords':<13} {'hyperslab it reads':<34} local shape")
for r, coords, b, shape in rows or []:
    slab = f"full[{s}, :, {rng_text(b[0])}, {rng_text(b[1])}, {rng_text(b[2])}]"
    say(f"{r:>4}  {str(coords):<13} {slab:<34} {shape}")
say("every rank's block == the same slice of the sample read whole by one process: exact")

# %% [markdown]
# The blocks **tile** the sample: every voxel belongs to exactly one rank of the spatial group.
# Rank 0 checks it by counting, per voxel, how many blocks contain it.

# %%
if rank == 0:
    count = np.zeros((S, S, S), dtype=np.int64)
    for _, _, b, _ in rows:
        count[b] += 1
    tiles = bool((count == 1).all())
else:
    tiles = None
agree(comm.bcast(tiles, root=0), "the blocks do not tile the sample")
say("the blocks tile the sample: every voxel is read by exactly one rank")

# %% [markdown]
# ## 3. Bytes per rank vs the whole sample
#
# A rank's share is the volume of its block over the volume of the sample,
#
# $$\text{share}_r = \frac{d_r\, h_r\, w_r}{D\,H\,W}, \qquad \sum_r \text{share}_r = 1,$$
#
# the sum being 1 because the blocks tile the sample (each voxel read once over the spatial
# group). With balanced blocks a rank's share lies between $\prod_a \lfloor n_a/p_a\rfloor / \prod_a n_a$
# and $\prod_a \lceil n_a/p_a\rceil / \prod_a n_a$, around $1/P_\text{spatial}$.
#
# The bytes are the array's `nbytes`. The reader counts them too: `bytes_read` is the payload
# of the hyperslabs it took from the file — the block of `full` plus the 16 bytes of `unitPar`
# (every rank of the group reads the targets; they are tiny).

# %%
agree(bytes_read == x.nbytes + y.nbytes, "reader.bytes_read is not the payload of what it read")
table = comm.gather((rank, block, x.nbytes), root=0)
Ps = math.prod(grid.spatial_dims)
lo = math.prod(n // p for n, p in zip((S, S, S), grid.spatial_dims)) / S ** 3
hi = math.prod(-(-n // p) for n, p in zip((S, S, S), grid.spatial_dims)) / S ** 3
if rank == 0:
    say(f"{'rank':>4}  {'block (D, H, W)':<22} {'bytes':>8}  share")
    for r, b, nbytes in table:
        say(f"{r:>4}  {' x '.join(rng_text(q) for q in b):<22} {nbytes:>8}  {nbytes / sample_bytes:.5f}")
    total = sum(nbytes for _, _, nbytes in table)
    shares = [nbytes / sample_bytes for _, _, nbytes in table]
    say(f"{'sum':>4}  {'':<22} {total:>8}  {sum(shares):.5f}   (whole sample: {sample_bytes} bytes)")
    ok = total == sample_bytes and abs(sum(shares) - 1) < 1e-12 and all(lo <= q <= hi for q in shares)
else:
    ok = None
agree(comm.bcast(ok, root=0), "the shares do not add up to one sample, or one is unbalanced")
say(f"shares sum to 1; each within [{lo:.5f}, {hi:.5f}] around 1/P_spatial = {1 / Ps:.5f}")

# %% [markdown]
# At full size the point is memory, not just bandwidth. The same count for a 512^3 sample on a
# 64-rank spatial group `(4, 4, 4)`: each rank reads and holds 32 MiB, never the 2 GiB.

# %%
big = 4 * 512 ** 3 * 4
per_rank = 4 * math.prod(b.stop - b.start for b in block_slices(512, (4, 4, 4), (1, 2, 3))) * 4
assert big == 2 * 2 ** 30 and per_rank * 64 == big and per_rank == 32 * 2 ** 20
say(f"4 x 512^3 float32 = {big / 2 ** 30:.0f} GiB; on a (4, 4, 4) spatial group each rank reads "
    f"{per_rank / 2 ** 20:.0f} MiB of it")

# %% [markdown]
# ## 4. What the disk sees: whole chunks
#
# HDF5 stores a chunked dataset chunk by chunk and reads a chunk as a unit (through its chunk
# cache): a hyperslab that touches a chunk pulls the **whole chunk** from disk. Along axis $x$
# a non-empty block $[\alpha_x, \beta_x)$ touches the chunks $\lfloor \alpha_x/e \rfloor, \dots,
# \lceil \beta_x/e \rceil - 1$, so
#
# $$\text{disk bytes}_r \ \ge\ \prod_{x \in \{D,H,W\}} \Big(\Big\lceil \frac{\beta_x}{e} \Big\rceil - \Big\lfloor \frac{\alpha_x}{e} \Big\rfloor\Big) \cdot C e^3 \cdot 4\ \text{bytes}.$$
#
# The reader measures what the library actually pulled (`file_bytes_read`, through a counting
# file object): the touched chunks plus a little metadata (the chunk index, `unitPar`). When every
# block boundary is a multiple of $e$ the chunks are shared out exactly and the group reads
# the sample once; when a boundary cuts a chunk, **both** neighbours read that chunk — e.g. with
# 3 ranks (run it with `-n 3`), $32 = 11 + 11 + 10$ cuts the 8-voxel chunks and the group reads
# 1.5 samples from disk; with 4 ranks on (1, 2, 2, 1) every boundary is a chunk boundary.
# That is why `docs/data.md` says: pick `--chunk` to divide the block sizes you will run with
# (128 over 4 ranks: chunk 32), and why chunks should not be much bigger than a block.

# %%
def chunks_touched(b: tuple, edge: int) -> int:
    """Number of chunks of edge ``edge`` that the block ``b`` (3 slices) intersects."""
    if any(q.stop <= q.start for q in b):
        return 0
    return math.prod(-(-q.stop // edge) - q.start // edge for q in b)


touched = chunks_touched(block, EDGE)
floor_bytes = touched * chunk_bytes
extra = file_bytes_read - floor_bytes
agree(0 <= extra < 64 * 1024, f"rank {rank}: disk bytes {file_bytes_read} vs touched chunks {floor_bytes}")
rows = comm.gather((rank, x.nbytes, touched, floor_bytes, file_bytes_read), root=0)
aligned = all(q.start % EDGE == 0 and (q.stop % EDGE == 0 or q.stop == S) for q in block)
aligned = comm.allreduce(aligned, op=MPI.LAND)
if rank == 0:
    say(f"{'rank':>4} {'payload':>8} {'chunks':>7} {'chunk bytes':>12} {'disk bytes':>11}")
    for r, nbytes, t, fb, db in rows:
        say(f"{r:>4} {nbytes:>8} {t:>7} {fb:>12} {db:>11}")
    chunk_total = sum(row[3] for row in rows)
    disk_total = sum(row[4] for row in rows)
    say(f"{'sum':>4} {sample_bytes:>8} {sum(row[2] for row in rows):>7} {chunk_total:>12} {disk_total:>11}")
    say(f"the group pulled {chunk_total / sample_bytes:.2f} samples' worth of chunks from disk "
        f"({'blocks aligned with chunks' if aligned else 'block boundaries cut chunks'})")
    ok = (chunk_total == sample_bytes) == aligned and chunk_total >= sample_bytes
else:
    ok = None
agree(comm.bcast(ok, root=0), "chunk accounting: aligned blocks must read each chunk exactly once")
say("every rank's disk bytes = the whole chunks its block touches + < 64 KiB of metadata")

# %% [markdown]
# ## 5. The loader: the same samples on every rank of a spatial group
#
# With a data axis the grid is `(Pn, Pd, Ph, Pw)`: data rank $n$ takes its part of each global
# batch, and the $P_d P_h P_w$ ranks sharing $n$ (the `spatial_comm`) must read **the same
# samples**, each its own block — otherwise a halo exchange would stitch together blocks of
# different universes. No message is needed to agree on that: `Loader` draws epoch $e$'s order
# as `default_rng([seed, e]).permutation(N)`, identical on every rank given the same seed, and
# step $t$ takes positions $[tB, (t+1)B)$, of which data rank $n$ of $P_n$ takes its
# `block_range(B, Pn, n)` part. Every rank passes the **same seed**.
#
# The grid here is `(2, P/2, 1, 1)` for an even rank count, else `(1, P, 1, 1)`; global batch
# $B = 4$, so one epoch of 8 samples is 2 steps. Each rank checks that its spatial group
# agrees on the indices, that the data ranks' parts make up the global batch, and that every
# local block is the slice of the right sample.

# %%
Pn = 2 if P % 2 == 0 else 1
grid2 = ProcessGrid(comm, (Pn, P // Pn, 1, 1))
block2 = grid2.local_block((S, S, S))
B, LOADER_SEED = 4, 0
ok, seen = True, []
with HDF5Reader(path, spatial_block=block2) as reader2, HDF5Reader(path) as whole:
    loader = Loader(reader2, global_batch=B, data_rank=grid2.sample_coord, data_size=Pn, seed=LOADER_SEED)
    for batch in loader:                                      # the 2 steps of epoch 0
        group = grid2.spatial_comm.allgather(batch.indices)  # what my spatial partners read
        ok &= all(g == batch.indices for g in group)
        parts = grid2.comm.allgather((grid2.sample_coord, batch.indices))
        joined = [i for n in range(Pn) for i in next(p for c, p in parts if c == n)]
        ok &= joined == [int(i) for i in loader.global_indices(batch.epoch, batch.step)]
        for j, i in enumerate(batch.indices):
            ok &= np.array_equal(batch.x[j], whole.read(i)[0][(slice(None),) + block2])
        seen.append((batch.step, batch.indices))
    bytes2 = reader2.bytes_read
rows = comm.gather((rank, grid2.coords, seen, bytes2), root=0)
agree(ok, "the loader's samples or blocks disagree across a spatial group")
say(f"grid (Pn, Pd, Ph, Pw) = {grid2.dims}, global batch {B}, loader seed {LOADER_SEED}")
say(f"{'rank':>4}  {'coords':<13} {'step 0 samples':<15} {'step 1 samples':<15} bytes read (epoch)")
for r, coords, steps, nb in rows or []:
    say(f"{r:>4}  {str(coords):<13} {str(list(steps[0][1])):<15} {str(list(steps[1][1])):<15} {nb}")
say("ranks with the same n read the same samples; the n parts make up the global batch; "
    "every block is the slice of its sample")

# %% [markdown]
# One rank with a different seed would silently break this: its order differs, so its block
# would belong to another universe than its partners'. (Resuming from a checkpoint has the same
# requirement: every rank restores the same `(epoch, step)` from `loader.state_dict()`.) The
# reader can also keep each local block in memory after its first read (`cache=True`): later
# epochs then do no I/O at all, and the cache holds only this rank's spatial share of the data.

# %%
mine = Loader(reader2, B, grid2.sample_coord, Pn, seed=LOADER_SEED).local_indices(0, 0)
other = Loader(reader2, B, grid2.sample_coord, Pn, seed=LOADER_SEED + 1).local_indices(0, 0)
agree(mine != other, "two seeds happened to give the same first batch")
say(f"data rank 0, step 0: seed {LOADER_SEED} reads samples {list(mine)}; "
    f"a rank given seed {LOADER_SEED + 1} would read {list(other)}")   # rank 0 is data rank 0

# %% [markdown]
# ## 6. A picture: each rank's hyperslab on a slice of the sample
#
# A depth x height slice (at the middle of W) of channel 0 of sample 5, $\log(1 + \text{counts})$,
# assembled on rank 0 from the pieces of that slice each rank read in section 2 — no rank read the
# whole sample for it. Solid outlines: each rank's hyperslab with its payload (and, in brackets,
# the bytes HDF5 pulled from disk for it); dashed lines: the chunk boundaries (every 8 voxels).
# Right: payload vs bytes from disk per rank.

# %%
w_mid = S // 2
piece = x[0, :, :, w_mid - block[2].start] if block[2].start <= w_mid < block[2].stop else None
pieces = comm.gather((rank, block, piece, x.nbytes, file_bytes_read), root=0)
if rank == 0:
    image = np.full((S, S), np.nan)
    for r, b, pc, _, _ in pieces:
        if pc is not None:
            image[b[0], b[1]] = pc
    ok = np.array_equal(image, x_all[0, :, :, w_mid])       # assembled == the reference slice
else:
    ok = None
agree(comm.bcast(ok, root=0), "the assembled slice differs from the sample")

if rank == 0:
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.8), gridspec_kw={"width_ratios": [1.2, 1]})
    ax.imshow(np.log1p(image), origin="lower", cmap="magma", extent=(0, S, 0, S))
    for e in range(EDGE, S, EDGE):
        ax.axhline(e, color="c", lw=1.0, ls="--", alpha=0.9)
        ax.axvline(e, color="c", lw=1.0, ls="--", alpha=0.9)
    colours = plt.get_cmap("tab10").colors
    for r, b, pc, nbytes, disk in pieces:
        if pc is None:
            continue
        (d0, d1), (h0, h1) = (b[0].start, b[0].stop), (b[1].start, b[1].stop)
        ax.add_patch(plt.Rectangle((h0 + 0.3, d0 + 0.3), h1 - h0 - 0.6, d1 - d0 - 0.6, fill=False,
                                   ec=colours[r % 10], lw=2.5))
        ax.text((h0 + h1) / 2, (d0 + d1) / 2, f"rank {r}\n{nbytes} B\n(disk {disk} B)",
                ha="center", va="center", fontsize=9, color="k",
                bbox=dict(fc="w", ec=colours[r % 10], alpha=0.85))
    ax.set_xlabel("H")
    ax.set_ylabel("D")
    ax.set_title(f"sample {s}, channel 0, W = {w_mid}: log(1 + counts)\n"
                 f"grid {dims}; whole sample {sample_bytes} B")
    ranks = [p[0] for p in pieces]
    bx.bar(np.array(ranks) - 0.2, [p[3] / 1024 for p in pieces], 0.4, label="payload (its block)",
           color=[colours[r % 10] for r in ranks])
    bx.bar(np.array(ranks) + 0.2, [p[4] / 1024 for p in pieces], 0.4, label="from disk (whole chunks)",
           color="0.6")
    bx.axhline(sample_bytes / 1024 / Ps, color="k", ls="--", lw=1, label="sample / $P_\\mathrm{spatial}$")
    bx.set_xticks(ranks)
    bx.set_xlabel("rank")
    bx.set_ylabel("KiB read for one sample")
    bx.set_ylim(0, 1.45 * max(p[4] for p in pieces) / 1024)
    bx.legend(loc="upper left", fontsize=8)
    bx.set_title("bytes per rank")
    fig.tight_layout()
    fig.savefig("09_spatial_io.png", dpi=90)
    plt.close(fig)
    say("saved 09_spatial_io.png")

# %% [markdown]
# ## 7. Clean up
# Every reader is closed; after a barrier (nobody is still reading) rank 0 removes the
# temporary directory.

# %%
grid2.free()
grid.free()
comm.Barrier()
if rank == 0:
    shutil.rmtree(workdir)
gone = comm.bcast(not os.path.exists(workdir) if rank == 0 else None, root=0)
agree(gone, f"{workdir} was not removed")
say(f"removed {os.path.basename(workdir)}/")

# %% [markdown]
# In training the same pieces run inside `refimpl train`: `HDF5Reader(path, spatial_block=
# grid.local_block(...), cache=True, log1p=True)` under a `Loader(reader, B, data_rank=n,
# data_size=Pn, seed=...)`. `docs/data.md` documents the layout (including LBANN's one-file-per-
# sample variant, `--layout per-sample`, which the reader reads the same way), and
# `tests/mpi/test_reader.py` checks the reassembly for every grid arrangement of the world.
