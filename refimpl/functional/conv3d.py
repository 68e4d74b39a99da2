"""3D convolution, forward and backward, as the math reads (PyTorch semantics, NCDHW, no groups).

    y[n, f, o] = b[f] + sum_{c, t} w[f, c, t] * x[n, c, o*s + t*dl - p]

with zero padding ``p``, stride ``s`` and dilation ``dl`` per axis (each an int
or a ``(d, h, w)`` tuple), ``t`` running over the kernel taps.  Output extent
per axis: ``floor((n + 2p - dl(k-1) - 1)/s) + 1``.

The reference (``algorithm="reference"``, or ``REFIMPL_CONV_ALGORITHM=reference``
for a whole run) is three steps, each a few lines below:

1. ``im2col``: pad ``x`` with zeros, then copy one strided slice of it per tap
   ``t``: row ``(c, t)`` of the column matrix holds ``x_pad[n, c, o*s + t*dl]``
   for every output point ``(n, o)``.  Shape ``(C*kd*kh*kw, N*Do*Ho*Wo)``.
2. one GEMM: ``Y = W @ col``, with ``W`` the weight as an ``(F, C*kd*kh*kw)``
   matrix (its memory order is the rows' ``(c, t)`` order).
3. backward, the adjoints of those two linear maps (docs/derivations.md, "Convolution"):
   ``dW = dY @ col^T``; ``dcol = W^T @ dY``, and ``col2im`` adds every entry
   of ``dcol`` back to the input point it was copied from (the adjoint of a
   copy is an add; overlapping windows add up), then drops the padding;
   ``db = sum of dY`` over (N, D, H, W).

Transposed convolution is this conv's input adjoint (conv_transpose3d.py).

The other algorithms compute the same sums faster and live in
``refimpl/kernels/`` (tiled im2col without a padded copy, phase grids for
strides, Winograd F(4x4x4, 3x3x3), the device schedule, worker threads), picked
by ``refimpl/kernels/conv.py``: ``algorithm`` "auto" (the default), "im2col" or
"winograd"; None reads ``REFIMPL_CONV_ALGORITHM``.  Each is tested against the
functions below.

``conv3d_input_grad`` and ``conv3d_weight_grad`` accept a ``dy`` whose spatial
extent is *at most* the conv output extent (the first outputs per axis; inputs
past the last window get zero gradient), which is what transposed convolution
with ``output_padding`` needs.
"""
from __future__ import annotations

from itertools import product
from math import prod

from .. import settings
from ..backend import array_module, check_same_dtype
from ._args import check_float, check_ndim, triple, window_out_shape

AXES = ("depth", "height", "width")
ENV_ALGORITHM = "REFIMPL_CONV_ALGORITHM"
ALGORITHMS = settings.SETTINGS[ENV_ALGORITHM].choices      # ("auto", "im2col", "winograd", "reference")
REFERENCE = "reference"


# ---------------------------------------------------------------- the math

def tap_windows(kernel, s, dl, out):
    """``(tap, window)`` per kernel tap in weight order: ``window`` the strided slices of the padded
    input that tap reads for the outputs ``0 .. out-1`` (``t*dl + o*s`` per axis)."""
    for tap in product(*(range(k) for k in kernel)):
        yield tap, tuple(slice(t * d, t * d + st * (o - 1) + 1, st) for t, d, st, o in zip(tap, dl, s, out))


def im2col(x, kernel, s, p, dl, out):
    """``(N, C, D, H, W) -> (C*kd*kh*kw, N*Do*Ho*Wo)``: row ``(c, t)`` holds ``x_pad[n, c, o*s + t*dl]``."""
    xp = array_module(x)
    n, c = x.shape[:2]
    x_pad = xp.pad(x, ((0, 0), (0, 0)) + tuple((q, q) for q in p))   # (N, C, D+2p, H+2p, W+2p)
    col = xp.empty((c, prod(kernel), n) + tuple(out), dtype=x.dtype)  # (C, taps, N, Do, Ho, Wo)
    for j, (_, window) in enumerate(tap_windows(kernel, s, dl, out)):
        col[:, j] = x_pad[(slice(None), slice(None)) + window].transpose(1, 0, 2, 3, 4)
    return col.reshape(c * prod(kernel), n * prod(out))


