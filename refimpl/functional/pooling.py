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

Speed: this file is the reference.  Large NumPy arrays run the same stages
block by block on worker threads (``refimpl/kernels/pooling.py``: one sample, a
few channels a block, each block exactly this math, so the same bits); the one
rule (``_route.kernel_for``): NumPy arrays of more than ``kernels.pooling.BLOCK_ELEMENTS``
elements take the kernel, outside ``functional.reference_only()``, and so do smaller ones of a
max pool whose 2 x 2 x 2 windows tile them (their first-maximum taps, then a scatter); CuPy
arrays take the kernel's CUDA passes; other small arrays take the math below.

Padding: an int, ``(pd, ph, pw)``, a per-side ``(d_lo, d_hi, h_lo, h_hi, w_lo, w_hi)``,
``'valid'`` or ``'same'`` (stride 1; the forms and the 'same' rules are in
``refimpl/functional/args.py``); each side must be ``<= kernel // 2`` (PyTorch's rule),
so every window holds at least one real element.  Max pooling pads with ``-inf``;
average pooling pads with zeros.

Output extent per axis: ``floor((n + lo + hi - d(k-1) - 1)/s) + 1``; with ``ceil_mode``
(PyTorch's rule) ``ceil`` instead of ``floor``, and the last window is dropped unless it
starts inside the input or the lo padding (``(out-1)*s < n + lo``).  The last window may
then hang past the hi padding: those cells are padding too (``-inf`` for max; zeros that
no divisor counts for avg), so the math pads the hi side by that overhang as well.

Average pooling divides each window's sum by its divisor (PyTorch's, exactly):
``divisor_override`` when given, else per axis the cells of the window that lie within
``[-lo, n + hi)`` (``count_include_pad=True``, the default: the padding counts, the
ceil-mode overhang does not) or within ``[0, n)`` (``count_include_pad=False``), the
product over the three axes (a window is a box, so its count is too).  Without
``ceil_mode`` and with ``count_include_pad`` that is the kernel volume everywhere.
"""
from __future__ import annotations

import numpy

from ..backend import array_module, check_same_dtype
from ..kernels import pooling as fast
from ._route import kernel_for
from .args import check_float, check_ndim, padding_sides, triple, window_out_shape

AXES = (4, 3, 2)  # W, then H, then D: the forward order of the separable stages



def _pool_args(x, kernel_size, stride, padding, dilation, ceil_mode=False):
    """Validate and normalise pooling hyper-parameters -> (k, s, p, d, out_shape, reach):
    ``p`` the (lo, hi) padding per axis, ``reach`` the same with hi grown by the ceil-mode
    overhang (what the math pads)."""
    check_ndim(x, 5, "x", "N, C, D, H, W")
    check_float("x", x)
    k = triple(kernel_size, "kernel_size", 1)
    s = k if stride is None else triple(stride, "stride", 1)
    d = triple(dilation, "dilation", 1)
    if not isinstance(ceil_mode, bool):
        raise ValueError(f"ceil_mode must be True or False, got {ceil_mode!r}")
    p = padding_sides(padding, k, d, s)
    for ki, (lo, hi) in zip(k, p):
        if max(lo, hi) > ki // 2:
            raise ValueError(f"padding must be <= kernel_size // 2 on every axis and side "
                             f"(PyTorch's rule), got padding={padding!r} for kernel_size={k}")
    out = window_out_shape(x.shape[2:], k, s, p, d, ceil_mode)
    if min(out) < 1:
        raise ValueError(f"input spatial shape {tuple(x.shape[2:])} is too small for "
                         f"kernel_size={k}, dilation={d}, padding={padding!r}: output would be {out}")
    reach = tuple((lo, max(hi, (o - 1) * si + di * (ki - 1) + 1 - n - lo))
                  for (lo, hi), o, si, di, ki, n in zip(p, out, s, d, k, x.shape[2:]))
    return k, s, p, d, out, reach


def check_avg_options(count_include_pad, divisor_override):
    """avg pooling's own arguments (ValueError naming the argument)."""
    if not isinstance(count_include_pad, bool):
        raise ValueError(f"count_include_pad must be True or False, got {count_include_pad!r}")
    if divisor_override is not None and (isinstance(divisor_override, (bool, str)) or
                                         not isinstance(divisor_override, (int, numpy.integer)) or
                                         divisor_override == 0):
        raise ValueError(f"divisor_override must be None or a nonzero integer (as PyTorch), "
                         f"got {divisor_override!r}")


