"""The fast route of the classification losses' class passes: plane by plane, in cache, on every core.

``refimpl/functional/losses.py`` holds the math: the softmax over the class axis 1
(``max``, ``exp``, ``sum``, ``log``), the cross-entropy sums and gradient
``w[y] (p - onehot(y)) / sum w``, the hard Dice confusion counts of ``argmax``.  On the
host NumPy's max, sum and argmax over a short strided class axis are slow passes
(``argmax`` 10x slower than a comparison per class plane), and fancy indexing at the
labels (``take_along_axis``) several times slower than one 0/1 mask per class.  So here,
for few classes (at most ``MASKED_PICK_CLASSES``), the same values are computed class
plane by class plane over blocks of ``CLASS_BLOCK_VOXELS`` voxels of one sample (K
planes of a block stay in the cache), the blocks shared by the worker threads of
``_threads`` (measured: docs/benchmarks.md, "Kernel choices").

Numbers: the softmax, the gradient and the confusion counts equal the reference's (the
max, a pick at the label and the argmax are exact; the normaliser adds the classes'
exponentials in class order, where the reference's sum over the class axis may round apart
by an ulp); the float64 sums add per-block sums in block order (an order that depends on
the shape only, not on the thread count), within float64 rounding of the reference's.
tests/test_reference_ops.py checks each against the reference.

On a GPU (CuPy logits) each of the four passes is one CUDA kernel (``DEVICE_SOURCE``,
launched by ``_cuda``), one thread per voxel looping over the K classes in class order (the
reference's reductions over the short class axis take a kernel launch and a temporary each):
the max, the exponentials and their sum in class order, p and lse; the cross-entropy sums as
float64 partials per lane (``batch_norm``'s scheme); the gradient one thread per element;
the confusion counts by integer atomic adds (exact in any order).  Numbers: the gradient and
the confusion counts equal the reference's for the same p; the softmax uses CUDA's
``expf``/``logf`` (``exp``/``log``), within a few ulp of NumPy's (tests/test_cuda_kernels.py);
the sums to float64 rounding.

The one dispatch rule (``applies``): NumPy logits, C-contiguous, ``(N, K, ...)`` with at
least one spatial axis and at most ``MASKED_PICK_CLASSES`` classes, and CuPy logits of
float32 or float64, take this route outside ``refimpl.functional.reference_only()``; anything else the
reference.
"""
from __future__ import annotations

import numpy

from ..backend import array_module
from . import _cuda, _threads

#: Up to this many classes the class passes run here (one 0/1 mask per class: 3 classes at
#: 64^3 several times faster than take_along_axis's fancy indexing, and than ufuncs with ``where=``).
MASKED_PICK_CLASSES = 8

#: Voxels per block of the blocked class passes (K planes of them stay in the cache).
CLASS_BLOCK_VOXELS = 1 << 15


def applies(logits) -> bool:
    """Whether the class passes over ``logits`` run here (module doc)."""
    if _cuda.on_device(logits):
        return _cuda.takes(logits) and logits.ndim >= 2
    return (type(logits) is numpy.ndarray and logits.flags.c_contiguous and logits.ndim >= 3
            and logits.shape[1] <= MASKED_PICK_CLASSES)


def _voxel_blocks(fn, *arrays):
    """``fn(*views)`` for every block of ``CLASS_BLOCK_VOXELS`` voxels of one sample, where each
    array (N, K, ...) or (N, ...) is seen as (N, K, V) / (N, V) and ``views`` are its block
    ``[:, v0:v1]`` of that sample; the blocks split among the worker threads, and the
    results returned in block order (so sums of them do not depend on the thread count)."""
    n = arrays[0].shape[0]
    flat = [a.reshape(a.shape[:2] + (-1,)) if a.ndim == arrays[0].ndim else a.reshape(n, -1)
            for a in arrays]
    voxels = flat[0].shape[-1]
    blocks = [(i, v0, min(v0 + CLASS_BLOCK_VOXELS, voxels))
              for i in range(n) for v0 in range(0, voxels, CLASS_BLOCK_VOXELS)]
    results = [None] * len(blocks)

    def one(_, index):
        i, v0, v1 = blocks[index]
        results[index] = fn(*(a[i, ..., v0:v1] for a in flat))
    _threads.run(one, list(range(len(blocks))), _threads.thread_count())
    return results


def softmax(logits):
    """``(p, lse)`` of ``functional.losses.SoftmaxParts``, class plane by class plane."""
    if _cuda.on_device(logits):
        return device_softmax(logits)
    n, k = logits.shape[:2]
    p = numpy.empty_like(logits)
    lse = numpy.empty((n, 1) + logits.shape[2:], dtype=logits.dtype)

    def block(z, pb, lb):                           # (K, B), (K, B), (1, B)
        lb = lb[0]
        m = z[0].copy()
        for c in range(1, k):
            numpy.maximum(m, z[c], out=m)
        for c in range(k):
            numpy.subtract(z[c], m, out=pb[c])
            numpy.exp(pb[c], out=pb[c])
        lb[...] = pb[0]
        for c in range(1, k):
            lb += pb[c]                             # the normaliser, then its log + max
        for c in range(k):
            numpy.divide(pb[c], lb, out=pb[c])
        numpy.log(lb, out=lb)
        lb += m
    _voxel_blocks(block, logits, p, lse)
    return p, lse


