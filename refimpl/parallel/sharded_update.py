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


class _Block:
    """One rank's block of a bucket, as the inner optimizer sees a parameter."""
    __slots__ = ("data", "grad", "name")

    def __init__(self, data, name):
        self.data, self.grad, self.name = data, None, name


class ShardedOptimizer:
    """The distributed update of ``make(blocks)`` (an ``refimpl.optim`` optimizer factory) over
    the buckets of ``sync``, a ``GradientSynchronizer(..., shard=True)``.

    ``params``: the model's parameters in registration order (the order of the saved state)."""

    def __init__(self, make, params, sync):
        if not sync.shard:
            raise ValueError("ShardedOptimizer needs a GradientSynchronizer built with shard=True")
        self.params = list(params)
        self.sync = sync
        self.comm = sync.reduce_comm
        index = {id(p): i for i, p in enumerate(self.params)}
        if set(index) != {id(p) for b in sync.buckets for p in b.params}:
            raise ValueError("the synchroniser's buckets must hold exactly the optimizer's parameters")
        self._layout = []        # per bucket: (flat parameters, (lo, hi), block, divisors, segments)
        blocks = []
        for k, bucket in enumerate(sync.buckets):
            xp = array_module(bucket.flat)
            flat = xp.empty_like(bucket.flat)                       # the bucket's parameters, flat
            segments = []
            for param, a, b in zip(bucket.params, bucket.offsets, bucket.offsets[1:]):
                flat[a:b] = param.data.reshape(-1)
                segments.append((index[id(param)], param, a, b))
            lo, hi = owned_block(flat.size, self.comm)
            divisors = xp.empty(hi - lo, dtype=flat.dtype)           # as finish() divides per parameter
            for _, param, a, b in segments:
                a, b = max(a, lo), min(b, hi)
                if a < b:
                    replicated = getattr(param, "spatial_replicated", False)
                    divisors[a - lo:b - lo] = self.comm.Get_size() if replicated else sync.data_size
            block = _Block(flat[lo:hi], f"bucket {k} [{lo}, {hi})")
            blocks.append(block)
            self._layout.append((flat, (lo, hi), block, divisors, segments))
        self.inner = make(blocks)

    # the inner optimizer's schedule-facing attributes
    lr = property(lambda self: self.inner.lr, lambda self, v: setattr(self.inner, "lr", v))
    step_count = property(lambda self: self.inner.step_count)
    slots = property(lambda self: self.inner.slots)

    def zero_grad(self) -> None:
        for p in self.params:
            p.zero_grad()

    def step(self) -> None:
        """Update this rank's blocks from the reduce-scattered gradients, then allgather them
        into every parameter (in place: layers keep their arrays)."""
        for bucket, (flat, (lo, hi), block, divisors, segments) in zip(self.sync.buckets, self._layout):
            for _, param, a, b in segments:       # the parameters as they are now (a checkpoint
                a2, b2 = max(a, lo), min(b, hi)    # may have been loaded into them)
                if a2 < b2:
                    flat[a2:b2] = param.data.reshape(-1)[a2 - a:b2 - a]
            block.grad = bucket.flat[lo:hi] / divisors
        self.inner.step()
        for flat, _, block, _, segments in self._layout:
            block.grad = None
            allgather(flat, self.comm, self.sync.algorithm, **self.sync.algorithm_options)
            for _, param, a, b in segments:
                param.data[...] = flat[a:b].reshape(param.data.shape)

    # ------------------------------------------------------------ checkpoints (collective)
    def state_dict(self) -> dict:
        """The plain optimizer's state dict: ``"<slot>.<parameter index>"`` -> whole host array
        (each bucket's blocks allgathered: collective over the group)."""
        arrays = {}
        for (flat, (lo, hi), _, _, segments), state in zip(self._layout, self.inner.state):
            for slot in self.inner.slots:
                if slot not in state:
                    continue
                whole = array_module(flat).zeros_like(flat)
                whole[lo:hi] = state[slot]
                allgather(whole, self.comm, self.sync.algorithm, **self.sync.algorithm_options)
                host = to_host(whole)
                for i, param, a, b in segments:
                    arrays[f"{slot}.{i}"] = host[a:b].reshape(param.data.shape).copy()
        return {"name": type(self.inner).__name__, "step_count": self.inner.step_count, "lr": self.inner.lr,
                "arrays": arrays}

    def load_state_dict(self, state: dict) -> None:
        """Take this rank's blocks of a plain-format state (ValueError on a mismatch)."""
        if state.get("name") != type(self.inner).__name__:
            raise ValueError(f"optimizer state is for {state.get('name')!r}, this is {type(self.inner).__name__}")
        arrays = state["arrays"]
        known = {f"{slot}.{i}" for _, _, _, _, segs in self._layout for i, _, _, _ in segs for slot in self.inner.slots}
        unknown = sorted(set(arrays) - known)
        if unknown:
            raise ValueError(f"optimizer state has unknown entries {unknown[:3]}")
        fresh = []
        for flat, (lo, hi), _, _, segments in self._layout:
            xp = array_module(flat)
            blocks = {}
            for slot in self.inner.slots:
                have = [f"{slot}.{i}" in arrays for i, _, _, _ in segments]
                if not any(have):
                    continue
                if not all(have):
                    raise ValueError(f"optimizer state {slot!r} covers only some parameters of a bucket")
                whole = xp.empty_like(flat)
                for i, param, a, b in segments:
                    value = arrays[f"{slot}.{i}"]
                    if tuple(value.shape) != tuple(param.data.shape):
                        raise ValueError(f"optimizer state '{slot}.{i}' has shape {tuple(value.shape)}, "
                                         f"parameter {param.name!r} has {tuple(param.data.shape)}")
                    whole[a:b] = xp.asarray(value, dtype=flat.dtype).reshape(-1)
                blocks[slot] = whole[lo:hi].copy()
            fresh.append(blocks)
        self.inner.state = fresh
        self.inner.step_count = int(state["step_count"])
        self.inner.lr = float(state["lr"])

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (the 1/|G| the distributed update saves)."""
        return sum(int(a.nbytes) for state in self.inner.state for a in state.values())


__all__ = ["ShardedOptimizer"]
