"""The fast route of max and average pooling: the reference math, block by block, on worker threads.

``refimpl/functional/pooling.py`` holds the math (separable 1-D stages along W, H,
D; their adjoints in reverse order).  Samples and channels are independent, so
here the same stages run on blocks of the input -- one sample, as many channels
as make about ``BLOCK_ELEMENTS`` inputs (one channel when a channel's volume is
larger) -- shared among the worker threads of ``_threads``: a block's few passes
then stay in the cache, and the blocks run on every core.  Each block computes
exactly what the reference computes on it, so the results equal the reference's
bit for bit (tests/test_reference_ops.py).  The reference's per-pass functions are passed
in by ``refimpl/functional/pooling.py`` (the kernels never import the reference).

The one dispatch rule (``applies``): NumPy arrays of more than ``BLOCK_ELEMENTS``
elements take this route, outside ``refimpl.functional.reference_only()``; CuPy
arrays (the device runs a pass in parallel already) and small arrays (one block) take
the reference.

Max pooling's masks from this route are a list with one entry (the reference's
stage masks) per block, in ``blocks(x)`` order.
"""
from __future__ import annotations

import numpy

from ..backend import array_module
from . import _threads

#: Inputs per block (1 MiB of float32; one channel when a channel's volume is larger).
BLOCK_ELEMENTS = 1 << 18


def applies(x) -> bool:
    """Whether pooling ``x`` runs here: a NumPy array of more than one block."""
    return array_module(x) is numpy and x.size > BLOCK_ELEMENTS


def blocks(x):
    """(sample, channel-range) index pairs covering ``x`` (N, C, ...): see the module doc."""
    n, c = x.shape[:2]
    volume = max(1, x[0, 0].size) if x.size else 1
    per = max(1, BLOCK_ELEMENTS // volume)
    return [(slice(i, i + 1), slice(c0, min(c0 + per, c))) for i in range(n) for c0 in range(0, c, per)]


def _per_block(fn, x, out_shape, dtype):
    """``out[b] = fn(b, x[b])[0]`` for every block ``b`` of ``blocks(x)``, over the worker
    threads; returns ``out`` (``out_shape``) and the list of the second results of ``fn``."""
    out = numpy.empty(out_shape, dtype=dtype)
    index = blocks(x)
    extra = [None] * len(index)

    def one(_, i):
        result, extra[i] = fn(i, index[i])
        out[index[i]] = result
    _threads.run(one, list(range(len(index))), _threads.thread_count(numpy))
    return out, extra


#: The separable stages' axes in the reference's order (W, H, D): ``pair_max_forward`` keeps it.
STAGE_AXES = (4, 3, 2)


def _pair_stage(x, axis, s, d, out):
    """One separable stage of a 2-tap window along ``axis``: ``(y, [first0, first1])`` with
    y = max(x0, x1), first0 = x0 >= x1 and first1 = x1 > x0, in three passes.

    Why it equals the reference's stage (``functional.pooling._max_along``: copy x0, max in
    x1, then first_t = (x_t == y) and no earlier tap's, eight passes): for numbers,
    x0 == max(x0, x1) exactly when x0 >= x1 (so a tie goes to x0, the first), and x1 is the
    first maximum exactly when x1 > x0; a NaN in either tap makes y NaN and both comparisons
    false, as ``== NaN`` is in the reference; -0 and +0 compare equal in both."""
    lead = (slice(None),) * axis
    x0 = x[lead + (slice(0, s * (out - 1) + 1, s),)]
    x1 = x[lead + (slice(d, d + s * (out - 1) + 1, s),)]
    return numpy.maximum(x0, x1), [numpy.greater_equal(x0, x1), numpy.greater(x1, x0)]


def pair_max_forward(x, s, d, out, with_masks):
    """The reference's ``max_pool_forward`` for a 2 x 2 x 2 window without padding: the same
    ``(y, stages)`` (``_pair_stage`` per axis in ``STAGE_AXES`` order)."""
    y, stages = x, []
    for axis in STAGE_AXES:
        a = axis - 2
        n_in = y.shape[axis]
        y, first = _pair_stage(y, axis, s[a], d[a], out[a])
        stages.append((first if with_masks else None, n_in))
    return y, stages


def _block_forward(forward, k, s, p, d, out):
    """``fn(x_block, with_masks) -> (y, stages)``: ``pair_max_forward`` for a 2 x 2 x 2 window
    without padding, else the reference's ``forward``."""
    if tuple(k) == (2, 2, 2) and all(lo == 0 and hi == 0 for lo, hi in p):
        return lambda xb, with_masks: pair_max_forward(xb, s, d, out, with_masks)
    return lambda xb, with_masks: forward(xb, k, s, p, d, out, with_masks)


def max_pool3d(forward, x, k, s, p, d, out, with_masks):
    """``(y, per-block masks or None)``: ``forward`` (the reference's ``max_pool_forward``,
    passed in: kernels never import the reference) per block; a 2 x 2 x 2 window without
    padding (CosmoFlow's and the U-Net's pools) by ``pair_max_forward``, the same values in
    fewer passes."""
    block_forward = _block_forward(forward, k, s, p, d, out)

    def block(_, idx):
        return block_forward(x[idx], with_masks)
    y, masks = _per_block(block, x, tuple(x.shape[:2]) + out, x.dtype)
    return y, (masks if with_masks else None)


def max_pool3d_backward(forward, backward, dy, x, k, s, p, d, out, masks):
    """dx: the reference's ``max_pool_backward`` (``backward``) per block, with this route's
    ``masks`` or, without them, the masks ``forward`` finds again."""
    index = blocks(x)
    if masks is not None and len(masks) != len(index):
        raise ValueError(f"masks has {len(masks)} blocks, x has {len(index)}: pass the masks of "
                         "max_pool3d(x, ..., return_masks=True) for this very x")

    block_forward = _block_forward(forward, k, s, p, d, out)

    def block(i, idx):
        xb = x[idx]
        stages = block_forward(xb, True)[1] if masks is None else masks[i]
        return backward(dy[idx], xb.shape, k, s, p, d, stages), None
    return _per_block(block, x, x.shape, dy.dtype)[0]


def avg_pool3d(forward, x, k, s, p, out, divisor):
    """y: the reference's ``avg_pool_forward`` (``forward``) per block (``divisor``: a number or
    (1, 1, Do, Ho, Wo), the same for every block)."""
    return _per_block(lambda _, idx: (forward(x[idx], k, s, p, out, divisor), None),
                      x, tuple(x.shape[:2]) + out, x.dtype)[0]


def avg_pool3d_backward(backward, dy, x, k, s, p, divisor):
    """dx: the reference's ``avg_pool_backward`` (``backward``) per block."""
    return _per_block(lambda _, idx: (backward(dy[idx], x[idx].shape, k, s, p, divisor), None),
                      x, x.shape, dy.dtype)[0]


__all__ = ["BLOCK_ELEMENTS", "applies", "blocks", "pair_max_forward", "max_pool3d", "max_pool3d_backward", "avg_pool3d",
           "avg_pool3d_backward"]
