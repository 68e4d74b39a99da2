"""Halo exchange (fill the ghosts) and its adjoint (add ghost gradients back to their owners).

A rank owns a balanced block of the input and needs the input range of its
output block (``partition.HaloPlan``).  Both live in one work array per call
covering the hull of the two ranges (they need not overlap: with stride > kernel
a rank may not need all of its own block):

    forward(x)      work[owned] = x
                    for axis in D, H, W:   send owned pieces, receive ghost pieces
                    return work[needed]            # own data + ghosts, ready for the local op

    adjoint(g)      work[needed] = g
                    for axis in W, H, D:   send ghost pieces back, ADD received pieces into
                                           the owned block, then CLEAR the ghosts sent
                    return work[owned]

A message along axis ``a`` spans the needed range on the earlier axes, so ghosts
received there (edges, corners) are forwarded on; the adjoint walks the axes in
reverse so they travel back the same way.  Forgetting the add or the clear
double-counts gradients.  Needs wider than a neighbour's block are served by every
owner holding a piece; ranks with empty blocks neither send nor receive.

Messages are non-blocking (Irecv/Isend + Waitall) per axis, every buffer goes
through ``buffers`` (CUDA-aware or host-staged), and ``bytes_sent`` counts the
bytes actually handed to MPI so the benchmark can compare with
``partition.bytes_sent``.
"""
from __future__ import annotations

from mpi4py import MPI

from ..backend import array_module
from .buffers import finish_recv, recv_buffer, send_buffer
from .partition import HaloPlan, grid_rank

HALO_TAG = 7100  # + axis


def _hull(a, b):
    """Smallest range covering the non-empty ones of two ranges."""
    ranges = [r for r in (a, b) if r[1] > r[0]] or [a]
    return min(r[0] for r in ranges), max(r[1] for r in ranges)


class HaloExchange:
    """Halo exchange of ``plan`` on ``grid.spatial_comm``; arrays are (..., D, H, W) blocks."""

    def __init__(self, plan: HaloPlan, grid):
        if tuple(plan.grid_dims) != tuple(grid.spatial_dims):
            raise ValueError(f"plan is for a {plan.grid_dims} spatial grid, grid has {grid.spatial_dims}")
        self.plan = plan
        self.comm = grid.spatial_comm
        self.coords = grid.spatial_coords
        self.owned = plan.owned(self.coords)
        self.needed = plan.needed(self.coords)
        self.frame = tuple(_hull(o, n) for o, n in zip(self.owned, self.needed))
        self.bytes_sent = 0  # cumulative, forward and adjoint
        self.messages_sent = 0
        # nothing to exchange and nothing to reshape (one rank, or a window that reads
        # exactly the owned block): forward and adjoint are the identity, skip the copies
        self.identity = self.needed == self.owned and not any(
            plan.sends(self.coords, a) or plan.recvs(self.coords, a) for a in range(3))

    def _at(self, region):
        """Index of the global ``region`` (three ranges) in the work array."""
        return (Ellipsis,) + tuple(slice(a - f, b - f) for (a, b), (f, _) in zip(region, self.frame))

    def _work(self, like, lead):
        shape = tuple(lead) + tuple(b - a for a, b in self.frame)
        return array_module(like).zeros(shape, dtype=like.dtype)

    def forward(self, local_block):
        """(..., d, h, w) owned block -> (..., nd, nh, nw) needed input range with ghosts filled."""
        _check_extent("local_block", local_block, self.owned)
        if self.identity:
            return local_block
        work = self._work(local_block, local_block.shape[:-3])
        work[self._at(self.owned)] = local_block
        for axis in range(3):
            self._exchange(work, axis, adjoint=False)
        return work[self._at(self.needed)]

    def adjoint(self, extended_grad):
        """(..., nd, nh, nw) gradient of the extended array -> (..., d, h, w) gradient of the block."""
        if self.identity:
            _check_extent("extended_grad", extended_grad, self.needed)
            return extended_grad
        return self.adjoint_frame(extended_grad)[self._at(self.owned)]

    def adjoint_frame(self, extended_grad):
        """The whole work array after the reverse exchange: zero outside the owned block."""
        _check_extent("extended_grad", extended_grad, self.needed)
        work = self._work(extended_grad, extended_grad.shape[:-3])
        work[self._at(self.needed)] = extended_grad
        for axis in reversed(range(3)):
            self._exchange(work, axis, adjoint=True)
        return work

    def _exchange(self, work, axis, adjoint):
        """One axis: forward copies owned pieces into peers' ghosts; adjoint adds them back."""
        sends = self.plan.sends(self.coords, axis)
        recvs = self.plan.recvs(self.coords, axis)
        if adjoint:  # gradients travel the forward routes backwards
            sends, recvs = recvs, sends
        lead, tag = work.shape[:-3], HALO_TAG + axis
        requests, incoming, outgoing = [], [], []
        for m in recvs:
            buf = recv_buffer(lead + m.shape, work.dtype, like=work)
            requests.append(self.comm.Irecv(buf, source=grid_rank(m.peer, self.plan.grid_dims), tag=tag))
            incoming.append((m, buf))
        for m in sends:
            buf = send_buffer(work[self._at(m.region)])  # (..., region) packed piece
            requests.append(self.comm.Isend(buf, dest=grid_rank(m.peer, self.plan.grid_dims), tag=tag))
            outgoing.append(buf)  # keep alive until Waitall
            self.bytes_sent += buf.nbytes
            self.messages_sent += 1
        MPI.Request.Waitall(requests)
        for m, buf in incoming:
            if adjoint:
                work[self._at(m.region)] += finish_recv(buf, like=work)
            else:
                work[self._at(m.region)] = finish_recv(buf, like=work)
        if adjoint:
            for m in sends:  # the ghosts' gradients now live with their owners
                work[self._at(m.region)] = 0


def _check_extent(name, a, region):
    expected = tuple(b - s for s, b in region)
    if getattr(a, "ndim", 0) < 3 or tuple(a.shape[-3:]) != expected:
        raise ValueError(f"{name} must end in the spatial extent {expected}, got shape {getattr(a, 'shape', None)}")
