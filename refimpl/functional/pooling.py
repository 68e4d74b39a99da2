"""3D max and average pooling, forward and backward (PyTorch semantics, NCDHW).

Both ops are written as a loop over the kernel taps: tap ``(a, b, c)`` of
every window is the strided slice

    x_pad[:, :, a*dd : a*dd + sd*(Do-1) + 1 : sd,  (same for h, w)]

of the padded input, an array of the output's shape.  The forward combines the
taps (max or mean); the backward adds ``dy`` back into the same slices.  That
keeps the backward xp-generic (no ``numpy.add.at``): overlapping windows are
accumulated one tap at a time, and within one tap the slice has no repeats.

Output extent per axis: ``floor((n + 2p - d(k-1) - 1)/s) + 1``.  Padding must
be ``<= kernel // 2`` (PyTorch's rule), so every window holds at least one
real element.  Max pooling pads with ``-inf``; average pooling pads with
zeros and divides by the full kernel volume (``count_include_pad=True``).
"""
from __future__ import annotations

from itertools import product

from ..backend import array_module, check_same_dtype
from ._args import check_float, check_ndim, triple, window_out_size


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
    out = tuple(window_out_size(n, ki, si, pi, di)
                for n, ki, si, pi, di in zip(x.shape[2:], k, s, p, d))
    if min(out) < 1:
        raise ValueError(f"input spatial shape {tuple(x.shape[2:])} is too small for "
                         f"kernel_size={k}, dilation={d}, padding={p}: output would be {out}")
    return k, s, p, d, out


def _tap_slice(tap, s, d, out):
    """Index of the padded input read by kernel tap ``tap`` for every output element."""
    return (slice(None), slice(None)) + tuple(
        slice(t * di, t * di + si * (oi - 1) + 1, si) for t, si, di, oi in zip(tap, s, d, out))


def _pad(x, p, value):
    xp = array_module(x)
    return xp.pad(x, ((0, 0), (0, 0)) + tuple((pi, pi) for pi in p),
                  mode="constant", constant_values=value)


def _unpad(dx_pad, p, shape):
    return dx_pad[(slice(None), slice(None)) + tuple(
        slice(pi, pi + n) for pi, n in zip(p, shape[2:]))]


def _max_and_argmax(x, k, s, p, d, out):
    """Window maxima and the tap (flat index in d, h, w scan order) that holds each.

    Ties go to the first tap in scan order (strict ``>`` update), as PyTorch does.
    """
    xp = array_module(x)
    x_pad = _pad(x, p, -xp.inf)
    taps = list(product(*(range(ki) for ki in k)))
    y = x_pad[_tap_slice(taps[0], s, d, out)].copy()             # (N, C, Do, Ho, Wo)
    arg = xp.zeros(y.shape, dtype=xp.int32)
    for t, tap in enumerate(taps[1:], start=1):
        v = x_pad[_tap_slice(tap, s, d, out)]
        better = v > y
        y = xp.where(better, v, y)
        arg = xp.where(better, t, arg)
    return y, arg, taps


def max_pool3d(x, kernel_size, stride=None, padding=0, dilation=1):
    """y[n, c, o] = max over the window of o (stride defaults to kernel_size)."""
    k, s, p, d, out = _pool_args(x, kernel_size, stride, padding, dilation)
    y, _, _ = _max_and_argmax(x, k, s, p, d, out)
    return y


def max_pool3d_backward(dy, x, kernel_size, stride=None, padding=0, dilation=1):
    """dx: each dy goes to the (first) maximum of its window; overlapping windows add."""
    k, s, p, d, out = _pool_args(x, kernel_size, stride, padding, dilation)
    check_same_dtype(x=x, dy=dy)
    if tuple(dy.shape) != tuple(x.shape[:2]) + out:
        raise ValueError(f"dy must have the output shape {tuple(x.shape[:2]) + out}, got {dy.shape}")
    xp = array_module(x, dy)
    _, arg, taps = _max_and_argmax(x, k, s, p, d, out)
    dx_pad = xp.zeros(x.shape[:2] + tuple(n + 2 * pi for n, pi in zip(x.shape[2:], p)),
                      dtype=x.dtype)
    for t, tap in enumerate(taps):
        dx_pad[_tap_slice(tap, s, d, out)] += xp.where(arg == t, dy, 0)
    return _unpad(dx_pad, p, x.shape)


def avg_pool3d(x, kernel_size, stride=None, padding=0):
    """y[n, c, o] = sum over the window of o / prod(kernel_size) (zero padding counted)."""
    k, s, p, d, out = _pool_args(x, kernel_size, stride, padding, 1)
    x_pad = _pad(x, p, 0)
    y = None
    for tap in product(*(range(ki) for ki in k)):
        v = x_pad[_tap_slice(tap, s, d, out)]
        y = v.copy() if y is None else y + v
    return y / (k[0] * k[1] * k[2])


def avg_pool3d_backward(dy, x, kernel_size, stride=None, padding=0):
    """dx: every element of a window receives dy / prod(kernel_size)."""
    k, s, p, d, out = _pool_args(x, kernel_size, stride, padding, 1)
    check_same_dtype(x=x, dy=dy)
    if tuple(dy.shape) != tuple(x.shape[:2]) + out:
        raise ValueError(f"dy must have the output shape {tuple(x.shape[:2]) + out}, got {dy.shape}")
    xp = array_module(x, dy)
    share = dy / (k[0] * k[1] * k[2])
    dx_pad = xp.zeros(x.shape[:2] + tuple(n + 2 * pi for n, pi in zip(x.shape[2:], p)),
                      dtype=x.dtype)
    for tap in product(*(range(ki) for ki in k)):
        dx_pad[_tap_slice(tap, s, d, out)] += share
    return _unpad(dx_pad, p, x.shape)


__all__ = ["max_pool3d", "max_pool3d_backward", "avg_pool3d", "avg_pool3d_backward"]
