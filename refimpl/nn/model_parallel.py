"""Model-parallel layers: convolutions split by filters or by channels over ``grid.model_comm``,
composed with the spatial halo exchange, and batch norm on channel-split activations.

Layouts.  Between model-parallel layers an activation is **channel-split**: model
rank ``m`` holds channels ``channel_range(C, Pm, m)`` of its spatial block of its
samples (``parallel/channels.py``).  Outside them (``input_split=False``) it is
**replicated**: every model rank holds all channels and computes the same thing,
and the gradient flowing back into a replicated activation is the whole gradient,
the same on every model rank (as everywhere else in refimpl: the loss is computed
identically on every copy).

Weights are split with the data they meet, so a rank stores 1/Pm of them.  The
whole weight is drawn first, in the unpartitioned layer's order, and each rank
keeps its slice: a seed gives the same model on every grid.  ``Parameter.shard``
records which slice ``(axis, start, stop, whole)`` a rank holds.

    layer                   weight slice            forward                     backward (adjoints)
    FilterParallelConv3d    W[f_m, :]   b[f_m]      allgather_channels(x)       dx: reduce_scatter_channels
                            (output slice)          -> conv -> y[f_m]           (input_split=False: allreduce,
                                                                                 the replicated gradient)
    ChannelParallelConv3d   W[:, c_m]   b[f_m]      conv(x[c_m]) = partial y    dy: allgather_channels
                            (input slice)           -> reduce_scatter_channels  -> conv backward -> dx[c_m]
                                                    + b[f_m]

The spatial halo exchange runs inside each (``SpatialConv3d``) on the channels the
rank computes with: the whole input for the filter-parallel conv, its slice for the
channel-parallel one.  dW and db of a slice are summed over the spatial group and
averaged over the data group, like any parameter (``GradientSynchronizer`` reduces
over the ranks that share ``m``); the slices never meet.

Batch norm, pooling, activations and dropout act per channel: on channel-split
activations they need no change but the channel slice of batch norm's parameters
and statistics (``ModelParallelBatchNorm3d``; its sums are reduced over
``grid.batch_comm``, the ranks holding the same channels).  Group and instance norm
(``ModelParallelGroupNorm3d``, ``ModelParallelInstanceNorm3d``) keep their per-sample sums on
the spatial group: a split that cuts a channel group is refused (``check_whole_groups``).
"""
from __future__ import annotations

from ..backend import array_module
from ..progress import phase
from ..parallel.channels import allgather_channels, channel_range, reduce_scatter_channels
from ..parallel.collectives import allreduce
from .linear import Linear
from .module import Module
from .spatial import SpatialBatchNorm3d, SpatialConv3d, SpatialConvTranspose3d, SpatialFlattenLinear
from .spatial import SpatialGroupNorm3d, SpatialInstanceNorm3d

MODES = ("none", "filter", "channel")


def keep_slice(param, axis: int, start: int, stop: int) -> None:
    """Keep ``param``'s slice [start, stop) along ``axis`` (a copy: the whole is dropped)."""
    xp = array_module(param.data)
    whole = param.data.shape[axis]
    index = [slice(None)] * param.data.ndim
    index[axis] = slice(start, stop)
    param.data = xp.ascontiguousarray(param.data[tuple(index)])
    param.shard = (axis, start, stop, whole)


def whole_of(array, shard, comm):
    """The whole of a split array (collective over ``comm``, the model group): the ranks' slices
    along the shard's axis, in rank order.  ``shard`` None: ``array`` itself."""
    if shard is None:
        return array
    xp = array_module(array)
    return xp.concatenate(comm.allgather(array), axis=shard[0])


def slice_of(array, shard):
    """This rank's slice of a whole array (the inverse of ``whole_of``)."""
    if shard is None:
        return array
    axis, start, stop, _ = shard
    return array[(slice(None),) * axis + (slice(start, stop),)]


def buffer_shards(model) -> dict:
    """{buffer name: shard} of the buffers split over the model axis (batch norm's running stats)."""
    return {f"{prefix}.{name}" if prefix else name: shard for prefix, module in model.named_modules()
            for name, shard in getattr(module, "buffer_shards", {}).items()}


