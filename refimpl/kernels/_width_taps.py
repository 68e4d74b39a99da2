"""The forward of a stride-1 conv with its width taps as column offsets: the host route for convs
of few input channels (CosmoFlow's first conv, 4 -> 16 channels at 64^3 and 128^3).

Why.  im2col's columns hold every input value ``C*kd*kh*kw`` times; the depth-tap schedule
(``_im2col``) shares the ``kd`` taps between neighbouring planes, and its hw-columns still
copy every input value ``kh*kw`` times, one tap at a time.  With 4 input channels those copies
cost about as much as the GEMM.  Here the ``kw`` taps along the width are not copied at all:
they become ``kw`` times more GEMM rows, and shifts of the GEMM's output.

The math, with the input zero-padded to ``(Dp, Hp, Wp)`` and every output plane's positions
flattened with the *padded* width, ``j = h*Wp + w`` (``L = Ho*Wp`` positions a plane; the
``Wp - Wo`` positions of each row past ``Wo`` are computed and dropped).  Output
``(f, d, h, w)`` reads, through tap ``(a, b, e)``, padded input ``(d + a*dl_d, h + b*dl_h,
w + e*dl_w)``: position ``j + b*dl_h*Wp + e*dl_w`` of the flattened padded plane
``d + a*dl_d``.  So with

    B[(a, c, b), j] = xpad[c, d + a, b*dl_h*Wp + j]        (kd*C*kh, L): whole rows, contiguous
    Z[(e, f), j]    = sum_{a,c,b} W[f, c, a, b, e] B[(a, c, b), j]     one GEMM (kw*F, kd*C*kh) @ B
    y[f, d, h, w]   = sum_e Z[(e, f), h*Wp + w + e*dl_w]

the columns are ``kd*C*kh`` contiguous runs of the padded planes, and the sum over ``e`` is
``kw - 1`` adds of whole shifted rows of ``Z`` (cached: one plane's ``Z``) followed by one copy
of the ``Wo`` valid positions of each row into ``y``.  The row ``B[(a, c, b)]`` is rows
``[b*dl_h, b*dl_h + Ho)`` of padded plane ``d + a``: it ends at row ``Hp - 1``, and the largest
index read from ``Z``, ``(Ho - 1)*Wp + (Wo - 1) + (kw - 1)*dl_w``, is ``L - 1``.

The padded planes are stored plane-major, ``B[slot, c, b, L]`` with slot ``s`` holding padded
plane ``d0 + s`` of the task: output plane ``d0 + i`` reads slots ``i .. i + kd - 1``, rows
``i*C*kh .. (i + kd)*C*kh`` of the flat buffer, one (kd*C*kh, L) view (depth dilation 1).  The
zero padding is written once per buffer: a slot's valid rows and columns are the same in every
task (whole planes), and a slot that falls in the depth padding is zeroed where it does.

The weight gradient takes the same padded planes.  From the forward's sums,

    dW[f, c, a, b, e] = sum_j B[(a, c, b), j + e*dl_w] dy_ext[f, j]
                      = sum_j B[(a, c, b), j] dZ[(e, f), j],    dZ[(e, f), j] = dy_ext[f, j - e*dl_w]

with ``dy_ext`` the output plane's gradient at the padded width (zero at the ``Wp - Wo``
positions of each row past ``Wo``, which the forward dropped).  So per output plane one GEMM
``dW^T (kd*C*kh, kw*F) += B @ dZ^T`` (L, kw*F), and ``dZ[e]`` is ``dy_ext`` shifted by
``e*dl_w`` along the flat index: the positions it shifts in at a row's start are the previous
row's dropped ones (``Wp - e*dl_w >= Wo``) or before the plane, zero in both cases.  ``dZ`` is
one copy of the plane of ``dy`` into ``dZ[0]``'s valid positions (the rest stays zero), then
``kw - 1`` contiguous copies of ``dZ[0]``'s flat rows.

Cost per output position, against the depth-tap schedule's ``C*kh*kw`` copies: ``C*kh`` long
contiguous copies, the GEMM's ``kd*C*kh*kw*F`` products (the same, times ``Wp / Wo``) with
``kw*F`` rows instead of ``F`` (faster for a narrow F), ``(kw - 1)*F`` cached adds and an
``F`` copy (the weight gradient: ``kw*F`` cached copies instead of the adds);
``routes.width_taps_pay`` says where that is faster (docs/benchmarks.md, "Kernel choices").
Exact: the same products, summed in another order.
"""
from __future__ import annotations

