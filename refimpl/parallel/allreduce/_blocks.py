"""Block offsets shared by the algorithms (balanced blocks, ``partition.block_range``)."""
from __future__ import annotations


def offsets(n: int, parts: int) -> list[int]:
    """Start of each balanced block of n elements over ``parts`` blocks, plus n."""
    from ..partition import block_range        # on first use: building the command line needs none
    return [block_range(n, parts, i)[0] for i in range(parts)] + [n]
