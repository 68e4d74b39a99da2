"""MaxPool3d and AvgPool3d layers (no parameters).

As in the conv layers, ``local_forward``/``local_backward`` take the padding
explicitly so that a spatially partitioned subclass can run them on a block it
has already extended with halos (and -inf / zero padding at the domain edge).
"""
from __future__ import annotations

from ..functional._args import triple, window_out_shape
from ..functional.pooling import avg_pool3d, avg_pool3d_backward, max_pool3d, max_pool3d_backward
from .module import Module


class _Pool3d(Module):
    """What both pools share: hyper-parameters, output extent, forward/backward around local_*."""

    def __init__(self, kernel_size, stride, padding, dilation):
        super().__init__()
        self.kernel_size = triple(kernel_size, "kernel_size", 1)
        self.stride = self.kernel_size if stride is None else triple(stride, "stride", 1)
        self.padding = triple(padding, "padding", 0)
        self.dilation = triple(dilation, "dilation", 1)

    def setup(self, global_in_shape):
        return window_out_shape(global_in_shape, self.kernel_size, self.stride, self.padding, self.dilation)

    def forward(self, x):
        self._save(x)
        return self.local_forward(x, self.padding)

    def backward(self, dy):
        (x,) = self._saved()
        return self.local_backward(dy, x, self.padding)


class MaxPool3d(_Pool3d):
    """Max pooling; forward keeps the first-maximum masks for backward (no recompute)."""

    def __init__(self, kernel_size, stride=None, padding=0, dilation=1):
        super().__init__(kernel_size, stride, padding, dilation)
        self._masks = None

    def local_forward(self, x, padding):
        y, self._masks = max_pool3d(x, self.kernel_size, self.stride, padding, self.dilation,
                                    return_masks=True)
        return y

    def local_backward(self, dy, x, padding):
        masks, self._masks = self._masks, None          # used once, like the saved input
        return max_pool3d_backward(dy, x, self.kernel_size, self.stride, padding, self.dilation,
                                   masks=masks)

    def extra_repr(self):
        return (f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}, "
                f"dilation={self.dilation}")


class AvgPool3d(_Pool3d):
    """Average pooling with count_include_pad=True (divisor = kernel volume); no dilation."""

    def __init__(self, kernel_size, stride=None, padding=0):
        super().__init__(kernel_size, stride, padding, 1)

    def local_forward(self, x, padding):
        return avg_pool3d(x, self.kernel_size, self.stride, padding)

    def local_backward(self, dy, x, padding):
        return avg_pool3d_backward(dy, x, self.kernel_size, self.stride, padding)

    def extra_repr(self):
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


__all__ = ["MaxPool3d", "AvgPool3d"]
