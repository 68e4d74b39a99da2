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

The one dispatch rule (``applies``): NumPy arrays of more than ``BLOCK_ELEMENTS``
elements take this route outside ``refimpl.functional.reference_only()``; CuPy
and arrays of one block take the reference (for them both are the same operations).
"""
from __future__ import annotations

import numpy

from ..backend import array_module
from . import _threads

#: Voxels x channels per block of a pass (1 MiB of float32: measured best; blocks of 64 Ki
#: elements make the per-channel rows too short).
BLOCK_ELEMENTS = 1 << 18


def applies(x) -> bool:
    """Whether batch norm's passes over ``x`` run here: a NumPy array of more than one block."""
    return array_module(x) is numpy and x.size > BLOCK_ELEMENTS


def channel_blocks(*arrays):
    """The arrays (same NCDHW shape) as blocks ``(channels, views)``: ``channels`` a slice of
    the channel axis, ``views`` the arrays' ``(C', L)`` pieces for it: one sample's channels
    ``[c0, c1)`` over voxels ``[v0, v1)``, about ``BLOCK_ELEMENTS`` in all, its rows a whole
    sample's voxels where they fit (fewer channels then)."""
    n, c = arrays[0].shape[:2]
    flat = [numpy.ascontiguousarray(a).reshape(n, c, -1) for a in arrays]
    size = flat[0].shape[2]
    step = max(1, min(size, BLOCK_ELEMENTS))                          # voxels per row
    rows = max(1, BLOCK_ELEMENTS // step)                             # channels per block
    return [(slice(c0, min(c0 + rows, c)), tuple(f[i, c0:c0 + rows, v0:v0 + step] for f in flat))
            for i in range(n) for c0 in range(0, c, rows) for v0 in range(0, size, step)]


def _run_blocks(fn, blocks):
    """``fn(channels, *views)`` for every block, over the worker threads; results in block order."""
    results = [None] * len(blocks)

    def one(_, i):
        results[i] = fn(blocks[i][0], *blocks[i][1])
    _threads.run(one, list(range(len(blocks))), _threads.thread_count(numpy))
    return results


def _channel_sums(partials, blocks, c):
    """Per-block float64 row sums ``(C',)`` added per channel, in block order -> (C,)."""
    total = numpy.zeros(c, dtype=numpy.float64)
    for part, (channels, _) in zip(partials, blocks):
        total[channels] += part
    return total


def local_sums(x, k):
    """``(sum(x - k), sum((x - k)^2))`` per channel in float64; ``k`` (C, 1) in x's dtype, or
    None for no shift."""
    def sums(ch, xb):
        xs = xb if k is None else xb - k[ch]
        s1 = numpy.sum(xs, axis=-1, dtype=numpy.float64)
        xs = xs * xs if k is None else numpy.multiply(xs, xs, out=xs)
        return s1, numpy.sum(xs, axis=-1, dtype=numpy.float64)
    blocks = channel_blocks(x)
    parts = _run_blocks(sums, blocks)
    c = x.shape[1]
    return (_channel_sums([a for a, _ in parts], blocks, c),
            _channel_sums([b for _, b in parts], blocks, c))


def affine(x, a, c):
    """``y = a x + c`` per channel (``a``, ``c`` (C, 1) in x's dtype), a new array."""
    y = numpy.empty(x.shape, dtype=x.dtype)

    def normalise(ch, yb, xb):
        numpy.multiply(xb, a[ch], out=yb)
        yb += c[ch]
    _run_blocks(normalise, channel_blocks(y, x))
    return y


def backward_sums(dy, x, m):
    """``(sum(dy), sum(dy * (x - m)))`` per channel in float64; ``m`` (C, 1) in dy's dtype."""
    def sums(ch, gb, xb):
        t = numpy.subtract(xb, m[ch])
        t *= gb
        return numpy.sum(gb, axis=-1, dtype=numpy.float64), numpy.sum(t, axis=-1, dtype=numpy.float64)
    blocks = channel_blocks(dy, x)
    parts = _run_blocks(sums, blocks)
    c = dy.shape[1]
    return (_channel_sums([s for s, _ in parts], blocks, c),
            _channel_sums([t for _, t in parts], blocks, c))


def backward_dx(dy, x, a, b, c):
    """``dx = b x + c + a dy`` per channel (``a``, ``b``, ``c`` (C, 1) in dy's dtype)."""
    dx = numpy.empty(dy.shape, dtype=dy.dtype)

    def grad(ch, db, gb, xb):
        numpy.multiply(xb, b[ch], out=db)
        db += c[ch]
        db += gb * a[ch]
    _run_blocks(grad, channel_blocks(dx, dy, x))
    return dx


__all__ = ["BLOCK_ELEMENTS", "applies", "channel_blocks", "local_sums", "affine", "backward_sums",
           "backward_dx"]
