"""Fully connected layer and flatten (PyTorch layout: w is (out_features, in_features)).

    y  = x w^T + b          x: (N, in), y: (N, out)
    dx = dy w,  dw = dy^T x,  db = sum_n dy
"""
from __future__ import annotations

from math import prod

from ..backend import check_same_dtype
from .args import check_float, check_ndim


def linear(x, w, b=None):
    """y = x @ w.T + b."""
    check_ndim(x, 2, "x", "N, in_features")
    check_ndim(w, 2, "w", "out_features, in_features")
    check_float("x", x)
    if b is not None and (getattr(b, "ndim", None) != 1 or b.shape[0] != w.shape[0]):
        raise ValueError(f"b must have shape ({w.shape[0]},), got {getattr(b, 'shape', type(b).__name__)}")
    check_same_dtype(x=x, w=w, b=b)
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"x has {x.shape[1]} features but w expects {w.shape[1]} (w is (out, in))")
    y = x @ w.T                                                  # (N, out)
    return y if b is None else y + b


def linear_backward(dy, x, w):
    """(dx, dw, db) for y = x @ w.T + b."""
    check_ndim(x, 2, "x", "N, in_features")
    check_ndim(w, 2, "w", "out_features, in_features")
    check_ndim(dy, 2, "dy", "N, out_features")
    check_same_dtype(x=x, w=w, dy=dy)
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"x has {x.shape[1]} features but w expects {w.shape[1]} (w is (out, in))")
    if tuple(dy.shape) != (x.shape[0], w.shape[0]):
        raise ValueError(f"dy must have shape {(x.shape[0], w.shape[0])}, got {dy.shape}")
    return dy @ w, dy.T @ x, dy.sum(axis=0)


def flatten(x):
    """(N, ...) -> (N, prod(...)), a C-order reshape (as torch.flatten(x, 1))."""
    if getattr(x, "ndim", 0) < 1:
        raise ValueError(f"x must have a batch axis, got shape {getattr(x, 'shape', None)}")
    return x.reshape(x.shape[0], -1)


def flatten_backward(dy, x_shape):
    """dy reshaped back to the input's shape."""
    x_shape = tuple(x_shape)
    if getattr(dy, "size", None) != prod(x_shape):
        raise ValueError(f"dy of shape {getattr(dy, 'shape', type(dy).__name__)} does not hold "
                         f"the {prod(x_shape)} values of x_shape {x_shape}")
    return dy.reshape(x_shape)


__all__ = ["linear", "linear_backward", "flatten", "flatten_backward"]
