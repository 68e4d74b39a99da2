"""Argument normalisation and validation shared by every functional op, and by the code outside
functional/ that takes the same arguments (layers, models, the partition, the data readers).

Errors are ValueError with the argument's name in the message, raised before
any computation (and, in the distributed layers, before any message).

Padding (conv3d, max/avg pooling; conv_transpose3d takes an int or a 3-tuple only, as
PyTorch) comes in five forms, all normalised by ``padding_sides`` to one ``(lo, hi)`` pair
per axis (D, H, W):

| form                              | per axis ``(lo, hi)``                                    |
|-----------------------------------|----------------------------------------------------------|
| ``p`` (int)                       | ``(p, p)``                                               |
| ``(pd, ph, pw)``                  | ``(pd, pd)``, ``(ph, ph)``, ``(pw, pw)``                 |
| ``(d_lo, d_hi, h_lo, h_hi, w_lo, w_hi)`` | as written: asymmetric padding                    |
| ``'valid'``                       | ``(0, 0)``                                               |
| ``'same'`` (stride 1 only)        | total ``T = dl(k-1)``: ``(T // 2, T - T // 2)``          |

``'same'`` keeps the output extent equal to the input extent at stride 1.  The two rules
people know, side by side:

| kernel | PyTorch (``padding='same'``)                   | TensorFlow / Keras (``padding='same'``)        |
|--------|------------------------------------------------|------------------------------------------------|
| odd    | ``dl(k-1)/2`` on each side                     | the same                                       |
| even   | total ``dl(k-1)``, the odd cell on the hi side | total ``dl(k-1)``, the odd cell AFTER (hi side) |

so they agree at stride 1 (an even kernel 2: 0 before, 1 after).  At stride > 1 PyTorch
refuses 'same' and so does refimpl (a ValueError); TensorFlow's strided 'same' (output
``ceil(n/s)``, a padding that depends on ``n``) is not implemented.
"""
from __future__ import annotations

from ..backend import check_same_dtype


def triple(value, name: str, minimum: int = 0) -> tuple[int, int, int]:
    """int or 3-sequence -> (d, h, w) tuple of ints >= minimum."""
    if isinstance(value, (int,)) and not isinstance(value, bool):
        t = (value, value, value)
    else:
        try:
            t = tuple(value)
        except TypeError:
            raise ValueError(f"{name} must be an int or a 3-tuple of ints, got {value!r}") from None
        if len(t) != 3:
            raise ValueError(f"{name} must be an int or a 3-tuple of ints, got {value!r}")
    out = []
    for v in t:
        if isinstance(v, bool) or int(v) != v:
            raise ValueError(f"{name} must hold integers, got {value!r}")
        v = int(v)
        if v < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
        out.append(v)
    return tuple(out)


PADDING_FORMS = "an int, a 3-tuple, a 6-tuple (d_lo, d_hi, h_lo, h_hi, w_lo, w_hi), 'valid' or 'same'"


