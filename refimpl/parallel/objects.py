"""Collectives of small Python objects (flags, shapes, counts) that release the GIL while they wait.

mpi4py's pickle-based ``comm.bcast``, ``comm.scatter``, ``comm.reduce`` and
``comm.allreduce`` (mpi4py 4.1, Open MPI 5) keep the GIL while they block:
measured here, a thread that ticks every 50 ms ticked 0-1 times during a
1-second ``bcast`` / ``allreduce`` wait, and 19 times during ``allgather``,
``gather``, ``Barrier``, ``Allreduce`` or ``Wait``.  A rank blocked in one of the
former freezes every other Python thread of its process, the fail-stop
watchdog (refimpl/failstop.py) included, so a peer that stops answering would
never be noticed.  refimpl therefore moves Python objects only with the calls
below, built on ``allgather`` (one small message per rank: these carry flags,
shapes and counts, never tensors).  ``tests/test_faults.py`` checks that no
GIL-holding call is left in the package.
"""
from __future__ import annotations


def bcast_object(comm, obj, root: int = 0):
    """Root's ``obj`` on every rank of ``comm`` (what ``comm.bcast`` does, waiting without the GIL)."""
    return comm.allgather(obj if comm.Get_rank() == root else None)[root]


def allreduce_sum(comm, value):
    """The sum of ``value`` over ``comm``, in rank order: the same result on every rank.

    ``value``: a Python number or a NumPy array (host); rank order makes the float
    sum identical everywhere (what ``comm.allreduce`` does, waiting without the GIL).
    """
    values = comm.allgather(value)
    total = values[0]
    for v in values[1:]:
        total = total + v
    return total


__all__ = ["bcast_object", "allreduce_sum"]
