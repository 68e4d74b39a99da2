"""refimpl's CUDA kernels (``refimpl/kernels/_cuda.py``) against the reference, with or without a GPU.

Three checks of the same source: ``nvcc --ptx`` compiles it for both dtypes (where the CUDA
compiler is installed); it runs on the host through ``cuda_emulation`` (one thread: every
grid-stride loop covers everything) and equals the reference bit for bit, or for sums to
float64 rounding; and, where CuPy has a GPU, it runs there and equals the same
(``scripts/gpu_check.sh`` runs this file).  The host run goes through the public functions:
``_cuda.on_device`` is told that NumPy arrays are device arrays and ``_cuda.launch`` runs the
emulation, so the dispatch is the one a CuPy array takes.
"""
import numpy as np
import pytest

import cuda_emulation as emu
from refimpl import backend, settings
from refimpl.functional import (avg_pool3d, avg_pool3d_backward, batch_norm3d, batch_norm3d_backward,
                                max_pool3d, max_pool3d_backward, reference_only)
from refimpl.functional.batch_norm import (batch_norm_backward, batch_norm_backward_local_sums,
                                           batch_norm_forward, batch_norm_local_sums, batch_norm_stats)
from refimpl.functional.dropout import dropout, dropout_backward
from refimpl.functional.losses import dice_score_local_sums, soft_dice_loss, softmax_cross_entropy
from refimpl.functional.group_norm import (group_norm3d, group_norm3d_backward, group_norm_backward,
                                           group_norm_backward_local_sums, group_norm_backward_row_sums,
                                           group_norm_forward, group_norm_local_sums, group_norm_stats)
from refimpl.kernels import _cuda, _im2col_device, batch_norm, group_norm, losses, pooling
from refimpl.kernels import dropout as dropout_kernels
from test_strict import MODELS, _step_runner

SOURCES = {"pooling": pooling.DEVICE_SOURCE, "batch_norm": batch_norm.DEVICE_SOURCE,
           "group_norm": group_norm.DEVICE_SOURCE, "dropout": dropout_kernels.DEVICE_SOURCE,
           "losses": losses.DEVICE_SOURCE, "im2col": _im2col_device.DEVICE_SOURCE}
GPU = not settings.cupy_unavailable()


@pytest.mark.skipif(emu.NVCC is None, reason="nvcc is not installed here")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", sorted(SOURCES))
def test_nvcc_compiles_the_kernels(name, dtype):
    proc = emu.nvcc_compiles(SOURCES[name], dtype)
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr.lower(), proc.stderr


