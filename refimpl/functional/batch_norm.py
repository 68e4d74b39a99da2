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

Sums: every per-channel sum is accumulated in float64 (``sum(dtype=float64)``), although
casting each element costs as much as the rest of a pass: float32 partial sums change
the statistics by ~sqrt(L) eps between grids, and the sums cancel (``sum(dy)`` is about 0
for a batch norm whose output another batch norm normalises again, as in the U-Net),
where Adam turns rounding near 0 into a full step of either sign: float32 training then
differed between grids by 12 % of such a bias.  The forward computes
``y = a * x + c`` per channel with ``a = gamma * inv_std``, ``c = beta - mean * a``
(the formula above, two elementwise operations).  The backward needs

    sum(dy),  sum(dy * xhat) = inv_std * sum(dy * (x - mean))

(one subtraction and one product, then the two sums).  Then, per channel with
``a = gamma * inv_std``, ``b = -a * inv_std * mean(dy * xhat)``, ``c = -a * mean(dy) - b * mean``,

    dx = a * dy + b * x + c                  (4 elementwise operations instead of 6)

which is the formula above rearranged.  Its rounding: ``b * x + c`` stands for
``b * (x - mean)`` and carries an error of about ``eps * |mean| / std`` of that term,
harmless unless ``|mean| >> std`` (then the shift that the layers pass, the running
mean, keeps the forward accurate, and the backward loses ``log10(|mean| / std)`` digits).

Speed: this file is the reference.  Large NumPy arrays run the same operations block by
block on worker threads (``refimpl/kernels/batch_norm.py``: the elementwise passes give
the same bits, the sums differ by float64 rounding).  The one rule (``_route.kernel_for``):
NumPy arrays of more than ``kernels.batch_norm.BLOCK_ELEMENTS`` elements take the kernel
outside ``functional.reference_only()``; CuPy and small arrays take the math below.
"""
from __future__ import annotations

from typing import NamedTuple

from ..backend import array_module, check_same_dtype
from ..kernels import batch_norm as fast
from ._route import kernel_for
from .args import check_channel_vector, check_float, check_ndim, check_real



def _per_channel(v):
    """(C,) -> (1, C, 1, 1, 1) for broadcasting against NCDHW."""
    return v.reshape(1, -1, 1, 1, 1)


def _sum_per_channel(a):
    """(N, C, D, H, W) -> (C,) float64: each sample's voxels summed, then the samples."""
    xp = array_module(a)
    n, c = a.shape[:2]
    return xp.sum(a.reshape(n, c, -1), axis=-1, dtype=xp.float64).sum(axis=0)


class BatchNormCache(NamedTuple):
    x: object        # (N, C, D, H, W) the input
    mean: object     # (C,) in x's dtype
    gamma: object    # (C,) or None
    inv_std: object  # (C,) in x's dtype


def _col(v, dtype):
    """(C,) -> (C, 1) in ``dtype``: per-channel scalars for the kernel's (C', L) blocks."""
    return v.astype(dtype).reshape(-1, 1)


def batch_norm_local_sums(x, shift=None):
    """(count, S1, S2): count = N*D*H*W (int), S1 = sum(x - shift), S2 = sum((x - shift)^2).

    S1, S2: float64 arrays of shape (C,); ``shift`` (C,) defaults to 0 (see module doc).
    The shifted values are formed in x's dtype and summed in float64.
    """
    check_ndim(x, 5, "x", "N, C, D, H, W")
    check_float("x", x)
    check_channel_vector(shift, "shift", x.shape[1])
    count = x.shape[0] * x.shape[2] * x.shape[3] * x.shape[4]
    kernel = kernel_for(fast, x)
    if kernel is not None:
        return (count,) + kernel.local_sums(x, None if shift is None else _col(shift, x.dtype))
    xs = x if shift is None else x - _per_channel(shift.astype(x.dtype))     # x - K
    return count, _sum_per_channel(xs), _sum_per_channel(xs * xs)


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
        check_channel_vector(v, name, x.shape[1])
    check_same_dtype(x=x, gamma=gamma, beta=beta)
    xp = array_module(x)
    dt = x.dtype
    # y = x * a + c with a = gamma * inv_std, c = beta - mean * a (per channel, in float64)
    a = inv_std.astype(xp.float64) * (1.0 if gamma is None else gamma.astype(xp.float64))
    c = (0.0 if beta is None else beta.astype(xp.float64)) - mean.astype(xp.float64) * a
    kernel = kernel_for(fast, x)
    if kernel is not None:
        y = kernel.affine(x, _col(a, dt), _col(c, dt))
    else:
        y = x * _per_channel(a.astype(dt))
        y += _per_channel(c.astype(dt))
    return y, BatchNormCache(x, mean.astype(dt), gamma, inv_std.astype(dt))


