"""layer_norm3d: per-sample statistics over (C, D, H, W), a per-channel scale and shift.

Layer norm (``refimpl.functional.layer_norm3d``) is group norm with one group: each sample's
mean and variance cover all its channels and voxels, weight and bias are per channel (C,)
broadcast over D, H, W.  So the kind is group norm's (``norm.py``, ``_PerSampleNorm``) with
G = 1: the same statistics (``sum_partial``, ``sumsq_partial`` of x; ``gsum_partial``,
``gxhat_partial`` of g = gamma*dy and g*xhat, now per sample: shape (N, 1)), allreduced over
the spatial group (the ranks holding the other blocks of the same samples), the same
``rank_partials``, ``known_mistakes`` (statistics of each rank's own block) and ``torch_ranks``
('local-stats' plant), and the layers of refimpl/nn built with one group
(``GroupNorm3d(1, C)``, ``SpatialGroupNorm3d(1, C)``).

No channel split (``--model-parallel channel``): the one group spans every channel, so its
sums would have to cross the model axis too, which ``ModelParallelGroupNorm3d`` refuses.
PyTorch twin: ``torch.nn.functional.layer_norm`` over (C, D, H, W) with the (C,) weight and
bias expanded over (D, H, W).
"""
from __future__ import annotations

from .. import functional as F
from .norm import EPS, _PerSampleNorm


class LayerNorm3dKind(_PerSampleNorm):
    name = "layer_norm3d"
    plan_label = "layer_norm"
    model_modes = ("none",)              # one group over every channel: a channel split would cut it
    affine_mistake = ("a per-channel scale and shift error: layer-norm statistics (mean, variance over C, D, H, "
                      "W per sample; biased vs. unbiased; eps) or gamma/beta differ from the case's (biased "
                      "variance, eps 1e-5)")

    def groups(self, spec):
        return 1

    def forward(self, spec, x, w, b):
        return F.layer_norm3d(x, w, b, EPS)

    def backward(self, spec, dy, cache):
        return F.layer_norm3d_backward(dy, cache)

    def local(self, spec, *, rng, dtype):
        from ..nn import GroupNorm3d
        return GroupNorm3d(1, spec.input[1], EPS, dtype=dtype)

    def partitioned(self, spec, *, grid, rng, dtype):
        from ..nn.spatial import SpatialGroupNorm3d
        return SpatialGroupNorm3d(1, spec.input[1], EPS, grid=grid, dtype=dtype)

    def torch_forward(self, spec, tf, x, w, b):
        shape = tuple(x.shape[1:])
        return tf.layer_norm(x, shape, w.reshape(-1, 1, 1, 1).expand(shape), b.reshape(-1, 1, 1, 1).expand(shape),
                             EPS)

    def reduction_length(self, spec, tensor, out_shape):
        n, c, d, h, w = spec.input
        if tensor in ("dw", "db", "dw_partial", "db_partial"):
            return n * d * h * w, "N·D·H·W values per channel"
        return c * d * h * w, "C·D·H·W values per sample statistic"

    def plan_groups(self, layer):
        return 1

    def plan_reference(self, channels):
        return (lambda x, w, b: F.layer_norm3d(x, w, b, EPS)), F.layer_norm3d_backward


KINDS = (LayerNorm3dKind(),)