def _nvrtc():
    """CuPy's NVRTC binding when the NVRTC library loads here (a GPU is not needed), else None."""
    try:
        from cupy_backends.cuda.libs import nvrtc
        nvrtc.getVersion()
        return nvrtc
    except Exception:
        return None


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", sorted(SOURCES))
def test_nvrtc_compiles_the_kernels(name, dtype):
    """The compiler CuPy's RawModule uses, on the same source: no error, no warning."""
    nvrtc = _nvrtc()
    if nvrtc is None:
        pytest.skip("NVRTC does not load here (pip install nvidia-cuda-nvrtc-cu12 to check without a GPU)")
    prog = nvrtc.createProgram(_cuda.source(SOURCES[name], dtype), "kernels.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, ["-arch=compute_90", "-default-device"])
        except Exception as err:
            pytest.fail(f"NVRTC: {err}\n{nvrtc.getProgramLog(prog)}")
        assert nvrtc.getPTX(prog) and not nvrtc.getProgramLog(prog).strip(), nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


def _emulated_launch(body, name, kinds, values, dtype, total, grid_y=1):
    emu.run(body, name, kinds, values, dtype)


def emulate(patch, launch=_emulated_launch):
    """NumPy arrays count as device arrays and the kernels run emulated on the host (``launch``)."""
    patch.setattr(_cuda, "on_device", lambda a: isinstance(a, np.ndarray))
    patch.setattr(_cuda, "launch", launch)


@pytest.fixture(params=["host"] + (["gpu"] if GPU else []))
def where(request, monkeypatch):
    """``host``: the kernels emulated on NumPy arrays; ``gpu``: CuPy arrays on the GPU."""
    if request.param == "host":
        if emu.CXX is None:
            pytest.skip("no C++ compiler here to emulate the kernels")
        emulate(monkeypatch)
        yield request.param
    else:
        backend.set_backend("cupy")
        try:
            yield request.param
        finally:
            backend.set_backend("numpy")


def _equal(a, b):
    """Bit for bit, zeros of either sign and NaNs equal."""
    np.testing.assert_array_equal(backend.to_host(a), b)


POOLS = [  # kernel, stride, padding, dilation, ceil_mode, input spatial shape
    (2, 2, 0, 1, False, (8, 6, 10)),                        # CosmoFlow's and the U-Net's
    (3, 2, 1, 1, False, (7, 9, 8)),                         # overlapping, padded
    ((3, 2, 2), (1, 2, 3), (1, 0, 1), (1, 1, 2), False, (6, 7, 9)),
    (3, 3, 1, 1, True, (7, 8, 5)),                          # ceil mode: a window past the end
    (2, 1, 0, 2, False, (5, 6, 6)),                         # dilated, overlapping
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("k, s, p, d, ceil, shape", POOLS)
def test_max_pool_kernels_equal_the_reference(where, k, s, p, d, ceil, shape, dtype):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3) + shape).astype(dtype)
    x[0, 0, 1:3, 1:3, 1:3] = 0.5                          # ties: the first maximum takes the gradient
    x[1, 2, 0, 0, 0] = np.nan                             # a NaN window: y NaN, no gradient
    x[1, 1, 2:4, :2, :2] = -np.inf                        # all -inf windows: the first cell
    with reference_only():
        y_ref, masks = max_pool3d(x, k, s, p, d, ceil, return_masks=True)
        dy = rng.standard_normal(y_ref.shape).astype(dtype)
        dx_ref = max_pool3d_backward(dy, x, k, s, p, d, ceil, masks=masks)
    xd, dyd = backend.asarray(x), backend.asarray(dy)
    y, dev_masks = max_pool3d(xd, k, s, p, d, ceil, return_masks=True)
    _equal(y, y_ref)
    _equal(max_pool3d_backward(dyd, xd, k, s, p, d, ceil, masks=dev_masks), dx_ref)
    _equal(max_pool3d_backward(dyd, xd, k, s, p, d, ceil), dx_ref)          # the masks found again


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("k, s, p, d, ceil, shape", [r for r in POOLS if r[3] == 1])
@pytest.mark.parametrize("include_pad, override", [(True, None), (False, None), (True, -3)])
def test_avg_pool_kernels_equal_the_reference(where, k, s, p, d, ceil, shape, dtype, include_pad, override):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3) + shape).astype(dtype)
    with reference_only():
        y_ref = avg_pool3d(x, k, s, p, ceil, include_pad, override)
        dy = rng.standard_normal(y_ref.shape).astype(dtype)
        dx_ref = avg_pool3d_backward(dy, x, k, s, p, ceil, include_pad, override)
    xd, dyd = backend.asarray(x), backend.asarray(dy)
    _equal(avg_pool3d(xd, k, s, p, ceil, include_pad, override), y_ref)
    _equal(avg_pool3d_backward(dyd, xd, k, s, p, ceil, include_pad, override), dx_ref)


def test_device_max_pool_backward_refuses_other_masks(where):
    x = backend.asarray(np.random.default_rng(5).standard_normal((1, 2, 4, 4, 4)))
    y = max_pool3d(x, 2)
    with pytest.raises(ValueError, match="masks must be the masks of max_pool3d"):
        max_pool3d_backward(y, x, 2, masks=[y])



def _sums_close(dev, ref, terms):
    """float64 sums to rounding: within 1e-12 of the sum of the terms' magnitudes."""
    for d, r, t in zip(dev, ref, terms):
        d = backend.to_host(d)
        assert d.dtype == np.float64 and d.shape == r.shape
        assert np.all(np.abs(d - r) <= 1e-12 * t), (d, r)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(3, 4, 5, 6, 7), (1, 2, 1, 1, 3)])