from ..backend import array_module
from . import _threads

#: Bytes of padded planes per task to aim for (cache-sized, as the depth-tap forward's tiles).
TASK_BYTES = 4 * 2**20


def _shape_fits(k, stride, padding, dilation, in_spatial, out):
    """The route computes stride-1 convs of depth dilation 1 with more than one width tap, for
    all their outputs (not the first ones of a gradient covering only those)."""
    full = all(o == n + 2 * p - dl * (kk - 1) for o, n, p, dl, kk in zip(out, in_spatial, padding, dilation, k))
    return tuple(stride) == (1, 1, 1) and dilation[0] == 1 and k[2] > 1 and full


class ForwardPlan:
    """Tasks (whole output planes ``[d0, d1)`` of one sample) and per-worker buffers: the
    task's padded planes ``B`` and one plane's ``Z`` (the weight gradient's ``dZ``).  ``build`` returns None where the route
    does not apply (``_shape_fits``) or one plane's work does not fit the budget share."""

    @classmethod
    def build(cls, xp, dtype, n_batch, c, f, k, stride, padding, dilation, in_spatial, out, budget, workers):
        if not _shape_fits(k, stride, padding, dilation, in_spatial, out):
            return None
        reach = k[0] - 1
        wp = out[2] + dilation[2] * (k[2] - 1)                # the padded width
        length = out[1] * wp                                   # L: an output plane, padded width
        slot = c * k[1] * length                               # a padded plane's (C, kh, L) rows
        item = dtype.itemsize
        per_worker = max(1, budget // max(1, workers))
        z = k[2] * f * length
        nd = min(out[0], max(1, TASK_BYTES // (slot * item) - reach))
        while (nd + reach) * slot * item + z * item > per_worker:
            if nd == 1:
                return None
            nd = max(1, nd // 2)
        plan = cls()
        plan.k, plan.padding, plan.dilation = tuple(k), tuple(padding), tuple(dilation)
        plan.out, plan.wp, plan.length, plan.c, plan.f = tuple(out), wp, length, c, f
        plan.tasks = [(n, d0, min(d0 + nd, out[0])) for n in range(n_batch) for d0 in range(0, out[0], nd)]
        plan.workers = max(1, min(workers, len(plan.tasks)))
        # zeros: the padding columns and rows of every slot are never written again
        plan.b_bufs = [xp.zeros((nd + reach, c, k[1], length), dtype=dtype) for _ in range(plan.workers)]
        plan.z_bufs = [xp.empty((k[2], f, length), dtype=dtype) for _ in range(plan.workers)]
        plan.z_zeroed = [False] * plan.workers                 # weight_grad: dZ's zeros written
        plan.zeroed = [set(range(nd + reach)) for _ in range(plan.workers)]   # slots all zero now
        return plan

    def padded_planes(self, x, n, d0, d1, worker):
        """The task's padded planes ``d0 .. d1 - 1 + kd - 1``, filled: (slots*C*kh, L)."""
        slots = d1 - d0 + self.k[0] - 1
        buf = self.b_bufs[worker][:slots]                       # (slots, C, kh, L)
        depth, height, width = x.shape[2:]
        pd, ph, pw = self.padding
        dl_h = self.dilation[1]
        first, last = max(0, pd - d0), min(slots, depth + pd - d0)   # slots of real planes
        zeroed = self.zeroed[worker]
        for s in range(slots):
            if (s < first or s >= last) and s not in zeroed:
                buf[s] = 0
                zeroed.add(s)
        if last <= first:
            return buf.reshape(-1, self.length)
        zeroed.difference_update(range(first, last))
        rows = buf[first:last].reshape(last - first, self.c, self.k[1], self.out[1], self.wp)
        for b in range(self.k[1]):
            lo = max(0, ph - b * dl_h)                          # output rows reading real input rows
            hi = min(self.out[1], height + ph - b * dl_h)
            if hi > lo:
                rows[:, :, b, lo:hi, pw:pw + width] = x[n, :, d0 + first - pd:d0 + last - pd,
                                                        lo + b * dl_h - ph:hi + b * dl_h - ph].transpose(1, 0, 2, 3)
        return buf.reshape(-1, self.length)


def forward(x, w, y, plan):
    """``y = conv3d(x, w)`` (no bias) by width taps as column offsets (see above): per output
    plane one GEMM ``Z = W (kw*F, kd*C*kh) @ B`` (kd*C*kh, L), ``kw - 1`` shifted adds into
    ``Z[0]``, and the valid positions copied into y's plane."""
    xp = array_module(x, w)
    f, c, kd, kh, kw = w.shape
    rows = c * kh
    w_taps = xp.ascontiguousarray(w.transpose(4, 0, 2, 1, 3)).reshape(kw * f, kd * rows)   # (e, f) x (a, c, b)
    length, wo, dl_w = plan.length, plan.out[2], plan.dilation[2]

    def one(worker, task):
        n, d0, d1 = task
        flat = plan.padded_planes(x, n, d0, d1, worker)        # (slots*C*kh, L)
        z = plan.z_bufs[worker]                                 # (kw, F, L)
        for i in range(d1 - d0):
            xp.matmul(w_taps, flat[i * rows:(i + kd) * rows], out=z.reshape(kw * f, length))
            for e in range(1, kw):
                z[0, :, :length - e * dl_w] += z[e, :, e * dl_w:]
            y[n, :, d0 + i] = z[0].reshape(f, plan.out[1], plan.wp)[:, :, :wo]
    _threads.run(one, plan.tasks, plan.workers)
    return y


def weight_grad(dy, x, weight_shape, plan):
    """``dW`` of ``y = conv3d(x, w)`` by the same padded planes (see above): per output plane
    ``dW^T (kd*C*kh, kw*F) += B @ dZ^T``, each worker its own ``dW^T``, added in worker order."""
    xp = array_module(dy, x)
    f, c, kd, kh, kw = weight_shape
    rows = c * kh
    length, wo, dl_w = plan.length, plan.out[2], plan.dilation[2]
    dwts = [xp.zeros((kd * rows, kw * f), dtype=dy.dtype) for _ in range(plan.workers)]

    def one(worker, task):
        n, d0, d1 = task
        flat = plan.padded_planes(x, n, d0, d1, worker)        # (slots*C*kh, L)
        dz = plan.z_bufs[worker]                                # (kw, F, L)
        if not plan.z_zeroed[worker]:                           # once: the shifts keep the zeros
            dz[...] = 0
            plan.z_zeroed[worker] = True
        valid = dz[0].reshape(f, plan.out[1], plan.wp)[:, :, :wo]
        for i in range(d1 - d0):
            valid[...] = dy[n, :, d0 + i]                       # dy_ext: zero past Wo
            for e in range(1, kw):
                dz[e, :, e * dl_w:] = dz[0, :, :length - e * dl_w]
            dwts[worker] += xp.matmul(flat[i * rows:(i + kd) * rows], dz.reshape(kw * f, length).T)
    _threads.run(one, plan.tasks, plan.workers)
    dwt = _threads.sum_in_order(dwts)                           # rows (a, c, b), columns (e, f)
    return xp.ascontiguousarray(dwt.reshape(kd, c, kh, kw, f).transpose(4, 1, 0, 2, 3))
