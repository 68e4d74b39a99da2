"""Pointwise activations and their backward passes (PyTorch semantics).

Derivative conventions at the kinks follow PyTorch: relu'(0) = 0 and
leaky_relu'(0) = negative_slope.  tanh's backward takes the *output*
(tanh' = 1 - tanh^2), so a layer caches y instead of x; the CosmoFlow head
uses ``scale * tanh(x)`` (scale 1.2), see ``scaled_tanh``.
"""
from __future__ import annotations

from ..backend import array_module, check_same_dtype
from ..kernels._threads import elementwise


def relu(x):
    """max(x, 0)."""
    xp = array_module(x)
    return elementwise(lambda o, a: xp.maximum(a, 0, out=o), xp.empty_like(x), _c(x))


def _c(a):
    """``a`` C-contiguous (the blockwise passes flatten their arrays)."""
    return array_module(a).ascontiguousarray(a)


def relu_backward(dy, x):
    """dy where x > 0, else 0: ``dy * (x > 0)``, two passes (NumPy's ``where`` with a
    scalar runs 7x slower; the product differs from it only in the sign of zeros)."""
    check_same_dtype(x=x, dy=dy)
    xp = array_module(x, dy)
    return elementwise(lambda o, g, a: xp.multiply(g, a > 0, out=o), xp.empty_like(dy), _c(dy), _c(x))


def leaky_relu(x, negative_slope=0.01):
    """x where x > 0, else negative_slope * x.

    For 0 <= slope <= 1 that is max(x, slope * x): two passes over x instead of three.
    """
    xp = array_module(x)
    if 0.0 <= negative_slope <= 1.0:
        def pass_(o, a):
            xp.multiply(a, negative_slope, out=o)
            xp.maximum(o, a, out=o)
        return elementwise(pass_, xp.empty_like(x), _c(x))
    return xp.where(x > 0, x, x * negative_slope)


def leaky_relu_backward(dy, x, negative_slope=0.01):
    """dy where x > 0, else negative_slope * dy.

    For 0 <= slope <= 1 as ``dy * max(m, slope)`` with the 0/1 mask ``m = (x > 0)``: the
    factor is exactly 1 or the slope, so it equals ``where(x > 0, dy, dy * slope)`` bit for
    bit, in 4 short passes per block (NumPy's ``where`` runs 5-8x slower; the earlier
    ``dy * m + dy * ((1 - m) * slope)`` took 7: 390 -> 260 us per 256 Ki floats here).
    Other slopes: ``dy * m + dy * ((1 - m) * slope)`` (one term is zero, the other exact or
    the same rounded ``dy * slope``).  The passes run block by block
    (``_threads.elementwise``: in cache, on every core).
    """
    check_same_dtype(x=x, dy=dy)
    xp = array_module(x, dy)

    def pass_(o, g, a):
        m = (a > 0).astype(g.dtype)           # 1 where x > 0
        if 0.0 <= negative_slope <= 1.0:
            xp.maximum(m, negative_slope, out=m)   # 1 where x > 0, slope elsewhere
            xp.multiply(g, m, out=o)
            return
        xp.multiply(g, m, out=o)
        m -= 1
        m *= -negative_slope                  # 0 where x > 0, slope elsewhere
        m *= g
        o += m
    return elementwise(pass_, xp.empty_like(dy), _c(dy), _c(x))


def tanh(x):
    xp = array_module(x)
    return xp.tanh(x)


def tanh_backward(dy, y):
    """dy * (1 - y^2) with y = tanh(x), the forward's output."""
    check_same_dtype(y=y, dy=dy)
    return dy * (1 - y * y)


def scaled_tanh(x, scale=1.2):
    """scale * tanh(x) -> (y, t) with t = tanh(x) kept for the backward."""
    t = tanh(x)
    return scale * t, t


def scaled_tanh_backward(dy, t, scale=1.2):
    """dy * scale * (1 - t^2) with t = tanh(x)."""
    return tanh_backward(dy * scale, t)


__all__ = ["relu", "relu_backward", "leaky_relu", "leaky_relu_backward", "tanh", "tanh_backward",
           "scaled_tanh", "scaled_tanh_backward"]
