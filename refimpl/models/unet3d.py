"""3D U-Net: voxel-wise segmentation (Cicek et al. 2016; the LBANN / MLPerf variants).

With L levels and widths w_i = base_width * 2^i (tiny preset: 1 x 16^3, L = 2, w_0 = 4):

    x                                              (B, C, S, S, S)
    encoder level i = 0..L-1:
      enc_i  = [Conv3d k=3 pad 1 -> BatchNorm3d -> ReLU] x 2   (B, w_i, S/2^i, ...)  -> skip_i
      pool_i = MaxPool3d 2                                     (B, w_i, S/2^(i+1), ...)
    bottleneck = [conv block] x 2                              (B, w_L, S/2^L, ...)
    decoder level i = L-1..0:
      up_i   = ConvTranspose3d k=2 s=2                         (B, w_i, S/2^i, ...)
      concat (up_i, skip_i) on the channel axis                (B, 2 w_i, S/2^i, ...)
      dec_i  = [conv block] x 2                                (B, w_i, S/2^i, ...)
    out = Conv3d k=1 -> class logits                           (B, K, S, S, S)

Convs followed by batch norm have no bias (the norm's shift replaces it, and its
gradient would be identically zero).  Loss (config "loss"): softmax cross-entropy
(optional class weights), soft Dice, or their sum "ce+dice"; metric: hard Dice
of the argmax, averaged over classes.  ``S`` must be divisible by 2^L.

On a process grid every layer holds the rank's spatial block.  The skip and the
upsampled tensor are balanced blocks of the same global extent on the same grid,
so they coincide and concatenate locally.  Batch norm statistics cover the whole
global batch (``global_stats=True``: reduced over every rank of the grid), which
makes the model grid-invariant.  With config "norm" = "group" or "instance" the conv blocks
normalise each sample by groups of channels (``num_groups`` per layer, clipped to its width) or
by channel instead: statistics per sample, reduced over the spatial ranks only (a sample's
blocks), grid-invariant as well; module names stay (``enc0.1`` is the norm layer whatever it is).
Backward splits the concatenated gradient and
adds the skip part to the gradient of the encoder output.
"""
from __future__ import annotations

import numpy

from ..backend import array_module, asarray
from ..kernels import blas_held_single
from ..functional.losses import (
    cross_entropy_backward, cross_entropy_local_sums, dice_score_finish, dice_score_local_sums,
    mean_finish, soft_dice_backward, soft_dice_finish, soft_dice_local_sums, SoftmaxParts)
from ..nn.activation import ReLU
from ..nn.module import Sequential
from .base import (
    Layers, Model, check_choice, check_input_shape, check_number, check_positive_int, is_number,
    merge_config)

LOSSES = ("ce", "dice", "ce+dice")
NORMS = ("batch", "group", "instance")
#: the registry kind (refimpl/layers) of each "norm" in ``describe()``
NORM_KINDS = {"batch": "batch_norm3d", "group": "group_norm3d", "instance": "instance_norm3d"}


def norm_groups(config, width: int) -> int:
    """Statistics groups per sample of a normalisation layer of ``width`` channels (0: batch norm)."""
    return {"batch": 0, "group": min(config["num_groups"], width), "instance": width}[config["norm"]]


def first_split_level(config) -> int:
    """The first level whose conv blocks the model axis splits, the bottleneck being level
    ``levels``: ``levels - model_parallel_levels``, or ``levels + 1`` where ``model_parallel``
    is "none" (the model, ``describe()`` and the oracle's torch twin all split by it)."""
    if config.get("model_parallel", "none") == "none":
        return config["levels"] + 1
    return config["levels"] - config.get("model_parallel_levels", 0)


DEFAULTS = {
    "input_shape": (1, 128, 128, 128),   # (C, D, H, W)
    "num_classes": 3,
    "levels": 3,                         # poolings on the way down (and upsamplings back)
    "base_width": 32,                    # channels of level 0; level i has base_width * 2^i
    "loss": "ce",                        # "ce" | "dice" | "ce+dice"
    "class_weights": None,               # cross-entropy weight per class, or None
    "dice_eps": 1e-5,
    "bn_eps": 1e-5,                      # the eps of every normalisation layer (whichever "norm")
    "bn_momentum": 0.1,                  # batch norm's running statistics (group/instance keep none)
    # the conv blocks' normalisation: "batch" (statistics of the global batch), "group" (per sample
    # and group of channels) or "instance" (per sample and channel); docs/training.md
    "norm": "batch",
    # group norm's groups per layer, clipped to the layer's width (a level narrower than it has one
    # channel per group); every width must then be divisible by it
    "num_groups": 8,
    # the model axis Pm (grids of 5 entries): "filter" / "channel" split the bottleneck block
    # (its first conv filter-parallel, the second filter- or channel-parallel, batch norm on the
    # channel slices) and gather its output before the first upsampling; "none": every model
    # rank runs every layer (docs/model_parallel.md)
    "model_parallel": "none",
    # ... and the encoder and decoder blocks of the deepest K levels too, each as the bottleneck:
    # from a replicated input to its output gathered again (0: the bottleneck alone)
    "model_parallel_levels": 0,
}


