"""Strided convolution by input phases: the host's im2col route where windows overlap along a
strided axis (a 3x3x3 conv of stride 2, say).

Why.  im2col gathers a stride-2 conv's columns with a step of 2 along every axis, and NumPy
copies them one output row at a time (17 elements for a 33^3 input): about 2.5 ns per element
on the 2-core VM of docs/benchmarks.md, against 0.2 ns for long contiguous runs.  Its input
gradient adds the columns back with the same strides (col2im), one tap after another.  For the
issue-9 row (N=2, 32->32, 33^3, k3 s2 p1) those two passes were as long as its GEMMs.

The math, per axis (input extent ``n``, kernel ``k``, stride ``s``, padding ``p``, dilation
``dl``): output ``o`` reads input ``i = o*s + t*dl - p`` through tap ``t``.  Write
``t*dl = q*s + r`` with ``0 <= r < s``; then

    i + p = (o + q)*s + r,

so tap ``t`` reads the *phase* ``r`` of the zero-padded input, ``X_r[j] = x[j*s + r - p]``
(zero outside ``[0, n)``), at ``j = o + q``: a stride-1 shift by ``q``.  A strided conv is a
sum of stride-1 convs, one per phase (of the phases the taps use).

**Flat grids.**  Each phase of a sample is stored (all channels) as a grid of extents
``(Do + qd + 1, Ho + qh, Wo + qw)`` (``q*``: the largest shift per axis; the last plane stays
zero), flattened.  Output ``(d, h, w)`` sits at ``l = d*Eh*Ew + h*Ew + w`` and reads, through
tap ``t``, the phase grid at ``l + shift(t)``, ``shift(t) = q_d*Eh*Ew + q_h*Ew + q_w``.  So over
a tile of whole output planes the column row of (tap ``t``, channel ``c``) is *one contiguous
run* of a phase grid, and im2col becomes ``T*C`` long contiguous copies (``T`` taps).  The grid
positions with ``h >= Ho`` or ``w >= Wo`` are computed and dropped: ``Eh*Ew / (Ho*Wo)`` more
GEMM columns (1.12 for ``Ho = Wo = 17``, ``k = 3``, ``s = 2``).  Then, per tile::

    y_grid (F, L) = W (F, T*C) @ col (T*C, L);       y = y_grid at the valid positions

The weight gradient takes the same columns: ``dW^T (T*C, F) += col @ dy_grid^T`` with ``dy``
copied into the grid layout (zero at the dropped positions): faster than im2col's strided
gathers (docs/benchmarks.md, "Kernel choices").

**Input gradient.**  Input ``i = j*s + r - p`` is position ``j`` of phase ``r``, and

    dx_r[j] = sum over the taps t of phase r:  W_t^T (C, F) dy[j - q(t)],

a stride-1 conv of ``dy`` with the taps of that phase (stride 1 is the flipped-kernel route of
``_im2col.input_grad_by_flipped_kernel``).  With ``dy`` in a grid ``G[g] = dy[g - qmax]`` (zero
elsewhere), tap ``t`` reads ``G`` at ``l + shift'(t)``, ``shift'(t) = (qmax_d - q_d)*Gh*Gw +
(qmax_h - q_h)*Gw + (qmax_w - q_w)``: contiguous columns again, one GEMM per phase,
``dx_r (C, L) = W_r (C, T_r*F) @ col_r (T_r*F, L)``, and its valid positions are *written*
into ``dx``: every input position belongs to exactly one phase, so there are no overlapping
adds (col2im's), and positions of a phase no tap reads (``s > k`` along an axis) stay zero.

Cost: one strided pass over ``x`` (the phases) instead of ``T`` strided gathers, and one
strided write of ``dx`` instead of ``T`` strided adds; the GEMMs are im2col's (plus the grid's
dropped positions).  Exact: the same products, summed in another order.  Faster than im2col
in both passes (one-plane tiles: the GEMM's columns stay in cache), the input gradient most
(measured: docs/benchmarks.md, "Kernel choices").

Memory: the work is cut into tasks of whole output planes of one sample (a "slab": its phase
grids, built once) and column tiles of ``nd`` planes within a slab; per worker thread one
phase-grid, one column and one or two ``(F, L)`` buffers, together at most the budget's share
(``plan`` returns None where one plane does not fit: ``_im2col``'s row tiles then serve).
"""
from __future__ import annotations

