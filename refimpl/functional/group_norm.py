"""3D group normalisation and instance normalisation, split into local steps around the reductions.

Group norm (Wu & He 2018; PyTorch ``torch.nn.functional.group_norm``): the C channels are
cut into G groups of C/G consecutive channels, and each sample n normalises each group g
over its m = (C/G) * D * H * W values:

    mean[n, g] = sum(x) / m,  var[n, g] = sum((x - mean)^2) / m     (biased: it normalises)
    xhat = (x - mean[n, g]) * inv_std[n, g],  inv_std = 1 / sqrt(var + eps)
    y    = gamma[c] * xhat + beta[c]                                 (scale and shift per channel)

Instance norm is group norm with G = C (every channel its own group: statistics per sample
and channel over D * H * W), as ``torch.nn.functional.instance_norm(use_input_stats=True)``.
Neither keeps running statistics: they are per sample, so training and evaluation normalise
alike, and data parallelism (samples on other ranks) needs no reduction at all.

The backward, with g = gamma[c] * dy and the sums over the same m values of (n, group),

    dx     = inv_std * (g - sum(g) / m - xhat * sum(g * xhat) / m)
    dgamma = sum over n, D, H, W of dy * xhat     (per channel)
    dbeta  = sum over n, D, H, W of dy            (per channel)

(differentiate y through xhat, mean and inv_std: d mean / dx = 1/m,
d inv_std / dx = -inv_std^3 (x - mean) / m; the two corrections are the projections of g
on the constants and on xhat, which the normalisation removes).  gamma varies inside a
group, so the sums are of ``gamma * dy``, not of ``dy`` as in batch norm.  But gamma is one
number per channel, so every sum the backward needs comes from two sums per (sample,
channel), ``r1 = sum(dy)`` and ``r2 = sum(dy * xhat)`` over D, H, W (float64):

    sum(g) = sum over the group's channels of gamma[c] * r1,   sum(g * xhat) likewise of r2
    dbeta  = sum over n of r1,                                 dgamma = sum over n of r2

one pass over dy and x for all four (``group_norm_backward_row_sums``).

Every per-(n, group) sum is a separate function result, so a spatially partitioned layer
computes the sums on its block, allreduces them over the spatial group, and finishes with
the global sums (refimpl/nn/norm.py):

    forward:  group_norm_local_sums -> Allreduce -> group_norm_stats -> group_norm_forward
    backward: group_norm_backward_row_sums -> group_norm_backward_local_sums -> Allreduce
              -> group_norm_backward (the row sums passed to both: dgamma, dbeta from them)

Numerical scheme: batch norm's (refimpl/functional/batch_norm.py), one allreduce per
direction.  The statistics come from the shifted sums ``S1 = sum(x - K)``,
``S2 = sum((x - K)^2)`` accumulated in float64, ``mean = K + S1/m``,
``var = S2/m - (S1/m)^2``; the cancellation costs about ``(mean - K)^2 / var`` relative to
float64's eps.  Group norm has no running mean to serve as ``K`` (statistics are per
sample), so the layers pass none (K = 0): the float64 accumulation keeps float32 and float64
results accurate unless |mean| >> std within a group (at |mean| / std = 1e4 a float64
variance keeps 8 digits).  A caller that knows a better shift, the same on every rank of the
reduction, passes it as ``shift`` (N, G).  Sums travel as float64 arrays of shape (N, G).

The sums need every value of a group on the ranks that reduce them: a split of the
channels (model parallelism) that cuts a group is refused by the layers
(refimpl/nn/norm.py), one that keeps groups whole reduces nothing over the model axis.

Speed: this file is the reference.  Large NumPy arrays run the same operations block by
block on worker threads (``refimpl/kernels/group_norm.py``, on batch norm's blocks: the
elementwise passes give the same bits, the sums differ by float64 rounding).  The one rule
(``_route.kernel_for``): NumPy arrays of more than ``kernels.batch_norm.BLOCK_ELEMENTS``
elements take the kernel outside ``functional.reference_only()``; CuPy and small arrays take
the math below.

Shapes: inside, x is viewed as (N, G, C/G, D*H*W): a per-(n, group) value broadcasts as
(N, G, 1, 1), a per-channel one as (1, G, C/G, 1).
"""
from __future__ import annotations

