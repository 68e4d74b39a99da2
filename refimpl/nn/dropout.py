"""Dropout layer with a mask that depends only on (seed, step, global element index).

Each training forward call draws a fresh mask with seed ``fold_seed(seed, step)``
and increments ``step``; eval mode is the identity.  ``mask_block(x)`` says
which block of which global tensor ``x`` is: the whole tensor here, the rank's
block (global shape + index ranges) in a partitioned subclass, which then draws
exactly the slice of the unpartitioned mask without any message.
"""
from __future__ import annotations

from ..functional.dropout import dropout, dropout_backward, fold_seed
from .module import Module


class Dropout(Module):
    def __init__(self, p=0.5, seed=0):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"p must be in [0, 1], got {p!r}")
        self.p, self.seed, self.step = float(p), int(seed), 0

    def mask_block(self, x):
        """(global_shape, index_ranges) of x: here x is the whole tensor."""
        return tuple(x.shape), None

    def forward(self, x):
        if not self.training or self.p == 0.0:
            self._save(None)
            return x
        global_shape, index_ranges = self.mask_block(x)
        y, mask = dropout(x, self.p, fold_seed(self.seed, self.step), global_shape, index_ranges)
        self.step += 1
        self._save(mask)
        return y

    def backward(self, dy):
        (mask,) = self._saved()
        return dy if mask is None else dropout_backward(dy, mask, self.p)

    def extra_repr(self):
        return f"p={self.p}, seed={self.seed}"


__all__ = ["Dropout"]
