"""conv3d and conv_transpose3d: window ops that mix channels, with a weight and a bias.

The reference forward and backward run refimpl/functional with ``algorithm="reference"`` (pad,
one slice per tap, one GEMM), never a kernel of refimpl/kernels/: the oracle's trust rests on
code anyone can read.
"""
from __future__ import annotations

import math

import numpy

from .. import functional as F
from ..functional.args import padding_sides
from ..functional.conv3d import REFERENCE
from ..parallel.partition import (conv_halo_plan, transposed_conv_halo_plan, transposed_needed_input_range,
                                 transposed_output_extent, window_output_extent)
from .base import LayerKind, WindowKind, plan_window_cost, spec_option
from .options import Option

#: PyTorch's grouped convolution
GROUPS = Option("groups", int, 1, "channel groups of {kinds} (PyTorch's; default 1; not with --model-parallel)",
                metavar="G", validate=lambda v: v >= 1, rule="a positive integer")


class _Conv(LayerKind):
    """What conv3d and conv_transpose3d share: F output channels, each reading every input
    channel; a weight split by filter or by channel over the model axis."""

    hyper_parameters = ("out_channels", "kernel", "stride", "padding", "dilation")
    options = (GROUPS,)
    model_modes = ("none", "filter", "channel")
    mixes_channels = True
    dx_reads_forward = False           # dx = the adjoint of the conv applied to dy

    def output_channels(self, spec):
        return spec.out_channels

    def validate(self, spec):
        super().validate(spec)
        groups = spec_option(spec, "groups")
        if groups > 1 and (spec.input[1] % groups or spec.out_channels % groups):
            raise ValueError(f"--groups {groups} must divide the input channels ({spec.input[1]}) and "
                             f"--out-channels ({spec.out_channels})")
        if groups > 1 and spec.model_parallel != "none":
            raise ValueError(f"--groups {groups} is not supported with --model-parallel {spec.model_parallel} "
                             "(the model-parallel convs split ungrouped weights)")

    def may_use_winograd(self, spec, algorithm):
        from ..kernels import routes
        if not routes.winograd_applicable(spec.kernel, spec.stride, spec.dilation):
            return False
        return algorithm == "winograd" or (
            algorithm == "auto" and routes.wide_enough(spec.input[1], spec.out_channels, weight_grad=True,
                                                       r=spec.kernel[0]))

    def parameter_shapes(self, spec):
        channels = [0, 0]
        out_axis, in_axis = self.weight_axes
        channels[out_axis], channels[in_axis] = spec.out_channels, spec.input[1]
        channels[1] //= spec_option(spec, "groups")        # PyTorch: dim 1 holds one group's channels
        return tuple(channels) + tuple(spec.kernel), (spec.out_channels,)

    def draw_parameters(self, rng, spec):
        """Weights of variance 1/(C/groups·kd·kh·kw): outputs of the inputs' magnitude."""
        w_shape, b_shape = self.parameter_shapes(spec)
        fan_in = spec.input[1] // spec_option(spec, "groups") * math.prod(spec.kernel)
        return {"w": rng.standard_normal(w_shape) / numpy.sqrt(fan_in), "b": rng.standard_normal(b_shape)}

    def weight_grad_volume(self, spec, out_shape) -> int:
        """Voxels summed into one weight gradient: the output volume of the underlying conv."""
        raise NotImplementedError

    # ------------------------------------------------------------ planner

    plan_channelwise = False
    plan_calibrated = True

    def plan_weight_taps(self, layer):
        return math.prod(layer.kernel)

    def plan_mac_voxels(self, v_in, v_out) -> int:
        """Voxels each (output, input) channel pair multiplies the kernel over: a conv's outputs."""
        return v_out

    def plan_cost(self, layer, rank, cost):
        """2 N_r F C k^3 V FLOPs per pass, forward, dW (and dX unless the first layer) at the
        rate measured for the shape; its halo; the model-axis collectives of its split
        (filter: allgather x, reduce-scatter dx; filter-replicated: dx allreduced; channel:
        reduce-scatter y, allgather dy)."""
        pm, m, n_r, itemsize, machine = rank.pm, rank.m, rank.n_r, rank.itemsize, rank.machine
        plan = rank.halo_plan(layer)
        v_in, v_out, v_need, c_halo = plan_window_cost(layer, rank, cost, plan)
        c_local, f_local = rank.c_local(layer), rank.f_local(layer)
        c_mac = c_local if layer.split == "channel" else layer.c_in
        f_mac = layer.c_out if layer.split == "channel" else f_local
        macs = n_r * f_mac * c_mac * math.prod(layer.kernel) * self.plan_mac_voxels(v_in, v_out)
        macs //= getattr(layer, "groups", 1)            # a group's outputs read only its own inputs
        passes = 3 if layer.input_grad else 2          # forward, dW (, dX)
        cost.flops = 2.0 * macs * passes
        compute_s = cost.flops / (machine.conv_rate(layer, n_r * v_in) * 1e9)
        cost.saved_bytes = n_r * c_halo * v_need * itemsize
        cost.transient_bytes = n_r * (c_halo * v_need + f_local * v_out) * itemsize
        # model-axis collectives
        if layer.split == "filter" and pm > 1:            # allgather x, reduce-scatter dx
            b = 2 * rank.moved_bytes(layer.c_in, n_r * v_in)
            cost.model_bytes, cost.model_messages = b, 2 * (pm - 1)
        elif layer.split == "filter-replicated" and pm > 1 and layer.input_grad:   # dx allreduced
            n_bytes = n_r * layer.c_in * v_in * itemsize
            cost.model_allreduce_bytes = n_bytes
            cost.comm_s += rank.allreduce_s(n_bytes, rank.model_group)
        elif layer.split == "channel" and pm > 1:         # reduce-scatter y, allgather dy
            b = 2 * rank.moved_bytes(layer.c_out, n_r * v_out)
            cost.model_bytes, cost.model_messages = b, 2 * (pm - 1)
        if layer.split in ("filter", "channel") and pm > 1:
            alpha, beta = machine.group_link(rank.model_group)
            cost.comm_s += cost.model_messages * alpha + cost.model_bytes * beta
        return compute_s

    def reduction_length(self, spec, tensor, out_shape):
        n, c = spec.input[:2]
        kvol, groups = math.prod(spec.kernel), spec_option(spec, "groups")
        if tensor in ("y", "y_partial"):
            return c // groups * kvol, "C/groups·kd·kh·kw terms per output"
        if tensor in ("dx", "dx_needed"):
            return out_shape[1] // groups * kvol, "F/groups·kd·kh·kw terms per input"
        if tensor in ("dw", "dw_partial"):
            return n * self.weight_grad_volume(spec, out_shape), "N·(conv output volume) terms per weight"
        return n * math.prod(out_shape[2:]), "N·Do·Ho·Wo terms per bias"


