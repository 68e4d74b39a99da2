"""GroupNorm3d and InstanceNorm3d: per-sample normalisation with a learnable scale/shift.

Statistics per (sample, group of C/G channels) over (C/G, D, H, W), the biased variance,
as ``torch.nn.GroupNorm``; ``InstanceNorm3d`` is the same layer with one group per channel
(``torch.nn.InstanceNorm3d(affine=True)``, statistics from the input in training and
evaluation alike: no running statistics are kept, so ``eval()`` changes nothing).

As in ``BatchNorm3d``, the sums pass through ``global_sums`` in both directions (the
element count, once, through ``global_count``): the identity here, an Allreduce over the
spatial group in the partitioned subclasses (``nn/spatial.py``), which makes the
statistics those of the unpartitioned tensor.  The sums are per sample, so the ranks that
hold other samples (data parallelism) never take part.  No shift: group norm has no running
mean to centre the sums with (refimpl/functional/group_norm.py, "Numerical scheme").
"""
from __future__ import annotations

from ..backend import TRAIN_DTYPE
from ..functional.group_norm import (
    check_num_groups, group_norm_backward, group_norm_backward_local_sums, group_norm_backward_row_sums,
    group_norm_forward, group_norm_local_sums, group_norm_stats)
from .init import constant
from .module import Module


def _positive_int(value, name):
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


class GroupNorm3d(Module):
    """Group norm of ``num_channels`` channels in ``num_groups`` groups (G must divide C)."""

    def __init__(self, num_groups, num_channels, eps=1e-5, *, dtype=TRAIN_DTYPE):
        super().__init__()
        self.num_channels = _positive_int(num_channels, "num_channels")
        self.num_groups = check_num_groups(num_groups, self.num_channels)
        self.eps = float(eps)
        if not self.eps >= 0:
            raise ValueError(f"eps must be >= 0, got {eps!r}")
        c = self.num_channels
        self.weight = self.add_parameter("weight", constant((c,), 1.0, dtype))
        self.bias = self.add_parameter("bias", constant((c,), 0.0, dtype))

    def global_count(self, count: int) -> int:
        """Values per (sample, group) the statistics cover (identity on one process)."""
        return count

    def global_sums(self, *sums):
        """Per-(sample, group) sums over every value the statistics cover (identity here)."""
        return sums

    def forward(self, x):
        if x.ndim == 5 and x.shape[1] != self.num_channels:
            raise ValueError(f"x has {x.shape[1]} channels but {type(self).__name__} expects {self.num_channels}")
        count, s1, s2 = group_norm_local_sums(x, self.num_groups)   # (N, G) float64 each
        count = self.global_count(count)
        s1, s2 = self.global_sums(s1, s2)
        if count < 1:
            raise ValueError(f"{type(self).__name__} needs at least one value per group, got an empty input")
        mean, _, inv_std = group_norm_stats(count, s1, s2, self.eps)
        y, cache = group_norm_forward(x, self.num_groups, mean, inv_std, self.weight.data, self.bias.data)
        self._save(cache, count)
        return y

    def backward(self, dy):
        cache, count = self._saved()
        rows = group_norm_backward_row_sums(dy, cache)              # (N, C) float64 each
        sum_g, sum_g_xhat = self.global_sums(*group_norm_backward_local_sums(dy, cache, row_sums=rows))
        dx, dgamma, dbeta = group_norm_backward(dy, cache, sum_g, sum_g_xhat, count, row_sums=rows)
        self.weight.accumulate_grad(dgamma)      # local contributions: summed over spatial ranks
        self.bias.accumulate_grad(dbeta)
        return dx

    def extra_repr(self):
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}"


class InstanceNorm3d(GroupNorm3d):
    """Instance norm: group norm with one group per channel (always affine, no running stats)."""

    def __init__(self, num_features, eps=1e-5, *, dtype=TRAIN_DTYPE):
        num_features = _positive_int(num_features, "num_features")
        super().__init__(num_features, num_features, eps, dtype=dtype)

    @property
    def num_features(self) -> int:
        return self.num_channels

    def extra_repr(self):
        return f"{self.num_channels}, eps={self.eps}"


__all__ = ["GroupNorm3d", "InstanceNorm3d"]
