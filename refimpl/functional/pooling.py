"""3D max and average pooling, forward and backward (PyTorch semantics, NCDHW).

Both are separable: a 3-D window max (or sum) is a 1-D max (sum) along W, then
along H, then along D.  Each 1-D stage is a loop over the ``k`` taps of its
axis, tap ``t`` being the strided slice ``t*d : t*d + s*(o-1) + 1 : s`` -- so a
window costs kw + kh + kd passes instead of kd*kh*kw, and nothing needs
``numpy.add.at``: the backward adds each tap back into its slice (within one tap
the slice has no repeats), axes in reverse order (D, H, W): the adjoint.

Max pooling's gradient goes to the first maximum of the window in (d, h, w) scan
order, as PyTorch's: each stage marks the first tap holding its maximum, and the
lexicographically first maximum of a window is the first along D of the firsts
along H of the firsts along W.

Blocks: samples and channels are independent, so NumPy runs the stages block by
block (one sample, as many channels as make about ``BLOCK_ELEMENTS`` inputs) over
the worker threads of ``_threads``: a block's few passes then stay in the cache.
CuPy takes the whole array as one block.

Output extent per axis: ``floor((n + 2p - d(k-1) - 1)/s) + 1``.  Padding must
be ``<= kernel // 2`` (PyTorch's rule), so every window holds at least one
real element.  Max pooling pads with ``-inf``; average pooling pads with
zeros and divides by the full kernel volume (``count_include_pad=True``).
"""
from __future__ import annotations

import numpy

from ..backend import array_module, check_same_dtype
from ..kernels import _threads
from ._args import check_float, check_ndim, triple, window_out_shape

AXES = (4, 3, 2)  # W, then H, then D: the forward order of the separable stages
#: Inputs per block (1 MiB of float32; one channel when a channel's volume is larger).
BLOCK_ELEMENTS = 1 << 18


