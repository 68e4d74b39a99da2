"""A function over tasks on worker threads, its results in the tasks' order: ``ordered_map``.

``refimpl convert`` spends its time per source file on work that is independent from file to
file (gunzip, CRC-32C, parsing, the int16 -> float32 transpose) and only then writes, in one
thread, in the order of the files (the dataset must not depend on how many workers read it).
So the reading runs on ``workers`` threads and the writer takes their results in order.

Threads, not processes: zlib's decompression and NumPy's gathers, xors and copies release
the GIL, so the readers run in parallel (40 gzip-ed 128^3 records into tmpfs on 2 cores: 4.9 s
on one thread, 3.4 s on two, 3.1 s on three), while a process pool spent more on carrying each
32 MiB sample back through its pipe (121 ms) than reading it (about 100 ms): 6.3 s on two.

- at most ``workers * AHEAD`` tasks are submitted and not yet taken, so memory stays bounded
  when the writer is slower than the readers (``Executor.map`` would submit every task first);
- an exception a task raises is raised here, in order: the first failing task's, as a
  sequential loop would;
- leaving early (an exception, Ctrl-C, the consumer closing the generator) cancels what has not
  started; a task already running ends with its task (threads cannot be stopped).
"""
from __future__ import annotations

import collections
import os
from concurrent.futures import ThreadPoolExecutor

#: Tasks in flight per worker: one running, one done or queued behind it.
AHEAD = 2


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def ordered_map(fn, tasks, workers: int):
    """``fn(task)`` for each of ``tasks`` (an iterable, read lazily), in order; on this thread
    when ``workers == 1``, else on ``workers`` threads."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if workers == 1:
        yield from map(fn, tasks)
        return
    pool = ThreadPoolExecutor(workers, thread_name_prefix="refimpl-reader")
    pending = collections.deque()
    try:
        for task in tasks:
            pending.append(pool.submit(fn, task))
            if len(pending) >= workers * AHEAD:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["AHEAD", "ordered_map", "usable_cores"]