def check_model_split(channels: int, grid, what: str) -> None:
    """Pm must not exceed the channels a layer splits (ValueError, the same on every rank)."""
    if grid.model_dims > channels:
        raise ValueError(f"{what} splits {channels} channels over Pm={grid.model_dims} model ranks: "
                         f"at most one rank per channel (lower Pm, or keep this layer unsplit)")


class FilterParallelConv3d(SpatialConv3d):
    """Conv3d whose output channels (filters) are split over the model group.

    ``input_split``: the input is channel-split (allgathered first; dx reduce-scattered)
    or replicated (used as is; dx, a partial sum over the filters of each rank,
    allreduced over the model group so every copy holds the whole gradient).
    Output: channel-split, ``channel_range(out_channels, Pm, m)``.
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, bias=True,
                 *, grid, rng, input_split=True, **kwargs):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, bias,
                         grid=grid, rng=rng, **kwargs)
        check_model_split(out_channels, grid, "a filter-parallel conv")
        self.input_split = bool(input_split)
        self.total_out = self.out_channels
        self.out_slice = channel_range(self.out_channels, grid.model_dims, grid.model_coord)
        keep_slice(self.weight, 0, *self.out_slice)                       # (F_m, C, k, k, k)
        if self.bias is not None:
            keep_slice(self.bias, 0, *self.out_slice)                     # (F_m,)
        self.out_channels = self.out_slice[1] - self.out_slice[0]

    def forward(self, x):
        if self.input_split:
            phase("channel allgather of {layer} (forward)", self)
            x = allgather_channels(x, self.in_channels, self.grid.model_comm)    # (N, C, block)
        return super().forward(x)                                         # (N, F_m, out block)

    def backward(self, dy):
        dx = super().backward(dy)                                         # (N, C, block): partial sum
        if dx is None:
            return None
        phase("channel reduce-scatter of {layer} (backward)" if self.input_split else
              "input-gradient allreduce of {layer} (backward)", self)
        if self.input_split:
            return reduce_scatter_channels(dx, self.grid.model_comm)      # (N, c_m, block)
        xp = array_module(dx)
        dx = xp.ascontiguousarray(dx)
        allreduce(dx, self.grid.model_comm)                               # the replicated whole
        return dx


class _InputChannelSplit:
    """What the channel-parallel conv and transposed conv share: this rank's input channels give
    partial sums of every output channel (the bias withheld), reduce-scattered into the output
    slice, which its owner biases; backward allgathers dy and runs the layer's own backward."""

    def forward(self, x):
        bias, self.bias = self.bias, None             # partial sums carry no bias
        try:
            partial = super().forward(x)                                  # (N, F, out block), partial
        finally:
            self.bias = bias
        phase("channel reduce-scatter of {layer} (forward)", self)
        y = reduce_scatter_channels(array_module(partial).ascontiguousarray(partial), self.grid.model_comm)
        if self.bias is not None:
            y += self.bias.data.reshape(1, -1, 1, 1, 1)                   # (N, F_m, out block)
        return y

    def backward(self, dy):
        phase("channel allgather of {layer} (backward)", self)
        dy_full = allgather_channels(dy, self.total_out, self.grid.model_comm)    # (N, F, out block)
        bias, self.bias = self.bias, None
        try:
            dx = super().backward(dy_full)                                # dW of c_m; dx (N, c_m, block)
        finally:
            self.bias = bias
        if self.bias is not None:
            self.bias.accumulate_grad(dy.sum(axis=(0, 2, 3, 4)))          # db[f_m]
        return dx


