"""CosmoFlow: regression of 4 cosmological parameters from a 3D dark-matter density volume.

The MLPerf HPC reference network (Mathuriya et al. 2018; MLPerf HPC CosmoFlow,
github.com/mlcommons/hpc ``cosmoflow/models/cosmoflow.py``: Keras ``Conv3D(kernel_size=2,
padding='same')``), for L conv blocks of width ``conv_size * 2^i`` (mlperf preset: 4 x 128^3,
L = 5, k = 2):

    x                                     (B, 4, S, S, S)
    L x [Conv3d k 'same' -> LeakyReLU(0.3) -> MaxPool3d 2]
      'same': the output keeps the input extent; odd k pads k // 2 on each side, even k
      pads k - 1 in all, the odd cell after (k = 2: 0 before, 1 after), TensorFlow's rule
      block i                             (B, conv_size * 2^i, S / 2^(i+1), ...)
    [global_pool "avg": AvgPool3d over the whole remaining extent -> (B, c, 1, 1, 1)]
    flatten + Dense fc1_size              (B, fc1)     <- SpatialFlattenLinear on a grid
    LeakyReLU(0.3) -> Dropout             (B, fc1)
    Dense fc2_size -> LeakyReLU -> Dropout (B, fc2)
    Dense num_outputs -> 1.2 tanh         (B, 4)       targets lie in [-1, 1]

Loss: mean squared error over the global batch and the 4 outputs; metric: mean
absolute error.  ``S`` must be divisible by 2^L.

``global_pool = "avg"`` (not in the MLPerf network) averages each channel of the last
block over its whole extent before the head, so the head takes ``conv_size * 2^(L-1)``
features whatever the input size: the network's parameters -- and what it can fit --
no longer grow with the input, only the volume it averages over does.  That is the
fixed-capacity family scripts/experiment_volume.py compares sample volumes with
(docs/experiments.md); without it the flatten's weight grows like the volume.

On a process grid every conv/pool layer holds the rank's spatial block and the
flatten + first dense layer reduces its partial products over the spatial group,
so the dense head runs *replicated* on every spatial rank of a sample group:
its parameters are ``spatial_replicated`` (the synchroniser averages their equal
gradients over the spatial group) and its dropout masks are drawn in
global-batch coordinates, so every grid drops the same units of the same sample.
"""
from __future__ import annotations

import numpy

from ..backend import array_module
from ..functional.args import compact_padding, padding_sides
from ..kernels import blas_held_single
from ..functional.losses import mae_local_sums, mean_finish, mse_local_sums, mse_loss_backward
from ..nn.activation import LeakyReLU, ScaledTanh
from ..nn.module import Sequential
from .base import Layers, Model, check_choice, check_input_shape, check_number, check_positive_int, merge_config

MODEL_MODES = ("none", "filter", "channel")
GLOBAL_POOLS = ("none", "avg")

DEFAULTS = {
    "input_shape": (4, 128, 128, 128),   # (C, D, H, W)
    "conv_size": 32,                     # channels of the first conv block; block i has conv_size * 2^i
    "n_conv_layers": 5,
    "kernel_size": 3,                    # 'same' padding: k // 2 per side if odd, else (k-1)//2 + the odd cell after
    "fc1_size": 128,
    "fc2_size": 64,
    "num_outputs": 4,
    "dropout": 0.5,
    "leaky_slope": 0.3,
    "output_scale": 1.2,
    # the model axis Pm (grids of 5 entries): "none" runs every layer on every model rank;
    # "filter" / "channel" split the last `model_parallel_blocks` conv blocks (the first of them
    # filter-parallel, its input being replicated; the others filter- or channel-parallel) and
    # the dense head (Gholami's 1.5-D layers; docs/model_parallel.md)
    "model_parallel": "none",
    "model_parallel_blocks": 1,
    # "avg": average each channel over the last block's whole extent before the head (a global
    # average pool), so the parameter count does not depend on input_shape; "none": flatten it all
    "global_pool": "none",
}


def check_config(config: dict, where: str = "config") -> dict:
    """DEFAULTS updated by ``config`` (overrides), every key's type and range checked;
    ValueError of one line naming the key.  Pure: ``refimpl train`` checks its
    [model_config] with it before any rank builds a layer, the model on building."""
    config = merge_config(DEFAULTS, config, "cosmoflow", where)
    n_layers = check_positive_int(config, "n_conv_layers", where=where)
    for key in ("conv_size", "kernel_size", "fc1_size", "fc2_size", "num_outputs"):
        check_positive_int(config, key, where=where)
    check_number(config, "dropout", lambda p: 0.0 <= p < 1.0, "in [0, 1)", where)
    check_number(config, "leaky_slope", lambda a: True, "(the slope for x < 0)", where)
    check_number(config, "output_scale", lambda s: s > 0, "> 0", where)
    check_choice(config, "model_parallel", MODEL_MODES, where)
    check_choice(config, "global_pool", GLOBAL_POOLS, where)
    blocks = check_positive_int(config, "model_parallel_blocks", where=where)
    if blocks > n_layers:
        raise ValueError(f"{where}['model_parallel_blocks'] = {blocks} exceeds n_conv_layers = {n_layers}")
    config["input_shape"] = check_input_shape(config, 2 ** n_layers,
                                              f"{n_layers} conv blocks each halve it", where)
    return config


