"""Bounded-memory im2col + GEMM: the one piece of math behind conv3d and conv_transpose3d.

Notation, per spatial axis: input extent ``n``, kernel ``k``, stride ``s``,
padding ``p``, dilation ``dl``, output extent ``o``.  Output position ``j``
reads input position ``i = j*s + t*dl - p`` through kernel tap ``t``; an ``i``
outside ``[0, n)`` is zero padding (it is never materialised: no padded copy
of the input is made, each tap copies only its in-range box and zeroes the
border of the column tile).

For a tile of ``M`` output positions (of ``nb`` whole samples, or of part of
one sample), with ``K = C*kd*kh*kw``::

    col   (K, M)  : col[(c, a, b, e), m] = x[c, i_d(m, a), i_h(m, b), i_w(m, e)]   (im2col)
    y     (F, M)  = W (F, K) @ col                                              forward
    dW^T  (K, F) += col @ dy^T (M, F)                                           weight grad
    dcol  (K, M)  = W^T (K, F) @ dy;   dx += col2im(dcol)                       input grad

``W`` is the weight ``(F, C, kd, kh, kw)`` reshaped to ``(F, K)``; ``W^T`` and ``dy^T`` are
transposed views, which BLAS reads as they lie, and ``dW^T`` becomes ``dW`` by a blocked
transpose (``transposed``: NumPy's own copy of a transposed 4 MB weight gradient took 7 ms).  For a
one-sample tile the ``(F, M)`` tile of ``y`` / ``dy`` is the NCDHW array itself
(the GEMM writes straight into ``y``); a tile of several samples (small
volumes: one bigger GEMM instead of several small ones) stages ``(F, nb, M)``
through a buffer.  The tiles of a forward or a weight gradient are independent
and run on the worker threads of ``_threads`` (each with its own buffers and dW
accumulator, BLAS single-threaded meanwhile); col2im's tiles overlap and run
in order.  col2im adds the ``K`` rows back tap by tap with strided
slices (no ``numpy.add.at``): within one tap the slice has no repeated input
position.

Tiles and the memory bound: the outputs are cut into tiles of whole samples,
else of whole depth planes of one sample, else of whole rows ``(h, :)`` of one
plane.  A tile holds about ``TARGET_TILE_BYTES`` (8 MiB: cache-sized) of
columns but at least ``MIN_TILE_POSITIONS`` positions, and never more than
``max_temp_bytes`` allows.  The temporary buffers of one call (column tile,
plus an ``(F, M)`` GEMM-output / staging tile) are allocated once and reused,
and their size is at most

    max(max_temp_bytes, bytes of one output row's tile)

where one output row's tile is ``(K + F) * Wo * itemsize`` bytes.  Besides
that the functions allocate only their result (and a ``(K, F)`` weight-grad
accumulator per worker in the backward).  Default:
``MAX_TEMP_BYTES`` = 64 MiB, read at call time.

Two other routes share this math.  The input gradient of a stride-1 conv with no more
output than input channels is the forward conv of the zero-padded ``dy`` with the flipped
kernel (``input_grad_by_flipped_kernel``: columns of ``F*k`` rows instead of ``C*k``, no
overlapping adds), where that measured faster and its padded ``dy`` fits the budget.  And
device arrays (CuPy) run ``_im2col_device``'s schedule of a few large operations
(``device_schedule``, ``REFIMPL_CONV_SCHEDULE``).

Transposed convolution is the input-adjoint of convolution (Chainer's
convolution_nd / deconvolution_nd): ``conv_transpose3d`` calls
``input_grad`` here, and its backward is ``forward(dy, w, g=x)`` (the conv of
``dy`` and the weight grad with the roles of ``x`` and ``dy`` swapped, sharing
one pass over the columns of ``dy``).  Everything is xp-generic
(NumPy or CuPy).
"""
from __future__ import annotations

from itertools import product

import numpy

from .. import settings
from ..backend import array_module
from . import _threads
from .routes import flipped_kernel_pays, plane_gemms_pay, width_taps_pay

#: Default bound, in bytes, on the temporary column (+ GEMM output) buffers.
MAX_TEMP_BYTES = 64 * 2**20
#: Preferred column-tile size (cache-sized tiles run faster than huge ones) ...
TARGET_TILE_BYTES = 8 * 2**20
#: ... but never fewer output positions than this per tile (small GEMMs run slowly).
MIN_TILE_POSITIONS = 2048


def device_schedule(xp):
    """Whether ``forward`` and ``backward`` run ``_im2col_device``'s schedule (a few large
    operations) instead of the CPU's (cache-sized tiles on worker threads):
    ``REFIMPL_CONV_SCHEDULE`` = device or host, or (auto, the default) where the arrays
    live on a device (CuPy, or the strict stand-in)."""
    choice = settings.env_setting("REFIMPL_CONV_SCHEDULE")
    return choice == "device" or (choice == "auto" and xp is not numpy)


def budget_or_default(max_temp_bytes):
    """The byte budget to use: the argument, or the module default read now."""
    b = MAX_TEMP_BYTES if max_temp_bytes is None else max_temp_bytes
    if isinstance(b, bool) or int(b) != b or b < 1:
        raise ValueError(f"max_temp_bytes must be a positive integer, got {max_temp_bytes!r}")
    return int(b)


# --------------------------------------------------------------------------- tiles

