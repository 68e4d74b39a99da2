"""conv3d and conv_transpose3d: window ops that mix channels, with a weight and a bias.

The reference forward and backward run refimpl/functional with ``algorithm="reference"`` (pad,
one slice per tap, one GEMM), never a kernel of refimpl/kernels/: the oracle's trust rests on
code anyone can read.
"""
from __future__ import annotations

import math

import numpy

from .. import functional as F
from ..functional.conv3d import REFERENCE
from ..parallel.partition import transposed_conv_halo_plan, transposed_needed_input_range, transposed_output_extent
from .base import LayerKind, WindowKind


class _Conv(LayerKind):
    """What conv3d and conv_transpose3d share: F output channels, each reading every input
    channel; a weight split by filter or by channel over the model axis."""

    hyper_parameters = ("out_channels", "kernel", "stride", "padding", "dilation")
    model_modes = ("none", "filter", "channel")
    mixes_channels = True

    def output_channels(self, spec):
        return spec.out_channels

    def may_use_winograd(self, spec, algorithm):
        from ..kernels import winograd
        if not winograd.applicable(spec.kernel, spec.stride, spec.dilation):
            return False
        return algorithm == "winograd" or (
            algorithm == "auto" and winograd.wide_enough(spec.input[1], spec.out_channels, weight_grad=True))

    def parameter_shapes(self, spec):
        channels = [0, 0]
        out_axis, in_axis = self.weight_axes
        channels[out_axis], channels[in_axis] = spec.out_channels, spec.input[1]
        return tuple(channels) + tuple(spec.kernel), (spec.out_channels,)

    def draw_parameters(self, rng, spec):
        """Weights of variance 1/(C·kd·kh·kw): outputs of the inputs' magnitude."""
        w_shape, b_shape = self.parameter_shapes(spec)
        fan_in = spec.input[1] * math.prod(spec.kernel)
        return {"w": rng.standard_normal(w_shape) / numpy.sqrt(fan_in), "b": rng.standard_normal(b_shape)}

    def weight_grad_volume(self, spec, out_shape) -> int:
        """Voxels summed into one weight gradient: the output volume of the underlying conv."""
        raise NotImplementedError

    def reduction_length(self, spec, tensor, out_shape):
        n, c = spec.input[:2]
        kvol = math.prod(spec.kernel)
        if tensor in ("y", "y_partial"):
            return c * kvol, "C·kd·kh·kw terms per output"
        if tensor in ("dx", "dx_needed"):
            return out_shape[1] * kvol, "F·kd·kh·kw terms per input"
        if tensor in ("dw", "dw_partial"):
            return n * self.weight_grad_volume(spec, out_shape), "N·(conv output volume) terms per weight"
        return n * math.prod(out_shape[2:]), "N·Do·Ho·Wo terms per bias"


class Conv3dKind(_Conv, WindowKind):
    name = "conv3d"
    weight_axes = (0, 1)                 # (F, C, kd, kh, kw), as PyTorch

    def forward(self, spec, x, w, b):
        return F.conv3d(x, w, b, spec.stride, spec.padding, spec.dilation, algorithm=REFERENCE), (x, w)

    def backward(self, spec, dy, saved):
        x, w = saved
        return F.conv3d_backward(dy, x, w, spec.stride, spec.padding, spec.dilation, algorithm=REFERENCE)

    def weight_grad_volume(self, spec, out_shape):
        return math.prod(out_shape[2:])

    def local(self, spec, *, rng, dtype):
        from ..nn import Conv3d
        return Conv3d(spec.input[1], spec.out_channels, spec.kernel, spec.stride, spec.padding, spec.dilation,
                      rng=rng, dtype=dtype)

    def partitioned(self, spec, *, grid, rng, dtype):
        from ..nn import model_parallel, spatial
        layer = {"none": spatial.SpatialConv3d, "filter": model_parallel.FilterParallelConv3d,
                 "channel": model_parallel.ChannelParallelConv3d}[spec.model_parallel]
        return layer(spec.input[1], spec.out_channels, spec.kernel, spec.stride, spec.padding, spec.dilation,
                     grid=grid, rng=rng, dtype=dtype)

    def torch_window(self, spec, tf, x, w, b, padding):
        return tf.conv3d(x, w, b, spec.stride, padding, spec.dilation)


