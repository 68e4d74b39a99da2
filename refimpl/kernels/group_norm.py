"""The fast route of group and instance norm's passes on the host: the reference formulas
block by block, on worker threads.

``refimpl/functional/group_norm.py`` holds the math: float64 sums (the shifted ``S1``,
``S2`` per (sample, group) of the forward; the backward's row sums ``sum(dy)``,
``sum(dy * xhat)`` per (sample, channel)), the normalisation
``y = (x - mean) * inv_std * gamma + beta`` and the input gradient
``dx = inv_std * (g - mean(g) - xhat * mean(g xhat))``, ``g = gamma * dy``.  Written over the
whole array, as the math reads, each of those forms whole-array temporaries (``x - mean``,
``xhat`` in each backward pass, ``g``, ``dy * xhat``) that stream through memory, on one
core: several times slower than PyTorch's fused passes (docs/benchmarks.md, "Kernel
choices").  Here the same operations run on batch norm's blocks (``batch_norm.channel_blocks``:
one sample's channels ``[c0, c1)`` over voxels ``[v0, v1)``, about ``batch_norm.BLOCK_ELEMENTS``
elements), shared by the worker threads: a block's few operations read the cache, and every
row of a block is one channel of one sample, so its group's mean and ``inv_std`` and its
channel's ``gamma`` and ``beta`` are one number per row.

Numbers: every elementwise operation is the reference's, in the reference's order, on the
same per-row numbers (the statistics cast to x's dtype as the reference casts them), so
``y`` and ``dx`` equal the reference's bit for bit given the same statistics; a per-(sample,
group) or per-channel sum adds the blocks' float64 row sums in block order (an order that
depends on the shape only, not on the thread count), which differs from the reference's
order of additions by float64 rounding (tests/test_reference_ops.py holds it to 1e-12).

On a GPU (CuPy arrays) each pass is one CUDA kernel (``DEVICE_SOURCE``, launched by
``_cuda``) over the (N*C) rows of V = D*H*W voxels, each row one channel of one sample with its
group's mean and ``inv_std`` (expanded to one value per row) and its channel's ``gamma`` and
``beta``: the forward's sums are batch norm's ``bn_sums`` on the array seen as one sample of
N*C channels (a shift per row); the normalisation, the backward's row sums and its input
gradient are kernels of their own, each operation rounded on its own in the reference's
order: ``y`` and ``dx`` the reference's bit for bit, the sums to float64 rounding.

The one dispatch rule (``applies``): NumPy arrays of more than one block and float32 / float64
CuPy arrays (``_cuda.takes``) take this route outside ``refimpl.functional.reference_only()``;
NumPy arrays of one block and the strict stand-in take the reference.
"""
from __future__ import annotations

import numpy

from ..backend import array_module
from . import _cuda, batch_norm


def applies(x) -> bool:
    """Whether group norm's passes over ``x`` run here: a NumPy array of more than one block,
    or a float32 / float64 CuPy array."""
    return (array_module(x) is numpy and x.size > batch_norm.BLOCK_ELEMENTS) or _cuda.takes(x)


def _expand(v, channels_per_group):
    """(N, G) -> (N, C): each group's value for each of its channels."""
    return numpy.repeat(v, channels_per_group, axis=1)


def _row_sums(partials, blocks, n, c):
    """Per-block float64 row sums ``(C',)`` added per (sample, channel) in block order -> (N, C)."""
    total = numpy.zeros((n, c), dtype=numpy.float64)
    for part, (sample, channels, _) in zip(partials, blocks):
        total[sample, channels] += part
    return total