def col2im(col, input_shape, kernel, s, p, dl, out):
    """The adjoint of ``im2col``: each entry of ``col`` added to the input point it came from."""
    xp = array_module(col)
    n, c = input_shape[:2]
    padded = (n, c) + tuple(e + 2 * q for e, q in zip(input_shape[2:], p))
    x_pad = xp.zeros(padded, dtype=col.dtype)                          # (N, C, D+2p, H+2p, W+2p)
    col = col.reshape((c, prod(kernel), n) + tuple(out))               # (C, taps, N, Do, Ho, Wo)
    for j, (_, window) in enumerate(tap_windows(kernel, s, dl, out)):
        x_pad[(slice(None), slice(None)) + window] += col[:, j].transpose(1, 0, 2, 3, 4)
    inner = tuple(slice(q, q + e) for q, e in zip(p, input_shape[2:]))
    return x_pad[(slice(None), slice(None)) + inner]                   # the padding dropped


def forward(x, w, b, s, p, dl, out):
    """``y = W @ im2col(x) (+ b)`` for validated arguments; ``out`` may be the first outputs only."""
    xp = array_module(x)
    n, f = x.shape[0], w.shape[0]
    y = w.reshape(f, -1) @ im2col(x, w.shape[2:], s, p, dl, out)      # (F, N*Do*Ho*Wo)
    y = xp.ascontiguousarray(y.reshape((f, n) + tuple(out)).transpose(1, 0, 2, 3, 4))   # (N, F, Do, Ho, Wo)
    if b is not None:
        y += b.reshape(1, -1, 1, 1, 1)
    return y


def input_grad(dy, w, input_shape, s, p, dl):
    """``dx = col2im(W^T @ dY)``: the adjoint of the forward in ``x`` (``dy`` may cover the first outputs)."""
    f = w.shape[0]
    dy_rows = dy.transpose(1, 0, 2, 3, 4).reshape(f, -1)             # (F, N*Do*Ho*Wo), as W @ col gives
    return col2im(w.reshape(f, -1).T @ dy_rows, input_shape, w.shape[2:], s, p, dl, dy.shape[2:])


def weight_grad(dy, x, weight_shape, s, p, dl):
    """``dW = dY @ col^T``: the adjoint of the forward in ``W`` (``dy`` may cover the first outputs)."""
    dy_rows = dy.transpose(1, 0, 2, 3, 4).reshape(dy.shape[1], -1)   # (F, N*Do*Ho*Wo)
    col = im2col(x, weight_shape[2:], s, p, dl, dy.shape[2:])         # (C*taps, N*Do*Ho*Wo)
    return (dy_rows @ col.T).reshape(weight_shape)


# ---------------------------------------------------------------- arguments, and the choice of route

def algorithm_setting():
    """``REFIMPL_CONV_ALGORITHM`` (default "auto"), or ValueError naming the variable
    (parsed by refimpl.settings, read at every call so a run can switch it)."""
    return settings.env_setting(ENV_ALGORITHM)


def is_reference(algorithm) -> bool:
    """Whether this call runs the math above (``algorithm``, else ``REFIMPL_CONV_ALGORITHM``)."""
    if algorithm is None:
        algorithm = algorithm_setting()
    elif algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    return algorithm == REFERENCE


def conv_params(stride, padding, dilation):
    """Validated ``(stride, padding, dilation)`` triples."""
    return (triple(stride, "stride", 1), triple(padding, "padding", 0),
            triple(dilation, "dilation", 1))


def conv_out_spatial(in_spatial, k, s, p, dl, x_name="x", w_name="w"):
    """Output extents; ValueError naming the kernel when a window does not fit."""
    out = window_out_shape(in_spatial, k, s, p, dl)
    for ax, (o, n, kk, pp, dd) in enumerate(zip(out, in_spatial, k, p, dl)):
        if o < 1:
            raise ValueError(
                f"kernel of {w_name} is larger than the padded input of {x_name} on the "
                f"{AXES[ax]} axis: dilated kernel extent {dd * (kk - 1) + 1} > padded input "
                f"extent {n + 2 * pp} (output extent would be {o}, must be >= 1)")
    return out


