"""3D transposed convolution ("deconvolution"), forward and backward (PyTorch semantics).

Transposed convolution is the input-adjoint of convolution (Chainer's
convolution_nd / deconvolution_nd): with the weight ``(C_in, C_out, kd, kh, kw)``
read as a conv weight ``(F=C_in, C=C_out, ...)``,

    conv_transpose3d(x, w)          = conv3d_input_grad(dy=x, w, output shape)
    d/dx of conv_transpose3d  (dx)  = conv3d(dy, w)            (first D_in outputs per axis)
    d/dw of conv_transpose3d  (dw)  = conv3d_weight_grad(dy=x, x=dy, w.shape)

so the math is written once, in conv3d's reference (``algorithm="reference"``:
its ``input_grad``, ``forward`` and ``weight_grad``) and in its kernels
(``refimpl/kernels/conv.py``; ``algorithm=`` as in conv3d: "auto" takes Winograd
for 3x3x3 and 2x2x2 kernels with stride 1 and dilation 1).  Output extent per axis:
``(n-1)s - 2p + dl(k-1) + output_padding + 1``; ``output_padding`` must be
smaller than ``max(stride, dilation)`` (PyTorch's rule): those last outputs are
read by no input's window, the conv's "inputs past the last window".
"""
from __future__ import annotations

from ..backend import check_same_dtype
from .args import check_float, check_ndim, transposed_out_shape, triple
from .conv3d import AXES, _grouped, forward, input_grad, is_reference, weight_grad


def _check(x, w, stride, padding, output_padding, dilation, x_name="x", groups=1):
    check_ndim(x, 5, x_name, "N, C_in, D, H, W")
    check_ndim(w, 5, "w", "C_in, C_out, kd, kh, kw")
    check_float(x_name, x)
    check_float("w", w)
    if min(w.shape[2:]) < 1:
        raise ValueError(f"w must have a kernel extent >= 1 on every axis, got shape {w.shape}")
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or w.shape[0] % groups:
        raise ValueError(f"groups must be a positive integer dividing the {w.shape[0]} input channels "
                         f"(w.shape[0]), got {groups!r}")
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"channel mismatch: {x_name} has {x.shape[1]} channels (shape[1]) but w "
                         f"expects {w.shape[0]} (w.shape[0]); weights are (C_in, C_out/groups, kd, kh, kw)")
    s, p, dl = triple(stride, "stride", 1), triple(padding, "padding", 0), triple(dilation, "dilation", 1)
    op = triple(output_padding, "output_padding", 0)
    for ax in range(3):
        if op[ax] >= max(s[ax], dl[ax]):
            raise ValueError(f"output_padding must be smaller than max(stride, dilation) on every "
                             f"axis, got output_padding={op}, stride={s}, dilation={dl}")
    out = transposed_out_shape(x.shape[2:], w.shape[2:], s, p, dl, op)
    for ax, o in enumerate(out):
        if o < 1:
            raise ValueError(f"padding {p} is too large for the transposed conv on the {AXES[ax]} "
                             f"axis: output extent would be {o}, must be >= 1")
    return s, p, dl, op, out


def conv_transpose3d(x, w, b=None, stride=1, padding=0, output_padding=0, dilation=1, groups=1, *,
                     max_temp_bytes=None, algorithm=None):
    """``(N, C_in, D, H, W) -> (N, C_out, Do, Ho, Wo)`` with ``w`` of shape (C_in, C_out/groups, kd, kh, kw).

    ``groups`` as PyTorch's (which takes it before ``dilation``: here it comes after, keeping
    refimpl's positional order): input channel group g feeds output channel group g alone."""
    s, p, dl, op, out = _check(x, w, stride, padding, output_padding, dilation, groups=groups)
    check_same_dtype(x=x, w=w, b=b)
    if b is not None and (getattr(b, "ndim", None) != 1 or b.shape[0] != w.shape[1] * groups):
        raise ValueError(f"b must have shape ({w.shape[1] * groups},) (one value per output channel), "
                         f"got {getattr(b, 'shape', None)}")
    if groups > 1:
        return _grouped(lambda xg, wg, bg: conv_transpose3d(xg, wg, bg, stride, padding, output_padding, dilation,
                                                            max_temp_bytes=max_temp_bytes, algorithm=algorithm),
                        groups, 1, (x, 1), (w, 0), (b, 0))
    output_shape = (x.shape[0], w.shape[1]) + out
    if is_reference(algorithm):
        y = input_grad(x, w, output_shape, s, p, dl)            # x plays the conv's dy
    else:
        from ..kernels import conv as kernel
        y = kernel.input_grad(x, w, output_shape, s, p, dl, kernel.budget_or_default(max_temp_bytes),
                              algorithm, full_dy=not any(op))
    if b is not None:
        y += b.reshape(1, -1, 1, 1, 1)
    return y


def conv_transpose3d_backward(dy, x, w, stride=1, padding=0, output_padding=0, dilation=1, groups=1, *,
                              max_temp_bytes=None, algorithm=None):
    """``(dx, dw, db)`` of ``y = conv_transpose3d(x, w, b)`` given ``dy = dL/dy``.

    ``db`` is ``dy`` summed over (N, D, H, W), returned whether or not the forward had a bias.
    """
    s, p, dl, op, out = _check(x, w, stride, padding, output_padding, dilation, groups=groups)
    check_ndim(dy, 5, "dy", "N, C_out, Do, Ho, Wo")
    check_same_dtype(dy=dy, x=x, w=w)
    expected = (x.shape[0], w.shape[1] * groups) + out
    if tuple(dy.shape) != expected:
        raise ValueError(f"dy must have the transposed conv output shape {expected}, "
                         f"got {tuple(dy.shape)}")
    if groups > 1:
        dx, dw = _grouped(lambda dyg, xg, wg: conv_transpose3d_backward(
            dyg, xg, wg, stride, padding, output_padding, dilation, max_temp_bytes=max_temp_bytes,
            algorithm=algorithm)[:2], groups, (1, 0), (dy, 1), (x, 1), (w, 0))
        return dx, dw, dy.sum(axis=(0, 2, 3, 4))
    # the conv whose input-adjoint we are: x plays dy (F = C_in), dy plays the input (C = C_out)
    if is_reference(algorithm):
        dx = forward(dy, w, None, s, p, dl, tuple(x.shape[2:]))  # its first D_in outputs per axis
        dw = weight_grad(x, dy, w.shape, s, p, dl)
    else:
        from ..kernels import conv as kernel
        dx, dw = kernel.transpose_backward(dy, x, w, s, p, dl, kernel.budget_or_default(max_temp_bytes),
                                           algorithm, full=not any(op))
    return dx, dw, dy.sum(axis=(0, 2, 3, 4))


__all__ = ["conv_transpose3d", "conv_transpose3d_backward"]
