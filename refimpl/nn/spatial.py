"""Spatially partitioned layers: the unpartitioned layers, run on one block of each sample.

Every spatial rank holds the balanced block ``grid.local_block(global (D, H, W))``
of its samples, for every activation in the network.  A window layer is

    forward:   plan (once) -> halo exchange -> pad at the domain edge -> local math
    backward:  local backward -> crop the edge padding -> adjoint halo exchange

The plan partitions the layer's OUTPUT in balanced blocks and derives the input
each rank needs (``partition.conv_halo_plan``): outputs ``[o0, o1)`` read inputs
``[s*o0 - p_lo, s*(o1-1) - p_lo + d(k-1)]`` (``p_lo`` the padding before the input: a
per-side or 'same' padding changes only that and the output extent); the part outside
the domain is the layer's own padding (zeros, or -inf for max pooling), never a
neighbour's data, so the local op runs with padding 0 on an explicitly padded block.
Two layers give the local op the exchanged block and that padding itself instead: the conv
(zeros are its padding, and a symmetric padding costs no copy: ``SpatialConv3d``), and
average pooling, whose divisor depends on which cells are padding (``count_include_pad``,
the ceil-mode overhang: ``SpatialAvgPool3d``).

``setup(global_in_shape) -> global_out_shape`` builds the plan from the global
(D, H, W) extent; models call it once for the whole network (pure index math,
no message).  Parameter gradients are the local contributions: the gradient
synchroniser sums them over the spatial group (``refimpl.parallel.grad_sync``).
Ranks whose output block is empty still call every collective and accumulate
zero gradients, so hooks and reductions line up on every rank.

Statistics layers (batch, group and instance norm) need no halo: they are pointwise but
for their sums, which ``SpatialStatistics`` allreduces (packed in one message) over the
ranks holding the rest of the values they cover.
"""
from __future__ import annotations

from ..backend import array_module
from ..functional.conv_transpose3d import conv_transpose3d, conv_transpose3d_backward
from ..functional.linear import linear, linear_backward
from ..progress import phase
from ..parallel.collectives import allreduce
from ..parallel.objects import allreduce_sum
from ..parallel.halo import HaloExchange
from ..functional.args import padding_sides
from ..parallel.partition import conv_halo_plan, transposed_conv_halo_plan
from .batch_norm import BatchNorm3d
from .conv import Conv3d, ConvTranspose3d
from .dropout import Dropout
from .linear import FlattenLinear
from .norm import GroupNorm3d, InstanceNorm3d
from .pooling import AvgPool3d, MaxPool3d

NO_PADDING = (0, 0, 0)


def pad_block(x, edge_padding, value):
    """(..., d, h, w) -> (..., lo+d+hi, ...): ``value`` in the per-side padding."""
    if all(lo == 0 and hi == 0 for lo, hi in edge_padding):
        return x
    xp = array_module(x)
    shape = x.shape[:-3] + tuple(n + lo + hi for n, (lo, hi) in zip(x.shape[-3:], edge_padding))
    out = xp.full(shape, value, dtype=x.dtype)
    out[crop_index(x.shape[-3:], edge_padding)] = x
    return out


def crop_index(inner_shape, edge_padding):
    """Index of the un-padded interior of a padded (..., D, H, W) block."""
    return (Ellipsis,) + tuple(slice(lo, lo + n) for n, (lo, _) in zip(inner_shape, edge_padding))


def _extent(ranges):
    return tuple(b - a for a, b in ranges)