def _blocks(x):
    """(sample, channel-range) index pairs covering ``x`` (N, C, ...): see the module doc."""
    if array_module(x) is not numpy or x.size <= BLOCK_ELEMENTS:
        return [(slice(None), slice(None))]
    n, c = x.shape[:2]
    volume = max(1, x[0, 0].size) if x.size else 1
    per = max(1, BLOCK_ELEMENTS // volume)
    return [(slice(i, i + 1), slice(c0, min(c0 + per, c))) for i in range(n) for c0 in range(0, c, per)]


def _per_block(fn, x, out_shape, dtype):
    """``out[b] = fn(b, x[b])`` for every block ``b`` of ``_blocks(x)``, over the worker
    threads; returns ``out`` (``out_shape``) and the list of what else ``fn`` returned."""
    xp = array_module(x)
    out = xp.empty(out_shape, dtype=dtype)
    blocks = _blocks(x)
    extra = [None] * len(blocks)

    def one(_, i):
        result, extra[i] = fn(i, blocks[i])
        out[blocks[i]] = result
    _threads.run(one, list(range(len(blocks))), _threads.thread_count(xp))
    return out, extra


def _pool_args(x, kernel_size, stride, padding, dilation):
    """Validate and normalise pooling hyper-parameters -> (k, s, p, d, out_shape)."""
    check_ndim(x, 5, "x", "N, C, D, H, W")
    check_float("x", x)
    k = triple(kernel_size, "kernel_size", 1)
    s = k if stride is None else triple(stride, "stride", 1)
    p = triple(padding, "padding", 0)
    d = triple(dilation, "dilation", 1)
    for ki, pi in zip(k, p):
        if pi > ki // 2:
            raise ValueError(f"padding must be <= kernel_size // 2 on every axis "
                             f"(PyTorch's rule), got padding={p} for kernel_size={k}")
    out = window_out_shape(x.shape[2:], k, s, p, d)
    if min(out) < 1:
        raise ValueError(f"input spatial shape {tuple(x.shape[2:])} is too small for "
                         f"kernel_size={k}, dilation={d}, padding={p}: output would be {out}")
    return k, s, p, d, out


def _taps(axis, k, s, d, out):
    """(tap, index) for the 1-D window of ``axis``: tap t reads t*d, t*d + s, ... (``out`` values)."""
    lead = (slice(None),) * axis
    return [(t, lead + (slice(t * d, t * d + s * (out - 1) + 1, s),)) for t in range(k)]


def _stage_shape(x_shape, axis, n):
    return x_shape[:axis] + (n,) + x_shape[axis + 1:]


def _pad(x, p, value):
    if p == (0, 0, 0):
        return x
    xp = array_module(x)
    return xp.pad(x, ((0, 0), (0, 0)) + tuple((pi, pi) for pi in p),
                  mode="constant", constant_values=value)


def _unpad(dx_pad, p, shape):
    return dx_pad[(slice(None), slice(None)) + tuple(
        slice(pi, pi + n) for pi, n in zip(p, shape[2:]))]


def _max_along(x, axis, k, s, d, out, with_arg):
    """1-D max pooling along ``axis`` -> (y, per-tap masks of the first maximum, or None).

    ``first[t]`` is True where tap ``t`` is the first tap (in scan order) equal to the
    maximum: the masks are disjoint and say where the gradient goes.
    """
    xp = array_module(x)
    taps = _taps(axis, k, s, d, out)
    y = x[taps[0][1]].copy()
    for _, index in taps[1:]:
        xp.maximum(y, x[index], out=y)
    if not with_arg:
        return y, None
    first, unclaimed = [], None
    for _, index in taps:
        hit = x[index] == y
        if unclaimed is None:
            unclaimed = ~hit
        else:
            hit &= unclaimed
            unclaimed &= ~hit
        first.append(hit)
    return y, first
def _max_stages(x, k, s, p, d, out, with_arg):
    """Separable max over W, H, D of the -inf padded input -> (y, [(first-max masks, input extent)])."""
    xp = array_module(x)
    y, stages = _pad(x, p, -xp.inf), []
    for axis in AXES:
        a = axis - 2
        n_in = y.shape[axis]
        y, first = _max_along(y, axis, k[a], s[a], d[a], out[a], with_arg)
        stages.append((first, n_in))
    return y, stages


def _spread_along(g, axis, k, s, d, n_in, first=None):
    """Adjoint of one 1-D stage: tap t adds g (where it held the first max, for max pooling)
    into its slice.  When windows do not overlap along the axis (s > d(k-1)) every input
    position is written by at most one tap, so the taps write without reading back."""
    xp = array_module(g)
    dx = xp.zeros(_stage_shape(g.shape, axis, n_in), dtype=g.dtype)
    disjoint = s > d * (k - 1)
    for t, index in _taps(axis, k, s, d, g.shape[axis]):
        target = dx[index]                               # a view: writes land in dx
        if first is None:
            if disjoint:
                target[...] = g
            else:
                target += g
        elif disjoint:
            xp.multiply(g, first[t], out=target)
        else:
            target += g * first[t]
    return dx


def _check_dy(dy, x, out):
    check_same_dtype(x=x, dy=dy)
    if tuple(dy.shape) != tuple(x.shape[:2]) + out:
        raise ValueError(f"dy must have the output shape {tuple(x.shape[:2]) + out}, got {dy.shape}")


def max_pool3d(x, kernel_size, stride=None, padding=0, dilation=1, *, return_masks=False):
    """y[n, c, o] = max over the window of o (stride defaults to kernel_size).

    ``return_masks=True`` returns ``(y, masks)``: the first-maximum masks of every
    separable stage of every block (PyTorch's ``return_indices`` in another form),
    which ``max_pool3d_backward(..., masks=masks)`` uses instead of recomputing them.
    They take ``k`` booleans per input of each stage (for k = 2: 1.75 bytes per input).
    """
    k, s, p, d, out = _pool_args(x, kernel_size, stride, padding, dilation)

    def block(_, idx):
        return _max_stages(x[idx], k, s, p, d, out, with_arg=return_masks)
    y, masks = _per_block(block, x, tuple(x.shape[:2]) + out, x.dtype)
    return (y, masks) if return_masks else y


def max_pool3d_backward(dy, x, kernel_size, stride=None, padding=0, dilation=1, *, masks=None):
    """dx: each dy goes to the (first) maximum of its window; overlapping windows add.

    ``masks``: the second result of ``max_pool3d(x, ..., return_masks=True)`` for this
    ``x`` and these arguments; without it the forward runs again to find them."""
    k, s, p, d, out = _pool_args(x, kernel_size, stride, padding, dilation)
    _check_dy(dy, x, out)

    def block(i, idx):
        xb = x[idx]
        stages = _max_stages(xb, k, s, p, d, out, with_arg=True)[1] if masks is None else masks[i]
        g = dy[idx]
        for axis, (first, n_in) in reversed(list(zip(AXES, stages))):
            a = axis - 2
            g = _spread_along(g, axis, k[a], s[a], d[a], n_in, first)
        return _unpad(g, p, xb.shape), None
    return _per_block(block, x, x.shape, dy.dtype)[0]


def avg_pool3d(x, kernel_size, stride=None, padding=0):
    """y[n, c, o] = sum over the window of o / prod(kernel_size) (zero padding counted)."""
    k, s, p, d, out = _pool_args(x, kernel_size, stride, padding, 1)

    def block(_, idx):
        y = _pad(x[idx], p, 0)
        for axis in AXES:
            a = axis - 2
            taps = _taps(axis, k[a], s[a], d[a], out[a])
            total = y[taps[0][1]].copy()
            for _, index in taps[1:]:
                total += y[index]
            y = total
        y /= k[0] * k[1] * k[2]
        return y, None
    return _per_block(block, x, tuple(x.shape[:2]) + out, x.dtype)[0]


def avg_pool3d_backward(dy, x, kernel_size, stride=None, padding=0):
    """dx: every element of a window receives dy / prod(kernel_size)."""
    k, s, p, d, out = _pool_args(x, kernel_size, stride, padding, 1)
    _check_dy(dy, x, out)
    padded = tuple(n + 2 * pi for n, pi in zip(x.shape[2:], p))

    def block(_, idx):
        g = dy[idx] / (k[0] * k[1] * k[2])
        for axis in reversed(AXES):
            a = axis - 2
            g = _spread_along(g, axis, k[a], s[a], d[a], padded[a])
        return _unpad(g, p, x[idx].shape), None
    return _per_block(block, x, x.shape, dy.dtype)[0]


__all__ = ["max_pool3d", "max_pool3d_backward", "avg_pool3d", "avg_pool3d_backward"]