def _at_labels(z, y):
    """``z[y[v], v]`` for a block ``z`` (K, B), as ``sum_k z_k * (y == k)``: each product exact
    (a factor 0 or 1), all terms but one zero, so the sum is the picked value exactly."""
    out = z[0] * (y == 0)
    for k in range(1, z.shape[0]):
        out += z[k] * (y == k)
    return out


def cross_entropy_sums(logits, lse, labels, class_weights):
    """``[sum_v w[y_v], sum_v w[y_v] * nll_v]`` (float64 (2,)), ``nll_v = lse_v - z_{y_v}``."""
    if _cuda.on_device(logits):
        return device_cross_entropy_sums(logits, lse, labels, class_weights)
    def block(z, lb, y):
        nll = lb[0] - _at_labels(z, y)                               # lse - z_y
        if class_weights is None:
            return numpy.array([float(y.size), numpy.sum(nll, dtype=numpy.float64)])
        w = class_weights.take(y)
        return numpy.array([numpy.sum(w, dtype=numpy.float64), numpy.sum(w * nll, dtype=numpy.float64)])
    return numpy.sum(_voxel_blocks(block, logits, lse, labels), axis=0)


def cross_entropy_grad(p, labels, class_weights, scale):
    """``w[y] (p - onehot(y)) * scale``, the one-hot subtracted plane by plane at the labels."""
    if _cuda.on_device(p):
        return device_cross_entropy_grad(p, labels, class_weights, scale)
    grad = numpy.empty_like(p)

    def block(pb, gb, y):                                           # (K, B), (K, B), (B,)
        for c in range(pb.shape[0]):
            numpy.subtract(pb[c], y == c, out=gb[c])
        if class_weights is not None:
            gb *= class_weights.take(y)
        gb *= scale
    _voxel_blocks(block, p, grad, labels)
    return grad


def _argmax_classes(z):
    """``argmax(z, axis=0)`` of a block (K, B) (the first maximum) as one comparison per class plane."""
    best = z[0].copy()
    pred = numpy.zeros(best.shape, dtype=numpy.int64)
    for k in range(1, z.shape[0]):
        better = z[k] > best                        # strict: ties keep the earlier class
        numpy.maximum(best, z[k], out=best)
        pred += better * (k - pred)                 # k where better, unchanged elsewhere
    return pred


def confusion(logits, labels):
    """The (K, K) confusion counts, row = label, column = argmax prediction, block by block."""
    if _cuda.on_device(logits):
        return device_confusion(logits, labels)
    k = logits.shape[1]
    return numpy.sum(_voxel_blocks(lambda z, y: numpy.bincount(y * k + _argmax_classes(z), minlength=k * k),
                                   logits, labels), axis=0).reshape(k, k)



# ---------------------------------------------------------------- the CUDA kernels (CuPy arrays)
#
# Logits (N, K, V) C-contiguous (V: the voxels, 1 without spatial axes), labels (N, V) int64.
# Softmax per voxel as the reference: m = max_k z_k (a NaN propagates, as numpy.maximum),
# e_k = exp(z_k - m), s = e_0 + e_1 + ... in class order, p_k = e_k / s, lse = log(s) + m.
# The cross-entropy terms w[y] and w[y] * (lse - z_y) (w = 1 and no product without weights),
# summed in float64 per lane; the gradient (p - [y == k]) * w[y] * scale, rounded op by op in
# the reference's order; the confusion counts at (label, first maximum: a NaN counts as the
# maximum, as numpy.argmax).  Samples (and, for the gradient, sample-class rows) run along y,
# voxels along x: no index is divided per element.
DEVICE_SOURCE = r"""
extern "C" __global__ void softmax_parts(const T* z, T* p, T* lse, long long n, long long k, long long v) {
    for (long long s = blockIdx.y; s < n; s += gridDim.y) {
        for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < v;
             j += (long long)blockDim.x * gridDim.x) {
            long long base = s * k * v + j;
            T m = z[base];
            for (long long c = 1; c < k; ++c) {
                T zc = z[base + c * v];
                if (zc > m || zc != zc) m = zc;
            }
            T sum = (T)0;
            for (long long c = 0; c < k; ++c) {
                T e = EXP(SUB(z[base + c * v], m));
                p[base + c * v] = e;
                sum = c == 0 ? e : ADD(sum, e);
            }
            for (long long c = 0; c < k; ++c) p[base + c * v] = DIV(p[base + c * v], sum);
            lse[s * v + j] = ADD(LOG(sum), m);
        }
    }
}

extern "C" __global__ void cross_entropy_sums(const T* z, const T* lse, const long long* y, const T* w,
                                              double* s1, double* s2, long long n, long long k, long long v,
                                              long long lanes) {
    for (long long lane = (long long)blockIdx.x * blockDim.x + threadIdx.x; lane < lanes;
         lane += (long long)blockDim.x * gridDim.x) {
        double a1 = 0.0, a2 = 0.0;
        for (long long s = 0; s < n; ++s) {
            for (long long j = lane; j < v; j += lanes) {
                long long label = y[s * v + j];
                T nll = SUB(lse[s * v + j], z[(s * k + label) * v + j]);
                if (w) {
                    a1 += (double)w[label];
                    a2 += (double)MUL(w[label], nll);
                } else {
                    a1 += 1.0;
                    a2 += (double)nll;
                }
            }
        }
        s1[lane] = a1;
        s2[lane] = a2;
    }
}

extern "C" __global__ void cross_entropy_grad(const T* p, const long long* y, const T* w, const T* scale,
                                              T* grad, long long n, long long k, long long v) {
    for (long long r = blockIdx.y; r < n * k; r += gridDim.y) {
        long long s = r / k, c = r % k;
        for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < v;
             j += (long long)blockDim.x * gridDim.x) {
            long long label = y[s * v + j];
            T g = SUB(p[r * v + j], (T)(c == label));
            if (w) g = MUL(g, w[label]);
            grad[r * v + j] = MUL(g, scale[0]);
        }
    }
}

extern "C" __global__ void confusion_counts(const T* z, const long long* y, unsigned long long* counts,
                                            long long n, long long k, long long v) {
    for (long long s = blockIdx.y; s < n; s += gridDim.y) {
        for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < v;
             j += (long long)blockDim.x * gridDim.x) {
            long long base = s * k * v + j, best = 0;
            T m = z[base];
            for (long long c = 1; c < k && m == m; ++c) {
                T zc = z[base + c * v];
                if (zc > m || zc != zc) { m = zc; best = c; }
            }
            atomicAdd(&counts[y[s * v + j] * k + best], 1ULL);
        }
    }
}
"""

