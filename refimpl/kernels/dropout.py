"""The fast route of dropout on a GPU: the mask and the scaled output in one CUDA kernel.

``refimpl/functional/dropout.py`` holds the math: element i of the global tensor is kept
when ``mix64(seed + (i + 1) * golden) >> 11 >= round(p * 2^53)`` (SplitMix64), and
``y = where(keep, x * scale, 0)``.  With CuPy arrays the reference builds the block's flat
global indices and runs the hash as about fifteen uint64 array operations, each a kernel
launch and a temporary of 8 bytes per element, then the ``where``.  Here one thread per
element computes its global index from the block's offsets, the hash, the keep bit and
``y`` (the multiply rounded on its own, ``MUL``): the same mask and the same bits.  The
backward ``where(keep, dy * scale, 0)`` is one kernel too.  Host arrays keep the reference
(its passes are few next to a conv's); tests/test_cuda_kernels.py checks both kernels
against it, emulated on the host and on a GPU.

The one dispatch rule (``applies``): CuPy arrays of float32 or float64 of at most ``MAX_DIMS`` axes, outside
``refimpl.functional.reference_only()``.
"""
from __future__ import annotations

from ..backend import array_module
from . import _cuda

#: Axes the kernel indexes (NCDHW and the dense head's (N, F)).
MAX_DIMS = 5

DEVICE_SOURCE = r"""
extern "C" __global__ void dropout_forward(const T* x, T* y, bool* keep, long long total,
        long long n0, long long n1, long long n2, long long n3, long long n4,
        long long a0, long long a1, long long a2, long long a3, long long a4,
        long long g0, long long g1, long long g2, long long g3, long long g4,
        long long seed_bits, long long threshold, T scale) {
    long long rows = n4 ? total / n4 : 0;
    for (long long row = blockIdx.y; row < rows; row += gridDim.y) {
        long long r = row;                       // the row's coordinates on the first four axes
        long long c3 = r % n3; r /= n3;
        long long c2 = r % n2; r /= n2;
        long long c1 = r % n1; r /= n1;
        long long c0 = r;
        long long base = (a0 + c0) * g0 + (a1 + c1) * g1 + (a2 + c2) * g2 + (a3 + c3) * g3;
        for (long long c4 = (long long)blockIdx.x * blockDim.x + threadIdx.x; c4 < n4;
             c4 += (long long)blockDim.x * gridDim.x) {
            long long i = row * n4 + c4;
            unsigned long long index = (unsigned long long)(base + (a4 + c4) * g4);
            unsigned long long z = (unsigned long long)seed_bits + (index + 1ULL) * 0x9E3779B97F4A7C15ULL;
            z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
            z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
            z = z ^ (z >> 31);
            bool k = (z >> 11) >= (unsigned long long)threshold;
            keep[i] = k;
            y[i] = k ? MUL(x[i], scale) : (T)0;
        }
    }
}

extern "C" __global__ void dropout_backward(const T* dy, const bool* keep, T* dx, long long total, T scale) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)blockDim.x * gridDim.x) {
        dx[i] = keep[i] ? MUL(dy[i], scale) : (T)0;
    }
}
"""

SIGNATURES = {
    "dropout_forward": ("ptr",) * 3 + ("i64",) * 18 + ("T",),
    "dropout_backward": ("ptr",) * 3 + ("i64", "T"),
}


def applies(x) -> bool:
    """Whether dropout of ``x`` runs here: a CuPy array of at most ``MAX_DIMS`` axes."""
    return _cuda.takes(x) and x.ndim <= MAX_DIMS


def _signed(bits) -> int:
    """A 64-bit unsigned value as the signed integer of the same bits (the kernel reads it back)."""
    return bits - (1 << 64) if bits >= 1 << 63 else bits


def dropout(x, seed, threshold, scale, global_shape, index_ranges):
    """``(y, keep)`` for the block ``index_ranges`` (one (start, stop) per axis) of a
    ``global_shape`` tensor; ``threshold`` = round(p * 2^53), ``scale`` = 1 / (1 - p)."""
    xp = array_module(x)
    x = xp.ascontiguousarray(x)
    pad = MAX_DIMS - x.ndim
    shape = (1,) * pad + tuple(x.shape)
    offsets = (0,) * pad + tuple(a for a, _ in index_ranges)
    strides, stride = [], 1
    for n in reversed(global_shape):
        strides.append(stride)
        stride *= n
    strides = (0,) * pad + tuple(reversed(strides))
    y = xp.empty(x.shape, dtype=x.dtype)
    keep = xp.empty(x.shape, dtype=bool)
    _cuda.launch(DEVICE_SOURCE, "dropout_forward", SIGNATURES["dropout_forward"],
                 (x, y, keep, x.size) + shape + offsets + strides + (_signed(seed), threshold, scale),
                 x.dtype, shape[-1], grid_y=_cuda.grid_rows(x.size // max(1, shape[-1])))
    return y, keep


def dropout_backward(dy, keep, scale):
    """``where(keep, dy * scale, 0)``."""
    xp = array_module(dy)
    dy = xp.ascontiguousarray(dy)
    dx = xp.empty(dy.shape, dtype=dy.dtype)
    _cuda.launch(DEVICE_SOURCE, "dropout_backward", SIGNATURES["dropout_backward"],
                 (dy, xp.ascontiguousarray(keep), dx, dy.size, scale), dy.dtype, dy.size)
    return dx


__all__ = ["MAX_DIMS", "DEVICE_SOURCE", "SIGNATURES", "applies", "dropout", "dropout_backward"]
