"""The fast route of the pointwise activations: few NumPy passes, in cache, on every core.

``refimpl/functional/activations.py`` holds the math (``where(x > 0, ...)``).  Here the
same values are computed with cheaper NumPy operations, over cache-sized blocks of the
flattened arrays shared by the worker threads (``_threads.elementwise``: every pass after
the first reads the cache, and the blocks run on all cores):

- relu: ``maximum(x, 0)`` into the output;
- relu backward: ``dy * (x > 0)`` (NumPy's ``where`` with a scalar runs 7x slower; the
  product differs from it only in the sign of zeros), the comparison written straight into a
  float block (a bool mask times a float array runs a cast loop: 1.4x slower per block);
- leaky relu, 0 <= slope <= 1: ``max(x, slope * x)``, two passes instead of three (in place,
  over ``x``: the product to a block-sized temporary, then the maximum over the block);
- leaky relu backward, 0 <= slope <= 1: ``dy * max(m, slope)`` with the 0/1 mask
  ``m = (x > 0)``: the factor is exactly 1 or the slope, so it equals
  ``where(x > 0, dy, dy * slope)`` bit for bit, in 4 short passes per block (``where``
  runs 5-8x slower; the earlier ``dy * m + dy * ((1 - m) * slope)`` took 7 passes:
  docs/benchmarks.md, "Kernel choices").  Other slopes: ``dy * m + dy * ((1 - m) * slope)`` (one term is
  zero, the other exact or the same rounded ``dy * slope``).

On a GPU (CuPy arrays) each of the four is one fused ``cupy.ElementwiseKernel`` instead:
the reference's ``where(x > 0, x, x * slope)`` is three kernel launches and two temporaries,
and these layers are launch- and bandwidth-bound there (docs/gpu.md).  Each kernel body is
the reference's formula for one element, in the same operations, so it computes the same
values (``DEVICE_KERNELS``; tested against the host route by tests/test_device_arrays.py on a
GPU, ``scripts/gpu_check.sh``).

The one dispatch rule (``applies``): NumPy arrays take the blockwise passes (any size: one
block is one call of the same cheap passes), CuPy arrays the fused kernels, outside
``refimpl.functional.reference_only()``; the strict stand-in takes the reference.  Tested
against the reference in tests/test_reference_ops.py (bit for bit, zeros of either sign
compared equal).
"""
from __future__ import annotations

import numpy

from ..backend import array_module
from ._threads import elementwise


def applies(*arrays) -> bool:
    """Whether the activation passes over ``arrays`` run here: NumPy or CuPy arrays."""
    xp = array_module(*arrays)
    return xp is numpy or xp.__name__ == "cupy"


#: The fused device kernels: (inputs, output, the reference's formula for one element).
#: relu: ``maximum(x, 0)`` (NaN propagates); relu backward: ``dy * (x > 0)``; leaky relu:
#: ``where(x > 0, x, x * slope)``; its backward: ``where(x > 0, dy, dy * slope)``.
DEVICE_KERNELS = {
    "relu": ("T x", "T y", "y = (x > (T)0 || x != x) ? x : (T)0"),
    "relu_backward": ("T dy, T x", "T dx", "dx = dy * (T)(x > (T)0)"),
    "leaky_relu": ("T x, T slope", "T y", "y = x > (T)0 ? x : x * slope"),
    "leaky_relu_backward": ("T dy, T x, T slope", "T dx", "dx = x > (T)0 ? dy : dy * slope"),
}
_compiled = {}


def _on_device(a) -> bool:
    return type(a).__module__.startswith("cupy")


def _device(name):
    """The CuPy ElementwiseKernel ``name`` of ``DEVICE_KERNELS``, built once (CuPy compiles it
    per dtype on first use and caches it)."""
    if name not in _compiled:
        import cupy
        _compiled[name] = cupy.ElementwiseKernel(*DEVICE_KERNELS[name], name="refimpl_" + name)
    return _compiled[name]


def _c(a):
    """``a`` C-contiguous (the blockwise passes flatten their arrays)."""
    return numpy.ascontiguousarray(a)


def relu(x, out=None):
    """``out``: where y goes (``x`` itself included: one elementwise pass); a new array when None."""
    if _on_device(x):
        return _device("relu")(x, *(() if out is None else (out,)))
    return elementwise(lambda o, a: numpy.maximum(a, 0, out=o), numpy.empty_like(x) if out is None else out, _c(x))


def relu_backward(dy, x, out=None):
    """``out``: where dx goes (``dy`` itself included); a new array when None."""
    if _on_device(dy):
        return _device("relu_backward")(dy, x, *(() if out is None else (out,)))

    def pass_(o, g, a):
        m = numpy.greater(a, 0, out=numpy.empty_like(g), casting="unsafe")   # 1.0 where x > 0, else 0.0
        numpy.multiply(g, m, out=o)
    return elementwise(pass_, numpy.empty_like(dy) if out is None else out, _c(dy), _c(x))


def leaky_relu(x, negative_slope, out=None):
    """``out``: where y goes (``x`` itself included: each block's product goes to a block-sized
    temporary first, so the block of ``x`` is read before it is written); a new array when None."""
    if _on_device(x):
        return _device("leaky_relu")(x, x.dtype.type(negative_slope), *(() if out is None else (out,)))
    if not 0.0 <= negative_slope <= 1.0:
        y = numpy.where(x > 0, x, x * negative_slope)
        if out is None:
            return y
        out[...] = y
        return out

    def pass_(o, a):
        if numpy.may_share_memory(o, a):            # in place: read the block before writing it
            numpy.maximum(a, a * negative_slope, out=o)
            return
        numpy.multiply(a, negative_slope, out=o)
        numpy.maximum(o, a, out=o)
    return elementwise(pass_, numpy.empty_like(x) if out is None else out, _c(x))


def leaky_relu_backward(dy, x, negative_slope, out=None):
    """``out``: where dx goes (``dy`` itself included: every pass reads a block of ``dy``
    before it writes that block); a new array when None."""
    if _on_device(dy):
        return _device("leaky_relu_backward")(dy, x, dy.dtype.type(negative_slope), *(() if out is None else (out,)))

    def pass_(o, g, a):
        m = (a > 0).astype(g.dtype)           # 1 where x > 0
        if 0.0 <= negative_slope <= 1.0:
            numpy.maximum(m, negative_slope, out=m)   # 1 where x > 0, slope elsewhere
            numpy.multiply(g, m, out=o)
            return
        t = 1 - m
        t *= negative_slope                   # 0 where x > 0, slope elsewhere
        t *= g                                # (before o, which may be g, is written)
        numpy.multiply(g, m, out=o)
        o += t
    return elementwise(pass_, numpy.empty_like(dy) if out is None else out, _c(dy), _c(x))


__all__ = ["applies", "relu", "relu_backward", "leaky_relu", "leaky_relu_backward"]
