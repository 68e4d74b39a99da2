"""Every fast route of the non-conv ops (refimpl/kernels/) against the reference math of
refimpl/functional/ (inside ``functional.reference_only()``), float64 and float32.

The routes compute the reference's own formulas on blocks of the arrays, so they are
held to bit equality where the blocks cannot change the order of a sum, and to 1e-12
(float64) where per-channel sums add block partials.  The reference itself is checked
against PyTorch by tests/test_pooling.py, test_batch_norm.py and test_pointwise_losses.py.
"""
import contextlib

import numpy as np
import pytest

from refimpl.functional import _route, pooling, reference_only
from refimpl.functional._route import kernel_for
from refimpl.kernels import pooling as pooling_kernel


def reference(monkeypatch):
    """The reference math for every op, for the rest of the test (as ``reference_only()``)."""
    monkeypatch.setattr(_route, "_reference_only", 1)


def both_routes(monkeypatch, kernel, block, fn, attr="BLOCK_ELEMENTS"):
    """``(fn() by the reference, fn() by the kernel)``, the kernel's block size ``kernel.<attr>``
    set to ``block`` (small: many blocks)."""
    monkeypatch.setattr(kernel, attr, block)
    with reference_only():
        ref = fn()
    return ref, fn()


def assert_same(a, b):
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for u, v in zip(a, b):
            assert_same(u, v)
    elif a is None:
        assert b is None
    else:
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)


def assert_passes_close(ref, fast, dtype):
    """Every result of a statistics layer's split passes (dicts of arrays or tuples of them,
    None for an absent gradient) of the kernel route against the reference's: the same dtype
    and shape, within 1e-12 (float64: block partials add in another order) or 1e-5 (float32:
    float32 rounding of the statistics) of the result's magnitude."""
    tol = 1e-12 if dtype == np.float64 else 1e-5
    for key in ref:
        for a, b in zip(*(v if isinstance(v, tuple) else (v,) for v in (ref[key], fast[key]))):
            if a is None:
                assert b is None
                continue
            assert a.dtype == b.dtype and a.shape == b.shape
            assert np.max(np.abs(a - b)) <= tol * max(1.0, np.max(np.abs(a))), key


# ---------------------------------------------------------------- pooling
def with_special_values(x):
    """``x`` with a pair max pool's hard cases written in: ties (every third value rounded), NaN
    (no tap holds it), -0 against +0, -inf."""
    flat = x.reshape(-1)
    x[..., ::3] = np.round(x[..., ::3])
    flat[::17], flat[5::19], flat[7::23], flat[9::29] = np.nan, -0.0, 0.0, -np.inf
    return x


POOL_CASES = [((2, 5, 6, 7, 8), 2, None, 0, 1), ((1, 3, 9, 8, 7), 3, 2, 1, 1),
              ((2, 4, 7, 7, 7), (3, 2, 3), (1, 2, 2), (1, 0, 1), 1), ((1, 6, 9, 9, 9), 2, 1, 0, 2)]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape, k, s, p, d", POOL_CASES)
@pytest.mark.parametrize("block", [1, 60, 700])        # a channel a block; several channels a block
def test_pooling_blocked_route_equals_reference(monkeypatch, shape, k, s, p, d, dtype, block):
    """kernels.pooling (blocks of channels on worker threads) vs functional.pooling's math:
    max and avg pooling, forward and backward (with and without the forward's masks), bit
    for bit; at 1 and 2 worker threads."""
    rng = np.random.default_rng(len(shape) + block)
    x = rng.standard_normal(shape).astype(dtype)
    x[..., ::3] = np.round(x[..., ::3])                    # ties: the first maximum must win
    y = pooling.max_pool3d(x, k, s, p, d)
    dy = rng.standard_normal(y.shape).astype(dtype)
    ya = pooling.avg_pool3d(x, k, s, p) if d == 1 else None
    dya = rng.standard_normal(ya.shape).astype(dtype) if d == 1 else None

    def passes():
        yk, masks = pooling.max_pool3d(x, k, s, p, d, return_masks=True)
        out = [yk, pooling.max_pool3d_backward(dy, x, k, s, p, d),
               pooling.max_pool3d_backward(dy, x, k, s, p, d, masks=masks)]
        if d == 1:
            out += [pooling.avg_pool3d(x, k, s, p), pooling.avg_pool3d_backward(dya, x, k, s, p)]
        return out
    for threads in ("1", "2"):
        monkeypatch.setenv("REFIMPL_THREADS", threads)
        ref, fast = both_routes(monkeypatch, pooling_kernel, block, passes)
        assert pooling_kernel.applies(x) and len(pooling_kernel.blocks(x)) > 1
        assert_same(ref, fast)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("stride, dilation, out", [((2, 2, 2), (1, 1, 1), (4, 3, 5)), ((1, 2, 1), (2, 1, 2), (6, 5, 8))])
