"""group_norm3d and instance_norm3d: per-sample statistics layers, priced by the planner.

Group norm (``refimpl.functional.group_norm3d``) normalises each sample by groups of C/G
channels, instance norm (``instance_norm3d``) by channel (G = C).  On a grid the
per-(sample, group) sums are allreduced over the spatial group only: the sample groups hold
other samples and reduce nothing (``nn/spatial.py`` SpatialGroupNorm3d).  Under a channel
split (the U-Net's model-parallel bottleneck) each model rank holds whole groups (a split that
cuts one is refused: ``nn/model_parallel.py`` check_whole_groups), so nothing crosses the
model axis either.

For now these kinds carry only the planner's hooks (like plan_only.py's): they sit in
``PLAN_ONLY`` (refimpl/layers/__init__.py), so check-layer and the oracle do not offer them
yet.  The statistics groups per sample come with the model's ``describe()`` entry
(``norm_groups``; the planner's ``Layer.norm_groups``).
"""
from __future__ import annotations

from .base import LayerKind


class _PerSampleNorm(LayerKind):
    """A normalisation whose statistics are per (sample, group): pointwise but for its sums."""

    def plan_split_channels(self, layer):
        return layer.c_out

    def plan_param_sizes(self, layer, pm, m, width):
        """weight and bias: the rank's channel slice when the activation is channel-split."""
        c = layer.c_out if layer.split == "none" or pm == 1 else width(layer.c_out)
        return [c, c]

    def plan_groups(self, layer) -> int:
        """Statistics groups per sample of the whole layer."""
        return layer.norm_groups or layer.c_out

    def plan_cost(self, layer, rank, cost):
        """Memory-bound at batch norm's ``Machine.bn_rate`` (the same passes: sums, normalise;
        backward sums, dx); over the spatial group the value count (8 bytes) and the
        (2, N_r, G_r) float64 sums allreduced forward, the (2, N_r, G_r) gradient sums backward,
        G_r the groups of the rank's channels."""
        n_r, f_local, v_block = rank.n_r, rank.f_local(layer), rank.block_voxels(layer)
        cost.flops = 10.0 * n_r * f_local * v_block
        compute_s = n_r * f_local * v_block / rank.machine.bn_rate
        cost.saved_bytes = n_r * f_local * v_block * rank.itemsize
        groups = max(1, self.plan_groups(layer) * f_local // layer.c_out)
        sums_bytes = 16 * n_r * groups
        spatial = rank.spatial_group
        cost.comm_s = rank.allreduce_s(8, spatial) + 2 * rank.allreduce_s(sums_bytes, spatial)
        cost.allreduce_bytes = 2 * sums_bytes if spatial[0] > 1 else 0
        return compute_s


class GroupNorm3dKind(_PerSampleNorm):
    name = "group_norm3d"
    plan_label = "group_norm"


class InstanceNorm3dKind(_PerSampleNorm):
    name = "instance_norm3d"
    plan_label = "instance_norm"

    def plan_groups(self, layer):
        return layer.c_out


KINDS = (GroupNorm3dKind(), InstanceNorm3dKind())
