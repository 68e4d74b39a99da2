"""halving_doubling (Rabenseifner): recursive-halving reduce-scatter + recursive-doubling allgather.

The buffer is cut into p' blocks.  Halving: with distance d = p'/2, ..., 1, a rank keeps the
half of its current block range on its side of bit d, sends the other half to rank XOR d and
adds the half it receives; it ends owning the sum of block ``new rank``.  Doubling runs the
same exchanges in reverse (d = 1, ..., p'/2), copying instead of adding.  Non-power-of-two p
folds like recursive doubling.

Cost (Thakur, Rabenseifner & Gropp 2005, sec. 4.4): lg p' halving rounds send and add
n/2, n/4, ..., n/p' bytes, (p'-1)/p' n in all; the doubling rounds send as much again:

    T = 2 lg p' alpha + 2 (p'-1)/p' n beta + (p'-1)/p' n gamma
        [+ 2 alpha + 2 n beta + n gamma if p != p']

Halves (p a power of two): the halving and the doubling.
"""
from __future__ import annotations

from ...backend import array_module
from ._blocks import offsets
from .recursive_doubling import fold, fold_cost, power_of_two_below
from .registry import Algorithm, Halves


def halving(flat, msgs, new, p2, real):
    """Reduce-scatter by recursive halving over p2 (a power of two) ranks numbered ``new``
    (``real(v)``: the comm rank of number v): at distance d = p2/2, ..., 1 a rank keeps the
    half of its block range on its side of bit d, sends the other half to number ``new ^ d``
    and adds the half it receives; it ends owning the sum of block ``new``."""
    xp = array_module(flat)
    off = offsets(flat.size, p2)
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


def doubling(flat, msgs, new, p2, real):
    """Allgather by recursive doubling (the halving's exchanges in reverse, copying): number
    ``new`` starts with block ``new`` and ends with all p2 blocks."""
    off = offsets(flat.size, p2)
    lo, hi, d = new, new + 1, 1
    while d < p2:
        olo, ohi = (lo - d, lo) if new & d else (hi, hi + d)
        peer = real(new ^ d)
        yield [msgs.send(flat[off[lo]:off[hi]], peer), msgs.recv(flat[off[olo]:off[ohi]], peer)]
        lo, hi, d = min(lo, olo), max(hi, ohi), d * 2


def steps(flat, msgs):
    """Fold, halving (reduce-scatter to block ``new``), doubling (allgather), unfold."""
    p2, new, partner, real = fold(msgs)
    xp = array_module(flat)
    if partner is not None:  # fold: even sends its data to odd
        if new is None:
            yield [msgs.send(flat, partner)]
        else:
            got = xp.empty_like(flat)
            yield [msgs.recv(got, partner)]
            flat += got
    if new is not None:
        yield from halving(flat, msgs, new, p2, real)     # reduce-scatter: block ``new``
        yield from doubling(flat, msgs, new, p2, real)    # allgather
    if partner is not None:  # unfold: odd returns the result
        yield [msgs.recv(flat, partner) if new is None else msgs.send(flat, partner)]


def cost(n, p, alpha, beta, gamma):
    """2 lg p' alpha + 2 (p'-1)/p' n beta + (p'-1)/p' n gamma + fold."""
    p2, lg, _ = power_of_two_below(p)
    return (2 * lg * alpha + 2 * (p2 - 1) / p2 * n * beta + (p2 - 1) / p2 * n * gamma
            + fold_cost(n, p, alpha, beta, gamma))


def _identity(v):
    return v


def _reduce_scatter(flat, msgs):
    """Recursive halving over all p ranks (a power of two): rank r ends with block r."""
    yield from halving(flat, msgs, msgs.rank, msgs.size, _identity)


def _allgather(flat, msgs):
    """Recursive doubling over all p ranks (a power of two)."""
    yield from doubling(flat, msgs, msgs.rank, msgs.size, _identity)


def _halves(p):
    """Halving and doubling when p is a power of two; else none (the fold has no halves)."""
    return Halves("halving-doubling", _reduce_scatter, _allgather) if p & (p - 1) == 0 else None


ALGORITHM = Algorithm(
    name="halving_doubling", steps=steps, cost=cost, halves=_halves,
    summary="Rabenseifner: recursive-halving reduce-scatter + recursive-doubling allgather")
