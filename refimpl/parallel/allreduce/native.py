"""native: MPI's own allreduce (the library picks its algorithm by message size).

Steps: one ``Iallreduce``; the blocking form calls ``MPI_Allreduce`` (MPI's tuned algorithms;
the non-blocking ``Iallreduce`` is usually slower).  Halves: ``MPI_Reduce_scatter`` and
``MPI_Allgatherv``.

Cost: modelled as the cheapest of ring, recursive doubling and halving-doubling, since MPI
libraries switch between them by size (Thakur, Rabenseifner & Gropp 2005, sec. 5: MPICH takes
recursive doubling for short messages, Rabenseifner's halving-doubling for long ones).
"""
from __future__ import annotations

from . import halving_doubling, recursive_doubling, ring
from .registry import Algorithm, Halves


def steps(flat, msgs):
    """MPI's own ``Iallreduce``, in place."""
    yield [msgs.allreduce(flat)]


def blocking(flat, msgs):
    """MPI's own blocking ``Allreduce``, in place."""
    msgs.allreduce(flat, blocking=True)


def cost(n, p, alpha, beta, gamma):
    """min(ring, recursive doubling, halving-doubling): the library switches by size."""
    return min(model.cost(n, p, alpha, beta, gamma) for model in (ring, recursive_doubling, halving_doubling))


def _reduce_scatter(flat, msgs):
    """``MPI_Reduce_scatter`` (blocking): rank r gets the sum of block r."""
    msgs.reduce_scatter_blocks(flat)
    yield from ()


def _allgather(flat, msgs):
    """``MPI_Allgatherv`` (blocking): every rank's block to every rank."""
    msgs.allgather_blocks(flat)
    yield from ()


ALGORITHM = Algorithm(
    name="native", steps=steps, cost=cost, blocking=blocking,
    halves=lambda p: Halves("MPI", _reduce_scatter, _allgather),
    summary="MPI's own Iallreduce (blocking: MPI_Allreduce); the library picks its algorithm by size")
