"""ring: reduce-scatter then allgather around a ring of p ranks (bandwidth-optimal).

The buffer is cut into p balanced blocks.  In each of p-1 steps every rank sends one block to
its right neighbour and adds the block it receives from its left one (reduce-scatter): after
them position i owns the sum of block (i+1) % p.  p-1 more steps pass the finished blocks
around (allgather).

Cost (Thakur, Rabenseifner & Gropp 2005, sec. 4.1): each of the 2(p-1) steps is one message of
n/p bytes, and each reduce-scatter step adds n/p bytes:

    T = 2(p-1) alpha + 2 (p-1)/p n beta + (p-1)/p n gamma

Halves: the first p-1 steps and the last p-1, in the ring order that leaves rank r block r.
"""
from __future__ import annotations

from ...backend import array_module
from ._blocks import offsets
from .registry import Algorithm, Halves


def reduce_scatter_over(flat, msgs, members):
    """Ring reduce-scatter over ``members`` (comm ranks in ring order).

    Step s: send block (i - s) to the right, receive block (i - s - 1) from the
    left and add it in.  After q-1 steps position i owns the sum of block (i+1) % q.
    """
    q = len(members)
    if q == 1:
        return
    i = members.index(msgs.rank)
    right, left = members[(i + 1) % q], members[(i - 1) % q]
    off = offsets(flat.size, q)
    xp = array_module(flat)
    tmp = xp.empty(off[1] - off[0], dtype=flat.dtype)  # block 0 is the largest
    for s in range(q - 1):
        send, recv = (i - s) % q, (i - s - 1) % q
        got = tmp[:off[recv + 1] - off[recv]]
        yield [msgs.send(flat[off[send]:off[send + 1]], right),
               msgs.recv(got, left)]
        flat[off[recv]:off[recv + 1]] += got


def allgather_over(flat, msgs, members):
    """Ring allgather over ``members`` when position i owns block (i+1) % q."""
    q = len(members)
    i = members.index(msgs.rank)
    right, left = members[(i + 1) % q], members[(i - 1) % q]
    off = offsets(flat.size, q)
    for s in range(q - 1):
        send, recv = (i + 1 - s) % q, (i - s) % q
        yield [msgs.send(flat[off[send]:off[send + 1]], right),
               msgs.recv(flat[off[recv]:off[recv + 1]], left)]


def steps(flat, msgs):
    """Ring allreduce over all ranks in rank order."""
    members = list(range(msgs.size))
    yield from reduce_scatter_over(flat, msgs, members)
    yield from allgather_over(flat, msgs, members)


def cost(n, p, alpha, beta, gamma):
    """2(p-1) alpha + 2 (p-1)/p n beta + (p-1)/p n gamma."""
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta + (p - 1) / p * n * gamma


def _members(p):
    """Ring order in which position i owns block (i + 1) % p = rank (i + 1) % p: rank r owns block r."""
    return [(i + 1) % p for i in range(p)]


def _reduce_scatter(flat, msgs):
    """The ring's first p-1 steps: rank r ends with the sum of block r."""
    yield from reduce_scatter_over(flat, msgs, _members(msgs.size))


def _allgather(flat, msgs):
    """The ring's last p-1 steps: block r from rank r to every rank."""
    yield from allgather_over(flat, msgs, _members(msgs.size))


ALGORITHM = Algorithm(
    name="ring", steps=steps, cost=cost,
    halves=lambda p: Halves("ring", _reduce_scatter, _allgather),
    summary="reduce-scatter then allgather around a ring: bandwidth-optimal, latency linear in p")