def avg_divisor(x, k, s, p, out, count_include_pad=True, divisor_override=None):
    """What each window's sum is divided by: ``divisor_override``, the kernel volume where every
    window counts k cells per axis, else the (1, 1, Do, Ho, Wo) product of the per-axis counts
    of the module doc."""
    if divisor_override is not None:
        return divisor_override
    counts = []                                            # host index math: no device sync
    for n, ki, si, (lo, hi), o in zip(x.shape[2:], k, s, p, out):
        start = numpy.arange(o) * si - lo                  # each window's first cell (unpadded)
        if count_include_pad:
            counts.append(numpy.minimum(start + ki, n + hi) - start)
        else:
            counts.append(numpy.minimum(start + ki, n) - numpy.maximum(start, 0))
    if all((c == ki).all() for c, ki in zip(counts, k)):
        return k[0] * k[1] * k[2]
    c_d, c_h, c_w = counts
    divisor = c_d[:, None, None] * c_h[None, :, None] * c_w[None, None, :]
    return array_module(x).asarray(divisor.astype(x.dtype)[None, None])   # (1, 1, Do, Ho, Wo)


def _check_dy(dy, x, out):
    check_same_dtype(x=x, dy=dy)
    if tuple(dy.shape) != tuple(x.shape[:2]) + out:
        raise ValueError(f"dy must have the output shape {tuple(x.shape[:2]) + out}, got {dy.shape}")


# ---------------------------------------------------------------- the math

def _taps(axis, k, s, d, out):
    """(tap, index) for the 1-D window of ``axis``: tap t reads t*d, t*d + s, ... (``out`` values)."""
    lead = (slice(None),) * axis
    return [(t, lead + (slice(t * d, t * d + s * (out - 1) + 1, s),)) for t in range(k)]


def _stage_shape(x_shape, axis, n):
    return x_shape[:axis] + (n,) + x_shape[axis + 1:]


def _pad(x, p, value):
    """``x`` with ``value`` in the (lo, hi) padding ``p`` of each spatial axis."""
    if all(lo == 0 and hi == 0 for lo, hi in p):
        return x
    xp = array_module(x)
    return xp.pad(x, ((0, 0), (0, 0)) + tuple(p), mode="constant", constant_values=value)


def _unpad(dx_pad, p, shape):
    return dx_pad[(slice(None), slice(None)) + tuple(
        slice(lo, lo + n) for (lo, _), n in zip(p, shape[2:]))]


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


def max_pool_forward(x, k, s, p, d, out, with_arg):
    """``(y, stages)`` for validated arguments (``p``: (lo, hi) per axis): the separable max over
    W, H, D of the -inf padded input, ``stages`` = [(first-maximum masks or None, input extent)]
    per stage."""
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


def max_pool_backward(dy, x_shape, k, s, p, d, stages):
    """dx: ``dy`` spread back through the stages in reverse order (D, H, W), each tap adding
    its gradient where it held the first maximum, then the padding dropped."""
    g = dy
    for axis, (first, n_in) in reversed(list(zip(AXES, stages))):
        a = axis - 2
        g = _spread_along(g, axis, k[a], s[a], d[a], n_in, first)
    return _unpad(g, p, x_shape)


def avg_pool_forward(x, k, s, p, out, divisor):
    """y: the separable window sum of the zero padded ``x`` (``p``: (lo, hi) per axis) over W,
    H, D, divided by ``divisor`` (``avg_divisor``: a number, or one per output point)."""
    y = _pad(x, p, 0)
    for axis in AXES:
        a = axis - 2
        taps = _taps(axis, k[a], s[a], 1, out[a])
        total = y[taps[0][1]].copy()
        for _, index in taps[1:]:
            total += y[index]
        y = total
    y /= divisor
    return y


def avg_pool_backward(dy, x_shape, k, s, p, divisor):
    """dx: ``dy / divisor`` added into every tap's slice, axes in reverse order (D, H, W: the
    adjoint of the forward's sums), then the padding dropped."""
    padded = tuple(n + lo + hi for n, (lo, hi) in zip(x_shape[2:], p))
    g = dy / divisor
    for axis in reversed(AXES):
        a = axis - 2
        g = _spread_along(g, axis, k[a], s[a], 1, padded[a])
    return _unpad(g, p, x_shape)


