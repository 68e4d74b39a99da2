"""Chunk-parallel execution of the memory-bound passes NumPy runs on one core.

Why: a NumPy copy, add or strided gather runs on one core; only BLAS calls are
threaded.  In a conv whose GEMMs are cheap (Winograd) those passes are most of
the time, so with two cores PyTorch (whose kernels are all threaded) is twice
as fast while we are not.  The work of a conv is cut into independent chunks
anyway (to bound its temporaries); here ``W`` Python threads process the
chunks (the calling thread is worker 0), each with its own work buffers, while BLAS is limited to one thread so
the cores are not oversubscribed.  NumPy releases the GIL inside its copy,
ufunc and BLAS loops, so the threads run in parallel.

Determinism: worker ``w`` processes chunks ``w, w + W, w + 2W, ...`` in that
order (a static assignment), so any per-worker accumulation (a weight gradient)
is summed in an order that depends only on ``W``: the same thread count gives
bit-identical results, run after run.

``W`` is ``REFIMPL_THREADS`` when set (a positive integer; anything else is
refused; empty means unset), else the number of threads BLAS would use (``OMP_NUM_THREADS`` /
``OPENBLAS_NUM_THREADS``, default: the cores), and 1 for CuPy arrays (the
device runs its kernels in parallel already) or without ``threadpoolctl``.  Inside
``blas_held_single`` (the conv functions, the models' passes) BLAS stays on one thread
throughout and ``W`` is the count resolved on entry.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager

import numpy

from .. import settings

ENV_THREADS = "REFIMPL_THREADS"

_controller = None
_pool = None
_held = None            # the worker count while ``blas_held_single`` holds BLAS to one thread


def _blas_controller():
    """threadpoolctl's controller for the loaded BLAS (None without threadpoolctl)."""
    global _controller
    if _controller is None:
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:                                  # pragma: no cover - optional
            _controller = False
        else:
            _controller = ThreadpoolController().select(user_api="blas")
    return _controller or None


def thread_count(xp=numpy):
    """Worker threads for chunked passes on ``xp`` arrays (see the module docstring);
    ``REFIMPL_THREADS`` is read (refimpl.settings parses it) at every call."""
    if xp is not numpy:
        return 1
    if _held is not None:
        return _held
    threads = settings.env_setting(ENV_THREADS)
    if threads is not None:
        return threads
    ctl = _blas_controller()
    if ctl is None:
        return 1
    counts = [lib.num_threads for lib in ctl.lib_controllers]
    return max(1, min(counts)) if counts else 1


@contextmanager
def blas_held_single():
    """Hold BLAS to one thread for the duration where refimpl's workers are several (the
    worker count, resolved on entry, is kept meanwhile); re-entrant.  Also a decorator.

    Why: a BLAS call on several threads (a small Winograd weight transform, a conv of one
    tile, a linear layer) leaves OpenBLAS's threads spinning for a while after it returns,
    and on a 2-core machine they then take a core from the next chunked pass of our
    workers: the convs right after such calls ran up to 1.6x slower, the whole step
    several per cent (measured: docs/benchmarks.md, "Kernel choices").  The models' forward and backward and the conv entry points run inside this; BLAS is
    then never asked for threads of its own, the workers are the parallelism."""
    global _held
    if _held is not None:
        yield
        return
    workers, ctl = thread_count(), _blas_controller()
    if workers <= 1 or ctl is None:
        yield
        return
    _held = workers
    try:
        with ctl.limit(limits=1):
            yield
    finally:
        _held = None


def run(fn, tasks, workers):
    """``fn(w, task)`` for every task, worker ``w`` taking tasks ``w, w + workers, ...``
    in order; BLAS runs single-threaded meanwhile.  Exceptions propagate."""
    global _pool
    workers = max(1, min(workers, len(tasks)))
    if workers == 1:
        for task in tasks:
            fn(0, task)
        return
    if _pool is None or _pool._max_workers < workers:
        _pool = ThreadPoolExecutor(max_workers=max(workers, 2), thread_name_prefix="refimpl")

    def serial(w):
        for task in tasks[w::workers]:
            fn(w, task)

    def all_workers():
        # the calling thread is worker 0 (it is running already: one thread fewer to wake)
        futures = [_pool.submit(serial, w) for w in range(1, workers)]
        try:
            serial(0)
        finally:
            wait(futures)                   # every worker is done before anything is raised
        for f in futures:
            f.result()

    ctl = _blas_controller()
    if ctl is None or _held is not None:             # (held: BLAS is on one thread already)
        all_workers()
    else:
        with ctl.limit(limits=1):
            all_workers()


def sum_in_order(parts):
    """The per-worker (or per-block) partial results summed in list order, into the first
    (``None`` entries: workers that got no task); the order depends only on the list, so
    the same worker count gives the same bits."""
    total = parts[0]
    for part in parts[1:]:
        if part is not None:
            total += part
    return total


def copy(dst, src, workers):
    """``dst[...] = src`` (same shape, any strides), split over the two leading axes."""
    tasks = [(i, j) for i in range(dst.shape[0]) for j in range(dst.shape[1])] \
        if dst.ndim >= 2 else [None]
    if workers <= 1 or len(tasks) < 2:
        dst[...] = src
        return

    def one(_, ij):
        dst[ij] = src[ij]
    run(one, tasks, workers)


#: Elements per block of a blockwise elementwise pass (1 MiB of float32, measured): a few passes over one block stay in
#: the L2 cache instead of streaming the whole array each time.
ELEMENTWISE_BLOCK = 1 << 18


def elementwise(fn, out, *inputs):
    """``fn(out_block, *input_blocks)`` over cache-sized blocks of the flattened arrays,
    the blocks shared among the worker threads; ``out`` and ``inputs`` are C-contiguous
    arrays of one size.  On CuPy (or one block) it is the single call ``fn(out, *inputs)``.

    Why: an elementwise op written as several NumPy passes (a mask, a product, a sum)
    streams the whole array through memory once per pass; block by block, every pass
    after the first reads the cache, and the blocks run on all cores.
    """
    xp = numpy if all(type(a).__module__ == "numpy" for a in (out,) + inputs) else None
    workers = thread_count(numpy) if xp is not None else 1
    n = out.size
    if xp is None or n <= ELEMENTWISE_BLOCK:
        fn(out, *inputs)
        return out
    flat = [a.reshape(-1) for a in (out,) + inputs]

    def block(_, start):
        stop = min(start + ELEMENTWISE_BLOCK, n)
        fn(*(a[start:stop] for a in flat))
    run(block, list(range(0, n, ELEMENTWISE_BLOCK)), workers)
    return out