def _check_x_w(x, w, x_name="x", w_name="w"):
    check_ndim(x, 5, x_name, "N, C, D, H, W")
    check_ndim(w, 5, w_name, "F, C, kd, kh, kw")
    check_float(x_name, x)
    check_float(w_name, w)
    if min(w.shape[2:]) < 1:
        raise ValueError(f"{w_name} must have a kernel extent >= 1 on every axis, got shape {w.shape}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"channel mismatch: {x_name} has {x.shape[1]} channels (shape[1]) but "
                         f"{w_name} expects {w.shape[1]} (w.shape[1]); weights are (F, C, kd, kh, kw)")


def check_bias(b, n_out, name="b"):
    if b is None:
        return
    if getattr(b, "ndim", None) != 1 or b.shape[0] != n_out:
        raise ValueError(f"{name} must have shape ({n_out},) (one value per output channel), "
                         f"got {getattr(b, 'shape', None)}")


def check_dy_extent(dy, expected, name="dy"):
    """``dy``'s spatial extent must be >= 1 and <= ``expected`` per axis."""
    for ax, (o, e) in enumerate(zip(dy.shape[2:], expected)):
        if not 1 <= o <= e:
            raise ValueError(f"{name} has spatial shape {tuple(dy.shape[2:])}: on the {AXES[ax]} "
                             f"axis it must be between 1 and the conv output extent {e}")


# ---------------------------------------------------------------- the public functions

def conv3d(x, w, b=None, stride=1, padding=0, dilation=1, *, max_temp_bytes=None, algorithm=None):
    """3D convolution ``(N, C, D, H, W) * (F, C, kd, kh, kw) -> (N, F, Do, Ho, Wo)``.

    ``algorithm``: "reference" (the math above), or "auto", "im2col", "winograd"
    (refimpl/kernels/conv.py); None: ``REFIMPL_CONV_ALGORITHM``, default "auto".
    ``max_temp_bytes`` bounds the kernels' temporary buffers (the reference has no bound)."""
    _check_x_w(x, w)
    check_same_dtype(x=x, w=w, b=b)
    check_bias(b, w.shape[0])
    s, p, dl = conv_params(stride, padding, dilation)
    out = conv_out_spatial(x.shape[2:], w.shape[2:], s, p, dl)
    if is_reference(algorithm):
        return forward(x, w, b, s, p, dl, out)
    from ..kernels import conv as kernel
    return kernel.forward_with_bias(x, w, s, p, dl, out, kernel.budget_or_default(max_temp_bytes),
                                    algorithm, bias=b)


def conv3d_backward(dy, x, w, stride=1, padding=0, dilation=1, *, max_temp_bytes=None,
                    algorithm=None):
    """``(dx, dw, db)`` of ``y = conv3d(x, w, b)`` given ``dy = dL/dy``.

    ``db`` is ``dy`` summed over (N, D, H, W), returned whether or not the forward had a bias.
    """
    _check_x_w(x, w)
    check_ndim(dy, 5, "dy", "N, F, Do, Ho, Wo")
    check_same_dtype(dy=dy, x=x, w=w)
    s, p, dl = conv_params(stride, padding, dilation)
    out = conv_out_spatial(x.shape[2:], w.shape[2:], s, p, dl)
    expected = (x.shape[0], w.shape[0]) + out
    if tuple(dy.shape) != expected:
        raise ValueError(f"dy must have the conv output shape {expected}, got {tuple(dy.shape)}")
    if is_reference(algorithm):
        dx, dw = input_grad(dy, w, x.shape, s, p, dl), weight_grad(dy, x, w.shape, s, p, dl)
    else:
        from ..kernels import conv as kernel
        dx, dw = kernel.backward_no_bias(dy, x, w, s, p, dl, kernel.budget_or_default(max_temp_bytes),
                                         algorithm)
    return dx, dw, dy.sum(axis=(0, 2, 3, 4))