def _group_sums(partials, blocks, n, c, num_groups):
    """Per-block float64 row sums ``(C',)`` added per (sample, channel) in block order
    (``_row_sums``), then per group over its channels -> (N, G)."""
    return _row_sums(partials, blocks, n, c).reshape(n, num_groups, c // num_groups).sum(axis=-1)


def local_sums(x, num_groups, shift):
    """``(sum(x - K), sum((x - K)^2))`` per (sample, group) in float64 (N, G); ``shift`` K (N, G)
    or None.  The reference: ``xs = x - K`` in x's dtype, ``xs * xs``, each summed in float64."""
    if _cuda.on_device(x):
        return device_local_sums(x, num_groups, shift)
    n, c = x.shape[:2]
    cpg = c // num_groups
    k = None if shift is None else _expand(shift.astype(x.dtype), cpg)          # (N, C)

    def sums(i, ch, xb):
        xs = xb if k is None else xb - k[i, ch, None]
        s1 = numpy.sum(xs, axis=-1, dtype=numpy.float64)
        xs = xs * xs if k is None else numpy.multiply(xs, xs, out=xs)
        return s1, numpy.sum(xs, axis=-1, dtype=numpy.float64)
    blocks = batch_norm.channel_blocks(x)
    parts = batch_norm.run_blocks(sums, blocks)
    return (_group_sums([a for a, _ in parts], blocks, n, c, num_groups),
            _group_sums([b for _, b in parts], blocks, n, c, num_groups))


def forward(x, num_groups, mean, inv_std, gamma, beta):
    """``y = (x - mean) * inv_std [* gamma] [+ beta]``, a new array; ``mean``, ``inv_std`` (N, G)
    in x's dtype, ``gamma``, ``beta`` (C,) or None."""
    if _cuda.on_device(x):
        return device_forward(x, num_groups, mean, inv_std, gamma, beta)
    n, c = x.shape[:2]
    cpg = c // num_groups
    m, s = _expand(mean, cpg), _expand(inv_std, cpg)                            # (N, C)
    y = numpy.empty(x.shape, dtype=x.dtype)

    def normalise(i, ch, yb, xb):
        numpy.subtract(xb, m[i, ch, None], out=yb)
        yb *= s[i, ch, None]                                          # xhat
        if gamma is not None:
            yb *= gamma[ch, None]
        if beta is not None:
            yb += beta[ch, None]
    batch_norm.run_blocks(normalise, batch_norm.channel_blocks(y, x))
    return y


def backward_row_sums(dy, x, num_groups, mean, inv_std):
    """``(sum(dy), sum(dy * xhat))`` per (sample, channel) in float64 (N, C), ``xhat = (x - mean)
    * inv_std``; ``mean``, ``inv_std`` (N, G) in dy's dtype."""
    if _cuda.on_device(dy):
        return device_backward_row_sums(dy, x, num_groups, mean, inv_std)
    n, c = dy.shape[:2]
    cpg = c // num_groups
    m, s = _expand(mean, cpg), _expand(inv_std, cpg)

    def sums(i, ch, gb, xb):
        xhat = numpy.subtract(xb, m[i, ch, None])
        xhat *= s[i, ch, None]
        r1 = numpy.sum(gb, axis=-1, dtype=numpy.float64)
        xhat *= gb                                                    # dy * xhat
        return r1, numpy.sum(xhat, axis=-1, dtype=numpy.float64)
    blocks = batch_norm.channel_blocks(dy, x)
    parts = batch_norm.run_blocks(sums, blocks)
    return _row_sums([a for a, _ in parts], blocks, n, c), _row_sums([b for _, b in parts], blocks, n, c)


def backward(dy, x, num_groups, mean, inv_std, gamma, mean_g, mean_g_xhat):
    """``dx = inv_std * (g - mean_g - xhat * mean_g_xhat)``, ``g = gamma * dy`` (``dy`` when gamma
    is None), a new array; ``mean``, ``inv_std``, ``mean_g``, ``mean_g_xhat``: (N, G) in dy's dtype."""
    if _cuda.on_device(dy):
        return device_backward(dy, x, num_groups, mean, inv_std, gamma, mean_g, mean_g_xhat)
    c = dy.shape[1]
    cpg = c // num_groups
    m, s = _expand(mean, cpg), _expand(inv_std, cpg)
    mg, mgx = _expand(mean_g, cpg), _expand(mean_g_xhat, cpg)
    dx = numpy.empty(dy.shape, dtype=dy.dtype)

    def grad(i, ch, db, gb, xb):
        xhat = numpy.subtract(xb, m[i, ch, None])
        xhat *= s[i, ch, None]
        if gamma is not None:
            numpy.multiply(gb, gamma[ch, None], out=db)               # g
        else:
            db[...] = gb
        db -= mg[i, ch, None]                                         # g - mean(g)
        xhat *= mgx[i, ch, None]                                      # xhat * mean(g xhat)
        db -= xhat
        db *= s[i, ch, None]
    batch_norm.run_blocks(grad, batch_norm.channel_blocks(dx, dy, x))
    return dx


# ---------------------------------------------------------------- the CUDA kernels (CuPy arrays)
#
# Arrays (N, C, V) C-contiguous, seen as R = N*C rows of V voxels; per-row values (R,) (a
# group's mean and inv_std, repeated over its channels), per-channel values (C,) (gamma, beta),
# per-(sample, group) values expanded to rows the same way; everything in the arrays' dtype.
# Grid-stride loops over rows (y) and voxels (x), as batch norm's; the row sums of the backward
# by lanes, as batch norm's sums (then added over the lanes by CuPy).  The terms are the
# reference's: xhat = (x - mean) * inv_std; y = xhat [* gamma] [+ beta]; dy * xhat; and
# dx = inv_std * ((g - mean_g) - xhat * mean_g_xhat), g = dy [* gamma], each rounded in T.
DEVICE_SOURCE = r"""
extern "C" __global__ void gn_forward(const T* x, const T* m, const T* s, const T* gamma, const T* beta, T* y,
                                      long long rows, long long c, long long v) {
    for (long long r = blockIdx.y; r < rows; r += gridDim.y) {
        T mr = m[r], sr = s[r];
        T gr = gamma ? gamma[r % c] : (T)1, br = beta ? beta[r % c] : (T)0;
        for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < v;
             j += (long long)blockDim.x * gridDim.x) {
            T t = MUL(SUB(x[r * v + j], mr), sr);
            if (gamma) t = MUL(t, gr);
            if (beta) t = ADD(t, br);
            y[r * v + j] = t;
        }
    }
}

extern "C" __global__ void gn_backward_row_sums(const T* dy, const T* x, const T* m, const T* s,
                                                double* s1, double* s2, long long rows, long long v,
                                                long long lanes) {
    for (long long r = blockIdx.y; r < rows; r += gridDim.y) {
        T mr = m[r], sr = s[r];
        for (long long lane = (long long)blockIdx.x * blockDim.x + threadIdx.x; lane < lanes;
             lane += (long long)blockDim.x * gridDim.x) {
            double a1 = 0.0, a2 = 0.0;
            for (long long j = lane; j < v; j += lanes) {
                T g = dy[r * v + j];
                a1 += (double)g;
                a2 += (double)MUL(g, MUL(SUB(x[r * v + j], mr), sr));
            }
            s1[r * lanes + lane] = a1;
            s2[r * lanes + lane] = a2;
        }
    }
}

extern "C" __global__ void gn_backward_dx(const T* dy, const T* x, const T* m, const T* s, const T* gamma,
                                          const T* mg, const T* mgx, T* dx, long long rows, long long c,
                                          long long v) {
    for (long long r = blockIdx.y; r < rows; r += gridDim.y) {
        T mr = m[r], sr = s[r], mgr = mg[r], mgxr = mgx[r];
        T gr = gamma ? gamma[r % c] : (T)1;
        for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < v;
             j += (long long)blockDim.x * gridDim.x) {
            long long i = r * v + j;
            T xhat = MUL(SUB(x[i], mr), sr);
            T g = gamma ? MUL(dy[i], gr) : dy[i];
            dx[i] = MUL(sr, SUB(SUB(g, mgr), MUL(xhat, mgxr)));
        }
    }
}
"""

SIGNATURES = {
    "gn_forward": ("ptr",) * 6 + ("i64",) * 3,
    "gn_backward_row_sums": ("ptr",) * 6 + ("i64",) * 3,
    "gn_backward_dx": ("ptr",) * 8 + ("i64",) * 3,
}


def _rows(xp, v, channels_per_group, dtype):
    """(N, G) -> the (N*C,) per-row values, as the kernels take a vector (None stays None)."""
    return None if v is None else batch_norm.channel_values(xp, xp.repeat(v, channels_per_group, axis=1), dtype)


def device_local_sums(x, num_groups, shift):
    """batch norm's sums (``batch_norm.device_local_sums``) over x seen as one sample of N*C
    channels, a shift per row; the (N*C,) sums added per group -> (N, G) float64."""
    xp = array_module(x)
    x, n, c, _ = _cuda.flat(x)
    sums = batch_norm.device_local_sums(x.reshape(1, n * c, -1), _rows(xp, shift, c // num_groups, x.dtype))
    return tuple(t.reshape(n, num_groups, -1).sum(axis=-1) for t in sums)


def device_forward(x, num_groups, mean, inv_std, gamma, beta):
    xp = array_module(x)
    x, n, c, v = _cuda.flat(x)
    y = xp.empty(x.shape, dtype=x.dtype)
    cpg, dt = c // num_groups, x.dtype
    gamma, beta = (batch_norm.channel_values(xp, t, dt) for t in (gamma, beta))
    _cuda.launch(DEVICE_SOURCE, "gn_forward", SIGNATURES["gn_forward"],
                 (x, _rows(xp, mean, cpg, dt), _rows(xp, inv_std, cpg, dt), gamma, beta, y, n * c, c, v), dt, v,
                 grid_y=_cuda.grid_rows(n * c))
    return y


def device_backward_row_sums(dy, x, num_groups, mean, inv_std):
    xp = array_module(dy)
    dy, n, c, v = _cuda.flat(dy)
    rows, cpg, dt = n * c, c // num_groups, dy.dtype
    lanes = _cuda.sum_lanes(v)
    s1 = xp.empty((rows, lanes), dtype=xp.float64)
    s2 = xp.empty((rows, lanes), dtype=xp.float64)
    _cuda.launch(DEVICE_SOURCE, "gn_backward_row_sums", SIGNATURES["gn_backward_row_sums"],
                 (dy, xp.ascontiguousarray(x), _rows(xp, mean, cpg, dt), _rows(xp, inv_std, cpg, dt), s1, s2,
                  rows, v, lanes), dt, lanes, grid_y=_cuda.grid_rows(rows))
    return s1.sum(axis=1).reshape(n, c), s2.sum(axis=1).reshape(n, c)


def device_backward(dy, x, num_groups, mean, inv_std, gamma, mean_g, mean_g_xhat):
    xp = array_module(dy)
    dy, n, c, v = _cuda.flat(dy)
    dx = xp.empty(dy.shape, dtype=dy.dtype)
    cpg, dt = c // num_groups, dy.dtype
    _cuda.launch(DEVICE_SOURCE, "gn_backward_dx", SIGNATURES["gn_backward_dx"],
                 (dy, xp.ascontiguousarray(x), _rows(xp, mean, cpg, dt), _rows(xp, inv_std, cpg, dt),
                  batch_norm.channel_values(xp, gamma, dt), _rows(xp, mean_g, cpg, dt),
                  _rows(xp, mean_g_xhat, cpg, dt), dx, n * c, c, v), dt, v, grid_y=_cuda.grid_rows(n * c))
    return dx


__all__ = ["applies", "local_sums", "forward", "backward_row_sums", "backward", "DEVICE_SOURCE", "SIGNATURES"]
