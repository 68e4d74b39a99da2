"""multicolor: multi-colour tree allreduce (Kumar et al. 2017, IBM).

The buffer is cut into k = ``colors`` parts.  Part c is reduced up and broadcast down a binary
tree (heap numbering: parent of v is (v-1)//2) over the ranks rotated by c*p//k, so each colour
has different interior nodes and roots and the k trees load different links.  The colours run
concurrently, level by level: in reduce round t the nodes at depth H-t of every tree send their
partial sums to their parents (H = floor(lg p)); the broadcast runs the levels back down.
Sends and receives between one pair of ranks in one round are posted in colour order on both
sides, so MPI's non-overtaking rule matches them.

Cost: 2H rounds (H up, H down), each one message latency.  A part is m = n/k bytes; the busiest
rank's port bounds the bandwidth term: it sends or receives one part per tree edge it touches,
D in all (the largest, over ranks, sum over colours of tree degree), and adds one part per
child, C in all (``tree_load``):

    T = 2 H alpha + D m beta + C m gamma        (D ~ 3k/2 for k >= 2)

Option ``colors``: the number of trees k, an int >= 1 (default 2).
"""
from __future__ import annotations

from ...backend import array_module
from ._blocks import offsets
from .registry import Algorithm, Option, is_int


def steps(flat, msgs, colors: int = 2):
    """k concurrent trees, reduce level by level up, broadcast level by level down."""
    p, rank = msgs.size, msgs.rank
    off = offsets(flat.size, colors)
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


def tree_load(p: int, colors: int) -> tuple[int, int]:
    """(D, C) of the cost: max over ranks of summed degree / children over the colours' trees."""
    degree, children = [0] * p, [0] * p
    for c in range(colors):
        shift = c * p // colors
        for v in range(p):
            r = (v + shift) % p
            kids = sum(1 for u in (2 * v + 1, 2 * v + 2) if u < p)
            degree[r] += kids + (v > 0)
            children[r] += kids
    return max(degree), max(children)


def cost(n, p, alpha, beta, gamma, colors: int = 2):
    """2 H alpha + (D beta + C gamma) n / k."""
    degree, children = tree_load(p, colors)
    return 2 * (p.bit_length() - 1) * alpha + (degree * beta + children * gamma) * n / colors


def check_colors(colors, p=None):
    if not is_int(colors) or colors < 1:
        raise ValueError(f"colors must be an int >= 1, got {colors!r}")


ALGORITHM = Algorithm(
    name="multicolor", steps=steps, cost=cost,
    options=(Option("colors", default=2, allowed="an int >= 1, the number of trees k", check=check_colors,
                    examples=(1, 3, 7)),),
    summary="IBM's multi-colour trees: the buffer in k parts, each reduced and broadcast over its own tree")