class Conv3dKind(_Conv, WindowKind):
    name = "conv3d"
    weight_axes = (0, 1)                 # (F, C, kd, kh, kw), as PyTorch

    def forward(self, spec, x, w, b):
        return F.conv3d(x, w, b, spec.stride, spec.padding, spec.dilation, spec_option(spec, "groups"),
                        algorithm=REFERENCE), (x, w)

    def backward(self, spec, dy, saved):
        x, w = saved
        return F.conv3d_backward(dy, x, w, spec.stride, spec.padding, spec.dilation, spec_option(spec, "groups"),
                                 algorithm=REFERENCE)

    def weight_grad_volume(self, spec, out_shape):
        return math.prod(out_shape[2:])

    def local(self, spec, *, rng, dtype):
        from ..nn import Conv3d
        return Conv3d(spec.input[1], spec.out_channels, spec.kernel, spec.stride, spec.padding, spec.dilation,
                      groups=spec_option(spec, "groups"), rng=rng, dtype=dtype)

    def partitioned(self, spec, *, grid, rng, dtype):
        from ..nn import model_parallel, spatial
        if spec.model_parallel == "none":
            return spatial.SpatialConv3d(spec.input[1], spec.out_channels, spec.kernel, spec.stride, spec.padding,
                                         spec.dilation, groups=spec_option(spec, "groups"), grid=grid, rng=rng,
                                         dtype=dtype)
        layer = {"filter": model_parallel.FilterParallelConv3d,
                 "channel": model_parallel.ChannelParallelConv3d}[spec.model_parallel]
        return layer(spec.input[1], spec.out_channels, spec.kernel, spec.stride, spec.padding, spec.dilation,
                     grid=grid, rng=rng, dtype=dtype)

    def torch_window(self, spec, tf, x, w, b, padding, ceil_mode=False):
        return tf.conv3d(x, w, b, spec.stride, padding, spec.dilation, spec_option(spec, "groups"))

    def window_values(self, spec, patches, w, b, counts):
        y = numpy.einsum("ncdhwijk,fcijk->nfdhw", patches, w)
        return y + b.reshape(1, -1, 1, 1, 1)

    plan_label = "conv"

    def plan_halo(self, layer, spatial_dims):
        return conv_halo_plan(layer.in_dhw, spatial_dims, layer.kernel, layer.stride, layer.padding, 1)

    def plan_output_extent(self, layer, in_dhw):
        pads = padding_sides(layer.padding, layer.kernel, (1, 1, 1), layer.stride)
        return tuple(window_output_extent(n, k, st, p, 1) for n, k, p, st in
                     zip(in_dhw, layer.kernel, pads, layer.stride))

    def plan_time(self, layer, repeats, rng, best_time):
        x, dy = _plan_inputs(layer, rng)
        w = rng.standard_normal((layer.c_out, layer.c_in) + layer.kernel, dtype=numpy.float32)
        s, p = layer.stride, layer.padding
        if layer.input_grad:
            return best_time(lambda: (F.conv3d(x, w, stride=s, padding=p),
                                      F.conv3d_backward(dy, x, w, stride=s, padding=p)), repeats)
        return best_time(lambda: (F.conv3d(x, w, stride=s, padding=p),
                                  F.conv3d_weight_grad(dy, x, w.shape, stride=s, padding=p)), repeats)