class _Halo:
    """What every windowed spatial layer shares: the plan, the exchange and the edge padding."""

    def __init__(self, *args, grid, **kwargs):
        super().__init__(*args, **kwargs)
        self.grid, self.halo = grid, None

    def _plan(self, plan):
        self.halo = HaloExchange(plan, self.grid)
        coords = self.grid.spatial_coords
        self.out_block = plan.outputs(coords)            # global output ranges this rank computes
        self.in_needed = plan.needed(coords)             # global input ranges it reads
        self.edge_padding = plan.padding(coords) if plan.axes[0].padding is not None else None
        return tuple(ax.outputs[-1][1] for ax in plan.axes)  # global output (D, H, W)

    def _exchange(self, x):
        if self.halo is None:
            raise RuntimeError(f"{type(self).__name__}.setup(global_in_shape) must be called before "
                               "forward (the model's setup does it)")
        phase("halo exchange of {layer} (forward)", self)
        x_ext = self.halo.forward(x)
        phase("forward of {layer}", self)
        return x_ext

    def _adjoint_exchange(self, dx_ext):
        """The adjoint of ``_exchange``: ghost gradients added into their owners."""
        phase("adjoint halo exchange of {layer} (backward)", self)
        dx = self.halo.adjoint(dx_ext)
        phase("backward of {layer}", self)
        return dx

    @property
    def empty_output(self) -> bool:
        return any(b == a for a, b in self.out_block)


class _WindowHalo(_Halo):
    """Conv and pooling: plan from the window, pad the exchanged block at the domain edge."""

    def setup(self, global_in_shape):
        return self._plan(conv_halo_plan(global_in_shape, self.grid.spatial_dims, self.kernel_size,
                                         self.stride, self.padding, self.dilation,
                                         getattr(self, "ceil_mode", False)))

    def _gather_padded(self, x, pad_value):
        """(N, C, owned block) -> (N, C, needed range + edge padding): halo exchange, then pad."""
        return pad_block(self._exchange(x), self.edge_padding, pad_value)

    def _return_to_owners(self, dx_pad):
        """Adjoint of ``_gather_padded``: crop the edge padding, then the adjoint exchange."""
        return self._adjoint_exchange(dx_pad[crop_index(_extent(self.in_needed), self.edge_padding)])


class SpatialConv3d(_WindowHalo, Conv3d):
    """Conv3d on this rank's output block; halo exchange gathers the input it needs.

    The domain edge's zeros are the local conv's own padding, per side (``local_padding``), not
    a padded copy of the block: a conv's padding *is* zeros, and the kernels take a symmetric
    padding (every side of a one-rank grid) without any copy.  So a rank saves the exchanged
    block (on one spatial rank: the input itself), and its input gradient comes back at the
    exchanged block's extent, with nothing to crop.  The exception is a rank whose outputs
    read padding alone along some axis (an empty needed range: a wide padding on a small
    block): the conv's gradients take no empty input, so that rank pads a copy, as the
    pooling layers do (``pads_copy``) -- decided from the plan, the same at every step."""

    def _plan(self, plan):
        out = super()._plan(plan)
        self.pads_copy = any(b == a for a, b in self.in_needed)
        # the local conv's padding: (d_lo, d_hi, h_lo, h_hi, w_lo, w_hi), or none on a padded copy
        self.local_padding = NO_PADDING if self.pads_copy else tuple(v for pair in self.edge_padding for v in pair)
        return out

    def forward(self, x):
        if self.pads_copy:
            x_in = self._gather_padded(x, 0)             # (N, C, needed + edge padding)
        else:
            x_in = self._exchange(x)                     # (N, C, needed range within the domain)
        self._save(x_in)
        if self.empty_output:
            xp = array_module(x)
            return xp.zeros((x.shape[0], self.out_channels) + _extent(self.out_block), dtype=x.dtype)
        return self.local_forward(x_in, self.local_padding)     # (N, F, out block)

    def backward(self, dy):
        (x_in,) = self._saved()
        xp = array_module(dy)
        if self.empty_output:
            dx_in, dw = xp.zeros_like(x_in), xp.zeros_like(self.weight.data)
            db = xp.zeros((self.out_channels,), dtype=dy.dtype)
        else:
            dx_in, dw, db = self.local_backward(dy, x_in, self.local_padding)
        self.accumulate_weight_and_bias(dw, db)
        if not self.needs_input_grad:        # the same on every rank: no adjoint exchange at all
            return None
        return self._return_to_owners(dx_in) if self.pads_copy else self._adjoint_exchange(dx_in)