from itertools import product

from ..backend import array_module
from . import _threads
from ._im2col import transposed


def axis_taps(k, s, dl):
    """Per tap ``t`` of one axis: ``(r, q)`` with ``t*dl = q*s + r``, ``0 <= r < s``."""
    return tuple((t * dl % s, t * dl // s) for t in range(k))


def overlapping(k, stride, dilation):
    """Whether windows overlap along a strided axis (``(k-1)*dl >= s > 1``): there the phase
    route saves im2col's repeated strided gathers.  Without overlap (a k2 s2 conv) im2col
    touches every input once already."""
    return any(s > 1 and (kk - 1) * dl >= s for kk, s, dl in zip(k, stride, dilation))


def _axes(k, stride, dilation):
    """Per axis the taps' ``(r, q)`` and the largest shift ``q``; None where the route does not
    apply (no overlapping windows along a strided axis)."""
    if not overlapping(k, stride, dilation):
        return None
    per_axis = [axis_taps(kk, s, dl) for kk, s, dl in zip(k, stride, dilation)]
    return per_axis, [max(q for _, q in ax) for ax in per_axis]


def fill_grid(dst, src, starts, steps):
    """``dst[..., j] = src[..., starts + j*steps]`` per spatial axis (the last three) where that
    index lies in ``src``, zero elsewhere: the one copy that builds every grid here (and
    ``_im2col.placed``'s zero-padded arrays).

    Where a border is to be zero, a C-contiguous ``dst`` is zeroed whole first: one long
    memset costs less than zeroing the border row by row (a one-element strided write per
    row along the last axis)."""
    nd = dst.ndim - 3
    box_dst, box_src, borders = [slice(None)] * nd, [slice(None)] * nd, []
    for ax, (st, sp, m, n) in enumerate(zip(starts, steps, dst.shape[nd:], src.shape[nd:])):
        j0 = min(m, -(st // sp) if st < 0 else 0)                 # first j with st + j*sp >= 0
        j1 = max(j0, min(m, (n - 1 - st) // sp + 1 if n - 1 - st >= 0 else 0))
        if j1 == j0:
            dst[...] = 0
            return dst
        lead = (slice(None),) * (nd + ax)
        if j0 > 0:
            borders.append(lead + (slice(0, j0),))
        if j1 < m:
            borders.append(lead + (slice(j1, m),))
        box_dst.append(slice(j0, j1))
        box_src.append(slice(st + j0 * sp, st + (j1 - 1) * sp + 1, sp))
    if borders and dst.flags.c_contiguous:
        dst[...] = 0
    else:
        for border in borders:
            dst[border] = 0
    dst[tuple(box_dst)] = src[tuple(box_src)]
    return dst


def _slabs(n_batch, planes, slab):
    """Tasks ``(n, p0, p1)``: blocks of ``slab`` planes of one sample."""
    return [(n, p0, min(p0 + slab, planes)) for n in range(n_batch) for p0 in range(0, planes, slab)]


def _sizes(planes, n_batch, workers, per_plane, tile_bytes, per_worker, cost):
    """``(slab, tile)`` planes: tiles of about ``tile_bytes`` (``per_plane`` bytes of columns
    each), slabs as deep as keeps every worker busy, both shrunk until ``cost(slab, tile)``
    fits ``per_worker`` bytes; None when one plane does not."""
    tile = max(1, min(planes, tile_bytes // max(1, per_plane)))
    slab = max(tile, -(-planes // max(1, -(-workers // n_batch))))
    while cost(slab, tile) > per_worker:
        if slab > tile:
            slab = max(tile, slab // 2)
        elif tile > 1:
            tile = slab = tile // 2
        else:
            return None
    return slab, tile


class ForwardPlan:
    """The phases, taps, tasks and per-worker buffers of ``forward``; ``build`` returns None
    where the route does not apply (no overlapping windows along a strided axis) or one
    output plane's work does not fit the budget."""

    @classmethod
    def build(cls, xp, dtype, n_batch, c, f, k, stride, padding, dilation, out, budget,
              workers, tile_bytes):
        axes = _axes(k, stride, dilation)
        if axes is None:
            return None
        per_axis, qmax = axes
        phases = sorted(set(product(*[sorted({r for r, _ in ax}) for ax in per_axis])))
        eh, ew = out[1] + qmax[1], out[2] + qmax[2]
        plane = eh * ew
        taps = []                                   # (phase index, shift) in (a, b, e) order
        for a, b, e in product(*[range(kk) for kk in k]):
            (rd, qd), (rh, qh), (rw, qw) = per_axis[0][a], per_axis[1][b], per_axis[2][e]
            taps.append((phases.index((rd, rh, rw)), qd * plane + qh * ew + qw))
        kk = len(taps) * c
        item = dtype.itemsize

        def cost(slab, tile):
            return item * plane * (len(phases) * c * (slab + qmax[0] + 1) + (kk + f) * tile)
        sizes = _sizes(out[0], n_batch, workers, kk * plane * item, tile_bytes,
                       max(1, budget // max(1, workers)), cost)
        if sizes is None:
            return None
        plan = cls()
        plan.slab, plan.tile = sizes
        plan.stride, plan.padding, plan.out = tuple(stride), tuple(padding), tuple(out)
        plan.c, plan.f, plan.kk, plan.qmax, plan.phases, plan.taps = c, f, kk, qmax, phases, taps
        plan.eh, plan.ew, plan.plane = eh, ew, plane
        plan.tasks = _slabs(n_batch, out[0], plan.slab)
        plan.workers = max(1, min(workers, len(plan.tasks)))
        plan.grid_bufs = [xp.empty(len(phases) * c * (plan.slab + qmax[0] + 1) * plane, dtype=dtype)
                          for _ in range(plan.workers)]
        plan.col_bufs = [xp.empty(kk * plan.tile * plane, dtype=dtype) for _ in range(plan.workers)]
        plan.f_bufs = [xp.empty(f * plan.tile * plane, dtype=dtype) for _ in range(plan.workers)]
        return plan

    def phase_grids(self, x, n, p0, p1, worker):
        """The slab's phase grids of sample ``n`` (output planes ``[p0, p1)``), filled:
        (phases, C, planes + qd + 1, Eh, Ew) flattened to (phases, C, -1)."""
        depth = p1 - p0 + self.qmax[0] + 1
        shape = (len(self.phases), self.c, depth, self.eh, self.ew)
        grids = self.grid_bufs[worker][:len(self.phases) * self.c * depth * self.plane].reshape(shape)
        s, p = self.stride, self.padding
        for i, r in enumerate(self.phases):
            fill_grid(grids[i], x[n], (p0 * s[0] + r[0] - p[0], r[1] - p[1], r[2] - p[2]), s)
        return grids.reshape(len(self.phases), self.c, -1)

    def columns(self, grids, t0, t1, worker):
        """The (T*C, L) columns of the slab's output planes ``[t0, t1)``: contiguous runs."""
        m = (t1 - t0) * self.plane
        col = self.col_bufs[worker][:self.kk * m].reshape(len(self.taps), self.c, m)
        start = t0 * self.plane
        for i, (ph, shift) in enumerate(self.taps):
            col[i] = grids[ph, :, start + shift:start + shift + m]
        return col.reshape(self.kk, m)

    def column_tiles(self, x, task, worker):
        """The task's column tiles ``(t0, t1, col)``: the (T*C, L) columns of the output planes
        ``[p0 + t0, p0 + t1)`` of sample ``n`` (``task = (n, p0, p1)``), from the slab's phase
        grids; ``col`` is the worker's buffer, valid until the next tile."""
        n, p0, p1 = task
        grids = self.phase_grids(x, n, p0, p1, worker)
        for t0 in range(0, p1 - p0, self.tile):
            t1 = min(t0 + self.tile, p1 - p0)
            yield t0, t1, self.columns(grids, t0, t1, worker)

    def f_buffer(self, worker, planes):
        """The worker's (F, planes, Eh, Ew) GEMM-output buffer."""
        size = self.f * planes * self.plane
        return self.f_bufs[worker][:size].reshape(self.f, planes, self.eh, self.ew)


def forward(x, w, y, plan):
    """``y = conv3d(x, w)`` by phases, into ``y`` (see the module docstring)."""
    xp = array_module(x, w)
    f, out = plan.f, plan.out
    w2 = xp.ascontiguousarray(w.transpose(0, 2, 3, 4, 1)).reshape(f, plan.kk)   # rows (tap, channel)

    def one(worker, task):
        n, p0, _ = task
        for t0, t1, col in plan.column_tiles(x, task, worker):         # col (T*C, L)
            yg = plan.f_buffer(worker, t1 - t0)                         # (F, planes, Eh, Ew)
            xp.matmul(w2, col, out=yg.reshape(f, -1))
            y[n, :, p0 + t0:p0 + t1] = yg[:, :, :out[1], :out[2]]      # the valid positions
    _threads.run(one, plan.tasks, plan.workers)
    return y


def weight_grad(dy, x, weight_shape, plan):
    """``dW`` of ``conv3d`` (weight of shape ``weight_shape``) by phases: the forward's columns,
    ``dW^T (T*C, F) += col (T*C, L) @ dy_grid^T (L, F)`` per tile, with ``dy`` copied into the
    grid layout of the output (zero at the positions ``h >= Ho`` or ``w >= Wo`` the grid
    computes and drops, so their columns add nothing).  One ``dW^T`` per worker, summed in
    worker order (the same bits for the same thread count)."""
    xp = array_module(dy, x)
    f, c = plan.f, plan.c
    dwts = [xp.zeros((plan.kk, f), dtype=dy.dtype) for _ in range(plan.workers)]

    def one(worker, task):
        n, p0, _ = task
        for t0, t1, col in plan.column_tiles(x, task, worker):         # col (T*C, L)
            g = plan.f_buffer(worker, t1 - t0)                          # (F, planes, Eh, Ew)
            fill_grid(g, dy[n, :, p0 + t0:p0 + t1], (0, 0, 0), (1, 1, 1))
            dwts[worker] += xp.matmul(col, g.reshape(f, -1).T)
    _threads.run(one, plan.tasks, plan.workers)
    dwt = _threads.sum_in_order(dwts)                                   # rows (tap, channel)
    k = tuple(weight_shape[2:])
    dw = transposed(dwt).reshape((f,) + k + (c,))                        # the blocked transpose
    return xp.ascontiguousarray(dw.transpose(0, 4, 1, 2, 3))


class InputGradPlan:
    """The phases (each with its taps), tasks and per-worker buffers of ``input_grad``."""

    @classmethod
    def build(cls, xp, dtype, n_batch, c, f, k, stride, padding, dilation, in_spatial, budget,
              workers, tile_bytes):
        axes = _axes(k, stride, dilation)
        if axes is None:
            return None
        per_axis, qmax = axes
        # inputs i = j*s + r - p: j in [0, J); per phase r the j with i in [0, n)
        jext = [(n - 1 + p) // s + 1 for n, s, p in zip(in_spatial, stride, padding)]
        gh, gw = jext[1] + qmax[1], jext[2] + qmax[2]
        plane = gh * gw
        phases, silent = [], False
        for rs in product(*[range(s) for s in stride]):
            ranges = []
            for r, s, p, n in zip(rs, stride, padding, in_spatial):
                j0 = -((r - p) // s) if r < p else 0
                ranges.append((j0, (n - 1 + p - r) // s + 1))
            if any(j1 <= j0 for j0, j1 in ranges):
                continue                                        # no input in this phase
            tap_lists = [[(t, q) for t, (rr, q) in enumerate(ax) if rr == r]
                         for ax, r in zip(per_axis, rs)]
            if not all(tap_lists):
                silent = True                                   # inputs no tap reads: dx = 0
                continue
            taps, shifts = [], []
            for (a, qd), (b, qh), (e, qw) in product(*tap_lists):
                taps.append((a, b, e))
                shifts.append((qmax[0] - qd) * plane + (qmax[1] - qh) * gw + (qmax[2] - qw))
            phases.append((rs, taps, shifts, ranges))
        tmax = max((len(ph[1]) for ph in phases), default=1)
        item = dtype.itemsize

        def cost(slab, tile):
            return item * plane * (f * (slab + qmax[0] + 1) + (tmax * f + c) * tile)
        sizes = _sizes(jext[0], n_batch, workers, tmax * f * plane * item, tile_bytes,
                       max(1, budget // max(1, workers)), cost)
        if sizes is None:
            return None
        plan = cls()
        plan.slab, plan.tile = sizes
        plan.stride, plan.padding = tuple(stride), tuple(padding)
        plan.c, plan.f, plan.qmax, plan.phases, plan.silent = c, f, qmax, phases, silent
        plan.gh, plan.gw, plan.plane = gh, gw, plane
        plan.tasks = _slabs(n_batch, jext[0], plan.slab)
        plan.workers = max(1, min(workers, len(plan.tasks)))
        plan.grid_bufs = [xp.empty(f * (plan.slab + qmax[0] + 1) * plane, dtype=dtype)
                          for _ in range(plan.workers)]
        plan.col_bufs = [xp.empty(tmax * f * plan.tile * plane, dtype=dtype) for _ in range(plan.workers)]
        plan.c_bufs = [xp.empty(c * plan.tile * plane, dtype=dtype) for _ in range(plan.workers)]
        return plan


def input_grad(dy, w, input_shape, plan):
    """``dx`` of ``conv3d`` (input of shape ``input_shape``) by phases, see the module docstring."""
    xp = array_module(dy, w)
    c, f = plan.c, plan.f
    s, p = plan.stride, plan.padding
    dx = (xp.zeros if plan.silent else xp.empty)(tuple(input_shape), dtype=dy.dtype)
    # per phase: W_r (C, T_r*F), column blocks per tap: W_r[c, (i, f)] = W[f, c, tap_i]
    w_r = [xp.ascontiguousarray(xp.stack([w[(slice(None), slice(None)) + t].T for t in taps], axis=1)
                                ).reshape(c, -1) for _, taps, _, _ in plan.phases]

    def one(worker, task):
        n, p0, p1 = task
        depth = p1 - p0 + plan.qmax[0] + 1
        grid = plan.grid_bufs[worker][:f * depth * plan.plane].reshape(f, depth, plan.gh, plan.gw)
        fill_grid(grid, dy[n], (p0 - plan.qmax[0], -plan.qmax[1], -plan.qmax[2]), (1, 1, 1))
        flat = grid.reshape(f, -1)
        for t0 in range(0, p1 - p0, plan.tile):
            t1 = min(t0 + plan.tile, p1 - p0)
            m = (t1 - t0) * plan.plane
            start = t0 * plan.plane
            for wr, (rs, taps, shifts, ranges) in zip(w_r, plan.phases):
                (jd0, jd1), (jh0, jh1), (jw0, jw1) = ranges
                jd0, jd1 = max(jd0, p0 + t0), min(jd1, p0 + t1)        # this tile's planes
                if jd1 <= jd0:
                    continue
                col = plan.col_bufs[worker][:len(taps) * f * m].reshape(len(taps), f, m)
                for i, shift in enumerate(shifts):
                    col[i] = flat[:, start + shift:start + shift + m]
                dxr = plan.c_bufs[worker][:c * m].reshape(c, t1 - t0, plan.gh, plan.gw)
                xp.matmul(wr, col.reshape(-1, m), out=dxr.reshape(c, m))
                box = tuple(slice(j0 * ss + r - pp, (j1 - 1) * ss + r - pp + 1, ss)
                            for j0, j1, ss, r, pp in zip((jd0, jh0, jw0), (jd1, jh1, jw1), s, rs, p))
                dx[(n, slice(None)) + box] = dxr[:, jd0 - p0 - t0:jd1 - p0 - t0, jh0:jh1, jw0:jw1]
    _threads.run(one, plan.tasks, plan.workers)
    return dx
