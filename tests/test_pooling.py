"""max_pool3d / avg_pool3d forward and backward vs PyTorch (float64) and finite differences."""
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from refimpl.functional.pooling import avg_pool3d, avg_pool3d_backward, max_pool3d, max_pool3d_backward

torch = pytest.importorskip("torch", reason="PyTorch absent: pip install 'refimpl[oracle]'")


def rel_err(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / max(np.max(np.abs(b)), 1e-300))


def directional_fd_err(f, x, dx, dy, h=1e-6, seed=0):
    """|<dy, (f(x+hv) - f(x-hv)) / 2h> - <dx, v>| relative, for a random direction v."""
    v = np.random.default_rng(seed).standard_normal(x.shape)
    lhs = np.sum(dy * (f(x + h * v) - f(x - h * v))) / (2 * h)
    rhs = np.sum(dx * v)
    return abs(lhs - rhs) / max(abs(rhs), 1e-12)


@st.composite
def pool_case(draw, dilated):
    k = tuple(draw(st.integers(1, 5)) for _ in range(3))
    s = tuple(draw(st.integers(1, 3)) for _ in range(3))
    p = tuple(draw(st.integers(0, ki // 2)) for ki in k)
    d = tuple(draw(st.integers(1, 2)) if dilated else 1 for _ in range(3))
    # at least one output; avg_pool3d in torch also refuses inputs smaller than the kernel
    low = [max(1, ki if not dilated else di * (ki - 1) + 1 - 2 * pi) for ki, pi, di in zip(k, p, d)]
    spatial = tuple(draw(st.integers(lo, lo + 6)) for lo in low)
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 3))) + spatial
    return shape, k, s, p, d, draw(st.integers(0, 2**31))


@given(pool_case(dilated=True))
def test_max_pool3d_matches_torch(case):
    shape, k, s, p, d, seed = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)  # continuous values: no ties
    y = max_pool3d(x, k, s, p, d)
    # a dilated window can fall entirely in the padding: -inf there, as in torch; skip those
    assume(np.isfinite(y).all())
    xt = torch.tensor(x, requires_grad=True)
    yt = torch.nn.functional.max_pool3d(xt, k, s, p, d)
    assert y.shape == tuple(yt.shape)
    assert rel_err(y, yt.detach().numpy()) <= 1e-10
    dy = rng.standard_normal(y.shape)
    yt.backward(torch.tensor(dy))
    dx = max_pool3d_backward(dy, x, k, s, p, d)
    assert rel_err(dx, xt.grad.numpy()) <= 1e-10


@given(pool_case(dilated=False))
def test_avg_pool3d_matches_torch(case):
    shape, k, s, p, _, seed = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    y = avg_pool3d(x, k, s, p)
    xt = torch.tensor(x, requires_grad=True)
    yt = torch.nn.functional.avg_pool3d(xt, k, s, p, count_include_pad=True)
    assert y.shape == tuple(yt.shape)
    assert rel_err(y, yt.detach().numpy()) <= 1e-10
    dy = rng.standard_normal(y.shape)
    yt.backward(torch.tensor(dy))
    assert rel_err(avg_pool3d_backward(dy, x, k, s, p), xt.grad.numpy()) <= 1e-10


@pytest.mark.parametrize("args", [((2, 3, 1), (1, 2, 3), (1, 1, 0), (1, 2, 1)), ((3, 3, 3), 2, 1, 1)])
def test_max_pool3d_finite_differences(args):
    k, s, p, d = args
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 2, 7, 8, 6))
    dy = rng.standard_normal(max_pool3d(x, k, s, p, d).shape)
    dx = max_pool3d_backward(dy, x, k, s, p, d)
    assert directional_fd_err(lambda z: max_pool3d(z, k, s, p, d), x, dx, dy) < 1e-7


def test_avg_pool3d_finite_differences():
    k, s, p = (3, 2, 4), (2, 1, 3), (1, 1, 2)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3, 6, 5, 9))
    dy = rng.standard_normal(avg_pool3d(x, k, s, p).shape)
    dx = avg_pool3d_backward(dy, x, k, s, p)
    assert directional_fd_err(lambda z: avg_pool3d(z, k, s, p), x, dx, dy) < 1e-7