def tile_positions(out, k_rows, f_rows, itemsize, budget):
    """Output positions per tile: near ``TARGET_TILE_BYTES`` of columns (cache-sized),
    at least ``MIN_TILE_POSITIONS`` (GEMM-sized), at most what ``budget`` allows for
    the column tile plus an ``(F, M)`` GEMM-output tile, and never less than one row."""
    target = max(MIN_TILE_POSITIONS, TARGET_TILE_BYTES // (k_rows * itemsize))
    allowed = budget // ((k_rows + f_rows) * itemsize)
    return max(out[2], min(target, allowed))


def worker_share(n_batch, out, workers):
    """Output positions per worker when ``n_batch`` samples of ``out`` are shared evenly (at
    least 1): tiles no bigger than this give every worker a tile."""
    return max(1, -(-n_batch * out[0] * out[1] * out[2] // max(1, workers)))


def tiles(n_batch, out, positions):
    """Cut the output ``(N, Do, Ho, Wo)`` into tiles ``(n0, n1, d0, d1, h0, h1)`` of at
    most ``positions`` output positions (but at least one row): blocks of whole
    samples, else of whole depth planes of one sample, else of whole rows of one
    plane.  Every tile's ``(d, h, w)`` block of one (n, channel) is contiguous in an
    NCDHW array, so it reshapes to a GEMM operand without a copy.
    Returns (tiles, the largest tile's position count)."""
    do, ho, wo = out
    plane = ho * wo
    sample = do * plane
    if sample <= positions:
        nb = min(n_batch, positions // sample)
        t = [(n0, min(n0 + nb, n_batch), 0, do, 0, ho) for n0 in range(0, n_batch, nb)]
        return t, nb * sample
    if plane <= positions:
        nd = positions // plane
        t = [(n, n + 1, d0, min(d0 + nd, do), 0, ho)
             for n in range(n_batch) for d0 in range(0, do, nd)]
        return t, nd * plane
    nh = max(1, positions // wo)
    t = [(n, n + 1, d, d + 1, h0, min(h0 + nh, ho))
         for n in range(n_batch) for d in range(do) for h0 in range(0, ho, nh)]
    return t, nh * wo


def _valid(o0, o1, t, s, p, dl, n):
    """Outputs ``[lo, hi)`` within ``[o0, o1)`` whose tap-``t`` input lies in ``[0, n)``,
    and the input slice they read (``lo*s + t*dl - p`` on, step ``s``)."""
    off = t * dl - p                              # input index of output 0 through tap t
    lo = max(o0, -(off // s) if off < 0 else 0)   # ceil(-off / s) for off < 0
    hi = min(o1, (n - 1 - off) // s + 1 if n - 1 - off >= 0 else 0)
    if hi <= lo:
        return None
    start = lo * s + off
    return lo - o0, hi - o0, o1 - o0, slice(start, start + (hi - lo - 1) * s + 1, s)


def _taps(tile, k, s, p, dl, in_spatial, wo):
    """For every kernel tap of a tile: ``(tap, ranges, input slices)``; ``ranges`` holds
    per axis ``(lo, hi, extent)`` of the tile's outputs that read real input through
    this tap (the rest read zero padding); ``None`` when the tap reads padding only."""
    _, _, d0, d1, h0, h1 = tile
    per_axis = [[_valid(o0, o1, t, ss, pp, dd, n) for t in range(kk)]
                for (o0, o1), kk, ss, pp, dd, n
                in zip(((d0, d1), (h0, h1), (0, wo)), k, s, p, dl, in_spatial)]
    for a, b, e in product(range(k[0]), range(k[1]), range(k[2])):
        r = (per_axis[0][a], per_axis[1][b], per_axis[2][e])
        if None in r:
            yield (a, b, e), None, None
        else:
            yield (a, b, e), tuple(v[:3] for v in r), tuple(v[3] for v in r)


# ------------------------------------------------------------------ im2col / col2im
#
# A tile's column buffer is viewed as  col[c, a, b, e, n, d, h, w]  (rows (c, a, b, e),
# columns (n, d, h, w)): the GEMM sees it as (K, nb*M) with no copy.

def im2col(x, col, tile, k, s, p, dl):
    """Fill ``col`` (C, kd, kh, kw, nb, dch, hch, Wo) with the tile's columns of ``x``."""
    n0, n1 = tile[:2]
    for tap, ranges, src in _taps(tile, k, s, p, dl, x.shape[2:], col.shape[-1]):
        dst = col[(slice(None),) + tap]                    # (C, nb, dch, hch, Wo)
        if ranges is None:
            dst[...] = 0
            continue
        # zero the padding border of this tap (the buffer is reused between tiles)
        for ax, (lo, hi, ext) in enumerate(ranges):
            lead = (slice(None),) * (2 + ax)
            if lo > 0:
                dst[lead + (slice(0, lo),)] = 0
            if hi < ext:
                dst[lead + (slice(hi, ext),)] = 0
        box = tuple(slice(lo, hi) for lo, hi, _ in ranges)
        dst[(slice(None), slice(None)) + box] = \
            x[(slice(n0, n1), slice(None)) + src].transpose(1, 0, 2, 3, 4)


def col2im(dx, col, tile, k, s, p, dl):
    """``dx[the tile's inputs] +=`` the tile's columns ``col`` (C, kd, kh, kw, nb, dch, hch, Wo).

    Taps are added one after another: their input slices overlap."""
    n0, n1 = tile[:2]
    for tap, ranges, src in _taps(tile, k, s, p, dl, dx.shape[2:], col.shape[-1]):
        if ranges is None:
            continue
        box = tuple(slice(lo, hi) for lo, hi, _ in ranges)
        dx[(slice(n0, n1), slice(None)) + src] += \
            col[(slice(None),) + tap + (slice(None),) + box].transpose(1, 0, 2, 3, 4)


# ------------------------------------------------------------------------- GEMMs

class _Plan:
    """Tiles and reusable buffers for one call: one column (+ staging) buffer per worker
    thread, the budget shared among them (``_threads``).  The tiles of a forward or a
    weight gradient are independent and split among the workers; col2im's tiles
    overlap in ``dx``, so there the workers split the input channels instead
    (``channel_blocks``: each worker's column buffer holds the rows of at most
    ``ceil(C / channel_blocks)`` channels, and every worker runs every tile)."""

    def __init__(self, xp, dtype, n_batch, c, f, k, out, budget, workers=1, channel_blocks=None):
        self.c, self.f, self.k = c, f, tuple(k)
        self.kk = c * k[0] * k[1] * k[2]
        self.out = tuple(out)
        rows = self.kk if channel_blocks is None else -(-c // channel_blocks) * (self.kk // c)
        pos = tile_positions(out, rows, f, dtype.itemsize, max(1, budget // max(1, workers)))
        if channel_blocks is None:          # a tile per worker at least (small layers: 2 x 16^3)
            pos = min(pos, worker_share(n_batch, out, workers))
        self.tiles, tpos = tiles(n_batch, out, pos)
        self.workers = max(1, min(workers, len(self.tiles)) if channel_blocks is None else workers)
        multi = any(t[1] - t[0] > 1 for t in self.tiles)
        self.col_bufs = [xp.empty(tpos * rows, dtype=dtype) for _ in range(self.workers)]
        # (F, nb*M) staging for tiles of several samples (one sample: the array itself)
        self.f_bufs = [xp.empty(tpos * f, dtype=dtype) if multi else None for _ in range(self.workers)]

    def col(self, tile, worker=0, channels=None):
        """The tile's column buffer (C, kd, kh, kw, nb, dch, hch, Wo); ``channels``: only
        that many input channels' rows (a worker's channel block)."""
        n0, n1, d0, d1, h0, h1 = tile
        c = self.c if channels is None else channels
        shape = (c,) + self.k + (n1 - n0, d1 - d0, h1 - h0, self.out[2])
        size = c * (self.kk // self.c) * (n1 - n0) * (d1 - d0) * (h1 - h0) * self.out[2]
        return self.col_bufs[worker][:size].reshape(shape)

    def staging(self, tile, m, worker=0):
        nb = tile[1] - tile[0]
        return self.f_bufs[worker][:self.f * nb * m].reshape(self.f, nb, m)


def _block(a, tile):
    n0, n1, d0, d1, h0, h1 = tile
    return a[n0:n1, :, d0:d1, h0:h1, :]


def _fm_view(a, tile):
    """The one-sample tile of NCDHW ``a`` as an (F, M) view (see ``tiles``)."""
    n0, n1, d0, d1, h0, h1 = tile
    return a[n0, :, d0:d1, h0:h1, :].reshape(a.shape[1], -1)


def _fm_read(a, tile, plan, m, worker=0):
    """The tile of ``a`` as (F, nb*M): a view for one sample, a staged copy for several."""
    if tile[1] - tile[0] == 1:
        return _fm_view(a, tile)
    st = plan.staging(tile, m, worker)
    st[...] = _block(a, tile).reshape(tile[1] - tile[0], a.shape[1], m).transpose(1, 0, 2)
    return st.reshape(a.shape[1], -1)


def forward(x, w, stride, padding, dilation, out_spatial, budget, g=None):
    """``y = conv3d(x, w)`` without bias, for the outputs ``out_spatial`` (the first
    ``out_spatial`` positions per axis; all of them in an ordinary conv).

    With ``g`` (an output gradient of shape ``(N, F) + out_spatial``) also
    returns ``dW = weight_grad(g, x)``, sharing the column tiles: ``(y, dW)``.
    conv_transpose3d's backward is exactly this pair.
    """
    xp = array_module(x, w)
    if device_schedule(xp):
        return _im2col_device.forward(x, w, stride, padding, dilation, out_spatial, budget, g)
    n_b, c = x.shape[:2]
    f, k = w.shape[0], tuple(w.shape[2:])
    y = xp.empty((n_b, f) + tuple(out_spatial), dtype=x.dtype)   # every tile writes its block
    kk = c * k[0] * k[1] * k[2]
    if not (y.size and x.size):
        y[...] = 0
        return y if g is None else (y, xp.zeros(w.shape, dtype=x.dtype))
    if g is None and _pointwise_conv.applies(k, stride, padding):
        return _pointwise_conv.forward(x, w, y)
    workers = _threads.thread_count(xp)
    tile_bytes = FORWARD_TILE_BYTES if g is None else TARGET_TILE_BYTES
    phases = None if g is not None else _phase_grid.ForwardPlan.build(
        xp, x.dtype, n_b, c, f, k, stride, padding, dilation, out_spatial, budget, workers, tile_bytes)
    if phases is not None:
        return _phase_grid.forward(x, w, y, phases)
    widths = None if g is not None or not width_taps_pay(c, f, k, dilation, out_spatial) else \
        _width_taps.ForwardPlan.build(xp, x.dtype, n_b, c, f, k, stride, padding, dilation,
                                      tuple(x.shape[2:]), out_spatial, budget, workers)
    if widths is not None:
        return _width_taps.forward(x, w, y, widths)
    taps = _DepthTapPlan.build(xp, x.dtype, n_b, c, f, k, stride, dilation, out_spatial, budget,
                               workers, tile_bytes, forward_only=g is None)
    if taps is not None:
        return _forward_depth_taps(x, w, stride, padding, dilation, y, taps, g)
    w2 = xp.ascontiguousarray(w).reshape(f, kk)
    plan = _Plan(xp, x.dtype, n_b, c, f, k, out_spatial, budget, _threads.thread_count(xp))
    dwts = [None if g is None else xp.zeros((kk, f), dtype=x.dtype)   # dW^T: col @ g^T, per worker
            for _ in range(plan.workers)]

    def one(worker, tile):
        col = plan.col(tile, worker)
        im2col(x, col, tile, k, stride, padding, dilation)
        nb = tile[1] - tile[0]
        col2 = col.reshape(kk, -1)
        m = col2.shape[1] // nb
        if g is not None:                           # reads the staging buffer first ...
            dwts[worker] += xp.matmul(col2, _fm_read(g, tile, plan, m, worker).T)
        if nb == 1:
            xp.matmul(w2, col2, out=_fm_view(y, tile))
        else:                                       # ... which then takes the GEMM output
            st = plan.staging(tile, m, worker)
            xp.matmul(w2, col2, out=st.reshape(f, -1))
            blk = _block(y, tile)
            blk[...] = st.transpose(1, 0, 2).reshape(blk.shape)
    _threads.run(one, plan.tiles, plan.workers)
    return y if g is None else (y, _sum_transposed(dwts, w.shape))


def _sum_transposed(dwts, shape):
    """The per-worker dW^T (K, F) accumulators, summed in worker order, as dW of ``shape``."""
    return transposed(_threads.sum_in_order(dwts)).reshape(tuple(shape))


#: Rows of the (K, F) array per block of ``transposed``.
TRANSPOSE_ROWS = 64


def transposed(a):
    """``a.T`` of a 2-D array as a new C-contiguous array, copied ``TRANSPOSE_ROWS`` rows of ``a``
    at a time.  Why: NumPy's copy of a transposed (2048, 512) float32 array (a weight gradient
    dW^T of 256 -> 512 channels, k 2) took 7 ms, in blocks 0.8 ms (docs/benchmarks.md, "Kernel
    choices"); small arrays take the same either way."""
    xp = array_module(a)
    if xp is not numpy:
        return xp.ascontiguousarray(a.T)
    k, f = a.shape
    out = numpy.empty((f, k), dtype=a.dtype)
    for i in range(0, k, TRANSPOSE_ROWS):
        out[:, i:i + TRANSPOSE_ROWS] = a[i:i + TRANSPOSE_ROWS].T
    return out


def backward(dy, x, w, stride, padding, dilation, budget, need_dx=True, need_dw=True,
             flipped=None):
    """``(dx, dW)`` of ``y = conv3d(x, w)`` for the outputs ``dy`` covers.

    Shares the column tiles: ``dW += dy @ col^T``, then the same buffer takes
    ``dcol = W^T @ dy`` and is added back into ``dx`` (col2im).  Either result
    may be skipped (``None``): ``need_dx=False`` is ``weight_grad`` (``w`` is
    then only a shape), ``need_dw=False`` is ``input_grad`` (``x`` is then only
    a shape and dtype: it is not read).

    Threads: col2im's tiles overlap in ``dx``, so with ``need_dx`` the worker
    threads split the *input channels* instead of the tiles: worker ``w`` owns
    channels ``[c0, c1)``, i.e. the rows ``[c0*T, c1*T)`` of ``col``, ``dcol``
    and ``dW^T`` (``T = kd*kh*kw`` taps) and the channels ``[c0, c1)`` of
    ``dx``, and runs every tile for them in order.  Nothing is shared between
    workers, so no partial sums are needed.  Without ``need_dx`` the tiles are
    independent and split among the workers, each with its own ``dW^T``.

    ``flipped``: whether dx is taken as the conv with the flipped kernel, when the caller
    has decided it already (``flipped_kernel_pays``; None: decided here).
    """
    xp = array_module(dy, x, w)
    on_device = device_schedule(xp)
    if (not on_device and _pointwise_conv.applies(tuple(w.shape[2:]), stride, padding)
            and tuple(dy.shape[2:]) == tuple(x.shape[2:])):
        return _pointwise_conv.backward(dy, x, w, need_dx, need_dw)
    if flipped is None:
        flipped = need_dx and flipped_kernel_pays(dy, w, x.shape, stride, budget, on_device)

    def with_dw(dx):
        """``(dx, dW)`` for a dx taken by its own route: dW by the tiles below (need_dx=False)."""
        return dx, (backward(dy, x, w, stride, padding, dilation, budget, need_dx=False)[1]
                    if need_dw else None)
    if flipped:
        return with_dw(input_grad_by_flipped_kernel(dy, w, tuple(x.shape[2:]), padding, dilation,
                                                    budget))
    if on_device:
        return _im2col_device.backward(dy, x, w, stride, padding, dilation, budget, need_dx, need_dw)
    n_b, c = x.shape[:2]
    f, k = w.shape[0], tuple(w.shape[2:])
    workers = _threads.thread_count(xp)
    if need_dx and windows_tile(k, stride, padding, dilation):
        return with_dw(input_grad_without_overlap(dy, w, tuple(x.shape), budget))
    if need_dx and dy.size and x.shape[0] * c:
        by_phases = _phase_grid.InputGradPlan.build(xp, dy.dtype, n_b, c, f, k, stride, padding,
                                                    dilation, tuple(x.shape[2:]), budget, workers,
                                                    FORWARD_TILE_BYTES)
        if by_phases is not None:
            return with_dw(_phase_grid.input_grad(dy, w, tuple(x.shape), by_phases))
    taps = k[0] * k[1] * k[2]
    kk = c * taps
    out_spatial = tuple(dy.shape[2:])
    dx = xp.zeros(tuple(x.shape), dtype=dy.dtype) if need_dx else None
    if not (dy.size and (need_dw or dx.size) and (not need_dw or x.size)):
        return dx, (xp.zeros(tuple(w.shape), dtype=dy.dtype) if need_dw else None)
    # W as (F, K): a block of its columns, transposed, is W^T's rows as a GEMM reads them (no
    # transposed copy of W: NumPy's transposing copy of a 4 MB weight took up to 7 ms)
    if need_dx:
        w2 = xp.ascontiguousarray(w).reshape(f, kk)
        nblocks = min(workers, c)
        blocks = [(c * i // nblocks, c * (i + 1) // nblocks) for i in range(nblocks)]
        plan = _Plan(xp, dy.dtype, n_b, c, f, k, out_spatial, budget, nblocks, channel_blocks=nblocks)
        dwt = xp.zeros((kk, f), dtype=dy.dtype) if need_dw else None     # dW^T, rows split

        def channels(worker, block):
            c0, c1 = block
            rows = slice(c0 * taps, c1 * taps)
            for tile in plan.tiles:
                col = plan.col(tile, worker, channels=c1 - c0)
                col2 = col.reshape((c1 - c0) * taps, -1)
                m = col2.shape[1] // (tile[1] - tile[0])
                dyt = _fm_read(dy, tile, plan, m, worker)
                if need_dw:
                    im2col(x[:, c0:c1], col, tile, k, stride, padding, dilation)
                    dwt[rows] += xp.matmul(col2, dyt.T)
                xp.matmul(w2[:, rows].T, dyt, out=col2)
                col2im(dx[:, c0:c1], col, tile, k, stride, padding, dilation)
        _threads.run(channels, blocks, len(blocks))
        return dx, (transposed(dwt).reshape(tuple(w.shape)) if need_dw else None)

    by_phases = _phase_grid.ForwardPlan.build(xp, dy.dtype, n_b, c, f, k, stride, padding, dilation,
                                              out_spatial, budget, workers, FORWARD_TILE_BYTES)
    if by_phases is not None:
        return dx, _phase_grid.weight_grad(dy, x, w.shape, by_phases)
    widths = None if not width_taps_pay(c, f, k, dilation, out_spatial, weight_grad=True) else \
        _width_taps.ForwardPlan.build(xp, dy.dtype, n_b, c, f, k, stride, padding, dilation, tuple(x.shape[2:]),
                                      out_spatial, budget, workers)
    if widths is not None:
        return dx, _width_taps.weight_grad(dy, x, w.shape, widths)
    taps_plan = _DepthTapPlan.build(xp, dy.dtype, n_b, c, f, k, stride, dilation, out_spatial,
                                    budget, workers, weight_grad_only=True)
    if taps_plan is not None:
        return dx, _weight_grad_depth_taps(dy, x, w.shape, stride, padding, dilation, taps_plan)
    plan = _Plan(xp, dy.dtype, n_b, c, f, k, out_spatial, budget, workers)
    dwts = [xp.zeros((kk, f), dtype=dy.dtype) for _ in range(plan.workers)]  # dW^T = sum col @ dy^T

    def one(worker, tile):
        col = plan.col(tile, worker)
        col2 = col.reshape(kk, -1)
        m = col2.shape[1] // (tile[1] - tile[0])
        im2col(x, col, tile, k, stride, padding, dilation)
        dwts[worker] += xp.matmul(col2, _fm_read(dy, tile, plan, m, worker).T)
    _threads.run(one, plan.tiles, plan.workers)
    return dx, _sum_transposed(dwts, w.shape)


# ---------------------------------------------- windows that tile the input: no col2im adds

def windows_tile(k, stride, padding, dilation):
    """Whether the windows of a conv tile its input: kernel = stride on every axis, no padding,
    no dilation (the U-Net's k2 s2 down- and up-sampling).  Then every input position is read
    by at most one (output, tap) pair."""
    return (tuple(k) == tuple(stride) and not any(padding) and all(d == 1 for d in dilation))


def input_grad_without_overlap(dy, w, input_shape, budget):
    """``dx`` of a conv whose windows tile the input (``windows_tile``), and so the forward of
    the matching transposed conv.  Input ``i = j*k + t`` is read only by output ``j`` through
    tap ``t``, so per tile of outputs

        Z (C*T, M) = W^T (C*T, F) @ dy (F, M),     dx[c, j*k + t] = Z[(c, t), j]

    and each of the ``T`` taps' rows is *written* into ``dx`` with one strided copy (step
    ``k``): no zeroed ``dx`` and no col2im adds (those take about three times as long:
    docs/benchmarks.md, "Kernel choices").  Inputs past the last
    window (an odd extent) are zero.  The tiles (of whole planes or rows of one sample) write
    disjoint parts of ``dx`` and run on the worker threads; each worker's ``Z`` buffer is
    within its share of ``budget`` (one output row at least)."""
    xp = array_module(dy, w)
    n_b, f = dy.shape[:2]
    c, k = w.shape[1], tuple(w.shape[2:])
    taps = k[0] * k[1] * k[2]
    out = tuple(dy.shape[2:])
    dx = xp.empty(tuple(input_shape), dtype=dy.dtype)
    for ax, (kk, j, n) in enumerate(zip(k, out, input_shape[2:])):
        if n > kk * j:                                     # inputs no window reads
            dx[(slice(None),) * (2 + ax) + (slice(kk * j, n),)] = 0
    if not (dy.size and dx.size):
        return dx
    workers = _threads.thread_count(xp)
    wt = xp.ascontiguousarray(w).reshape(f, c * taps).T                # (C*T, F), a transposed view
    per_worker = max(1, budget // max(1, workers))
    positions = max(out[2], min(out[0] * out[1] * out[2], per_worker // (c * taps * dy.dtype.itemsize)))
    positions = min(positions, max(out[2], worker_share(n_b, out, workers)))
    cut, most = tiles(n_b, out, positions)
    workers = max(1, min(workers, len(cut)))
    bufs = [xp.empty(c * taps * most, dtype=dy.dtype) for _ in range(workers)]

    def one(worker, tile):
        n, _, d0, d1, h0, h1 = tile
        dyv = _fm_view(dy, tile)                                        # (F, M)
        z = bufs[worker][:c * taps * dyv.shape[1]].reshape(c * taps, -1)
        xp.matmul(wt, dyv, out=z)
        z = z.reshape((c,) + k + (d1 - d0, h1 - h0, out[2]))            # (C, kd, kh, kw, nd, nh, Jw)
        for a, b, e in product(range(k[0]), range(k[1]), range(k[2])):
            dx[n, :, d0 * k[0] + a:d1 * k[0]:k[0], h0 * k[1] + b:h1 * k[1]:k[1],
               e:out[2] * k[2]:k[2]] = z[:, a, b, e]
    _threads.run(one, cut, workers)
    return dx


# --------------------------------------------------------- stride 1: dx as a forward conv

def placed(a, offsets, ext):
    """A zero array ``(N, C) + ext`` holding ``a[..., o]`` at ``o + offset`` per spatial axis
    (an offset may be negative: what falls outside is cut off)."""
    out = array_module(a).empty(tuple(a.shape[:2]) + tuple(ext), dtype=a.dtype)
    return _phase_grid.fill_grid(out, a, tuple(-o for o in offsets), (1, 1, 1))


def input_grad_by_flipped_kernel(dy, w, in_spatial, padding, dilation, budget):
    """``dx`` of a stride-1 conv as a forward conv (one strided copy and one GEMM per tile,
    no col2im).  Output ``o`` reads input ``i = o + t*dl - p`` through tap ``t``, so

        dx[c, i] = sum_{f, t} dy[f, i + p - t*dl] W[f, c, t]
                 = sum_{f, u} Z[f, i + u*dl] W[f, c, k-1-u]          (u = k-1-t)

    with ``Z[j] = dy[j - (k-1)*dl + p]`` (zero outside ``dy``) of extent ``n + (k-1)*dl``:
    the valid (unpadded) conv of ``Z`` with the flipped, transposed kernel
    ``W'[c, f, u] = W[f, c, k-1-u]``, whose output extent is ``n``.  A negative offset
    ``(k-1)*dl - p`` drops outputs that read padding only; a ``dy`` shorter than the conv's
    outputs is zero beyond its end, as ``Z`` is."""
    k = tuple(w.shape[2:])
    offsets = tuple((kk - 1) * dl - p for kk, dl, p in zip(k, dilation, padding))
    ext = tuple(n + (kk - 1) * dl for n, kk, dl in zip(in_spatial, k, dilation))
    z = placed(dy, offsets, ext)                                        # (N, F) + ext
    return forward(z, flipped_kernel(w), (1, 1, 1), (0, 0, 0), dilation, tuple(in_spatial), budget)


def flipped_kernel(w):
    """The flipped, transposed kernel ``W'[c, f, u] = W[f, c, k-1-u]`` (C, F, kd, kh, kw) of a
    weight (F, C, kd, kh, kw), C-ordered: the kernel of an input gradient taken as a forward
    conv (here and in ``winograd.backward``)."""
    return array_module(w).ascontiguousarray(w.transpose(1, 0, 2, 3, 4)[:, :, ::-1, ::-1, ::-1])


# --------------------------------------------------------------- depth taps share columns
#
# With stride 1 along depth, the column rows of depth tap ``a`` are those of tap 0
# shifted by ``a*dl`` planes:  col[c, a, b, e, n, d, h, w] = hw[c, b, e, n, d + a*dl, h, w]
# where ``hw`` is the im2col of the (1, kh, kw) kernel over the tile's input planes
# ``d0 .. d1 + (kd-1)*dl`` ("hw-columns").  So one buffer of C*kh*kw rows serves every
# depth tap, and the forward is a sum of kd GEMMs, one per depth tap, each reading a
# plane-shifted view of it:
#
#     y (F, M)  = sum_a  W[:, :, a] (F, C*kh*kw) @ hw[..., a*dl : a*dl + nd, ...] (C*kh*kw, M)
#     dW[:, :, a]^T (C*kh*kw, F) += hw[..., a*dl : a*dl + nd, ...] @ dy^T (M, F)
#
# For one sample the view is a 2-D matrix with a row stride (BLAS takes it as is):
# the (c, b, e) rows are equally spaced and the (d, h, w) columns of whole planes
# (or of rows of one plane) are contiguous.  The copies shrink from kd*kh*kw taps
# per output to kh*kw taps per input plane: about kd x less column traffic, which
# is what a conv of few channels (CosmoFlow's and the U-Net's first conv: K = 108
# and 27 rows, GEMMs that are cheap next to their columns) spends its time on.
# Exact: only the order in which the kd partial sums are added changes.  The input
# gradient keeps im2col's col2im (its depth taps would add into overlapping planes).
#
# Plane-major hw-columns (the forward or the weight gradient alone, depth dilation 1, tiles of
# whole planes of one sample): stored as  hw[j, (c, b, e), h, w]  (input plane j of the tile first), the rows of
# output plane d for all kd depth taps are  (a, c, b, e) -> plane d + a, row (c, b, e):
# offset ((d + a) * rows + r) * plane = d * rows * plane + (a * rows + r) * plane, one
# contiguous (kd * C*kh*kw, Ho*Wo) block.  So each output plane is ONE GEMM with the weight
# reordered to (F, kd, C, kh, kw), written straight into y's plane: no kd partial products
# and no kd - 1 passes adding them (``routes.plane_gemms_pay`` says where that is faster).
# The weight gradient reads the same block: dW^T (kd*C*kh*kw, F) += block @ dy's plane^T.

#: Bytes of hw-columns per tile of the depth-tap *forward*: small enough to stay in the cache
#: while its kd GEMMs (F rows each: few for the narrow first convs) read it three times: with
#: larger tiles those GEMMs fall below the rate they reach on cached data.  The weight
#: gradient's GEMMs (a long sum over M) keep ``TARGET_TILE_BYTES`` tiles, which run them
#: faster (measured: docs/benchmarks.md, "Kernel choices").
FORWARD_TILE_BYTES = 2 * 2**20
#: Depth planes per tile when a tile holds part of a plane: enough that the ``reach``
#: extra planes of hw-columns cost little (copies (planes + reach) / planes).
DEPTH_TAP_PLANES = 8


def depth_tap_tiles(n_batch, out, reach, positions):
    """Tiles ``(n0, n1, d0, d1, h0, h1)`` of about ``positions`` output positions for the
    depth-tap schedule (their hw-columns reach ``reach`` planes deeper): whole samples while
    they fit, else blocks of whole planes of one sample at least ``2 * reach`` deep, else
    blocks of ``DEPTH_TAP_PLANES`` planes by as many rows as fit (at least one; fewer
    planes where one row that deep does not fit).  None when the tiles would be shallower
    than ``reach`` (then the hw-columns would copy as much as im2col's)."""
    do, ho, wo = out
    plane = ho * wo
    if do < reach:
        return None
    if do * plane <= positions:
        nb = min(n_batch, positions // (do * plane))
        return [(n0, min(n0 + nb, n_batch), 0, do, 0, ho) for n0 in range(0, n_batch, nb)]
    nd = positions // plane
    if nd >= max(1, 2 * reach):
        return [(n, n + 1, d0, min(d0 + nd, do), 0, ho) for n in range(n_batch) for d0 in range(0, do, nd)]
    nd = min(do, max(DEPTH_TAP_PLANES, 2 * reach))
    if nd * wo > positions:                           # not one row that deep: shallower tiles
        nd = positions // wo
        if nd < max(1, reach):
            return None
    hch = min(ho, max(1, positions // (nd * wo)))
    return [(n, n + 1, d0, min(d0 + nd, do), h0, min(h0 + hch, ho))
            for n in range(n_batch) for d0 in range(0, do, nd) for h0 in range(0, ho, hch)]


def _y_view(tile, out):
    """Whether a tile's block ``(F, nd, hch, Wo)`` of one sample of an NCDHW array reshapes
    to an (F, M) view: whole rows of one plane, or whole planes."""
    return tile[3] - tile[2] == 1 or tile[5] - tile[4] == out[1]


class _DepthTapPlan:
    """Tiles and per-worker buffers of the depth-tap forward / weight gradient: one
    hw-column buffer (C*kh*kw rows over the tile's extended planes) and one (F, M)
    product buffer per worker, plus an (F, M) accumulator where a tile's block of ``y``
    is no (F, M) view (several planes by part of their rows: ``depth_tap_tiles``).
    ``build`` returns None where it does not apply or would not pay: a depth stride other
    than 1, one depth tap, or tiles (within the budget im2col's plan obeys) shallower than
    the taps' reach ``(kd-1)*dl`` (then the hw-columns would copy as much as im2col's
    columns).  ``tile_bytes``: the hw-columns per tile to aim for (``FORWARD_TILE_BYTES``
    for a forward alone, else ``TARGET_TILE_BYTES``).  ``forward_only`` / ``weight_grad_only``:
    the plan serves that pass alone, which then takes plane-major hw-columns where
    ``plane_gemms_pay`` (one GEMM per output plane, ``_forward_plane_gemms`` and the plane
    branch of ``_weight_grad_depth_taps``)."""

    @classmethod
    def build(cls, xp, dtype, n_batch, c, f, k, stride, dilation, out, budget, workers,
              tile_bytes=None, forward_only=False, weight_grad_only=False):
        reach = (k[0] - 1) * dilation[0]
        if k[0] == 1 or stride[0] != 1:
            return None
        rows = c * k[1] * k[2]
        itemsize = dtype.itemsize
        per_worker = max(1, budget // max(1, workers))
        # the bound of im2col's plan: the budget, or one output row's (K + F) * Wo tile
        allowed = max(per_worker, (rows * k[0] + f) * out[2] * itemsize)
        plane = out[1] * out[2]
        if (forward_only or weight_grad_only) and dilation[0] == 1 and plane_gemms_pay(plane):
            # plane-major: tiles of whole planes of one sample, about TARGET_TILE_BYTES of hw-columns
            nd = min(out[0], max(1, TARGET_TILE_BYTES // (rows * plane * itemsize) - reach))
            if (nd + reach) * rows * plane * itemsize <= allowed:
                tl = [(n, n + 1, d0, min(d0 + nd, out[0]), 0, out[1])
                      for n in range(n_batch) for d0 in range(0, out[0], nd)]
                return cls._made(xp, dtype, rows, reach, k, out, tl, nd * plane, f, workers,
                                 (nd + reach) * rows * plane, staged=False, plane_major=True)
        positions = max(1, (tile_bytes or TARGET_TILE_BYTES) // (rows * itemsize))
        positions = min(positions, worker_share(n_batch, out, workers))   # a tile per worker at least
        smallest = max(1, reach) * out[2]                # one row, as few planes as pay
        while True:                 # the hw-columns reach past the tile: shrink it to fit
            tl = depth_tap_tiles(n_batch, out, reach, max(positions, smallest))
            if tl is None:
                return None
            tpos = max((t[1] - t[0]) * (t[3] - t[2]) * (t[5] - t[4]) for t in tl) * out[2]
            size = max((t[1] - t[0]) * (t[3] - t[2] + reach) * (t[5] - t[4]) for t in tl) * out[2] * rows
            staged = not all(_y_view(t, out) for t in tl)
            if (size + (1 + staged) * tpos * f) * itemsize <= allowed:
                break
            if positions <= smallest:
                return None
            positions //= 2
        return cls._made(xp, dtype, rows, reach, k, out, tl, tpos, f, workers, size, staged)

    @classmethod
    def _made(cls, xp, dtype, rows, reach, k, out, tl, tpos, f, workers, size, staged, plane_major=False):
        plan = cls()
        plan.rows, plan.reach, plan.k, plan.out, plan.tiles = rows, reach, tuple(k), tuple(out), tl
        plan.tpos, plan.f, plan.plane_major = tpos, f, plane_major
        plan.workers = max(1, min(workers, len(tl)))
        plan.hw_bufs = [xp.empty(size, dtype=dtype) for _ in range(plan.workers)]
        # (F, M) product and, for tiles whose block of y is no (F, M) view, (F, M) accumulator;
        # none plane-major (its GEMMs write y's planes)
        plan.f_bufs = [xp.empty(0 if plane_major else (1 + staged) * tpos * f, dtype=dtype)
                       for _ in range(plan.workers)]
        return plan

    def product(self, worker, m):
        """The worker's (F, m) product buffer."""
        return self.f_bufs[worker][:self.f * m].reshape(self.f, m)

    def accumulator(self, worker, m):
        """The worker's (F, m) accumulator, for tiles whose block of ``y`` is no (F, M) view."""
        return self.f_bufs[worker][self.f * self.tpos:self.f * (self.tpos + m)].reshape(self.f, m)

    def hw_columns(self, x, tile, worker, padding, stride, dilation):
        """The tile's hw-columns of ``x``, (C*kh*kw, nb, nd + reach, hch, Wo), filled."""
        n0, n1, d0, d1, h0, h1 = tile
        ext = (n0, n1, d0, d1 + self.reach, h0, h1)
        c = x.shape[1]
        shape = (c, 1) + self.k[1:] + (n1 - n0, d1 - d0 + self.reach, h1 - h0, self.out[2])
        size = self.rows * (n1 - n0) * (d1 - d0 + self.reach) * (h1 - h0) * self.out[2]
        hw = self.hw_bufs[worker][:size].reshape(shape)
        im2col(x, hw, ext, (1,) + self.k[1:], (1,) + tuple(stride[1:]), padding,
               (1,) + tuple(dilation[1:]))
        return hw.reshape((self.rows,) + shape[4:])

    def hw_planes(self, x, tile, worker, padding, stride, dilation):
        """The one-sample tile's hw-columns plane-major, (nd + reach, C*kh*kw, Ho*Wo), filled:
        ``im2col`` writes through a view in its (C, 1, kh, kw, 1, planes, Ho, Wo) order."""
        n0, n1, d0, d1, h0, h1 = tile
        planes, c = d1 - d0 + self.reach, x.shape[1]
        buf = self.hw_bufs[worker][:planes * self.rows * (h1 - h0) * self.out[2]]
        view = buf.reshape((planes, c, 1) + self.k[1:] + (1, h1 - h0, self.out[2])).transpose(1, 2, 3, 4, 5, 0, 6, 7)
        im2col(x, view, (n0, n1, d0, d1 + self.reach, h0, h1), (1,) + self.k[1:],
               (1,) + tuple(stride[1:]), padding, (1,) + tuple(dilation[1:]))
        return buf.reshape(planes, self.rows, -1)

    def tap(self, hw, i, a, dl, nd):
        """Depth tap ``a`` of sample ``i`` of the tile: a (C*kh*kw, M) view of ``hw``."""
        return hw[:, i, a * dl:a * dl + nd].reshape(self.rows, -1)


def _forward_plane_gemms(x, w, stride, padding, dilation, y, plan):
    """``forward`` by plane-major hw-columns (see above): per output plane one GEMM
    ``W (F, kd*C*kh*kw) @ hw[d : d + kd]`` (kd*C*kh*kw, Ho*Wo) into y's plane."""
    xp = array_module(x, w)
    f, kd = w.shape[0], w.shape[2]
    w_planes = xp.ascontiguousarray(w.transpose(0, 2, 1, 3, 4)).reshape(f, kd * plan.rows)   # (F, kd, C, kh, kw)

    def one(worker, tile):
        n, _, d0, d1 = tile[:4]
        hw = plan.hw_planes(x, tile, worker, padding, stride, dilation)      # (planes, rows, Ho*Wo)
        flat = hw.reshape(hw.shape[0] * plan.rows, -1)
        for d in range(d1 - d0):
            xp.matmul(w_planes, flat[d * plan.rows:(d + kd) * plan.rows],
                      out=y[n, :, d0 + d].reshape(f, -1))                 # (F, Ho*Wo) view of y
    _threads.run(one, plan.tiles, plan.workers)
    return y


def _forward_depth_taps(x, w, stride, padding, dilation, y, plan, g=None):
    """``forward`` by depth taps (see above), filling ``y``; with ``g`` also ``dW``."""
    xp = array_module(x, w)
    f = w.shape[0]
    kd, dl = w.shape[2], dilation[0]
    if g is None and plan.plane_major:
        return _forward_plane_gemms(x, w, stride, padding, dilation, y, plan)
    wa = xp.ascontiguousarray(w.transpose(2, 0, 1, 3, 4)).reshape(kd, f, plan.rows)   # W[:, :, a]
    dwts = [None if g is None else xp.zeros((kd, plan.rows, f), dtype=x.dtype)
            for _ in range(plan.workers)]

    def one(worker, tile):
        n0, n1, d0, d1, h0, h1 = tile
        hw = plan.hw_columns(x, tile, worker, padding, stride, dilation)
        nd = d1 - d0
        whole_rows = _y_view(tile, y.shape[2:])      # then y's block is an (F, M) view
        for i in range(n1 - n0):
            block = y[n0 + i, :, d0:d1, h0:h1, :]                         # (F, nd, hch, Wo)
            m = block[0].size
            yv = block.reshape(f, m) if whole_rows else plan.accumulator(worker, m)
            prod = plan.product(worker, m)
            gv = None if g is None else g[n0 + i, :, d0:d1, h0:h1, :].reshape(f, m)
            for a in range(kd):
                col = plan.tap(hw, i, a, dl, nd)                        # (C*kh*kw, M) view
                if gv is not None:
                    dwts[worker][a] += xp.matmul(col, gv.T)
                if a == 0:
                    xp.matmul(wa[0], col, out=yv)
                else:
                    xp.matmul(wa[a], col, out=prod)
                    yv += prod
            if not whole_rows:
                block[...] = yv.reshape(block.shape)
    _threads.run(one, plan.tiles, plan.workers)
    if g is None:
        return y
    return y, _depth_taps_weight(_threads.sum_in_order(dwts), w.shape)


def _depth_taps_weight(dwt, shape):
    """(kd, C*kh*kw, F) per-tap dW^T as dW (F, C, kd, kh, kw): the blocked transpose to
    (F, kd, C*kh*kw), then a copy that moves runs of kh*kw."""
    xp = array_module(dwt)
    f, c, kd, kh, kw = shape
    d = transposed(dwt.reshape(-1, f)).reshape(f, kd, c, kh, kw)
    return xp.ascontiguousarray(d.transpose(0, 2, 1, 3, 4))


def _weight_grad_depth_taps(dy, x, weight_shape, stride, padding, dilation, plan):
    """``dW`` of ``conv3d`` by depth taps: the tiles split among the workers, each with its
    own per-tap accumulator (summed in worker order).

    Plane-major hw-columns (``plan.plane_major``): per output plane one GEMM
    ``dW^T (kd*C*kh*kw, F) += hw[d : d + kd] (kd*C*kh*kw, Ho*Wo) @ dy[n, :, d]^T`` (the forward's
    plane GEMM, transposed): all kd depth taps in one call, so the plane of ``dy`` is read once
    instead of kd times, and the GEMM's output is kd times taller (a narrow conv's dW GEMMs,
    16 x 32 over 16384 positions, ran at a third of the rate; docs/benchmarks.md, "Kernel
    choices")."""
    xp = array_module(dy, x)
    f = weight_shape[0]
    kd, dl = weight_shape[2], dilation[0]
    dwts = [xp.zeros((kd, plan.rows, f), dtype=dy.dtype) for _ in range(plan.workers)]

    def plane_gemms(worker, tile):
        n, _, d0, d1 = tile[:4]
        hw = plan.hw_planes(x, tile, worker, padding, stride, dilation)      # (planes, rows, Ho*Wo)
        flat = hw.reshape(hw.shape[0] * plan.rows, -1)
        acc = dwts[worker].reshape(kd * plan.rows, f)                        # (kd, rows, F) as one
        for d in range(d1 - d0):
            acc += xp.matmul(flat[d * plan.rows:(d + kd) * plan.rows], dy[n, :, d0 + d].reshape(f, -1).T)

    def one(worker, tile):
        n0, n1, d0, d1, h0, h1 = tile
        hw = plan.hw_columns(x, tile, worker, padding, stride, dilation)
        for i in range(n1 - n0):
            gv = dy[n0 + i, :, d0:d1, h0:h1, :].reshape(f, -1)          # (F, M) view
            for a in range(kd):
                dwts[worker][a] += xp.matmul(plan.tap(hw, i, a, dl, d1 - d0), gv.T)
    _threads.run(plane_gemms if plan.plane_major else one, plan.tiles, plan.workers)
    return _depth_taps_weight(_threads.sum_in_order(dwts), weight_shape)


from . import _im2col_device, _phase_grid, _pointwise_conv, _width_taps  # noqa: E402  (the first imports ``tiles`` from here)