@pytest.mark.parametrize("affine, shifted", [(True, True), (False, False)])
def test_batch_norm_kernels_equal_the_reference(where, dtype, shape, affine, shifted):
    """Each pass on the same inputs as the reference's: the sums to float64 rounding, the
    affine passes bit for bit; then the whole layer, forward and backward, in float64."""
    rng = np.random.default_rng(6)
    c = shape[1]
    x = (rng.standard_normal(shape) * 2 + 3).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    gamma, beta = ((rng.standard_normal(c).astype(dtype), rng.standard_normal(c).astype(dtype)) if affine
                   else (None, None))
    shift = rng.standard_normal(c).astype(dtype) if shifted else None
    dev = lambda a: None if a is None else backend.asarray(a)
    per_channel = lambda a: np.abs(a).astype(np.float64).sum(axis=(0, 2, 3, 4))
    with reference_only():
        count, s1, s2 = batch_norm_local_sums(x, shift)
        xs = x - (0 if shift is None else shift.reshape(1, -1, 1, 1, 1))
        mean, var, inv_std = batch_norm_stats(count, s1, s2, shift=shift)
        y_ref, cache = batch_norm_forward(x, mean, inv_std, gamma, beta)
        sums_ref = batch_norm_backward_local_sums(dy, cache)
        dx_ref, dgamma_ref, dbeta_ref = batch_norm_backward(dy, cache, *sums_ref, count)
    count_d, s1_d, s2_d = batch_norm_local_sums(dev(x), dev(shift))
    assert count_d == count
    _sums_close((s1_d, s2_d), (s1, s2), (per_channel(xs), per_channel(xs * xs)))
    y, dcache = batch_norm_forward(dev(x), dev(mean), dev(inv_std), dev(gamma), dev(beta))
    _equal(y, y_ref)
    sums = batch_norm_backward_local_sums(dev(dy), dcache)
    inv = inv_std.astype(dtype).astype(np.float64)
    _sums_close(sums, sums_ref, (per_channel(dy), per_channel(dy * (x - mean.astype(dtype).reshape(1, -1, 1, 1, 1))) * inv))
    dx, dgamma, dbeta = batch_norm_backward(dev(dy), dcache, dev(sums_ref[0]), dev(sums_ref[1]), count)
    _equal(dx, dx_ref)
    assert (dgamma is None) == (dgamma_ref is None)
    # the whole layer (float64): statistics and gradients to 1e-10
    if dtype == np.float64:
        with reference_only():
            y_ref, layer_cache = batch_norm3d(x, gamma, beta)
            grads_ref = batch_norm3d_backward(dy, layer_cache)
        y, layer_cache_d = batch_norm3d(dev(x), dev(gamma), dev(beta))
        np.testing.assert_allclose(backend.to_host(y), y_ref, rtol=1e-10, atol=1e-10)
        for g, r in zip(batch_norm3d_backward(dev(dy), layer_cache_d), grads_ref):
            assert (g is None) == (r is None)
            if r is not None:
                np.testing.assert_allclose(backend.to_host(g), r, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape, groups", [((3, 6, 5, 4, 7), 2), ((2, 4, 3, 3, 3), 4), ((1, 3, 1, 1, 2), 1)])
@pytest.mark.parametrize("affine, shifted", [(True, True), (False, False)])
def test_group_norm_kernels_equal_the_reference(where, dtype, shape, groups, affine, shifted):
    """Group (and, G = C, instance) norm's passes on the same inputs as the reference's: the
    sums to float64 rounding, y and dx bit for bit; then the whole layer in float64."""
    rng = np.random.default_rng(7)
    n, c = shape[:2]
    x = (rng.standard_normal(shape) * 2 + 3).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    gamma, beta = ((rng.standard_normal(c).astype(dtype), rng.standard_normal(c).astype(dtype)) if affine
                   else (None, None))
    shift = rng.standard_normal((n, groups)) if shifted else None
    dev = lambda a: None if a is None else backend.asarray(a)
    with reference_only():
        count, s1, s2 = group_norm_local_sums(x, groups, shift)
        mean, _, inv_std = group_norm_stats(count, s1, s2, shift=shift)
        y_ref, cache = group_norm_forward(x, groups, mean, inv_std, gamma, beta)
        rows_ref = group_norm_backward_row_sums(dy, cache)
        sums_ref = group_norm_backward_local_sums(dy, cache, row_sums=rows_ref)
        dx_ref, dgamma_ref, dbeta_ref = group_norm_backward(dy, cache, *sums_ref, count, row_sums=rows_ref)
    xs = x.reshape(n, groups, -1) - (0 if shift is None else shift.astype(dtype)[:, :, None])
    per_group = lambda a: np.abs(a).astype(np.float64).sum(axis=-1)
    count_d, s1_d, s2_d = group_norm_local_sums(dev(x), groups, dev(shift))
    assert count_d == count
    _sums_close((s1_d, s2_d), (s1, s2), (per_group(xs), per_group(xs * xs)))
    y, dcache = group_norm_forward(dev(x), groups, dev(mean), dev(inv_std), dev(gamma), dev(beta))
    _equal(y, y_ref)
    rows = group_norm_backward_row_sums(dev(dy), dcache)
    xhat = ((x.reshape(n, groups, -1) - cache.mean[:, :, None]) * cache.inv_std[:, :, None]).reshape(n, c, -1)
    per_row = lambda a: np.abs(a).astype(np.float64).sum(axis=-1)
    _sums_close(rows, rows_ref, (per_row(dy.reshape(n, c, -1)), per_row(dy.reshape(n, c, -1) * xhat)))
    dx, dgamma, dbeta = group_norm_backward(dev(dy), dcache, dev(sums_ref[0]), dev(sums_ref[1]), count,
                                            row_sums=tuple(dev(r) for r in rows_ref))
    _equal(dx, dx_ref)
    assert (dgamma is None) == (dgamma_ref is None)
    if dtype == np.float64:                        # the whole layer: statistics and gradients to 1e-10
        with reference_only():
            y_ref, layer_cache = group_norm3d(x, groups, gamma, beta)
            grads_ref = group_norm3d_backward(dy, layer_cache)
        y, layer_cache_d = group_norm3d(dev(x), groups, dev(gamma), dev(beta))
        np.testing.assert_allclose(backend.to_host(y), y_ref, rtol=1e-10, atol=1e-10)
        for g, r in zip(group_norm3d_backward(dev(dy), layer_cache_d), grads_ref):
            assert (g is None) == (r is None)
            if r is not None:
                np.testing.assert_allclose(backend.to_host(g), r, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("p, seed", [(0.3, 12345), (0.5, 2**64 - 17), (1.0, 7), (0.0, 2**63)])
@pytest.mark.parametrize("global_shape, ranges", [
    ((4, 3, 6, 5, 7), None),                                   # the whole tensor
    ((4, 3, 6, 5, 7), [(1, 3), (0, 3), (2, 6), (1, 4), (3, 7)]),   # a rank's block
    ((6, 10), [(2, 5), (0, 10)]),                              # the dense head's (N, F)
])
def test_dropout_kernels_equal_the_reference(where, dtype, p, seed, global_shape, ranges):
    rng = np.random.default_rng(8)
    block = global_shape if ranges is None else tuple(b - a for a, b in ranges)
    x = rng.standard_normal(block).astype(dtype)
    dy = rng.standard_normal(block).astype(dtype)
    with reference_only():
        y_ref, mask_ref = dropout(x, p, seed, global_shape, ranges)
        dx_ref = dropout_backward(dy, mask_ref, p)
    y, mask = dropout(backend.asarray(x), p, seed, global_shape, ranges)
    _equal(mask, mask_ref)
    _equal(y, y_ref)
    _equal(dropout_backward(backend.asarray(dy), mask, p), dx_ref)
    if 0 < p < 1:
        assert 0 < mask_ref.mean() < 1


def test_empty_arrays(where):
    """Zero elements: the kernels launch over nothing and return empty results."""
    x = backend.asarray(np.ones((2, 3, 0), dtype=np.float32))
    y, keep = dropout(x, 0.5, 3)
    assert y.shape == (2, 3, 0) and keep.shape == (2, 3, 0)
    assert dropout_backward(y, keep, 0.5).shape == (2, 3, 0)


def test_dropout_kernel_refuses_a_block_of_another_shape(where):
    x = backend.asarray(np.ones((2, 3)))
    with pytest.raises(ValueError, match="select a block of shape"):
        dropout(x, 0.5, 1, (4, 3), [(0, 3), (0, 3)])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(2, 3, 4, 5, 6), (5, 4), (1, 12, 3, 2, 2)])
