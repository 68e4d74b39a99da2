"""Pointwise activations and their backward passes (PyTorch semantics).

Derivative conventions at the kinks follow PyTorch: relu'(0) = 0 and
leaky_relu'(0) = negative_slope.  tanh's backward takes the *output*
(tanh' = 1 - tanh^2), so a layer caches y instead of x; the CosmoFlow head
uses ``scale * tanh(x)`` (scale 1.2), see ``scaled_tanh``.

Speed: this file is the reference.  On NumPy arrays relu and leaky_relu (forward and
backward) run ``refimpl/kernels/pointwise.py``: the same values by cheaper passes over
cache-sized blocks on worker threads.  The one rule (``_route.kernel_for``): NumPy arrays
take the kernel outside ``functional.reference_only()``; CuPy arrays take the math below.

Arguments (checked before either route): ``x`` an array of at least 1-D, any shape; ``dy``
exactly ``x``'s shape and dtype (never broadcast); ``negative_slope`` a real number.  Anything
else is a ValueError naming the argument.
"""
from __future__ import annotations

from ..backend import array_module, check_same_dtype
from ..kernels import pointwise as fast
from ._route import kernel_for


def _shape(a):
    """``a``'s shape for a message: its shape, or its type when it is not an array."""
    return f"shape {tuple(a.shape)}" if hasattr(a, "shape") else type(a).__name__


def _check_input(x, name="x"):
    """A ValueError naming ``x`` unless it is an array of at least 1-D (any shape, NCDHW or
    not); a 0-d array or a Python scalar is refused (the kernels work on blocks of elements)."""
    if getattr(x, "ndim", 0) < 1:
        raise ValueError(f"{name} must be an array of at least 1-D (any shape, e.g. "
                         f"N, C, D, H, W), got {_shape(x)}")


def _check_grad(dy, x, name="x"):
    """``dy`` an array of exactly ``x``'s shape (no broadcasting) and dtype, else a ValueError."""
    if not hasattr(dy, "shape") or tuple(dy.shape) != tuple(x.shape):
        raise ValueError(f"dy must have {name}'s shape {tuple(x.shape)}, got {_shape(dy)}")
    check_same_dtype(**{name: x, "dy": dy})


def _check_out(out, like, name="dy"):
    """``out`` a writeable C-contiguous array of ``like``'s shape and dtype, else a ValueError."""
    ok = (hasattr(out, "shape") and tuple(out.shape) == tuple(like.shape) and out.dtype == like.dtype
          and out.flags.c_contiguous and getattr(out.flags, "writeable", True))
    if not ok:
        raise ValueError(f"out must be a writeable C-contiguous array of {name}'s shape {tuple(like.shape)} and dtype "
                         f"{like.dtype}, got {_shape(out)}")


def _written(result, out):
    """``result``, or ``out`` holding it when an ``out`` was given."""
    if out is None:
        return result
    out[...] = result
    return out


def _check_slope(negative_slope):
    """negative_slope a real number (a Python or NumPy scalar), else a ValueError naming it."""
    real = isinstance(negative_slope, (int, float)) or getattr(negative_slope, "ndim", None) == 0
    if not real or isinstance(negative_slope, bool):
        raise ValueError(f"negative_slope must be a real number, got {negative_slope!r}")


def relu(x, *, out=None):
    """max(x, 0).

    ``out``: a C-contiguous array of x's shape and dtype that receives y and is returned; it
    may be ``x`` itself (``nn.ReLU(in_place=True)``, as ``leaky_relu``)."""
    _check_input(x)
    if out is not None:
        _check_out(out, x, "x")
    kernel = kernel_for(fast, x)
    if kernel is not None:
        return kernel.relu(x, out)
    xp = array_module(x)
    return _written(xp.maximum(x, 0), out)


def relu_backward(dy, x, *, out=None):
    """dy where x > 0, else 0: ``dy * 1[x > 0]`` (relu'(0) = 0, as PyTorch's).

    ``out``: a C-contiguous array of dy's shape and dtype that receives dx and is returned; it
    may be ``dy`` itself (``nn.ReLU(reuse_grad=True)``, as ``leaky_relu_backward``)."""
    _check_input(x)
    _check_grad(dy, x)
    if out is not None:
        _check_out(out, dy)
    kernel = kernel_for(fast, dy, x)
    if kernel is not None:
        return kernel.relu_backward(dy, x, out)
    return _written(dy * (x > 0), out)


def leaky_relu(x, negative_slope=0.01, *, out=None):
    """x where x > 0, else negative_slope * x.

    ``out``: a C-contiguous array of x's shape and dtype that receives y and is returned; it
    may be ``x`` itself (y written over the input, which saves a new array's pass through
    memory: ``nn.LeakyReLU(in_place=True)``)."""
    _check_input(x)
    _check_slope(negative_slope)
    if out is not None:
        _check_out(out, x, "x")
    kernel = kernel_for(fast, x)
    if kernel is not None:
        return kernel.leaky_relu(x, negative_slope, out)
    xp = array_module(x)
    return _written(xp.where(x > 0, x, x * negative_slope), out)


def leaky_relu_backward(dy, x, negative_slope=0.01, *, out=None):
    """dy where x > 0, else negative_slope * dy (leaky_relu'(0) = negative_slope).

    ``out``: a C-contiguous array of dy's shape and dtype that receives dx and is returned;
    it may be ``dy`` itself (dx written over the gradient, which saves a pass through memory
    of a new array: ``nn.LeakyReLU(reuse_grad=True)``)."""
    _check_input(x)
    _check_grad(dy, x)
    _check_slope(negative_slope)
    if out is not None:
        _check_out(out, dy)
    kernel = kernel_for(fast, dy, x)
    if kernel is not None:
        return kernel.leaky_relu_backward(dy, x, negative_slope, out)
    xp = array_module(x, dy)
    return _written(xp.where(x > 0, dy, dy * negative_slope), out)


def tanh(x):
    xp = array_module(x)
    return xp.tanh(x)


def tanh_backward(dy, y):
    """dy * (1 - y^2) with y = tanh(x), the forward's output."""
    _check_grad(dy, y, "y")                  # any shape, 0-d too: tanh has no kernel
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