class ChannelParallelConv3d(_InputChannelSplit, SpatialConv3d):
    """Conv3d whose input channels are split over the model group: partial sums of every
    output channel, reduce-scattered into channel-split outputs (bias added by the owner)."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, bias=True,
                 *, grid, rng, **kwargs):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, bias,
                         grid=grid, rng=rng, **kwargs)
        check_model_split(in_channels, grid, "a channel-parallel conv")
        pm, m = grid.model_dims, grid.model_coord
        self.total_in, self.total_out = self.in_channels, self.out_channels
        self.in_slice = channel_range(self.in_channels, pm, m)
        self.out_slice = channel_range(self.out_channels, pm, m)
        keep_slice(self.weight, 1, *self.in_slice)                        # (F, C_m, k, k, k)
        if self.bias is not None:
            keep_slice(self.bias, 0, *self.out_slice)                     # (F_m,)
        self.in_channels = self.in_slice[1] - self.in_slice[0]


class FilterParallelConvTranspose3d(SpatialConvTranspose3d):
    """ConvTranspose3d whose output channels are split over the model group (weight (C, F_m, k)):
    the input's channels allgathered first, dx (a partial sum over the filters) reduce-scattered."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, output_padding=0,
                 dilation=1, bias=True, *, grid, rng, **kwargs):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, output_padding, dilation,
                         bias, grid=grid, rng=rng, **kwargs)
        check_model_split(out_channels, grid, "a filter-parallel transposed conv")
        self.total_out = self.out_channels
        self.out_slice = channel_range(self.out_channels, grid.model_dims, grid.model_coord)
        keep_slice(self.weight, 1, *self.out_slice)                       # (C, F_m, k, k, k)
        if self.bias is not None:
            keep_slice(self.bias, 0, *self.out_slice)
        self.out_channels = self.out_slice[1] - self.out_slice[0]

    def forward(self, x):
        phase("channel allgather of {layer} (forward)", self)
        return super().forward(allgather_channels(x, self.in_channels, self.grid.model_comm))

    def backward(self, dy):
        dx = super().backward(dy)                                         # (N, C, block): partial
        phase("channel reduce-scatter of {layer} (backward)", self)
        return reduce_scatter_channels(array_module(dx).ascontiguousarray(dx), self.grid.model_comm)


class ChannelParallelConvTranspose3d(_InputChannelSplit, SpatialConvTranspose3d):
    """ConvTranspose3d whose input channels are split over the model group (weight (C_m, F, k)):
    partial sums of every output channel, reduce-scattered; dy allgathered in backward."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, output_padding=0,
                 dilation=1, bias=True, *, grid, rng, **kwargs):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, output_padding, dilation,
                         bias, grid=grid, rng=rng, **kwargs)
        check_model_split(in_channels, grid, "a channel-parallel transposed conv")
        pm, m = grid.model_dims, grid.model_coord
        self.total_out = self.out_channels
        self.in_slice = channel_range(self.in_channels, pm, m)
        self.out_slice = channel_range(self.out_channels, pm, m)
        keep_slice(self.weight, 0, *self.in_slice)                        # (C_m, F, k, k, k)
        if self.bias is not None:
            keep_slice(self.bias, 0, *self.out_slice)
        self.in_channels = self.in_slice[1] - self.in_slice[0]


class ModelParallelBatchNorm3d(SpatialBatchNorm3d):
    """Batch norm of a channel-split activation: this rank's channels, statistics of the whole
    global batch (reduced over ``grid.batch_comm``: the ranks that hold the same channels)."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, *, grid, **kwargs):
        super().__init__(num_features, eps, momentum, grid=grid, global_stats=True, **kwargs)
        check_model_split(num_features, grid, "a model-parallel batch norm")
        self.total_features = self.num_features
        start, stop = channel_range(self.num_features, grid.model_dims, grid.model_coord)
        for param in (self.weight, self.bias):
            keep_slice(param, 0, start, stop)
        self.buffer_shards = {}              # checkpoints save the running statistics whole
        for name in ("running_mean", "running_var"):
            buf = getattr(self, name)[start:stop].copy()
            setattr(self, name, buf)
            self._buffers[name] = buf
            self.buffer_shards[name] = (0, start, stop, self.total_features)
        self.num_features = stop - start


def check_whole_groups(channels: int, num_groups: int, grid, what: str) -> None:
    """Every model rank's channel slice must hold whole groups (ValueError, the same on every
    rank, before any message): a group cut by the split would need its sums reduced over the
    model axis too, which refimpl does not do."""
    check_model_split(channels, grid, what)
    per_group = channels // num_groups
    cut = [m for m in range(grid.model_dims)
           if any(edge % per_group for edge in channel_range(channels, grid.model_dims, m))]
    if cut:
        slices = [channel_range(channels, grid.model_dims, m) for m in range(grid.model_dims)]
        raise ValueError(f"{what} of {channels} channels in {num_groups} groups of {per_group}: the model "
                         f"split over Pm={grid.model_dims} ranks (channel slices {slices}) cuts a group; "
                         f"choose Pm so that every slice holds whole groups (e.g. Pm dividing "
                         f"{num_groups}), or keep this layer unsplit")


