"""Winograd F(4x4x4, 3x3x3): 3x3x3 stride-1 convolution with 8x fewer multiplications
(and F(4x4x4, 2x2x2) for 2x2x2 kernels, 4.1x fewer: "Kernel 2" below).

Why: on the small per-rank blocks of spatial parallelism, im2col + GEMM spends
27 multiply-adds per output and channel pair; PyTorch's oneDNN runs its direct
convolution faster than numpy's GEMM can do those multiplications.  Winograd's
minimal filtering algorithm computes 4 outputs of a 3-tap correlation from 6
inputs with 6 multiplications instead of 12; nested over three axes, a 4x4x4
block of outputs costs 6^3 = 216 products per channel pair instead of
27 * 64 = 1728.  The products of all tiles and channels become 216 independent
GEMMs (one per point of the 6x6x6 transform grid), batched in one ``matmul``;
the transforms around them are memory-bound passes.

The 1-D algorithm F(4, 3) (Lavin & Gray, "Fast Algorithms for Convolutional
Neural Networks", CVPR 2016; Winograd 1980).  The correlation
``y[i] = sum_t g[t] d[i + t]`` (i = 0..3, t = 0..2, d of length 6) is the
coefficient extraction of the polynomial product ``g(X) d~(X)`` evaluated at
the points 0, 1, -1, 2, -2 and infinity; with the Toom-Cook/CRT construction
it reads

    y = A^T [ (G g) * (B^T d) ]          (* elementwise, 6 products)

    B^T = [[4, 0,-5, 0, 1, 0],       G = [[ 1/4,    0,    0],     A^T = [[1, 1, 1, 1, 1, 0],
           [0,-4,-4, 1, 1, 0],            [-1/6, -1/6, -1/6],            [0, 1,-1, 2,-2, 0],
           [0, 4,-4,-1, 1, 0],            [-1/6,  1/6, -1/6],            [0, 1, 1, 4, 4, 0],
           [0,-2,-1, 2, 1, 0],            [1/24, 1/12,  1/6],            [0, 1,-1, 8,-8, 1]]
           [0, 2,-1,-2, 1, 0],            [1/24,-1/12,  1/6],
           [0, 4, 0,-5, 0, 1]]            [   0,    0,    1]]

(row j of ``G g`` is g(X) at point j, up to the scale 1/(prod of point
differences) that ``B^T`` and ``A^T`` absorb; the last row/column is the point
at infinity: the leading coefficient).  ``test_winograd.py`` checks the identity
exactly in float64 for random g, d.  In 3-D the transforms are Kronecker
products, applied one axis after the other:

    V = (B^T (x) B^T (x) B^T) d      input tile, 6x6x6, overlapping tiles at stride 4
    U = (G (x) G (x) G) w            per (filter, channel), 6x6x6
    M[xi] = V[xi] (T, C) @ U[xi] (C, F)        for each of the 216 points xi
    y = (A^T (x) A^T (x) A^T) M      output tile, 4x4x4

Backward = the adjoints of these linear maps, in reverse:
``dM = (A (x) A (x) A) dY``; ``dU[xi] = V[xi]^T @ dM[xi]`` summed over tiles,
``dw = (G^T (x) G^T (x) G^T) dU``; ``dV[xi] = dM[xi] @ U[xi]^T``,
``dx = overlap-add of (B (x) B (x) B) dV`` (the adjoint of cutting
overlapping tiles is adding them back where they overlap).

Error (float32): the transforms are not orthogonal (entries up to 8 in A^T
and 5 in B^T, 1/24 in G), so rounding errors grow by a constant factor over
the direct sum.  The ratio max |y - y_exact| / max_o sum_{c,t} |w x| measured by
``python scripts/bench_winograd_error.py`` (docs/benchmarks.md, "Winograd's float32 error")
is 10-100x the direct sum's, about 1e-4 of a typical output (outputs are ~sqrt(27 C) times
smaller than that scale).  The documented bound, which the tests and the script check, is
``FLOAT32_BOUND`` = 3e-5 of that scale.  In float64 the algorithm is exact to
~1e-15 relative (tests: <= 1e-10 vs PyTorch); ``algorithm="im2col"`` (or
``REFIMPL_CONV_ALGORITHM=im2col``) gives the plain sum where that matters.

Kernel 2: MLPerf's CosmoFlow convolves with 2x2x2 kernels ('same' padding: none before, one
zero after).  The same construction with r = 2 and the points 0, 1, -1, 2 and infinity gives
F(4, 2): 4 outputs from a 5-wide tile with 5 products instead of 8,

    B^T = [[2,-1,-2, 1, 0],       G = [[1/2,    0],        A^T = [[1, 1, 1, 1, 0],
           [0, 2, 1,-1, 0],            [1/2,  1/2],               [0, 1,-1, 2, 0],
           [0,-2, 3,-1, 0],            [1/6, -1/6],               [0, 1, 1, 4, 0],
           [0,-1, 0, 1, 0],            [1/6,  1/3],               [0, 1,-1, 8, 1]]
           [0, 2,-1,-2, 1]]            [  0,    1]]

(the rows of B^T scaled to integers, G's by the inverse), so in 3-D 125 products per 4x4x4
tile where im2col spends 8 x 64 = 512.  Everything below reads alpha = 4 + r - 1 (6 or 5) and r
off the matrices' shapes (``matrices``); the tiles still advance by 4, so 5-wide input tiles
overlap by 1 and the overlap-add's boxes are {0..3, 4}^3.  Of the four point sets 0, 1, -1 and
one of 2, 1/2, -2, -1/2, this one had the smallest float32 error (3.3e-6 of the scale below,
against 3.9-4.1e-6; im2col's is 1.4e-7), well within ``FLOAT32_BOUND``.  Which convs take it:
``routes.worthwhile`` with ``r=2`` (its own bars, ``routes.KERNEL_2_*``).

Padding: ``padding`` is the zeros before the input along each axis; those after it are read
from the zero buffer the tiles are cut from, as far as ``out_spatial`` reaches, so an
asymmetric padding (a per-side one, or 'same' with an even kernel) costs nothing extra here.

Layout: the input is copied once to channels-last ``(N, D', H', W', C)``
(zero-padded to ``4*tiles + 2`` per axis), then every tile is cut out with one
strided copy into ``(6, 6, 6, T, C)`` (T = tiles, C contiguous).  In that
layout each axis of the transform is one GEMM over the leading axes:
``B^T (6x6) @ (6, rest)`` batched over the axes before it (1, 6 and 36
calls; on the host each cut into GEMMs of ``TRANSFORM_COLUMNS`` columns), i.e. a
memory-bound pass with no reshuffling.  The output goes the
other way: ``(216, T, F)`` -> ``(4, 4, 4, T, F)`` -> channels-last -> NCDHW.

Memory: the tiles are processed in chunks of whole samples, else of depth
rows of tiles of one sample, so that the three work buffers of
``216 * T * max(C, F)`` elements stay within ``max_temp_bytes`` (the same
bound as im2col; at least one row of tiles).  Besides those the functions
allocate channels-last copies of their inputs and outputs (x and y; dy, x and dx:
each the size of the array, padded to whole tiles) and the transformed weights
``216 * C * F`` (and its gradient in the backward, never both at once, see ``backward``);
deep layers of few tiles (``by_channel_blocks``) hold instead ``V`` and ``dM`` of all tiles
(no bigger than those) and one channel block's share per worker.  The chunks run on the
worker threads of ``_threads``, the budget shared among them.
"""
from __future__ import annotations