def _shape5(value, name, layout):
    """A 5-tuple of positive ints, or ValueError naming the argument."""
    try:
        shape = tuple(int(v) for v in value)
    except TypeError:
        raise ValueError(f"{name} must be a 5-tuple ({layout}), got {value!r}") from None
    if len(shape) != 5 or min(shape) < 1:
        raise ValueError(f"{name} must be a 5-tuple ({layout}) of positive ints, got {value!r}")
    return shape


def conv3d_input_grad(dy, w, input_shape, stride=1, padding=0, dilation=1, *, max_temp_bytes=None,
                      algorithm=None):
    """``dx`` (of shape ``input_shape``) of ``y = conv3d(x, w)`` given ``dy``.

    ``dy``'s spatial extent may be smaller than the conv output extent of
    ``input_shape`` (the first outputs per axis; the rest count as zero).
    """
    check_ndim(dy, 5, "dy", "N, F, Do, Ho, Wo")
    check_ndim(w, 5, "w", "F, C, kd, kh, kw")
    check_float("dy", dy)
    check_same_dtype(dy=dy, w=w)
    input_shape = _shape5(input_shape, "input_shape", "N, C, D, H, W")
    if input_shape[1] != w.shape[1]:
        raise ValueError(f"channel mismatch: input_shape has {input_shape[1]} channels but w expects "
                         f"{w.shape[1]} (w.shape[1])")
    if dy.shape[:2] != (input_shape[0], w.shape[0]):
        raise ValueError(f"dy must have shape (N, F, ...) = ({input_shape[0]}, {w.shape[0]}, ...), "
                         f"got {tuple(dy.shape)}")
    s, p, dl = conv_params(stride, padding, dilation)
    out = conv_out_spatial(input_shape[2:], w.shape[2:], s, p, dl, x_name="input_shape")
    check_dy_extent(dy, out)
    if is_reference(algorithm):
        return input_grad(dy, w, input_shape, s, p, dl)
    from ..kernels import conv as kernel
    return kernel.input_grad(dy, w, input_shape, s, p, dl, kernel.budget_or_default(max_temp_bytes),
                             algorithm, tuple(dy.shape[2:]) == out)


def conv3d_weight_grad(dy, x, weight_shape, stride=1, padding=0, dilation=1, *, max_temp_bytes=None,
                       algorithm=None):
    """``dW`` (of shape ``weight_shape`` = (F, C, kd, kh, kw)) of ``y = conv3d(x, w)`` given ``dy``.

    ``dy``'s spatial extent may be smaller than the conv output extent of ``x``
    (the first outputs per axis).
    """
    check_ndim(dy, 5, "dy", "N, F, Do, Ho, Wo")
    check_ndim(x, 5, "x", "N, C, D, H, W")
    check_float("x", x)
    check_same_dtype(dy=dy, x=x)
    weight_shape = _shape5(weight_shape, "weight_shape", "F, C, kd, kh, kw")
    if x.shape[1] != weight_shape[1]:
        raise ValueError(f"channel mismatch: x has {x.shape[1]} channels but weight_shape expects "
                         f"{weight_shape[1]}")
    if dy.shape[:2] != (x.shape[0], weight_shape[0]):
        raise ValueError(f"dy must have shape (N, F, ...) = ({x.shape[0]}, {weight_shape[0]}, ...), "
                         f"got {tuple(dy.shape)}")
    s, p, dl = conv_params(stride, padding, dilation)
    out = conv_out_spatial(x.shape[2:], weight_shape[2:], s, p, dl, w_name="weight_shape")
    check_dy_extent(dy, out)
    if is_reference(algorithm):
        return weight_grad(dy, x, weight_shape, s, p, dl)
    from ..kernels import conv as kernel
    return kernel.weight_grad(dy, x, weight_shape, s, p, dl, kernel.budget_or_default(max_temp_bytes),
                              algorithm, tuple(dy.shape[2:]) == out)


__all__ = ["conv3d", "conv3d_backward", "conv3d_input_grad", "conv3d_weight_grad", "im2col", "col2im",
           "forward", "input_grad", "weight_grad", "ALGORITHMS", "REFERENCE"]
