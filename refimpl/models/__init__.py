"""CosmoFlow and 3D U-Net on any process grid.

``build_model(name, config, grid, seed)`` gives the same network (same weights,
same dropout masks, same batch-norm statistics) on every process grid: with
``grid=None`` the plain single-process model, otherwise each rank holds its
block of every activation (see refimpl/models/base.py for the batch layout and
the loss scaling that makes the synchronised gradients those of the global
batch).
"""
from __future__ import annotations

from ..backend import TRAIN_DTYPE
from . import cosmoflow, unet3d
from .cosmoflow import CosmoFlow
from .presets import PRESETS
from .unet3d import UNet3D

MODELS = {"cosmoflow": CosmoFlow, "unet3d": UNet3D}
DEFAULTS = {"cosmoflow": cosmoflow.DEFAULTS, "unet3d": unet3d.DEFAULTS}   # every config key, per model
CHECK_CONFIG = {"cosmoflow": cosmoflow.check_config, "unet3d": unet3d.check_config}   # (config, where) -> full config


def build_model(name: str, config, grid=None, seed: int = 0, dtype=TRAIN_DTYPE,
                global_batch: int | None = None):
    """The model ``name`` ("cosmoflow" | "unet3d") built from ``config``.

    ``config``: a dict of overrides of the model's DEFAULTS (unknown keys raise
    ValueError), or a preset name from ``PRESETS[name]``.  ``grid``: a
    ProcessGrid or None.  ``global_batch``: if given, checked to be divisible by
    the grid's Pn (ValueError on every rank, before any message) and enforced on
    every forward.
    """
    config = resolve_config(name, config)
    if isinstance(seed, bool) or int(seed) != seed or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    return MODELS[name](config, grid, int(seed), dtype, global_batch)


def resolve_config(name: str, config) -> dict:
    """A copy of ``config`` (a dict of overrides, or a preset name of model ``name``);
    ValueError for an unknown model or preset."""
    if name not in MODELS:
        raise ValueError(f"model name must be one of {sorted(MODELS)}, got {name!r}")
    if isinstance(config, str):
        if config not in PRESETS[name]:
            raise ValueError(f"no {name} preset {config!r}; presets: {sorted(PRESETS[name])}")
        config = PRESETS[name][config]
    return dict(config)


__all__ = ["PRESETS", "MODELS", "DEFAULTS", "CHECK_CONFIG", "build_model", "resolve_config", "CosmoFlow", "UNet3D"]