def test_max_pool3d_ties_go_to_first_in_scan_order():
    x = np.zeros((1, 1, 2, 2, 2))
    x[0, 0, 1, 0, 1] = x[0, 0, 0, 1, 1] = 1.0   # two maxima: (0,1,1) comes first in d,h,w order
    dx = max_pool3d_backward(np.ones((1, 1, 1, 1, 1)), x, 2)
    assert dx[0, 0, 0, 1, 1] == 1.0 and dx.sum() == 1.0


def test_default_stride_is_kernel_size():
    x = np.random.default_rng(3).standard_normal((1, 2, 8, 6, 4))
    assert max_pool3d(x, 2).shape == (1, 2, 4, 3, 2)
    assert avg_pool3d(x, (2, 3, 4)).shape == (1, 2, 4, 2, 1)


def test_float32_stays_float32():
    x = np.random.default_rng(4).standard_normal((1, 2, 4, 4, 4)).astype(np.float32)
    for y in (max_pool3d(x, 2), avg_pool3d(x, 2)):
        assert y.dtype == np.float32
    dy = np.ones((1, 2, 2, 2, 2), np.float32)
    assert max_pool3d_backward(dy, x, 2).dtype == np.float32
    assert avg_pool3d_backward(dy, x, 2).dtype == np.float32


@pytest.mark.parametrize("call, match", [
    (lambda x: max_pool3d(x[0], 2), "x must be 5-D"),
    (lambda x: max_pool3d(x, 3, padding=2), "padding must be <= kernel_size // 2"),
    (lambda x: avg_pool3d(x, (2, 2, 3), padding=(1, 1, 2)), "padding"),
    (lambda x: max_pool3d(x, 0), "kernel_size must be >= 1"),
    (lambda x: avg_pool3d(x, 2, stride=0), "stride must be >= 1"),
    (lambda x: max_pool3d(x, 2, dilation=(1, 0, 1)), "dilation"),
    (lambda x: max_pool3d(x, 5), "too small"),
    (lambda x: max_pool3d_backward(np.ones((1, 1, 2, 2, 2), np.float32), x, 2), "dtype mismatch"),
    (lambda x: avg_pool3d_backward(np.ones((1, 1, 3, 2, 2)), x, 2), "dy must have the output shape"),
    (lambda x: max_pool3d(x.astype(np.int64), 2), "floating-point"),
])
def test_bad_arguments_raise(call, match):
    x = np.random.default_rng(5).standard_normal((1, 1, 4, 4, 4))
    with pytest.raises(ValueError, match=match):
        call(x)


@pytest.mark.parametrize("kernel,stride,padding,dilation", [
    (2, 2, 0, 1), (3, 1, 1, 1), ((2, 3, 2), (1, 2, 2), (1, 1, 0), (1, 1, 2)), (3, 2, 1, 2)])
def test_max_pool_ties_go_to_first_max_like_torch(kernel, stride, padding, dilation):
    """Integer-valued input: most windows hold tied maxima; the gradient must pick the
    same (first in d, h, w scan order) element as PyTorch."""
    torch = pytest.importorskip("torch", reason="PyTorch absent: pip install 'refimpl[oracle]'")
    rng = np.random.default_rng(7)
    x = rng.integers(0, 3, (2, 3, 7, 8, 9)).astype(np.float64)
    y = max_pool3d(x, kernel, stride, padding, dilation)
    dy = rng.uniform(0.5, 1.5, y.shape)
    xt = torch.from_numpy(x).requires_grad_()
    yt = torch.nn.functional.max_pool3d(xt, kernel, stride, padding, dilation)
    yt.backward(torch.from_numpy(dy))
    assert np.array_equal(y, yt.detach().numpy())
    assert np.allclose(max_pool3d_backward(dy, x, kernel, stride, padding, dilation), xt.grad.numpy(),
                       rtol=1e-12, atol=0)
