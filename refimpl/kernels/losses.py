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

The one dispatch rule (``applies``): NumPy logits, C-contiguous, ``(N, K, ...)`` with at
least one spatial axis and at most ``MASKED_PICK_CLASSES`` classes take this route outside
``refimpl.functional.reference_only()``; anything else the reference.
"""
from __future__ import annotations

import numpy

from . import _threads

#: Up to this many classes the class passes run here (one 0/1 mask per class: 3 classes at
#: 64^3 several times faster than take_along_axis's fancy indexing, and than ufuncs with ``where=``).
MASKED_PICK_CLASSES = 8

#: Voxels per block of the blocked class passes (K planes of them stay in the cache).
CLASS_BLOCK_VOXELS = 1 << 15


def applies(logits) -> bool:
    """Whether the class passes over ``logits`` run here (module doc)."""
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
    def block(z, lb, y):
        nll = lb[0] - _at_labels(z, y)                               # lse - z_y
        if class_weights is None:
            return numpy.array([float(y.size), numpy.sum(nll, dtype=numpy.float64)])
        w = class_weights.take(y)
        return numpy.array([numpy.sum(w, dtype=numpy.float64), numpy.sum(w * nll, dtype=numpy.float64)])
    return numpy.sum(_voxel_blocks(block, logits, lse, labels), axis=0)


def cross_entropy_grad(p, labels, class_weights, scale):
    """``w[y] (p - onehot(y)) * scale``, the one-hot subtracted plane by plane at the labels."""
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
    k = logits.shape[1]
    return numpy.sum(_voxel_blocks(lambda z, y: numpy.bincount(y * k + _argmax_classes(z), minlength=k * k),
                                   logits, labels), axis=0).reshape(k, k)


__all__ = ["MASKED_PICK_CLASSES", "CLASS_BLOCK_VOXELS", "applies", "softmax", "cross_entropy_sums",
           "cross_entropy_grad", "confusion"]
