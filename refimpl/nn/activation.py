"""Pointwise activation layers (no parameters, no halos: the same on any block)."""
from __future__ import annotations

from ..functional.activations import (
    leaky_relu, leaky_relu_backward, relu, relu_backward, scaled_tanh, scaled_tanh_backward, tanh,
    tanh_backward)
from .module import Module


class ReLU(Module):
    def forward(self, x):
        self._save(x)
        return relu(x)

    def backward(self, dy):
        (x,) = self._saved()
        return relu_backward(dy, x)


class LeakyReLU(Module):
    def __init__(self, negative_slope=0.01):
        super().__init__()
        self.negative_slope = float(negative_slope)

    def forward(self, x):
        self._save(x)
        return leaky_relu(x, self.negative_slope)

    def backward(self, dy):
        (x,) = self._saved()
        return leaky_relu_backward(dy, x, self.negative_slope)

    def extra_repr(self):
        return f"negative_slope={self.negative_slope}"


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
