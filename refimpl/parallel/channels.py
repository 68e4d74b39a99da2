"""Model-parallel collectives: (N, C, ...) activations whose channels are split over ``grid.model_comm``.

Model rank ``m`` of ``Pm`` holds the balanced channel slice ``channel_range(C, Pm, m)``
(``partition.block_range``: the first ``C % Pm`` slices one longer; empty when
``Pm > C``, and such a rank still joins every collective).  Two operators, each
the adjoint of the other (``<A x, y> == <x, A* y>``, tested in float64):

    operator                                         adjoint (its backward)
    allgather_channels       own slice -> all C      reduce_scatter_channels
    reduce_scatter_channels  partial sums of all C   allgather_channels
                             -> own slice, summed

Why these two.  A filter-parallel conv (each rank owns the filters of its output
slice) needs every input channel: ``allgather_channels`` before it; its input
gradient, computed from the rank's filters only, is a *partial* sum over the
model group, so the adjoint sums and scatters.  A channel-parallel conv (each rank
owns the weights of its input slice) computes partial sums of every output
channel: ``reduce_scatter_channels`` after it; the adjoint hands every rank the
whole output gradient.  (Dryden et al., SC'19; DistDL's DistributedChannelConv
and DistributedFeatureConv make the same pair.)

Layout on the wire: channels are moved to the front, ``(C, N, ...)``, so each
rank's slice is one contiguous run in rank order, and MPI's ``Allgatherv`` /
``Reduce_scatter`` move them (every buffer through ``buffers``: CUDA-aware or
host-staged).  Bytes: each rank exchanges ``(C - c_m) * N * V * itemsize``
(``V`` = voxels of its block): the slices of the others it receives in the
allgather, its partial sums of the others' slices it contributes to the
reduce-scatter.  ``moved_bytes`` is that formula, from the shapes alone;
``ChannelTraffic`` counts the buffers the calls hand to MPI (received in the
allgather, contributed in the reduce-scatter), so a test compares the two.  Gholami et al.'s
bandwidth term for either collective of ``n`` words over ``p`` ranks is
``beta * (p - 1) / p * n``: the same number when the slices are even.
"""
from __future__ import annotations

import math

from mpi4py import MPI

from ..backend import array_module
from .buffers import finish_recv, recv_buffer, send_buffer
from .partition import channel_counts, channel_range, moved_bytes  # noqa: F401 (re-exported)


class ChannelTraffic:
    """Bytes the channel collectives of this process exchanged with other ranks, summed."""

    def __init__(self):
        self.bytes = 0
        self.calls = 0

    def add(self, nbytes: int) -> None:
        self.bytes += int(nbytes)
        self.calls += 1


TRAFFIC = ChannelTraffic()


def _front(a):
    """(N, C, ...) -> contiguous (C, N, ...): a rank's channel slice becomes one run."""
    return array_module(a).ascontiguousarray(array_module(a).moveaxis(a, 1, 0))


def _back(a):
    return array_module(a).ascontiguousarray(array_module(a).moveaxis(a, 0, 1))


def allgather_channels(x_local, channels: int, comm):
    """(N, c_m, ...) own slice -> (N, channels, ...) on every model rank.  Adjoint: reduce_scatter_channels."""
    parts, me = comm.Get_size(), comm.Get_rank()
    counts = channel_counts(channels, parts)
    if x_local.shape[1] != counts[me]:
        raise ValueError(f"allgather_channels: rank {me} holds {x_local.shape[1]} channels, its slice of "
                         f"{channels} over {parts} ranks has {counts[me]}")
    if parts == 1:
        return x_local
    rest = tuple(x_local.shape[:1]) + tuple(x_local.shape[2:])            # (N, ...)
    per_channel = math.prod(rest)
    sizes = [c * per_channel for c in counts]
    displs = [sum(sizes[:r]) for r in range(parts)]
    flat = recv_buffer((sum(sizes),), x_local.dtype, like=x_local)
    send = send_buffer(_front(x_local))
    comm.Allgatherv(send, [flat, (sizes, displs)])
    TRAFFIC.add(flat.nbytes - send.nbytes)          # what this rank received from the others
    full = finish_recv(flat, like=x_local).reshape((channels,) + rest)     # (C, N, ...)
    return _back(full)                                                     # (N, C, ...)


def reduce_scatter_channels(y_full, comm):
    """(N, C, ...) on every model rank -> (N, c_m, ...): the sum over the group of the own slice.
    Adjoint: allgather_channels."""
    parts, me = comm.Get_size(), comm.Get_rank()
    if parts == 1:
        return y_full
    channels = y_full.shape[1]
    counts = channel_counts(channels, parts)
    rest = tuple(y_full.shape[:1]) + tuple(y_full.shape[2:])
    per_channel = math.prod(rest)
    own = recv_buffer((counts[me],) + rest, y_full.dtype, like=y_full)
    send = send_buffer(_front(y_full))
    comm.Reduce_scatter(send, own, recvcounts=[c * per_channel for c in counts], op=MPI.SUM)
    TRAFFIC.add(send.nbytes - own.nbytes)           # its partial sums of the others' slices
    return _back(finish_recv(own, like=y_full))                            # (N, c_m, ...)


__all__ = ["channel_range", "channel_counts", "moved_bytes", "ChannelTraffic", "TRAFFIC",
           "allgather_channels", "reduce_scatter_channels"]