class SpatialMaxPool3d(_WindowHalo, MaxPool3d):
    """Max pooling on this rank's output block; the domain edge is padded with -inf (the
    ceil-mode overhang too: the plan's edge padding holds it), then pooled unpadded."""

    def forward(self, x):
        x_pad = self._gather_padded(x, float("-inf"))
        self._save(x_pad)
        if self.empty_output:
            return array_module(x).zeros(x.shape[:2] + _extent(self.out_block), dtype=x.dtype)
        return self.local_forward(x_pad, NO_PADDING, ceil_mode=False)

    def backward(self, dy):
        (x_pad,) = self._saved()
        if self.empty_output:
            dx_pad = array_module(dy).zeros_like(x_pad)
        else:
            dx_pad = self.local_backward(dy, x_pad, NO_PADDING, ceil_mode=False)
        return self._return_to_owners(dx_pad)


class SpatialAvgPool3d(_WindowHalo, AvgPool3d):
    """Average pooling on this rank's output block.

    The local op runs on the exchanged block with the padding the clip to the domain removed
    (the plan's edge padding, less any ceil-mode overhang past the layer's hi padding) and the
    layer's ``ceil_mode``: its windows are then the global windows of the owned outputs, and
    each window's divisor counts the same cells as the unpartitioned op's (padding counted or
    not, overhang never).  A rank's output count is right: without an overhang the block spans
    whole windows (ceil = floor), and the overhang of the last window is less than the stride.
    """

    def _plan(self, plan):
        out = super()._plan(plan)
        p_hi = [hi for _, hi in padding_sides(self.padding, self.kernel_size, self.dilation, self.stride)]
        self.local_padding = tuple(v for (lo, hi), q in zip(self.edge_padding, p_hi) for v in (lo, min(hi, q)))
        return out

    def forward(self, x):
        x_ext = self._exchange(x)                        # (N, C, needed range)
        self._save(x_ext)
        if self.empty_output:
            return array_module(x).zeros(x.shape[:2] + _extent(self.out_block), dtype=x.dtype)
        return self.local_forward(x_ext, self.local_padding)

    def backward(self, dy):
        (x_ext,) = self._saved()
        if self.empty_output:
            dx_ext = array_module(dy).zeros_like(x_ext)
        else:
            dx_ext = self.local_backward(dy, x_ext, self.local_padding)
        return self._adjoint_exchange(dx_ext)


class SpatialConvTranspose3d(_Halo, ConvTranspose3d):
    """Transposed conv by gathering: exchange the input bounding range, compute owned outputs.

    The local inputs ``[i0, i1)`` through a padding-0 transposed conv land on global
    outputs ``i0*s - p + t`` (output ``o`` gathers input ``i`` through tap ``j`` when
    ``i*s - p + j*d == o``); the owned block ``[o0, o1)`` is cut from that.  Owned outputs
    no local input reaches (possible with stride > kernel) receive no tap: only the bias.
    """

    def setup(self, global_in_shape):
        return self._plan(transposed_conv_halo_plan(
            global_in_shape, self.grid.spatial_dims, self.kernel_size, self.stride, self.padding,
            self.dilation, self.output_padding))

    def _overlap(self, local_extent):
        """(index in the local full output, index in the owned block) of their overlap, or None."""
        src, dst = [], []
        for (i0, _), (o0, o1), n, s, p in zip(self.in_needed, self.out_block, local_extent,
                                              self.stride, self.padding):
            start = i0 * s - p                         # global position of local output 0
            a, b = max(o0, start), min(o1, start + n)
            if a >= b:
                return None
            src.append(slice(a - start, b - start))
            dst.append(slice(a - o0, b - o0))
        return (Ellipsis, *src), (Ellipsis, *dst)

    def _local_extent(self, n_in):
        return tuple((n - 1) * s + d * (k - 1) + 1
                     for n, s, d, k in zip(n_in, self.stride, self.dilation, self.kernel_size))

    def forward(self, x):
        x_ext = self._exchange(x)                       # (N, C_in, needed input range)
        self._save(x_ext)
        xp = array_module(x)
        y = xp.zeros((x.shape[0], self.out_channels) + _extent(self.out_block), dtype=x.dtype)
        if not self.empty_output and all(n > 0 for n in x_ext.shape[-3:]):
            y_local = conv_transpose3d(x_ext, self.weight.data, None, self.stride, 0, 0, self.dilation, self.groups)
            where = self._overlap(y_local.shape[-3:])
            if where is not None:
                y[where[1]] = y_local[where[0]]
        if self.bias is not None:
            y += self.bias.data.reshape(1, -1, 1, 1, 1)
        return y                                         # (N, C_out, out block)

    def backward(self, dy):
        (x_ext,) = self._saved()
        xp = array_module(dy)
        dx_ext, dw = xp.zeros_like(x_ext), xp.zeros_like(self.weight.data)
        if not self.empty_output and all(n > 0 for n in x_ext.shape[-3:]):
            local_extent = self._local_extent(x_ext.shape[-3:])
            where = self._overlap(local_extent)
            if where is not None:
                dy_local = xp.zeros(dy.shape[:2] + local_extent, dtype=dy.dtype)
                dy_local[where[0]] = dy[where[1]]
                dx_ext, dw, _ = conv_transpose3d_backward(dy_local, x_ext, self.weight.data,
                                                          self.stride, 0, 0, self.dilation, self.groups)
        self.accumulate_weight_and_bias(dw, dy.sum(axis=(0, 2, 3, 4)))
        return self._adjoint_exchange(dx_ext)