from itertools import product

import numpy

from ..backend import array_module
from . import _im2col, _threads
from .routes import WINOGRAD_TILE, winograd_tiles

#: Documented bound on max|y - y_exact| / max_o sum|w x| in float32 (measured <= 7.5e-6).
FLOAT32_BOUND = 3e-5

# F(4, 3), points 0, 1, -1, 2, -2, inf (see the module docstring)
_BT = numpy.array([[4, 0, -5, 0, 1, 0],
                   [0, -4, -4, 1, 1, 0],
                   [0, 4, -4, -1, 1, 0],
                   [0, -2, -1, 2, 1, 0],
                   [0, 2, -1, -2, 1, 0],
                   [0, 4, 0, -5, 0, 1]], dtype=numpy.float64)
_G = numpy.array([[1 / 4, 0, 0],
                  [-1 / 6, -1 / 6, -1 / 6],
                  [-1 / 6, 1 / 6, -1 / 6],
                  [1 / 24, 1 / 12, 1 / 6],
                  [1 / 24, -1 / 12, 1 / 6],
                  [0, 0, 1]], dtype=numpy.float64)
_AT = numpy.array([[1, 1, 1, 1, 1, 0],
                   [0, 1, -1, 2, -2, 0],
                   [0, 1, 1, 4, 4, 0],
                   [0, 1, -1, 8, -8, 1]], dtype=numpy.float64)

# F(4, 2), points 0, 1, -1, 2, inf (see "Kernel 2" in the module docstring)
_BT2 = numpy.array([[2, -1, -2, 1, 0],
                    [0, 2, 1, -1, 0],
                    [0, -2, 3, -1, 0],
                    [0, -1, 0, 1, 0],
                    [0, 2, -1, -2, 1]], dtype=numpy.float64)
_G2 = numpy.array([[1 / 2, 0],
                   [1 / 2, 1 / 2],
                   [1 / 6, -1 / 6],
                   [1 / 6, 1 / 3],
                   [0, 1]], dtype=numpy.float64)
_AT2 = numpy.array([[1, 1, 1, 1, 0],
                    [0, 1, -1, 2, 0],
                    [0, 1, 1, 4, 0],
                    [0, 1, -1, 8, 1]], dtype=numpy.float64)

#: ``(B^T, G, A^T)`` of F(4, r) by kernel extent r.
SCHEMES = {3: (_BT, _G, _AT), 2: (_BT2, _G2, _AT2)}

M_OUT = WINOGRAD_TILE                      # outputs per tile and axis, m = 4 in both schemes


def matrices(xp, dtype, r=3):
    """``(B^T, G, A^T)`` of F(4, r) as ``xp`` arrays of ``dtype``: B^T is alpha x alpha
    (alpha = 4 + r - 1, the input tile's extent), G alpha x r, A^T 4 x alpha.  Every function
    below reads alpha and r off these shapes."""
    return tuple(xp.asarray(m, dtype=dtype) for m in SCHEMES[r])


# ------------------------------------------------------------------- separable transforms