SIGNATURES = {
    "softmax_parts": ("ptr",) * 3 + ("i64",) * 3,
    "cross_entropy_sums": ("ptr",) * 6 + ("i64",) * 4,
    "cross_entropy_grad": ("ptr",) * 5 + ("i64",) * 3,
    "confusion_counts": ("ptr",) * 3 + ("i64",) * 3,
}

def _labels(labels):
    xp = array_module(labels)
    return xp.ascontiguousarray(labels, dtype=xp.int64)


def _weights(class_weights, dtype):
    return None if class_weights is None else array_module(class_weights).ascontiguousarray(class_weights, dtype=dtype)


def device_softmax(logits):
    xp = array_module(logits)
    z, n, k, v = _cuda.flat(logits)
    p = xp.empty(z.shape, dtype=z.dtype)
    lse = xp.empty((n, 1) + tuple(z.shape[2:]), dtype=z.dtype)
    _cuda.launch(DEVICE_SOURCE, "softmax_parts", SIGNATURES["softmax_parts"], (z, p, lse, n, k, v), z.dtype, v,
                 grid_y=_cuda.grid_rows(n))
    return p, lse


def device_cross_entropy_sums(logits, lse, labels, class_weights):
    xp = array_module(logits)
    z, n, k, v = _cuda.flat(logits)
    lanes = _cuda.sum_lanes(v)
    s1 = xp.empty(lanes, dtype=xp.float64)
    s2 = xp.empty(lanes, dtype=xp.float64)
    _cuda.launch(DEVICE_SOURCE, "cross_entropy_sums", SIGNATURES["cross_entropy_sums"],
                 (z, xp.ascontiguousarray(lse), _labels(labels), _weights(class_weights, z.dtype), s1, s2,
                  n, k, v, lanes), z.dtype, lanes)
    return xp.stack([s1.sum(), s2.sum()])


def device_cross_entropy_grad(p, labels, class_weights, scale):
    xp = array_module(p)
    p, n, k, v = _cuda.flat(p)
    grad = xp.empty(p.shape, dtype=p.dtype)
    _cuda.launch(DEVICE_SOURCE, "cross_entropy_grad", SIGNATURES["cross_entropy_grad"],
                 (p, _labels(labels), _weights(class_weights, p.dtype),
                  xp.ascontiguousarray(xp.asarray(scale, dtype=p.dtype).reshape(1)), grad, n, k, v),
                 p.dtype, v, grid_y=_cuda.grid_rows(n * k))
    return grad


def device_confusion(logits, labels):
    xp = array_module(logits)
    z, n, k, v = _cuda.flat(logits)
    counts = xp.zeros(k * k, dtype=xp.uint64)
    _cuda.launch(DEVICE_SOURCE, "confusion_counts", SIGNATURES["confusion_counts"], (z, _labels(labels), counts, n, k, v),
                 z.dtype, v, grid_y=_cuda.grid_rows(n))
    return counts.astype(xp.int64).reshape(k, k)

__all__ = ["MASKED_PICK_CLASSES", "CLASS_BLOCK_VOXELS", "applies", "softmax", "cross_entropy_sums",
           "cross_entropy_grad", "confusion", "DEVICE_SOURCE", "SIGNATURES"]
