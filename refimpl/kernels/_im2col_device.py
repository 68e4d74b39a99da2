"""im2col + GEMM in a few large array operations: the device (CuPy) schedule of ``_im2col``.

The math is ``_im2col``'s (read its docstring first): columns, one GEMM for ``y``, one for
``dW``, one for the column gradient and col2im.  What differs is the *schedule*.  On a GPU
every array operation costs a kernel launch plus tens of microseconds of Python and CuPy
overhead, whatever its size, and there is no cache to fit a tile into.  ``_im2col``'s CPU
schedule (cache-sized tiles, kd*kh*kw strided copies per tile plus the zeroing of their
padding borders, worker threads) therefore spends its time launching: on a GPU it ran one to
two orders of magnitude behind cuDNN (docs/benchmarks.md, "Kernel choices").  Here:

* the input is zero-padded once (``_padded``: only as far as the outputs read), so the
  taps need no borders;
* a tile's columns are **one** strided copy.  With ``xpad`` padded and C-contiguous,

      col[n, c, a, b, e, d, h, w] = xpad[n, c, d*s + a*dl, h*s + b*dl, w*s + e*dl]

  is an 8-D strided view of ``xpad`` (strides ``(sN, sC, dl*sD, dl*sH, dl*sW, s*sD,
  s*sH, s*sW)`` in its element strides ``sN .. sW``), copied into the ``(nb, K, M)``
  column buffer.  On a GPU that copy is one CUDA kernel (``DEVICE_SOURCE``: a block row
  per column row, whose source offset is worked out once, and its positions along x, two
  32-bit divisions each), where CuPy's copy of an 8-D view divides every element's index
  eight times in 64 bits; the view's copy stays the reference it is tested against;
* the GEMMs are batched over the tile's samples:
  ``y (nb, F, M) = W (F, K) @ col``, ``dcol (nb, K, M) = W^T (K, F) @ dy``, and
  ``dW (F, K) += sum_n dy_n (F, M) @ col_n^T`` one GEMM per sample on a transposed view
  (``_add_weight_grad``);
* col2im adds the ``K`` rows back tap by tap into a padded ``dx`` (kd*kh*kw strided
  adds per tile, every sample of the tile at once: within one tap no input position
  repeats), and the padding is cut off at the end.  (``_im2col.backward`` takes dx of a
  stride-1 conv as the forward conv with the flipped kernel instead, on this schedule too:
  ``flipped_kernel_pays``);
* tiles are as large as ``max_temp_bytes`` allows: whole samples, else whole depth
  planes, else rows (``_im2col.tiles``), at least one row.

Memory: the column buffer and the GEMM product of one tile, together at most
``max(max_temp_bytes, (K + F) * Wo * itemsize)`` bytes, plus the padded copy of the input
(forward, weight gradient) or of the input gradient (input gradient): one input-sized
temporary, which the CPU schedule avoids and a GPU can afford.

Exact: every output is the same sum of products as in ``_im2col`` (float64 results agree with
PyTorch to rounding); only the order of additions differs.

Where the time goes: with ``PROFILE`` set (``scripts/bench_layers.py --phases``), each pass
reports its phases -- ``pad``, ``columns`` (the strided copy), ``gemm`` (y, or dx's column
gradient), ``dw gemm``, ``col2im``, ``dx buffers`` (zeroing and cropping the padded dx) -- to
it; unset (the default), nothing is recorded.
"""
from __future__ import annotations

import contextlib
from math import prod

from ..backend import array_module
from . import _cuda
from ._im2col import placed, tiles


#: None, or what collects the time of each phase: an object whose ``phase(name)`` is a context
#: manager (``scripts/bench_layers.py --phases``: synchronised clocks around each).
PROFILE = None
#: The phases a pass reports to ``PROFILE``, by name.
PHASES = ("pad", "columns", "gemm", "dw gemm", "col2im", "dx buffers")


def _phase(name):
    if PROFILE is None:
        return contextlib.nullcontext()
    assert name in PHASES, name
    return PROFILE.phase(name)


def _reach(o, k, s, dl):
    """Padded extent the first ``o`` outputs read along one axis: ``(o-1)*s + (k-1)*dl + 1``."""
    return (o - 1) * s + (k - 1) * dl + 1


