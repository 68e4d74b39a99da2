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

The one dispatch rule (``applies``): NumPy arrays of more than one block take this route
outside ``refimpl.functional.reference_only()``; NumPy arrays of one block, CuPy arrays and
the strict stand-in take the reference (no CUDA kernel yet: a device runs the reference's
whole-array operations, each one kernel launch).
"""
from __future__ import annotations

import numpy

from ..backend import array_module
from . import batch_norm


def applies(x) -> bool:
    """Whether group norm's passes over ``x`` run here: a NumPy array of more than one block."""
    return array_module(x) is numpy and x.size > batch_norm.BLOCK_ELEMENTS


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


__all__ = ["applies", "local_sums", "forward", "backward_row_sums", "backward"]
