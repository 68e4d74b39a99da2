"""BatchNorm3d: per-channel normalisation with learnable scale/shift and running stats.

Training mode normalises with the batch statistics (biased variance) and
updates ``running_mean``/``running_var`` (unbiased variance), as PyTorch; eval
mode normalises with the running statistics.  The per-channel sums pass
through ``global_sums`` in both directions (the element count, once, through
``global_count``): the identity here, an Allreduce over the spatial (and
optionally data) group in the partitioned subclass, which is all it takes to
make the statistics those of the unpartitioned tensor.  The
running mean is the shift of the sums (see refimpl.functional.batch_norm): it is
the same on every rank, so the shifted sums can be added across ranks.
"""
from __future__ import annotations

from ..backend import TRAIN_DTYPE
from ..functional.batch_norm import (
    batch_norm3d_backward, batch_norm_backward, batch_norm_backward_local_sums, batch_norm_forward,
    batch_norm_local_sums, batch_norm_stats, update_running_stats)
from .init import constant
from .module import Module


class BatchNorm3d(Module):
    def __init__(self, num_features, eps=1e-5, momentum=0.1, *, dtype=TRAIN_DTYPE):
        super().__init__()
        if isinstance(num_features, bool) or int(num_features) != num_features or num_features < 1:
            raise ValueError(f"num_features must be a positive integer, got {num_features!r}")
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"momentum must be in [0, 1], got {momentum!r}")
        self.num_features, self.eps, self.momentum = int(num_features), float(eps), float(momentum)
        c = self.num_features
        self.weight = self.add_parameter("weight", constant((c,), 1.0, dtype))
        self.bias = self.add_parameter("bias", constant((c,), 0.0, dtype))
        self.running_mean = self.add_buffer("running_mean", constant((c,), 0.0, dtype))
        self.running_var = self.add_buffer("running_var", constant((c,), 1.0, dtype))

    def global_count(self, count: int) -> int:
        """Number of elements per channel the statistics cover (identity on one process)."""
        return count

    def global_sums(self, *sums):
        """Per-channel sums over every element the statistics cover (identity on one process)."""
        return sums

    def forward(self, x):
        if x.ndim == 5 and x.shape[1] != self.num_features:
            raise ValueError(f"x has {x.shape[1]} channels but BatchNorm3d expects {self.num_features}")
        gamma, beta = self.weight.data, self.bias.data
        if not self.training:
            inv_std = 1.0 / (self.running_var.astype("float64") + self.eps) ** 0.5
            y, cache = batch_norm_forward(x, self.running_mean, inv_std, gamma, beta)
            self._save(cache, None)
            return y
        shift = self.running_mean
        count, s1, s2 = batch_norm_local_sums(x, shift)
        count = self.global_count(count)
        s1, s2 = self.global_sums(s1, s2)
        if count < 2:
            raise ValueError(f"training BatchNorm3d needs more than one value per channel, got {count}")
        mean, var, inv_std = batch_norm_stats(count, s1, s2, self.eps, shift)
        update_running_stats(self.running_mean, self.running_var, mean, var, count, self.momentum)
        y, cache = batch_norm_forward(x, mean, inv_std, gamma, beta)
        self._save(cache, count)
        return y

    def backward(self, dy):
        cache, count = self._saved()
        if count is None:   # eval mode: the statistics are constants
            dx, dgamma, dbeta = batch_norm3d_backward(dy, (cache, None))
        else:
            local = batch_norm_backward_local_sums(dy, cache)
            sum_dy, sum_dy_xhat = self.global_sums(*local)
            dx, dgamma, dbeta = batch_norm_backward(dy, cache, sum_dy, sum_dy_xhat, count,
                                                    local_sums=local)
        self.weight.accumulate_grad(dgamma)
        self.bias.accumulate_grad(dbeta)
        return dx

    def extra_repr(self):
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}"


__all__ = ["BatchNorm3d"]