def check_config(config: dict, where: str = "config") -> dict:
    """DEFAULTS updated by ``config`` (overrides), every key's type and range checked;
    ValueError of one line naming the key.  Pure: ``refimpl train`` checks its
    [model_config] with it before any rank builds a layer, the model on building."""
    config = merge_config(DEFAULTS, config, "unet3d", where)
    levels = check_positive_int(config, "levels", where=where)
    check_positive_int(config, "base_width", where=where)
    classes = check_positive_int(config, "num_classes", minimum=2, where=where)
    check_choice(config, "loss", LOSSES, where)
    weights = config["class_weights"]
    if weights is not None and not (isinstance(weights, (list, tuple)) and len(weights) == classes
                                    and all(is_number(w) and w >= 0 for w in weights)):
        raise ValueError(f"{where}['class_weights'] must be {classes} non-negative numbers (one per "
                         f"class) or unset, got {weights!r}")
    check_number(config, "dice_eps", lambda e: e > 0, "> 0", where)
    check_number(config, "bn_eps", lambda e: e > 0, "> 0", where)
    check_number(config, "bn_momentum", lambda m: 0.0 <= m <= 1.0, "in [0, 1]", where)
    check_choice(config, "model_parallel", ("none", "filter", "channel"), where)
    split_levels = check_positive_int(config, "model_parallel_levels", minimum=0, where=where)
    if split_levels > levels:
        raise ValueError(f"{where}['model_parallel_levels'] = {split_levels} exceeds levels = {levels}")
    check_choice(config, "norm", NORMS, where)
    num_groups = check_positive_int(config, "num_groups", where=where)
    if config["norm"] == "group":
        for width in (config["base_width"] * 2 ** i for i in range(levels + 1)):
            if width % min(num_groups, width):
                raise ValueError(f"{where}['num_groups'] = {num_groups} must divide every conv block's width "
                                 f"(base_width * 2^level, clipped to at most the width): {width} is not "
                                 f"divisible by {num_groups}")
    config["input_shape"] = check_input_shape(config, 2 ** levels, f"{levels} levels each halve it",
                                              where)
    return config


