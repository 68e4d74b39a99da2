"""One data-parallel SGD step on P ranks == one process on the whole batch (float64).

A tiny conv net is built identically on every rank; the global batch of B
samples (B not a multiple of P, so local batches differ in size) is split
into balanced blocks.  The loss is 0.5 * sum ||y - t||^2 / B over the global
batch; a rank's local gradient is scaled by P / B so that the data-group
*average* that GradientSynchronizer computes is exactly the global gradient.
"""
import numpy as np
import pytest

from refimpl.nn.activation import ReLU
from refimpl.nn.conv import Conv3d
from refimpl.nn.linear import Flatten, Linear
from refimpl.nn.module import Sequential
from refimpl.parallel.grad_sync import GradientSynchronizer
from refimpl.parallel.partition import block_range

LR = 0.1


def tiny_model():
    rng = np.random.default_rng(5)
    return Sequential(Conv3d(2, 3, 3, padding=1, rng=rng, dtype=np.float64), ReLU(),
                      Conv3d(3, 4, 2, stride=2, rng=rng, dtype=np.float64), ReLU(),
                      Flatten(), Linear(4 * 2 * 2 * 2, 3, rng=rng, dtype=np.float64))


def sgd_step(model, x, t, scale, sync=None):
    model.zero_grad()
    y = model(x)
    model.backward((y - t) * scale)
    if sync is not None:
        sync.finish()
    for p in model.parameters():
        p.data -= LR * p.grad


@pytest.mark.parametrize("algorithm,overlap,bucket_bytes,first", [
    ("native", True, 1 << 10, 256), ("ring", True, 0, 0), ("halving_doubling", False, 1 << 40, 1 << 40),
    ("native", False, 25 << 20, 1 << 20)])
def test_dp_step_equals_full_batch(comm, all_ranks_agree, algorithm, overlap, bucket_bytes, first):
    p, rank = comm.Get_size(), comm.Get_rank()
    batch = 2 * p + 1
    data = np.random.default_rng(17)
    x = data.standard_normal((batch, 2, 4, 4, 4))
    t = data.standard_normal((batch, 3))
    full = tiny_model()
    sgd_step(full, x, t, 1.0 / batch)

    model = tiny_model()
    sync = GradientSynchronizer(model.parameters(), comm, algorithm=algorithm, overlap=overlap,
                                bucket_bytes=bucket_bytes, first_bucket_bytes=first)
    lo, hi = block_range(batch, p, rank)
    sgd_step(model, x[lo:hi], t[lo:hi], p / batch, sync)

    err = max(float(np.abs(a.data - b.data).max() / np.abs(b.data).max())
              for a, b in zip(model.parameters(), full.parameters()))
    moved = min(float(np.abs(a.data - b.data).max()) for a, b in zip(model.parameters(), tiny_model().parameters()))
    all_ranks_agree(err <= 1e-12 and moved > 0, f"err={err:.3e} smallest update={moved:.3e}")
