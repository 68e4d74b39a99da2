"""Allreduce (sum) built from point-to-point messages, with alpha-beta-gamma costs.

Every algorithm is a *step generator* ``fn(flat, msgs, **options)``: a plain
function that reduces a 1-D contiguous buffer ``flat`` in place, posts one
round of non-blocking messages (``msgs.send`` / ``msgs.recv``: Isend / Irecv),
``yield``-s their requests, and after the round has completed does the local
work (add what arrived, pick the next partner).  Run to the end with
``Waitall`` on each round it is a blocking allreduce (``allreduce``); advanced
a round at a time with ``Testall`` it is the non-blocking form that gradient
synchronisation overlaps with backward (``start_allreduce`` ->
``AllreduceHandle.test()`` / ``.wait()``): Python has no progress thread, so
the caller's ``test()`` calls are the progress engine.

Costs use the model of Thakur, Rabenseifner & Gropp (2005): sending a message
of n bytes costs ``alpha + n*beta``; reducing n bytes locally costs
``n*gamma``.  ``p`` is the number of ranks, ``lg`` the base-2 logarithm, and
``p'`` the largest power of two <= p.  ``predicted_time`` evaluates them.

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

import math

from mpi4py import MPI

from ..backend import array_module
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


def _offsets(n: int, parts: int) -> list[int]:
    """Start of each balanced block of n elements over ``parts`` blocks, plus n."""
    return [block_range(n, parts, i)[0] for i in range(parts)] + [n]


def _next_tag(comm) -> int:
    """A fresh tag for one allreduce on ``comm`` (the same on every rank)."""
    global _seq_keyval
    if _seq_keyval is None:
        _seq_keyval = MPI.Comm.Create_keyval()
    seq = comm.Get_attr(_seq_keyval) or 0
    comm.Set_attr(_seq_keyval, seq + 1)
    tag_ub = comm.Get_attr(MPI.TAG_UB) or 32767
    return _TAG_BASE + seq % (tag_ub - _TAG_BASE)


# ---------------------------------------------------------------- the algorithms

def native(flat, msgs):
    """MPI's own ``Iallreduce`` (the library picks its algorithm by size).

    Cost: at best the minimum of the algorithms below.
    """
    yield [msgs.allreduce(flat)]


def _ring_reduce_scatter(flat, msgs, members):
    """Ring reduce-scatter over ``members`` (comm ranks in ring order).

    Step s: send block (i - s) to the right, receive block (i - s - 1) from the
    left and add it in.  After q-1 steps position i owns the sum of block (i+1) % q.
    """
    q = len(members)
    if q == 1:
        return
    i = members.index(msgs.rank)
    right, left = members[(i + 1) % q], members[(i - 1) % q]
    off = _offsets(flat.size, q)
    xp = array_module(flat)
    tmp = xp.empty(off[1] - off[0], dtype=flat.dtype)  # block 0 is the largest
    for s in range(q - 1):
        send, recv = (i - s) % q, (i - s - 1) % q
        got = tmp[:off[recv + 1] - off[recv]]
        yield [msgs.send(flat[off[send]:off[send + 1]], right),
               msgs.recv(got, left)]
        flat[off[recv]:off[recv + 1]] += got


def _ring_allgather(flat, msgs, members):
    """Ring allgather over ``members`` when position i owns block (i+1) % q."""
    q = len(members)
    i = members.index(msgs.rank)
    right, left = members[(i + 1) % q], members[(i - 1) % q]
    off = _offsets(flat.size, q)
    for s in range(q - 1):
        send, recv = (i + 1 - s) % q, (i - s) % q
        yield [msgs.send(flat[off[send]:off[send + 1]], right),
               msgs.recv(flat[off[recv]:off[recv + 1]], left)]


def ring(flat, msgs):
    """Ring allreduce: reduce-scatter then allgather around a ring of p ranks.

    The buffer is cut into p balanced blocks; in each of p-1 steps every rank
    sends one block to its right neighbour and adds the block it receives from
    its left one (reduce-scatter), then p-1 more steps pass the finished blocks
    around (allgather).  Bandwidth-optimal, latency linear in p:

        T = 2(p-1) alpha + 2 (p-1)/p n beta + (p-1)/p n gamma
    """
    members = list(range(msgs.size))
    yield from _ring_reduce_scatter(flat, msgs, members)
    yield from _ring_allgather(flat, msgs, members)


def _fold(msgs):
    """Non-power-of-two fold (Thakur et al. 2005, sec. 4.4).

    With p = p' + rem (p' a power of two), the first 2*rem ranks pair up: even
    rank 2j gives its data to odd rank 2j+1 and sits out; the p' ranks left are
    renumbered 0..p'-1.  Returns (p', my new rank or None, partner of the fold
    or None, real rank of new rank).
    """
    p, rank = msgs.size, msgs.rank
    p2 = 1 << (p.bit_length() - 1)
    rem = p - p2
    if rank < 2 * rem:
        new = None if rank % 2 == 0 else rank // 2
        partner = rank + 1 if rank % 2 == 0 else rank - 1
    else:
        new, partner = rank - rem, None
    return p2, new, partner, (lambda v: 2 * v + 1 if v < rem else v + rem)


def recursive_doubling(flat, msgs):
    """Recursive doubling: lg p rounds, each exchanging the *whole* buffer.

    In round k every rank swaps its partial sum with rank XOR 2^k and adds, so
    after lg p rounds all ranks hold the total.  Latency-optimal; for a
    non-power-of-two p the extra ranks fold in first and get the result last:

        T = lg p' (alpha + n beta + n gamma)  [+ 2 alpha + 2 n beta + n gamma if p != p']
    """
    p2, new, partner, real = _fold(msgs)
    xp = array_module(flat)
    tmp = xp.empty_like(flat)
    if partner is not None:  # fold: even sends its data to odd
        if new is None:
            yield [msgs.send(flat, partner)]
        else:
            yield [msgs.recv(tmp, partner)]
            flat += tmp
    if new is not None:
        d = 1
        while d < p2:
            peer = real(new ^ d)
            yield [msgs.send(flat, peer), msgs.recv(tmp, peer)]
            flat += tmp
            d *= 2
    if partner is not None:  # unfold: odd returns the result
        yield [msgs.recv(flat, partner) if new is None else msgs.send(flat, partner)]


def halving_doubling(flat, msgs):
    """Rabenseifner: recursive-halving reduce-scatter + recursive-doubling allgather.

    The buffer is cut into p' blocks.  Halving: with distance d = p'/2, ..., 1,
    a rank keeps the half of its current block range on its side of bit d,
    sends the other half to rank XOR d and adds the half it receives; it ends
    owning the sum of block ``new rank``.  Doubling runs the same exchanges in
    reverse (d = 1, ..., p'/2), copying instead of adding.  Non-power-of-two p
    folds like recursive doubling:

        T = 2 lg p' alpha + 2 (p'-1)/p' n beta + (p'-1)/p' n gamma
            [+ 2 alpha + 2 n beta + n gamma if p != p']
    """
    p2, new, partner, real = _fold(msgs)
    xp = array_module(flat)
    if partner is not None:  # fold: even sends its data to odd
        if new is None:
            yield [msgs.send(flat, partner)]
        else:
            got = xp.empty_like(flat)
            yield [msgs.recv(got, partner)]
            flat += got
    if new is not None:
        yield from _halving(flat, msgs, new, p2, real)     # reduce-scatter: block ``new``
        yield from _doubling(flat, msgs, new, p2, real)    # allgather
    if partner is not None:  # unfold: odd returns the result
        yield [msgs.recv(flat, partner) if new is None else msgs.send(flat, partner)]


def multicolor(flat, msgs, colors: int = 2):
    """Multi-colour tree allreduce (Kumar et al. 2017, IBM).

    The buffer is cut into k = ``colors`` parts.  Part c is reduced up and
    broadcast down a binary tree (heap numbering: parent of v is (v-1)//2) over
    the ranks rotated by c*p//k, so each colour has different interior nodes
    and roots and the k trees load different links.  The colours run
    concurrently, level by level: in reduce round t the nodes at depth H-t of
    every tree send their partial sums to their parents (H = floor(lg p)); the
    broadcast runs the levels back down.  Sends and receives between one pair
    of ranks in one round are posted in colour order on both sides, so MPI's
    non-overtaking rule matches them.  With m = n/k and D (C) the largest, over
    ranks, sum over colours of tree degree (number of children):

        T = 2 H alpha + D m beta + C m gamma

    (the busiest rank's port bounds the bandwidth term; D ~ 3k/2 for k >= 2).
    """
    p, rank = msgs.size, msgs.rank
    off = _offsets(flat.size, colors)
    height = p.bit_length() - 1
    xp = array_module(flat)
    trees = []  # per colour: (my depth, parent or None, children) in real ranks
    for c in range(colors):
        shift = c * p // colors
        v = (rank - shift) % p
        kids = [(u + shift) % p for u in (2 * v + 1, 2 * v + 2) if u < p]
        parent = (v - 1) // 2 if v > 0 else None
        trees.append(((v + 1).bit_length() - 1, None if parent is None else (parent + shift) % p, kids))
    parts = [flat[off[c]:off[c + 1]] for c in range(colors)]
    got = [[xp.empty_like(parts[c]) for _ in trees[c][2]] for c in range(colors)]
    for t in range(height):  # reduce: depth height-t sends up to depth height-t-1
        requests = []
        for c, (depth, parent, kids) in enumerate(trees):
            if depth == height - t and parent is not None:
                requests.append(msgs.send(parts[c], parent))
            if depth == height - t - 1:
                requests += [msgs.recv(g, k) for g, k in zip(got[c], kids)]
        yield requests
        for c, (depth, parent, kids) in enumerate(trees):
            if depth == height - t - 1:
                for g in got[c]:
                    parts[c] += g
    for t in range(height):  # broadcast: depth t sends down to depth t+1
        requests = []
        for c, (depth, parent, kids) in enumerate(trees):
            if depth == t:
                requests += [msgs.send(parts[c], k) for k in kids]
            if depth == t + 1:
                requests.append(msgs.recv(parts[c], parent))
        yield requests


def default_group_size(p: int) -> int:
    """The largest divisor of p that is <= sqrt(p) (a near-square 2-D grid)."""
    return max(g for g in range(1, math.isqrt(p) + 1) if p % g == 0)


def hierarchical(flat, msgs, group_size: int | None = None):
    """2-D allreduce: reduce-scatter in groups, allreduce across, allgather in groups.

    Ranks form q = p/g groups of g consecutive ranks (e.g. the GPUs of a node).
    Ring reduce-scatter inside the group leaves each rank 1/g of the group sum;
    ranks with the same position in every group ring-allreduce that piece;
    a ring allgather inside the group reassembles the total.  Only n/g bytes
    cross groups per rank:

        T = 2(g-1) alpha + 2 (g-1)/g n beta + (g-1)/g n gamma
          + 2(q-1) alpha + 2 (q-1)/q (n/g) beta + (q-1)/q (n/g) gamma

    ``group_size`` must divide p (ValueError otherwise, raised on every rank
    before any message); None picks ``default_group_size(p)``.
    """
    p, rank = msgs.size, msgs.rank
    g = check_group_size(group_size, p)
    group, local = divmod(rank, g)
    mine = [group * g + j for j in range(g)]
    column = [h * g + local for h in range(p // g)]
    yield from _ring_reduce_scatter(flat, msgs, mine)
    lo, hi = block_range(flat.size, g, (local + 1) % g)
    yield from _ring_reduce_scatter(flat[lo:hi], msgs, column)
    yield from _ring_allgather(flat[lo:hi], msgs, column)
    yield from _ring_allgather(flat, msgs, mine)


def check_group_size(group_size, p: int) -> int:
    if group_size is None:
        return default_group_size(p)
    if isinstance(group_size, bool) or int(group_size) != group_size or not 1 <= group_size <= p \
            or p % group_size:
        raise ValueError(f"group_size must be a divisor of the number of ranks {p}, got {group_size!r}")
    return int(group_size)


ALGORITHMS = {
    "native": native,
    "ring": ring,
    "recursive_doubling": recursive_doubling,
    "halving_doubling": halving_doubling,
    "multicolor": multicolor,
    "hierarchical": hierarchical,
}
_OPTIONS = {"multicolor": ("colors",), "hierarchical": ("group_size",)}


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
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {sorted(ALGORITHMS)}, got {algorithm!r}")
    unknown = set(options) - set(_OPTIONS.get(algorithm, ()))
    if unknown:
        raise ValueError(f"algorithm {algorithm!r} takes no option(s) {sorted(unknown)}")
    if "colors" in options and (isinstance(options["colors"], bool) or int(options["colors"]) != options["colors"]
                                or options["colors"] < 1):
        raise ValueError(f"colors must be an int >= 1, got {options['colors']!r}")
    if algorithm == "hierarchical":
        check_group_size(options.get("group_size"), comm.Get_size())
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
    sum and ``buf`` is left as it was.  ``options``: ``colors`` (multicolor),
    ``group_size`` (hierarchical).  Every rank must start its allreduces on a
    communicator in the same order (as with any collective).
    """
    flat, result = _checked(buf, comm, algorithm, out, options)
    msgs = Messages(comm, _next_tag(comm))
    return AllreduceHandle(ALGORITHMS[algorithm](flat, msgs, **options), msgs, result)


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
    "native" calls the blocking ``MPI_Allreduce`` here (MPI's tuned algorithms;
    the non-blocking ``Iallreduce`` of the handle form is usually slower).
    """
    if comm.Get_size() > 1:
        LAYER_ALLREDUCES.bytes += int(buf.nbytes)
        LAYER_ALLREDUCES.calls += 1
    if algorithm == "native":
        flat, result = _checked(buf, comm, algorithm, out, options)
        Messages(comm, tag=0).allreduce(flat, blocking=True)
        return result
    return start_allreduce(buf, comm, algorithm, out=out, **options).wait()


# ---------------------------------------------------------------- the two halves

def owned_block(n: int, comm) -> tuple[int, int]:
    """Elements ``[lo, hi)`` of an n-element buffer this rank owns after ``reduce_scatter``:
    balanced blocks (``block_range``), block r on rank r, whatever the algorithm."""
    return block_range(n, comm.Get_size(), comm.Get_rank())


def _halving(flat, msgs, new, p2, real):
    """Reduce-scatter by recursive halving over p2 (a power of two) ranks numbered ``new``
    (``real(v)``: the comm rank of number v): at distance d = p2/2, ..., 1 a rank keeps the
    half of its block range on its side of bit d, sends the other half to number ``new ^ d``
    and adds the half it receives; it ends owning the sum of block ``new``."""
    xp = array_module(flat)
    off = _offsets(flat.size, p2)
    tmp = xp.empty(max(off[p2 // 2], flat.size - off[p2 // 2]), dtype=flat.dtype)  # largest half
    lo, hi, d = 0, p2, p2 // 2
    while d >= 1:
        mid = (lo + hi) // 2
        (klo, khi), (slo, shi) = ((mid, hi), (lo, mid)) if new & d else ((lo, mid), (mid, hi))
        got = tmp[:off[khi] - off[klo]]
        peer = real(new ^ d)
        yield [msgs.send(flat[off[slo]:off[shi]], peer), msgs.recv(got, peer)]
        flat[off[klo]:off[khi]] += got
        lo, hi, d = klo, khi, d // 2


def _doubling(flat, msgs, new, p2, real):
    """Allgather by recursive doubling (the halving's exchanges in reverse, copying): number
    ``new`` starts with block ``new`` and ends with all p2 blocks."""
    off = _offsets(flat.size, p2)
    lo, hi, d = new, new + 1, 1
    while d < p2:
        olo, ohi = (lo - d, lo) if new & d else (hi, hi + d)
        peer = real(new ^ d)
        yield [msgs.send(flat[off[lo]:off[hi]], peer), msgs.recv(flat[off[olo]:off[ohi]], peer)]
        lo, hi, d = min(lo, olo), max(hi, ohi), d * 2


def _identity(v):
    return v


def _block_counts(n: int, p: int) -> list[int]:
    """Elements of each rank's block (``owned_block``), for MPI's vector collectives."""
    return [b - a for a, b in (block_range(n, p, r) for r in range(p))]


def _run(steps, msgs) -> None:
    """Drive a step generator to its end (blocking)."""
    handle = AllreduceHandle(steps, msgs, None)
    handle.wait()


def _ring_members(p):
    """Ring order in which position i owns block (i + 1) % p = rank (i + 1) % p: rank r owns block r."""
    return [(i + 1) % p for i in range(p)]


def halves(algorithm: str, p: int) -> str:
    """How ``algorithm`` splits into a reduce-scatter and an allgather on p ranks: 'ring',
    'halving-doubling' (p a power of two), 'MPI' (native: MPI_Reduce_scatter / MPI_Allgatherv),
    or 'allreduce' (no reduce-scatter half: the whole allreduce, each rank keeping its block,
    and MPI's allgather; recursive doubling, multicolor, hierarchical and halving-doubling on
    p not a power of two)."""
    if algorithm == "ring":
        return "ring"
    if algorithm == "native":
        return "MPI"
    if algorithm == "halving_doubling" and p & (p - 1) == 0:
        return "halving-doubling"
    return "allreduce"


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
    kind = halves(algorithm, p)
    msgs = Messages(comm, _next_tag(comm))
    if kind == "ring":
        _run(_ring_reduce_scatter(flat, msgs, _ring_members(p)), msgs)
    elif kind == "halving-doubling":
        _run(_halving(flat, msgs, msgs.rank, p, _identity), msgs)
    elif kind == "MPI":
        counts = _block_counts(flat.size, p)
        whole = send_buffer(flat)
        mine = recv_buffer((hi - lo,), flat.dtype, like=flat)
        comm.Reduce_scatter(whole, mine, counts, op=MPI.SUM)
        flat[lo:hi] = finish_recv(mine, like=flat)
    else:
        _run(ALGORITHMS[algorithm](flat, msgs, **options), msgs)
    return lo, hi


def allgather(buf, comm, algorithm: str = "native", **options) -> None:
    """Every rank's block (``owned_block``) of ``buf`` to every rank, in place: the adjoint of
    ``reduce_scatter`` (the second half of the algorithm's allreduce; MPI's Allgatherv where
    the algorithm has no allgather half).  Cost: ``(p-1)/p n beta`` plus latencies."""
    flat, _ = _checked(buf, comm, algorithm, None, options)
    p = comm.Get_size()
    if p == 1:
        return
    kind = halves(algorithm, p)
    msgs = Messages(comm, _next_tag(comm))
    if kind == "ring":
        _run(_ring_allgather(flat, msgs, _ring_members(p)), msgs)
    elif kind == "halving-doubling":
        _run(_doubling(flat, msgs, msgs.rank, p, _identity), msgs)
    else:
        counts = _block_counts(flat.size, p)
        lo, hi = owned_block(flat.size, comm)
        mine = send_buffer(flat[lo:hi])
        whole = recv_buffer((flat.size,), flat.dtype, like=flat)
        comm.Allgatherv(mine, [whole, counts])
        flat[...] = finish_recv(whole, like=flat)


# ---------------------------------------------------------------- cost model

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


def _tree_load(p: int, colors: int) -> tuple[int, int]:
    """(D, C) of the multicolor model: max over ranks of summed degree / children."""
    degree, children = [0] * p, [0] * p
    for c in range(colors):
        shift = c * p // colors
        for v in range(p):
            r = (v + shift) % p
            kids = sum(1 for u in (2 * v + 1, 2 * v + 2) if u < p)
            degree[r] += kids + (v > 0)
            children[r] += kids
    return max(degree), max(children)


def predicted_time(algorithm: str, n_bytes: float, p: int, alpha: float, beta: float,
                   gamma: float = 0.0, **kw) -> float:
    """Alpha-beta-gamma prediction (seconds) of one allreduce of ``n_bytes`` on ``p`` ranks.

    ``alpha``: seconds per message, ``beta``: seconds per byte sent, ``gamma``:
    seconds per byte reduced.  ``kw``: ``colors`` (multicolor, default 2),
    ``group_size`` (hierarchical).  "native" is modelled as the best of ring,
    recursive doubling and halving-doubling (MPI libraries switch by size).
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {sorted(ALGORITHMS)}, got {algorithm!r}")
    if p < 1:
        raise ValueError(f"p must be >= 1, got {p}")
    n, a, b, c = float(n_bytes), alpha, beta, gamma
    if p == 1:
        return 0.0
    p2 = 1 << (p.bit_length() - 1)
    lg = p2.bit_length() - 1
    fold = (2 * a + 2 * n * b + n * c) if p != p2 else 0.0
    if algorithm == "native":
        return min(predicted_time(name, n_bytes, p, alpha, beta, gamma)
                   for name in ("ring", "recursive_doubling", "halving_doubling"))
    if algorithm == "ring":
        return 2 * (p - 1) * a + 2 * (p - 1) / p * n * b + (p - 1) / p * n * c
    if algorithm == "recursive_doubling":
        return lg * (a + n * b + n * c) + fold
    if algorithm == "halving_doubling":
        return 2 * lg * a + 2 * (p2 - 1) / p2 * n * b + (p2 - 1) / p2 * n * c + fold
    if algorithm == "multicolor":
        k = kw.get("colors", 2)
        degree, children = _tree_load(p, k)
        return 2 * (p.bit_length() - 1) * a + (degree * b + children * c) * n / k
    g = check_group_size(kw.get("group_size"), p)  # hierarchical
    q = p // g
    return (2 * (g - 1) * a + 2 * (g - 1) / g * n * b + (g - 1) / g * n * c
            + 2 * (q - 1) * a + 2 * (q - 1) / q * (n / g) * b + (q - 1) / q * (n / g) * c)
