"""refimpl/data/ordered_pool.py: results in the tasks' order, bounded look-ahead, the first error."""
import threading
import time

import pytest

from refimpl.data.ordered_pool import AHEAD, ordered_map, usable_cores


def slow_square(x):
    time.sleep(0.001 * ((7 * x) % 5))           # later tasks often finish first
    return x * x


@pytest.mark.parametrize("workers", [1, 2, 3, 8])
def test_results_come_in_the_tasks_order(workers):
    assert list(ordered_map(slow_square, range(40), workers)) == [x * x for x in range(40)]


def test_tasks_are_read_lazily_and_at_most_workers_times_ahead_wait():
    taken, workers = [], 3

    def tasks():
        for i in range(100):
            taken.append(i)
            yield i
    results = ordered_map(slow_square, tasks(), workers)
    for k in range(10):
        assert next(results) == k * k
        assert len(taken) <= k + 1 + workers * AHEAD
    results.close()
    assert len(taken) < 100


def test_the_first_failing_task_is_raised_and_the_rest_cancelled():
    started = []
    lock = threading.Lock()

    def fn(x):
        with lock:
            started.append(x)
        if x in (3, 5):
            time.sleep(0.05 if x == 3 else 0)   # 5 fails first in time, 3 first in order
            raise ValueError(f"task {x}")
        return x

    with pytest.raises(ValueError, match="task 3"):
        list(ordered_map(fn, range(1000), 2))
    time.sleep(0.1)
    assert len(started) < 20                    # nothing started after the error but what was queued


def test_bad_worker_counts_and_the_cores():
    with pytest.raises(ValueError, match="workers must be >= 1"):
        list(ordered_map(slow_square, range(3), 0))
    assert usable_cores() >= 1
