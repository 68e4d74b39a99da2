"""recursive_doubling: lg p rounds, each exchanging the *whole* buffer (latency-optimal).

In round k every rank swaps its partial sum with rank XOR 2^k and adds, so after lg p rounds
all ranks hold the total.  For p not a power of two the extra ranks fold in first and get the
result last (``fold``).

Cost (Thakur, Rabenseifner & Gropp 2005, sec. 4.4): lg p' rounds of one n-byte message and one
n-byte sum each, plus the fold when p != p' (p' the largest power of two <= p: two more
messages of n bytes, one more sum):

    T = lg p' (alpha + n beta + n gamma)  [+ 2 alpha + 2 n beta + n gamma if p != p']
"""
from __future__ import annotations

from ...backend import array_module
from .registry import Algorithm


def fold(msgs):
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


def power_of_two_below(p: int) -> tuple[int, int, bool]:
    """(p', lg p', p != p') for p >= 1: p' the largest power of two <= p."""
    p2 = 1 << (p.bit_length() - 1)
    return p2, p2.bit_length() - 1, p != p2


def fold_cost(n, p, alpha, beta, gamma):
    """The fold and unfold of a non-power-of-two p: 2 alpha + 2 n beta + n gamma (else 0)."""
    return (2 * alpha + 2 * n * beta + n * gamma) if power_of_two_below(p)[2] else 0.0


def steps(flat, msgs):
    """Fold, lg p' whole-buffer exchanges, unfold."""
    p2, new, partner, real = fold(msgs)
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


def cost(n, p, alpha, beta, gamma):
    """lg p' (alpha + n beta + n gamma) + fold."""
    lg = power_of_two_below(p)[1]
    return lg * (alpha + n * beta + n * gamma) + fold_cost(n, p, alpha, beta, gamma)


ALGORITHM = Algorithm(
    name="recursive_doubling", steps=steps, cost=cost,
    summary="lg p rounds exchanging the whole buffer: latency-optimal, for small messages")