def padding_sides(padding, kernel, dilation=(1, 1, 1), stride=(1, 1, 1),
                  name: str = "padding") -> tuple[tuple[int, int], ...]:
    """Any padding form of the module doc -> ``((d_lo, d_hi), (h_lo, h_hi), (w_lo, w_hi))``.

    ``kernel``, ``dilation`` and ``stride`` (3-tuples) are read by ``'same'`` only; a tuple
    of three ``(lo, hi)`` pairs (this function's own result) passes through checked."""
    if isinstance(padding, str):
        if padding == "valid":
            return ((0, 0),) * 3
        if padding != "same":
            raise ValueError(f"{name} must be {PADDING_FORMS}, got {padding!r}")
        if tuple(stride) != (1, 1, 1):
            raise ValueError(f"{name}='same' needs stride 1 on every axis (as in PyTorch; "
                             f"TensorFlow's strided 'same' is not implemented), got stride {tuple(stride)}")
        totals = [d * (k - 1) for k, d in zip(kernel, dilation)]
        return tuple((t // 2, t - t // 2) for t in totals)
    if isinstance(padding, (int,)) and not isinstance(padding, bool):
        flat = padding
    else:
        try:
            flat = tuple(padding)
        except TypeError:
            raise ValueError(f"{name} must be {PADDING_FORMS}, got {padding!r}") from None
        if len(flat) == 3 and all(isinstance(q, (tuple, list)) for q in flat):
            flat = tuple(v for q in flat for v in q)          # ((lo, hi),) * 3, flattened
    if not isinstance(flat, tuple) or len(flat) != 6:
        if not isinstance(flat, int) and len(flat) != 3:
            raise ValueError(f"{name} must be {PADDING_FORMS}, got {padding!r}")
        return tuple((q, q) for q in triple(flat, name, 0))
    lo, hi = triple(flat[0::2], name, 0), triple(flat[1::2], name, 0)
    return tuple(zip(lo, hi))


def compact_padding(sides) -> tuple[int, ...]:
    """``(lo, hi)`` pairs -> ``(pd, ph, pw)`` when every axis is symmetric, else the 6-tuple
    ``(d_lo, d_hi, h_lo, h_hi, w_lo, w_hi)``: the form layers keep and print."""
    if all(lo == hi for lo, hi in sides):
        return tuple(lo for lo, _ in sides)
    return tuple(v for pair in sides for v in pair)


def sides(p) -> tuple[int, int]:
    """One axis's padding: an int ``p`` -> ``(p, p)``; a ``(lo, hi)`` pair as it is."""
    if hasattr(p, "__index__"):                           # int, numpy integer
        return (int(p), int(p))
    lo, hi = p
    return (int(lo), int(hi))


def check_ndim(x, ndim: int, name: str, layout: str = "") -> None:
    if getattr(x, "ndim", None) != ndim:
        what = f" ({layout})" if layout else ""
        raise ValueError(f"{name} must be {ndim}-D{what}, got shape {getattr(x, 'shape', None)}")


def check_float(name: str, x) -> None:
    if x.dtype.kind != "f":
        raise ValueError(f"{name} must be a floating-point array, got {x.dtype}")


def check_channel_vector(v, name: str, channels: int) -> None:
    """``v`` None or a (C,) vector of ``channels`` entries (a per-channel scale or shift)."""
    if v is None:
        return
    check_ndim(v, 1, name, "C")
    if v.shape[0] != channels:
        raise ValueError(f"{name} has {v.shape[0]} channels but x has {channels}")


def check_real(name: str, value, minimum=None) -> None:
    """``value`` a real number (Python or NumPy scalar) >= ``minimum``, else a ValueError naming it."""
    real = isinstance(value, (int, float)) or getattr(value, "ndim", None) == 0
    if not real or isinstance(value, bool):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    if minimum is not None and not value >= minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")


def window_out_size(n: int, k: int, s: int, p, d: int, ceil_mode: bool = False) -> int:
    """Output extent of a window op: floor((n + lo + hi - d(k-1) - 1)/s) + 1 (``p`` an int:
    lo = hi = p, or a ``(lo, hi)`` pair).

    ``ceil_mode`` (pooling, PyTorch's rule): ceil instead of floor, then the last window is
    dropped unless it starts inside the input or the lo padding, ``(out-1)*s < n + lo``."""
    lo, hi = sides(p)
    if not ceil_mode:
        return (n + lo + hi - d * (k - 1) - 1) // s + 1
    out = -(-(n + lo + hi - d * (k - 1) - 1) // s) + 1
    return out - 1 if (out - 1) * s >= n + lo else out


def transposed_out_size(n: int, k: int, s: int, p: int, d: int, op: int) -> int:
    """Output extent of a transposed conv: (n-1)s - 2p + d(k-1) + output_padding + 1."""
    return (n - 1) * s - 2 * p + d * (k - 1) + op + 1


def window_out_shape(spatial, k, s, p, d, ceil_mode: bool = False) -> tuple[int, ...]:
    """``window_out_size`` on every spatial axis (per-axis k, s, d; ``p`` any padding form)."""
    p = padding_sides(p, k, d, s)
    return tuple(window_out_size(*args, ceil_mode) for args in zip(spatial, k, s, p, d))


def transposed_out_shape(spatial, k, s, p, d, op) -> tuple[int, ...]:
    """``transposed_out_size`` on every spatial axis (per-axis k, s, p, d, output_padding)."""
    return tuple(transposed_out_size(*args) for args in zip(spatial, k, s, p, d, op))


__all__ = ["triple", "padding_sides", "compact_padding", "sides", "PADDING_FORMS", "check_ndim", "check_float",
           "check_channel_vector", "check_real",
           "check_same_dtype",
           "window_out_size", "transposed_out_size", "window_out_shape", "transposed_out_shape"]