def test_pair_max_forward_equals_the_reference_stages(dtype, stride, dilation, out):
    """kernels.pooling.pair_max_forward (a 2 x 2 x 2 window in 3 passes a stage) returns the
    reference's y and first-maximum masks exactly: ties, NaN (no tap holds it), -0 against +0,
    -inf; with and without masks."""
    from refimpl.functional.pooling import max_pool_forward
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 3, 8, 6, 10)).astype(dtype)
    with_special_values(x)
    pad = ((0, 0),) * 3
    for masks in (True, False):
        (y_ref, st_ref), (y, st) = (max_pool_forward(x, (2, 2, 2), stride, pad, dilation, out, masks),
                                    pooling_kernel.pair_max_forward(x, stride, dilation, out, masks))
        assert y.dtype == y_ref.dtype and np.array_equal(y, y_ref, equal_nan=True)
        assert [n for _, n in st] == [n for _, n in st_ref]
        for (first, _), (first_ref, _) in zip(st, st_ref):
            assert (first is None) == (not masks)
            assert first is None or all(np.array_equal(u, v) and u.dtype == v.dtype
                                        for u, v in zip(first, first_ref, strict=True))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("stride, dilation, out", [((2, 2, 2), (1, 1, 1), (4, 3, 5)),
                                                   ((2, 2, 2), (1, 1, 1), (3, 3, 4)),
                                                   ((3, 2, 4), (2, 1, 3), (2, 3, 2))])
def test_pair_max_backward_equals_the_reference(dtype, stride, dilation, out):
    """kernels.pooling.pair_max_backward (the zero fill left out where both taps write every
    input, the last stage into the caller's array) gives the reference's dx exactly, from the
    reference's masks and from pair_max_forward's: ties, NaN, -0 and +0, -inf; windows that
    cover the input (even extents), that leave its last plane or row out (odd), that skip
    inputs (s > 2 d)."""
    from refimpl.functional.pooling import max_pool_backward, max_pool_forward
    rng = np.random.default_rng(11)
    shape = (2, 3) + tuple(s * (o - 1) + d + 1 + (i % 2) for i, (s, d, o) in enumerate(zip(stride, dilation, out)))
    x = rng.standard_normal(shape).astype(dtype)
    with_special_values(x)
    dy = rng.standard_normal((2, 3) + out).astype(dtype)
    dy.reshape(-1)[::13] = -dy.reshape(-1)[::13] * 0.0                  # -0 and +0 gradients
    pad = ((0, 0),) * 3
    _, stages = max_pool_forward(x, (2, 2, 2), stride, pad, dilation, out, True)
    dx_ref = max_pool_backward(dy, x.shape, (2, 2, 2), stride, pad, dilation, stages)
    for st in (stages, pooling_kernel.pair_max_forward(x, stride, dilation, out, True)[1]):
        dx = np.full(x.shape, 7.0, dtype=dtype)                          # every element must be written
        assert pooling_kernel.pair_max_backward(dy, st, stride, dilation, dx) is dx
        assert np.array_equal(dx, dx_ref, equal_nan=True)
        assert np.array_equal(np.signbit(dx), np.signbit(dx_ref))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape", [(2, 3, 4, 6, 8), (1, 1, 2, 2, 2), (3, 2, 6, 4, 2)])
