"""max_pool3d and avg_pool3d: channel-wise window ops without parameters."""
from __future__ import annotations

import math

import numpy

from .. import functional as F
from ..parallel.partition import conv_halo_plan
from .base import WindowKind, plan_window_cost, spec_option, spec_padding
from .options import Option

#: PyTorch's pooling options (max and avg pooling share ceil_mode)
CEIL_MODE = Option("ceil_mode", bool, False, "ceil instead of floor for the output extent ({kinds}; "
                   "PyTorch's rule; default off)")
COUNT_INCLUDE_PAD = Option("count_include_pad", bool, True, "the zero padding counts in the divisor ({kinds}; "
                           "default on, as PyTorch)")
DIVISOR_OVERRIDE = Option("divisor_override", int, None, "divide every window's sum by N ({kinds})", metavar="N",
                          validate=lambda v: v != 0, rule="a nonzero integer")


class _Pool(WindowKind):
    """What the poolings share: windows per channel, stride defaulting to the kernel, and
    padding of at most half the kernel (as in PyTorch)."""

    model_modes = ("none", "channel")    # channel-split activations: each rank pools its own channels
    no_halo_mistake = ("pooled locally without a halo: {who}'s outputs are those of pooling its own block alone "
                       "(cells beyond it read as padding); pooling windows that cross a block edge need the "
                       "neighbours' cells")

    def default_stride(self, kernel):
        return kernel

    def validate(self, spec):
        super().validate(spec)
        if any(max(pair) > k // 2 for pair, k in zip(spec_padding(spec), spec.kernel)):
            raise ValueError(f"--padding {spec.padding} must be at most half the kernel {spec.kernel} "
                             "on every side for pooling (as in PyTorch)")

    # ------------------------------------------------------------ planner

    plan_label = "pool"

    def plan_halo(self, layer, spatial_dims):
        return conv_halo_plan(layer.in_dhw, spatial_dims, layer.kernel, layer.stride, layer.padding, 1,
                              layer.option("ceil_mode"))

    #: memory-bound: input elements/s of forward + backward until calibrated
    plan_element_rate = 1e9

    def plan_measure_rate(self, x, rng, timed):
        """Input elements/s of a 2^3 window, stride 2, forward + backward (``plan_step``)."""
        dy = rng.standard_normal((*x.shape[:2], *(n // 2 for n in x.shape[2:]))).astype(x.dtype)
        return x.size / timed(lambda: self.plan_step(x, dy))

    def plan_step(self, x, dy):
        """One forward + backward of a 2^3 window of stride 2 by the functional op training runs."""
        raise NotImplementedError

    def plan_cost(self, layer, rank, cost):
        """Memory-bound: the rank's work-array elements at its element rate; its halo."""
        n_r, itemsize = rank.n_r, rank.itemsize
        v_in, v_out, v_need, c_halo = plan_window_cost(layer, rank, cost, rank.halo_plan(layer))
        f_local = rank.f_local(layer)
        cost.flops = 2.0 * n_r * f_local * v_out * math.prod(layer.kernel)
        compute_s = n_r * f_local * v_need / rank.machine.element_rate(self)
        cost.saved_bytes = n_r * c_halo * v_need * itemsize
        cost.transient_bytes = n_r * (c_halo * v_need + f_local * v_out) * itemsize
        return compute_s

    def overlap(self, spec) -> int:
        """How many windows one input can fall in: the terms of one element of dx."""
        return math.prod(-(-(spec.dilation[a] * (spec.kernel[a] - 1) + 1) // spec.stride[a]) for a in range(3))


class MaxPool3dKind(_Pool):
    name = "max_pool3d"
    hyper_parameters = ("kernel", "stride", "padding", "dilation")
    options = (CEIL_MODE,)
    pad_value = -numpy.inf

    def window_values(self, spec, patches, w, b, counts):
        return patches.max(axis=(-3, -2, -1))

    def forward(self, spec, x, w, b):
        return F.max_pool3d(x, spec.kernel, spec.stride, spec.padding, spec.dilation,
                            spec_option(spec, "ceil_mode")), x

    def backward(self, spec, dy, x):
        return F.max_pool3d_backward(dy, x, spec.kernel, spec.stride, spec.padding, spec.dilation,
                                     spec_option(spec, "ceil_mode")), None, None

    def plan_step(self, x, dy):
        """With the first-maximum masks, as ``nn.MaxPool3d`` trains."""
        _, masks = F.max_pool3d(x, 2, return_masks=True)
        F.max_pool3d_backward(dy, x, 2, masks=masks)

    def reduction_length(self, spec, tensor, out_shape):
        return (1, "a maximum: exact") if tensor == "y" else (self.overlap(spec), "overlapping windows per input")

    def local(self, spec, *, rng, dtype):
        from ..nn import MaxPool3d
        return MaxPool3d(spec.kernel, spec.stride, spec.padding, spec.dilation, spec_option(spec, "ceil_mode"))

    def partitioned(self, spec, *, grid, rng, dtype):
        from ..nn.spatial import SpatialMaxPool3d
        return SpatialMaxPool3d(spec.kernel, spec.stride, spec.padding, spec.dilation,
                                spec_option(spec, "ceil_mode"), grid=grid)

    def torch_window(self, spec, tf, x, w, b, padding, ceil_mode=False):
        return tf.max_pool3d(x, spec.kernel, spec.stride, padding, spec.dilation, ceil_mode)


class AvgPool3dKind(_Pool):
    """Each window's sum over its divisor: PyTorch's count_include_pad (default: the zero padding
    counts, a ceil-mode overhang does not) and divisor_override."""

    name = "avg_pool3d"
    dx_reads_forward = False           # dx spreads dy over each window: x is not read
    hyper_parameters = ("kernel", "stride", "padding")
    options = (CEIL_MODE, COUNT_INCLUDE_PAD, DIVISOR_OVERRIDE)

    def validate(self, spec):
        if spec.dilation != (1, 1, 1):
            raise ValueError(f"--dilation is not supported by {self.name} (PyTorch has none either)")
        super().validate(spec)

    @staticmethod
    def pool_options(spec):
        """(ceil_mode, count_include_pad, divisor_override) of ``spec``."""
        return tuple(spec_option(spec, name) for name in ("ceil_mode", "count_include_pad", "divisor_override"))

    def forward(self, spec, x, w, b):
        return F.avg_pool3d(x, spec.kernel, spec.stride, spec.padding, *self.pool_options(spec)), x

    def backward(self, spec, dy, x):
        return F.avg_pool3d_backward(dy, x, spec.kernel, spec.stride, spec.padding, *self.pool_options(spec)), None, None

    def plan_step(self, x, dy):
        F.avg_pool3d(x, 2)
        F.avg_pool3d_backward(dy, x, 2)

    def reduction_length(self, spec, tensor, out_shape):
        if tensor == "y":
            return math.prod(spec.kernel), "kd·kh·kw window terms"
        return self.overlap(spec), "overlapping windows per input"

    def local(self, spec, *, rng, dtype):
        from ..nn import AvgPool3d
        return AvgPool3d(spec.kernel, spec.stride, spec.padding, *self.pool_options(spec))

    def partitioned(self, spec, *, grid, rng, dtype):
        from ..nn.spatial import SpatialAvgPool3d
        return SpatialAvgPool3d(spec.kernel, spec.stride, spec.padding, *self.pool_options(spec), grid=grid)

    def torch_window(self, spec, tf, x, w, b, padding, ceil_mode=False):
        _, include, divisor = self.pool_options(spec)
        return tf.avg_pool3d(x, spec.kernel, spec.stride, padding, ceil_mode, include, divisor)

    def window_values(self, spec, patches, w, b, counts):
        include, divisor = spec_option(spec, "count_include_pad"), spec_option(spec, "divisor_override")
        return patches.sum(axis=(-3, -2, -1)) / (divisor or counts[0 if include else 1])

    def torch_forward(self, spec, tf, x, w, b):
        """Symmetric padding: PyTorch's own op; asymmetric: window sums of the padded input over
        ``avg_divisor``'s counts (PyTorch has no per-side padding)."""
        p = spec_padding(spec)
        if all(lo == hi for lo, hi in p):
            return self.torch_window(spec, tf, x, w, b, tuple(lo for lo, _ in p), spec_option(spec, "ceil_mode"))
        y = self._torch_by_counts(spec, tf, x, p, p)
        return y[(Ellipsis,) + tuple(slice(0, n) for n in self.output_extent(spec))]

    def torch_block(self, spec, tf, lo, x_needed, w, b, shift_axis=None):
        """Default options: the padded block pooled unpadded; else the window sums of the padded
        block over the counts of the cells its windows count (the padding the clip removed,
        less any ceil-mode overhang, when count_include_pad)."""
        ceil, include, divisor = self.pool_options(spec)
        if not ceil and include and divisor is None:
            return super().torch_block(spec, tf, lo, x_needed, w, b, shift_axis)
        k, s = spec.kernel, spec.stride
        p_all = spec_padding(spec)
        edges, real = [], []
        for a in range(3):
            (i0, i1), (o0, o1) = lo.needed[a], lo.outputs[a]
            low = i0 - (s[a] * o0 - p_all[a][0])
            high = (s[a] * (o1 - 1) - p_all[a][0] + k[a]) - i1
            if shift_axis == a:
                low, high = low + 1, high - 1
            edges.append((low, high))
            real.append((low, min(high, p_all[a][1])))
        return self._torch_by_counts(spec, tf, x_needed, edges, real, unpadded=True)

    def _torch_by_counts(self, spec, tf, x, edges, real, unpadded=False):
        """Window sums of ``x`` zero padded by ``edges`` ((lo, hi) per axis) over each window's
        divisor: ``divisor_override``, or the windows' counts of the cells inside ``x`` plus,
        with count_include_pad, the ``real`` padding.  ``unpadded``: ``edges`` cover every
        window whole (no ceil_mode of the op's own)."""
        ceil, include, divisor = self.pool_options(spec)
        ceil = ceil and not unpadded
        pads = [v for a in reversed(range(3)) for v in edges[a]]
        sums = tf.avg_pool3d(tf.pad(x, pads), spec.kernel, spec.stride, 0, ceil, True, 1)
        if divisor is not None:
            return sums / divisor
        ones = x.new_ones((1, 1) + tuple(x.shape[2:]))
        inner = [v for a in reversed(range(3)) for v in real[a]] if include else [0] * 6
        outer = [e - r for e, r in zip(pads, inner)]
        counts = tf.pad(tf.pad(ones, inner, value=1.0), outer)
        return sums / tf.avg_pool3d(counts, spec.kernel, spec.stride, 0, ceil, True, 1)
