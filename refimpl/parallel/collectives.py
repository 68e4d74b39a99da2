"""Allreduce (sum) over MPI: running the step generators of ``parallel/allreduce/``.

The algorithms themselves (ring, recursive doubling, halving-doubling, multi-colour,
hierarchical, MPI's own) live one per module in ``refimpl/parallel/allreduce/``, each with its
steps, its alpha-beta-gamma cost and its options side by side; ``ALGORITHMS`` lists them and
``predicted_time`` prices them (both re-exported here).  This module runs them.

Every algorithm is a *step generator* ``fn(flat, msgs, **options)``: it posts one round of
non-blocking messages through ``Messages`` (Isend / Irecv), ``yield``-s their requests, and
after the round has completed does the local work.  Run to the end with ``Waitall`` on each
round it is a blocking allreduce (``allreduce``); advanced a round at a time with ``Testall``
it is the non-blocking form that gradient synchronisation overlaps with backward
(``start_allreduce`` -> ``AllreduceHandle.test()`` / ``.wait()``): Python has no progress
thread, so the caller's ``test()`` calls are the progress engine.

Exactness: integer sums are associative, so every algorithm is bit-identical
to ``MPI_Allreduce`` on integer data; on floats the order of additions differs
(results agree to rounding).  Each element's final value is computed on one
rank (or identically by partners, ``a + b == b + a``) and then copied, so all
ranks end with bit-identical results.

Messages of concurrent allreduces on one communicator must not mix, so every
call takes a fresh tag from a per-communicator sequence (stored as an MPI
attribute of the communicator): all ranks start their allreduces on a
communicator in the same order, as with any collective.
"""
from __future__ import annotations

from mpi4py import MPI

from .allreduce import (ALGORITHMS, Algorithm, Option, algorithm_named, check_group_size,  # noqa: F401
                        check_options, default_group_size, predicted_time, register)
from .buffers import finish_recv, is_device, recv_buffer, send_buffer
from .partition import block_range

_TAG_BASE = 1 << 14  # above the tags of hand-written messages elsewhere in refimpl
_seq_keyval = None


# ---------------------------------------------------------------- message helpers

class Messages:
    """The messages of one allreduce: its communicator, its own tag, device staging.

    Every buffer goes through refimpl.parallel.buffers: host arrays pass
    straight to MPI; a device array is handed over directly when MPI is
    CUDA-aware, else staged through host memory.  A staged receive lands in
    its target in ``land()``, which the driver calls when a round has arrived.
    """

    def __init__(self, comm, tag: int):
        self.comm, self.tag = comm, tag
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._staged = []  # (host buffer, device target) of this round's receives
        self._sending = []  # send buffers of this round, alive until it completes

    def send(self, a, dest: int):
        buf = send_buffer(a)
        self._sending.append(buf)
        return self.comm.Isend(buf, dest=dest, tag=self.tag)

    def recv(self, target, source: int):
        return self.comm.Irecv(self._landing(target), source=source, tag=self.tag)

    def allreduce(self, target, blocking: bool = False):
        """MPI's allreduce of ``target`` in place: Iallreduce, or Allreduce when blocking."""
        buf = self._landing(target)
        if buf is not target:
            buf[...] = send_buffer(target)
        if blocking:
            self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            self.land()
            return None
        return self.comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

    def reduce_scatter_blocks(self, flat) -> None:
        """MPI's blocking Reduce_scatter of ``flat``: this rank's block (``owned_block``) of
        the sum lands in place; the rest of ``flat`` is left as it was."""
        counts = _block_counts(flat.size, self.size)
        lo, hi = block_range(flat.size, self.size, self.rank)
        whole = send_buffer(flat)
        mine = recv_buffer((hi - lo,), flat.dtype, like=flat)
        self.comm.Reduce_scatter(whole, mine, counts, op=MPI.SUM)
        flat[lo:hi] = finish_recv(mine, like=flat)

    def allgather_blocks(self, flat) -> None:
        """MPI's blocking Allgatherv: every rank's block (``owned_block``) of ``flat`` to
        every rank, in place."""
        counts = _block_counts(flat.size, self.size)
        lo, hi = block_range(flat.size, self.size, self.rank)
        mine = send_buffer(flat[lo:hi])
        whole = recv_buffer((flat.size,), flat.dtype, like=flat)
        self.comm.Allgatherv(mine, [whole, counts])
        flat[...] = finish_recv(whole, like=flat)

    def _landing(self, target):
        if not is_device(target):
            return target
        buf = recv_buffer(target.shape, target.dtype, like=target)
        if buf is not target:
            self._staged.append((buf, target))
        return buf

    def land(self) -> None:
        """After a round: copy staged receives into their targets, release send buffers."""
        for buf, target in self._staged:
            target[...] = finish_recv(buf, like=target)
        self._staged.clear()
        self._sending.clear()