@pytest.mark.parametrize("values", ["special", "ties"])
def test_pair_tap_route_equals_the_reference(dtype, shape, values):
    """The small-array route of a 2 x 2 x 2 max pool that tiles its input (first-maximum
    indices, then a scatter) gives the reference's y bit for bit and its dx (zeros of either
    sign compared equal), with the forward's masks and without: NaN, -0 and +0, -inf, and
    windows full of ties (values in {0, 1}: the first maximum in (d, h, w) order must win)."""
    rng = np.random.default_rng(13)
    if values == "ties":
        x = rng.integers(0, 2, shape).astype(dtype)
    else:
        x = with_special_values(rng.standard_normal(shape).astype(dtype))
    out = tuple(n // 2 for n in shape[2:])
    dy = (1.0 + rng.standard_normal(shape[:2] + out)).astype(dtype)
    dy.reshape(-1)[::7] = -0.0
    with reference_only():
        y_ref, masks_ref = pooling.max_pool3d(x, 2, return_masks=True)
        dx_ref = pooling.max_pool3d_backward(dy, x, 2, masks=masks_ref)
    assert pooling_kernel.applies(x, ((2, 2, 2), (2, 2, 2), ((0, 0),) * 3, (1, 1, 1)))
    y, masks = pooling.max_pool3d(x, 2, return_masks=True)
    assert len(masks) == 1 and isinstance(masks[0], tuple)            # the tap route's masks
    assert y.dtype == y_ref.dtype and np.array_equal(y, y_ref, equal_nan=True)
    assert np.array_equal(np.signbit(y), np.signbit(y_ref))
    for dx in (pooling.max_pool3d_backward(dy, x, 2, masks=masks), pooling.max_pool3d_backward(dy, x, 2)):
        assert dx.dtype == dx_ref.dtype and np.array_equal(dx, dx_ref)
    if values == "ties":          # each window's gradient lands on one input: its first maximum
        first = pooling_kernel.pair_tap_forward(x)[1][0]
        assert np.count_nonzero(pooling.max_pool3d_backward(np.ones_like(dy), x, 2)) == dy.size
        assert np.array_equal(x.reshape(-1)[first], y)


def test_pair_tap_route_applies_where_the_windows_tile():
    """Only a small NumPy array whose 2 x 2 x 2, stride-2, unpadded windows tile it takes the
    tap route; odd extents, stride 1, padding or dilation keep the reference; average pooling
    (no window passed) and a larger array keep their rules."""
    pad0 = ((0, 0),) * 3
    window = ((2, 2, 2), (2, 2, 2), pad0, (1, 1, 1))
    x = np.ones((1, 2, 4, 4, 4))
    assert pooling_kernel.applies(x, window) and not pooling_kernel.applies(x)
    assert not pooling_kernel.applies(np.ones((1, 2, 4, 5, 4)), window)
    assert not pooling_kernel.applies(x, ((2, 2, 2), (1, 1, 1), pad0, (1, 1, 1)))
    assert not pooling_kernel.applies(x, ((2, 2, 2), (2, 2, 2), ((1, 1), (0, 0), (0, 0)), (1, 1, 1)))
    assert not pooling_kernel.applies(x, ((2, 2, 2), (2, 2, 2), pad0, (1, 2, 1)))
    assert not pooling_kernel.applies(np.ones((0, 2, 4, 4, 4)), window)
    with reference_only():
        assert kernel_for(pooling.fast, x, window) is None


def test_pooling_dispatch_rule(monkeypatch):
    """The rule for functional.pooling (``_route.kernel_for``): NumPy arrays of more than
    BLOCK_ELEMENTS, outside reference_only(); masks of one route are refused by the other's
    backward when the block counts differ."""
    small = np.zeros((1, 2, 4, 4, 4))
    big = np.zeros((2, 2, 4, 4, 4))
    monkeypatch.setattr(pooling_kernel, "BLOCK_ELEMENTS", small.size)
    assert kernel_for(pooling.fast, small) is None and kernel_for(pooling.fast, big) is pooling_kernel
    reference(monkeypatch)
    assert kernel_for(pooling.fast, big) is None
    monkeypatch.setattr(_route, "_reference_only", 0)
    masks = pooling.max_pool3d(big, 2, return_masks=True)[1]
    assert len(masks) == len(pooling_kernel.blocks(big)) == 2
    with pytest.raises(ValueError, match="masks has 1 blocks"):
        pooling.max_pool3d_backward(np.zeros((2, 2, 2, 2, 2)), big, 2, masks=masks[:1])


# ---------------------------------------------------------------- batch norm
from refimpl.functional import batch_norm as bn                  # noqa: E402
from refimpl.kernels import batch_norm as bn_kernel               # noqa: E402

BN_CASES = [((2, 5, 4, 6, 7), 64), ((3, 7, 2, 3, 4), 100), ((1, 6, 3, 3, 3), 27), ((2, 3, 5, 5, 5), 200)]


def bn_passes(x, dy, gamma, beta, shift, sums_only=False):
    """Every pass of the split batch norm, as the distributed layers run them."""
    count, s1, s2 = bn.batch_norm_local_sums(x, shift)
    mean, var, inv_std = bn.batch_norm_stats(count, s1, s2, 1e-5, shift)
    y, cache = bn.batch_norm_forward(x, mean, inv_std, gamma, beta)
    sums = bn.batch_norm_backward_local_sums(dy, cache)
    dx, dgamma, dbeta = bn.batch_norm_backward(dy, cache, *sums, count, local_sums=sums)
    return dict(sums=(s1, s2), stats=(mean, var, inv_std), y=y, bwd_sums=sums, dx=dx,
                dgamma=dgamma, dbeta=dbeta)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape, block", BN_CASES)
@pytest.mark.parametrize("affine, shifted", [(True, True), (False, False), (True, False)])
def test_batch_norm_blocked_route_equals_reference(monkeypatch, shape, block, dtype, affine, shifted):
    """kernels.batch_norm (blocks of channels x voxels on worker threads) vs functional.batch_norm's
    math, every pass of the split (local sums, stats, forward, backward sums, backward): float64
    sums to 1e-12 (block partials add in another order), the elementwise passes given the same
    per-channel coefficients bit for bit; float32 within float32 rounding of the stats."""
    rng = np.random.default_rng(sum(shape) + block)
    x = (rng.standard_normal(shape) * 3 + 1.5).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    gamma, beta = (rng.standard_normal(shape[1]).astype(dtype) for _ in range(2)) if affine else (None, None)
    shift = (rng.standard_normal(shape[1]) + 1.5).astype(dtype) if shifted else None
    for threads in ("1", "2"):
        monkeypatch.setenv("REFIMPL_THREADS", threads)
        ref, fast = both_routes(monkeypatch, bn_kernel, block,
                                lambda: bn_passes(x, dy, gamma, beta, shift))
        assert bn_kernel.applies(x) and len(bn_kernel.channel_blocks(x)) > shape[0]
        assert_passes_close(ref, fast, dtype)


@pytest.mark.parametrize("shape, block", BN_CASES[:2])
def test_batch_norm_blocked_elementwise_passes_bit_for_bit(monkeypatch, shape, block):
    """Given the same per-channel numbers, the kernel's affine passes (forward y, backward dx) and
    the reference's are the same floats."""
    rng = np.random.default_rng(3)
    x, dy = rng.standard_normal(shape), rng.standard_normal(shape)
    c = shape[1]
    mean, inv_std, gamma, beta = rng.standard_normal(c), rng.uniform(0.5, 2, c), rng.standard_normal(c), \
        rng.standard_normal(c)
    sums = rng.standard_normal(c), rng.standard_normal(c)

    def passes():
        y, cache = bn.batch_norm_forward(x, mean, inv_std, gamma, beta)
        return (y,) + bn.batch_norm_backward(dy, cache, *sums, 40, local_sums=sums)
    ref, fast = both_routes(monkeypatch, bn_kernel, block, passes)
    assert_same(ref, fast)


def test_batch_norm_dispatch_rule(monkeypatch):
    """functional.batch_norm's rule: NumPy arrays of more than BLOCK_ELEMENTS, outside reference_only()."""
    small, big = np.zeros((1, 2, 4, 4, 4)), np.zeros((2, 2, 4, 4, 4))
    monkeypatch.setattr(bn_kernel, "BLOCK_ELEMENTS", small.size)
    assert kernel_for(bn.fast, small) is None and kernel_for(bn.fast, big) is bn_kernel
    reference(monkeypatch)
    assert kernel_for(bn.fast, big) is None


# ---------------------------------------------------------------- group and instance norm
from refimpl.functional import group_norm as gn                  # noqa: E402
from refimpl.kernels import group_norm as gn_kernel               # noqa: E402

# (shape, block, groups): blocks of a few channels, of one channel's part, of several samples' rows
GN_CASES = [((2, 6, 4, 6, 7), 64, 3), ((3, 4, 2, 3, 4), 50, 1), ((1, 6, 3, 3, 3), 27, 6), ((2, 8, 5, 5, 5), 300, 2)]


def gn_passes(x, dy, num_groups, gamma, beta, shift):
    """Every pass of the split group norm, as the distributed layers run them."""
    count, s1, s2 = gn.group_norm_local_sums(x, num_groups, shift)
    mean, var, inv_std = gn.group_norm_stats(count, s1, s2, 1e-5, shift)
    y, cache = gn.group_norm_forward(x, num_groups, mean, inv_std, gamma, beta)
    rows = gn.group_norm_backward_row_sums(dy, cache)
    sums = gn.group_norm_backward_local_sums(dy, cache, row_sums=rows)
    dx, dgamma, dbeta = gn.group_norm_backward(dy, cache, *sums, count, row_sums=rows)
    return dict(sums=(s1, s2), stats=(mean, var, inv_std), y=y, rows=rows, bwd_sums=sums, dx=dx,
                dgamma=dgamma, dbeta=dbeta)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape, block, groups", GN_CASES)
@pytest.mark.parametrize("affine, shifted", [(True, True), (False, False), (True, False)])
def test_group_norm_blocked_route_equals_reference(monkeypatch, shape, block, groups, dtype, affine, shifted):
    """kernels.group_norm (batch norm's blocks of channels x voxels on worker threads) vs
    functional.group_norm's math, every pass of the split (local sums, stats, forward, backward
    sums, backward), group norm and instance norm (groups = C): float64 sums to 1e-12 (block
    partials add in another order), float32 within float32 rounding of the stats; at 1 and 2
    worker threads."""
    rng = np.random.default_rng(sum(shape) + block)
    x = (rng.standard_normal(shape) * 3 + 1.5).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    gamma, beta = (rng.standard_normal(shape[1]).astype(dtype) for _ in range(2)) if affine else (None, None)
    shift = (rng.standard_normal((shape[0], groups)) + 1.5).astype(dtype) if shifted else None
    for threads in ("1", "2"):
        monkeypatch.setenv("REFIMPL_THREADS", threads)
        ref, fast = both_routes(monkeypatch, bn_kernel, block,
                                lambda: gn_passes(x, dy, groups, gamma, beta, shift))
        assert gn_kernel.applies(x) and len(bn_kernel.channel_blocks(x)) > shape[0]
        assert_passes_close(ref, fast, dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape, block, groups", GN_CASES)
@pytest.mark.parametrize("affine", [True, False])
def test_group_norm_blocked_elementwise_passes_bit_for_bit(monkeypatch, shape, block, groups, dtype, affine):
    """Given the same per-group numbers, the kernel's elementwise passes (forward y, backward dx)
    and the reference's are the same floats."""
    rng = np.random.default_rng(4 + block)
    x, dy = (rng.standard_normal(shape).astype(dtype) for _ in range(2))
    n, c = shape[:2]
    mean, inv_std = rng.standard_normal((n, groups)), rng.uniform(0.5, 2, (n, groups))
    gamma, beta = (rng.standard_normal(c).astype(dtype) for _ in range(2)) if affine else (None, None)
    sums = rng.standard_normal((n, groups)), rng.standard_normal((n, groups))

    def passes():
        y, cache = gn.group_norm_forward(x, groups, mean, inv_std, gamma, beta)
        return y, gn.group_norm_backward(dy, cache, *sums, 40)[0]
    ref, fast = both_routes(monkeypatch, bn_kernel, block, passes)
    assert gn_kernel.applies(x)
    assert_same(ref, fast)


def test_group_norm_dispatch_rule(monkeypatch):
    """functional.group_norm's rule: NumPy arrays of more than batch norm's BLOCK_ELEMENTS,
    outside reference_only()."""
    small, big = np.zeros((1, 2, 4, 4, 4)), np.zeros((2, 2, 4, 4, 4))
    monkeypatch.setattr(bn_kernel, "BLOCK_ELEMENTS", small.size)
    assert kernel_for(gn.fast, small) is None and kernel_for(gn.fast, big) is gn_kernel
    reference(monkeypatch)
    assert kernel_for(gn.fast, big) is None


# ---------------------------------------------------------------- activations
from refimpl.functional import activations as act                 # noqa: E402
from refimpl.kernels import _threads, pointwise                   # noqa: E402


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape", [(3, 4, 5, 6, 7), (1000,), (2, 3, 0, 4, 4)])
@pytest.mark.parametrize("slope", [0.01, 0.3, 1.0, 0.0, 1.5, -0.2])
def test_pointwise_route_equals_reference(monkeypatch, shape, dtype, slope):
    """kernels.pointwise (cheap passes over cache-sized blocks, worker threads) vs
    functional.activations' where-formulas: relu, relu_backward, leaky_relu,
    leaky_relu_backward, bit for bit (zeros of either sign and ties at 0 included; the
    sign of a zero is not compared); contiguous and strided inputs; 1 and 2 threads."""
    rng = np.random.default_rng(len(shape))
    x = rng.standard_normal(shape).astype(dtype)
    x.reshape(-1)[::7], x.reshape(-1)[1::11] = 0.0, -0.0
    dy = rng.standard_normal(shape).astype(dtype)
    for xs, dys in ((x, dy), (x[..., ::2], dy[..., ::2])):           # strided views too
        for threads in ("1", "2"):
            monkeypatch.setenv("REFIMPL_THREADS", threads)
            assert kernel_for(act.fast, xs) is pointwise
            ref, fast = both_routes(monkeypatch, _threads, 97, lambda: (
                act.relu(xs), act.relu_backward(dys, xs), act.leaky_relu(xs, slope),
                act.leaky_relu_backward(dys, xs, slope)), attr="ELEMENTWISE_BLOCK")
            assert_same(ref, fast)


@pytest.mark.parametrize("slope", [0.3, 0.0, 1.5, -0.2])
def test_leaky_relu_backward_written_over_dy(monkeypatch, slope):
    """``out=dy``: dx written over the gradient equals the reference's new array, bit for bit,
    on both routes (blocks smaller than the array, 2 threads: each block reads its dy before
    writing it); ``out`` of another shape, dtype or layout is refused naming it."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 9, 8, 7)).astype(np.float32)
    x.reshape(-1)[::13] = 0.0
    dy = rng.standard_normal(x.shape).astype(np.float32)
    with reference_only():
        want = act.leaky_relu_backward(dy, x, slope)
    monkeypatch.setenv("REFIMPL_THREADS", "2")
    monkeypatch.setattr(_threads, "ELEMENTWISE_BLOCK", 97)
    for route in (contextlib.nullcontext, reference_only):
        g = dy.copy()
        with route():
            got = act.leaky_relu_backward(g, x, slope, out=g)
        assert got is g and np.array_equal(g, want)
    for out in (np.empty((2, 3, 9, 8, 6), np.float32), np.empty(x.shape), dy.copy()[..., ::-1],
                np.broadcast_to(np.float32(0), x.shape)):
        with pytest.raises(ValueError, match="out must be a writeable C-contiguous array of dy's shape"):
            act.leaky_relu_backward(dy, x, slope, out=out)


@pytest.mark.parametrize("slope", [0.3, 0.0, 1.5, -0.2])
def test_leaky_relu_written_over_x(monkeypatch, slope):
    """``out=x``: y written over the input equals the reference's new array, bit for bit, on
    both routes (blocks smaller than the array, 2 threads: each block reads its x before
    writing it); ``out`` of another shape, dtype or layout is refused naming x."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 3, 9, 8, 7)).astype(np.float32)
    x.reshape(-1)[::13] = 0.0
    with reference_only():
        want = act.leaky_relu(x, slope)
    monkeypatch.setenv("REFIMPL_THREADS", "2")
    monkeypatch.setattr(_threads, "ELEMENTWISE_BLOCK", 97)
    for route in (contextlib.nullcontext, reference_only):
        a = x.copy()
        with route():
            got = act.leaky_relu(a, slope, out=a)
        assert got is a and np.array_equal(a, want)
    for out in (np.empty((2, 3, 9, 8, 6), np.float32), np.empty(x.shape), x.copy()[..., ::-1]):
        with pytest.raises(ValueError, match="out must be a writeable C-contiguous array of x's shape"):
            act.leaky_relu(x, slope, out=out)


@pytest.mark.parametrize("slope", [0.3, 0.0, 1.5])
def test_leaky_relu_layer_in_place(slope):
    """nn.LeakyReLU(in_place=True) returns y in x's memory and saves y; its dx equals the
    reference's at the original x bit for bit (y > 0 exactly where x > 0 for a slope >= 0),
    zeros of either sign included; a strided x is left alone; a negative slope is refused;
    CosmoFlow's feature blocks build it so."""
    from refimpl.models import build_model
    from refimpl.nn import LeakyReLU
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 3, 4, 4, 4))
    x.reshape(-1)[::9], x.reshape(-1)[1::11] = 0.0, -0.0
    dy = rng.standard_normal(x.shape)
    want_y, want_dx = act.leaky_relu(x, slope), act.leaky_relu_backward(dy, x, slope)
    layer, a = LeakyReLU(slope, in_place=True), x.copy()
    y = layer.forward(a)
    assert y is a and np.array_equal(a, want_y)
    assert np.array_equal(layer.backward(dy), want_dx)
    strided = x.copy()[..., ::-1]
    kept = strided.copy()
    y = layer.forward(strided)
    assert np.array_equal(strided, kept) and np.array_equal(y, act.leaky_relu(kept, slope))
    with pytest.raises(ValueError, match="in_place=True.*negative_slope >= 0"):
        LeakyReLU(-0.2, in_place=True)
    model = build_model("cosmoflow", "tiny")
    assert [m.in_place for _, m in model.named_modules() if isinstance(m, LeakyReLU)] == [True] * 2 + [False] * 2


