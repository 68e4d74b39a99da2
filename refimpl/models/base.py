"""What both models share: the layer factory, the batch bookkeeping and the loss reduction.

One model class serves every process grid.  ``Layers`` hands out the
unpartitioned layer (``grid=None``) or its spatially partitioned twin
(``refimpl.nn.spatial``); both draw their initial weights from the same
``numpy.random.Generator`` in the same order, so a seed gives the same model on
any grid, and parameter names (hence ``state_dict``) are the same too.

Batch bookkeeping: the global batch of ``B`` samples is split over the ``Pn``
sample groups in equal parts (``B % Pn == 0``); sample group ``n`` holds samples
``[n*B/Pn, (n+1)*B/Pn)`` and, within it, each spatial rank the balanced block
``grid.local_block`` of every sample.

Loss scaling: the gradient synchroniser sums parameter gradients over the
spatial group and *averages* them over the data group (divides by Pn).  A loss
normalised by the global count therefore hands back ``Pn * dL/dout`` so that the
average of the Pn data-parallel contributions is the gradient of the global
loss: ``(1/Pn) sum_n Pn dL/dW|_n = dL/dW``.
"""
from __future__ import annotations

import math

from ..backend import array_module, resolve_dtype
from ..nn import spatial
from ..nn.batch_norm import BatchNorm3d
from ..nn.conv import Conv3d, ConvTranspose3d
from ..nn.init import check_rng
from ..nn.linear import FlattenLinear, Linear
from ..nn.module import Module
from ..nn.norm import GroupNorm3d, InstanceNorm3d
from ..nn.pooling import AvgPool3d, MaxPool3d


class Layers:
    """Builds each layer unpartitioned (grid None) or spatially partitioned over ``grid``."""

    def __init__(self, grid, rng, dtype):
        self.grid, self.rng, self.dtype = grid, check_rng(rng), resolve_dtype(dtype)

    def _kw(self):
        return {} if self.grid is None else {"grid": self.grid}

    def conv(self, c_in, c_out, kernel_size, padding=0, bias=True):
        cls = Conv3d if self.grid is None else spatial.SpatialConv3d
        return cls(c_in, c_out, kernel_size, padding=padding, bias=bias, rng=self.rng, dtype=self.dtype,
                   **self._kw())

    def conv_transpose(self, c_in, c_out, kernel_size, stride):
        cls = ConvTranspose3d if self.grid is None else spatial.SpatialConvTranspose3d
        return cls(c_in, c_out, kernel_size, stride=stride, rng=self.rng, dtype=self.dtype, **self._kw())

    def max_pool(self, kernel_size):
        return MaxPool3d(kernel_size) if self.grid is None else \
            spatial.SpatialMaxPool3d(kernel_size, grid=self.grid)

    def avg_pool(self, kernel_size):
        """Average pooling with stride = kernel (a whole-extent window is a global average pool;
        on a grid its halo gathers the window from every rank that owns a piece)."""
        return AvgPool3d(kernel_size) if self.grid is None else \
            spatial.SpatialAvgPool3d(kernel_size, grid=self.grid)

    def batch_norm(self, channels, eps=1e-5, momentum=0.1):
        """Statistics over the whole global batch (every rank of the grid): grid-invariant."""
        if self.grid is None:
            return BatchNorm3d(channels, eps, momentum, dtype=self.dtype)
        return spatial.SpatialBatchNorm3d(channels, eps, momentum, grid=self.grid, global_stats=True,
                                          dtype=self.dtype)

    def norm(self, kind, channels, num_groups=None, eps=1e-5, momentum=0.1):
        """A conv block's normalisation: ``kind`` "batch" (``batch_norm``), "group" (``num_groups``
        groups) or "instance".  Group and instance norm are per sample: their statistics are
        reduced over the spatial group only (data parallelism needs none), grid-invariant too."""
        if kind == "batch":
            return self.batch_norm(channels, eps, momentum)
        groups = channels if kind == "instance" else num_groups
        if self.grid is None:
            return InstanceNorm3d(channels, eps, dtype=self.dtype) if kind == "instance" else \
                GroupNorm3d(groups, channels, eps, dtype=self.dtype)
        if kind == "instance":
            return spatial.SpatialInstanceNorm3d(channels, eps, grid=self.grid, dtype=self.dtype)
        return spatial.SpatialGroupNorm3d(groups, channels, eps, grid=self.grid, dtype=self.dtype)

    def flatten_linear(self, in_channels, in_features, out_features):
        if self.grid is None:
            return FlattenLinear(in_channels, in_features, out_features, rng=self.rng, dtype=self.dtype)
        return spatial.SpatialFlattenLinear(in_channels, in_features, out_features, grid=self.grid,
                                            rng=self.rng, dtype=self.dtype)

    def linear(self, in_features, out_features):
        return Linear(in_features, out_features, rng=self.rng, dtype=self.dtype)

    # ---------------------------------------------------------------- model-parallel placement
    def model_conv(self, c_in, c_out, kernel_size, padding, mode, first, bias=True):
        """A conv split over the model axis: filter-parallel (the first split block: its input is
        replicated), channel-parallel after it in "channel" mode; unsplit without a grid."""
        if self.grid is None:
            return self.conv(c_in, c_out, kernel_size, padding=padding, bias=bias)
        from ..nn import model_parallel as mp
        if mode == "channel" and not first:
            return mp.ChannelParallelConv3d(c_in, c_out, kernel_size, padding=padding, bias=bias,
                                            grid=self.grid, rng=self.rng, dtype=self.dtype)
        return mp.FilterParallelConv3d(c_in, c_out, kernel_size, padding=padding, bias=bias, grid=self.grid,
                                       rng=self.rng, dtype=self.dtype, input_split=not first)

    def model_batch_norm(self, channels, eps=1e-5, momentum=0.1):
        """Batch norm of a channel-split activation (statistics of the global batch)."""
        if self.grid is None:
            return self.batch_norm(channels, eps, momentum)
        from ..nn.model_parallel import ModelParallelBatchNorm3d
        return ModelParallelBatchNorm3d(channels, eps, momentum, grid=self.grid, dtype=self.dtype)

    def model_norm(self, kind, channels, num_groups=None, eps=1e-5, momentum=0.1):
        """``norm`` of a channel-split activation: batch norm's statistics of the global batch; group
        and instance norm per sample, every model rank's slice whole groups (else a ValueError)."""
        if kind == "batch":
            return self.model_batch_norm(channels, eps, momentum)
        if self.grid is None:
            return self.norm(kind, channels, num_groups, eps, momentum)
        from ..nn.model_parallel import ModelParallelGroupNorm3d, ModelParallelInstanceNorm3d
        if kind == "instance":
            return ModelParallelInstanceNorm3d(channels, eps, grid=self.grid, dtype=self.dtype)
        return ModelParallelGroupNorm3d(num_groups, channels, eps, grid=self.grid, dtype=self.dtype)

    def gather(self, channels):
        """Channel-split -> replicated (an identity without a grid, so names stay the same)."""
        if self.grid is None:
            from ..nn.module import Sequential
            return Sequential()
        from ..nn.model_parallel import GatherFeatures
        return GatherFeatures(channels, grid=self.grid)

    def row_flatten_linear(self, in_channels, in_features, out_features):
        """Flatten + dense, rows split over the model axis (Gholami's Pr), columns over the blocks."""
        if self.grid is None:
            return self.flatten_linear(in_channels, in_features, out_features)
        from ..nn.model_parallel import RowParallelFlattenLinear
        return RowParallelFlattenLinear(in_channels, in_features, out_features, grid=self.grid,
                                        rng=self.rng, dtype=self.dtype)

    def row_linear(self, in_features, out_features):
        """Gholami's 1.5-D dense layer: rows over the model axis, feature-split input and output."""
        if self.grid is None:
            return self.linear(in_features, out_features)
        from ..nn.model_parallel import RowParallelLinear
        return RowParallelLinear(in_features, out_features, grid=self.grid, rng=self.rng, dtype=self.dtype)

    def dropout(self, p):
        """Mask drawn in global-batch coordinates (``set_block`` each forward)."""
        return spatial.SpatialDropout(p, seed=int(self.rng.integers(2 ** 63)))