# ---------------------------------------------------------------- the public functions

def max_pool3d(x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, *, return_masks=False):
    """y[n, c, o] = max over the window of o (stride defaults to kernel_size).

    ``return_masks=True`` returns ``(y, masks)``: the first-maximum masks of the separable
    stages (PyTorch's ``return_indices`` in another form), which
    ``max_pool3d_backward(..., masks=masks)`` uses instead of recomputing them.  They
    take ``k`` booleans per input of each stage (for k = 2: 1.75 bytes per input).  They are
    a list with one entry per block of the work, each the list of that block's stages: one
    block (the whole array) for the math, several for the kernel (``_route.kernel_for``); the backward
    of the same ``x`` takes the same route.  (The kernel's route for a small array whose
    2 x 2 x 2 stride-2 windows tile it keeps one entry of its own form instead: each window's
    first-maximum index, ``kernels.pooling.pair_tap_forward``.)
    """
    k, s, _, d, out, p = _pool_args(x, kernel_size, stride, padding, dilation, ceil_mode)
    kernel = kernel_for(fast, x, (k, s, p, d))
    if kernel is not None:
        y, masks = kernel.max_pool3d(max_pool_forward, x, k, s, p, d, out, return_masks)
    else:
        y, stages = max_pool_forward(x, k, s, p, d, out, return_masks)
        masks = [stages]                                   # one block: the whole array
    return (y, masks) if return_masks else y


def max_pool3d_backward(dy, x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, *,
                        masks=None):
    """dx: each dy goes to the (first) maximum of its window; overlapping windows add.

    ``masks``: the second result of ``max_pool3d(x, ..., return_masks=True)`` for this
    ``x`` and these arguments; without it the forward runs again to find them."""
    k, s, _, d, out, p = _pool_args(x, kernel_size, stride, padding, dilation, ceil_mode)
    _check_dy(dy, x, out)
    kernel = kernel_for(fast, x, (k, s, p, d))
    if kernel is not None:
        return kernel.max_pool3d_backward(max_pool_forward, max_pool_backward, dy, x, k, s, p, d, out,
                                          masks)
    if masks is not None and len(masks) != 1:
        raise ValueError(f"masks has {len(masks)} blocks, x has 1: pass the masks of "
                         "max_pool3d(x, ..., return_masks=True) for this very x")
    stages = max_pool_forward(x, k, s, p, d, out, True)[1] if masks is None else masks[0]
    return max_pool_backward(dy, x.shape, k, s, p, d, stages)


def avg_pool3d(x, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    """y[n, c, o] = sum over the window of o / its divisor (module doc; PyTorch's arguments)."""
    k, s, p, _, out, reach = _pool_args(x, kernel_size, stride, padding, 1, ceil_mode)
    check_avg_options(count_include_pad, divisor_override)
    divisor = avg_divisor(x, k, s, p, out, count_include_pad, divisor_override)
    kernel = kernel_for(fast, x)
    if kernel is not None:
        return kernel.avg_pool3d(avg_pool_forward, x, k, s, reach, out, divisor)
    return avg_pool_forward(x, k, s, reach, out, divisor)


def avg_pool3d_backward(dy, x, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
                        divisor_override=None):
    """dx: every element of a window receives dy / the window's divisor."""
    k, s, p, _, out, reach = _pool_args(x, kernel_size, stride, padding, 1, ceil_mode)
    check_avg_options(count_include_pad, divisor_override)
    _check_dy(dy, x, out)
    divisor = avg_divisor(x, k, s, p, out, count_include_pad, divisor_override)
    kernel = kernel_for(fast, x)
    if kernel is not None:
        return kernel.avg_pool3d_backward(avg_pool_backward, dy, x, k, s, reach, divisor)
    return avg_pool_backward(dy, x.shape, k, s, reach, divisor)


__all__ = ["max_pool3d", "max_pool3d_backward", "avg_pool3d", "avg_pool3d_backward",
           "max_pool_forward", "max_pool_backward", "avg_pool_forward", "avg_pool_backward", "avg_divisor"]
