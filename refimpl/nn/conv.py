"""Conv3d and ConvTranspose3d layers (PyTorch weight layouts and default init).

``forward`` = ``local_forward`` on the whole input; a spatially partitioned
subclass exchanges halos first and calls ``local_forward`` on its padded block
(with the padding it applied itself), then reuses ``local_backward`` and the
gradient bookkeeping in ``backward``.
"""
from __future__ import annotations

from ..backend import TRAIN_DTYPE
from ..functional.args import compact_padding, padding_sides, transposed_out_shape, triple, window_out_shape
from ..functional.conv3d import conv3d, conv3d_backward, conv3d_weight_grad
from ..functional.conv_transpose3d import conv_transpose3d, conv_transpose3d_backward
from .init import check_rng, uniform_fan_in
from .module import Module


def _check_channels(in_channels, out_channels):
    for name, v in (("in_channels", in_channels), ("out_channels", out_channels)):
        if isinstance(v, bool) or int(v) != v or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")


def _set_window(layer, in_channels, out_channels, kernel_size, stride, padding, dilation, any_padding=True):
    """Channels and window hyper-parameters, validated (ValueError naming the argument).

    ``any_padding`` (Conv3d): ``padding`` in any form of ``functional.args.padding_sides``
    (int, 3-tuple, per-side 6-tuple, 'valid', 'same'), kept as ``(pd, ph, pw)`` when symmetric,
    else as the 6-tuple ``(d_lo, d_hi, h_lo, h_hi, w_lo, w_hi)``; else (ConvTranspose3d, as
    PyTorch) an int or a 3-tuple."""
    _check_channels(in_channels, out_channels)
    layer.in_channels, layer.out_channels = int(in_channels), int(out_channels)
    layer.kernel_size = triple(kernel_size, "kernel_size", 1)
    layer.stride = triple(stride, "stride", 1)
    layer.dilation = triple(dilation, "dilation", 1)
    layer.padding = (compact_padding(padding_sides(padding, layer.kernel_size, layer.dilation, layer.stride))
                     if any_padding else triple(padding, "padding", 0))


def _set_groups(layer, groups):
    """``groups`` (PyTorch's, keyword-only here): a positive integer dividing both channel counts."""
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or \
            layer.in_channels % groups or layer.out_channels % groups:
        raise ValueError(f"groups must be a positive integer dividing in_channels={layer.in_channels} and "
                         f"out_channels={layer.out_channels}, got {groups!r}")
    layer.groups = groups


def _add_weight_and_bias(layer, channel_dims, fan_in_channels, bias, rng, dtype):
    """weight (channel_dims + kernel) and bias ~ U(+-1/sqrt(fan_in)), fan_in = channels x kernel volume."""
    check_rng(rng)
    k = layer.kernel_size
    fan_in = fan_in_channels * k[0] * k[1] * k[2]
    layer.weight = layer.add_parameter("weight", uniform_fan_in(rng, tuple(channel_dims) + k, fan_in, dtype))
    layer.bias = layer.add_parameter(
        "bias", uniform_fan_in(rng, (layer.out_channels,), fan_in, dtype)) if bias else None


class _ConvLayer(Module):
    """What both conv layers share: the gradient bookkeeping of their weight and bias."""

    def accumulate_weight_and_bias(self, dw, db):
        self.weight.accumulate_grad(dw)
        if self.bias is not None:
            self.bias.accumulate_grad(db)


class Conv3d(_ConvLayer):
    """y = conv3d(x, weight, bias); weight (out, in/groups, kd, kh, kw), fan_in = in/groups * kd * kh * kw.

    ``needs_input_grad = False`` (a model's first layer, whose input is data) skips the
    input gradient: ``backward`` then returns None and computes only dw and db, as
    PyTorch does for an input that does not require grad.
    """

    needs_input_grad = True

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 bias=True, *, groups=1, rng, dtype=TRAIN_DTYPE):
        super().__init__()
        _set_window(self, in_channels, out_channels, kernel_size, stride, padding, dilation)
        _set_groups(self, groups)
        c_group = self.in_channels // self.groups
        _add_weight_and_bias(self, (self.out_channels, c_group), c_group, bias, rng, dtype)

    def local_forward(self, x, padding):
        b = None if self.bias is None else self.bias.data
        return conv3d(x, self.weight.data, b, self.stride, padding, self.dilation, self.groups)

    def local_backward(self, dy, x, padding):
        """(dx, dw, db) of local_forward; dx is None when the input gradient is not needed."""
        if not self.needs_input_grad:
            dw = conv3d_weight_grad(dy, x, self.weight.shape, self.stride, padding, self.dilation, self.groups)
            return None, dw, dy.sum(axis=(0, 2, 3, 4))
        return conv3d_backward(dy, x, self.weight.data, self.stride, padding, self.dilation, self.groups)

    def setup(self, global_in_shape):
        return window_out_shape(global_in_shape, self.kernel_size, self.stride, self.padding, self.dilation)

    def forward(self, x):
        self._save(x)
        return self.local_forward(x, self.padding)

    def backward(self, dy):
        (x,) = self._saved()
        dx, dw, db = self.local_backward(dy, x, self.padding)
        self.accumulate_weight_and_bias(dw, db)
        return dx

    def extra_repr(self):
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}, dilation={self.dilation}, "
                f"groups={self.groups}, bias={self.bias is not None}")


class ConvTranspose3d(_ConvLayer):
    """y = conv_transpose3d(x, weight, bias); weight (in, out/groups, kd, kh, kw).

    PyTorch computes fan_in from the weight's dim 1, i.e. out/groups * kd * kh * kw here.
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0,
                 output_padding=0, dilation=1, bias=True, *, groups=1, rng, dtype=TRAIN_DTYPE):
        super().__init__()
        _set_window(self, in_channels, out_channels, kernel_size, stride, padding, dilation, any_padding=False)
        self.output_padding = triple(output_padding, "output_padding", 0)
        _set_groups(self, groups)
        f_group = self.out_channels // self.groups
        _add_weight_and_bias(self, (self.in_channels, f_group), f_group, bias, rng, dtype)

    def local_forward(self, x, padding, output_padding):
        b = None if self.bias is None else self.bias.data
        return conv_transpose3d(x, self.weight.data, b, self.stride, padding, output_padding,
                                self.dilation, self.groups)

    def local_backward(self, dy, x, padding, output_padding):
        """(dx, dw, db) of local_forward."""
        return conv_transpose3d_backward(dy, x, self.weight.data, self.stride, padding,
                                         output_padding, self.dilation, self.groups)

    def setup(self, global_in_shape):
        return transposed_out_shape(global_in_shape, self.kernel_size, self.stride, self.padding,
                                    self.dilation, self.output_padding)

    def forward(self, x):
        self._save(x)
        return self.local_forward(x, self.padding, self.output_padding)

    def backward(self, dy):
        (x,) = self._saved()
        dx, dw, db = self.local_backward(dy, x, self.padding, self.output_padding)
        self.accumulate_weight_and_bias(dw, db)
        return dx

    def extra_repr(self):
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}, "
                f"output_padding={self.output_padding}, dilation={self.dilation}, "
                f"groups={self.groups}, bias={self.bias is not None}")


__all__ = ["Conv3d", "ConvTranspose3d"]
