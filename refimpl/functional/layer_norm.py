"""3D layer normalisation: each sample normalised over all its channels and voxels (C, D, H, W).

Layer norm (Ba, Kiros & Hinton 2016) of an NCDHW tensor: sample n normalises its
m = C * D * H * W values with one mean and one variance,

    mean[n] = sum(x[n]) / m,  var[n] = sum((x[n] - mean[n])^2) / m     (biased: it normalises)
    xhat = (x - mean[n]) * inv_std[n],  inv_std = 1 / sqrt(var + eps)
    y    = gamma[c] * xhat + beta[c]                                    (scale and shift per channel)

The affine weight and bias are per channel, shape (C,), broadcast over D, H, W (as
``torch.nn.GroupNorm(1, C)``), not the (C, D, H, W) elementwise ones of
``torch.nn.functional.layer_norm(x, (C, D, H, W), weight, bias)``: with weight and bias
the (C,) vectors expanded over (D, H, W) the two agree.  The backward, the sums over the
m values of sample n, g = gamma[c] * dy:

    dx     = inv_std * (g - sum(g) / m - xhat * sum(g * xhat) / m)
    dgamma = sum over n, D, H, W of dy * xhat     (per channel)
    dbeta  = sum over n, D, H, W of dy            (per channel)

This is group norm with one group (refimpl/functional/group_norm.py, whose module doc
derives the backward and gives the numerical scheme), and it is computed by it: the split
API (``group_norm_local_sums`` -> Allreduce -> ``group_norm_stats`` -> ``group_norm_forward``;
``group_norm_backward_local_sums`` -> Allreduce -> ``group_norm_backward``) with
``num_groups=1`` is layer norm's, the per-sample statistics of shape (N, 1).
"""
from __future__ import annotations

from .args import check_ndim
from .group_norm import group_norm3d, group_norm3d_backward


def layer_norm3d(x, weight=None, bias=None, eps=1e-5):
    """One-process layer norm -> (y, cache): statistics per sample over (C, D, H, W), biased
    variance, per-channel weight and bias (C,) (module doc); backward: ``layer_norm3d_backward``."""
    check_ndim(x, 5, "x", "N, C, D, H, W")
    return group_norm3d(x, 1, weight, bias, eps)


def layer_norm3d_backward(dy, cache):
    """(dx, dweight, dbias) for ``layer_norm3d``'s cache (dweight, dbias None without weight)."""
    return group_norm3d_backward(dy, cache)


__all__ = ["layer_norm3d", "layer_norm3d_backward"]
