"""Mini-batches for one rank: a global batch split over the data-parallel group.

Every epoch has its own permutation of the N samples, drawn from
``default_rng([seed, epoch])``: the same on every rank, so each rank knows,
without a message, which samples it reads.  Step ``t`` of an epoch takes
permutation positions ``[t B, (t + 1) B)`` (the global batch); data-parallel
rank ``n`` of ``Pn`` takes its ``partition.block_range(B, Pn, n)`` part of
them (uneven when Pn does not divide B: weight losses by the local count).
The last partial global batch is dropped, so every step has exactly B samples.

The position (epoch, step) is the next batch to yield; ``state_dict`` /
``load_state_dict`` save and restore it, so a restarted run reads exactly the
batches it would have read.  All ranks of a spatial group share one data rank
and so read the same samples, each its own hyperslab (``HDF5Reader``).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy

from ..parallel.partition import block_range


class Batch(NamedTuple):
    epoch: int
    step: int
    indices: tuple          # global sample indices of the local batch
    x: object               # (n, C, d, h, w) float32
    y: object               # (n, T) float32 or (n, d, h, w) integer labels


class Loader:
    """Yield this rank's local mini-batches of ``reader`` from a resumable (epoch, step)."""

    def __init__(self, reader, global_batch: int, data_rank: int = 0, data_size: int = 1,
                 seed: int = 0, shuffle: bool = True, epoch: int = 0, step: int = 0):
        if data_size < 1 or not 0 <= data_rank < data_size:
            raise ValueError(f"data_rank must be in [0, data_size={data_size}), got {data_rank}")
        if not 1 <= global_batch <= reader.num_samples:
            raise ValueError(f"global_batch must be in [1, {reader.num_samples}] (samples in "
                             f"{reader.path}), got {global_batch}")
        self.reader = reader
        self.global_batch = global_batch
        self.data_rank, self.data_size = data_rank, data_size
        self.seed, self.shuffle = seed, shuffle
        self.steps_per_epoch = reader.num_samples // global_batch
        self.local_range = block_range(global_batch, data_size, data_rank)
        self.epoch, self.step = 0, 0
        self.seek(epoch, step)

    def order(self, epoch: int):
        """Sample order of ``epoch``: identical on every rank."""
        n = self.reader.num_samples
        if not self.shuffle:
            return numpy.arange(n)
        return numpy.random.default_rng([self.seed, epoch]).permutation(n)

    def global_indices(self, epoch: int, step: int):
        """The B sample indices of global batch ``step`` of ``epoch``."""
        start = step * self.global_batch
        return self.order(epoch)[start:start + self.global_batch]

    def local_indices(self, epoch: int, step: int) -> tuple:
        """This data rank's part of the global batch."""
        lo, hi = self.local_range
        return tuple(int(i) for i in self.global_indices(epoch, step)[lo:hi])

    def seek(self, epoch: int, step: int) -> None:
        if epoch < 0 or not 0 <= step < self.steps_per_epoch:
            raise ValueError(f"position (epoch={epoch}, step={step}) needs epoch >= 0 and step in "
                             f"[0, {self.steps_per_epoch})")
        self.epoch, self.step = epoch, step

    def next_batch(self) -> Batch:
        """The batch at the current position; then advance (to the next epoch after the last step)."""
        epoch, step = self.epoch, self.step
        indices = self.local_indices(epoch, step)
        x, y = self.reader.read_batch(indices)
        if step + 1 == self.steps_per_epoch:
            self.epoch, self.step = epoch + 1, 0
        else:
            self.step = step + 1
        return Batch(epoch, step, indices, x, y)

    def __iter__(self):
        """The remaining batches of the current epoch."""
        epoch = self.epoch
        while self.epoch == epoch:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "step": self.step, "seed": self.seed,
                "global_batch": self.global_batch, "num_samples": self.reader.num_samples,
                "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state``'s position; ValueError if it came from a different setup."""
        for key in ("seed", "global_batch", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(f"loader state has {key}={state[key]!r} but this loader has "
                                 f"{getattr(self, key)!r}")
        if state["num_samples"] != self.reader.num_samples:
            raise ValueError(f"loader state has num_samples={state['num_samples']} but "
                             f"{self.reader.path} holds {self.reader.num_samples}")
        self.seek(state["epoch"], state["step"])


__all__ = ["Batch", "Loader"]