def test_leaky_relu_layer_reuses_dy_only_when_asked():
    """nn.LeakyReLU(reuse_grad=True) returns dx in dy's memory (CosmoFlow's features build
    it so); the default leaves dy as it was; both equal the reference."""
    from refimpl.models import build_model
    from refimpl.nn import LeakyReLU
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 3, 4, 4, 4))
    dy = rng.standard_normal(x.shape)
    want = act.leaky_relu_backward(dy, x, 0.3)
    for reuse in (False, True):
        layer, g = LeakyReLU(0.3, reuse_grad=reuse), dy.copy()
        layer.forward(x)
        dx = layer.backward(g)
        assert np.array_equal(dx, want) and (dx is g) == reuse and np.array_equal(g, want if reuse else dy)
    layer = LeakyReLU(0.3, reuse_grad=True)
    layer.forward(x)
    assert np.array_equal(layer.backward(dy[..., ::-1]), act.leaky_relu_backward(dy[..., ::-1], x, 0.3))
    model = build_model("cosmoflow", "tiny")
    assert [m.reuse_grad for _, m in model.named_modules() if isinstance(m, LeakyReLU)] == [True] * 2 + [False] * 2


def test_relu_written_over_x_and_dy(monkeypatch):
    """``relu(x, out=x)`` and ``relu_backward(dy, x, out=dy)`` equal the reference's new arrays
    bit for bit on both routes (blocks smaller than the array, 2 threads), zeros of either sign
    and NaN included; a wrong ``out`` is refused naming the array it must match."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 3, 9, 8, 7)).astype(np.float32)
    x.reshape(-1)[::13], x.reshape(-1)[1::17], x.reshape(-1)[2::19] = 0.0, -0.0, np.nan
    dy = rng.standard_normal(x.shape).astype(np.float32)
    with reference_only():
        want_y, want_dx = act.relu(x), act.relu_backward(dy, x)
    monkeypatch.setenv("REFIMPL_THREADS", "2")
    monkeypatch.setattr(_threads, "ELEMENTWISE_BLOCK", 97)
    for route in (contextlib.nullcontext, reference_only):
        a, g = x.copy(), dy.copy()
        with route():
            assert act.relu_backward(dy, x).tobytes() == want_dx.tobytes()
            got_dx = act.relu_backward(g, x, out=g)
            got_y = act.relu(a, out=a)
        assert got_y is a and np.array_equal(a, want_y, equal_nan=True)
        assert got_dx is g and np.array_equal(g, want_dx)
    for out in (np.empty((2, 3, 9, 8, 6), np.float32), np.empty(x.shape), x.copy()[..., ::-1]):
        with pytest.raises(ValueError, match="out must be a writeable C-contiguous array of x's shape"):
            act.relu(x, out=out)
        with pytest.raises(ValueError, match="out must be a writeable C-contiguous array of dy's shape"):
            act.relu_backward(dy, x, out=out)


def test_relu_layer_in_place_and_reusing_dy():
    """nn.ReLU(in_place=True, reuse_grad=True) returns y in x's memory and dx in dy's, equal to
    the reference's at the original x bit for bit (y > 0 exactly where x > 0); strided arrays
    are left alone; the default keeps both; the U-Net's conv blocks build it so."""
    from refimpl.models import build_model
    from refimpl.nn import ReLU
    rng = np.random.default_rng(12)
    x = rng.standard_normal((2, 3, 4, 4, 4))
    x.reshape(-1)[::9], x.reshape(-1)[1::11] = 0.0, -0.0
    dy = rng.standard_normal(x.shape)
    want_y, want_dx = act.relu(x), act.relu_backward(dy, x)
    for flag in (False, True):
        layer, a, g = ReLU(in_place=flag, reuse_grad=flag), x.copy(), dy.copy()
        y = layer.forward(a)
        dx = layer.backward(g)
        assert (y is a) == flag and (dx is g) == flag
        assert np.array_equal(y, want_y) and np.array_equal(dx, want_dx)
        assert np.array_equal(a, want_y if flag else x) and np.array_equal(g, want_dx if flag else dy)
    layer = ReLU(in_place=True, reuse_grad=True)
    strided, g = x.copy()[..., ::-1], dy.copy()[..., ::-1]
    kept, kept_g = strided.copy(), g.copy()
    assert np.array_equal(layer.forward(strided), act.relu(kept)) and np.array_equal(strided, kept)
    assert np.array_equal(layer.backward(g), act.relu_backward(kept_g, kept)) and np.array_equal(g, kept_g)
    model = build_model("unet3d", "tiny")
    relus = [m for _, m in model.named_modules() if isinstance(m, ReLU)]
    assert relus and all(m.in_place and m.reuse_grad for m in relus)