def _padded(x, padding, out, k, stride, dilation):
    """``x`` zero-padded by ``padding`` at the start of each spatial axis, and cut or padded at
    the end to the extent the outputs ``out`` read.  ``x`` itself when it has that extent
    already and needs no padding."""
    xp = array_module(x)
    ext = tuple(_reach(o, kk, s, dl) for o, kk, s, dl in zip(out, k, stride, dilation))
    if not any(padding) and all(e <= n for e, n in zip(ext, x.shape[2:])):
        return xp.ascontiguousarray(x[(slice(None), slice(None)) + tuple(slice(0, e) for e in ext)])
    return placed(x, padding, ext)


def _column_view(xpad, tile, k, stride, dilation, wo):
    """The tile's columns as a strided view of ``xpad``: (nb, C, kd, kh, kw, nd, nh, Wo)."""
    xp = array_module(xpad)
    n0, n1, d0, d1, h0, h1 = tile
    s, dl = stride, dilation
    base = xpad[n0:, :, d0 * s[0]:, h0 * s[1]:, :]
    sn, sc, sd, sh, sw = xpad.strides            # bytes; xpad is C-contiguous
    shape = (n1 - n0, xpad.shape[1]) + tuple(k) + (d1 - d0, h1 - h0, wo)
    strides = (sn, sc, dl[0] * sd, dl[1] * sh, dl[2] * sw, s[0] * sd, s[1] * sh, s[2] * sw)
    return xp.lib.stride_tricks.as_strided(base, shape=shape, strides=strides)