class UNet3D(Model):
    task = "segmentation"

    def __init__(self, config, grid, seed, dtype, global_batch=None):
        config = check_config(config)
        super().__init__(config, grid, dtype, global_batch)
        self.levels, base, self.num_classes = config["levels"], config["base_width"], config["num_classes"]
        self.terms = config["loss"].split("+")
        self.class_weights = None
        if config["class_weights"] is not None:
            self.class_weights = asarray(numpy.asarray(config["class_weights"], dtype=numpy.float64),
                                         dtype=self.dtype)
        self.input_shape = config["input_shape"]
        make = Layers(grid, numpy.random.default_rng(seed), dtype)

        norm, eps, momentum = config["norm"], config["bn_eps"], config["bn_momentum"]

        mode, split_from = config["model_parallel"], first_split_level(config)

        def conv_block(c_in, c_out, level):   # [Conv3d k=3 pad 1 -> BatchNorm3d (or the "norm") -> ReLU] x 2
            # the ReLUs write y over the norm's y (its backward reads its own x) and dx over a dy
            # no one else reads (a conv's dx, or the pool's dx + the skip's: a new array)
            groups = norm_groups(config, c_out)
            if level < split_from:
                return Sequential(
                    make.conv(c_in, c_out, 3, padding=1, bias=False),
                    make.norm(norm, c_out, groups, eps, momentum), ReLU(in_place=True, reuse_grad=True),
                    make.conv(c_out, c_out, 3, padding=1, bias=False),
                    make.norm(norm, c_out, groups, eps, momentum), ReLU(in_place=True, reuse_grad=True))
            # split over the model axis: from a replicated input, its output gathered again
            return Sequential(
                make.model_conv(c_in, c_out, 3, 1, mode, first=True, bias=False),   # (n, c_out/Pm, ...)
                make.model_norm(norm, c_out, groups, eps, momentum), ReLU(),
                make.model_conv(c_out, c_out, 3, 1, mode, first=False, bias=False),
                make.model_norm(norm, c_out, groups, eps, momentum), ReLU(),
                make.gather(c_out))                                                  # (n, c_out, ...)

        self.widths = [base * 2 ** i for i in range(self.levels + 1)]
        self.enc, self.pool, self.up, self.dec = [], [], [None] * self.levels, [None] * self.levels
        c_in = self.input_shape[0]
        for i in range(self.levels):                  # registration = forward order (for bucketing)
            self.enc.append(self.add_module(f"enc{i}", conv_block(c_in, self.widths[i], i)))
            self.pool.append(self.add_module(f"pool{i}", make.max_pool(2)))
            c_in = self.widths[i]
        # the widest, smallest activations: split over the model axis (level L >= split_from) unless "none"
        self.bottleneck = self.add_module("bottleneck", conv_block(c_in, self.widths[-1], self.levels))
        self.first_conv = self.enc[0][0]
        self.needs_input_grad = False
        for i in reversed(range(self.levels)):
            self.up[i] = self.add_module(f"up{i}", make.conv_transpose(self.widths[i + 1],
                                                                       self.widths[i], 2, 2))
            self.dec[i] = self.add_module(f"dec{i}", conv_block(2 * self.widths[i], self.widths[i], i))
        self.out = self.add_module("out", make.conv(self.widths[0], self.num_classes, 1))
        self.setup_layers(self.children())   # extents: S -> S/2^L -> S (pure index math)

    @classmethod
    def describe(cls, config) -> list[dict]:
        """The layers this class builds for ``config``, in forward order, without building them:
        entries as ``CosmoFlow.describe`` (refimpl/models/cosmoflow.py) gives them."""
        from .cosmoflow import _layer
        cfg = check_config(config)
        levels, base, classes = cfg["levels"], cfg["base_width"], cfg["num_classes"]
        c, dhw = cfg["input_shape"][0], tuple(cfg["input_shape"][1:])
        mode = cfg["model_parallel"]
        norm_kind = NORM_KINDS[cfg["norm"]]
        out = []

        def block(prefix, c_in, c_out, dhw, first_grad, split=("none", "none")):
            for j, (ci, sp) in enumerate(zip((c_in, c_out), split)):
                split_in = j == 1 and split[0] != "none"
                out.append(_layer(f"{prefix}.{3 * j}", "conv3d", ci, c_out, dhw, dhw, (3, 3, 3), (1, 1, 1),
                                  (1, 1, 1), weights=c_out * ci * 27, split=sp, split_in=split_in,
                                  input_grad=first_grad or j > 0))
                bn_split = sp != "none"
                out.append(_layer(f"{prefix}.{3 * j + 1}", norm_kind, c_out, c_out, dhw, dhw,
                                  weights=2 * c_out, split_in=bn_split, split="channel" if bn_split else "none",
                                  **({"num_groups": norm_groups(cfg, c_out)} if cfg["norm"] == "group" else {})))
                out.append(_layer(f"{prefix}.{3 * j + 2}", "relu", c_out, c_out, dhw, dhw, split_in=bn_split))

        widths = [base * 2 ** i for i in range(levels + 1)]
        shapes = [tuple(n // 2 ** i for n in dhw) for i in range(levels + 1)]
        split_from = first_split_level(cfg)
        split = ("filter-replicated", "channel" if mode == "channel" else "filter")

        def level_block(prefix, level, c_in, first_grad):
            """A conv block of ``level``, split as the model's (and its gather) from ``split_from`` on."""
            if level < split_from:
                block(prefix, c_in, widths[level], shapes[level], first_grad)
                return
            block(prefix, c_in, widths[level], shapes[level], first_grad, split)
            out.append(_layer(f"{prefix}.6", "gather", widths[level], widths[level], shapes[level],
                              shapes[level], split_in=True))

        c_in = c
        for i in range(levels):
            level_block(f"enc{i}", i, c_in, first_grad=i > 0)
            out.append(_layer(f"pool{i}", "max_pool3d", widths[i], widths[i], shapes[i], shapes[i + 1], (2, 2, 2),
                              (2, 2, 2)))
            c_in = widths[i]
        level_block("bottleneck", levels, c_in, True)
        c_in = widths[levels]
        for i in reversed(range(levels)):
            out.append(_layer(f"up{i}", "conv_transpose3d", c_in, widths[i], shapes[i + 1], shapes[i], (2, 2, 2),
                              (2, 2, 2), weights=c_in * widths[i] * 8 + widths[i]))
            level_block(f"dec{i}", i, 2 * widths[i], True)
            c_in = widths[i]
        out.append(_layer("out", "conv3d", c_in, classes, shapes[0], shapes[0],
                          weights=classes * c_in + classes))
        return out

    def local_target(self, target_global):
        """(B, D, H, W) labels -> this rank's (B/Pn, local block)."""
        return target_global[(self.local_samples(target_global.shape[0]),)
                             + tuple(self.local_block(target_global.shape[1:]))]

    @blas_held_single()
    def forward(self, x_local):
        """(n_local, C, local block) -> (n_local, K, local block) class logits."""
        self.check_input(x_local)
        xp = array_module(x_local)
        x, skips = x_local, []
        for enc, pool in zip(self.enc, self.pool):
            x = enc.forward(x)                        # (n, w_i, block at level i)
            skips.append(x)
            x = pool.forward(x)                       # (n, w_i, block at level i+1)
        x = self.bottleneck.forward(x)                # (n, w_L, block at level L)
        for i in reversed(range(self.levels)):
            up = self.up[i].forward(x)                # (n, w_i, block at level i)
            if up.shape != skips[i].shape:            # both: balanced blocks of one global extent
                raise RuntimeError(f"level {i}: upsampled block {up.shape} != skip block {skips[i].shape}")
            x = self.dec[i].forward(xp.concatenate([up, skips[i]], axis=1))   # (n, w_i, ...)
        return self.out.forward(x)                    # (n, K, local block)

    @blas_held_single()
    def backward(self, dout_local):
        xp = array_module(dout_local)
        d = self.out.backward(dout_local)
        skip_grads = [None] * self.levels
        for i in range(self.levels):                  # decoder in reverse: level 0 first
            d_cat = self.dec[i].backward(d)           # (n, 2 w_i, ...) = (d up, d skip)
            w = self.widths[i]
            skip_grads[i] = d_cat[:, w:]
            d = self.up[i].backward(xp.ascontiguousarray(d_cat[:, :w]))
        d = self.bottleneck.backward(d)
        for i in reversed(range(self.levels)):
            d = self.pool[i].backward(d) + skip_grads[i]   # the encoder output feeds pool and skip
            d = self.enc[i].backward(d)
        return d

    def loss(self, out_local, target_local):
        """(loss, Pn * dloss/dout, {"dice": mean hard Dice}) over the global batch and every voxel.

        One allreduce over the whole grid carries every sum: cross-entropy
        [sum w, sum w nll], soft Dice [I_k, P_k, T_k] and the hard Dice counts.
        """
        xp = array_module(out_local)
        k = self.num_classes
        parts = SoftmaxParts(out_local, target_local)   # one softmax (and label check) for every piece
        pieces = [dice_score_local_sums(out_local, target_local, parts).reshape(-1)]   # (3K,)
        if "ce" in self.terms:
            pieces.append(cross_entropy_local_sums(out_local, target_local, self.class_weights,
                                                   parts))                             # (2,)
        if "dice" in self.terms:
            pieces.append(soft_dice_local_sums(out_local, target_local, parts).reshape(-1))   # (3K,)
        sums = self.reduce_sums(xp.concatenate(pieces), over="grid")
        scale = float(self.data_parallel)
        loss, dout, at = 0.0, None, 3 * k
        if "ce" in self.terms:
            ce_sums, at = sums[at:at + 2], at + 2
            loss += mean_finish(ce_sums)
            dout = cross_entropy_backward(out_local, target_local, ce_sums, self.class_weights, scale,
                                          parts)
        if "dice" in self.terms:
            dice_sums = sums[at:at + 3 * k].reshape(3, k)
            eps = float(self.config["dice_eps"])
            loss += soft_dice_finish(dice_sums, eps)
            g = soft_dice_backward(out_local, target_local, dice_sums, eps, scale, parts)
            if dout is None:
                dout = g
            else:
                dout += g
        dice = float(numpy.mean(dice_score_finish(sums[:3 * k].reshape(3, k))))
        return loss, dout, {"dice": dice}


__all__ = ["UNet3D", "DEFAULTS", "LOSSES", "NORMS", "check_config", "first_split_level", "norm_groups"]
