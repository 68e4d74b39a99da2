"""Dropout with a counter-based mask that any block of a global tensor can compute alone.

The keep/drop decision of an element depends only on ``seed`` and the element's
*flat global index* ``i`` (C order over ``global_shape``):

    h_i  = mix64(seed + (i + 1) * 0x9E3779B97F4A7C15  mod 2^64)     (SplitMix64)
    keep = (h_i >> 11) >= round(p * 2^53)                          (P(keep) = 1 - p)

i.e. element i reads the i-th output of a SplitMix64 generator started at
``seed``.  Because nothing is sequential, a rank holding the block
``index_ranges`` of the global tensor evaluates the hash on its own indices and
gets exactly the slice of the unpartitioned mask: spatially partitioned dropout
equals the unpartitioned one with no communication.  A layer derives a fresh
seed per call with ``fold_seed(seed, step)`` so that every step draws a new mask.

Scaling as PyTorch (inverted dropout): y = x * keep / (1 - p); p = 1 gives zeros.

Speed: this file is the reference.  CuPy arrays take one CUDA kernel for the mask and ``y``
and one for the backward (``refimpl/kernels/dropout.py``: the same mask and bits); the one
rule (``_route.kernel_for``): outside ``functional.reference_only()``.
"""
from __future__ import annotations

import numpy

from ..backend import array_module
from ..kernels import dropout as fast
from ._route import kernel_for

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _mix64(z, xp):
    """SplitMix64 finaliser on a uint64 array (arithmetic wraps modulo 2^64)."""
    z = (z ^ (z >> xp.uint64(30))) * xp.uint64(_MIX1)
    z = (z ^ (z >> xp.uint64(27))) * xp.uint64(_MIX2)
    return z ^ (z >> xp.uint64(31))


def _check_seed(seed):
    if isinstance(seed, bool) or int(seed) != seed or not 0 <= int(seed) <= _MASK64:
        raise ValueError(f"seed must be an integer in [0, 2^64), got {seed!r}")
    return int(seed)


def fold_seed(seed, counter):
    """A new 64-bit seed from (seed, counter), e.g. one per forward call (host ints)."""
    z = (_check_seed(seed) + (int(counter) + 1) * _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def _check_p(p):
    if not 0.0 <= float(p) <= 1.0:
        raise ValueError(f"p must be in [0, 1], got {p!r}")
    return float(p)


def _block(global_shape, index_ranges):
    """``(global_shape, index_ranges)`` checked, as ints; the ranges default to the whole tensor."""
    global_shape = tuple(int(n) for n in global_shape)
    if index_ranges is None:
        index_ranges = [(0, n) for n in global_shape]
    if len(index_ranges) != len(global_shape):
        raise ValueError(f"index_ranges needs one (start, stop) per axis of global_shape "
                         f"{global_shape}, got {index_ranges!r}")
    for (a, b), n in zip(index_ranges, global_shape):
        if not 0 <= a <= b <= n:
            raise ValueError(f"index_ranges {index_ranges!r} is outside global_shape {global_shape}")
    return global_shape, [(int(a), int(b)) for a, b in index_ranges]


def dropout_mask(global_shape, p, seed, index_ranges=None, xp=numpy):
    """Boolean keep-mask of the block ``index_ranges`` of a ``global_shape`` tensor.

    ``index_ranges``: one half-open (start, stop) per axis, default the whole
    tensor.  The result has the block's shape and equals
    ``dropout_mask(global_shape, p, seed)[block]``.
    """
    p, seed = _check_p(p), _check_seed(seed)
    global_shape, index_ranges = _block(global_shape, index_ranges)
    # flat C-order global index of every element of the block
    ndim = len(global_shape)
    index = xp.zeros((1,) * ndim, dtype=xp.uint64)
    stride = 1
    for axis in reversed(range(ndim)):
        a, b = index_ranges[axis]
        coord = xp.arange(a, b, dtype=xp.uint64) * xp.uint64(stride)
        index = index + coord.reshape((1,) * axis + (b - a,) + (1,) * (ndim - axis - 1))
        stride *= global_shape[axis]
    state = xp.uint64(seed) + (index + xp.uint64(1)) * xp.uint64(_GOLDEN)
    threshold = round(p * 2.0 ** 53)
    return (_mix64(state, xp) >> xp.uint64(11)) >= xp.uint64(threshold)


def _scale(p):
    return 0.0 if p == 1.0 else 1.0 / (1.0 - p)


def dropout(x, p, seed, global_shape=None, index_ranges=None):
    """(y, mask): y = x * mask / (1 - p), mask from ``dropout_mask`` for x's block.

    Unpartitioned: leave ``global_shape``/``index_ranges`` out (x is the whole tensor).
    """
    p, seed = _check_p(p), _check_seed(seed)
    xp = array_module(x)
    global_shape, ranges = _block(tuple(x.shape) if global_shape is None else global_shape, index_ranges)
    block = tuple(b - a for a, b in ranges)
    if block != tuple(x.shape):
        raise ValueError(f"index_ranges select a block of shape {block} but x is {x.shape}")
    kernel = kernel_for(fast, x)
    if kernel is not None:
        return kernel.dropout(x, seed, round(p * 2.0 ** 53), _scale(p), global_shape, ranges)
    mask = dropout_mask(global_shape, p, seed, ranges, xp=xp)
    return xp.where(mask, x * _scale(p), 0), mask


def dropout_backward(dy, mask, p):
    """dx = dy * mask / (1 - p)."""
    p = _check_p(p)
    if mask.shape != dy.shape:
        raise ValueError(f"mask has shape {mask.shape} but dy is {dy.shape}")
    kernel = kernel_for(fast, dy)
    if kernel is not None:
        return kernel.dropout_backward(dy, mask, _scale(p))
    xp = array_module(dy)
    return xp.where(mask, dy * _scale(p), 0)


__all__ = ["dropout", "dropout_backward", "dropout_mask", "fold_seed"]