class SpatialStatistics:
    """What every statistics layer shares on a grid: its sums are those of the unpartitioned tensor.

    A statistics layer (batch, group, instance norm) computes sums on its block and hands them
    to ``global_count`` (the number of values they cover, an int) and ``global_sums`` (arrays
    of one shape, float64: per channel, per (sample, group), ...); here both are summed over
    ``stats_comm``, the ranks that hold the other parts of the same values.  The sums travel
    packed, ``(len(sums),) + shape`` in one message, and are unpacked in the same order.
    Every rank calls both in forward and ``global_sums`` in backward, empty blocks included
    (their sums are zeros), so the collectives line up.  ``stats_phase`` names the step in
    progress reports.

    A new statistics layer is its one-process layer, whose forward and backward pass their sums
    through ``self.global_count`` / ``self.global_sums`` (identities there, as in ``BatchNorm3d``
    and ``GroupNorm3d``), and ``class SpatialX(SpatialStatistics, X)``; ``stats_comm`` (default
    ``grid.spatial_comm``) names who shares its values.
    """

    stats_phase = "statistics allreduce of {layer}"

    def __init__(self, *args, grid, stats_comm=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.grid = grid
        self.stats_comm = grid.spatial_comm if stats_comm is None else stats_comm

    def setup(self, global_in_shape):
        return tuple(global_in_shape)

    def global_count(self, count):
        phase(self.stats_phase, self)
        return allreduce_sum(self.stats_comm, int(count))

    def global_sums(self, *sums):
        xp = array_module(*sums)
        packed = xp.ascontiguousarray(xp.stack(sums))   # (len(sums), ...): one message for all
        phase(self.stats_phase, self)
        allreduce(packed, self.stats_comm)
        return tuple(packed[i] for i in range(len(sums)))


class SpatialBatchNorm3d(SpatialStatistics, BatchNorm3d):
    """Batch norm whose statistics are those of the whole (unpartitioned) tensor.

    The per-channel sums and the element count are allreduced over the spatial
    group, or over the whole batch (spatial x data: ``grid.batch_comm``) with ``global_stats=True``,
    in forward (mean, variance) and backward (sum dy, sum dy*xhat).  The biased
    variance normalises; the unbiased one updates the running variance.
    """

    stats_phase = "batch-norm statistics allreduce of {layer}"

    def __init__(self, *args, grid, global_stats=False, **kwargs):
        super().__init__(*args, grid=grid, stats_comm=grid.batch_comm if global_stats else grid.spatial_comm,
                         **kwargs)
        self.global_stats = bool(global_stats)


class SpatialGroupNorm3d(SpatialStatistics, GroupNorm3d):
    """Group norm whose statistics are those of each whole (unpartitioned) sample.

    The per-(sample, group) sums and the value count are allreduced over the spatial group
    (``grid.spatial_comm``: the ranks holding the other blocks of the same samples) in
    forward (mean, variance) and backward (sum gamma dy, sum gamma dy xhat); sample groups
    (data parallelism) hold other samples and reduce nothing.  weight and bias are whole on
    every rank, their gradients this block's contributions: the gradient synchroniser sums
    them over the spatial group (as batch norm's, not ``spatial_replicated``).
    """

    stats_phase = "group-norm statistics allreduce of {layer}"


class SpatialInstanceNorm3d(SpatialStatistics, InstanceNorm3d):
    """Instance norm (group norm, one group per channel) with statistics of each whole sample:
    the (sample, channel) sums allreduced over the spatial group, as ``SpatialGroupNorm3d``."""

    stats_phase = "instance-norm statistics allreduce of {layer}"


class SpatialDropout(Dropout):
    """Dropout whose mask is this block's slice of the unpartitioned mask (no message).

    ``global_shape`` is the whole tensor (global batch included) and ``offset`` the
    position of this rank's block in it, one start per axis; ``set_block`` updates
    them (the sample offset of a data-parallel rank, the spatial block of a
    spatially partitioned one).
    """

    def __init__(self, p=0.5, seed=0):
        super().__init__(p, seed)
        self.global_shape, self.offset = None, None

    def set_block(self, global_shape, offset):
        self.global_shape, self.offset = tuple(global_shape), tuple(offset)

    def mask_block(self, x):
        if self.global_shape is None:
            return tuple(x.shape), None
        return self.global_shape, [(a, a + n) for a, n in zip(self.offset, x.shape)]


class SpatialFlattenLinear(FlattenLinear):
    """Flatten the spatial blocks + the first dense layer: the transition to a dense head.

    The unpartitioned layer computes ``y = W flatten(x) + b`` with flatten in
    (C, D, H, W) order.  Each rank owns the columns of ``W`` that meet its block,
    so ``y = sum over spatial ranks of W[:, cols] x_block + b``: one allreduce of
    (N, out) partial products over the spatial group, and every rank continues
    with the same ``y`` (the head after it is replicated).

    Backward: the head is replicated, so every spatial rank holds the same ``dy``
    and the adjoint of the allreduce hands each rank that ``dy`` unchanged.  The
    weight gradient is non-zero only in the rank's columns: summed over the
    spatial group it is the unpartitioned gradient.  The bias, like every
    parameter of the replicated head, gets the same gradient on every spatial
    rank: it is marked ``spatial_replicated`` so the gradient synchroniser
    averages it over the spatial group instead of summing.
    """

    def __init__(self, in_channels, in_features, out_features, *, grid, rng, **kwargs):
        super().__init__(in_channels, in_features, out_features, rng=rng, **kwargs)
        self.grid, self.columns = grid, None

    def setup(self, global_in_shape):
        out = super().setup(global_in_shape)            # checks C x D x H x W == in_features
        d, h, w = global_in_shape
        xp = array_module(self.weight.data)
        block = self.grid.local_block(global_in_shape)
        flat = xp.arange(self.in_features).reshape(self.in_channels, d, h, w)
        self.columns = flat[(slice(None),) + tuple(block)].reshape(-1)  # global flat index of local features
        return out

    def forward(self, x):
        if self.columns is None:
            raise RuntimeError("SpatialFlattenLinear.setup(global_in_shape) must be called before forward")
        x_flat = x.reshape(x.shape[0], -1)              # (N, C*d*h*w) local features
        w_local = self.weight.data[:, self.columns]      # (out, local features)
        y = linear(x_flat, w_local, None)                # (N, out) partial product
        phase("allreduce of {layer} (forward)", self)
        allreduce(y, self.grid.spatial_comm)
        if self.bias is not None:
            y += self.bias.data
        self._save(x_flat, x.shape)
        return y

    def backward(self, dy):
        x_flat, shape = self._saved()
        xp = array_module(dy)
        dx, dw_local, db = linear_backward(dy, x_flat, self.weight.data[:, self.columns])
        dw = xp.zeros_like(self.weight.data)
        dw[:, self.columns] = dw_local
        self.weight.accumulate_grad(dw)
        if self.bias is not None:
            self.bias.accumulate_grad(db)
        return dx.reshape(shape)