import numbers
from typing import NamedTuple

from ..backend import array_module, check_same_dtype
from ..kernels import group_norm as fast
from ._route import kernel_for
from .args import check_channel_vector, check_float, check_ndim, check_real
from .batch_norm import batch_norm_stats


class GroupNormCache(NamedTuple):
    x: object           # (N, C, D, H, W) the input
    num_groups: int     # G
    mean: object        # (N, G) in x's dtype
    inv_std: object     # (N, G) in x's dtype
    gamma: object       # (C,) or None


def check_num_groups(num_groups, channels: int) -> int:
    """G a positive integer dividing C, else a ValueError naming both."""
    if isinstance(num_groups, bool) or not isinstance(num_groups, numbers.Integral) or num_groups < 1:
        raise ValueError(f"num_groups must be a positive integer, got {num_groups!r}")
    num_groups = int(num_groups)
    if channels % num_groups:
        raise ValueError(f"num_groups={num_groups} must divide the number of channels C={channels} "
                         f"(every group holds C/num_groups channels)")
    return num_groups


def _grouped(a, num_groups):
    """(N, C, D, H, W) -> (N, G, C/G, D*H*W): the values of group g of sample n in [n, g]."""
    n, c = a.shape[:2]
    return a.reshape(n, num_groups, c // num_groups, -1)


def _per_group(v):
    """(N, G) -> (N, G, 1, 1) against the grouped view."""
    return v.reshape(v.shape + (1, 1))


def _per_channel(v, num_groups):
    """(C,) -> (1, G, C/G, 1) against the grouped view."""
    return v.reshape(1, num_groups, -1, 1)


def _sum_per_group(a):
    """(N, G, C/G, L) -> (N, G) float64."""
    xp = array_module(a)
    n, g = a.shape[:2]
    return xp.sum(a.reshape(n, g, -1), axis=-1, dtype=xp.float64)


def _check_x(x, num_groups):
    check_ndim(x, 5, "x", "N, C, D, H, W")
    check_float("x", x)
    check_num_groups(num_groups, x.shape[1])


def _check_group_array(v, name, n, g):
    if v is None:
        return
    if tuple(getattr(v, "shape", ())) != (n, g):
        raise ValueError(f"{name} must have shape (N, G) = {(n, g)}, got "
                         f"{tuple(v.shape) if hasattr(v, 'shape') else type(v).__name__}")


def group_norm_local_sums(x, num_groups, shift=None):
    """(count, S1, S2): count = (C/G) * D * H * W of this block (int), S1 = sum(x - shift),
    S2 = sum((x - shift)^2) per (sample, group): float64 (N, G).

    ``shift`` (N, G) defaults to 0 (module doc); the shifted values are formed in x's dtype
    and summed in float64.  An empty block gives count 0 and zero sums.
    """
    _check_x(x, num_groups)
    _check_group_array(shift, "shift", x.shape[0], num_groups)
    count = (x.shape[1] // num_groups) * x.shape[2] * x.shape[3] * x.shape[4]
    kernel = kernel_for(fast, x)
    if kernel is not None:
        return (count,) + kernel.local_sums(x, num_groups, shift)
    xg = _grouped(x, num_groups)                                     # (N, G, C/G, L)
    xs = xg if shift is None else xg - _per_group(shift.astype(x.dtype))   # x - K
    return count, _sum_per_group(xs), _sum_per_group(xs * xs)


def group_norm_stats(count, sum_, sumsq, eps=1e-5, shift=None):
    """(mean, var_biased, inv_std), float64 (N, G), from the (global) shifted sums of
    ``count`` values per (sample, group)."""
    return batch_norm_stats(count, sum_, sumsq, eps, shift)


def group_norm_forward(x, num_groups, mean, inv_std, gamma=None, beta=None):
    """y = gamma * (x - mean) * inv_std + beta -> (y, cache); mean/inv_std (N, G) cast to x's dtype."""
    _check_x(x, num_groups)
    n, c = x.shape[:2]
    for name, v in (("mean", mean), ("inv_std", inv_std)):
        _check_group_array(v, name, n, num_groups)
    for name, v in (("gamma", gamma), ("beta", beta)):
        check_channel_vector(v, name, c)
    check_same_dtype(x=x, gamma=gamma, beta=beta)
    dt = x.dtype
    mean, inv_std = mean.astype(dt), inv_std.astype(dt)
    cache = GroupNormCache(x, num_groups, mean, inv_std, gamma)
    kernel = kernel_for(fast, x)
    if kernel is not None:
        return kernel.forward(x, num_groups, mean, inv_std, gamma, beta), cache
    xhat = (_grouped(x, num_groups) - _per_group(mean)) * _per_group(inv_std)     # (N, G, C/G, L)
    y = xhat if gamma is None else xhat * _per_channel(gamma, num_groups)
    if beta is not None:
        y = y + _per_channel(beta, num_groups)
    return y.reshape(x.shape), cache


def _xhat(cache):
    """(N, G, C/G, L) normalised input, recomputed from the cache."""
    return (_grouped(cache.x, cache.num_groups) - _per_group(cache.mean)) * _per_group(cache.inv_std)


def _check_dy(dy, cache):
    if not isinstance(cache, GroupNormCache):
        raise ValueError(f"cache must be the second result of group_norm3d / group_norm_forward, got "
                         f"{type(cache).__name__}")
    if not hasattr(dy, "shape") or tuple(dy.shape) != tuple(cache.x.shape):
        raise ValueError(f"dy must have x's shape {tuple(cache.x.shape)}, got "
                         f"{tuple(dy.shape) if hasattr(dy, 'shape') else type(dy).__name__}")
    check_same_dtype(x=cache.x, dy=dy)


def group_norm_backward_row_sums(dy, cache):
    """(r1, r2) = (sum(dy), sum(dy * xhat)) per (sample, channel) over this block's D, H, W:
    float64 (N, C) each (module doc: every sum of the backward is made of them)."""
    _check_dy(dy, cache)
    kernel = kernel_for(fast, dy)
    if kernel is not None:
        return kernel.backward_row_sums(dy, cache.x, cache.num_groups, cache.mean, cache.inv_std)
    xp = array_module(dy)
    n, c = dy.shape[:2]
    dyc = dy.reshape(n, c, -1)                                       # (N, C, L)
    xhat = _xhat(cache).reshape(n, c, -1)
    return xp.sum(dyc, axis=-1, dtype=xp.float64), xp.sum(dyc * xhat, axis=-1, dtype=xp.float64)


def _check_row_sums(row_sums, dy):
    if not (isinstance(row_sums, tuple) and len(row_sums) == 2
            and all(tuple(getattr(r, "shape", ())) == tuple(dy.shape[:2]) for r in row_sums)):
        raise ValueError(f"row_sums must be group_norm_backward_row_sums' pair of (N, C) = "
                         f"{tuple(dy.shape[:2])} arrays")


def group_norm_backward_local_sums(dy, cache, row_sums=None):
    """(sum(g), sum(g * xhat)) with g = gamma * dy over this block: float64 (N, G) each, as
    ``sum over the group's channels of gamma[c] * r`` of the row sums (module doc).
    ``row_sums``: ``group_norm_backward_row_sums(dy, cache)`` when the caller has them (the
    pass over dy and x is not repeated)."""
    _check_dy(dy, cache)
    if row_sums is None:
        row_sums = group_norm_backward_row_sums(dy, cache)
    _check_row_sums(row_sums, dy)
    xp = array_module(dy)
    n, c = dy.shape[:2]
    gamma = None if cache.gamma is None else cache.gamma.astype(xp.float64)
    return tuple((r if gamma is None else r * gamma).reshape(n, cache.num_groups, -1).sum(axis=-1)
                 for r in row_sums)


def group_norm_backward(dy, cache, sum_g, sum_g_xhat, count, row_sums=None):
    """(dx, dgamma, dbeta) of group norm.

    ``sum_g``, ``sum_g_xhat`` (N, G) and ``count``: the sums over *all* ``count`` values of each
    (sample, group) the statistics were taken over (allreduced when partitioned).  ``dgamma``
    and ``dbeta`` (C,) are this block's *local* contributions (None when gamma is None): the
    caller sums them over spatial shards like any other weight gradient; they are the row
    sums (``row_sums``, when the caller has them, else computed here) added over the samples.
    """
    _check_dy(dy, cache)
    _check_group_array(sum_g, "sum_g", dy.shape[0], cache.num_groups)
    _check_group_array(sum_g_xhat, "sum_g_xhat", dy.shape[0], cache.num_groups)
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    dt, G = dy.dtype, cache.num_groups
    mean_g, mean_g_xhat = (sum_g / count).astype(dt), (sum_g_xhat / count).astype(dt)   # (N, G)
    if row_sums is not None:
        _check_row_sums(row_sums, dy)
    kernel = kernel_for(fast, dy)
    if kernel is not None:
        dx = kernel.backward(dy, cache.x, G, cache.mean, cache.inv_std, cache.gamma, mean_g, mean_g_xhat)
    else:
        xhat = _xhat(cache)                                          # (N, G, C/G, L)
        dyg = _grouped(dy, G)
        g = dyg if cache.gamma is None else dyg * _per_channel(cache.gamma, G)
        mean_g, mean_g_xhat = _per_group(mean_g), _per_group(mean_g_xhat)
        dx = _per_group(cache.inv_std) * (g - mean_g - xhat * mean_g_xhat)   # the formula of the module doc
        dx = dx.reshape(dy.shape)
    if cache.gamma is None:
        return dx, None, None
    r1, r2 = group_norm_backward_row_sums(dy, cache) if row_sums is None else row_sums
    return dx, r2.sum(axis=0).astype(dt), r1.sum(axis=0).astype(dt)     # dgamma, dbeta (C,)


def group_norm3d(x, num_groups, weight=None, bias=None, eps=1e-5):
    """One-process group norm -> (y, cache): statistics per (sample, group of C/G channels)
    over (C/G, D, H, W), biased variance, as ``torch.nn.functional.group_norm``."""
    _check_x(x, num_groups)
    check_real("eps", eps, minimum=0)
    num_groups = int(num_groups)
    count, s1, s2 = group_norm_local_sums(x, num_groups)
    if count < 1:
        raise ValueError(f"group norm needs at least one value per group, got x of shape {tuple(x.shape)}")
    mean, _, inv_std = group_norm_stats(count, s1, s2, eps)
    y, cache = group_norm_forward(x, num_groups, mean, inv_std, weight, bias)
    return y, cache


def group_norm3d_backward(dy, cache):
    """(dx, dweight, dbias) for ``group_norm3d``'s (or ``instance_norm3d``'s) cache."""
    rows = group_norm_backward_row_sums(dy, cache)
    sums = group_norm_backward_local_sums(dy, cache, row_sums=rows)
    x = cache.x
    count = (x.shape[1] // cache.num_groups) * x.shape[2] * x.shape[3] * x.shape[4]
    return group_norm_backward(dy, cache, *sums, count, row_sums=rows)


def instance_norm3d(x, weight=None, bias=None, eps=1e-5):
    """One-process instance norm -> (y, cache): group norm with one group per channel
    (statistics per sample and channel over D, H, W), as
    ``torch.nn.functional.instance_norm(use_input_stats=True)``; backward:
    ``instance_norm3d_backward`` (= ``group_norm3d_backward``)."""
    check_ndim(x, 5, "x", "N, C, D, H, W")
    return group_norm3d(x, x.shape[1], weight, bias, eps)


def instance_norm3d_backward(dy, cache):
    """(dx, dweight, dbias) for ``instance_norm3d``'s cache."""
    return group_norm3d_backward(dy, cache)


__all__ = ["GroupNormCache", "check_num_groups", "group_norm_local_sums", "group_norm_stats",
           "group_norm_forward", "group_norm_backward_row_sums", "group_norm_backward_local_sums",
           "group_norm_backward",
           "group_norm3d", "group_norm3d_backward", "instance_norm3d", "instance_norm3d_backward"]