def _block_counts(n: int, p: int) -> list[int]:
    """Elements of each rank's block (``owned_block``), for MPI's vector collectives."""
    return [b - a for a, b in (block_range(n, p, r) for r in range(p))]


def _next_tag(comm) -> int:
    """A fresh tag for one allreduce on ``comm`` (the same on every rank)."""
    global _seq_keyval
    if _seq_keyval is None:
        _seq_keyval = MPI.Comm.Create_keyval()
    seq = comm.Get_attr(_seq_keyval) or 0
    comm.Set_attr(_seq_keyval, seq + 1)
    tag_ub = comm.Get_attr(MPI.TAG_UB) or 32767
    return _TAG_BASE + seq % (tag_ub - _TAG_BASE)


# ---------------------------------------------------------------- running them

class AllreduceHandle:
    """A started allreduce: ``test()`` advances it without blocking, ``wait()`` ends it."""

    def __init__(self, steps, msgs, result):
        self._steps, self._msgs = steps, msgs
        self._requests = []
        self.result = result
        self.done = False
        self._advance()

    def _advance(self):
        """Do the local work after a round and post the next round's messages."""
        self._msgs.land()
        try:
            self._requests = next(self._steps)
        except StopIteration:
            self._requests, self.done = [], True

    def test(self) -> bool:
        """Advance through every round that has already arrived; True when finished."""
        while not self.done and MPI.Request.Testall(self._requests):
            self._advance()
        return self.done

    def wait(self):
        """Block until finished; returns the result buffer."""
        while not self.done:
            MPI.Request.Waitall(self._requests)
            self._advance()
        return self.result


def _flat_view(a, name: str):
    """1-D view of a C- or F-contiguous array (elementwise sums ignore the order)."""
    if a.flags.c_contiguous:
        return a.reshape(-1)
    if a.flags.f_contiguous:
        return a.T.reshape(-1)
    raise ValueError(f"{name} must be a contiguous array, got strides {a.strides}")


def _checked(buf, comm, algorithm, out, options):
    """Validate the arguments; returns (1-D view reduced in place, result array).

    Everything checked depends only on arguments all ranks share, so a bad call
    raises ValueError on every rank before any message.
    """
    check_options(algorithm, options, comm.Get_size())
    if buf.dtype.kind not in "iufc":
        raise ValueError(f"buf must hold numbers (int, uint, float, complex), got {buf.dtype}")
    flat = _flat_view(buf, "buf")
    if out is None or out is buf:
        return flat, buf
    if out.shape != buf.shape or out.dtype != buf.dtype:
        raise ValueError(f"out must match buf: got {out.shape} {out.dtype}, expected {buf.shape} {buf.dtype}")
    out[...] = buf
    return _flat_view(out, "out"), out


def start_allreduce(buf, comm, algorithm: str = "native", out=None, **options) -> AllreduceHandle:
    """Start a sum-allreduce of ``buf`` over ``comm``; returns its handle.

    In place when ``out`` is None, else ``out`` (same shape and dtype) gets the
    sum and ``buf`` is left as it was.  ``options``: the algorithm's (``ALGORITHMS[algorithm]
    .options``: ``colors`` of multicolor, ``group_size`` of hierarchical).  Every rank must
    start its allreduces on a communicator in the same order (as with any collective).
    """
    flat, result = _checked(buf, comm, algorithm, out, options)
    msgs = Messages(comm, _next_tag(comm))
    return AllreduceHandle(ALGORITHMS[algorithm].steps(flat, msgs, **options), msgs, result)


class AllreduceTraffic:
    """Bytes of the buffers the blocking ``allreduce`` reduced over more than one rank, summed
    (the layers' allreduces: batch-norm sums, the flatten layer's partial products, replicated
    input gradients over the model group; the planner predicts them)."""

    def __init__(self):
        self.bytes = 0
        self.calls = 0


LAYER_ALLREDUCES = AllreduceTraffic()


def allreduce(buf, comm, algorithm: str = "native", out=None, **options):
    """Sum ``buf`` over all ranks of ``comm`` with the named algorithm; returns the result.

    See ``start_allreduce`` for the arguments; ``ALGORITHMS`` lists the names.
    An algorithm with a ``blocking`` form runs it ("native": the blocking ``MPI_Allreduce``,
    MPI's tuned algorithms; the non-blocking ``Iallreduce`` of the handle form is usually slower).
    """
    if comm.Get_size() > 1:
        LAYER_ALLREDUCES.bytes += int(buf.nbytes)
        LAYER_ALLREDUCES.calls += 1
    blocking = algorithm_named(algorithm).blocking
    if blocking is not None:
        flat, result = _checked(buf, comm, algorithm, out, options)
        blocking(flat, Messages(comm, tag=0))
        return result
    return start_allreduce(buf, comm, algorithm, out=out, **options).wait()


