"""Convs of a 1x1x1 kernel, stride 1 and no padding (the U-Net's output layer, a channel mixer):
the input is its own columns.

Why.  im2col's columns of a 1x1x1 conv are a copy of the input, and its input gradient goes
through a ``(C, M)`` buffer copied into ``dx``.  Here every pass is GEMMs on views of the
NCDHW arrays, per sample ``n`` and block of ``COLUMNS`` positions ``[m0, m1)``::

    y[n][:, m0:m1]  (F, b) = W (F, C)   @ x[n][:, m0:m1]  (C, b)       forward
    dx[n][:, m0:m1] (C, b) = W^T (C, F) @ dy[n][:, m0:m1] (F, b)       input gradient
    dW (F, C)             += dy[n][:, m0:m1] (F, b) @ x[n][:, m0:m1]^T (b, C)   weight gradient

(``x[n]`` viewed as ``(C, D*H*W)``).  The blocks keep the operands in cache: one GEMM over a
whole 64^3 sample ran 1.5-2x slower (docs/benchmarks.md, "Kernel choices").  They run on the
worker threads (``_threads``), each worker with its own dW, added in worker order.  Exact: the
same products; dW's sum is split by blocks.  No buffer but dW and the results.
"""
from __future__ import annotations

from ..backend import array_module
from . import _threads

#: Positions per GEMM (a block of every channel's row of one sample).
COLUMNS = 16384


def applies(k, stride, padding):
    """A 1x1x1 kernel, stride 1, no padding (dilation is then irrelevant)."""
    return tuple(k) == (1, 1, 1) and tuple(stride) == (1, 1, 1) and tuple(padding) == (0, 0, 0)


def _tasks(n_batch, positions):
    return [(n, m0, min(m0 + COLUMNS, positions)) for n in range(n_batch) for m0 in range(0, positions, COLUMNS)]


def _flat(a):
    """(N, C, D, H, W) -> (N, C, D*H*W): a view of a C-contiguous array."""
    return a.reshape(a.shape[0], a.shape[1], -1)


def forward(x, w, y):
    """``y = conv3d(x, w)`` (no bias) into ``y``."""
    xp = array_module(x, w)
    w2 = xp.ascontiguousarray(w).reshape(w.shape[0], w.shape[1])
    xf, yf = _flat(x), _flat(y)

    def one(_, task):
        n, m0, m1 = task
        xp.matmul(w2, xf[n, :, m0:m1], out=yf[n, :, m0:m1])
    _threads.run(one, _tasks(x.shape[0], xf.shape[2]), _threads.thread_count(xp))
    return y


def backward(dy, x, w, need_dx=True, need_dw=True):
    """``(dx, dW)`` of ``conv3d(x, w)``; either may be skipped (None: ``x`` or ``w`` is then read
    for its shape only)."""
    xp = array_module(dy)
    f, c = w.shape[:2]
    dx = xp.empty(tuple(x.shape), dtype=dy.dtype) if need_dx else None
    w2t = xp.ascontiguousarray(w).reshape(f, c).T if need_dx else None            # (C, F) view
    dyf = _flat(dy)
    xf = _flat(x) if need_dw else None
    dxf = _flat(dx) if need_dx else None
    tasks = _tasks(dy.shape[0], dyf.shape[2])
    workers = max(1, min(_threads.thread_count(xp), len(tasks)))
    dws = [xp.zeros((f, c), dtype=dy.dtype) for _ in range(workers)] if need_dw else None

    def one(worker, task):
        n, m0, m1 = task
        if need_dx:
            xp.matmul(w2t, dyf[n, :, m0:m1], out=dxf[n, :, m0:m1])
        if need_dw:
            dws[worker] += xp.matmul(dyf[n, :, m0:m1], xf[n, :, m0:m1].T)
    _threads.run(one, tasks, workers)
    dw = _threads.sum_in_order(dws).reshape(tuple(w.shape)) if need_dw else None
    return dx, dw
