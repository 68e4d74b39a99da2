"""3D batch normalisation, split into local steps around the reductions.

Training-mode batch norm (PyTorch semantics, per channel c over N, D, H, W):

    mean = sum(x) / n,  var = sum((x - mean)^2) / n          (biased: it normalises)
    xhat = (x - mean) * inv_std,  inv_std = 1 / sqrt(var + eps)
    y    = gamma * xhat + beta
    running_mean <- (1 - m) running_mean + m mean
    running_var  <- (1 - m) running_var  + m var * n / (n - 1)   (unbiased: it is tracked)

The backward, with the sums over the same n elements,

    dx = gamma * inv_std * (dy - sum(dy) / n - xhat * sum(dy * xhat) / n)
    dgamma = sum(dy * xhat),  dbeta = sum(dy).

Every per-channel sum is a separate function result, so a spatially partitioned
layer computes the local sums on its block, allreduces them over the spatial
(and optionally data) group, and finishes with the global sums:

    forward:  batch_norm_local_sums -> Allreduce -> batch_norm_stats -> batch_norm_forward
    backward: batch_norm_backward_local_sums -> Allreduce -> batch_norm_backward

Numerical scheme (one allreduce per direction): the statistics come from the
*shifted* sums ``S1 = sum(x - K)``, ``S2 = sum((x - K)^2)`` accumulated in
float64, with ``mean = K + S1/n`` and ``var = S2/n - (S1/n)^2``.  The variance
is shift-invariant; the cancellation in ``S2/n - (S1/n)^2`` costs about
``(mean - K)^2 / var`` in relative precision, so a shift near the mean makes it
harmless.  Layers pass the running mean as ``K``: it is identical on every rank
of the reduction group (no extra message) and tracks the batch mean.  With no
shift (K = 0) the float64 accumulation alone keeps float32 training accurate
unless |mean| >> std.  (The alternative, a two-pass centred sum, is exact but
needs two allreduces.)  Sums travel as float64 arrays of shape (C,).

Passes: every step is one pass over its inputs, run block by block
(``_channel_blocks``: a block is a range of channels of one sample over a cache-sized
range of voxels, as long as fits, the blocks shared by the worker threads of ``_threads``), so the
few elementwise operations of a step read the cache, not memory.  The cache keeps
``x`` itself (no normalised copy).  Every per-channel sum is accumulated in float64
(``sum(dtype=float64)``), although casting each element costs as much as the rest of
a pass: float32 partial sums, even as BLAS products over cache-sized rows (3x faster),
change the statistics by ~sqrt(L) eps between grids, and the sums cancel (``sum(dy)``
is about 0 for a batch norm whose output another batch norm normalises again, as in
the U-Net), where Adam turns rounding near 0 into a full step of either sign: float32
training then differed between grids by 12 % of such a bias.  The backward needs

    sum(dy),  sum(dy * xhat) = inv_std * sum(dy * (x - mean))

(one subtraction and one product, then the two sums).  Then, per channel with
``a = gamma * inv_std``, ``b = -a * inv_std * mean(dy * xhat)``, ``c = -a * mean(dy) - b * mean``,

    dx = a * dy + b * x + c                  (4 elementwise operations instead of 6)

which is the formula above rearranged.  Its rounding: ``b * x + c`` stands for
``b * (x - mean)`` and carries an error of about ``eps * |mean| / std`` of that term,
harmless unless ``|mean| >> std`` (then the shift that the layers pass, the running
mean, keeps the forward accurate, and the backward loses ``log10(|mean| / std)`` digits).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy

from ..backend import array_module, check_same_dtype
from ..kernels import _threads
from ._args import check_float, check_ndim

_AXES = (0, 2, 3, 4)  # every axis but the channel


def _per_channel(v):
    """(C,) -> (1, C, 1, 1, 1) for broadcasting against NCDHW."""
    return v.reshape(1, -1, 1, 1, 1)


class BatchNormCache(NamedTuple):
    x: object        # (N, C, D, H, W) the input
    mean: object     # (C,) in x's dtype
    gamma: object    # (C,) or None
    inv_std: object  # (C,) in x's dtype


#: Voxels x channels per block of a pass (1 MiB of float32: measured best here, 2x
#: faster than 64 Ki elements, whose per-channel rows are too short).
BLOCK_ELEMENTS = 1 << 18


def _channel_blocks(*arrays):
    """The arrays (same NCDHW shape) as blocks ``(channels, views)``: ``channels`` a slice of
    the channel axis, ``views`` the arrays' ``(C', L)`` (NumPy) pieces for it.  On NumPy a
    block is one sample's channels ``[c0, c1)`` over voxels ``[v0, v1)``, about
    ``BLOCK_ELEMENTS`` in all, its rows as long as possible (a whole sample's voxels where
    they fit, fewer channels then): every per-channel reduction then runs over long rows
    (measured, 2 threads, 1 x 128 x 32^3: rows of 2048 voxels, all 128 channels, took the
    backward's sums 4.9 ms, rows of 32768 by 8 channels 1.9 ms).  On CuPy (or for an array
    of at most one block) the whole ``(N, C, DHW)`` array is one block."""
    n, c = arrays[0].shape[:2]
    flat = [array_module(a).ascontiguousarray(a).reshape(n, c, -1) for a in arrays]
    size = flat[0].shape[2]
    if array_module(*arrays) is not numpy or n * c * size <= BLOCK_ELEMENTS:   # (small or empty)
        return [(slice(None), tuple(flat))]
    step = min(size, BLOCK_ELEMENTS)                                  # voxels per row
    rows = max(1, BLOCK_ELEMENTS // step)                             # channels per block
    return [(slice(c0, min(c0 + rows, c)), tuple(f[i, c0:c0 + rows, v0:v0 + step] for f in flat))
            for i in range(n) for c0 in range(0, c, rows) for v0 in range(0, size, step)]


def _run_blocks(fn, blocks):
    """``fn(channels, *views)`` for every block, over the worker threads (numpy); results in
    block order."""
    results = [None] * len(blocks)

    def one(_, i):
        results[i] = fn(blocks[i][0], *blocks[i][1])
    workers = _threads.thread_count(array_module(blocks[0][1][0]))
    _threads.run(one, list(range(len(blocks))), workers)
    return results


def _channel_sums(partials, blocks, c):
    """Per-block float64 partial sums ``(..., C')`` added per channel, in block order -> (C,)."""
    xp = array_module(partials[0])
    total = xp.zeros(c, dtype=xp.float64)
    for part, (channels, _) in zip(partials, blocks):
        total[channels] += part.reshape(-1, part.shape[-1]).sum(axis=0)
    return total


def _col(v, dtype):
    """(C,) -> (C, 1) in ``dtype``: per-channel scalars for a (..., C, L) block."""
    return v.astype(dtype).reshape(-1, 1)


def _check_channel_vector(v, name, channels):
    if v is None:
        return
    check_ndim(v, 1, name, "C")
    if v.shape[0] != channels:
        raise ValueError(f"{name} has {v.shape[0]} channels but x has {channels}")


def batch_norm_local_sums(x, shift=None):
    """(count, S1, S2): count = N*D*H*W (int), S1 = sum(x - shift), S2 = sum((x - shift)^2).

    S1, S2: float64 arrays of shape (C,); ``shift`` (C,) defaults to 0 (see module doc).
    The shifted values are formed in x's dtype and summed in float64, block by block.
    """
    check_ndim(x, 5, "x", "N, C, D, H, W")
    check_float("x", x)
    _check_channel_vector(shift, "shift", x.shape[1])
    xp = array_module(x)
    c = x.shape[1]
    count = x.shape[0] * x.shape[2] * x.shape[3] * x.shape[4]
    k = None if shift is None else _col(shift, x.dtype)

    def sums(ch, xb):
        xs = xb if k is None else xb - k[ch]
        s1 = xp.sum(xs, axis=-1, dtype=xp.float64)
        xs = xs * xs if k is None else xp.multiply(xs, xs, out=xs)
        return s1, xp.sum(xs, axis=-1, dtype=xp.float64)
    blocks = _channel_blocks(x)
    parts = _run_blocks(sums, blocks)
    return (count, _channel_sums([a for a, _ in parts], blocks, c),
            _channel_sums([b for _, b in parts], blocks, c))


def batch_norm_stats(count, sum_, sumsq, eps=1e-5, shift=None):
    """(mean, var_biased, inv_std), float64 (C,), from the (global) shifted sums."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    xp = array_module(sum_, sumsq)
    m1 = sum_ / count
    var = xp.maximum(sumsq / count - m1 * m1, 0.0)
    mean = m1 if shift is None else m1 + shift.astype(xp.float64)
    return mean, var, 1.0 / xp.sqrt(var + eps)


def update_running_stats(running_mean, running_var, mean, var_biased, count, momentum=0.1):
    """In place: running <- (1 - momentum) running + momentum * batch (variance unbiased)."""
    if count < 2:
        raise ValueError(f"count must be >= 2 to update the running variance, got {count}")
    var_unbiased = var_biased * (count / (count - 1))
    running_mean[...] = (1 - momentum) * running_mean + momentum * mean.astype(running_mean.dtype)
    running_var[...] = (1 - momentum) * running_var + momentum * var_unbiased.astype(running_var.dtype)


def batch_norm_forward(x, mean, inv_std, gamma=None, beta=None):
    """y = gamma * (x - mean) * inv_std + beta  -> (y, cache); mean/inv_std cast to x's dtype."""
    check_ndim(x, 5, "x", "N, C, D, H, W")
    check_float("x", x)
    for name, v in (("mean", mean), ("inv_std", inv_std), ("gamma", gamma), ("beta", beta)):
        _check_channel_vector(v, name, x.shape[1])
    check_same_dtype(x=x, gamma=gamma, beta=beta)
    xp = array_module(x)
    dt = x.dtype
    # y = x * a + c with a = gamma * inv_std, c = beta - mean * a (per channel, in float64)
    a = inv_std.astype(xp.float64) * (1.0 if gamma is None else gamma.astype(xp.float64))
    c = (0.0 if beta is None else beta.astype(xp.float64)) - mean.astype(xp.float64) * a
    a, c = _col(a, dt), _col(c, dt)
    y = xp.empty(x.shape, dtype=dt)

    def normalise(ch, yb, xb):
        xp.multiply(xb, a[ch], out=yb)
        yb += c[ch]
    _run_blocks(normalise, _channel_blocks(y, x))
    return y, BatchNormCache(x, mean.astype(dt), gamma, inv_std.astype(dt))


def batch_norm_backward_local_sums(dy, cache):
    """(sum(dy), sum(dy * xhat)) over the local block: float64 (C,) each."""
    check_same_dtype(x=cache.x, dy=dy)
    if dy.shape != cache.x.shape:
        raise ValueError(f"dy has shape {dy.shape}, expected {cache.x.shape}")
    xp = array_module(dy)
    m = _col(cache.mean, dy.dtype)

    def sums(ch, gb, xb):                      # sum(dy), sum(dy * (x - mean)), in float64
        t = xp.subtract(xb, m[ch])
        t *= gb
        return xp.sum(gb, axis=-1, dtype=xp.float64), xp.sum(t, axis=-1, dtype=xp.float64)
    c = dy.shape[1]
    blocks = _channel_blocks(dy, cache.x)
    parts = _run_blocks(sums, blocks)
    sum_dy_centred = _channel_sums([b for _, b in parts], blocks, c)
    return (_channel_sums([a for a, _ in parts], blocks, c),
            sum_dy_centred * cache.inv_std.astype(xp.float64))


def batch_norm_backward(dy, cache, sum_dy, sum_dy_xhat, count, local_sums=None):
    """(dx, dgamma, dbeta) of training-mode batch norm.

    ``sum_dy``, ``sum_dy_xhat``, ``count``: the sums over *all* n elements the
    statistics were taken over (allreduced when partitioned).  ``dgamma`` and
    ``dbeta`` are this block's *local* contributions (None when gamma is None):
    the caller sums them over spatial shards like any other weight gradient.
    ``local_sums``: ``batch_norm_backward_local_sums(dy, cache)`` when the caller has
    them already (the pass is not repeated).
    """
    local_sum_dy, local_sum_dy_xhat = (batch_norm_backward_local_sums(dy, cache)
                                       if local_sums is None else local_sums)
    xp = array_module(dy)
    dt = dy.dtype
    f64 = xp.float64
    inv_std = cache.inv_std.astype(f64)
    a = inv_std if cache.gamma is None else inv_std * cache.gamma.astype(f64)
    # dx = a * (dy - mean(dy) - xhat * mean(dy xhat)) = a * dy + b * x + c   (module doc)
    b = -a * inv_std * (sum_dy_xhat / count)
    c = -a * (sum_dy / count) - b * cache.mean.astype(f64)
    a, b, c = _col(a, dt), _col(b, dt), _col(c, dt)
    dx = xp.empty(dy.shape, dtype=dt)

    def grad(ch, db, gb, xb):
        xp.multiply(xb, b[ch], out=db)
        db += c[ch]
        db += gb * a[ch]
    _run_blocks(grad, _channel_blocks(dx, dy, cache.x))
    if cache.gamma is None:
        return dx, None, None
    return dx, local_sum_dy_xhat.astype(dt), local_sum_dy.astype(dt)


def batch_norm3d(x, gamma=None, beta=None, running_mean=None, running_var=None,
                 training=True, momentum=0.1, eps=1e-5):
    """One-process batch norm -> (y, cache); training updates running stats in place.

    Eval mode (``training=False``) normalises with the running statistics.
    """
    check_ndim(x, 5, "x", "N, C, D, H, W")
    for name, v in (("running_mean", running_mean), ("running_var", running_var)):
        _check_channel_vector(v, name, x.shape[1])
    if not training:
        if running_mean is None or running_var is None:
            raise ValueError("eval mode (training=False) needs running_mean and running_var")
        xp = array_module(x)
        inv_std = 1.0 / xp.sqrt(running_var.astype(xp.float64) + eps)
        y, cache = batch_norm_forward(x, running_mean, inv_std, gamma, beta)
        return y, (cache, None)
    count, s1, s2 = batch_norm_local_sums(x, shift=running_mean)
    if count < 2:
        raise ValueError(f"training batch norm needs more than one value per channel, "
                         f"got x of shape {x.shape}")
    mean, var, inv_std = batch_norm_stats(count, s1, s2, eps, shift=running_mean)
    if running_mean is not None and running_var is not None:
        update_running_stats(running_mean, running_var, mean, var, count, momentum)
    y, cache = batch_norm_forward(x, mean, inv_std, gamma, beta)
    return y, (cache, count)


def batch_norm3d_backward(dy, cache):
    """(dx, dgamma, dbeta) for ``batch_norm3d``'s cache (training or eval mode).

    In eval mode mean and inv_std are constants: dx = gamma * inv_std * dy.
    """
    bn_cache, count = cache
    if count is not None:
        sums = batch_norm_backward_local_sums(dy, bn_cache)
        return batch_norm_backward(dy, bn_cache, *sums, count, local_sums=sums)
    sum_dy, sum_dy_xhat = batch_norm_backward_local_sums(dy, bn_cache)
    scale = bn_cache.inv_std if bn_cache.gamma is None else bn_cache.inv_std * bn_cache.gamma
    dx = _per_channel(scale) * dy
    if bn_cache.gamma is None:
        return dx, None, None
    return dx, sum_dy_xhat.astype(dy.dtype), sum_dy.astype(dy.dtype)


__all__ = ["BatchNormCache", "batch_norm_local_sums", "batch_norm_stats", "update_running_stats",
           "batch_norm_forward", "batch_norm_backward_local_sums", "batch_norm_backward",
           "batch_norm3d", "batch_norm3d_backward"]
