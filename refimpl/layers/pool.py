"""max_pool3d and avg_pool3d: channel-wise window ops without parameters."""
from __future__ import annotations

import math

import numpy

from .. import functional as F
from ..parallel.partition import conv_halo_plan
from .base import WindowKind, plan_window_cost


class _Pool(WindowKind):
    """What the poolings share: windows per channel, stride defaulting to the kernel, and
    padding of at most half the kernel (as in PyTorch)."""

    model_modes = ("none", "channel")    # channel-split activations: each rank pools its own channels

    def default_stride(self, kernel):
        return kernel

    def validate(self, spec):
        super().validate(spec)
        if any(2 * p > k for p, k in zip(spec.padding, spec.kernel)):
            raise ValueError(f"--padding {spec.padding} must be at most half the kernel {spec.kernel} "
                             "for pooling (as in PyTorch)")

    # ------------------------------------------------------------ planner

    plan_label = "pool"

    def plan_halo(self, layer, spatial_dims):
        return conv_halo_plan(layer.in_dhw, spatial_dims, layer.kernel, layer.stride, layer.padding, 1)

    def plan_cost(self, layer, rank, cost):
        """Memory-bound: the rank's work-array elements at ``Machine.pool_rate``; its halo."""
        n_r, itemsize = rank.n_r, rank.itemsize
        v_in, v_out, v_need, c_halo = plan_window_cost(layer, rank, cost, rank.halo_plan(layer))
        f_local = rank.f_local(layer)
        cost.flops = 2.0 * n_r * f_local * v_out * math.prod(layer.kernel)
        compute_s = n_r * f_local * v_need / rank.machine.pool_rate
        cost.saved_bytes = n_r * c_halo * v_need * itemsize
        cost.transient_bytes = n_r * (c_halo * v_need + f_local * v_out) * itemsize
        return compute_s

    def overlap(self, spec) -> int:
        """How many windows one input can fall in: the terms of one element of dx."""
        return math.prod(-(-(spec.dilation[a] * (spec.kernel[a] - 1) + 1) // spec.stride[a]) for a in range(3))


class MaxPool3dKind(_Pool):
    name = "max_pool3d"
    hyper_parameters = ("kernel", "stride", "padding", "dilation")
    pad_value = -numpy.inf

    def forward(self, spec, x, w, b):
        return F.max_pool3d(x, spec.kernel, spec.stride, spec.padding, spec.dilation), x

    def backward(self, spec, dy, x):
        return F.max_pool3d_backward(dy, x, spec.kernel, spec.stride, spec.padding, spec.dilation), None, None

    def reduction_length(self, spec, tensor, out_shape):
        return (1, "a maximum: exact") if tensor == "y" else (self.overlap(spec), "overlapping windows per input")

    def local(self, spec, *, rng, dtype):
        from ..nn import MaxPool3d
        return MaxPool3d(spec.kernel, spec.stride, spec.padding, spec.dilation)

    def partitioned(self, spec, *, grid, rng, dtype):
        from ..nn.spatial import SpatialMaxPool3d
        return SpatialMaxPool3d(spec.kernel, spec.stride, spec.padding, spec.dilation, grid=grid)

    def torch_window(self, spec, tf, x, w, b, padding):
        return tf.max_pool3d(x, spec.kernel, spec.stride, padding, spec.dilation)


class AvgPool3dKind(_Pool):
    """Zero padding counts in the average (PyTorch's count_include_pad)."""

    name = "avg_pool3d"
    hyper_parameters = ("kernel", "stride", "padding")

    def validate(self, spec):
        if spec.dilation != (1, 1, 1):
            raise ValueError(f"--dilation is not supported by {self.name} (PyTorch has none either)")
        super().validate(spec)

    def forward(self, spec, x, w, b):
        return F.avg_pool3d(x, spec.kernel, spec.stride, spec.padding), x

    def backward(self, spec, dy, x):
        return F.avg_pool3d_backward(dy, x, spec.kernel, spec.stride, spec.padding), None, None

    def reduction_length(self, spec, tensor, out_shape):
        if tensor == "y":
            return math.prod(spec.kernel), "kd·kh·kw window terms"
        return self.overlap(spec), "overlapping windows per input"

    def local(self, spec, *, rng, dtype):
        from ..nn import AvgPool3d
        return AvgPool3d(spec.kernel, spec.stride, spec.padding)

    def partitioned(self, spec, *, grid, rng, dtype):
        from ..nn.spatial import SpatialAvgPool3d
        return SpatialAvgPool3d(spec.kernel, spec.stride, spec.padding, grid=grid)

    def torch_window(self, spec, tf, x, w, b, padding):
        return tf.avg_pool3d(x, spec.kernel, spec.stride, padding)