@pytest.mark.parametrize("weighted", [False, True])
def test_loss_kernels_equal_the_reference(where, dtype, shape, weighted):
    """Cross-entropy (loss and gradient), soft Dice and the hard Dice counts: the softmax's
    exp and log are the device's (or the C library's), so a few ulp apart from NumPy's; the
    confusion counts exact."""
    rng = np.random.default_rng(9)
    k = shape[1]
    logits = (rng.standard_normal(shape) * 3).astype(dtype)
    labels = rng.integers(0, k, size=(shape[0],) + shape[2:])
    weights = (rng.random(k) + 0.5).astype(dtype) if weighted else None
    logits[0, :, ...] = 0.25                                  # ties: the first class is the prediction
    with reference_only():
        loss_ref, grad_ref = softmax_cross_entropy(logits, labels, weights)
        dice_ref, dice_grad_ref = soft_dice_loss(logits, labels)
        counts_ref = dice_score_local_sums(logits, labels)
    ld, yd = backend.asarray(logits), backend.asarray(labels)
    loss, grad = softmax_cross_entropy(ld, yd, None if weights is None else backend.asarray(weights))
    ulp = 8 * np.finfo(dtype).eps
    assert abs(loss - loss_ref) <= ulp * abs(loss_ref) * 4
    np.testing.assert_allclose(backend.to_host(grad), grad_ref, rtol=ulp * 4, atol=ulp * np.abs(grad_ref).max())
    dice, dice_grad = soft_dice_loss(ld, yd)
    assert abs(dice - dice_ref) <= ulp * 4
    np.testing.assert_allclose(backend.to_host(dice_grad), dice_grad_ref, rtol=ulp * 4,
                               atol=ulp * np.abs(dice_grad_ref).max())
    _equal(dice_score_local_sums(ld, yd), counts_ref)


