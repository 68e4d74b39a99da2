"""Allreduce-sum as a linear operator is its own adjoint: the dot-product test for every algorithm.

F maps the per-rank vectors (x_r) to the replicated sum (sum_s x_s on every rank), so
<F x, y> = sum_r <sum_s x_s, y_r> = sum_s <x_s, sum_r y_r> = <x, F y>.  Backward
through an allreduce of replicated values is therefore another allreduce.
"""
import numpy as np
import pytest

from refimpl.parallel.collectives import ALGORITHMS, allreduce


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
@pytest.mark.parametrize("size", [1, 7, 1000])
def test_allreduce_is_self_adjoint(comm, all_ranks_agree, algorithm, size):
    rng = np.random.default_rng([comm.rank, size])
    x, y = rng.standard_normal(size), rng.standard_normal(size)
    fx, fy = allreduce(x.copy(), comm, algorithm), allreduce(y.copy(), comm, algorithm)
    lhs = comm.allreduce(float(fx @ y))
    rhs = comm.allreduce(float(x @ fy))
    all_ranks_agree(abs(lhs - rhs) <= 1e-12 * max(abs(lhs), 1.0), f"{algorithm}: {lhs} vs {rhs}")
