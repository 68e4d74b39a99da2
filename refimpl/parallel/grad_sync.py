"""Bucketed gradient allreduce, overlapped with backward.

Data-parallel training averages every gradient over the data-parallel
replicas.  Reducing each parameter separately costs one latency per
parameter; reducing everything after backward leaves the network idle while
backward runs.  The remedy (Intel MLSL, Sridharan et al. 2018; PyTorch DDP)
is to pack gradients into a few flat *buckets* in the order backward produces
them -- the reverse of the forward (registration) order -- and to start a
non-blocking allreduce of a bucket as soon as its last gradient is written,
while backward goes on computing the earlier layers.  The first bucket is kept
small so that communication starts early.

Spatial shards: a layer split over the spatial group holds the full weight on
every spatial rank, and each rank's dW, db is a *partial sum* over its block.
The true gradient is summed over the spatial group and averaged over the data
group.  Both happen in one reduction over the product group (data x spatial):
sum over all of its ranks, then divide by the data-group size -- never a sum
followed by a second reduction (that would double count).  A parameter of a
replicated part of the model (``Parameter.spatial_replicated``: e.g. the dense
head after a spatial gather) has the *same* gradient on every spatial rank, so
its sum is divided by the whole product-group size: averaged over both.

Python has no progress thread: an allreduce advances only when someone calls
into MPI.  Every gradient hook therefore also ``test()``-s the buckets in
flight.  Buckets are started strictly in bucket order on every rank (a bucket
that is ready early waits for the ones before it), so all ranks start the same
collectives in the same order even when a parameter is unused on some ranks.

Usage, per step::

    sync = GradientSynchronizer(model.parameters(), data_comm, spatial_comm)
    loss.backward(...)        # hooks start bucket allreduces as gradients appear
    sync.finish()             # wait, average, write the gradients back
    optimizer.step()

``with sync.no_sync(): ...`` runs backward without synchronising (gradient
accumulation); the next synchronised step reduces the accumulated sum.

Priorities (MLSL, Sridharan et al. 2018): the next forward needs the layers
nearest the input first, and backward produces their gradients last.  With
``priority="input-first"`` each bucket is cut into chunks of at most
``chunk_bytes`` (``partition.chunk_ranges``), every chunk its own allreduce,
and the chunks are started highest priority first (priority = the bucket's
position in backward order, so the input layers' bucket is highest): at most
``HELD_CHUNKS`` ready chunks are held back (each gradient hook starts the best
of the rest), ``finish(wait=False)`` starts what is held, so the input-side
bucket, ready last, overtakes the held chunks of the output-side buckets, while
everything beyond them still overlaps backward.  The start order must be the same on every
rank (collectives are matched in order), so it depends only on the order in
which gradients appear -- the same everywhere -- and never on timing.  The
waiting and the update of each bucket then happen layer by layer during the
next forward (``parallel/priority.LayerwiseUpdate``).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from mpi4py import MPI

from ..backend import array_module
from .allreduce import check_options
from .collectives import reduce_scatter, start_allreduce
from .partition import chunk_ranges, pack_buckets

MIB = 1 << 20
PRIORITIES = ("none", "input-first")
HELD_CHUNKS = 4     # input-first: ready chunks kept back for a better bucket to overtake


@dataclass(eq=False)          # a bucket is itself (identity), never equal by its arrays' values
class Bucket:
    """Parameters whose gradients are reduced together in one flat buffer."""
    params: list                     # in backward (reverse registration) order
    offsets: list                    # element offset of each param in flat, plus the end
    flat: object                     # (n,) reduction buffer, dtype of its params
    chunks: list = field(default_factory=list)   # [lo, hi) of flat, one allreduce each
    priority: int = 0                # higher is started first (input-first: backward position)
    ready: set = field(default_factory=set)   # ids of params hooked this step
    handles: list = field(default_factory=list)   # AllreduceHandle of each started chunk
    started_at: list = field(default_factory=list)   # per started chunk
    done_at: list = field(default_factory=list)      # per started chunk: first time seen finished

    @property
    def nbytes(self) -> int:
        return self.flat.nbytes

    @property
    def in_flight(self) -> bool:
        return bool(self.handles)


def make_buckets(params, bucket_bytes: int, first_bucket_bytes: int, chunk_bytes: int = 0) -> list[Bucket]:
    """Pack params (given in backward order) into buckets of one dtype and array module.

    A bucket is closed when the next parameter would take it past its cap
    (``first_bucket_bytes`` for the first, ``bucket_bytes`` after), or has another
    dtype; a parameter larger than the cap gets a bucket of its own.  Each bucket's ``chunks``
    cut it into pieces of at most ``chunk_bytes`` (0: one piece).
    """
    params = list(params)
    kinds = [(p.data.dtype, array_module(p.data)) for p in params]
    groups = [[params[i] for i in group] for group in
              pack_buckets([p.data.nbytes for p in params], kinds, bucket_bytes, first_bucket_bytes)]
    buckets = []
    for group in groups:
        offsets = [0]
        for param in group:
            offsets.append(offsets[-1] + param.data.size)
        xp = array_module(group[0].data)
        flat = xp.zeros(offsets[-1], dtype=group[0].data.dtype)
        buckets.append(Bucket(group, offsets, flat, chunk_ranges(flat.size, flat.itemsize, chunk_bytes)))
    return buckets


def product_comm(data_comm, spatial_comm):
    """The communicator of the data x spatial group containing this rank.

    Built from the world ranks of every spatial peer's data group.  The two
    communicators must be orthogonal (each data group meets each spatial group
    in one rank); collective over ``spatial_comm``, then over the product group.
    """
    if spatial_comm is None or spatial_comm.Get_size() == 1:
        return data_comm
    if data_comm.Get_size() == 1:
        return spatial_comm
    world = MPI.COMM_WORLD
    mine = MPI.Group.Translate_ranks(data_comm.Get_group(), list(range(data_comm.Get_size())),
                                     world.Get_group())
    members = sorted({r for group in spatial_comm.allgather(list(mine)) for r in group})
    if len(members) != data_comm.Get_size() * spatial_comm.Get_size():
        raise ValueError("data_comm and spatial_comm must be orthogonal: their product group has "
                         f"{len(members)} ranks, expected {data_comm.Get_size()} x {spatial_comm.Get_size()}")
    if len(members) == world.Get_size():
        return world
    return world.Create_group(world.Get_group().Incl(members))


class GradientSynchronizer:
    """Sum gradients over data x spatial, average over data, bucketed and overlapped.

    ``params``: the model's Parameters in registration (forward) order.
    ``reduce_comm``: the product group, if the caller already has it (e.g.
    from a process grid); otherwise built by ``product_comm``.
    ``algorithm`` and ``algorithm_options``: a name of ``parallel.allreduce.ALGORITHMS`` and its
    options (e.g. ``colors=4`` for multicolor), checked before any message.
    ``priority`` ("none" | "input-first") and ``chunk_bytes``: see the module docstring.
    ``trace``: keep one record per chunk and step in ``self.trace`` (bucket, chunk, bytes,
    priority, start and finish times) for a timeline.
    """

    def __init__(self, params, data_comm, spatial_comm=None, bucket_bytes: int = 25 * MIB,
                 first_bucket_bytes: int = 1 * MIB, algorithm: str = "native", overlap: bool = True,
                 reduce_comm=None, shard: bool = False, compressor=None, priority: str = "none",
                 chunk_bytes: int = 0, trace: bool = False, **algorithm_options):
        params = list(params)
        if priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {list(PRIORITIES)}, got {priority!r}")
        if priority != "none" and (shard or compressor is not None or not overlap):
            raise ValueError("priority input-first needs the overlapped allreduce: it does not combine with "
                             "the distributed update, a compressed exchange or overlap=False")
        check_options(algorithm, algorithm_options)     # the name, and the options it declares
        for name, value in (("bucket_bytes", bucket_bytes), ("first_bucket_bytes", first_bucket_bytes),
                            ("chunk_bytes", chunk_bytes)):
            if isinstance(value, bool) or int(value) != value or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if len({id(p) for p in params}) != len(params):
            raise ValueError("params must not repeat a Parameter")
        self.data_size = data_comm.Get_size()
        self.reduce_comm = reduce_comm if reduce_comm is not None else product_comm(data_comm, spatial_comm)
        check_options(algorithm, algorithm_options, self.reduce_comm.Get_size())   # e.g. group_size divides p
        self.algorithm, self.algorithm_options = algorithm, algorithm_options
        self.overlap = overlap
        # shard: reduce-scatter instead of allreduce, for parallel/sharded_update.ShardedOptimizer
        self.shard = bool(shard)
        # compressor (parallel/compress.Compressor): a compressed exchange after backward instead
        self.compressor = compressor
        if shard and compressor is not None:
            raise ValueError("the distributed update and a compressed exchange do not combine")
        self.buckets = make_buckets(params[::-1], bucket_bytes, first_bucket_bytes, int(chunk_bytes))
        self.priority = priority
        for index, bucket in enumerate(self.buckets):
            bucket.priority = index if priority == "input-first" else -index
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._next = 0            # index of the next bucket to become ready (buckets fill in order)
        self._waiting = []        # (bucket, chunk index) packed but not started, input-first only
        self._syncing = True
        self._step_began = None
        self.before_backward = None   # callback at the first gradient of a step (LayerwiseUpdate)
        self.history = []         # one record (dict) per synchronised step
        self.tracing, self.trace, self._steps = bool(trace), [], 0
        self.attach()

    def bucket_of(self, param) -> Bucket:
        return self._bucket_of[id(param)]

    # ------------------------------------------------------------ during backward

    def _grad_ready(self, param) -> None:
        """Parameter.accumulate_grad hook: mark ready, start full buckets, make progress."""
        if self.before_backward is not None and self._step_began is None:
            self.before_backward()         # the buffers are about to be refilled
        if not self._syncing:
            return
        if self._step_began is None:
            self._step_began = time.perf_counter()
        bucket = self._bucket_of[id(param)]
        if bucket.in_flight:
            raise RuntimeError(
                f"gradient of {param.name or 'a parameter'} arrived after its bucket was sent; "
                "a parameter used twice must accumulate once per backward (or use overlap=False)")
        bucket.ready.add(id(param))
        if self.overlap and not self.shard and self.compressor is None:
            while self._next < len(self.buckets) and \
                    len(self.buckets[self._next].ready) == len(self.buckets[self._next].params):
                self._ready(self.buckets[self._next])
            while len(self._waiting) > HELD_CHUNKS:      # input-first: best first
                self._start_chunk(*self._waiting.pop(0))
            self._progress()

    def _ready(self, bucket: Bucket) -> None:
        """The bucket's gradients are all in: pack it and start it (priority none) or queue its
        chunks by priority (input-first)."""
        self._pack(bucket)
        self._next += 1
        if self.priority == "none":
            for chunk in range(len(bucket.chunks)):
                self._start_chunk(bucket, chunk)
        else:
            self._waiting += [(bucket, chunk) for chunk in range(len(bucket.chunks))]
            self._waiting.sort(key=lambda item: (-item[0].priority, item[1]))

    def _pack(self, bucket: Bucket) -> None:
        """Copy the bucket's gradients (None counts as zeros) into its buffer."""
        for param, lo, hi in zip(bucket.params, bucket.offsets, bucket.offsets[1:]):
            if param.grad is None:
                bucket.flat[lo:hi] = 0
            else:
                bucket.flat[lo:hi] = param.grad.reshape(-1)

    def _start_chunk(self, bucket: Bucket, chunk: int) -> None:
        """Start the sum of one chunk of a packed bucket (chunks of a bucket start in order)."""
        lo, hi = bucket.chunks[chunk]
        bucket.started_at.append(time.perf_counter())
        bucket.done_at.append(None)
        bucket.handles.append(start_allreduce(bucket.flat[lo:hi], self.reduce_comm, self.algorithm,
                                              **self.algorithm_options))

    def _progress(self) -> None:
        """Advance every chunk in flight as far as it goes without blocking."""
        for bucket in self.buckets[:self._next]:
            for chunk, handle in enumerate(bucket.handles):
                if bucket.done_at[chunk] is None and handle.test():
                    bucket.done_at[chunk] = time.perf_counter()

    def _start_rest(self) -> None:
        """After backward: every bucket not yet ready is packed, every chunk not yet started is
        started (input-first: best first)."""
        while self._next < len(self.buckets):
            self._ready(self.buckets[self._next])
        for bucket, chunk in self._waiting:
            self._start_chunk(bucket, chunk)
        self._waiting = []

    def wait_bucket(self, bucket: Bucket) -> None:
        """Block until every chunk of the (started) bucket is summed."""
        for chunk, handle in enumerate(bucket.handles):
            handle.wait()
            if bucket.done_at[chunk] is None:
                bucket.done_at[chunk] = time.perf_counter()

    # ------------------------------------------------------------ after backward

    def finish(self, wait: bool = True) -> None:
        """Start what is left, wait for every bucket, average and write ``param.grad``.

        ``wait=False`` (input-first, for ``LayerwiseUpdate``) returns once everything is
        started; the caller then takes each bucket with ``wait_bucket`` and ``gradients``.
        Inside ``no_sync()`` this does nothing (gradients stay local sums).
        """
        if not self._syncing:
            return
        self._steps += 1              # the synchronised step this is (1-based), for the trace
        if self.shard:
            return self._finish_sharded()
        if self.compressor is not None:
            return self._finish_compressed()
        backward_end = time.perf_counter()
        started_in_backward = sum(len(b.handles) for b in self.buckets)
        in_flight = sum(min(done or backward_end, backward_end) - start
                        for b in self.buckets for start, done in zip(b.started_at, b.done_at))
        self._start_rest()
        self._next = 0
        if not wait:
            self._record(backward_end, backward_end, started_in_backward, in_flight)
            return
        for bucket in sorted(self.buckets, key=lambda b: -b.priority):
            self.wait_bucket(bucket)
        finished = time.perf_counter()
        for bucket in self.buckets:
            self._write_back(bucket)
        self._record(backward_end, finished, started_in_backward, in_flight)

    def _record(self, backward_end, finished, started_in_backward=0, in_flight=0.0, **extra) -> None:
        """One step's entry of ``history``; the next step's backward starts a new clock."""
        self.history.append({
            "buckets": len(self.buckets),
            "started_in_backward": started_in_backward,    # chunks (one per bucket unless chunked)
            "in_flight_during_backward_s": in_flight,   # summed over buckets
            "wait_s": finished - backward_end,          # time finish() blocked
            "backward_s": backward_end - (self._step_began or backward_end),  # first hook -> finish
            **extra,
        })
        self._step_began = None

    def divisor(self, param) -> int:
        """What the summed gradient of ``param`` is divided by: the data-group size (an average
        over the replicas), or the whole product group's for a parameter replicated across the
        spatial group (its spatial ranks hold the same gradient, not partial sums)."""
        return self.reduce_comm.Get_size() if getattr(param, "spatial_replicated", False) else self.data_size

    def _finish_compressed(self) -> None:
        """Every bucket through the compressor (an allgather of compressed messages, summed in
        rank order), then averaged and written back as in ``finish``."""
        backward_end = time.perf_counter()
        sent = self.compressor.bytes_sent
        for key, bucket in enumerate(self.buckets):
            self._pack(bucket)
            self.compressor.exchange(bucket.flat, key)
            self._write_back(bucket)
        self._record(backward_end, time.perf_counter(), bytes_sent=self.compressor.bytes_sent - sent)

    def gradients(self, bucket: Bucket):
        """(param, synchronised gradient) of a summed bucket: its slice of the buffer divided by
        ``divisor(param)``; the bucket is then free for the next step."""
        out = [(param, bucket.flat[lo:hi].reshape(param.data.shape) / self.divisor(param))
               for param, lo, hi in zip(bucket.params, bucket.offsets, bucket.offsets[1:])]
        if self.tracing:
            index = self.buckets.index(bucket)
            self.trace += [{"step": self._steps, "bucket": index, "chunk": chunk,
                            "bytes": (hi - lo) * bucket.flat.itemsize, "priority": bucket.priority,
                            "start": start, "finish": done}
                           for chunk, ((lo, hi), start, done) in
                           enumerate(zip(bucket.chunks, bucket.started_at, bucket.done_at))]
        bucket.ready.clear()
        bucket.handles, bucket.started_at, bucket.done_at = [], [], []
        return out

    def _write_back(self, bucket: Bucket) -> None:
        """``param.grad`` from the reduced buffer, divided by ``divisor(param)``."""
        for param, grad in self.gradients(bucket):
            param.grad = grad

    def _finish_sharded(self) -> None:
        """Reduce-scatter every bucket: this rank's block of each bucket's buffer holds the sum
        (``collectives.owned_block``), for the distributed update to divide and apply; the
        parameters' local gradients are dropped (nothing may read them as synchronised)."""
        backward_end = time.perf_counter()
        for bucket in self.buckets:
            self._pack(bucket)
            reduce_scatter(bucket.flat, self.reduce_comm, self.algorithm, **self.algorithm_options)
            for param in bucket.params:
                param.grad = None
            bucket.ready.clear()
        self._record(backward_end, time.perf_counter())

    @contextlib.contextmanager
    def no_sync(self):
        """Skip synchronisation: backward inside accumulates gradients locally only."""
        if any(b.in_flight or b.ready for b in self.buckets):
            raise RuntimeError("no_sync() entered while a synchronised backward is unfinished; "
                               "call finish() first")
        self._syncing = False
        try:
            yield self
        finally:
            self._syncing = True

    def attach(self) -> None:
        """Install this synchroniser's hook on its parameters (done by the constructor)."""
        for bucket in self.buckets:
            for param in bucket.params:
                param.on_grad_ready = self._grad_ready

    def detach(self) -> None:
        """Remove the hooks from the parameters."""
        for bucket in self.buckets:
            for param in bucket.params:
                param.on_grad_ready = None