# The checks of a model config's keys, shared by the models' ``check_config``.  ``where``
# names the config in the messages: "config" for build_model, "model_config" for the
# run config of ``refimpl train`` (which checks the model config before building it).

def is_number(value) -> bool:
    """A finite int or float (bools are not numbers here: ``True`` is a typo, not 1)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def check_positive_int(config, key, minimum=1, where="config"):
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}[{key!r}] must be an integer >= {minimum}, got {value!r}")
    return value


def check_number(config, key, ok, allowed, where="config"):
    """config[key] is a finite number with ``ok(value)``; ``allowed`` completes 'a number ...'."""
    value = config[key]
    if not is_number(value) or not ok(value):
        raise ValueError(f"{where}[{key!r}] must be a number {allowed}, got {value!r}")
    return value


def check_choice(config, key, choices, where="config"):
    value = config[key]
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{where}[{key!r}] must be one of {', '.join(choices)}, got {value!r}")
    return value


def check_input_shape(config, divisor, what, where="config"):
    """config['input_shape'] = (C, D, H, W) with every spatial size divisible by ``divisor``."""
    shape = config["input_shape"]
    if not isinstance(shape, (list, tuple)) or len(shape) != 4 \
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in shape):
        raise ValueError(f"{where}['input_shape'] must be 4 positive integers (C, D, H, W), got {shape!r}")
    shape = tuple(shape)
    for axis, n in zip("DHW", shape[1:]):
        if n % divisor:
            raise ValueError(f"{where}['input_shape']: input size {axis}={n} of {shape} must be "
                             f"divisible by {divisor} ({what})")
    return shape


def merge_config(defaults: dict, config: dict, model: str, where="config") -> dict:
    """defaults updated by config; unknown keys raise ValueError (a typo must not pass silently)."""
    if not isinstance(config, dict):
        raise ValueError(f"{where} must be a dict of {model} settings, got {config!r}")
    unknown = sorted(set(config) - set(defaults))
    if unknown:
        raise ValueError(f"unknown {model} {where} key(s) {unknown}; known: {sorted(defaults)}")
    return {**defaults, **config}


class Model(Module):
    """A model on a process grid: batch bookkeeping, input checks, loss reductions.

    Subclasses set ``input_shape`` (C, D, H, W), ``task`` and build their layers
    (``first_conv``: the layer that reads the input), then call ``self.setup_layers()``.
    """

    task = ""

    def __init__(self, config, grid, dtype, global_batch):
        super().__init__()
        self.config, self.grid, self.dtype = config, grid, resolve_dtype(dtype)
        self.data_parallel = 1 if grid is None else grid.dims[0]        # Pn
        if global_batch is not None:
            check_global_batch(global_batch, self.data_parallel)
        self.global_batch = global_batch

    # ------------------------------------------------------------ blocks
    def local_block(self, global_dhw):
        """This rank's slices of a (D, H, W) volume (the whole volume without a grid)."""
        if self.grid is None:
            return tuple(slice(0, n) for n in global_dhw)
        return self.grid.local_block(global_dhw)

    def local_samples(self, global_batch: int) -> slice:
        """This sample group's slice of the global batch (equal parts)."""
        n_local = check_global_batch(global_batch, self.data_parallel)
        start = (0 if self.grid is None else self.grid.sample_coord) * n_local
        return slice(start, start + n_local)

    def local_input(self, x_global):
        """(B, C, D, H, W) global batch -> this rank's (B/Pn, C, local block)."""
        return x_global[(self.local_samples(x_global.shape[0]), slice(None))
                        + tuple(self.local_block(x_global.shape[2:]))]

    def local_input_shape(self, n_local: int):
        c = self.input_shape[0]
        block = self.local_block(self.input_shape[1:])
        return (n_local, c) + tuple(s.stop - s.start for s in block)

    def check_input(self, x):
        """x must be this rank's block; returns the global batch size."""
        shape = tuple(getattr(x, "shape", ()))
        expected = self.local_input_shape(shape[0] if len(shape) == 5 else 0)
        if shape != expected:
            raise ValueError(f"x_local must have shape {expected} (this rank's block of a global input "
                             f"(B, {', '.join(map(str, self.input_shape))}) on grid "
                             f"{None if self.grid is None else self.grid.dims}), got {shape}")
        if x.dtype != self.dtype:
            raise ValueError(f"x_local is {x.dtype} but the model is {self.dtype.__name__}")
        batch = x.shape[0] * self.data_parallel
        if self.global_batch is not None and batch != self.global_batch:
            raise ValueError(f"x_local holds {x.shape[0]} samples: {batch} over {self.data_parallel} "
                             f"sample groups, but the model was built for global_batch {self.global_batch}")
        return batch

    def sample_offset(self, n_local: int) -> int:
        return (0 if self.grid is None else self.grid.sample_coord) * n_local

    @property
    def needs_input_grad(self) -> bool:
        """Whether ``backward`` returns dL/dx of the input batch.  Training never uses it, so
        models skip it (False, as for a PyTorch input without requires_grad): the first conv
        computes only its weight gradient and ``backward`` returns None.  Set True to get it."""
        return self.first_conv.needs_input_grad

    @needs_input_grad.setter
    def needs_input_grad(self, value: bool):
        self.first_conv.needs_input_grad = bool(value)

    def setup_layers(self, layers):
        """Chain ``setup`` through ``layers`` from the input extent (pure index math)."""
        extent = tuple(self.input_shape[1:])
        for layer in layers:
            extent = layer.setup(extent)
        return extent

    # ------------------------------------------------------------ reductions
    def reduce_sums(self, sums, over: str):
        """Sum a float64 array of local sums over 'data' (data_comm) or 'grid' (the whole global
        batch: grid.batch_comm, which leaves out the copies a model axis holds)."""
        if self.grid is None:
            return sums
        from ..parallel.collectives import allreduce
        comm = self.grid.data_comm if over == "data" else self.grid.batch_comm
        xp = array_module(sums)
        return allreduce(xp.ascontiguousarray(sums), comm)


def check_global_batch(global_batch, data_parallel: int) -> int:
    """B must be a positive multiple of Pn; returns B // Pn (same answer on every rank)."""
    if isinstance(global_batch, bool) or int(global_batch) != global_batch or global_batch < 1:
        raise ValueError(f"global_batch must be a positive integer, got {global_batch!r}")
    if global_batch % data_parallel:
        raise ValueError(f"global_batch {global_batch} must be divisible by the number of sample "
                         f"groups Pn={data_parallel}")
    return int(global_batch) // data_parallel


__all__ = ["Layers", "Model", "check_global_batch", "merge_config", "is_number", "check_positive_int",
           "check_number", "check_choice", "check_input_shape"]
