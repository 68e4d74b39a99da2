"""The distributed machinery; each primitive is a linear operator with its adjoint beside it.

- ``partition``: block ranges, needed input ranges, halo plans (pure index math, no MPI)
- ``grid``: ``ProcessGrid`` over (sample, depth, height, width) Cartesian communicators
- ``halo``: ``HaloExchange.forward`` (fill ghosts) / ``.adjoint`` (add ghosts back, clear)
- ``redistribute``: scatter/gather, allgather/reduce-scatter, broadcast/sum-reduce
- ``allreduce``: the allreduce algorithms, one module each (steps, alpha-beta cost, options), one registry
- ``collectives``: runs them from point-to-point messages, blocking or overlapped
- ``grad_sync``: bucketed gradient allreduce overlapped with backward
- ``buffers``: device buffers to MPI, CUDA-aware or staged through host memory

Submodules are imported explicitly (``from refimpl.parallel.grid import ProcessGrid``) so
that the pure index math in ``partition`` does not need mpi4py.
"""