def _transform(mat, src, dst, rest):
    """Apply ``mat`` (r x s) to each of the three leading axes of the (s, s, s, rest)
    array at the start of the flat work buffer ``src``.

    One GEMM per axis (``_column_blocked_matmul``): axis 0 is ``mat @ src.reshape(s, -1)``;
    axis 1 the same batched over axis 0; axis 2 batched over axes 0 and 1.  ``src`` and ``dst``
    are used in turn (dst, src, dst: each must hold the stage outputs it receives,
    ``src`` also the input), so the result, (r, r, r, rest), ends at the start of
    ``dst``: returned as that exact-size flat view.
    """
    xp = array_module(src)
    r, s = mat.shape
    a = src[:s ** 3 * rest]
    bufs = (dst, src)
    for axis in range(3):
        lead = r ** axis                             # axes already transformed
        out = bufs[axis % 2][:lead * r * s ** (2 - axis) * rest]
        _column_blocked_matmul(mat, a.reshape(lead, s, -1), out.reshape(lead, r, -1))
        a = out
    return a


#: Columns per GEMM of a transform pass on the host (measured: docs/benchmarks.md, "Kernel choices").
TRANSFORM_COLUMNS = 4096


def _column_blocked_matmul(mat, a, out):
    """``out[i] = mat @ a[i]`` for ``a`` (lead, s, n), ``out`` (lead, r, n), C-contiguous.

    Why: OpenBLAS runs ``mat`` (6 x 6) against a long ``(6, n)`` operand almost 2x slower
    than against the same columns cut into blocks of ``TRANSFORM_COLUMNS`` (a 1.8 MB pass:
    233 us in one call, 128 us in blocks, a plain copy 110 us); the blocks are one batched
    ``matmul`` over strided views ``(lead, n // cols, s, cols)``, the leftover columns one more
    call.  Each output element is the same dot product of a row of ``mat`` with a column of
    ``a`` whichever way the columns are cut.  On a device: one call."""
    xp = array_module(a)
    lead, s, n = a.shape
    r = mat.shape[0]
    cols = TRANSFORM_COLUMNS
    blocks = n // cols if xp is numpy else 0
    if blocks > 1:
        def view(arr, rows):
            sl, sr, sc = arr.strides
            return numpy.lib.stride_tricks.as_strided(arr, (lead, blocks, rows, cols), (sl, cols * sc, sr, sc))
        numpy.matmul(mat, view(a, s), out=view(out, r))
        done = blocks * cols
    else:
        done = 0
    if done < n:
        xp.matmul(mat, a[:, :, done:], out=out[:, :, done:])


def _weight_transform(g, w):
    """``U = (G (x) G (x) G) w`` as (216, C, F): the GEMM operand ``U[xi]`` is (C, F)
    (alpha^3 = 216 for F(4, 3), 125 for F(4, 2))."""
    xp = array_module(w)
    f, c = w.shape[:2]
    alpha, r = g.shape
    taps = xp.ascontiguousarray(w.transpose(2, 3, 4, 1, 0)).reshape(-1)    # (3, 3, 3, C, F)
    out = xp.empty(alpha ** 3 * c * f, dtype=w.dtype)
    work = xp.empty(alpha ** 2 * r * c * f, dtype=w.dtype)   # the taps, then (6, 6, 3, C, F)
    work[:taps.size] = taps
    return _transform(g, work, out, c * f).reshape(alpha ** 3, c, f)


def _weight_transform_adjoint(g, dut):
    """``dw = (G^T (x) G^T (x) G^T) dU``, from ``dU^T`` (216, F, C) to (F, C, 3, 3, 3)."""
    xp = array_module(dut)
    f, c = dut.shape[1:]
    alpha, r = g.shape
    work = xp.empty(alpha ** 2 * r * c * f, dtype=dut.dtype)   # (3, 6, 6, F, C), then (3, 3, 3, F, C)
    d = _transform(g.T, xp.ascontiguousarray(dut).reshape(-1), work, c * f)
    return xp.ascontiguousarray(d.reshape(r, r, r, f, c).transpose(3, 4, 0, 1, 2))


# ---------------------------------------------------------------------- tiles and chunks

#: Preferred bytes of the work buffers of one chunk: passes over cache-resident
#: chunks run up to 2x faster than over big ones (docs/benchmarks.md, "Kernel choices") ...
TARGET_CHUNK_BYTES = 4 * 2**20
#: ... but at least this many tiles per chunk (the rows of the 216 GEMMs).
MIN_CHUNK_TILES = 128


