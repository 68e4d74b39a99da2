"""The layers and the models on device arrays equal the same computation on host arrays.

Run on every device backend this machine has: the strict stand-in always (CI), CuPy where a
GPU is (``scripts/gpu_check.sh``).  A device computes the same sums in another order (its convs
run ``_im2col_device``'s schedule, its BLAS is another), so the comparison is in float64 to
1e-10 relative, not bit for bit (``test_strict`` compares bits, NumPy on the device schedule).
"""
import numpy as np
import pytest

from refimpl import backend, settings
from refimpl.functional import (avg_pool3d, avg_pool3d_backward, batch_norm3d, batch_norm3d_backward,
                                conv3d, conv3d_backward, conv_transpose3d, conv_transpose3d_backward,
                                max_pool3d, max_pool3d_backward)
from test_conv import rel_err
from test_strict import MODELS, _step_runner

DEVICES = ["strict"] + (["cupy"] if not settings.cupy_unavailable() else [])
RTOL = 1e-10


@pytest.fixture(params=DEVICES)
def device(request):
    backend.set_backend(request.param)
    try:
        yield request.param
    finally:
        backend.set_backend("numpy")


def _both(fn, *host_args, **kwargs):
    """``fn`` on the host arrays and on their device copies -> (host result, device result on the host)."""
    dev = fn(*(backend.asarray(a) if isinstance(a, np.ndarray) else a for a in host_args), **kwargs)
    ref = fn(*host_args, **kwargs)
    if isinstance(ref, tuple):
        return ref, tuple(None if d is None else backend.to_host(d) for d in dev)
    return ref, backend.to_host(dev)


def _close(ref, dev):
    for r, d in zip(ref if isinstance(ref, tuple) else (ref,), dev if isinstance(dev, tuple) else (dev,)):
        assert (r is None) == (d is None)
        if r is not None:
            assert rel_err(d, r) <= RTOL


@pytest.mark.parametrize("k, s, p, dl", [(3, 1, 1, 1), ((3, 2, 5), (2, 1, 1), (1, 0, 2), (1, 2, 1)),
                                         (2, 2, 0, 1), (1, 1, 0, 1)])
def test_conv_layers_on_the_device(device, k, s, p, dl):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 3, 9, 8, 7))
    w = rng.standard_normal((4, 3) + ((k,) * 3 if isinstance(k, int) else k))
    b = rng.standard_normal(4)
    y_ref, y_dev = _both(conv3d, x, w, b, s, p, dl)
    assert rel_err(y_dev, y_ref) <= RTOL
    dy = rng.standard_normal(y_ref.shape)
    _close(*_both(conv3d_backward, dy, x, w, s, p, dl))
    # the transposed conv of y's shape back to x's: the adjoint, on the same weight
    yt_ref, yt_dev = _both(conv_transpose3d, y_ref, w, None, s, p, 0, dl)      # w: (C_in=4, C_out=3, k)
    assert rel_err(yt_dev, yt_ref) <= RTOL
    dyt = rng.standard_normal(yt_ref.shape)
    _close(*_both(conv_transpose3d_backward, dyt, y_ref, w, s, p, 0, dl))


