"""MaxPool3d and AvgPool3d layers (no parameters), with PyTorch's arguments.

As in the conv layers, ``local_forward``/``local_backward`` take the padding
explicitly so that a spatially partitioned subclass can run them on a block it
has already extended with halos (and -inf / zero padding at the domain edge).
``padding`` takes every form of ``refimpl.functional.pooling`` (int, 3-tuple, per-side
6-tuple, 'valid', 'same'), kept as ``(pd, ph, pw)`` when symmetric, else as the 6-tuple.
"""
from __future__ import annotations

from ..functional.args import compact_padding, padding_sides, triple, window_out_shape
from ..functional.pooling import avg_pool3d, avg_pool3d_backward, check_avg_options, max_pool3d, max_pool3d_backward
from .module import Module


class _Pool3d(Module):
    """What both pools share: hyper-parameters, output extent, forward/backward around local_*."""

    def __init__(self, kernel_size, stride, padding, dilation, ceil_mode=False):
        super().__init__()
        self.kernel_size = triple(kernel_size, "kernel_size", 1)
        self.stride = self.kernel_size if stride is None else triple(stride, "stride", 1)
        self.dilation = triple(dilation, "dilation", 1)
        pads = padding_sides(padding, self.kernel_size, self.dilation, self.stride)
        if any(max(pair) > k // 2 for pair, k in zip(pads, self.kernel_size)):
            raise ValueError(f"padding must be <= kernel_size // 2 on every axis and side (PyTorch's "
                             f"rule), got padding={padding!r} for kernel_size={self.kernel_size}")
        self.padding = compact_padding(pads)
        if not isinstance(ceil_mode, bool):
            raise ValueError(f"ceil_mode must be True or False, got {ceil_mode!r}")
        self.ceil_mode = ceil_mode

    def setup(self, global_in_shape):
        return window_out_shape(global_in_shape, self.kernel_size, self.stride, self.padding, self.dilation,
                                self.ceil_mode)

    def forward(self, x):
        self._save(x)
        return self.local_forward(x, self.padding)

    def backward(self, dy):
        (x,) = self._saved()
        return self.local_backward(dy, x, self.padding)


class MaxPool3d(_Pool3d):
    """Max pooling; forward keeps the first-maximum masks for backward (no recompute).
    ``local_*``'s ``ceil_mode`` None: the layer's own."""

    #: each output is the maximum of its window: ``Sequential`` may run it before a
    #: non-decreasing activation (``commutes_with_max``)
    pools_by_max = True

    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False):
        super().__init__(kernel_size, stride, padding, dilation, ceil_mode)
        self._masks = None

    def local_forward(self, x, padding, ceil_mode=None):
        ceil_mode = self.ceil_mode if ceil_mode is None else ceil_mode
        y, self._masks = max_pool3d(x, self.kernel_size, self.stride, padding, self.dilation, ceil_mode,
                                    return_masks=True)
        return y

    def local_backward(self, dy, x, padding, ceil_mode=None):
        ceil_mode = self.ceil_mode if ceil_mode is None else ceil_mode
        masks, self._masks = self._masks, None          # used once, like the saved input
        return max_pool3d_backward(dy, x, self.kernel_size, self.stride, padding, self.dilation, ceil_mode,
                                   masks=masks)

    def extra_repr(self):
        return (f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}, "
                f"dilation={self.dilation}, ceil_mode={self.ceil_mode}")


class AvgPool3d(_Pool3d):
    """Average pooling (no dilation): each window's sum over its divisor -- ``divisor_override``,
    else the window's cells inside input + padding (``count_include_pad=True``, the default)
    or inside the input alone (refimpl/functional/pooling.py)."""

    def __init__(self, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
                 divisor_override=None):
        super().__init__(kernel_size, stride, padding, 1, ceil_mode)
        check_avg_options(count_include_pad, divisor_override)
        self.count_include_pad, self.divisor_override = count_include_pad, divisor_override

    def local_forward(self, x, padding):
        return avg_pool3d(x, self.kernel_size, self.stride, padding, self.ceil_mode, self.count_include_pad,
                          self.divisor_override)

    def local_backward(self, dy, x, padding):
        return avg_pool3d_backward(dy, x, self.kernel_size, self.stride, padding, self.ceil_mode,
                                   self.count_include_pad, self.divisor_override)

    def extra_repr(self):
        return (f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}, "
                f"ceil_mode={self.ceil_mode}, count_include_pad={self.count_include_pad}, "
                f"divisor_override={self.divisor_override}")


__all__ = ["MaxPool3d", "AvgPool3d"]
