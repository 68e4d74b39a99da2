"""Linear (fully connected) and Flatten layers."""
from __future__ import annotations

from ..backend import TRAIN_DTYPE
from ..functional.linear import flatten, flatten_backward, linear, linear_backward
from .init import check_rng, uniform_fan_in
from .module import Module


class Linear(Module):
    """y = x @ weight.T + bias; weight (out, in) ~ U(-1/sqrt(in), 1/sqrt(in)), bias likewise."""

    def __init__(self, in_features, out_features, bias=True, *, rng, dtype=TRAIN_DTYPE):
        super().__init__()
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(v, bool) or int(v) != v or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        check_rng(rng)
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.weight = self.add_parameter(
            "weight", uniform_fan_in(rng, (self.out_features, self.in_features), self.in_features, dtype))
        self.bias = self.add_parameter(
            "bias", uniform_fan_in(rng, (self.out_features,), self.in_features, dtype)) if bias else None

    def forward(self, x):
        self._save(x)
        return linear(x, self.weight.data, None if self.bias is None else self.bias.data)

    def backward(self, dy):
        (x,) = self._saved()
        dx, dw, db = linear_backward(dy, x, self.weight.data)
        self.weight.accumulate_grad(dw, fresh=True)        # dy^T x and sum(dy): new arrays
        if self.bias is not None:
            self.bias.accumulate_grad(db, fresh=True)
        return dx

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class FlattenLinear(Linear):
    """Flatten (C, D, H, W) + dense in one layer: the first dense layer after the conv stack.

    One module (not Flatten then Linear) so that its parameter names are those of its
    spatially partitioned twin (``nn.spatial.SpatialFlattenLinear``) and a checkpoint
    moves between grids unchanged.  The bias is ``spatial_replicated``: on a grid it is
    computed once per spatial group, like the rest of the dense head.
    """

    def __init__(self, in_channels, in_features, out_features, bias=True, *, rng, dtype=TRAIN_DTYPE):
        super().__init__(in_features, out_features, bias, rng=rng, dtype=dtype)
        self.in_channels = int(in_channels)
        if self.bias is not None:
            self.bias.spatial_replicated = True

    def setup(self, global_in_shape):
        d, h, w = global_in_shape
        if self.in_channels * d * h * w != self.in_features:
            raise ValueError(f"in_features {self.in_features} != channels {self.in_channels} x "
                             f"global extent {tuple(global_in_shape)}")
        return (self.out_features,)

    def forward(self, x):
        self.x_shape = x.shape                         # (N, C, D, H, W)
        return super().forward(flatten(x))             # (N, out)

    def backward(self, dy):
        return flatten_backward(super().backward(dy), self.x_shape)


class Flatten(Module):
    """(N, ...) -> (N, prod(...)), as torch.nn.Flatten()."""

    def forward(self, x):
        self._save(x.shape)
        return flatten(x)

    def backward(self, dy):
        (shape,) = self._saved()
        return flatten_backward(dy, shape)


__all__ = ["Linear", "FlattenLinear", "Flatten"]
