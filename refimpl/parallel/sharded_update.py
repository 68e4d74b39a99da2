"""Distributed weight update: reduce-scatter, update one block, allgather (MLSL's distributed
update, Sridharan et al. 2018; ZeRO stage 1, Rajbhandari et al. 2020).

Plain data parallelism allreduces every gradient and then *every* rank runs the same optimizer
update on *every* parameter, holding the optimizer's whole state (SGD momentum: one copy of the
weights; Adam: two).  An allreduce is a reduce-scatter followed by an allgather, so the update
can sit between the halves:

    reduce-scatter  the gradients of each bucket over the group G that holds the same parameters
                    (data x spatial, the group ``GradientSynchronizer`` reduces over): rank r
                    of G gets the sum of block r (``collectives.owned_block``);
    update          rank r updates block r of the parameters, with the optimizer state of
                    block r only: state memory and update time per rank / |G|;
    allgather       the updated blocks, so every rank holds every parameter again.

The bytes moved equal one allreduce's ((p-1)/p n each way for ring or halving-doubling).

Exactness: the optimizer's update is elementwise (weight decay, momentum, Adam's moments and
bias correction), so each element goes through the same arithmetic as in the plain update, on
the same reduced gradient (divided by the data-group size, or by |G| for a parameter
replicated over the spatial group, as ``GradientSynchronizer.finish`` divides); only the order
in which the reduction adds the ranks' contributions can differ between the reduce-scatter and
the allreduce.

The state is saved and loaded in the plain optimizer's format (one array per parameter and
slot, gathered whole): a checkpoint written with the distributed update resumes without it,
on another grid, and the other way round.
"""
from __future__ import annotations

from ..backend import array_module, to_host
from .collectives import allgather, owned_block
from .objects import allreduce_sum


class _Block:
    """The part of one parameter inside this rank's block of a bucket, as the inner optimizer
    sees a parameter: ``data`` is a view of the parameter itself (the update writes in place)."""
    __slots__ = ("data", "grad", "name")

    def __init__(self, data, name):
        self.data, self.grad, self.name = data, None, name


