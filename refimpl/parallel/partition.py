"""Pure index math for spatial partitioning (no MPI).

Balanced blocks: an extent ``n`` split over ``p`` ranks gives block ``i`` the
half-open range ``[start, start + size)`` with
``start = (n // p) * i + min(i, n % p)`` and ``size = n // p + (i < n % p)``:
the first ``n % p`` blocks get one extra element; blocks are empty when p > n.
The same map is used by compute, HDF5 hyperslab reads and gathers.
"""
from __future__ import annotations


def block_range(n: int, p: int, i: int) -> tuple[int, int]:
    """Half-open [start, stop) of block ``i`` when ``n`` elements split over ``p`` blocks."""
    if p < 1:
        raise ValueError(f"number of blocks p must be >= 1, got {p}")
    if not 0 <= i < p:
        raise ValueError(f"block index i must be in [0, {p}), got {i}")
    if n < 0:
        raise ValueError(f"extent n must be >= 0, got {n}")
    q, r = divmod(n, p)
    start = q * i + min(i, r)
    return start, start + q + (1 if i < r else 0)