class ConvTranspose3dKind(_Conv):
    """The input-adjoint of conv3d: input i reaches output o through tap j when i*s - p + j*d == o."""

    name = "conv_transpose3d"
    output_size_rule = "(n-1)s - 2p + d(k-1) + output_padding + 1 for a transposed conv"
    hyper_parameters = _Conv.hyper_parameters + ("output_padding",)
    has_halo = True
    weight_axes = (1, 0)                 # (C, F, kd, kh, kw), as PyTorch
    padding_forms = "symmetric"          # an int or 3 ints, as PyTorch's conv_transpose3d

    def output_extent(self, spec):
        return tuple(transposed_output_extent(spec.input[2 + a], spec.kernel[a], spec.stride[a], spec.padding[a],
                                              spec.dilation[a], spec.output_padding[a]) for a in range(3))

    def forward(self, spec, x, w, b):
        y = F.conv_transpose3d(x, w, b, spec.stride, spec.padding, spec.output_padding, spec.dilation,
                               spec_option(spec, "groups"), algorithm=REFERENCE)
        return y, (x, w)

    def backward(self, spec, dy, saved):
        x, w = saved
        return F.conv_transpose3d_backward(dy, x, w, spec.stride, spec.padding, spec.output_padding,
                                           spec.dilation, spec_option(spec, "groups"), algorithm=REFERENCE)

    def weight_grad_volume(self, spec, out_shape):
        return math.prod(spec.input[2:])

    def local(self, spec, *, rng, dtype):
        from ..nn import ConvTranspose3d
        return ConvTranspose3d(spec.input[1], spec.out_channels, spec.kernel, spec.stride, spec.padding,
                               spec.output_padding, spec.dilation, groups=spec_option(spec, "groups"), rng=rng,
                               dtype=dtype)

    def partitioned(self, spec, *, grid, rng, dtype):
        from ..nn import model_parallel, spatial
        if spec.model_parallel == "none":
            return spatial.SpatialConvTranspose3d(spec.input[1], spec.out_channels, spec.kernel, spec.stride,
                                                  spec.padding, spec.output_padding, spec.dilation,
                                                  groups=spec_option(spec, "groups"), grid=grid, rng=rng, dtype=dtype)
        layer = {"filter": model_parallel.FilterParallelConvTranspose3d,
                 "channel": model_parallel.ChannelParallelConvTranspose3d}[spec.model_parallel]
        return layer(spec.input[1], spec.out_channels, spec.kernel, spec.stride, spec.padding,
                     spec.output_padding, spec.dilation, grid=grid, rng=rng, dtype=dtype)

    def halo_plan(self, spec, spatial_dims):
        return transposed_conv_halo_plan(spec.input[2:], spatial_dims, spec.kernel, spec.stride, spec.padding,
                                         spec.dilation, spec.output_padding)

    def output_size_rules(self, spec, axis):
        n, k, s, d = spec.input[2 + axis], spec.kernel[axis], spec.stride[axis], spec.dilation[axis]
        p, op = spec.padding[axis], spec.output_padding[axis]

        def extent(p=p, d=d, op=op):
            return (n - 1) * s - 2 * p + d * (k - 1) + op + 1
        rules = []
        if op:
            rules.append((f"ignores output_padding ({op})", extent(op=0)))
        if d > 1:
            rules.append((f"ignores dilation (the dilated kernel spans {d * (k - 1) + 1}, not {k})", extent(d=1)))
        if p:
            rules.append((f"ignores padding ({p})", extent(p=0)))
        return tuple(rules)

    def input_window(self, spec, axis, o):
        return transposed_needed_input_range(o, o + 1, spec.kernel[axis], spec.stride[axis], spec.padding[axis],
                                             spec.dilation[axis], spec.input[2 + axis], spec.output_padding[axis])

    plan_label = "conv_transpose"

    def plan_mac_voxels(self, v_in, v_out):
        """A transposed conv multiplies every input voxel by the whole kernel."""
        return v_in

    def plan_halo(self, layer, spatial_dims):
        return transposed_conv_halo_plan(layer.in_dhw, spatial_dims, layer.kernel, layer.stride, layer.padding, 1,
                                         layer.output_padding)

    def plan_output_extent(self, layer, in_dhw):
        return tuple(transposed_output_extent(n, k, st, p, 1, op) for n, k, p, st, op in
                     zip(in_dhw, layer.kernel, layer.padding, layer.stride, layer.output_padding))

    def plan_time(self, layer, repeats, rng, best_time):
        x, dy = _plan_inputs(layer, rng)
        w = rng.standard_normal((layer.c_in, layer.c_out) + layer.kernel, dtype=numpy.float32)
        s, p, op = layer.stride, layer.padding, layer.output_padding
        return best_time(lambda: (F.conv_transpose3d(x, w, stride=s, padding=p, output_padding=op),
                                  F.conv_transpose3d_backward(dy, x, w, stride=s, padding=p, output_padding=op)),
                         repeats)

    def torch_forward(self, spec, tf, x, w, b):
        return tf.conv_transpose3d(x, w, b, spec.stride, spec.padding, spec.output_padding, spec_option(spec, "groups"),
                                   spec.dilation)

    def torch_block(self, spec, tf, lo, x_needed, w, b, shift_axis=None):
        """The whole transposed conv of the needed block, then the window of it that is lo's
        output block (cropped, or zero-padded where no input of the block reaches)."""
        s, p = spec.stride, spec.padding
        y = tf.conv_transpose3d(x_needed, w, None, s, 0, 0, spec_option(spec, "groups"),
                                spec.dilation) if all(x_needed.shape[2:]) else None
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


def _plan_inputs(layer, rng):
    """x and dy of one float32 sample for timing ``layer`` (refimpl plan --calibrate)."""
    x = rng.standard_normal((1, layer.c_in) + tuple(layer.in_dhw), dtype=numpy.float32)
    dy = rng.standard_normal((1, layer.c_out) + tuple(layer.out_dhw), dtype=numpy.float32)
    return x, dy
