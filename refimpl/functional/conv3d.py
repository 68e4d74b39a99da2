"""3D convolution, forward and backward (PyTorch semantics, NCDHW, no groups).

    y[n, f, o] = b[f] + sum_{c, t} w[f, c, t] * x[n, c, o*s + t*dl - p]

with zero padding ``p``, stride ``s`` and dilation ``dl`` per axis (each an int
or a ``(d, h, w)`` tuple).  Output extent per axis:
``floor((n + 2p - dl(k-1) - 1)/s) + 1``.

Two algorithms, picked per call by ``algorithm=``:

- ``"im2col"`` (``_im2col``): column tiles of a bounded size and one GEMM per
  tile (``y = W @ col``, ``dW += dy @ col^T``, ``dx += col2im(W^T @ dy)``); any
  kernel, stride, padding and dilation.  The temporary buffers of a call stay
  below ``max(max_temp_bytes, one output row's column tile)`` bytes, default
  ``_im2col.MAX_TEMP_BYTES`` = 64 MiB; the input is not padded (no padded copy).
- ``"winograd"`` (``winograd``): F(4x4x4, 3x3x3), 3x3x3 kernels with stride 1
  and dilation 1 only: 3.4x fewer multiplications per output than the 27 of
  im2col, exact in float64, within ``winograd.FLOAT32_BOUND`` in float32.  Its
  chunked work buffers obey ``max_temp_bytes``; it also copies the input and
  output once in channels-last order.
- ``"auto"`` (the default): Winograd where it applies, saves at least half of
  the multiplications, the channels are not too narrow and there are at least two
  tiles for the weight transform to pay (``winograd.worthwhile``: C*F/(C+F) >= 4,
  >= 6 for an input gradient im2col takes by the flipped kernel (>= 3 where
  Winograd's own is its forward with the flipped kernel), and for a weight
  gradient also F <= 2C; ``MIN_TILES``), else im2col.  The forward, the input
  gradient and the weight gradient of a layer choose apart.  Winograd's input gradient
  is its forward conv of ``dy`` with the flipped kernel where F <= C (F <= 2C when the
  weight gradient is not wanted) and that takes no more tiles (``winograd.dx_by_flipped_kernel``),
  else the adjoint.

``algorithm=None`` reads ``REFIMPL_CONV_ALGORITHM`` (one of the three names;
anything else is refused), default ``"auto"``: the layers and the training CLI
call with ``None``, so the variable switches a whole run to the plain im2col.

Building blocks reused by the distributed layers and by conv_transpose3d:

- ``conv3d_input_grad(dy, w, input_shape, ...)``: ``dx``, the adjoint of conv3d in ``x``;
- ``conv3d_weight_grad(dy, x, weight_shape, ...)``: ``dW``.

Both accept a ``dy`` whose spatial extent is *at most* the conv output extent
of the input (the first outputs per axis; inputs past the last window get zero
gradient / contribute nothing), which is what transposed convolution with
``output_padding`` needs.
"""
from __future__ import annotations

from .. import settings
from ..backend import array_module, check_same_dtype
from . import _im2col, _threads, winograd
from ._args import check_float, check_ndim, triple, window_out_shape

AXES = ("depth", "height", "width")
ENV_ALGORITHM = "REFIMPL_CONV_ALGORITHM"
ALGORITHMS = settings.SETTINGS[ENV_ALGORITHM].choices      # ("auto", "im2col", "winograd")


def algorithm_setting():
    """``REFIMPL_CONV_ALGORITHM`` (default "auto"), or ValueError naming the variable
    (parsed by refimpl.settings, read at every call so a run can switch it)."""
    return settings.env_setting(ENV_ALGORITHM)


def resolve_algorithm(algorithm, weight_shape, stride, dilation, out_spatial, full_dy=True,
                      n_batch=1, on_device=False, versus_flipped=None, weight_grad=False):
    """``"im2col"`` or ``"winograd"`` for this conv (weight ``(F, C, kd, kh, kw)``):
    ``algorithm`` (None: the ``REFIMPL_CONV_ALGORITHM`` variable, default "auto")
    validated against the shape.

    ``full_dy=False`` when a gradient covers only the first outputs per axis (the
    building blocks of transposed conv with output_padding): im2col only.
    ``versus_flipped`` ("adjoint" or "forward": Winograd's route for it) when the choice is for
    an input gradient that im2col would compute as the conv with the flipped kernel
    (``_im2col.flipped_kernel_pays``): "auto" then asks Winograd to beat that
    (``winograd.worthwhile``); ``weight_grad=True`` when it is
    for a weight gradient (its own threshold).
    """
    source = "algorithm"
    if algorithm is None:
        algorithm, source = algorithm_setting(), ENV_ALGORITHM
    elif algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    kernel = tuple(weight_shape[2:])
    fits = winograd.applicable(kernel, stride, dilation) and full_dy
    if algorithm == "winograd" and not fits:
        raise ValueError(f"{source}='winograd' computes 3x3x3 convs with stride 1 and dilation 1 "
                         f"(and a gradient covering every output); got kernel {tuple(kernel)}, "
                         f"stride {tuple(stride)}, dilation {tuple(dilation)}: use 'im2col' or 'auto'")
    if algorithm == "auto":
        if on_device:          # measured on an H100: Winograd's many small passes lose 10-20x there
            return "im2col"
        wide = winograd.worthwhile(out_spatial, weight_shape[1], weight_shape[0], n_batch,
                                   versus_flipped, weight_grad)
        return "winograd" if fits and wide else "im2col"
    return algorithm


