"""A trainable array and its gradient.

Layers own ``Parameter`` objects; backward *accumulates* into ``grad`` and then
calls ``mark_ready()`` so that gradient synchronisation (refimpl.parallel,
bucketed allreduce overlapped with backward) can start reducing a bucket as
soon as its last gradient has been written.
"""
from __future__ import annotations


class Parameter:
    __slots__ = ("data", "grad", "name", "on_grad_ready", "spatial_replicated", "shard")

    def __init__(self, data, name: str = ""):
        self.data = data
        self.grad = None
        self.name = name
        self.on_grad_ready = None  # callback(param), set by gradient synchronisation
        self.spatial_replicated = False
        self.shard = None          # model-parallel: (axis, start, stop, full length) of the whole

    def accumulate_grad(self, g, fresh=False) -> None:
        """grad += g (grad starts as None after zero_grad).  ``fresh=True``: ``g`` is a new
        array no one else holds (a GEMM's result), kept as the first gradient without a copy;
        otherwise it is copied, since the caller may reuse its buffer."""
        if g.shape != self.data.shape:
            raise ValueError(f"gradient of {self.name or 'parameter'} has shape {g.shape}, "
                             f"expected {self.data.shape}")
        if self.grad is None:
            self.grad = g if fresh else g.copy()
        else:
            self.grad += g
        if self.on_grad_ready is not None:
            self.on_grad_ready(self)

    def zero_grad(self) -> None:
        self.grad = None

    @property
    def shape(self):
        return self.data.shape

    def __repr__(self) -> str:
        return f"Parameter({self.name!r}, shape={tuple(self.data.shape)}, dtype={self.data.dtype})"
