"""The fast route of batch norm's passes: the reference formulas block by block, on worker threads.

``refimpl/functional/batch_norm.py`` holds the math: per-channel float64 sums (the
shifted ``S1``, ``S2`` of the forward; ``sum(dy)``, ``sum(dy * (x - mean))`` of the
backward) and the per-channel affine passes ``y = a x + c`` and ``dx = a dy + b x + c``.
Here the same operations run on blocks of the arrays (``channel_blocks``: one sample's
channels ``[c0, c1)`` over voxels ``[v0, v1)``, about ``BLOCK_ELEMENTS`` elements, rows as
long as possible), shared by the worker threads of ``_threads``: the few elementwise
operations of a pass then read the cache, not memory, and run on every core.  Long rows of
few channels beat short rows of all channels, and 1 MiB blocks beat smaller ones (measured:
docs/benchmarks.md, "Kernel choices").

Numbers: the affine passes are elementwise, so they equal the reference bit for bit; a
per-channel sum adds the blocks' float64 row sums in block order (an order that depends
on the shape only, not on the thread count), which differs from the reference's order of
additions by float64 rounding (tests/test_reference_ops.py holds it to 1e-12).

On a GPU (CuPy arrays) each pass is one CUDA kernel (``DEVICE_SOURCE``, launched by
``_cuda``): the two per-channel sums of a pass in one reading of the arrays (each thread adds
the voxels ``lane, lane + lanes, ...`` of each sample's row of a channel in float64, then CuPy
adds the (C, lanes) partial sums), and the affine passes one kernel each, every multiply and add rounded on its
own in the reference's order: the same bits as the reference for the elementwise passes, the
sums to float64 rounding.

The one dispatch rule (``applies``): NumPy arrays of more than ``BLOCK_ELEMENTS``
elements and CuPy arrays of float32 or float64 take this route outside ``refimpl.functional.reference_only()``;
NumPy arrays of one block and the strict stand-in take the reference (for them both are the
same operations).
"""
from __future__ import annotations

import numpy

from ..backend import array_module
from . import _cuda, _threads

#: Voxels x channels per block of a pass (1 MiB of float32: measured best; blocks of 64 Ki
#: elements make the per-channel rows too short).
BLOCK_ELEMENTS = 1 << 18


def applies(x) -> bool:
    """Whether batch norm's passes over ``x`` run here: a NumPy array of more than one block,
    or a float32 / float64 CuPy array (``_cuda.takes``)."""
    return (array_module(x) is numpy and x.size > BLOCK_ELEMENTS) or _cuda.takes(x)


