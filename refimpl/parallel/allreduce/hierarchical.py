"""hierarchical: 2-D allreduce: reduce-scatter in groups, allreduce across, allgather in groups.

Ranks form q = p/g groups of g consecutive ranks (e.g. the GPUs of a node).  Ring
reduce-scatter inside the group leaves each rank 1/g of the group sum; ranks with the same
position in every group ring-allreduce that piece; a ring allgather inside the group
reassembles the total.

Cost: the ring's (``ring``) over g ranks on n bytes, plus the ring's over q ranks on the n/g
bytes each rank owns after the first reduce-scatter.  Only n/g bytes cross groups per rank:

    T = 2(g-1) alpha + 2 (g-1)/g n beta + (g-1)/g n gamma
      + 2(q-1) alpha + 2 (q-1)/q (n/g) beta + (q-1)/q (n/g) gamma

Option ``group_size``: g, a divisor of p (ValueError otherwise, raised on every rank before
any message); None (the default) picks ``default_group_size(p)``, a near-square 2-D grid.
"""
from __future__ import annotations

import math

from .registry import Algorithm, Option, is_int
from .ring import allgather_over, reduce_scatter_over


def default_group_size(p: int) -> int:
    """The largest divisor of p that is <= sqrt(p) (a near-square 2-D grid)."""
    return max(g for g in range(1, math.isqrt(p) + 1) if p % g == 0)


def check_group_size(group_size, p: int) -> int:
    """The group size to use on p ranks: ``group_size``, or the default for None; ValueError
    unless it divides p."""
    if group_size is None:
        return default_group_size(p)
    if isinstance(group_size, bool) or int(group_size) != group_size or not 1 <= group_size <= p \
            or p % group_size:
        raise ValueError(f"group_size must be a divisor of the number of ranks {p}, got {group_size!r}")
    return int(group_size)


def steps(flat, msgs, group_size: int | None = None):
    """Ring reduce-scatter in the group, ring allreduce of my piece across groups, ring allgather."""
    from ..partition import block_range
    p, rank = msgs.size, msgs.rank
    g = check_group_size(group_size, p)
    group, local = divmod(rank, g)
    mine = [group * g + j for j in range(g)]
    column = [h * g + local for h in range(p // g)]
    yield from reduce_scatter_over(flat, msgs, mine)
    lo, hi = block_range(flat.size, g, (local + 1) % g)
    yield from reduce_scatter_over(flat[lo:hi], msgs, column)
    yield from allgather_over(flat[lo:hi], msgs, column)
    yield from allgather_over(flat, msgs, mine)


def cost(n, p, alpha, beta, gamma, group_size: int | None = None):
    """A ring over g on n bytes, then a ring over q = p/g on n/g bytes."""
    g = check_group_size(group_size, p)
    q = p // g
    return (2 * (g - 1) * alpha + 2 * (g - 1) / g * n * beta + (g - 1) / g * n * gamma
            + 2 * (q - 1) * alpha + 2 * (q - 1) / q * (n / g) * beta + (q - 1) / q * (n / g) * gamma)


def check(group_size, p=None):
    """None, or an int >= 1; with p, a divisor of p."""
    if p is not None:
        check_group_size(group_size, p)
    elif group_size is not None and (not is_int(group_size) or group_size < 1):
        raise ValueError(f"group_size must be an int >= 1 that divides the number of ranks, got {group_size!r}")


ALGORITHM = Algorithm(
    name="hierarchical", steps=steps, cost=cost,
    options=(Option("group_size", default=None, check=check, examples=(1,),      # 1 divides every p
                    allowed="an int dividing the number of ranks p, the ranks per group g; default the "
                            "largest divisor <= sqrt p"),),
    summary="2-D: ring reduce-scatter in groups of g ranks, ring allreduce across groups, ring allgather")
