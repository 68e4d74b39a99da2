"""The fast routes: the same sums as ``refimpl/functional/``, computed faster.

``refimpl/functional/`` is the reference, each op written as the math reads;
a learner never needs this package to understand a result.  Here live the
routes that make training fast on CPUs and GPUs, each tested against the
reference (tests/test_reference.py and the ops' own tests):

- ``routes``: the one table: which route computes each op, and the thresholds that pick
  it (``resolve_algorithm``, ``flipped_kernel_pays``; the measurements behind them in
  docs/benchmarks.md, "Kernel thresholds");
- ``conv``: the conv routes' entry points, one per function of functional/conv3d.py;
- ``_im2col``: bounded column tiles, one GEMM per tile, no padded copy (host);
- ``_im2col_device``: one padded copy and batched GEMMs (CuPy, where every array
  operation is a kernel launch);
- ``_phase_grid``: strided convs as stride-1 problems, one per input phase;
- ``_width_taps``: a stride-1 forward with the width taps as column offsets (few input channels);
- ``_pointwise_conv``: 1x1x1 kernels as GEMMs on views of the arrays;
- ``winograd``: F(4x4x4, 3x3x3) and F(4x4x4, 2x2x2), exact in float64, within ``FLOAT32_BOUND`` in float32;
- ``pooling``, ``batch_norm``, ``group_norm``, ``pointwise``, ``losses``: the blocked, threaded passes of the
  other ops, each behind one dispatch function of its ``refimpl/functional/`` module (which
  hands the kernel the reference's per-block functions: a kernel never imports functional);
- ``_threads``: the worker threads (NumPy runs a pass on one core) and BLAS holding.

Submodules are imported explicitly (``from refimpl.kernels import conv``); the package itself
exports the two names used outside it: ``blas_held_single`` (the models hold BLAS to one thread
around their passes) and ``thread_count`` (the worker count).
"""
from ._threads import blas_held_single, thread_count

__all__ = ["blas_held_single", "thread_count"]
