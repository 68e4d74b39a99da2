"""Named configurations: ``PRESETS[model][preset] -> config`` (keys as in each model's DEFAULTS).

- tiny: seconds on one CPU core, for tests and tutorials (16^3 inputs, a few channels);
- small: a laptop-sized run (64^3);
- mlperf / default: the published sizes (CosmoFlow: MLPerf HPC, 4 x 128^3, 5 conv
  blocks of 32 * 2^i channels, dense 128 / 64, dropout 0.5; U-Net: 3 levels of
  32 * 2^i channels on 128^3 volumes, 3 classes as in Cicek et al.).
"""
from __future__ import annotations

PRESETS = {
    "cosmoflow": {
        "tiny": {"input_shape": (4, 16, 16, 16), "conv_size": 4, "n_conv_layers": 2,
                 "fc1_size": 32, "fc2_size": 16, "dropout": 0.5},
        "small": {"input_shape": (4, 64, 64, 64), "conv_size": 16, "n_conv_layers": 4,
                  "fc1_size": 128, "fc2_size": 64, "dropout": 0.5},
        "mlperf": {"input_shape": (4, 128, 128, 128), "conv_size": 32, "n_conv_layers": 5,
                   "fc1_size": 128, "fc2_size": 64, "dropout": 0.5},
    },
    "unet3d": {
        "tiny": {"input_shape": (1, 16, 16, 16), "levels": 2, "base_width": 4, "num_classes": 3},
        "small": {"input_shape": (1, 64, 64, 64), "levels": 3, "base_width": 8, "num_classes": 3},
        "default": {"input_shape": (1, 128, 128, 128), "levels": 3, "base_width": 32,
                    "num_classes": 3, "loss": "ce+dice"},
    },
}

__all__ = ["PRESETS"]