class ConvTranspose3dKind(_Conv):
    """The input-adjoint of conv3d: input i reaches output o through tap j when i*s - p + j*d == o."""

    name = "conv_transpose3d"
    hyper_parameters = _Conv.hyper_parameters + ("output_padding",)
    has_halo = True
    weight_axes = (1, 0)                 # (C, F, kd, kh, kw), as PyTorch

    def output_extent(self, spec):
        return tuple(transposed_output_extent(spec.input[2 + a], spec.kernel[a], spec.stride[a], spec.padding[a],
                                              spec.dilation[a], spec.output_padding[a]) for a in range(3))

    def forward(self, spec, x, w, b):
        y = F.conv_transpose3d(x, w, b, spec.stride, spec.padding, spec.output_padding, spec.dilation,
                               algorithm=REFERENCE)
        return y, (x, w)

    def backward(self, spec, dy, saved):
        x, w = saved
        return F.conv_transpose3d_backward(dy, x, w, spec.stride, spec.padding, spec.output_padding,
                                           spec.dilation, algorithm=REFERENCE)

    def weight_grad_volume(self, spec, out_shape):
        return math.prod(spec.input[2:])

    def local(self, spec, *, rng, dtype):
        from ..nn import ConvTranspose3d
        return ConvTranspose3d(spec.input[1], spec.out_channels, spec.kernel, spec.stride, spec.padding,
                               spec.output_padding, spec.dilation, rng=rng, dtype=dtype)

    def partitioned(self, spec, *, grid, rng, dtype):
        from ..nn import model_parallel, spatial
        layer = {"none": spatial.SpatialConvTranspose3d, "filter": model_parallel.FilterParallelConvTranspose3d,
                 "channel": model_parallel.ChannelParallelConvTranspose3d}[spec.model_parallel]
        return layer(spec.input[1], spec.out_channels, spec.kernel, spec.stride, spec.padding,
                     spec.output_padding, spec.dilation, grid=grid, rng=rng, dtype=dtype)

    def halo_plan(self, spec, spatial_dims):
        return transposed_conv_halo_plan(spec.input[2:], spatial_dims, spec.kernel, spec.stride, spec.padding,
                                         spec.dilation, spec.output_padding)

    def input_window(self, spec, axis, o):
        return transposed_needed_input_range(o, o + 1, spec.kernel[axis], spec.stride[axis], spec.padding[axis],
                                             spec.dilation[axis], spec.input[2 + axis], spec.output_padding[axis])

    def torch_forward(self, spec, tf, x, w, b):
        return tf.conv_transpose3d(x, w, b, spec.stride, spec.padding, spec.output_padding, 1, spec.dilation)

    def torch_block(self, spec, tf, lo, x_needed, w, b, shift_axis=None):
        """The whole transposed conv of the needed block, then the window of it that is lo's
        output block (cropped, or zero-padded where no input of the block reaches)."""
        s, p = spec.stride, spec.padding
        y = tf.conv_transpose3d(x_needed, w, None, s, 0, 0, 1, spec.dilation) if all(x_needed.shape[2:]) else None
        pads = []
        for a in reversed(range(3)):             # torch's pad lists the last axis first
            (i0, i1), (o0, o1) = lo.needed[a], lo.outputs[a]
            start = i0 * s[a] - p[a]
            length = y.shape[2 + a] if y is not None else 0
            pads += [start - o0, (o1 - o0) - (start - o0) - length]   # negative pad = crop
        if y is None:
            y = x_needed.new_zeros(x_needed.shape[:1] + (w.shape[1],) + tuple(o1 - o0 for o0, o1 in lo.outputs))
        else:
            y = tf.pad(y, pads)
        return y if b is None else y + b.reshape(1, -1, 1, 1, 1)