def test_pointwise_dispatch_rule(monkeypatch):
    """functional.activations' rule: NumPy arrays (any size), outside reference_only()."""
    x = np.zeros(3)
    assert kernel_for(act.fast, x) is pointwise and kernel_for(act.fast, x, x) is pointwise
    reference(monkeypatch)
    assert kernel_for(act.fast, x) is None


# ---------------------------------------------------------------- losses
from refimpl.functional import losses                             # noqa: E402
from refimpl.kernels import losses as losses_kernel               # noqa: E402


def loss_passes(logits, labels, weights):
    """The class passes of the losses, as the U-Net runs them (one SoftmaxParts shared)."""
    parts = losses.SoftmaxParts(logits, labels)
    ce = losses.cross_entropy_local_sums(logits, labels, weights, parts)
    return dict(p=parts.p, lse=parts.lse, ce=ce,
                grad=losses.cross_entropy_backward(logits, labels, ce, weights, 2.0, parts),
                grad_own=losses.cross_entropy_backward(logits, labels, ce, weights),
                dice=losses.dice_score_local_sums(logits, labels, parts),
                dice_own=losses.dice_score_local_sums(logits, labels))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("k, weighted", [(2, False), (3, True), (8, True), (1, False)])
@pytest.mark.parametrize("shape", [(2, 5, 6, 7), (1, 40), (3, 2, 2, 1)])
def test_loss_class_route_equals_reference(monkeypatch, k, weighted, shape, dtype):
    """kernels.losses (class plane by class plane over blocks of voxels, worker threads) vs
    functional.losses' whole-array math: softmax p and lse, cross-entropy sums and gradient,
    hard-Dice confusion counts (ties: the first maximum).  The picks, the argmax and the
    counts are exact; the softmax normaliser and the float64 sums add in another order
    (float64: 1e-14 relative; float32: 1e-6)."""
    rng = np.random.default_rng(k + len(shape))
    logits = (3 * rng.standard_normal((shape[0], k) + shape[1:])).astype(dtype)
    if k > 1:
        logits[:, 1, ..., ::3] = logits[:, 0, ..., ::3]            # ties
    labels = rng.integers(0, k, (shape[0],) + shape[1:])
    weights = rng.uniform(0.2, 2.0, k).astype(dtype) if weighted else None
    tol = 1e-14 if dtype == np.float64 else 1e-6
    for threads in ("1", "2"):
        monkeypatch.setenv("REFIMPL_THREADS", threads)
        assert kernel_for(losses.fast, logits) is losses_kernel
        ref, fast = both_routes(monkeypatch, losses_kernel, 11,
                                lambda: loss_passes(logits, labels, weights), attr="CLASS_BLOCK_VOXELS")
        for key in ref:
            a, b = ref[key], fast[key]
            assert a.dtype == b.dtype and a.shape == b.shape, key
            if key.startswith("dice"):
                np.testing.assert_array_equal(a, b)
            else:
                assert np.max(np.abs(a - b)) <= tol * max(1.0, np.max(np.abs(a))), key


def test_loss_dispatch_rule(monkeypatch):
    """functional.losses' rule: NumPy C-contiguous logits (N, K, spatial...) with at most
    MASKED_PICK_CLASSES classes, outside reference_only()."""
    few = np.zeros((2, losses_kernel.MASKED_PICK_CLASSES, 3))
    assert kernel_for(losses.fast, few) is losses_kernel
    assert kernel_for(losses.fast, np.zeros((2, losses_kernel.MASKED_PICK_CLASSES + 1, 3))) is None
    assert kernel_for(losses.fast, np.zeros((2, 3))) is None                      # no spatial axis
    assert kernel_for(losses.fast, np.asfortranarray(np.zeros((2, 3, 4)))) is None
    reference(monkeypatch)
    assert kernel_for(losses.fast, few) is None
