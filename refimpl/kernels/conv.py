"""The fast routes of conv3d and conv_transpose3d behind one dispatch point per function.

``refimpl/functional/conv3d.py`` holds the math (``algorithm="reference"``: pad,
one strided slice per tap, one GEMM) and calls these for every other algorithm.
Which route runs, and the thresholds that pick it, is ``routes.py``'s table
(``resolve_algorithm``, ``flipped_kernel_pays``); here the routes are called.

Padding: the im2col routes take symmetric padding ``(pd, ph, pw)``.  An asymmetric one (``p`` as
``(lo, hi)`` pairs from ``functional.conv3d.conv_args``: a per-side padding, or 'same' with an
even kernel) runs there as the symmetric padding ``min(lo, hi)`` on the input zero padded by the
difference (``asymmetric``): one more copy of the input on that path only; the symmetric
path pays one ``isinstance`` test.  Winograd takes the zeros before the input (``lo``) as its
padding whatever those after it are (``winograd.forward``): no copy.
"""
from __future__ import annotations

from ..backend import array_module
from . import _im2col, _threads, winograd
from .routes import flipped_kernel_pays, resolve_algorithm
from ._im2col import budget_or_default   # the temporaries' bound of every route (functional passes it in)


def asymmetric(x, p):
    """``(x padded by (lo - m, hi - m) zeros per axis, m = min(lo, hi), its crop index)`` for
    ``p`` given as (lo, hi) pairs: the conv of ``x`` with padding ``p`` is the conv of the
    result with the symmetric padding ``m``, and its dx cropped by the index is dx of ``x``.
    ``x`` may be a ``ShapeOnly``."""
    m = tuple(min(lo, hi) for lo, hi in p)
    extra = tuple((lo - q, hi - q) for (lo, hi), q in zip(p, m))
    crop = (Ellipsis,) + tuple(slice(a, a + n) for (a, _), n in zip(extra, x.shape[2:]))
    shape = tuple(x.shape[:2]) + tuple(n + a + b for n, (a, b) in zip(x.shape[2:], extra))
    if isinstance(x, ShapeOnly):
        return ShapeOnly(shape, x.dtype), m, crop
    xp = array_module(x)
    x_pad = xp.zeros(shape, dtype=x.dtype)
    x_pad[crop] = x
    return x_pad, m, crop


def on_device(a):
    """Whether ``a``'s convs run the device schedule (``_im2col.device_schedule``)."""
    return _im2col.device_schedule(array_module(a))


@_threads.blas_held_single()
def forward_with_bias(x, w, s, p, dl, out, budget, algorithm, bias=None):
    """``conv3d(x, w)`` (+ ``bias`` when given) for validated arguments, by the algorithm
    ``resolve_algorithm`` picks (Winograd adds the bias in its last pass)."""
    if resolve_algorithm(algorithm, w.shape, s, dl, out, n_batch=x.shape[0],
                         on_device=on_device(x), forward=True) == "winograd":
        return winograd.forward(x, w, before(p), out, budget, bias)
    if isinstance(p[0], tuple):                   # asymmetric padding: pad the difference
        x, p, _ = asymmetric(x, p)
    y = _im2col.forward(x, w, s, p, dl, out, budget)
    if bias is not None:
        y += bias.reshape(1, -1, 1, 1, 1)
    return y


@_threads.blas_held_single()
def backward_no_bias(dy, x, w, s, p, dl, budget, algorithm, need_dx=True, need_dw=True, full_dy=True):
    """``(dx, dw)`` of ``conv3d(x, w)`` for validated arguments (either may be skipped:
    None; ``x`` may then be only a shape, ``w`` likewise), by the algorithm picked for each
    (together, sharing their passes, where both pick the same)."""
    if isinstance(p[0], tuple):                   # asymmetric padding
        padded, m, _ = asymmetric(ShapeOnly(x.shape, x.dtype), p)
        pick = _picks(dy, padded, w, s, m, dl, budget, algorithm, need_dx, need_dw, full_dy)[0]
        if set(pick.values()) == {"winograd"}:
            return winograd.backward(dy, x, w, before(p), budget, need_dx, need_dw)
        x_pad, p, crop = asymmetric(x, p)         # im2col: pad the difference
        dx, dw = backward_no_bias(dy, x_pad, w, s, p, dl, budget, algorithm, need_dx, need_dw, full_dy)
        return (None if dx is None else array_module(dx).ascontiguousarray(dx[crop])), dw
    pick, flipped = _picks(dy, x, w, s, p, dl, budget, algorithm, need_dx, need_dw, full_dy)

    def run(algo, want_dx, want_dw):
        if algo == "winograd":
            return winograd.backward(dy, x, w, p, budget, want_dx, want_dw)
        return _im2col.backward(dy, x, w, s, p, dl, budget, want_dx, want_dw, flipped and want_dx)
    if len(set(pick.values())) <= 1:
        return run(next(iter(pick.values()), "im2col"), need_dx, need_dw)
    return run(pick["dx"], True, False)[0], run(pick["dw"], False, True)[1]


def _picks(dy, x, w, s, p, dl, budget, algorithm, need_dx, need_dw, full_dy):
    """``({"dx": algorithm, "dw": algorithm} of the gradients needed, whether im2col's dx is the
    flipped kernel's conv)`` for symmetric padding ``p`` (``x`` may be a ``ShapeOnly``)."""
    device = on_device(dy)
    flipped = need_dx and flipped_kernel_pays(dy, w, x.shape, s, budget, device)
    versus = None
    if flipped:                   # (F <= C) Winograd's own dx route sets the bar to beat im2col's
        by_forward = winograd.dx_by_flipped_kernel(w.shape[1], w.shape[0], p, need_dw,
                                                   x.shape[2:], dy.shape[2:], w.shape[2])
        versus = "forward" if by_forward else "adjoint"
    pick = {kind: resolve_algorithm(algorithm, w.shape, s, dl, dy.shape[2:], full_dy, dy.shape[0],
                                    device, versus if kind == "dx" else None, kind == "dw")
            for kind, needed in (("dx", need_dx), ("dw", need_dw)) if needed}
    return pick, flipped


def before(p):
    """The zeros before the input per axis: ``lo`` of (lo, hi) pairs, else ``p`` itself."""
    return tuple(q[0] for q in p) if isinstance(p[0], tuple) else tuple(p)


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
