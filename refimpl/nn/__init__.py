"""Layers that own parameters and call ``refimpl.functional`` (+ ``refimpl.parallel``).

``forward(x)`` keeps what ``backward(dy) -> dx`` needs; backward accumulates the
parameter gradients.  ``refimpl.nn.spatial`` holds the spatially partitioned
versions (halo exchange around the same local math).
"""
import sys

from .activation import LeakyReLU, ReLU, ScaledTanh, Tanh
from .batch_norm import BatchNorm3d
from .conv import Conv3d, ConvTranspose3d
from .dropout import Dropout
from .linear import Flatten, FlattenLinear, Linear
from .module import Module, Sequential
from .norm import GroupNorm3d, InstanceNorm3d
from .parameter import Parameter
from .pooling import AvgPool3d, MaxPool3d

__all__ = [name for name, value in dict(globals()).items()
           if not name.startswith("_") and not isinstance(value, type(sys))]
