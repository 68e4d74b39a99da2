"""Named configurations: ``PRESETS[model][preset] -> config`` (keys as in each model's DEFAULTS).

- tiny: seconds on one CPU core, for tests and tutorials (16^3 inputs, a few channels);
- small: a laptop-sized run (64^3);
- mlperf / default: the published sizes (CosmoFlow: the MLPerf HPC reference network,
  github.com/mlcommons/hpc cosmoflow/models/cosmoflow.py + configs/cosmo.yaml: 4 x 128^3,
  5 blocks of Conv3D(kernel 2, padding 'same') of 32 * 2^i channels, dense 128 / 64,
  dropout 0.5; U-Net: 3 levels of 32 * 2^i channels on 128^3 volumes, 3 classes as in
  Cicek et al.);
- mlperf-k3: CosmoFlow's sizes with kernel 3, padding 1 (what ``mlperf`` was before it followed
  the reference's kernel 2);
- tiny-same: ``tiny`` with the reference's kernel 2 'same' (TensorFlow's rule: 0 before, 1 after),
  for tests of the even-kernel padding on every grid.
"""
from __future__ import annotations

PRESETS = {
    "cosmoflow": {
        "tiny": {"input_shape": (4, 16, 16, 16), "conv_size": 4, "n_conv_layers": 2,
                 "fc1_size": 32, "fc2_size": 16, "dropout": 0.5},
        "small": {"input_shape": (4, 64, 64, 64), "conv_size": 16, "n_conv_layers": 4,
                  "fc1_size": 128, "fc2_size": 64, "dropout": 0.5},
        "tiny-same": {"input_shape": (4, 16, 16, 16), "conv_size": 4, "n_conv_layers": 2, "kernel_size": 2,
                      "fc1_size": 32, "fc2_size": 16, "dropout": 0.5},
        "mlperf": {"input_shape": (4, 128, 128, 128), "conv_size": 32, "n_conv_layers": 5, "kernel_size": 2,
                   "fc1_size": 128, "fc2_size": 64, "dropout": 0.5},
        "mlperf-k3": {"input_shape": (4, 128, 128, 128), "conv_size": 32, "n_conv_layers": 5, "kernel_size": 3,
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