class ShardedOptimizer:
    """The distributed update of ``make(blocks)`` (an ``refimpl.optim`` optimizer factory) over
    the buckets of ``sync``, a ``GradientSynchronizer(..., shard=True)``.

    ``params``: the model's parameters in registration order (the order of the saved state).
    This rank's block of a bucket may cut across several parameters: the inner optimizer sees
    one ``_Block`` per parameter piece, a view of the parameter's own memory, so no copy of the
    parameters is kept; the bucket's gradient buffer, free once its block has been read, carries
    the allgather."""

    def __init__(self, make, params, sync):
        if not sync.shard:
            raise ValueError("ShardedOptimizer needs a GradientSynchronizer built with shard=True")
        self.params = list(params)
        self.sync = sync
        self.comm = sync.reduce_comm
        index = {id(p): i for i, p in enumerate(self.params)}
        if set(index) != {id(p) for b in sync.buckets for p in b.params}:
            raise ValueError("the synchroniser's buckets must hold exactly the optimizer's parameters")
        self._pieces = []        # per bucket: [(parameter index, parameter, a, b, a2, b2, block, divisor)]
        self._segments = []      # per bucket: [(parameter index, parameter, a, b)]
        blocks = []
        for bucket in sync.buckets:
            lo, hi = owned_block(bucket.flat.size, self.comm)
            pieces, segments = [], []
            for param, a, b in zip(bucket.params, bucket.offsets, bucket.offsets[1:]):
                i = index[id(param)]
                segments.append((i, param, a, b))
                a2, b2 = max(a, lo), min(b, hi)
                if a2 < b2:
                    divisor = sync.divisor(param)                 # as the plain finish() divides
                    block = _Block(param.data.reshape(-1)[a2 - a:b2 - a], f"{param.name}[{a2 - a}:{b2 - a}]")
                    pieces.append((i, param, a, b, a2, b2, block, divisor))
                    blocks.append(block)
            self._pieces.append(pieces)
            self._segments.append(segments)
        self.inner = make(blocks)

    # the inner optimizer's schedule-facing attributes
    lr = property(lambda self: self.inner.lr, lambda self, v: setattr(self.inner, "lr", v))
    step_count = property(lambda self: self.inner.step_count)
    slots = property(lambda self: self.inner.slots)

    def zero_grad(self) -> None:
        for p in self.params:
            p.zero_grad()

    def step(self) -> None:
        """Update this rank's pieces from the reduce-scattered gradients (in the parameters
        themselves), then allgather every bucket into every rank's parameters."""
        for bucket, pieces in zip(self.sync.buckets, self._pieces):
            for _, _, _, _, a2, b2, block, divisor in pieces:
                block.grad = bucket.flat[a2:b2] / divisor
        self.inner.step()
        for bucket, pieces, segments in zip(self.sync.buckets, self._pieces, self._segments):
            for _, _, _, _, a2, b2, block, _ in pieces:
                block.grad = None
                bucket.flat[a2:b2] = block.data
            allgather(bucket.flat, self.comm, self.sync.algorithm, **self.sync.algorithm_options)
            for _, param, a, b in segments:
                param.data[...] = bucket.flat[a:b].reshape(param.data.shape)

    # ------------------------------------------------------------ checkpoints (collective)
    def state_dict(self) -> dict:
        """The plain optimizer's state dict: ``"<slot>.<parameter index>"`` -> whole host array
        (each bucket's pieces allgathered: collective over the group)."""
        arrays, k = {}, 0
        for bucket, pieces, segments in zip(self.sync.buckets, self._pieces, self._segments):
            states = self.inner.state[k:k + len(pieces)]
            k += len(pieces)
            for slot in self.inner.slots:
                # the same decision on every rank (a rank may hold no piece of a small bucket)
                if not allreduce_sum(self.comm, int(any(slot in st for st in states))):
                    continue
                whole = array_module(bucket.flat).zeros_like(bucket.flat)
                for (_, _, _, _, a2, b2, _, _), st in zip(pieces, states):
                    if slot in st:
                        whole[a2:b2] = st[slot]
                allgather(whole, self.comm, self.sync.algorithm, **self.sync.algorithm_options)
                host = to_host(whole)
                for i, param, a, b in segments:
                    arrays[f"{slot}.{i}"] = host[a:b].reshape(param.data.shape).copy()
        return {"name": type(self.inner).__name__, "step_count": self.inner.step_count, "lr": self.inner.lr,
                "arrays": arrays}

    def load_state_dict(self, state: dict) -> None:
        """Take this rank's pieces of a plain-format state (ValueError on a mismatch)."""
        if state.get("name") != type(self.inner).__name__:
            raise ValueError(f"optimizer state is for {state.get('name')!r}, this is {type(self.inner).__name__}")
        arrays = state["arrays"]
        known = {f"{slot}.{i}" for segs in self._segments for i, _, _, _ in segs for slot in self.inner.slots}
        unknown = sorted(set(arrays) - known)
        if unknown:
            raise ValueError(f"optimizer state has unknown entries {unknown[:3]}")
        for key, value in arrays.items():
            i = int(key.rpartition(".")[2])
            if tuple(value.shape) != tuple(self.params[i].data.shape):
                raise ValueError(f"optimizer state {key!r} has shape {tuple(value.shape)}, parameter "
                                 f"{self.params[i].name!r} has {tuple(self.params[i].data.shape)}")
        fresh = []
        for pieces in self._pieces:
            for i, param, a, b, a2, b2, block, _ in pieces:
                xp = array_module(param.data)
                fresh.append({slot: xp.asarray(arrays[f"{slot}.{i}"], dtype=param.data.dtype).reshape(-1)
                              [a2 - a:b2 - a].copy()
                              for slot in self.inner.slots if f"{slot}.{i}" in arrays})
        self.inner.state = fresh
        self.inner.step_count = int(state["step_count"])
        self.inner.lr = float(state["lr"])

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (the 1/|G| the distributed update saves)."""
        return sum(int(a.nbytes) for state in self.inner.state for a in state.values())


__all__ = ["ShardedOptimizer"]