# ---------------------------------------------------------------- the two halves

def owned_block(n: int, comm) -> tuple[int, int]:
    """Elements ``[lo, hi)`` of an n-element buffer this rank owns after ``reduce_scatter``:
    balanced blocks (``block_range``), block r on rank r, whatever the algorithm."""
    return block_range(n, comm.Get_size(), comm.Get_rank())


def _run(steps, msgs) -> None:
    """Drive a step generator to its end (blocking)."""
    handle = AllreduceHandle(steps, msgs, None)
    handle.wait()


def _halves(algorithm: str, p: int):
    """The algorithm's ``Halves`` on p ranks, or None."""
    split = algorithm_named(algorithm).halves
    return split(p) if split is not None else None


def halves(algorithm: str, p: int) -> str:
    """How ``algorithm`` splits into a reduce-scatter and an allgather on p ranks (its
    ``halves``): 'ring', 'halving-doubling' (p a power of two), 'MPI' (native: MPI_Reduce_scatter
    / MPI_Allgatherv), or 'allreduce' (no reduce-scatter half: the whole allreduce, each rank
    keeping its block, and MPI's allgather; recursive doubling, multicolor, hierarchical and
    halving-doubling on p not a power of two)."""
    split = _halves(algorithm, p)
    return split.label if split is not None else "allreduce"


def reduce_scatter(buf, comm, algorithm: str = "native", **options) -> tuple[int, int]:
    """Sum ``buf`` (contiguous, any shape) over ``comm`` and leave this rank's block of the sum,
    ``owned_block``, in place: returns ``(lo, hi)`` of the flat buffer; its other elements are
    scratch afterwards.  The first half of the algorithm's allreduce (``halves``); its adjoint
    is ``allgather``.  Cost (ring, halving-doubling): half the allreduce's,
    ``(p-1)/p n beta + (p-1)/p n gamma`` plus latencies."""
    flat, _ = _checked(buf, comm, algorithm, None, options)
    p, (lo, hi) = comm.Get_size(), owned_block(flat.size, comm)
    if p == 1:
        return lo, hi
    split = _halves(algorithm, p)
    msgs = Messages(comm, _next_tag(comm))
    if split is not None:
        _run(split.reduce_scatter(flat, msgs), msgs)
    else:
        _run(ALGORITHMS[algorithm].steps(flat, msgs, **options), msgs)
    return lo, hi


def allgather(buf, comm, algorithm: str = "native", **options) -> None:
    """Every rank's block (``owned_block``) of ``buf`` to every rank, in place: the adjoint of
    ``reduce_scatter`` (the second half of the algorithm's allreduce; MPI's Allgatherv where
    the algorithm has no allgather half).  Cost: ``(p-1)/p n beta`` plus latencies."""
    flat, _ = _checked(buf, comm, algorithm, None, options)
    p = comm.Get_size()
    if p == 1:
        return
    split = _halves(algorithm, p)
    msgs = Messages(comm, _next_tag(comm))
    if split is not None:
        _run(split.allgather(flat, msgs), msgs)
    else:
        msgs.allgather_blocks(flat)


# ---------------------------------------------------------------- measuring the cost model's constants

def ping_pong(comm, nbytes: int, repeats: int) -> list[float] | None:
    """One-way times (half round trips) of a native Send/Recv of ``nbytes`` between ranks 0
    and 1 of ``comm``, after one warm-up round trip: the list on rank 0, None elsewhere
    (collective: every rank joins the barriers).  alpha is the time of a tiny message,
    beta the slope in bytes (``refimpl plan --calibrate``, scripts/bench_allreduce.py)."""
    import time

    import numpy
    buf = numpy.zeros(max(int(nbytes), 1), numpy.uint8)
    rank = comm.Get_rank()
    times = []
    for _ in range(repeats + 1):
        comm.Barrier()
        start = time.perf_counter()
        if rank == 0:
            comm.Send(buf, dest=1)
            comm.Recv(buf, source=1)
        elif rank == 1:
            comm.Recv(buf, source=0)
            comm.Send(buf, dest=0)
        times.append((time.perf_counter() - start) / 2)
    return times[1:] if rank == 0 else None
