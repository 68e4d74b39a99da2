"""Batch norm (training and eval) vs PyTorch float64, finite differences, and the split API.

The split test mimics the spatially partitioned layer without MPI: local sums of
D-slabs are added (what Allreduce does) and each slab finishes with the global sums.
"""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from refimpl.functional.batch_norm import (
    batch_norm3d, batch_norm3d_backward, batch_norm_backward, batch_norm_backward_local_sums,
    batch_norm_forward, batch_norm_local_sums, batch_norm_stats, update_running_stats)

torch = pytest.importorskip("torch", reason="PyTorch absent: pip install 'refimpl[oracle]'")


def rel_err(a, b, floor=1e-300):
    """max|a - b| / max(max|b|, floor)."""
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / max(np.max(np.abs(b)), floor))


def directional_fd_err(f, x, dx, dy, h=1e-6, seed=0):
    """|<dy, (f(x+hv) - f(x-hv)) / 2h> - <dx, v>| relative, for a random direction v."""
    v = np.random.default_rng(seed).standard_normal(x.shape)
    lhs = np.sum(dy * (f(x + h * v) - f(x - h * v))) / (2 * h)
    rhs = np.sum(dx * v)
    return abs(lhs - rhs) / max(abs(rhs), 1e-12)


def make_case(shape, seed):
    rng = np.random.default_rng(seed)
    c = shape[1]
    x = rng.standard_normal(shape) * rng.uniform(0.5, 3, (1, c, 1, 1, 1)) + rng.uniform(-2, 2, (1, c, 1, 1, 1))
    return (x, rng.uniform(0.5, 1.5, c), rng.standard_normal(c), rng.standard_normal(c),
            rng.uniform(0.5, 2, c), rng.standard_normal(shape))


shapes = st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 5), st.integers(1, 5),
                   st.integers(1, 5)).filter(lambda s: s[0] * s[2] * s[3] * s[4] >= 2)


@given(shapes, st.integers(0, 2**31), st.sampled_from([True, False]))
def test_batch_norm3d_matches_torch(shape, seed, training):
    x, gamma, beta, rmean, rvar, dy = make_case(shape, seed)
    rmean_t, rvar_t = torch.tensor(rmean), torch.tensor(rvar)
    xt, gt, bt = (torch.tensor(a, requires_grad=True) for a in (x, gamma, beta))
    yt = torch.nn.functional.batch_norm(xt, rmean_t, rvar_t, gt, bt, training=training,
                                        momentum=0.1, eps=1e-5)
    yt.backward(torch.tensor(dy))
    y, cache = batch_norm3d(x, gamma, beta, rmean, rvar, training=training, momentum=0.1, eps=1e-5)
    dx, dgamma, dbeta = batch_norm3d_backward(dy, cache)
    assert rel_err(y, yt.detach().numpy()) <= 1e-10
    # dx is a difference of O(|dy| gamma inv_std) terms that can nearly cancel (n = 2 makes
    # it ~eps/var): measure its error on that scale
    scale = np.max(np.abs(dy)) * np.max(gamma / np.sqrt(x.var(axis=(0, 2, 3, 4)) + 1e-5))
    assert rel_err(dx, xt.grad.numpy(), floor=scale) <= 1e-10
    assert rel_err(dgamma, gt.grad.numpy()) <= 1e-10
    assert rel_err(dbeta, bt.grad.numpy()) <= 1e-10
    assert rel_err(rmean, rmean_t.numpy()) <= 1e-10   # updated in place (training) or untouched
    assert rel_err(rvar, rvar_t.numpy()) <= 1e-10


@pytest.mark.parametrize("wrt", ["x", "gamma", "beta"])
def test_batch_norm3d_finite_differences(wrt):
    x, gamma, beta, _, _, dy = make_case((2, 3, 3, 4, 2), 7)
    args = {"x": x, "gamma": gamma, "beta": beta}

    def f(v):
        a = dict(args, **{wrt: v})
        return batch_norm3d(a["x"], a["gamma"], a["beta"])[0]

    dx, dgamma, dbeta = batch_norm3d_backward(dy, batch_norm3d(x, gamma, beta)[1])
    grad = {"x": dx, "gamma": dgamma, "beta": dbeta}[wrt]
    assert directional_fd_err(f, args[wrt], grad, dy) < 1e-6


def test_split_sums_equal_unpartitioned():
    """Sum local sums over D-slabs (as Allreduce would), finish per slab, compare."""
    x, gamma, beta, _, _, dy = make_case((2, 3, 7, 4, 5), 11)
    shift = np.array([0.3, -1.0, 2.0])
    y_ref, cache_ref = batch_norm3d(x, gamma, beta)
    dx_ref, dg_ref, db_ref = batch_norm3d_backward(dy, cache_ref)
    slabs = [slice(0, 3), slice(3, 3), slice(3, 7)]   # uneven, with an empty block
    local = [batch_norm_local_sums(x[:, :, s], shift) for s in slabs]
    count = sum(c for c, _, _ in local)
    mean, var, inv_std = batch_norm_stats(count, sum(s1 for _, s1, _ in local),
                                          sum(s2 for _, _, s2 in local), 1e-5, shift)
    outs = [batch_norm_forward(x[:, :, s], mean, inv_std, gamma, beta) for s in slabs]
    bsums = [batch_norm_backward_local_sums(dy[:, :, s], c) for s, (_, c) in zip(slabs, outs)]
    sum_dy, sum_dy_xhat = sum(a for a, _ in bsums), sum(b for _, b in bsums)
    grads = [batch_norm_backward(dy[:, :, s], c, sum_dy, sum_dy_xhat, count)
             for s, (_, c) in zip(slabs, outs)]
    assert rel_err(np.concatenate([y for y, _ in outs], axis=2), y_ref) <= 1e-12
    assert rel_err(np.concatenate([g[0] for g in grads], axis=2), dx_ref) <= 1e-12
    assert rel_err(sum(g[1] for g in grads), dg_ref) <= 1e-12   # local dgamma: summed by the caller
    assert rel_err(sum(g[2] for g in grads), db_ref) <= 1e-12


