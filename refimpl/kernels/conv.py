"""The fast routes of conv3d and conv_transpose3d, and the one place that picks them.

``refimpl/functional/conv3d.py`` holds the math (``algorithm="reference"``: pad,
one strided slice per tap, one GEMM).  Everything here computes the same sums
faster, and is tested against that reference (tests/test_conv.py,
tests/test_winograd.py):

| route                         | module            | where it runs                                    |
|-------------------------------|-------------------|--------------------------------------------------|
| im2col, host schedule         | ``_im2col``       | NumPy: cache-sized column tiles on worker threads, no padded copy |
| im2col, device schedule       | ``_im2col_device``| CuPy (``REFIMPL_CONV_SCHEDULE=device``): one padded copy, batched GEMMs |
| strided convs by input phases | ``_phase_grid``   | stride > 1 on the host: each phase a stride-1 conv |
| Winograd F(4x4x4, 3x3x3)      | ``winograd``      | 3x3x3, stride 1, dilation 1, wide enough channels (``winograd.worthwhile``) |

``algorithm`` is "auto" (the table's thresholds, ``resolve_algorithm``), "im2col"
or "winograd"; None reads ``REFIMPL_CONV_ALGORITHM``.  The thresholds and the
timings behind them are in docs/benchmarks.md.
"""
from __future__ import annotations

from .. import settings
from ..backend import array_module
from . import _im2col, _threads, winograd
from ._im2col import budget_or_default   # the temporaries' bound of every route (functional passes it in)

ENV_ALGORITHM = "REFIMPL_CONV_ALGORITHM"
ALGORITHMS = ("auto", "im2col", "winograd")      # the routes picked here; "reference" is functional's own


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
        algorithm, source = settings.env_setting(ENV_ALGORITHM), ENV_ALGORITHM
    if algorithm == "reference":
        raise ValueError("the reference conv is refimpl.functional.conv3d's own; the kernels compute "
                         f"{', '.join(ALGORITHMS)}")
    if algorithm not in ALGORITHMS:
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


@_threads.blas_held_single()
def transpose_backward(dy, x, w, s, p, dl, budget, algorithm, full):
    """``(dx, dw)`` of ``conv_transpose3d(x, w)``: ``dx`` the conv of ``dy`` with ``w`` (the first
    D_in outputs per axis), ``dw`` the conv weight gradient with ``x`` as dy and ``dy`` as input;
    im2col computes both in one pass over the column tiles of ``dy``."""
    n_in = tuple(x.shape[2:])
    if resolve_algorithm(algorithm, w.shape, s, dl, n_in, full, x.shape[0], on_device(dy)) == "winograd":
        dx = forward_with_bias(dy, w, s, p, dl, n_in, budget, "winograd")
        dw = weight_grad(x, dy, w.shape, s, p, dl, budget, "winograd", full)
        return dx, dw
    return _im2col.forward(dy, w, s, p, dl, n_in, budget, g=x)


__all__ = ["resolve_algorithm", "on_device", "budget_or_default", "forward_with_bias", "backward_no_bias",
           "input_grad", "weight_grad", "transpose_backward", "ALGORITHMS", "ENV_ALGORITHM"]