def chunks(n_batch, tiles, per_tile_bytes, budget, workers=1):
    """Cut the ``N x td`` rows of tiles into chunks ``(n0, n1, d0, d1)`` of about
    ``TARGET_CHUNK_BYTES`` of work buffers (but ``MIN_CHUNK_TILES`` tiles, and
    within ``budget``): whole samples while they fit, else depth ranges of one
    sample (at least one row of tiles).  With several ``workers``, no more tiles per
    chunk than gives each worker a chunk (a deep layer of few tiles: the workers, whose
    BLAS runs on one thread, share its GEMMs)."""
    td, th, tw = tiles
    want = max(MIN_CHUNK_TILES, TARGET_CHUNK_BYTES // per_tile_bytes)
    fit = max(1, min(want, budget // per_tile_bytes))            # tiles per chunk
    sample = td * th * tw
    fit = max(1, min(fit, -(-n_batch * sample // max(1, workers))))
    if sample <= fit:
        nb = min(n_batch, fit // sample)
        return [(n0, min(n0 + nb, n_batch), 0, td) for n0 in range(0, n_batch, nb)]
    rows = max(1, fit // (th * tw))
    return [(n, n + 1, d0, min(d0 + rows, td)) for n in range(n_batch) for d0 in range(0, td, rows)]


def overlap_waves(chunk_list):
    """The chunks in waves whose members add into disjoint parts of ``dx``: a chunk's 6-wide
    input tiles overlap only the next and the previous depth range of the *same* sample, so
    the chunks at even positions within their sample form one wave and those at odd
    positions the other; chunks of whole samples all run in one wave (a deep layer of few
    tiles: both workers busy instead of one)."""
    position, waves = {}, ([], [])
    for ch in chunk_list:
        i = position[ch[:2]] = position.get(ch[:2], -1) + 1
        waves[i % 2].append(ch)
    return [w for w in waves if w]


def _tile_view(xp, buf, chunk, tiles, extent, offset=(0, 0, 0)):
    """The chunk's tiles of the channels-last buffer ``buf`` (N, D', H', W', C), as a
    strided view (extent, extent, extent, nb, tdc, th, tw, C): element
    ``[a, b, c, n, i, j, k, ch] = buf[n0 + n, 4(d0 + i) + a + o_d, 4j + b + o_h, 4k + c + o_w, ch]``.
    ``extent`` is 6 for input tiles, 4 for output tiles; tiles overlap when 6."""
    n0, n1, d0, d1 = chunk
    sn, sd, sh, sw, sc = buf.strides
    base = buf[n0:, M_OUT * d0 + offset[0]:, offset[1]:, offset[2]:]
    ext = extent if isinstance(extent, tuple) else (extent,) * 3
    shape = ext + (n1 - n0, d1 - d0, tiles[1], tiles[2], buf.shape[4])
    strides = (sd, sh, sw, sn, M_OUT * sd, M_OUT * sh, M_OUT * sw, sc)
    return xp.lib.stride_tricks.as_strided(base, shape=shape, strides=strides)


def _padded_channels_last(x, pad, tiles, extra, workers):
    """Zero buffer (N, 4*td + extra, 4*th + extra, 4*tw + extra, C) with ``x`` at offset ``pad``."""
    xp = array_module(x)
    n, c = x.shape[:2]
    shape = (n,) + tuple(M_OUT * t + extra for t in tiles) + (c,)
    buf = xp.zeros(shape, dtype=x.dtype)
    box = tuple(slice(p, p + e) for p, e in zip(pad, x.shape[2:]))
    to_channels_last(buf[(slice(None),) + box], x, workers)
    return buf


#: Channels per piece of the NCDHW -> channels-last copy (``to_channels_last``) ...
CHANNELS_LAST_GROUP = 16
#: ... where a plane has at least this many positions (below, the pieces' calls cost more).
CHANNELS_LAST_MIN_PLANE = 256


def to_channels_last(dst, x, workers=1):
    """``dst[...] = x.transpose(0, 2, 3, 4, 1)``: ``x`` (N, C, D, H, W) into the channels-last
    view ``dst`` (N, D, H, W, C), plane by plane (n, d) on the workers, in pieces of
    ``CHANNELS_LAST_GROUP`` channels (more than that: in one piece).

    Why the pieces: the copy's inner loop runs along C (``dst``'s contiguous axis), reading one
    element from each channel's plane; the planes are D*H*W*itemsize apart, a power of two for
    the usual extents, so the C source lines in flight fall in the same cache set and evict each
    other as soon as C exceeds the cache's ways.  Sixteen channels at a time: 4 x 32 x 32^3 in
    2.6 ms instead of 4.6, 4 x 64 x 32^3 7.8 instead of 14.1 (2 workers; docs/benchmarks.md,
    "Kernel choices")."""
    xp = array_module(x)
    n, c, d = x.shape[:3]
    src = x.transpose(0, 2, 3, 4, 1)
    group = CHANNELS_LAST_GROUP
    if xp is not numpy or c <= group or x.shape[3] * x.shape[4] < CHANNELS_LAST_MIN_PLANE:
        _threads.copy(dst, src, workers)
        return

    def plane(_, ij):
        i, j = ij
        for c0 in range(0, c, group):
            dst[i, j, :, :, c0:c0 + group] = src[i, j, :, :, c0:c0 + group]
    _threads.run(plane, [(i, j) for i in range(n) for j in range(d)], workers)


#: Elements per block of the channels-last -> NCDHW transpose (cache-sized; measured best).
TRANSPOSE_BLOCK = 8192


def to_ncdhw(src, workers=1, bias=None):
    """``src`` (N, D, H, W, C), any strides, as a new C-ordered (N, C, D, H, W) array,
    plus ``bias`` (C,) per channel when given (in the same pass).

    A plain ``ascontiguousarray(src.transpose(0, 4, 1, 2, 3))`` reads ``src`` with
    stride C in its inner loop and runs 4-6x slower than a copy; copying blocks of
    rows whose ``(rows, W, C)`` slab is cache-sized brings it to copy speed.
    """
    xp = array_module(src)
    n, d, h, w, c = src.shape
    out = xp.empty((n, c, d, h, w), dtype=src.dtype)
    rows = max(1, TRANSPOSE_BLOCK // max(1, w * c))

    b = None if bias is None else bias.reshape(c, 1, 1)

    def plane(_, ij):
        i, j = ij
        for h0 in range(0, h, rows):
            block = src[i, j, h0:h0 + rows].transpose(2, 0, 1)       # (C, rows, W)
            if b is None:
                out[i, :, j, h0:h0 + rows] = block
            else:
                xp.add(block, b, out=out[i, :, j, h0:h0 + rows])
    _threads.run(plane, [(i, j) for i in range(n) for j in range(d)], workers)
    return out


class _Plan:
    """Chunks, worker threads, and each worker's three flat work buffers
    (alpha^3 * tiles * max(C, F) elements each); the budget is shared by the workers."""

    def __init__(self, xp, dtype, n_batch, tiles, width, budget, alpha):
        per_tile = alpha ** 3 * width * numpy.dtype(dtype).itemsize * 3
        workers = _threads.thread_count(xp)
        self.chunks = chunks(n_batch, tiles, per_tile, max(1, budget // workers), workers)
        self.workers = min(workers, len(self.chunks))
        size = alpha ** 3 * max(_n_tiles(ch, tiles) for ch in self.chunks) * width
        self.bufs = [[xp.empty(size, dtype=dtype) for _ in range(3)] for _ in range(self.workers)]


def _n_tiles(chunk, tiles):
    return (chunk[1] - chunk[0]) * (chunk[3] - chunk[2]) * tiles[1] * tiles[2]


def _input_tiles(xcl, chunk, tiles, bt, bufs, c):
    """``V`` (216, T, C) of the chunk: cut the 6^3 tiles, then ``B^T`` on each axis;
    ``bufs[0]`` takes the tiles, the result ends in ``bufs[1]``."""
    xp = array_module(xcl)
    t = _n_tiles(chunk, tiles)
    alpha = bt.shape[0]
    g = bufs[0][:alpha ** 3 * t * c]
    view = _tile_view(xp, xcl, chunk, tiles, alpha)                  # (6, 6, 6, nb, tdc, th, tw, C)
    g.reshape(view.shape)[...] = view
    return _transform(bt, bufs[0], bufs[1], t * c).reshape(alpha ** 3, t, c)


def _output_grad_tiles(dycl, chunk, tiles, at, bufs, f):
    """``dM = (A (x) A (x) A) dY`` (216, T, F) of the chunk: cut its 4^3 tiles of ``dy``, then
    ``A`` on each axis; ``bufs[0]`` takes the tiles, the result ends in ``bufs[1]``."""
    xp = array_module(dycl)
    t = _n_tiles(chunk, tiles)
    view = _tile_view(xp, dycl, chunk, tiles, M_OUT)                  # (4, 4, 4, nb, tdc, th, tw, F)
    bufs[0][:M_OUT ** 3 * t * f].reshape(view.shape)[...] = view
    return _transform(at.T, bufs[0], bufs[1], t * f).reshape(at.shape[1] ** 3, t, f)


def _overlap_add(dxcl, dg, chunk, tiles, alpha):
    """``dxcl += `` the chunk's 6-wide tiles ``dg`` (6, 6, 6, T, C): they overlap by 2 at
    stride 4, so the adds go in the 8 boxes {0..3, 4..5}^3 of tile offsets, within each of
    which no two tiles touch the same voxel (F(4, 2): 5-wide tiles, boxes {0..3, 4}^3)."""
    xp = array_module(dxcl)
    dg = dg.reshape((alpha,) * 3 + _tile_view(xp, dxcl, chunk, tiles, alpha).shape[3:])
    for box in overlap_boxes(alpha):
        offset = tuple(sl.start for sl in box)
        ext = tuple(sl.stop - sl.start for sl in box)
        _tile_view(xp, dxcl, chunk, tiles, ext, offset)[...] += dg[box]


# ------------------------------------------------------- deep layers: by channel blocks
#
# A deep layer of few tiles (8^3 blocks of 128-512 channels) is dominated by the weight-sized
# arrays: ``U`` (216 C F, 8x the weight) and, in the backward, ``dU``.  Formed whole they are
# streamed through memory several times (written, read by every chunk's GEMM, summed over the
# workers, transformed back), and the weight transform ran on one thread.  Cut along a channel
# axis instead, every piece of them stays in the cache and the workers share the pieces:
#
#     forward:  per block of filters b:   M_b = V @ U_b,           y[..., b]  = A-transform of M_b
#     dx:       per block of channels b:  dV_b = dM @ U_b^T,       dx[..., b] = overlap-add of the B-adjoint of dV_b
#     dw:       per block of filters b:   dU_b = dM[..., b]^T @ V,  dw[b]      = G-adjoint of dU_b
#
# with ``U_b`` transformed from the block's slice of ``w`` right before its GEMM, and ``V`` (216,
# T, C) and ``dM`` (216, T, F) of *all* tiles formed once (the chunks in parallel): small here,
# since they are taken only where they are no bigger than ``U``.  No block writes where another
# does (disjoint channels), so there is no reduction over workers and no wave order.  The sums
# are the same products in the same order per output: exact in float64, as before.  A block's
# transformed weights are still in cache when its GEMM reads them, so transform and GEMMs
# together cost about what the GEMMs alone did (docs/benchmarks.md, "Kernel choices").

#: Bytes of one channel block's transformed weights (216 x C x block): cache-sized.
CHANNEL_BLOCK_BYTES = 4 * 2**20


#: ... but input-gradient blocks of at least this many channels: their overlap-add into the
#: channels-last ``dx`` runs over ``block`` contiguous elements at a time, and short runs are
#: slow (docs/benchmarks.md, "Kernel choices").
DX_BLOCK_CHANNELS = 32


def by_channel_blocks(n_batch, tiles, c, f):
    """Whether a layer takes the channel-block route: ``V`` and ``dM`` of all tiles (216 T C and
    216 T F) no bigger than the transformed weights ``U`` (216 C F), i.e. ``T <= min(C, F)``:
    a deep layer of few tiles."""
    return n_batch * tiles[0] * tiles[1] * tiles[2] <= min(c, f)


def _blocks(total, other, itemsize, workers, alpha, least=1):
    """Ranges ``(b0, b1)`` of a channel axis of ``total``: about ``CHANNEL_BLOCK_BYTES`` of
    transformed weights each (alpha^3 x ``other`` x block) but ``least`` channels, at least one
    block per worker."""
    size = max(least, CHANNEL_BLOCK_BYTES // (alpha ** 3 * other * itemsize))
    size = max(1, min(size, -(-total // max(1, workers))))
    return [(b0, min(b0 + size, total)) for b0 in range(0, total, size)]


def _all_tiles(plan, tiles, of_chunk, src, mat, width):
    """(216, T, width) of every tile: ``of_chunk(src, chunk, tiles, mat, bufs, width)``
    (``_input_tiles`` or ``_output_grad_tiles``) of each chunk, in its worker's buffers,
    copied to the chunk's range of tiles; the chunks in parallel."""
    xp = array_module(src)
    starts, t0 = [], 0
    for ch in plan.chunks:
        starts.append(t0)
        t0 += _n_tiles(ch, tiles)
    out = xp.empty((mat.shape[1] ** 3, t0, width), dtype=plan.bufs[0][0].dtype)   # (alpha^3, T, width)

    def one(worker, i):
        ch = plan.chunks[i]
        out[:, starts[i]:starts[i] + _n_tiles(ch, tiles)] = of_chunk(src, ch, tiles, mat,
                                                                     plan.bufs[worker], width)
    _threads.run(one, list(range(len(plan.chunks))), plan.workers)
    return out


def _whole(n_batch, tiles):
    """The chunk of every tile."""
    return (0, n_batch, 0, tiles[0])


def _block_buffers(xp, dtype, t, blocks, workers, alpha):
    """Per worker two flat work buffers of alpha^3 x ``t`` x the widest of ``blocks``."""
    size = alpha ** 3 * t * max((b1 - b0 for b0, b1 in blocks), default=1)
    return [[xp.empty(size, dtype=dtype) for _ in range(2)] for _ in range(workers)]


def _forward_by_filter_blocks(xcl, w, ycl, tiles, plan, mats):
    """The forward by blocks of filters into the channels-last ``ycl`` (see above)."""
    xp = array_module(xcl, w)
    bt, g, at = mats
    alpha = bt.shape[0]
    f, c = w.shape[:2]
    n_b = xcl.shape[0]
    v = _all_tiles(plan, tiles, _input_tiles, xcl, bt, c)              # V (216, T, C)
    t = v.shape[1]
    whole = _whole(n_b, tiles)
    blocks = _blocks(f, c, w.dtype.itemsize, plan.workers, alpha)
    workers = min(plan.workers, len(blocks))
    bufs = _block_buffers(xp, w.dtype, t, blocks, workers, alpha)

    def one(worker, block):
        f0, f1 = block
        b0, b1 = bufs[worker]
        ub = _weight_transform(g, w[f0:f1])                             # (216, C, fb)
        xp.matmul(v, ub, out=b0[:alpha ** 3 * t * (f1 - f0)].reshape(alpha ** 3, t, f1 - f0))
        yt = _transform(at, b0, b1, t * (f1 - f0))                      # (4, 4, 4, T, fb)
        view = _tile_view(xp, ycl[..., f0:f1], whole, tiles, M_OUT)
        view[...] = yt.reshape(view.shape)
    _threads.run(one, blocks, workers)


def _backward_by_channel_blocks(dycl, xcl, dxcl, w, tiles, plan, mats):
    """dx (added into the channels-last ``dxcl``, when given) by blocks of input channels and
    dw (returned, when ``xcl`` is given) by blocks of filters (see above)."""
    xp = array_module(dycl, w)
    bt, g, at = mats
    alpha = bt.shape[0]
    f, c = w.shape[:2]
    n_b = dycl.shape[0]

    dm = _all_tiles(plan, tiles, _output_grad_tiles, dycl, at, f)      # dM (216, T, F)
    v = None if xcl is None else _all_tiles(plan, tiles, _input_tiles, xcl, bt, c)   # V (216, T, C)
    t = dm.shape[1]
    whole = _whole(n_b, tiles)
    tasks = []
    if dxcl is not None:
        tasks += [("dx", b) for b in _blocks(c, f, w.dtype.itemsize, plan.workers, alpha, DX_BLOCK_CHANNELS)]
    if v is not None:
        tasks += [("dw", b) for b in _blocks(f, c, w.dtype.itemsize, plan.workers, alpha)]
        dw = xp.empty(w.shape, dtype=w.dtype)
    workers = min(plan.workers, len(tasks))
    bufs = _block_buffers(xp, w.dtype, t, [b for kind, b in tasks if kind == "dx"], workers, alpha)

    def one(worker, task):
        kind, (a0, a1) = task
        b0, b1 = bufs[worker]
        if kind == "dw":
            dut = xp.matmul(dm[:, :, a0:a1].transpose(0, 2, 1), v)         # dU_b^T (216, fb, C)
            dw[a0:a1] = _weight_transform_adjoint(g, dut)
            return
        ub = _weight_transform(g, w[:, a0:a1])                          # (216, cb, F)
        dv = b0[:alpha ** 3 * t * (a1 - a0)].reshape(alpha ** 3, t, a1 - a0)
        xp.matmul(dm, ub.transpose(0, 2, 1), out=dv)                    # dV_b (216, T, cb)
        dg = _transform(bt.T, b0, b1, t * (a1 - a0))                    # (6, 6, 6, T, cb)
        _overlap_add(dxcl[..., a0:a1], dg, whole, tiles, alpha)
    _threads.run(one, tasks, workers)
    return dw if v is not None else None


# ----------------------------------------------------------------------------- the ops

def forward(x, w, padding, out_spatial, budget, bias=None):
    """``y = conv3d(x, w) + bias``, 3x3x3 or 2x2x2, stride 1, dilation 1 (bias may be None).

    ``padding`` is the zeros *before* the input per axis; those after it are whatever
    ``out_spatial`` reads (the tiles' zero buffer holds them), so an asymmetric padding
    ((lo, hi) per axis, 'same' with an even kernel) is its ``lo`` here, with no padded copy."""
    xp = array_module(x, w)
    n_b, c = x.shape[:2]
    f = w.shape[0]
    tiles = winograd_tiles(out_spatial)
    bt, g, at = matrices(xp, x.dtype, w.shape[2])
    alpha = bt.shape[0]
    plan = _Plan(xp, x.dtype, n_b, tiles, max(c, f), budget, alpha)
    xcl = _padded_channels_last(x, padding, tiles, alpha - M_OUT, plan.workers)  # (N, 4td+2, .., C)
    ycl = xp.empty((n_b,) + tuple(M_OUT * t for t in tiles) + (f,), dtype=x.dtype)
    od, oh, ow = out_spatial
    if by_channel_blocks(n_b, tiles, c, f):
        _forward_by_filter_blocks(xcl, w, ycl, tiles, plan, (bt, g, at))
        return to_ncdhw(ycl[:, :od, :oh, :ow], plan.workers, bias)
    u = _weight_transform(g, w)                                      # (216, C, F)

    def one(worker, chunk):
        b0, b1, b2 = plan.bufs[worker]
        t = _n_tiles(chunk, tiles)
        v = _input_tiles(xcl, chunk, tiles, bt, (b0, b1), c)          # (216, T, C) in b1
        xp.matmul(v, u, out=b2[:alpha ** 3 * t * f].reshape(alpha ** 3, t, f))   # M (216, T, F)
        yt = _transform(at, b2, b0, t * f)                            # (4, 4, 4, T, F) in b0
        view = _tile_view(xp, ycl, chunk, tiles, M_OUT)
        view[...] = yt.reshape(view.shape)
    _threads.run(one, plan.chunks, plan.workers)
    return to_ncdhw(ycl[:, :od, :oh, :ow], plan.workers, bias)


def dx_by_flipped_kernel(c, f, padding, need_dw, in_spatial, out_spatial, r=3):
    """Whether ``backward`` takes ``dx`` as Winograd's *forward* conv of ``dy`` with the flipped,
    transposed kernel ``W'[c, f, u] = W[f, c, r - 1 - u]`` and padding ``r - 1 - p`` (the identity
    of ``_im2col.input_grad_by_flipped_kernel``; a padding above r - 1, before or after the input
    (``padding`` holds both sides where they differ), would need a negative one),
    only where that forward has no more tiles (of the input's extent) than the adjoint (of the
    output's): a layer fed a halo-padded block (padding 0, 18^3 in, 16^3 out) would need 5^3
    tiles instead of 4^3, and ran slower (docs/benchmarks.md, "Kernel choices").

    Why: the adjoint route cuts 4^3 tiles of ``dy`` (F channels), expands them to 6^3 (``A``),
    and after the GEMM transforms 6^3 points of C channels (``B``) and adds them into ``dx``
    where tiles overlap (a read-modify-write of 216 values per tile and channel).  The forward
    route cuts 6^3 tiles of ``dy`` (F), transforms them (``B^T``) and after the GEMM reduces C
    channels from 6^3 to 4^3 points (``A^T``) and writes them once.  So the forward route moves
    about 2F + C/2 values per tile point where the adjoint moves F + 3C: it wins for F below
    about 2.5C.  But with ``dw`` wanted too the adjoint's ``dM`` (its cut and ``A``) serves both
    gradients, and the forward route must make ``dM`` for ``dw`` alone: it then pays only up to
    F = C (below, it wins; at F = C it is about even).  Measured: docs/benchmarks.md, "Kernel
    choices"."""
    if any(p > r - 1 for p in padding) or winograd_tiles(in_spatial) != winograd_tiles(out_spatial):
        return False
    return f <= c if need_dw else f <= 2 * c


def backward(dy, x, w, padding, budget, need_dx=True, need_dw=True):
    """``(dx, dw)`` of ``y = conv3d(x, w)`` (3x3x3, stride 1, dilation 1), from ``dy``.

    ``dx`` by the forward conv with the flipped kernel where ``dx_by_flipped_kernel`` says so
    (then ``dw`` alone, below).

    ``dM = (A (x) A (x) A) dY`` is formed once per chunk and shared: ``dU += V^T dM``
    (``V`` recomputed from ``x``) and ``dV = dM U^T`` (added back into ``dx``).
    Chunks next to each other along depth add into two shared planes of ``dx``, so
    they never run at the same time: the even chunks first, then the odd ones.

    Deep layers (few tiles, many channels) are dominated by the weight-sized arrays
    ``U`` and ``dU`` (216 C F each, 8x the weight): there the chunks run twice, dx
    first, ``U`` is freed, then dw (recomputing ``dM``), so the two never coexist.
    """
    xp = array_module(dy, x, w)
    n_b, c = x.shape[:2]
    f, r = w.shape[0], w.shape[2]
    after = tuple(o + r - 1 - n - p for o, n, p in zip(dy.shape[2:], x.shape[2:], padding))   # hi
    if need_dx and dx_by_flipped_kernel(c, f, tuple(padding) + after, need_dw, x.shape[2:], dy.shape[2:], r):
        dx = forward(dy, _im2col.flipped_kernel(w), tuple(r - 1 - p for p in padding),
                     tuple(x.shape[2:]), budget)
        return dx, (backward(dy, x, w, padding, budget, need_dx=False)[1] if need_dw else None)
    out_spatial = tuple(dy.shape[2:])
    tiles = winograd_tiles(out_spatial)
    bt, g, at = matrices(xp, dy.dtype, r)
    alpha = bt.shape[0]
    plan = _Plan(xp, dy.dtype, n_b, tiles, max(c, f), budget, alpha)
    weight_bound = 2 * c * f > 3 * _n_tiles(plan.chunks[0], tiles) * max(c, f) * plan.workers
    dycl = _padded_channels_last(dy, (0, 0, 0), tiles, 0, plan.workers)   # (N, 4td, 4th, 4tw, F)
    xcl = _padded_channels_last(x, padding, tiles, alpha - M_OUT, plan.workers) if need_dw else None
    dxcl = (xp.zeros((n_b,) + tuple(M_OUT * t + alpha - M_OUT for t in tiles) + (c,),
                     dtype=dy.dtype) if need_dx else None)
    if by_channel_blocks(n_b, tiles, c, f):
        dw = _backward_by_channel_blocks(dycl, xcl, dxcl, w, tiles, plan, (bt, g, at))
        return _unpadded_ncdhw(dxcl, padding, x.shape, plan.workers), dw
    # dU^T (216, F, C), one accumulator per worker (summed in worker order at the end); a
    # worker's first chunk writes it directly (no (216, F, C) temporary)
    duts = [None] * plan.workers
    u = None

    def one(worker, chunk, do_dx, do_dw):
        b0, b1, b2 = plan.bufs[worker]
        t = _n_tiles(chunk, tiles)
        dm = _output_grad_tiles(dycl, chunk, tiles, at, (b0, b1), f)  # (216, T, F) in b1
        if do_dw:
            v = _input_tiles(xcl, chunk, tiles, bt, (b0, b2), c)      # (216, T, C) in b2
            if duts[worker] is None:
                duts[worker] = xp.matmul(dm.transpose(0, 2, 1), v)    # (216, F, C)
            else:
                duts[worker] += xp.matmul(dm.transpose(0, 2, 1), v)
        if do_dx:
            dv = b0[:alpha ** 3 * t * c]
            xp.matmul(dm, u.transpose(0, 2, 1), out=dv.reshape(alpha ** 3, t, c))   # dV (216, T, C)
            dg = _transform(bt.T, b0, b2, t * c)                      # (6, 6, 6, T, C) in b2
            _overlap_add(dxcl, dg, chunk, tiles, alpha)

    def passes(do_dx, do_dw):
        step = (lambda worker, chunk: one(worker, chunk, do_dx, do_dw))
        if do_dx:                             # dx: neighbouring chunks never at the same time
            for wave in overlap_waves(plan.chunks):
                _threads.run(step, wave, plan.workers)
        else:
            _threads.run(step, plan.chunks, plan.workers)

    if need_dx:
        u = _weight_transform(g, w)                                   # (216, C, F)
        passes(True, need_dw and not weight_bound)
        u = None
    if need_dw and (weight_bound or not need_dx):
        passes(False, True)
    # free what the chunks used before the last passes allocate (the spatial peak is here)
    dycl = xcl = plan.bufs = None
    dx, dw = _unpadded_ncdhw(dxcl, padding, x.shape, plan.workers), None
    if need_dw:
        dw = _weight_transform_adjoint(g, _threads.sum_in_order(duts))
    return dx, dw


def _unpadded_ncdhw(dxcl, padding, shape, workers):
    """``dx`` of shape ``shape`` (NCDHW) from the padded channels-last ``dxcl`` (None: None)."""
    if dxcl is None:
        return None
    box = tuple(slice(p, p + e) for p, e in zip(padding, shape[2:]))
    return to_ncdhw(dxcl[(slice(None),) + box], workers)


def overlap_boxes(alpha):
    """The 8 boxes of tile offsets within which ``alpha``-wide tiles at stride 4 do not overlap."""
    return tuple(product(*[(slice(0, M_OUT), slice(M_OUT, alpha))] * 3))