class CosmoFlow(Model):
    task = "regression"

    def __init__(self, config, grid, seed, dtype, global_batch=None):
        config = check_config(config)
        super().__init__(config, grid, dtype, global_batch)
        n_layers, width, k = config["n_conv_layers"], config["conv_size"], config["kernel_size"]
        fc1, fc2 = config["fc1_size"], config["fc2_size"]
        self.num_outputs = config["num_outputs"]
        self.input_shape = config["input_shape"]
        slope = float(config["leaky_slope"])
        make = Layers(grid, numpy.random.default_rng(seed), dtype)

        mode = config["model_parallel"]
        split_from = n_layers - config["model_parallel_blocks"] if mode != "none" else n_layers
        blocks, c_in = [], self.input_shape[0]
        for i in range(n_layers):
            c_out = width * 2 ** i
            conv = make.conv(c_in, c_out, k, padding="same") if i < split_from else \
                make.model_conv(c_in, c_out, k, "same", mode, first=i == split_from)
            blocks += [conv,                                          # (B, c_out, s, s, s)
                       LeakyReLU(slope, reuse_grad=True, in_place=slope >= 0),   # y over its x, dx over its dy:
                                                                      # no one else reads either
                       make.max_pool(2)]                              # (B, c_out, s/2, s/2, s/2)
            # (Sequential runs the pool first, then the activation on the pooled block: the same
            # output, an eighth of the activation's cost; x is then the pool's y, dy the next conv's dx)
            c_in = c_out
        if mode != "none":
            blocks.append(make.gather(c_in))                          # channel-split -> replicated
        final = tuple(n // 2 ** n_layers for n in self.input_shape[1:])
        if config["global_pool"] == "avg":                            # the window is the whole extent
            blocks.append(make.avg_pool(final))                       # (B, c_in, 1, 1, 1)
            final = (1, 1, 1)
        self.features = self.add_module("features", Sequential(*blocks))
        self.first_conv = blocks[0]
        self.needs_input_grad = False
        n_flat = c_in * final[0] * final[1] * final[2]
        self.dropouts = [make.dropout(config["dropout"]), make.dropout(config["dropout"])]
        if mode == "none":
            flatten_dense = make.flatten_linear(c_in, n_flat, fc1)   # weight: each rank's columns
            self.head = self.add_module("head", Sequential(
                flatten_dense, LeakyReLU(slope), self.dropouts[0],                      # (B, fc1)
                make.linear(fc1, fc2), LeakyReLU(slope), self.dropouts[1],              # (B, fc2)
                make.linear(fc2, self.num_outputs), ScaledTanh(config["output_scale"])))  # (B, 4)
            self.dropout_offsets = (0, 0)
        else:                       # 1.5-D: rows over the model axis, features split between layers
            flatten_dense, dense = make.row_flatten_linear(c_in, n_flat, fc1), make.row_linear(fc1, fc2)
            self.head = self.add_module("head", Sequential(
                flatten_dense, LeakyReLU(slope), self.dropouts[0],                      # (B, fc1/Pm)
                dense, LeakyReLU(slope), self.dropouts[1],                              # (B, fc2/Pm)
                make.gather(fc2),                                                       # (B, fc2)
                make.linear(fc2, self.num_outputs), ScaledTanh(config["output_scale"])))  # (B, 4)
            self.dropout_offsets = tuple(getattr(layer, "out_slice", (0, 0))[0] for layer in (flatten_dense, dense))
        for param in self.head.parameters():     # after the flatten the head runs replicated
            param.spatial_replicated = param is not flatten_dense.weight
        self.setup_layers([self.features, self.head])

    @classmethod
    def describe(cls, config) -> list[dict]:
        """The layers this class builds for ``config``, in forward order, without building them
        (a 512^3 model's flatten weight alone is a GiB): per layer its module name, its kind in
        the layer registry (refimpl/layers), channels, global input / output extents (D, H, W),
        kernel / stride / padding, parameter count (weight + bias), how the model axis splits
        it (``split``: none | filter | filter-replicated | channel | row | row-split; ``split_in``:
        its input is channel-split) and whether it computes an input gradient.  ``refimpl plan``
        prices this list; tests/test_plan.py checks it against the built model's modules."""
        cfg = check_config(config)
        n_layers, width, k = cfg["n_conv_layers"], cfg["conv_size"], cfg["kernel_size"]
        mode = cfg["model_parallel"]
        split_from = n_layers - cfg["model_parallel_blocks"] if mode != "none" else n_layers
        c_in, dhw = cfg["input_shape"][0], tuple(cfg["input_shape"][1:])
        kk = (k,) * 3
        pad = compact_padding(padding_sides("same", kk))     # (1, 1, 1) for k = 3; (0, 1, 0, 1, 0, 1) for k = 2
        out, split_in = [], False
        for i in range(n_layers):
            c_out = width * 2 ** i
            split = "none" if i < split_from else ("filter-replicated" if i == split_from else
                                                   "channel" if mode == "channel" else "filter")
            out.append(_layer(f"features.{3 * i}", "conv3d", c_in, c_out, dhw, dhw, kk, (1, 1, 1), pad,
                              weights=c_out * c_in * k ** 3 + c_out, split=split, split_in=split_in,
                              input_grad=i > 0))
            split_in = split != "none"
            half = tuple(n // 2 for n in dhw)
            # the activation runs after the pool, on its output (nn.Sequential.run_order): priced there
            act_dhw = half if LeakyReLU(cfg["leaky_slope"]).commutes_with_max else dhw
            out.append(_layer(f"features.{3 * i + 1}", "leaky_relu", c_out, c_out, act_dhw, act_dhw,
                              split_in=split_in))
            out.append(_layer(f"features.{3 * i + 2}", "max_pool3d", c_out, c_out, dhw, half, (2, 2, 2),
                              (2, 2, 2), split_in=split_in))
            c_in, dhw = c_out, half
        if mode != "none":
            out.append(_layer(f"features.{3 * n_layers}", "gather", c_in, c_in, dhw, dhw, split_in=True))
        if cfg["global_pool"] == "avg":
            out.append(_layer(f"features.{3 * n_layers + (mode != 'none')}", "avg_pool3d", c_in, c_in, dhw,
                              (1, 1, 1), dhw, dhw))
            dhw = (1, 1, 1)
        flat = c_in * dhw[0] * dhw[1] * dhw[2]
        fc1, fc2, n_out = cfg["fc1_size"], cfg["fc2_size"], cfg["num_outputs"]
        row = mode != "none"
        out += [_layer("head.0", "flatten_linear", flat, fc1, dhw, (), weights=fc1 * flat + fc1,
                       split="row" if row else "none"),
                _layer("head.3", "linear", fc1, fc2, (), (), weights=fc2 * fc1 + fc2,
                       split="row-split" if row else "none", split_in=row)]
        if row:
            out.append(_layer("head.6", "gather", fc2, fc2, (), (), split_in=True))
        out.append(_layer(f"head.{7 if row else 6}", "linear", fc2, n_out, (), (), weights=n_out * fc2 + n_out))
        return out

    def local_target(self, target_global):
        """(B, num_outputs) -> this sample group's (B/Pn, num_outputs), the same on each spatial rank."""
        return target_global[self.local_samples(target_global.shape[0])]

    @blas_held_single()
    def forward(self, x_local):
        """(n_local, C, local block) -> (n_local, num_outputs), the same on every spatial rank."""
        batch = self.check_input(x_local)
        offset = self.sample_offset(x_local.shape[0])
        for dropout, width, first in zip(self.dropouts, (self.config["fc1_size"], self.config["fc2_size"]),
                                         self.dropout_offsets):
            dropout.set_block((batch, width), (offset, first))     # mask of the global (B, width)
        return self.head.forward(self.features.forward(x_local))

    @blas_held_single()
    def backward(self, dout_local):
        return self.features.backward(self.head.backward(dout_local))

    def loss(self, out_local, target_local):
        """MSE over the global batch and outputs; (loss, Pn * dloss/dout, {"mae": ...}).

        Every spatial rank of a sample group holds the same outputs and targets, so the
        sums are reduced over the data group only.
        """
        xp = array_module(out_local)
        if tuple(target_local.shape) != tuple(out_local.shape):
            raise ValueError(f"target_local must have shape {tuple(out_local.shape)} "
                             f"(n_local, num_outputs), got {tuple(target_local.shape)}")
        sums = self.reduce_sums(xp.concatenate([mse_local_sums(out_local, target_local),     # [n, sum e^2,
                                                mae_local_sums(out_local, target_local)]),   #  n, sum |e|]
                                over="data")
        dout = mse_loss_backward(out_local, target_local, sums[:2], dloss=float(self.data_parallel))
        return mean_finish(sums[:2]), dout, {"mae": mean_finish(sums[2:])}


def _layer(name, kind, c_in, c_out, in_dhw, out_dhw, kernel=(1, 1, 1), stride=(1, 1, 1), padding=(0, 0, 0),
           *, weights=0, split="none", split_in=False, input_grad=True, **options) -> dict:
    """One entry of ``describe()``: a layer of the registry kind ``kind`` (refimpl/layers);
    ``options``: values of the kind's declared options (group norm's ``num_groups``)."""
    return {"name": name, "kind": kind, "c_in": c_in, "c_out": c_out, "in_dhw": tuple(in_dhw),
            "out_dhw": tuple(out_dhw), "kernel": tuple(kernel), "stride": tuple(stride),
            "padding": tuple(padding), "weights": weights, "split": split, "split_in": split_in,
            "input_grad": input_grad, **options}


__all__ = ["CosmoFlow", "DEFAULTS", "GLOBAL_POOLS", "check_config"]
