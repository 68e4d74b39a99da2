"""3D convolution, forward and backward, as the math reads (PyTorch semantics, NCDHW).

    y[n, f, o] = b[f] + sum_{c, t} w[f, c, t] * x[n, c, o*s + t*dl - p_lo]

with zero padding ``p_lo`` before and ``p_hi`` after the input, stride ``s`` and
dilation ``dl`` per axis (each an int or a ``(d, h, w)`` tuple), ``t`` running over
the kernel taps.  Output extent per axis: ``floor((n + p_lo + p_hi - dl(k-1) - 1)/s) + 1``.
``padding`` is an int, ``(pd, ph, pw)`` (``p_lo = p_hi``), a per-side 6-tuple
``(d_lo, d_hi, h_lo, h_hi, w_lo, w_hi)``, ``'valid'`` (0) or ``'same'`` (stride 1: total
``dl(k-1)`` per axis, the odd cell of an even kernel on the hi side, as both PyTorch and
TensorFlow place it; refimpl/functional/args.py has the rules side by side).  The
kernels take symmetric padding; an asymmetric one reaches them as an explicit zero pad of
the difference (refimpl/kernels/conv.py).

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

Transposed convolution is this conv's input adjoint (conv_transpose3d.py).  ``groups``
(PyTorch's) splits the channels in equal groups, each its own conv (weight ``(F, C/groups, ...)``):
the public functions run one conv per group and concatenate.

The other algorithms compute the same sums faster and live in
``refimpl/kernels/`` (tiled im2col without a padded copy, phase grids for
strides, Winograd F(4x4x4, 3x3x3) and F(4x4x4, 2x2x2), the device schedule, worker threads), picked
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
from .args import PADDING_FORMS, triple

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
    """``(N, C, D, H, W) -> (C*kd*kh*kw, N*Do*Ho*Wo)``: row ``(c, t)`` holds ``x_pad[n, c, o*s + t*dl]``.

    ``p`` per axis: an int (both sides) or a ``(lo, hi)`` pair (asymmetric padding)."""
    xp = array_module(x)
    n, c = x.shape[:2]
    sides = tuple(q if isinstance(q, tuple) else (q, q) for q in p)  # (lo, hi) per axis
    x_pad = xp.pad(x, ((0, 0), (0, 0)) + sides)                       # (N, C, D+lo+hi, H+.., W+..)
    col = xp.empty((c, prod(kernel), n) + tuple(out), dtype=x.dtype)  # (C, taps, N, Do, Ho, Wo)
    for j, (_, window) in enumerate(tap_windows(kernel, s, dl, out)):
        col[:, j] = x_pad[(slice(None), slice(None)) + window].transpose(1, 0, 2, 3, 4)
    return col.reshape(c * prod(kernel), n * prod(out))


def col2im(col, input_shape, kernel, s, p, dl, out):
    """The adjoint of ``im2col``: each entry of ``col`` added to the input point it came from."""
    xp = array_module(col)
    n, c = input_shape[:2]
    sides = tuple(q if isinstance(q, tuple) else (q, q) for q in p)  # (lo, hi) per axis
    padded = (n, c) + tuple(e + lo + hi for e, (lo, hi) in zip(input_shape[2:], sides))
    x_pad = xp.zeros(padded, dtype=col.dtype)                          # (N, C, D+lo+hi, H+.., W+..)
    col = col.reshape((c, prod(kernel), n) + tuple(out))               # (C, taps, N, Do, Ho, Wo)
    for j, (_, window) in enumerate(tap_windows(kernel, s, dl, out)):
        x_pad[(slice(None), slice(None)) + window] += col[:, j].transpose(1, 0, 2, 3, 4)
    inner = tuple(slice(lo, lo + e) for (lo, _), e in zip(sides, input_shape[2:]))
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

def is_reference(algorithm) -> bool:
    """Whether this call runs the math above: ``algorithm``, else ``REFIMPL_CONV_ALGORITHM``
    (read at every call, so a run can switch it; refimpl.settings refuses a bad value)."""
    if algorithm is None:
        algorithm = settings.env_setting(ENV_ALGORITHM)
    elif algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    return algorithm == REFERENCE


LAYOUTS = {"x": "N, C, D, H, W", "w": "F, C, kd, kh, kw", "dy": "N, F, Do, Ho, Wo",
           "input_shape": "N, C, D, H, W", "weight_shape": "F, C, kd, kh, kw"}


def conv_args(stride, padding, dilation, *, x=None, w=None, b=None, dy=None, input_shape=None,
              weight_shape=None, first_outputs=False, groups=1):
    """``(s, p, dl, out)`` of one conv call, after every rule the math above assumes is checked.

    Each given array is 5-D, floating point and of one dtype (``b``: one value per output
    channel); the channels of ``x`` (or ``input_shape``) and ``w`` (or ``weight_shape``) agree;
    the dilated kernel fits the padded input: ``out = floor((n + 2p - dl(k-1) - 1)/s) + 1 >= 1``
    per axis; ``dy`` has the output shape, or with ``first_outputs`` the first outputs per axis
    (at least one).  A ValueError names the argument, before any computation (and, in the
    distributed layers, before any message).  One function, so that the reference reads in few."""
    arrays = {name: a for name, a in (("dy", dy), ("x", x), ("w", w)) if a is not None}
    for name, a in arrays.items():
        if getattr(a, "ndim", None) != 5:
            raise ValueError(f"{name} must be 5-D ({LAYOUTS[name]}), got shape {getattr(a, 'shape', None)}")
        if a.dtype.kind != "f":
            raise ValueError(f"{name} must be a floating-point array, got {a.dtype}")
    check_same_dtype(**arrays, b=b)
    x_name = "x" if x is not None else "input_shape"
    w_name = "w" if w is not None else "weight_shape"
    x_shape = tuple(x.shape) if x is not None else _shape5(input_shape, x_name)
    w_shape = tuple(w.shape) if w is not None else _shape5(weight_shape, w_name)
    if min(w_shape[2:]) < 1:
        raise ValueError(f"{w_name} must have a kernel extent >= 1 on every axis, got shape {w_shape}")
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or w_shape[0] % groups:
        raise ValueError(f"groups must be a positive integer dividing the {w_shape[0]} output channels "
                         f"({w_name}[0]), got {groups!r}")
    if x_shape[1] != w_shape[1] * groups:
        raise ValueError(f"channel mismatch: {x_name} has {x_shape[1]} channels (shape[1]) but "
                         f"{w_name} expects {w_shape[1]} ({w_name}[1]) x groups={groups}; weights are "
                         f"({LAYOUTS['w']}), C the channels of one group")
    if b is not None and (getattr(b, "ndim", None) != 1 or b.shape[0] != w_shape[0]):
        raise ValueError(f"b must have shape ({w_shape[0]},) (one value per output channel), "
                         f"got {getattr(b, 'shape', None)}")
    s, dl = triple(stride, "stride", 1), triple(dilation, "dilation", 1)
    # padding: int, (pd, ph, pw), (d_lo, d_hi, h_lo, h_hi, w_lo, w_hi), 'valid' or 'same' (the
    # table in refimpl/functional/args.py) -> (lo, hi) per axis, written out here so that the
    # reference reads in few functions
    if isinstance(padding, str):
        if padding not in ("valid", "same"):
            raise ValueError(f"padding must be {PADDING_FORMS}, got {padding!r}")
        if padding == "same" and s != (1, 1, 1):
            raise ValueError(f"padding='same' needs stride 1 on every axis (as in PyTorch), got stride {s}")
        total = [d * (k - 1) if padding == "same" else 0 for k, d in zip(w_shape[2:], dl)]
        sides = tuple((t // 2, t - t // 2) for t in total)
    elif isinstance(padding, (tuple, list)) and len(padding) == 6:
        sides = tuple(zip(triple(padding[0::2], "padding", 0), triple(padding[1::2], "padding", 0)))
    else:
        sides = tuple((q, q) for q in triple(padding, "padding", 0))
    # symmetric: (pd, ph, pw), the form every kernel takes; else the (lo, hi) pairs
    p = tuple(lo for lo, _ in sides) if all(lo == hi for lo, hi in sides) else sides
    out = tuple((n + lo + hi - d * (k - 1) - 1) // st + 1
                for n, k, st, (lo, hi), d in zip(x_shape[2:], w_shape[2:], s, sides, dl))
    for ax, (o, n, k, (lo, hi), d) in enumerate(zip(out, x_shape[2:], w_shape[2:], sides, dl)):
        if o < 1:
            raise ValueError(
                f"kernel of {w_name} is larger than the padded input of {x_name} on the "
                f"{AXES[ax]} axis: dilated kernel extent {d * (k - 1) + 1} > padded input "
                f"extent {n + lo + hi} (output extent would be {o}, must be >= 1)")
    if dy is not None:
        expected = (x_shape[0], w_shape[0]) + out
        if not first_outputs and tuple(dy.shape) != expected:
            raise ValueError(f"dy must have the conv output shape {expected}, got {tuple(dy.shape)}")
        if dy.shape[:2] != expected[:2]:
            raise ValueError(f"dy must have shape (N, F, ...) = ({expected[0]}, {expected[1]}, ...), "
                             f"got {tuple(dy.shape)}")
        for ax, (o, e) in enumerate(zip(dy.shape[2:], out)):
            if not 1 <= o <= e:
                raise ValueError(f"dy has spatial shape {tuple(dy.shape[2:])}: on the {AXES[ax]} "
                                 f"axis it must be between 1 and the conv output extent {e}")
    return s, p, dl, out


def _shape5(value, name):
    """A 5-tuple of non-negative ints, or ValueError naming the argument.

    Non-negative, as an array's shape: an input extent of 0 is a valid input where the padding
    gives the output extent (a spatial block that reads only padding), and a shape must pass
    wherever the array of that shape does (a grouped conv's input gradient takes the shape of
    each group's slice); the kernel and output extents are checked by ``conv_args``."""
    try:
        shape = tuple(int(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a 5-tuple ({LAYOUTS[name]}), got {value!r}") from None
    if len(shape) != 5 or min(shape) < 0:
        raise ValueError(f"{name} must be a 5-tuple ({LAYOUTS[name]}) of non-negative ints, got {value!r}")
    return shape


# ---------------------------------------------------------------- the public functions

def conv3d(x, w, b=None, stride=1, padding=0, dilation=1, groups=1, *, max_temp_bytes=None, algorithm=None):
    """3D convolution ``(N, C, D, H, W) * (F, C/groups, kd, kh, kw) -> (N, F, Do, Ho, Wo)``.

    ``algorithm``: "reference" (the math above), or "auto", "im2col", "winograd"
    (refimpl/kernels/conv.py); None: ``REFIMPL_CONV_ALGORITHM``, default "auto".
    ``max_temp_bytes`` bounds the kernels' temporary buffers (the reference has no bound).
    ``groups`` (PyTorch's): input channel group ``g`` feeds output channel group ``g`` alone,
    i.e. ``groups`` independent convs on channel slices (``_grouped``), concatenated."""
    s, p, dl, out = conv_args(stride, padding, dilation, x=x, w=w, b=b, groups=groups)
    if groups > 1:
        return _grouped(lambda xg, wg, bg: conv3d(xg, wg, bg, stride, padding, dilation, max_temp_bytes=max_temp_bytes,
                                                  algorithm=algorithm), groups, 1, (x, 1), (w, 0), (b, 0))
    if is_reference(algorithm):
        return forward(x, w, b, s, p, dl, out)
    from ..kernels import conv as kernel
    return kernel.forward_with_bias(x, w, s, p, dl, out, kernel.budget_or_default(max_temp_bytes),
                                    algorithm, bias=b)


def conv3d_backward(dy, x, w, stride=1, padding=0, dilation=1, groups=1, *, max_temp_bytes=None,
                    algorithm=None):
    """``(dx, dw, db)`` of ``y = conv3d(x, w, b)`` given ``dy = dL/dy``.

    ``db`` is ``dy`` summed over (N, D, H, W), returned whether or not the forward had a bias.
    """
    s, p, dl, _ = conv_args(stride, padding, dilation, x=x, w=w, dy=dy, groups=groups)
    if groups > 1:
        dx = _grouped(lambda dyg, xg, wg: conv3d_input_grad(dyg, wg, xg.shape, stride, padding, dilation,
                                                            max_temp_bytes=max_temp_bytes, algorithm=algorithm),
                      groups, 1, (dy, 1), (x, 1), (w, 0))
        dw = _grouped(lambda dyg, xg, wg: conv3d_weight_grad(dyg, xg, wg.shape, stride, padding, dilation,
                                                             max_temp_bytes=max_temp_bytes, algorithm=algorithm),
                      groups, 0, (dy, 1), (x, 1), (w, 0))
    elif is_reference(algorithm):
        dx, dw = input_grad(dy, w, x.shape, s, p, dl), weight_grad(dy, x, w.shape, s, p, dl)
    else:
        from ..kernels import conv as kernel
        dx, dw = kernel.backward_no_bias(dy, x, w, s, p, dl, kernel.budget_or_default(max_temp_bytes),
                                         algorithm)
    return dx, dw, dy.sum(axis=(0, 2, 3, 4))


def conv3d_input_grad(dy, w, input_shape, stride=1, padding=0, dilation=1, groups=1, *, max_temp_bytes=None,
                      algorithm=None):
    """``dx`` (of shape ``input_shape``) of ``y = conv3d(x, w)`` given ``dy``.

    ``dy``'s spatial extent may be smaller than the conv output extent of
    ``input_shape`` (the first outputs per axis; the rest count as zero).
    """
    s, p, dl, out = conv_args(stride, padding, dilation, w=w, dy=dy, input_shape=input_shape,
                              first_outputs=True, groups=groups)
    input_shape = _shape5(input_shape, "input_shape")
    if groups > 1:
        shape = (input_shape[0], input_shape[1] // groups) + input_shape[2:]
        return _grouped(lambda dyg, wg: conv3d_input_grad(dyg, wg, shape, stride, padding, dilation,
                                                          max_temp_bytes=max_temp_bytes, algorithm=algorithm),
                        groups, 1, (dy, 1), (w, 0))
    if is_reference(algorithm):
        return input_grad(dy, w, input_shape, s, p, dl)
    from ..kernels import conv as kernel
    return kernel.input_grad(dy, w, input_shape, s, p, dl, kernel.budget_or_default(max_temp_bytes),
                             algorithm, tuple(dy.shape[2:]) == out)


def conv3d_weight_grad(dy, x, weight_shape, stride=1, padding=0, dilation=1, groups=1, *, max_temp_bytes=None,
                       algorithm=None):
    """``dW`` (of shape ``weight_shape`` = (F, C/groups, kd, kh, kw)) of ``y = conv3d(x, w)`` given ``dy``.

    ``dy``'s spatial extent may be smaller than the conv output extent of ``x``
    (the first outputs per axis).
    """
    s, p, dl, out = conv_args(stride, padding, dilation, x=x, dy=dy, weight_shape=weight_shape,
                              first_outputs=True, groups=groups)
    weight_shape = _shape5(weight_shape, "weight_shape")
    if groups > 1:
        shape = (weight_shape[0] // groups,) + weight_shape[1:]
        return _grouped(lambda dyg, xg: conv3d_weight_grad(dyg, xg, shape, stride, padding, dilation,
                                                           max_temp_bytes=max_temp_bytes, algorithm=algorithm),
                        groups, 0, (dy, 1), (x, 1))
    if is_reference(algorithm):
        return weight_grad(dy, x, weight_shape, s, p, dl)
    from ..kernels import conv as kernel
    return kernel.weight_grad(dy, x, weight_shape, s, p, dl, kernel.budget_or_default(max_temp_bytes),
                              algorithm, tuple(dy.shape[2:]) == out)


def _grouped(fn, groups, axis, *arrays):
    """``concatenate([fn(slice g of each array) for g], axis)``: a grouped conv is ``groups``
    ungrouped ones.  ``arrays``: ``(array, channel axis)`` pairs, cut in ``groups`` equal
    contiguous slices along that axis (None stays None).  ``axis`` a tuple: ``fn`` returns that
    many arrays, each concatenated along its own axis (a tuple of the results)."""
    xp = array_module(*(a for a, _ in arrays if a is not None))

    def piece(a, ax, g):
        if a is None:
            return None
        n = a.shape[ax] // groups
        return xp.ascontiguousarray(a[(slice(None),) * ax + (slice(g * n, (g + 1) * n),)])
    parts = [fn(*(piece(a, ax, g) for a, ax in arrays)) for g in range(groups)]
    if isinstance(axis, tuple):
        return tuple(xp.concatenate([part[i] for part in parts], axis=ax) for i, ax in enumerate(axis))
    return xp.concatenate(parts, axis=axis)


__all__ = ["conv3d", "conv3d_backward", "conv3d_input_grad", "conv3d_weight_grad", "im2col", "col2im",
           "forward", "input_grad", "weight_grad", "ALGORITHMS", "REFERENCE"]
