"""PyTorch twins of refimpl's models: the same layers, the same module and parameter names.

One place for them: ``scripts/bench_train.py`` times them against refimpl, and
``refimpl oracle trace run-torch`` runs one training step of them as a peer under test.
Each twin names its modules as refimpl's model does (``features.0``, ``head.0``,
``enc0.3``, ``up1``, ...), so a state dict moves between the two by name and a forward
hook on a twin's module reports under the canonical layer name of the trace.

torch is imported here only, and lazily (inside the functions): refimpl never needs it.
A twin computes globally; for a model-parallel config (``model_parallel`` "filter" or
"channel") it carries the split model's extra module names: its ``gather`` layers are
identities (``nn.Identity``), as they are unpartitioned, so the head's later modules
keep the split model's indices (``head.7``).
"""
from __future__ import annotations


def _split(config: dict) -> bool:
    """Whether the model axis splits the model (its names then include the gathers)."""
    return config.get("model_parallel", "none") != "none"


def torch_cosmoflow(config: dict, dropout_masks=None):
    """refimpl.models.CosmoFlow in torch.nn: ``features`` (conv 'same', LeakyReLU, max pool 2; with
    ``global_pool`` "avg" an AvgPool3d over the last block's extent) and ``head`` (flatten + dense, LeakyReLU, dropout, dense, LeakyReLU, dropout, dense, 1.2 tanh).

    ``config``: a full CosmoFlow config (``refimpl.models.cosmoflow.check_config``).
    ``dropout_masks``: None for torch's own dropout, or a dict {"head.2": mask, "head.5": mask}
    of keep-masks (the trace's, refimpl's counter-based ones) that the dropout layers apply."""
    import torch
    from torch import nn
    slope, k = float(config.get("leaky_slope", 0.3)), config.get("kernel_size", 3)
    c_in, layers = config["input_shape"][0], []
    for i in range(config["n_conv_layers"]):
        c_out = config["conv_size"] * 2 ** i
        # 'same': odd k pads k // 2 per side; even k pads k - 1, the odd cell after (torch's rule too)
        layers += [nn.Conv3d(c_in, c_out, k, padding="same"), nn.LeakyReLU(slope), nn.MaxPool3d(2)]
        c_in = c_out
    if _split(config):
        layers.append(nn.Identity())                     # features.{3L}: the gather of the split blocks
    final = [n // 2 ** config["n_conv_layers"] for n in config["input_shape"][1:]]
    if config.get("global_pool", "none") == "avg":       # a window of the whole extent: each channel's mean
        layers.append(nn.AvgPool3d(final))
        final = [1, 1, 1]
    p = float(config["dropout"])

    class ScaledTanh(nn.Module):
        def __init__(self, scale):
            super().__init__()
            self.scale = scale

        def forward(self, t):
            return self.scale * torch.tanh(t)

    class FlattenLinear(nn.Linear):
        """Flatten (C, D, H, W) + dense: one module, as refimpl's (its name is ``head.0``)."""

        def forward(self, t):
            return super().forward(torch.flatten(t, 1))

    class MaskDropout(nn.Module):
        """Inverted dropout with a given keep-mask (refimpl's), so both draw the same."""

        def __init__(self, mask):
            super().__init__()
            self.mask = mask

        def forward(self, t):
            return t * self.mask.to(t.dtype) / (1.0 - p) if self.training and p > 0 else t

    def dropout(name):
        if dropout_masks is None:
            return nn.Dropout(p)
        return MaskDropout(torch.as_tensor(dropout_masks[name]))

    n_flat = c_in * final[0] * final[1] * final[2]
    net = nn.Module()
    net.features = nn.Sequential(*layers)
    gather = [nn.Identity()] if _split(config) else []   # head.6: the gather of the 1.5-D layers' features
    net.head = nn.Sequential(FlattenLinear(n_flat, config["fc1_size"]), nn.LeakyReLU(slope), dropout("head.2"),
                             nn.Linear(config["fc1_size"], config["fc2_size"]), nn.LeakyReLU(slope),
                             dropout("head.5"), *gather, nn.Linear(config["fc2_size"], config["num_outputs"]),
                             ScaledTanh(float(config.get("output_scale", 1.2))))
    net.forward = lambda x: net.head(net.features(x))
    return net


def torch_unet3d(config: dict):
    """refimpl.models.UNet3D in torch.nn, with its module names: ``enc{i}`` / ``dec{i}``
    ([Conv3d k3 pad 1 no bias, norm, ReLU] x 2), ``pool{i}``, ``bottleneck``, ``up{i}``
    (ConvTranspose3d k2 s2) and ``out`` (Conv3d k1); the norm is the config's ``norm``:
    BatchNorm3d, GroupNorm (``num_groups`` clipped to the width) or InstanceNorm3d (affine).
    A block the model axis splits (the bottleneck, and the deepest ``model_parallel_levels``
    levels' ``enc`` / ``dec``) ends in its gather's name (``.6``, an identity here)."""
    import torch
    from torch import nn

    from ..models.unet3d import first_split_level, norm_groups
    eps, momentum = float(config.get("bn_eps", 1e-5)), float(config.get("bn_momentum", 0.1))

    def norm(c):
        kind = config.get("norm", "batch")
        if kind == "group":
            return nn.GroupNorm(norm_groups(config, c), c, eps)
        if kind == "instance":
            return nn.InstanceNorm3d(c, eps, affine=True)
        return nn.BatchNorm3d(c, eps, momentum)

    def conv_block(c_in, c_out, gather=False):
        return nn.Sequential(nn.Conv3d(c_in, c_out, 3, padding=1, bias=False),
                             norm(c_out), nn.ReLU(),
                             nn.Conv3d(c_out, c_out, 3, padding=1, bias=False),
                             norm(c_out), nn.ReLU(),
                             *([nn.Identity()] if gather else []))       # <block>.6: the split's gather

    levels = config["levels"]
    widths = [config["base_width"] * 2 ** i for i in range(levels + 1)]
    split_from = first_split_level(config)

    class UNet3D(nn.Module):
        def __init__(self):
            super().__init__()
            c_in = config["input_shape"][0]
            for i in range(levels):                           # registration = refimpl's order
                setattr(self, f"enc{i}", conv_block(c_in, widths[i], gather=i >= split_from))
                setattr(self, f"pool{i}", nn.MaxPool3d(2))
                c_in = widths[i]
            self.bottleneck = conv_block(c_in, widths[levels], gather=levels >= split_from)
            for i in reversed(range(levels)):
                setattr(self, f"up{i}", nn.ConvTranspose3d(widths[i + 1], widths[i], 2, stride=2))
                setattr(self, f"dec{i}", conv_block(2 * widths[i], widths[i], gather=i >= split_from))
            self.out = nn.Conv3d(widths[0], config["num_classes"], 1)

        def forward(self, x):                                         # (B, C, S, S, S)
            skips = []
            for i in range(levels):
                skips.append(getattr(self, f"enc{i}")(x))            # (B, w_i, S/2^i, ...)
                x = getattr(self, f"pool{i}")(skips[-1])
            x = self.bottleneck(x)                                    # (B, w_L, S/2^L, ...)
            for i in reversed(range(levels)):
                up = getattr(self, f"up{i}")(x)
                x = getattr(self, f"dec{i}")(torch.cat([up, skips[i]], dim=1))   # (B, w_i, S/2^i, ...)
            return self.out(x)                                        # (B, K, S, S, S)

    return UNet3D()


def torch_model(name: str, config: dict, dropout_masks=None):
    """The twin of refimpl's model ``name`` ("cosmoflow" | "unet3d") for a full ``config``."""
    if name == "cosmoflow":
        return torch_cosmoflow(config, dropout_masks)
    if name == "unet3d":
        return torch_unet3d(config)
    raise ValueError(f"no PyTorch twin of model {name!r} (cosmoflow, unet3d)")


def load_parameters(net, params: dict) -> None:
    """Copy ``params`` ({refimpl parameter name: array}) into the twin, by name; every
    parameter of the twin must be given (ValueError naming the missing and the extra)."""
    import torch
    theirs = dict(net.named_parameters())
    missing, extra = sorted(set(theirs) - set(params)), sorted(set(params) - set(theirs))
    if missing or extra:
        raise ValueError(f"parameters do not match the PyTorch twin: missing {missing}, unknown {extra}")
    with torch.no_grad():
        for name, tensor in theirs.items():
            tensor.copy_(torch.as_tensor(params[name]))


__all__ = ["torch_cosmoflow", "torch_unet3d", "torch_model", "load_parameters"]