def batch_norm_backward_local_sums(dy, cache):
    """(sum(dy), sum(dy * xhat)) over the local block: float64 (C,) each."""
    check_same_dtype(x=cache.x, dy=dy)
    if dy.shape != cache.x.shape:
        raise ValueError(f"dy has shape {dy.shape}, expected {cache.x.shape}")
    xp = array_module(dy)
    kernel = kernel_for(fast, dy)
    if kernel is not None:
        sum_dy, sum_dy_centred = kernel.backward_sums(dy, cache.x, _col(cache.mean, dy.dtype))
    else:
        sum_dy = _sum_per_channel(dy)
        sum_dy_centred = _sum_per_channel((cache.x - _per_channel(cache.mean)) * dy)  # sum(dy (x - mean))
    return sum_dy, sum_dy_centred * cache.inv_std.astype(xp.float64)


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
    kernel = kernel_for(fast, dy)
    if kernel is not None:
        dx = kernel.backward_dx(dy, cache.x, _col(a, dt), _col(b, dt), _col(c, dt))
    else:
        dx = cache.x * _per_channel(b.astype(dt))
        dx += _per_channel(c.astype(dt))
        dx += dy * _per_channel(a.astype(dt))
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
        check_channel_vector(v, name, x.shape[1])
    check_real("momentum", momentum)
    check_real("eps", eps, minimum=0)
    if training and (x.shape[1] < 1 or x.shape[0] * x.shape[2] * x.shape[3] * x.shape[4] < 2):
        raise ValueError(f"training batch norm needs a channel and more than one value per channel "
                         f"(C >= 1, N*D*H*W >= 2), got x of shape {x.shape}")
    if not training:
        if running_mean is None or running_var is None:
            raise ValueError("eval mode (training=False) needs running_mean and running_var")
        xp = array_module(x)
        inv_std = 1.0 / xp.sqrt(running_var.astype(xp.float64) + eps)
        y, cache = batch_norm_forward(x, running_mean, inv_std, gamma, beta)
        return y, (cache, None)
    count, s1, s2 = batch_norm_local_sums(x, shift=running_mean)
    mean, var, inv_std = batch_norm_stats(count, s1, s2, eps, shift=running_mean)
    if running_mean is not None and running_var is not None:
        update_running_stats(running_mean, running_var, mean, var, count, momentum)
    y, cache = batch_norm_forward(x, mean, inv_std, gamma, beta)
    return y, (cache, count)


def batch_norm3d_backward(dy, cache):
    """(dx, dgamma, dbeta) for ``batch_norm3d``'s cache (training or eval mode).

    In eval mode mean and inv_std are constants: dx = gamma * inv_std * dy.
    """
    if not (isinstance(cache, tuple) and len(cache) == 2 and isinstance(cache[0], BatchNormCache)):
        raise ValueError(f"cache must be the second result of batch_norm3d, got {type(cache).__name__}")
    bn_cache, count = cache
    if not hasattr(dy, "shape") or tuple(dy.shape) != tuple(bn_cache.x.shape):
        raise ValueError(f"dy must have x's shape {tuple(bn_cache.x.shape)}, got "
                         f"{tuple(dy.shape) if hasattr(dy, 'shape') else type(dy).__name__}")
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