class _Plan:
    """The tiles of one call and its column buffer (one, reused)."""

    def __init__(self, xp, dtype, n_batch, kk, f, out, budget):
        per_position = (kk + f) * dtype.itemsize          # a column plus a GEMM output
        positions = max(out[2], budget // per_position)
        self.tiles, tpos = tiles(n_batch, out, positions)
        self.kk, self.out = kk, tuple(out)
        self.buf = xp.empty(tpos * kk, dtype=dtype)

    def columns(self, xpad, tile, k, stride, dilation):
        """The tile's columns copied into the buffer: (nb, K, M)."""
        view = _column_view(xpad, tile, k, stride, dilation, self.out[2])
        col = self.buf[:view.size].reshape(view.shape)
        if takes(xpad, view):
            device_columns(xpad, col, tile, k, stride, dilation)
        else:
            col[...] = view
        return col.reshape(view.shape[0], self.kk, -1)


# ---------------------------------------------------------------- the columns' CUDA kernel
#
# col (rows = nb*K, M) C-contiguous, K = C*kd*kh*kw, M = nd*nh*wo; xpad (N, C, Dp, Hp, Wp)
# C-contiguous.  Row r = (n, c, a, b, e) reads from
#     origin + n*sN + c*sC + a*tap_d + b*tap_h + e*tap_w
# (origin: the tile's first sample, depth and height; tap_*: a tap's dilated step), and its
# position m = (d, h, w) adds d*step_d + h*step_h + w*step_w (the strided steps).  The rows run
# grid-stride along y (one division chain per row), the positions along x (two unsigned 32-bit
# divisions each: a tile's M is below 2^31, ``takes``).
DEVICE_SOURCE = r"""
extern "C" __global__ void im2col_columns(const T* xpad, T* col, long long rows, long long k_rows,
        long long taps, long long taps_hw, long long kw, long long positions, long long nh, long long wo,
        long long origin, long long s_n, long long s_c, long long tap_d, long long tap_h, long long tap_w,
        long long step_d, long long step_h, long long step_w) {
    for (long long r = blockIdx.y; r < rows; r += gridDim.y) {
        long long n = r / k_rows, k = r % k_rows;
        long long c = k / taps, t = k % taps;
        long long a = t / taps_hw, t2 = t % taps_hw;
        long long b = t2 / kw, e = t2 % kw;
        const T* src = xpad + origin + n * s_n + c * s_c + a * tap_d + b * tap_h + e * tap_w;
        T* dst = col + r * positions;
        unsigned int uwo = (unsigned int) wo, unh = (unsigned int) nh;
        for (long long m = (long long) blockIdx.x * blockDim.x + threadIdx.x; m < positions;
             m += (long long) gridDim.x * blockDim.x) {
            unsigned int um = (unsigned int) m;
            unsigned int w = um % uwo, q = um / uwo;
            unsigned int h = q % unh, d = q / unh;
            dst[m] = src[d * step_d + h * step_h + w * step_w];
        }
    }
}
"""

SIGNATURES = {"im2col_columns": ("ptr", "ptr") + ("i64",) * 17}


def takes(xpad, view) -> bool:
    """Whether the kernel copies these columns: a float32 / float64 CuPy array (``_cuda.takes``)
    with a tile of fewer than 2^31 positions (its 32-bit position arithmetic)."""
    return _cuda.takes(xpad) and prod(view.shape[5:]) < 2 ** 31


def device_columns(xpad, col, tile, k, stride, dilation):
    """``col[...] = _column_view(...)`` by ``im2col_columns``: ``col`` the (nb, C, kd, kh, kw,
    nd, nh, wo) buffer, C-contiguous."""
    n0, n1, d0, d1, h0, h1 = tile
    _, c, _, hp, wp = xpad.shape
    s_w, s_h, s_d = 1, wp, hp * wp                     # xpad's element strides
    s_c, s_n = xpad.shape[2] * s_d, c * xpad.shape[2] * s_d
    nd, nh, wo = d1 - d0, h1 - h0, col.shape[-1]
    taps = k[0] * k[1] * k[2]
    rows, positions = (n1 - n0) * c * taps, nd * nh * wo
    origin = n0 * s_n + d0 * stride[0] * s_d + h0 * stride[1] * s_h
    _cuda.launch(DEVICE_SOURCE, "im2col_columns", SIGNATURES["im2col_columns"],
                 (xpad, col, rows, c * taps, taps, k[1] * k[2], k[2], positions, nh, wo,
                  origin, s_n, s_c, dilation[0] * s_d, dilation[1] * s_h, dilation[2] * s_w,
                  stride[0] * s_d, stride[1] * s_h, stride[2] * s_w),
                 xpad.dtype, positions, grid_y=_cuda.grid_rows(rows))


def _block(a, tile):
    """The tile's (nb, F, nd, nh, W) block of NCDHW ``a`` (a view)."""
    n0, n1, d0, d1, h0, h1 = tile
    return a[n0:n1, :, d0:d1, h0:h1, :]


def _col2im(dxpad, dcol, tile, k, stride, dilation, wo):
    """``dxpad[the tile's padded inputs] +=`` the column gradient ``dcol`` (nb, K, M), tap by tap."""
    n0, n1, d0, d1, h0, h1 = tile
    s, dl = stride, dilation
    nd, nh = d1 - d0, h1 - h0
    dcol = dcol.reshape((n1 - n0, dxpad.shape[1]) + tuple(k) + (nd, nh, wo))
    for a in range(k[0]):
        for b in range(k[1]):
            for e in range(k[2]):
                dd, hh, ww = d0 * s[0] + a * dl[0], h0 * s[1] + b * dl[1], e * dl[2]
                dxpad[n0:n1, :, dd:dd + (nd - 1) * s[0] + 1:s[0], hh:hh + (nh - 1) * s[1] + 1:s[1],
                      ww:ww + (wo - 1) * s[2] + 1:s[2]] += dcol[:, :, a, b, e]


def _add_weight_grad(dw2, dy_cols, col):
    """``dw2 (F, K) += sum_n dy_cols[n] (F, M) @ col[n]^T (M, K)``: one GEMM per sample of the
    tile, ``col[n]^T`` a transposed view (BLAS reads it as it lies).  One ``tensordot`` over
    (n, m) instead copies both operands to bring n next to m, the column buffer being the
    largest array of the pass: the weight gradient of 4 x 32->64 at 32^3 in one tile peaked at
    916 MiB that way, 452 MiB this way (host, tracemalloc); its time on a GPU is the
    ``dw gemm`` column of ``bench_layers.py --phases``."""
    for n in range(col.shape[0]):
        dw2 += dy_cols[n] @ col[n].T


def forward(x, w, stride, padding, dilation, out_spatial, budget, g=None):
    """``_im2col.forward`` on the device schedule: ``y`` (and ``dW`` of ``g``: ``(y, dW)``)."""
    xp = array_module(x, w)
    n_b, c = x.shape[:2]
    f, k = w.shape[0], tuple(w.shape[2:])
    kk = c * k[0] * k[1] * k[2]
    y = xp.empty((n_b, f) + tuple(out_spatial), dtype=x.dtype)
    if not (y.size and x.size):
        y[...] = 0
        return y if g is None else (y, xp.zeros(w.shape, dtype=x.dtype))
    with _phase("pad"):
        xpad = _padded(x, padding, out_spatial, k, stride, dilation)
    w2 = xp.ascontiguousarray(w).reshape(f, kk)
    plan = _Plan(xp, x.dtype, n_b, kk, f, out_spatial, budget)
    dw2 = None if g is None else xp.zeros((f, kk), dtype=x.dtype)
    for tile in plan.tiles:
        with _phase("columns"):
            col = plan.columns(xpad, tile, k, stride, dilation)      # (nb, K, M)
        blk = _block(y, tile)                                         # (nb, F, nd, nh, Wo)
        with _phase("gemm"):
            blk[...] = xp.matmul(w2, col).reshape(blk.shape)
        if g is not None:
            gb = _block(g, tile).reshape(col.shape[0], f, -1)        # (nb, F, M)
            with _phase("dw gemm"):
                _add_weight_grad(dw2, gb, col)
    return y if g is None else (y, dw2.reshape(w.shape))


def backward(dy, x, w, stride, padding, dilation, budget, need_dx=True, need_dw=True):
    """``_im2col.backward`` on the device schedule: ``(dx, dW)`` for the outputs ``dy``
    covers (either may be skipped: None; ``x`` / ``w`` may then be only shapes)."""
    xp = array_module(dy)
    n_b, c = x.shape[:2]
    f, k = w.shape[0], tuple(w.shape[2:])
    kk = c * k[0] * k[1] * k[2]
    out = tuple(dy.shape[2:])
    in_spatial = tuple(x.shape[2:])
    if not (dy.size and prod(x.shape)):
        return (xp.zeros(tuple(x.shape), dtype=dy.dtype) if need_dx else None,
                xp.zeros(tuple(w.shape), dtype=dy.dtype) if need_dw else None)
    plan = _Plan(xp, dy.dtype, n_b, kk, f, out, budget)
    with _phase("pad"):
        xpad = _padded(x, padding, out, k, stride, dilation) if need_dw else None
    dw2 = xp.zeros((f, kk), dtype=dy.dtype) if need_dw else None
    if need_dx:
        w2t = xp.ascontiguousarray(xp.ascontiguousarray(w).reshape(f, kk).T)   # (K, F)
        # padded dx: the outputs' reach, and at least the padding plus the input
        ext = tuple(max(_reach(o, kk_, s, dl), p + n)
                    for o, kk_, s, dl, p, n in zip(out, k, stride, dilation, padding, in_spatial))
        with _phase("dx buffers"):
            dxpad = xp.zeros((n_b, c) + ext, dtype=dy.dtype)
    for tile in plan.tiles:
        nb = tile[1] - tile[0]
        dyb = _block(dy, tile).reshape(nb, f, -1)                     # (nb, F, M)
        if need_dw:
            with _phase("columns"):
                col = plan.columns(xpad, tile, k, stride, dilation)  # (nb, K, M)
            with _phase("dw gemm"):
                _add_weight_grad(dw2, dyb, col)
        if need_dx:
            dcol = plan.buf[:nb * kk * dyb.shape[2]].reshape(nb, kk, -1)
            with _phase("gemm"):
                xp.matmul(w2t, dyb, out=dcol)
            with _phase("col2im"):
                _col2im(dxpad, dcol, tile, k, stride, dilation, out[2])
    dx = None
    if need_dx:
        with _phase("dx buffers"):
            dx = xp.ascontiguousarray(dxpad[(slice(None), slice(None))
                                            + tuple(slice(p, p + n) for p, n in zip(padding, in_spatial))])
    return dx, (dw2.reshape(tuple(w.shape)) if need_dw else None)