def channel_blocks(*arrays):
    """The arrays (same NCDHW shape) as blocks ``(sample, channels, views)``: ``channels`` a
    slice of the channel axis, ``views`` the arrays' ``(C', L)`` pieces for it: sample
    ``sample``'s channels ``[c0, c1)`` over voxels ``[v0, v1)``, about ``BLOCK_ELEMENTS`` in
    all, its rows a whole sample's voxels where they fit (fewer channels then).  Group norm's
    passes (``kernels.group_norm``) run on the same blocks."""
    n, c = arrays[0].shape[:2]
    flat = [numpy.ascontiguousarray(a).reshape(n, c, -1) for a in arrays]
    size = flat[0].shape[2]
    step = max(1, min(size, BLOCK_ELEMENTS))                          # voxels per row
    rows = max(1, BLOCK_ELEMENTS // step)                             # channels per block
    return [(i, slice(c0, min(c0 + rows, c)), tuple(f[i, c0:c0 + rows, v0:v0 + step] for f in flat))
            for i in range(n) for c0 in range(0, c, rows) for v0 in range(0, size, step)]


def run_blocks(fn, blocks):
    """``fn(sample, channels, *views)`` for every block, over the worker threads; results in
    block order."""
    results = [None] * len(blocks)

    def one(_, i):
        sample, channels, views = blocks[i]
        results[i] = fn(sample, channels, *views)
    _threads.run(one, list(range(len(blocks))), _threads.thread_count(numpy))
    return results


def _channel_sums(partials, blocks, c):
    """Per-block float64 row sums ``(C',)`` added per channel, in block order -> (C,)."""
    total = numpy.zeros(c, dtype=numpy.float64)
    for part, (_, channels, _) in zip(partials, blocks):
        total[channels] += part
    return total


def local_sums(x, k):
    """``(sum(x - k), sum((x - k)^2))`` per channel in float64; ``k`` (C, 1) in x's dtype, or
    None for no shift."""
    if _cuda.on_device(x):
        return device_local_sums(x, k)
    def sums(_, ch, xb):
        xs = xb if k is None else xb - k[ch]
        s1 = numpy.sum(xs, axis=-1, dtype=numpy.float64)
        xs = xs * xs if k is None else numpy.multiply(xs, xs, out=xs)
        return s1, numpy.sum(xs, axis=-1, dtype=numpy.float64)
    blocks = channel_blocks(x)
    parts = run_blocks(sums, blocks)
    c = x.shape[1]
    return (_channel_sums([a for a, _ in parts], blocks, c),
            _channel_sums([b for _, b in parts], blocks, c))


def affine(x, a, c):
    """``y = a x + c`` per channel (``a``, ``c`` (C, 1) in x's dtype), a new array."""
    if _cuda.on_device(x):
        return device_affine(x, a, c)
    y = numpy.empty(x.shape, dtype=x.dtype)

    def normalise(_, ch, yb, xb):
        numpy.multiply(xb, a[ch], out=yb)
        yb += c[ch]
    run_blocks(normalise, channel_blocks(y, x))
    return y


def backward_sums(dy, x, m):
    """``(sum(dy), sum(dy * (x - m)))`` per channel in float64; ``m`` (C, 1) in dy's dtype."""
    if _cuda.on_device(dy):
        return device_backward_sums(dy, x, m)
    def sums(_, ch, gb, xb):
        t = numpy.subtract(xb, m[ch])
        t *= gb
        return numpy.sum(gb, axis=-1, dtype=numpy.float64), numpy.sum(t, axis=-1, dtype=numpy.float64)
    blocks = channel_blocks(dy, x)
    parts = run_blocks(sums, blocks)
    c = dy.shape[1]
    return (_channel_sums([s for s, _ in parts], blocks, c),
            _channel_sums([t for _, t in parts], blocks, c))


def backward_dx(dy, x, a, b, c):
    """``dx = b x + c + a dy`` per channel (``a``, ``b``, ``c`` (C, 1) in dy's dtype)."""
    if _cuda.on_device(dy):
        return device_backward_dx(dy, x, a, b, c)
    dx = numpy.empty(dy.shape, dtype=dy.dtype)

    def grad(_, ch, db, gb, xb):
        numpy.multiply(xb, b[ch], out=db)
        db += c[ch]
        db += gb * a[ch]
    run_blocks(grad, channel_blocks(dx, dy, x))
    return dx



# ---------------------------------------------------------------- the CUDA kernels (CuPy arrays)
#
# Arrays (N, C, V) C-contiguous (V = D*H*W voxels); per-channel values (C,) in the arrays'
# dtype.  The sums: lane j of channel c adds the voxels j, j + lanes, ... of each sample's row
# of the channel in float64 and writes its partial to (c, j); the grid-stride loops over
# channels (y) and lanes (x) make one thread compute every lane, as the host emulation runs
# it.  The affine passes run over (N*C) rows (y) of V voxels (x): the channel's values are
# read once per row, and no index is divided per element (64-bit integer division costs a
# GPU tens of instructions, more than the element's memory traffic).  The
# terms are the reference's: x - k (and its square) and dy * (x - m) rounded in T, then
# widened.  The affine passes: the reference's y = x * a; y += c and dx = x * b; dx += c;
# dx += dy * a, each operation rounded in T.
DEVICE_SOURCE = r"""
extern "C" __global__ void bn_sums(const T* x, const T* k, double* s1, double* s2,
                                   long long n, long long c, long long v, long long lanes) {
    for (long long ch = blockIdx.y; ch < c; ch += gridDim.y) {
        T shift = k ? k[ch] : (T)0;
        for (long long lane = (long long)blockIdx.x * blockDim.x + threadIdx.x; lane < lanes;
             lane += (long long)blockDim.x * gridDim.x) {
            double a1 = 0.0, a2 = 0.0;
            for (long long s = 0; s < n; ++s) {
                const T* row = x + (s * c + ch) * v;
                for (long long j = lane; j < v; j += lanes) {
                    T t = row[j];
                    if (k) t = SUB(t, shift);
                    a1 += (double)t;
                    a2 += (double)MUL(t, t);
                }
            }
            s1[ch * lanes + lane] = a1;
            s2[ch * lanes + lane] = a2;
        }
    }
}

extern "C" __global__ void bn_backward_sums(const T* dy, const T* x, const T* m, double* s1, double* s2,
                                            long long n, long long c, long long v, long long lanes) {
    for (long long ch = blockIdx.y; ch < c; ch += gridDim.y) {
        T mean = m[ch];
        for (long long lane = (long long)blockIdx.x * blockDim.x + threadIdx.x; lane < lanes;
             lane += (long long)blockDim.x * gridDim.x) {
            double a1 = 0.0, a2 = 0.0;
            for (long long s = 0; s < n; ++s) {
                long long row = (s * c + ch) * v;
                for (long long j = lane; j < v; j += lanes) {
                    a1 += (double)dy[row + j];
                    a2 += (double)MUL(SUB(x[row + j], mean), dy[row + j]);
                }
            }
            s1[ch * lanes + lane] = a1;
            s2[ch * lanes + lane] = a2;
        }
    }
}

extern "C" __global__ void bn_affine(const T* x, const T* a, const T* cc, T* y,
                                     long long rows, long long c, long long v) {
    for (long long r = blockIdx.y; r < rows; r += gridDim.y) {
        T ar = a[r % c], cr = cc[r % c];
        for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < v;
             j += (long long)blockDim.x * gridDim.x) {
            y[r * v + j] = ADD(MUL(x[r * v + j], ar), cr);
        }
    }
}

extern "C" __global__ void bn_backward_dx(const T* dy, const T* x, const T* a, const T* b, const T* cc,
                                          T* dx, long long rows, long long c, long long v) {
    for (long long r = blockIdx.y; r < rows; r += gridDim.y) {
        T ar = a[r % c], br = b[r % c], cr = cc[r % c];
        for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < v;
             j += (long long)blockDim.x * gridDim.x) {
            long long i = r * v + j;
            dx[i] = ADD(ADD(MUL(x[i], br), cr), MUL(dy[i], ar));
        }
    }
}
"""

SIGNATURES = {
    "bn_sums": ("ptr",) * 4 + ("i64",) * 4,
    "bn_backward_sums": ("ptr",) * 5 + ("i64",) * 4,
    "bn_affine": ("ptr",) * 4 + ("i64",) * 3,
    "bn_backward_dx": ("ptr",) * 6 + ("i64",) * 3,
}

def channel_values(xp, v, dtype):
    """A per-channel vector (any shape of C values: (C,), (C, 1)) as the kernels take it: (C,)
    contiguous in ``dtype``; None stays None (a null pointer).  Group norm's kernels take theirs
    so too."""
    return None if v is None else xp.ascontiguousarray(v.reshape(-1), dtype=dtype)


def _device_sums(name, arrays, per_channel, n, c, v, dtype):
    """The two float64 (C,) sums of kernel ``name``: (C, lanes) partials, then added per channel."""
    xp = array_module(*arrays)
    lanes = _cuda.sum_lanes(v)
    s1 = xp.empty((c, lanes), dtype=xp.float64)
    s2 = xp.empty((c, lanes), dtype=xp.float64)
    _cuda.launch(DEVICE_SOURCE, name, SIGNATURES[name], tuple(arrays) + (per_channel, s1, s2, n, c, v, lanes),
                 dtype, lanes, grid_y=_cuda.grid_rows(c))
    return s1.sum(axis=1), s2.sum(axis=1)


def device_local_sums(x, k):
    xp = array_module(x)
    x, n, c, v = _cuda.flat(x)
    return _device_sums("bn_sums", (x,), channel_values(xp, k, x.dtype), n, c, v, x.dtype)


def device_backward_sums(dy, x, m):
    xp = array_module(dy)
    dy, n, c, v = _cuda.flat(dy)
    return _device_sums("bn_backward_sums", (dy, xp.ascontiguousarray(x)), channel_values(xp, m, dy.dtype),
                        n, c, v, dy.dtype)


def device_affine(x, a, c):
    xp = array_module(x)
    x, _, ch, v = _cuda.flat(x)
    y = xp.empty(x.shape, dtype=x.dtype)
    rows = x.shape[0] * ch
    _cuda.launch(DEVICE_SOURCE, "bn_affine", SIGNATURES["bn_affine"],
                 (x, channel_values(xp, a, x.dtype), channel_values(xp, c, x.dtype), y, rows, ch, v),
                 x.dtype, v, grid_y=_cuda.grid_rows(rows))
    return y


def device_backward_dx(dy, x, a, b, c):
    xp = array_module(dy)
    dy, _, ch, v = _cuda.flat(dy)
    dx = xp.empty(dy.shape, dtype=dy.dtype)
    pc = [channel_values(xp, t, dy.dtype) for t in (a, b, c)]
    rows = dy.shape[0] * ch
    _cuda.launch(DEVICE_SOURCE, "bn_backward_dx", SIGNATURES["bn_backward_dx"],
                 (dy, xp.ascontiguousarray(x), *pc, dx, rows, ch, v), dy.dtype, v, grid_y=_cuda.grid_rows(rows))
    return dx

__all__ = ["BLOCK_ELEMENTS", "applies", "channel_blocks", "run_blocks", "local_sums", "affine", "backward_sums",
           "backward_dx", "channel_values", "DEVICE_SOURCE", "SIGNATURES"]