class _ModelParallelGroups:
    """Group norm of a channel-split activation: this rank's channels hold whole groups
    (``check_whole_groups``), so its statistics are complete once reduced over the spatial
    group (the ranks holding the same samples and channels): nothing crosses the model axis.
    weight and bias keep this rank's channel slice."""

    def _keep_groups(self, grid, what):
        check_whole_groups(self.num_channels, self.num_groups, grid, what)
        self.total_channels = self.num_channels
        start, stop = channel_range(self.num_channels, grid.model_dims, grid.model_coord)
        for param in (self.weight, self.bias):
            keep_slice(param, 0, start, stop)
        self.num_groups = (stop - start) // (self.num_channels // self.num_groups)
        self.num_channels = stop - start


class ModelParallelGroupNorm3d(_ModelParallelGroups, SpatialGroupNorm3d):
    """Group norm of a channel-split activation (every model rank's slice whole groups, else
    a ValueError): per-sample statistics reduced over the spatial group only."""

    def __init__(self, num_groups, num_channels, eps=1e-5, *, grid, **kwargs):
        super().__init__(num_groups, num_channels, eps, grid=grid, **kwargs)
        self._keep_groups(grid, "a model-parallel group norm")


class ModelParallelInstanceNorm3d(_ModelParallelGroups, SpatialInstanceNorm3d):
    """Instance norm of a channel-split activation: every channel its own group, so any split
    keeps groups whole; statistics reduced over the spatial group only."""

    def __init__(self, num_features, eps=1e-5, *, grid, **kwargs):
        super().__init__(num_features, eps, grid=grid, **kwargs)
        self._keep_groups(grid, "a model-parallel instance norm")


# ---------------------------------------------------------------- Gholami's 1.5-D dense layers

class RowParallelLinear(Linear):
    """Gholami et al.'s 1.5-D fully connected layer on the Pr x Pc = Pm x Pn grid.

    ``Y = W X`` with ``W`` (d_out x d_in), a batch of B samples.  ``W`` is split by
    rows over the model group (rank m keeps ``W[f_m, :]``: d_out/Pm rows) and
    replicated over the data group; the batch is split over the data group
    (B/Pn per rank); activations between such layers are feature-split over the
    model group, exactly the channel-split layout of the convs above.  Messages,
    with the alpha-beta costs of the paper (allgather / reduce-scatter of n words
    over p ranks: ``alpha ceil(log2 p) + beta (p-1)/p n``; allreduce: twice that):

    - forward, ``input_split=True``: allgather of X over the model group,
      n = d_in * B/Pn words: ``alpha log Pm + beta (Pm-1)/Pm d_in B/Pn``;
      then ``Y[f_m] = W[f_m] X`` locally (no message after it);
    - backward, dX = W^T dY: each rank's ``W[f_m]^T dY[f_m]`` is a partial sum over
      the model group: reduce-scatter, n = d_in * B/Pn, the same cost;
      (``input_split=False``: X is replicated, nothing to gather; dX is allreduced
      over the model group so every copy holds the whole gradient);
    - backward, dW = dY X^T: summed over the batch, i.e. allreduced over the data
      group (``GradientSynchronizer``), n = d_out d_in / Pm words:
      ``2 alpha log Pn + 2 beta (Pn-1)/Pn d_out d_in / Pm``.

    The paper's point: the per-layer volume ``d_in B/Pn`` (model axis) trades against
    ``d_out d_in / Pm`` (data axis), so for a fixed batch the cheapest grid is usually
    neither pure data (Pm = 1) nor pure model (Pn = 1) parallel.  The bias is split
    with the rows.
    """

    def __init__(self, in_features, out_features, bias=True, *, grid, rng, input_split=True, **kwargs):
        super().__init__(in_features, out_features, bias, rng=rng, **kwargs)
        check_model_split(out_features, grid, "a 1.5-D dense layer")
        self.grid, self.input_split = grid, bool(input_split)
        self.total_out = self.out_features
        self.out_slice = channel_range(self.out_features, grid.model_dims, grid.model_coord)
        keep_slice(self.weight, 0, *self.out_slice)                       # (out_m, in)
        if self.bias is not None:
            keep_slice(self.bias, 0, *self.out_slice)
        self.out_features = self.out_slice[1] - self.out_slice[0]
        for param in self.parameters():       # the head runs replicated over the spatial group
            param.spatial_replicated = True

    def forward(self, x):
        if self.input_split:
            phase("feature allgather of {layer} (forward)", self)
            x = allgather_channels(x, self.in_features, self.grid.model_comm)    # (N/Pn, d_in)
        return super().forward(x)                                          # (N/Pn, d_out/Pm)

    def backward(self, dy):
        dx = super().backward(dy)                                          # (N/Pn, d_in), partial
        phase("feature reduce-scatter of {layer} (backward)" if self.input_split else
              "input-gradient allreduce of {layer} (backward)", self)
        if self.input_split:
            return reduce_scatter_channels(dx, self.grid.model_comm)
        dx = array_module(dx).ascontiguousarray(dx)
        allreduce(dx, self.grid.model_comm)
        return dx


