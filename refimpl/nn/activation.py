"""Pointwise activation layers (no parameters, no halos: the same on any block)."""
from __future__ import annotations

from ..functional.activations import (
    leaky_relu, leaky_relu_backward, relu, relu_backward, scaled_tanh, scaled_tanh_backward, tanh,
    tanh_backward)
from .module import Module


def _writeable(a) -> bool:
    return a.flags.c_contiguous and getattr(a.flags, "writeable", True)


class _SignPatternActivation(Module):
    """An activation whose backward reads only the sign pattern of its input (x > 0), so that
    the forward may write y over x (``in_place``: y > 0 exactly where x > 0) and the backward dx
    over dy (``reuse_grad``), each when that array is writeable and C-contiguous; the
    subclass gives ``_forward(x, out)`` and ``_backward(dy, x, out)``."""

    def __init__(self, in_place=False, reuse_grad=False):
        super().__init__()
        self.in_place = bool(in_place)
        self.reuse_grad = bool(reuse_grad)

    def forward(self, x):
        if self.in_place and _writeable(x):
            y = self._forward(x, out=x)
            self._save(y)                        # y > 0 exactly where x > 0
            return y
        self._save(x)
        return self._forward(x, out=None)

    def backward(self, dy):
        (x,) = self._saved()                     # or y, in place: the same sign pattern
        return self._backward(dy, x, out=dy if self.reuse_grad and _writeable(dy) else None)


class ReLU(_SignPatternActivation):
    """``in_place=True``: the forward writes y over its input ``x`` (when that is a writeable
    C-contiguous array), so a caller must not keep ``x``, and saves y for the backward: exact,
    since y = max(x, 0) > 0 exactly where x > 0 (a NaN is not > 0 in either).
    ``reuse_grad=True``: the backward writes dx over the ``dy`` it is given (when writeable and
    C-contiguous), so a caller must not keep ``dy``.  Why: as ``LeakyReLU``'s (no new array is
    allocated and first touched).  The U-Net builds its conv blocks' ReLUs so: x is the norm's
    output, which the norm's backward does not read, and dy a gradient no one else reads."""

    #: max(relu(a), relu(b)) == relu(max(a, b)) bit for bit: ``Sequential`` may pool first
    commutes_with_max = True

    def _forward(self, x, out):
        return relu(x, out=out)

    def _backward(self, dy, x, out):
        return relu_backward(dy, x, out=out)

    def extra_repr(self):
        return ", ".join(name + "=True" for name in ("in_place", "reuse_grad") if getattr(self, name))


class LeakyReLU(_SignPatternActivation):
    """``reuse_grad=True``: the backward writes dx over the ``dy`` it is given (when that is a
    writeable C-contiguous array), so a caller must not keep ``dy``.  Why: the backward is a
    memory-bound pass, and a new dx array costs a third more memory traffic than writing over
    dy (docs/benchmarks.md, "Kernel choices").  The models build it so where dy is a gradient
    no one else reads (CosmoFlow: the max pool's or the dropout's dx); the default keeps dy.

    ``in_place=True`` (a slope >= 0 only): the forward writes y over its input ``x`` (when that
    is a writeable C-contiguous array), so a caller must not keep ``x``, and saves y for the
    backward.  Why it is exact: the backward reads only where x > 0, and for a slope >= 0,
    y = x > 0 where x > 0 and y = slope * x <= 0 elsewhere, so y > 0 exactly where x > 0.  Why
    it pays: no new array is allocated and first touched (docs/benchmarks.md, "Kernel
    choices").  The models build it where x is an output no one else reads (CosmoFlow: the
    conv's, which the conv's backward does not need)."""

    def __init__(self, negative_slope=0.01, reuse_grad=False, in_place=False):
        super().__init__(in_place=in_place, reuse_grad=reuse_grad)
        self.negative_slope = float(negative_slope)
        if self.in_place and not self.negative_slope >= 0:
            raise ValueError(f"LeakyReLU(in_place=True) needs negative_slope >= 0 (the backward reads the sign of "
                             f"y for that of x), got {negative_slope!r}")

    @property
    def commutes_with_max(self) -> bool:
        """Whether the activation is non-decreasing (a slope >= 0), so that ``Sequential`` may run
        a max pool behind it first (the same output values; see ``Sequential``)."""
        return self.negative_slope >= 0

    def _forward(self, x, out):
        return leaky_relu(x, self.negative_slope, out=out)

    def _backward(self, dy, x, out):
        return leaky_relu_backward(dy, x, self.negative_slope, out=out)

    def extra_repr(self):
        return (f"negative_slope={self.negative_slope}" + (", reuse_grad=True" if self.reuse_grad else "")
                + (", in_place=True" if self.in_place else ""))


class Tanh(Module):
    def forward(self, x):
        y = tanh(x)
        self._save(y)
        return y

    def backward(self, dy):
        (y,) = self._saved()
        return tanh_backward(dy, y)


class ScaledTanh(Module):
    """y = scale * tanh(x); CosmoFlow's output head uses scale = 1.2."""

    def __init__(self, scale=1.2):
        super().__init__()
        self.scale = float(scale)

    def forward(self, x):
        y, t = scaled_tanh(x, self.scale)
        self._save(t)
        return y

    def backward(self, dy):
        (t,) = self._saved()
        return scaled_tanh_backward(dy, t, self.scale)

    def extra_repr(self):
        return f"scale={self.scale}"


__all__ = ["ReLU", "LeakyReLU", "Tanh", "ScaledTanh"]
