"""Argument normalisation and validation shared by every functional op.

Errors are ValueError with the argument's name in the message, raised before
any computation (and, in the distributed layers, before any message).
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


def check_ndim(x, ndim: int, name: str, layout: str = "") -> None:
    if getattr(x, "ndim", None) != ndim:
        what = f" ({layout})" if layout else ""
        raise ValueError(f"{name} must be {ndim}-D{what}, got shape {getattr(x, 'shape', None)}")


def check_float(name: str, x) -> None:
    if x.dtype.kind != "f":
        raise ValueError(f"{name} must be a floating-point array, got {x.dtype}")


def window_out_size(n: int, k: int, s: int, p: int, d: int) -> int:
    """Output extent of a window op: floor((n + 2p - d(k-1) - 1)/s) + 1."""
    return (n + 2 * p - d * (k - 1) - 1) // s + 1


def transposed_out_size(n: int, k: int, s: int, p: int, d: int, op: int) -> int:
    """Output extent of a transposed conv: (n-1)s - 2p + d(k-1) + output_padding + 1."""
    return (n - 1) * s - 2 * p + d * (k - 1) + op + 1


def window_out_shape(spatial, k, s, p, d) -> tuple[int, ...]:
    """``window_out_size`` on every spatial axis (per-axis k, s, p, d)."""
    return tuple(window_out_size(*args) for args in zip(spatial, k, s, p, d))


def transposed_out_shape(spatial, k, s, p, d, op) -> tuple[int, ...]:
    """``transposed_out_size`` on every spatial axis (per-axis k, s, p, d, output_padding)."""
    return tuple(transposed_out_size(*args) for args in zip(spatial, k, s, p, d, op))


__all__ = ["triple", "check_ndim", "check_float", "check_same_dtype",
           "window_out_size", "transposed_out_size", "window_out_shape", "transposed_out_shape"]
