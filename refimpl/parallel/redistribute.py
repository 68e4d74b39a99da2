"""Redistribution between whole samples and spatial blocks: linear operators with their adjoints.

Arrays are (..., D, H, W): any leading (N, C) dims travel along.  Block ``r`` of
``grid.spatial_comm`` is the balanced block at the row-major coordinates of
``r`` (``partition.block_slices``), the map ``ProcessGrid.local_block`` uses.

    operator                         adjoint (its backward)
    scatter_spatial  root -> blocks  gather_spatial          blocks -> root
    allgather_spatial blocks -> all  reduce_scatter_spatial  sum of copies -> own block
    broadcast        root -> all     sum_reduce              sum -> root

Non-root ranks learn shapes and dtypes from small object collectives (``bcast`` /
``allgather``) so every rank checks arguments identically and raises together.
Ranks with empty blocks send and receive nothing but join every collective.
Every buffer goes through ``buffers`` (CUDA-aware or host-staged).
"""
from __future__ import annotations

import math

from mpi4py import MPI

from ..backend import array_module, get_xp
from .buffers import finish_recv, recv_buffer, send_buffer
from .objects import bcast_object
from .partition import block_slices, grid_coords, grid_rank

REDIST_TAG = 7200


def _block(dhw, grid, rank):
    """Index of spatial rank ``rank``'s block in a (..., D, H, W) array."""
    return (Ellipsis,) + block_slices(dhw, grid.spatial_dims, grid_coords(rank, grid.spatial_dims))


def _block_shape(lead, dhw, grid, rank):
    return tuple(lead) + tuple(s.stop - s.start for s in _block(dhw, grid, rank)[1:])


def _global_shape(shapes, grid):
    """(lead, (D, H, W)) from every rank's block shape; ValueError on every rank if they don't tile."""
    dims = grid.spatial_dims
    lead = shapes[0][:-3]
    dhw = tuple(sum(shapes[grid_rank(tuple(c if b == a else 0 for b in range(3)), dims)][a - 3]
                    for c in range(dims[a])) for a in range(3))
    expected = [_block_shape(lead, dhw, grid, r) for r in range(len(shapes))]
    if [tuple(s) for s in shapes] != expected:
        raise ValueError(f"local blocks {shapes} are not the balanced blocks of a {lead + dhw} array "
                         f"over the spatial grid {dims}")
    return lead, dhw


def _run_memory(dtype):
    """An empty array marking the run's memory (host or device) for ranks that hold no input."""
    return get_xp().empty((0,), dtype=dtype)


def scatter_spatial(global_or_none, grid, root=0):
    """Root's (..., D, H, W) array -> every spatial rank's block.  Adjoint: gather_spatial."""
    comm = grid.spatial_comm
    shape, dtype = bcast_object(comm, (global_or_none.shape, global_or_none.dtype.str)
                                if comm.Get_rank() == root else None, root=root)
    lead, dhw = shape[:-3], shape[-3:]
    if comm.Get_rank() != root:
        like = _run_memory(dtype)
        local_shape = _block_shape(lead, dhw, grid, comm.Get_rank())
        if math.prod(local_shape) == 0:
            return get_xp().zeros(local_shape, dtype=dtype)
        buf = recv_buffer(local_shape, dtype, like=like)
        comm.Recv(buf, source=root, tag=REDIST_TAG)
        return finish_recv(buf, like=like)
    requests, outgoing = [], []
    for r in range(comm.Get_size()):
        piece = global_or_none[_block(dhw, grid, r)]
        if r != root and piece.size:
            outgoing.append(send_buffer(piece))
            requests.append(comm.Isend(outgoing[-1], dest=r, tag=REDIST_TAG))
    MPI.Request.Waitall(requests)
    return global_or_none[_block(dhw, grid, root)].copy()


def gather_spatial(local, grid, root=0):
    """Every spatial rank's block -> the whole (..., D, H, W) array on root (None elsewhere).

    Adjoint: scatter_spatial.
    """
    comm = grid.spatial_comm
    lead, dhw = _global_shape(comm.allgather(tuple(local.shape)), grid)
    if comm.Get_rank() != root:
        if local.size:
            comm.Send(send_buffer(local), dest=root, tag=REDIST_TAG)
        return None
    out = array_module(local).empty(tuple(lead) + dhw, dtype=local.dtype)
    for r in range(comm.Get_size()):
        shape = _block_shape(lead, dhw, grid, r)
        if r == root:
            out[_block(dhw, grid, r)] = local
        elif math.prod(shape):
            buf = recv_buffer(shape, local.dtype, like=local)
            comm.Recv(buf, source=r, tag=REDIST_TAG)
            out[_block(dhw, grid, r)] = finish_recv(buf, like=local)
    return out


def allgather_spatial(local, grid):
    """Every spatial rank's block -> the whole (..., D, H, W) array on every rank.

    Adjoint: reduce_scatter_spatial (sum the gradient copies, keep the own block).
    """
    comm = grid.spatial_comm
    shapes = comm.allgather(tuple(local.shape))
    lead, dhw = _global_shape(shapes, grid)
    counts = [math.prod(s) for s in shapes]
    displs = [sum(counts[:r]) for r in range(len(counts))]
    flat = recv_buffer((sum(counts),), local.dtype, like=local)  # blocks in rank order
    comm.Allgatherv(send_buffer(local), [flat, (counts, displs)])
    flat = finish_recv(flat, like=local)
    out = array_module(local).empty(tuple(lead) + dhw, dtype=local.dtype)
    for r, shape in enumerate(shapes):
        out[_block(dhw, grid, r)] = flat[displs[r]:displs[r] + counts[r]].reshape(shape)
    return out


def reduce_scatter_spatial(global_grad, grid):
    """Sum of every rank's (..., D, H, W) array, each rank keeping its own block.

    Adjoint of allgather_spatial.  Blocks are packed in rank order so that MPI's
    Reduce_scatter hands block r to rank r.
    """
    comm = grid.spatial_comm
    xp = array_module(global_grad)
    lead, dhw = global_grad.shape[:-3], global_grad.shape[-3:]
    pieces = [global_grad[_block(dhw, grid, r)].ravel() for r in range(comm.Get_size())]
    counts = [int(p.size) for p in pieces]
    own = recv_buffer(_block_shape(lead, dhw, grid, comm.Get_rank()), global_grad.dtype, like=global_grad)
    comm.Reduce_scatter(send_buffer(xp.concatenate(pieces)), own, recvcounts=counts, op=MPI.SUM)
    return finish_recv(own, like=global_grad)


def broadcast(x_or_none, comm, root=0):
    """Root's array -> a copy on every rank of ``comm`` (grid.spatial_comm or grid.data_comm).

    Adjoint: sum_reduce.
    """
    shape, dtype = bcast_object(comm, (x_or_none.shape, x_or_none.dtype.str)
                                if comm.Get_rank() == root else None, root=root)
    if comm.Get_rank() == root:
        comm.Bcast(send_buffer(x_or_none), root=root)
        return x_or_none.copy()
    like = _run_memory(dtype)
    buf = recv_buffer(shape, dtype, like=like)
    comm.Bcast(buf, root=root)
    return finish_recv(buf, like=like)


def sum_reduce(x, comm, root=0):
    """Sum of every rank's ``x`` on root (None elsewhere).  Adjoint: broadcast."""
    own = recv_buffer(x.shape, x.dtype, like=x) if comm.Get_rank() == root else None
    comm.Reduce(send_buffer(x), own, op=MPI.SUM, root=root)
    return finish_recv(own, like=x) if comm.Get_rank() == root else None