@pytest.mark.parametrize("k, p", [(3, 1), (2, "same"), (2, (1, 0, 0, 1, 1, 1))])
def test_winograd_on_the_device(device, k, p):
    """Winograd asked for (on a device "auto" is im2col): F(4, 3) and F(4, 2), the latter with
    an asymmetric padding (its ``lo`` as the offset in the zero buffer), run on device arrays
    as on the host."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 3, 9, 8, 7))
    w = rng.standard_normal((4, 3) + (k,) * 3)
    y_ref, y_dev = _both(conv3d, x, w, None, 1, p, algorithm="winograd")
    assert rel_err(y_dev, y_ref) <= RTOL
    dy = rng.standard_normal(y_ref.shape)
    _close(*_both(conv3d_backward, dy, x, w, 1, p, algorithm="winograd"))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_activations_on_the_device(device, dtype):
    """relu and leaky relu forward and backward on the device (CuPy: the fused kernels of
    kernels/pointwise.py) equal the host's values exactly: each is one rounding of the same
    formula (ties at zero included)."""
    from refimpl.functional.activations import leaky_relu, leaky_relu_backward, relu, relu_backward
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 3, 9, 8, 7)).astype(dtype)
    x.reshape(-1)[::5] = 0.0
    dy = rng.standard_normal(x.shape).astype(dtype)
    for fn, args in ((relu, (x,)), (relu_backward, (dy, x)), (leaky_relu, (x, 0.3)),
                     (leaky_relu_backward, (dy, x, 0.3)), (leaky_relu, (x, 1.5))):
        ref, dev = _both(fn, *args)
        assert dev.dtype == ref.dtype and np.array_equal(dev, ref), fn.__name__


def test_pooling_and_batch_norm_on_the_device(device):
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 3, 8, 7, 6))
    for fwd, bwd, args in ((max_pool3d, max_pool3d_backward, (3, 2, 1)), (avg_pool3d, avg_pool3d_backward, (2,))):
        y_ref, y_dev = _both(fwd, x, *args)
        assert rel_err(y_dev, y_ref) <= RTOL
        dy = rng.standard_normal(y_ref.shape)
        _close(*_both(bwd, dy, x, *args))
    gamma, beta = rng.standard_normal(3), rng.standard_normal(3)
    y, cache = batch_norm3d(backend.asarray(x), backend.asarray(gamma), backend.asarray(beta))
    y_ref, cache_ref = batch_norm3d(x, gamma, beta)
    assert rel_err(backend.to_host(y), y_ref) <= RTOL
    dy = rng.standard_normal(x.shape)
    ref = batch_norm3d_backward(dy, cache_ref)
    dev = batch_norm3d_backward(backend.asarray(dy), cache)
    _close(ref, tuple(backend.to_host(d) for d in dev))


def test_group_and_instance_norm_on_the_device(device):
    from refimpl.functional import group_norm3d, group_norm3d_backward, instance_norm3d
    rng = np.random.default_rng(9)
    x, dy = rng.standard_normal((2, 6, 5, 4, 3)) + 1.5, rng.standard_normal((2, 6, 5, 4, 3))
    gamma, beta = rng.uniform(0.5, 1.5, 6), rng.standard_normal(6)
    for run in (lambda a, g, b: group_norm3d(a, 3, g, b), instance_norm3d):
        y_ref, cache_ref = run(x, gamma, beta)
        y, cache = run(backend.asarray(x), backend.asarray(gamma), backend.asarray(beta))
        assert rel_err(backend.to_host(y), y_ref) <= RTOL
        ref = group_norm3d_backward(dy, cache_ref)
        dev = group_norm3d_backward(backend.asarray(dy), cache)
        _close(ref, tuple(backend.to_host(d) for d in dev))


@pytest.mark.parametrize("name, config, batch", MODELS)
def test_models_train_on_the_device_as_on_the_host(name, config, batch, device):
    """Three float64 training steps (forward, loss, backward, Adam) on the device end where the
    host's end: losses and every parameter to 1e-10."""
    runs = {}
    for kind in ("numpy", device):
        backend.set_backend(kind)
        step, model = _step_runner(name, config, batch)
        losses = [float(backend.to_host(backend.asarray(step()[0]))) for _ in range(3)]
        runs[kind] = losses, [backend.to_host(p.data) for p in model.parameters()]
    (l_host, p_host), (l_dev, p_dev) = runs["numpy"], runs[device]
    assert np.allclose(l_dev, l_host, rtol=RTOL, atol=0)
    for a, b in zip(p_dev, p_host):
        assert rel_err(a, b) <= 1e-9           # Adam divides by sqrt(v): a little amplification
