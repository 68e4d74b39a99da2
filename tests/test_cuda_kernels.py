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
from refimpl.functional import (avg_pool3d, avg_pool3d_backward, max_pool3d, max_pool3d_backward,
                                reference_only)
from refimpl.kernels import _cuda, pooling

SOURCES = {"pooling": pooling.DEVICE_SOURCE}
GPU = not settings.cupy_unavailable()


@pytest.mark.skipif(emu.NVCC is None, reason="nvcc is not installed here")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", sorted(SOURCES))
def test_nvcc_compiles_the_kernels(name, dtype):
    proc = emu.nvcc_compiles(SOURCES[name], dtype)
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr.lower(), proc.stderr


def _emulated_launch(body, name, kinds, values, dtype, total, grid_y=1):
    emu.run(body, name, kinds, values, dtype)


@pytest.fixture(params=["host"] + (["gpu"] if GPU else []))
def where(request, monkeypatch):
    """``host``: the kernels emulated on NumPy arrays; ``gpu``: CuPy arrays on the GPU."""
    if request.param == "host":
        if emu.CXX is None:
            pytest.skip("no C++ compiler here to emulate the kernels")
        monkeypatch.setattr(_cuda, "on_device", lambda a: isinstance(a, np.ndarray))
        monkeypatch.setattr(_cuda, "launch", _emulated_launch)
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