def test_shifted_float32_statistics_survive_a_large_mean():
    """|mean| >> std: float64 accumulation + running-mean shift keep float32 stats accurate."""
    rng = np.random.default_rng(3)
    x = (1000.0 + 0.01 * rng.standard_normal((4, 2, 8, 8, 8))).astype(np.float32)
    ref = x.astype(np.float64).var(axis=(0, 2, 3, 4))
    count, s1, s2 = batch_norm_local_sums(x, shift=np.full(2, 1000.0, np.float32))
    _, var, _ = batch_norm_stats(count, s1, s2, shift=np.full(2, 1000.0, np.float32))
    assert rel_err(var, ref) < 1e-3


def test_update_running_stats_uses_unbiased_variance():
    rm, rv = np.zeros(2), np.ones(2)
    update_running_stats(rm, rv, np.array([1.0, 2.0]), np.array([4.0, 8.0]), count=5, momentum=0.5)
    assert np.allclose(rm, [0.5, 1.0]) and np.allclose(rv, [0.5 + 0.5 * 5.0, 0.5 + 0.5 * 10.0])


def test_no_affine_and_float32():
    x = np.random.default_rng(5).standard_normal((2, 3, 2, 3, 4)).astype(np.float32)
    y, cache = batch_norm3d(x)
    dx, dgamma, dbeta = batch_norm3d_backward(np.ones_like(x), cache)
    assert y.dtype == np.float32 and dx.dtype == np.float32
    assert dgamma is None and dbeta is None
    assert np.allclose(y.mean(axis=(0, 2, 3, 4)), 0, atol=1e-5)
    assert np.allclose(y.var(axis=(0, 2, 3, 4)), 1, atol=1e-3)


@pytest.mark.parametrize("call, match", [
    (lambda x, g: batch_norm3d(x[0], g, g), "x must be 5-D"),
    (lambda x, g: batch_norm3d(x, g[:2], g[:2]), "gamma has 2 channels but x has 3"),
    (lambda x, g: batch_norm3d(x, g.reshape(1, 3), g), "gamma must be 1-D"),
    (lambda x, g: batch_norm3d(x, g.astype(np.float32), g), "dtype mismatch"),
    (lambda x, g: batch_norm3d(x, g, g, training=False), "running_mean and running_var"),
    (lambda x, g: batch_norm3d(x, g, g, np.zeros(2), np.ones(2)), "running_mean has 2 channels"),
    (lambda x, g: batch_norm3d(x[:1, :, :1, :1, :1], g, g), "more than one value per channel"),
    (lambda x, g: batch_norm_local_sums(x.astype(np.int32)), "floating-point"),
])
def test_bad_arguments_raise(call, match):
    x = np.random.default_rng(6).standard_normal((2, 3, 2, 2, 2))
    with pytest.raises(ValueError, match=match):
        call(x, np.ones(3))


@pytest.mark.parametrize("shape, block", [((2, 5, 4, 6, 7), 64),      # rows of 64 voxels, 1 channel
                                          ((3, 7, 2, 3, 4), 100),     # 24 voxels: 4 channels a block
                                          ((1, 6, 3, 3, 3), 27)])     # one channel's sample a block
def test_blocks_of_channels_and_voxels_cover_once_and_agree(shape, block, monkeypatch):
    """The passes run over blocks of channels x voxels (long rows); every element lies in
    exactly one block, and the sums, y and dx equal the unblocked ones (float64, to 1e-13),
    bit for bit across 1, 2 and 3 worker threads."""
    from refimpl.kernels import batch_norm as bn
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape) * 3 + 1.5
    dy = rng.standard_normal(shape)
    gamma, beta = rng.standard_normal(shape[1]), rng.standard_normal(shape[1])
    whole = (batch_norm3d(x, gamma, beta)[0],) + batch_norm3d_backward(dy, batch_norm3d(x, gamma, beta)[1])
    monkeypatch.setattr(bn, "BLOCK_ELEMENTS", block)
    blocks = bn.channel_blocks(x)
    assert len(blocks) > shape[0]
    hit = np.zeros(shape, int)
    for _, channels, (view,) in blocks:
        assert view.shape[0] == len(range(*channels.indices(shape[1]))) and view.size <= max(block, 1)
        view_hits = hit.reshape(shape[0], shape[1], -1)
        for i in range(shape[0]):
            if np.shares_memory(view, x.reshape(shape[0], shape[1], -1)[i]):
                offset = (view.__array_interface__["data"][0] - x.__array_interface__["data"][0]) // 8
                c0, v0 = divmod(offset - i * x[0].size, x[0, 0].size)
                view_hits[i, c0:c0 + view.shape[0], v0:v0 + view.shape[1]] += 1
    assert (hit == 1).all()
    runs = []
    for threads in ("1", "2", "3"):
        monkeypatch.setenv("REFIMPL_THREADS", threads)
        y, cache = batch_norm3d(x, gamma, beta)
        runs.append((y,) + batch_norm3d_backward(dy, cache))
    for run in runs:
        for a, b in zip(run, runs[0]):
            assert np.array_equal(a, b)
    for a, b in zip(runs[0], whole):
        assert rel_err(a, b) <= 1e-13