def on_device(a):
    """Whether ``a``'s convs run the device schedule (``_im2col.device_schedule``)."""
    return _im2col.device_schedule(array_module(a))


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


@_threads.blas_held_single()
def forward_with_bias(x, w, s, p, dl, out, budget, algorithm, bias=None):
    """``conv3d(x, w)`` (+ ``bias`` when given) for validated arguments, by the algorithm
    ``resolve_algorithm`` picks (Winograd adds the bias in its last pass)."""
    if resolve_algorithm(algorithm, w.shape, s, dl, out, n_batch=x.shape[0],
                         on_device=on_device(x)) == "winograd":
        return winograd.forward(x, w, p, out, budget, bias)
    y = _im2col.forward(x, w, s, p, dl, out, budget)
    if bias is not None:
        y += bias.reshape(1, -1, 1, 1, 1)
    return y


@_threads.blas_held_single()
def backward_no_bias(dy, x, w, s, p, dl, budget, algorithm, need_dx=True, need_dw=True, full_dy=True):
    """``(dx, dw)`` of ``conv3d(x, w)`` for validated arguments (either may be skipped:
    None; ``x`` may then be only a shape, ``w`` likewise), by the algorithm picked for each
    (together, sharing their passes, where both pick the same)."""
    device = on_device(dy)
    flipped = need_dx and _im2col.flipped_kernel_pays(dy, w, x.shape, s, budget, device)
    versus = None
    if flipped:                   # (F <= C) Winograd's own dx route sets the bar to beat im2col's
        by_forward = winograd.dx_by_flipped_kernel(w.shape[1], w.shape[0], p, need_dw,
                                                   x.shape[2:], dy.shape[2:])
        versus = "forward" if by_forward else "adjoint"
    pick = {kind: resolve_algorithm(algorithm, w.shape, s, dl, dy.shape[2:], full_dy, dy.shape[0],
                                    device, versus if kind == "dx" else None, kind == "dw")
            for kind, needed in (("dx", need_dx), ("dw", need_dw)) if needed}

    def run(algo, want_dx, want_dw):
        if algo == "winograd":
            return winograd.backward(dy, x, w, p, budget, want_dx, want_dw)
        return _im2col.backward(dy, x, w, s, p, dl, budget, want_dx, want_dw, flipped and want_dx)
    if len(set(pick.values())) <= 1:
        return run(next(iter(pick.values()), "im2col"), need_dx, need_dw)
    return run(pick["dx"], True, False)[0], run(pick["dw"], False, True)[1]


def conv3d(x, w, b=None, stride=1, padding=0, dilation=1, *, max_temp_bytes=None, algorithm=None):
    """3D convolution ``(N, C, D, H, W) * (F, C, kd, kh, kw) -> (N, F, Do, Ho, Wo)``.

    ``algorithm``: "auto", "im2col" or "winograd" (None: ``REFIMPL_CONV_ALGORITHM``
    or "auto"), see the module docstring."""
    _check_x_w(x, w)
    check_same_dtype(x=x, w=w, b=b)
    check_bias(b, w.shape[0])
    s, p, dl = conv_params(stride, padding, dilation)
    out = conv_out_spatial(x.shape[2:], w.shape[2:], s, p, dl)
    budget = _im2col.budget_or_default(max_temp_bytes)
    return forward_with_bias(x, w, s, p, dl, out, budget, algorithm, bias=b)


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
    budget = _im2col.budget_or_default(max_temp_bytes)
    dx, dw = backward_no_bias(dy, x, w, s, p, dl, budget, algorithm)
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
    return input_grad(dy, w, input_shape, s, p, dl, _im2col.budget_or_default(max_temp_bytes),
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
    return weight_grad(dy, x, weight_shape, s, p, dl, _im2col.budget_or_default(max_temp_bytes),
                       algorithm, tuple(dy.shape[2:]) == out)


class ShapeOnly:
    """Stands in for an array of which only ``shape`` and ``dtype`` are read."""

    def __init__(self, shape, dtype):
        self.shape = tuple(shape)
        self.dtype = dtype


def input_grad(dy, w, input_shape, s, p, dl, budget, algorithm, full_dy):
    """``dx`` of ``conv3d(x, w)`` with ``x`` of shape ``input_shape`` (validated arguments)."""
    dx, _ = backward_no_bias(dy, ShapeOnly(input_shape, dy.dtype), w, s, p, dl, budget,
                             algorithm, need_dw=False, full_dy=full_dy)
    return dx


def weight_grad(dy, x, weight_shape, s, p, dl, budget, algorithm, full_dy):
    """``dW`` (of shape ``weight_shape``) of ``conv3d(x, w)`` (validated arguments)."""
    _, dw = backward_no_bias(dy, x, ShapeOnly(weight_shape, dy.dtype), s, p, dl, budget,
                             algorithm, need_dx=False, full_dy=full_dy)
    return dw


__all__ = ["conv3d", "conv3d_backward", "conv3d_input_grad", "conv3d_weight_grad"]