def test_confusion_kernel_takes_a_nan_as_the_maximum(where):
    logits = np.array([[1.0, np.nan], [np.nan, 0.0], [2.0, 2.0], [3.0, 1.0]])   # (N=4, K=2): a NaN in
    labels = np.array([0, 1, 1, 0])                                               # either class, a tie
    with reference_only():
        ref = dice_score_local_sums(logits, labels)
    _equal(dice_score_local_sums(backend.asarray(logits), backend.asarray(labels)), ref)


def test_other_dtypes_take_the_reference(where):
    """float16 device arrays: no CUDA kernel of refimpl's (they compute float32 and float64)."""
    x = np.random.default_rng(10).standard_normal((1, 2, 4, 4, 4)).astype(np.float16)
    assert not pooling.applies(backend.asarray(x)) and not batch_norm.applies(backend.asarray(x))
    assert not dropout_kernels.applies(backend.asarray(x)) and not losses.applies(backend.asarray(x))
    assert not group_norm.applies(backend.asarray(x))
    with reference_only():
        ref = max_pool3d(x, 2)
    _equal(max_pool3d(backend.asarray(x), 2), ref)


CONVS = [  # x shape, weight shape, stride, padding, dilation, byte budget (small: tiles of rows, offsets)
    ((2, 3, 9, 8, 7), (4, 3, 3, 3, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1), 1 << 20),
    ((2, 3, 9, 8, 7), (4, 3, 3, 3, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1), 600),
    ((1, 2, 11, 10, 9), (3, 2, 3, 2, 3), (2, 1, 3), (1, 0, 2), (1, 2, 1), 900),
    ((3, 4, 8, 8, 8), (5, 4, 2, 2, 2), (2, 2, 2), (0, 0, 0), (1, 1, 1), 2000),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("xs, ws, stride, padding, dilation, budget", CONVS)
def test_im2col_columns_kernel_equals_the_strided_copy(where, monkeypatch, dtype, xs, ws, stride, padding, dilation,
                                                       budget):
    """The device schedule's forward, weight gradient and input gradient with the columns
    copied by ``im2col_columns`` and by the strided view's copy: the same arrays bit for bit
    (a copy), on whole samples and on tiles of rows within a sample."""
    rng = np.random.default_rng(sum(xs) + budget)
    x, w = rng.standard_normal(xs).astype(dtype), rng.standard_normal(ws).astype(dtype)
    out = tuple((n + 2 * p - dl * (k - 1) - 1) // s + 1
                for n, k, s, p, dl in zip(xs[2:], ws[2:], stride, padding, dilation))
    dy = rng.standard_normal((xs[0], ws[0]) + out).astype(dtype)
    launched = []

    def run():
        x_, w_, dy_ = (backend.asarray(a) for a in (x, w, dy))
        y = _im2col_device.forward(x_, w_, stride, padding, dilation, out, budget)
        dx, dw = _im2col_device.backward(dy_, x_, w_, stride, padding, dilation, budget)
        return [backend.to_host(a) for a in (y, dx, dw)]
    if where == "host":
        def counting(body, name, *args, **kwargs):
            launched.append(name)
            _emulated_launch(body, name, *args, **kwargs)
        monkeypatch.setattr(_cuda, "launch", counting)
    kernel = run()
    assert where == "gpu" or "im2col_columns" in launched
    monkeypatch.setenv("REFIMPL_CUDA_KERNELS", "0")
    for a, b in zip(kernel, run()):
        np.testing.assert_array_equal(a, b)


def train_with_and_without_kernels(name, config, batch, monkeypatch):
    """Three float64 training steps (forward, loss, backward, Adam) of a model on the host, and
    again with every pass that has a CUDA kernel in it (emulated on the host): asserts that the
    losses and every parameter agree to 1e-10; returns the names of the kernels launched."""
    if emu.CXX is None:
        pytest.skip("no C++ compiler here to emulate the kernels")
    runs, launched = {}, set()

    def launch(body, kernel, *args, **kwargs):
        launched.add(kernel)
        _emulated_launch(body, kernel, *args, **kwargs)
    for kind in ("host", "kernels"):
        with monkeypatch.context() as patch:
            if kind == "kernels":
                emulate(patch, launch)
            step, model = _step_runner(name, config, batch)
            losses = [float(step()[0]) for _ in range(3)]
            runs[kind] = losses, [p.data.copy() for p in model.parameters()]
    (l_host, p_host), (l_k, p_k) = runs["host"], runs["kernels"]
    np.testing.assert_allclose(l_k, l_host, rtol=1e-10, atol=0)
    for a, b in zip(p_k, p_host):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    return launched


@pytest.mark.parametrize("name, config, batch", MODELS)
def test_models_train_through_the_kernels_as_on_the_host(name, config, batch, monkeypatch):
    """Each model with every pooling, batch norm, dropout and loss pass in the CUDA kernels
    ends its three steps where the host's end."""
    launched = train_with_and_without_kernels(name, config, batch, monkeypatch)
    expected = ({"max_pool_forward", "pool_backward", "dropout_forward", "dropout_backward"}
                if name == "cosmoflow" else
                {"max_pool_forward", "pool_backward", "bn_sums", "bn_affine", "bn_backward_sums",
                 "bn_backward_dx", "softmax_parts", "cross_entropy_sums", "cross_entropy_grad"})
    assert expected <= launched, expected - launched


@pytest.mark.parametrize("norm", ["group", "instance"])
def test_unet_with_group_norm_trains_through_the_kernels_as_on_the_host(norm, monkeypatch):
    """The U-Net with group (2 groups) or instance norm, every normalisation pass in the group
    norm kernels, ends its three steps where the host's end."""
    name, config, batch = MODELS[1]
    launched = train_with_and_without_kernels(name, dict(config, norm=norm, num_groups=2), batch, monkeypatch)
    assert {"bn_sums", "gn_forward", "gn_backward_row_sums", "gn_backward_dx"} <= launched, launched


def test_cuda_kernels_switched_off(where, monkeypatch):
    """``REFIMPL_CUDA_KERNELS=0``: the reference's array operations instead of the kernels (the
    same values); a value that is no boolean is refused, naming the variable."""
    x = backend.asarray(np.random.default_rng(11).standard_normal((1, 2, 4, 4, 4)))
    assert pooling.applies(x)
    monkeypatch.setenv("REFIMPL_CUDA_KERNELS", "0")
    assert not (pooling.applies(x) or batch_norm.applies(x) or dropout_kernels.applies(x) or losses.applies(x)
                or group_norm.applies(x))
    with reference_only():
        ref = max_pool3d(backend.to_host(x), 2)
    _equal(max_pool3d(x, 2), ref)
    monkeypatch.setenv("REFIMPL_CUDA_KERNELS", "sometimes")
    with pytest.raises(ValueError, match="REFIMPL_CUDA_KERNELS"):
        pooling.applies(x)