class RowParallelFlattenLinear(SpatialFlattenLinear):
    """The first dense layer after the conv stack, rows split over the model group.

    Its input is replicated over the model group (every model rank holds its
    spatial block of every channel); the columns are split over the spatial group
    as in ``SpatialFlattenLinear`` (partial products allreduced over it), the rows
    over the model group (rank m computes output features f_m).  Backward: dX of
    the rank's rows is a partial sum over the model group, allreduced there (the
    replicated input's whole gradient).  The output is feature-split: the layout
    ``RowParallelLinear(input_split=True)`` takes.
    """

    def __init__(self, in_channels, in_features, out_features, *, grid, rng, **kwargs):
        super().__init__(in_channels, in_features, out_features, grid=grid, rng=rng, **kwargs)
        check_model_split(out_features, grid, "a 1.5-D dense layer")
        self.total_out = self.out_features
        self.out_slice = channel_range(self.out_features, grid.model_dims, grid.model_coord)
        keep_slice(self.weight, 0, *self.out_slice)
        if self.bias is not None:
            keep_slice(self.bias, 0, *self.out_slice)
        self.out_features = self.out_slice[1] - self.out_slice[0]

    def backward(self, dy):
        dx = super().backward(dy)                                          # (N, C, block), partial
        if self.grid.model_dims == 1:
            return dx
        phase("input-gradient allreduce of {layer} (backward)", self)
        dx = array_module(dx).ascontiguousarray(dx)
        allreduce(dx, self.grid.model_comm)
        return dx


class GatherFeatures(Module):
    """Feature-split (N, d_m) -> replicated (N, d): the end of a model-parallel head.

    Forward: ``allgather_channels`` over the model group.  Backward: what follows is
    computed identically on every model rank (the loss), so each rank's gradient is
    already the whole one and the rank keeps its slice: no message.  (Read as a sum
    over copies, the adjoint is the reduce-scatter of Pm equal gradients, each counted
    1/Pm: the same numbers, for nothing sent.)
    """

    def __init__(self, features: int, *, grid):
        super().__init__()
        self.features, self.grid = int(features), grid
        self.own = channel_range(self.features, grid.model_dims, grid.model_coord)

    def forward(self, x):
        phase("feature allgather of {layer} (forward)", self)
        return allgather_channels(x, self.features, self.grid.model_comm)

    def backward(self, dy):
        return array_module(dy).ascontiguousarray(dy[:, self.own[0]:self.own[1]])


__all__ = ["MODES", "keep_slice", "whole_of", "slice_of", "buffer_shards", "check_model_split", "FilterParallelConv3d", "ChannelParallelConv3d",
           "FilterParallelConvTranspose3d", "ChannelParallelConvTranspose3d", "ModelParallelBatchNorm3d", "ModelParallelGroupNorm3d", "ModelParallelInstanceNorm3d", "RowParallelLinear", "RowParallelFlattenLinear", "GatherFeatures"]
