"""group_norm3d and instance_norm3d: per-sample statistics layers, priced by the planner.

Group norm (``refimpl.functional.group_norm3d``) normalises each sample by groups of C/G
channels, instance norm (``instance_norm3d``) by channel (G = C).  On a grid the
per-(sample, group) sums are allreduced over the spatial group only: the sample groups hold
other samples and reduce nothing (``nn/spatial.py`` SpatialGroupNorm3d).  Under a channel
split (the U-Net's model-parallel bottleneck) each model rank holds whole groups (a split that
cuts one is refused: ``nn/model_parallel.py`` check_whole_groups), so nothing crosses the
model axis either.

check-layer and the oracle take them as every kind: group norm's option ``num_groups``
(``--num-groups``, a suite's ``num_groups``), the per-(sample, group) partial sums as their
statistics (``sum_partial``, ``sumsq_partial`` of x; ``gsum_partial``, ``gxhat_partial`` of
g = gamma*dy and g*xhat: what the backward allreduces), affine weight and bias per channel,
eps 1e-5 and the biased variance, as ``torch.nn.functional.group_norm`` / ``instance_norm``.
The planner reads group norm's groups from the model's ``describe()`` entry as the option
(``num_groups``: ``Layer.option``); instance norm's are its channels.
"""
from __future__ import annotations

import numpy

from .. import functional as F
from ..parallel.partition import channel_range
from .base import ChannelAffineKind
from .options import Option, Statistic

EPS = 1e-5
NUM_GROUPS = Option("num_groups", int, 1, "statistics groups G of {kinds}: C/G channels each (G must divide C; "
                    "default 1)", metavar="G", validate=lambda v: v >= 1, rule="a positive integer")


def per_sample_group(spec, layout=None) -> tuple:
    """(N, G) of the whole layer, or (N_r, G_r): the samples and groups rank ``layout`` holds."""
    kind = _kind(spec)
    g, per = kind.groups(spec), spec.input[1] // kind.groups(spec)
    if layout is None:
        return spec.input[0], g
    c0, c1 = layout.in_channels
    return layout.samples[1] - layout.samples[0], (c1 - c0) // per


def _kind(spec):
    from . import lookup
    return lookup(spec.layer)


#: the per-(sample, group) sums a rank adds to the allreduces (forward of x, backward of g = gamma*dy)
STATISTICS = (Statistic("sum_partial", "per-(sample, group) sum of x over the rank's block", per_sample_group),
              Statistic("sumsq_partial", "per-(sample, group) sum of x*x over the rank's block", per_sample_group),
              Statistic("gsum_partial", "per-(sample, group) sum of gamma*dy over the rank's block",
                        per_sample_group, backward=True),
              Statistic("gxhat_partial", "per-(sample, group) sum of gamma*dy*xhat over the rank's block",
                        per_sample_group, backward=True))


class _PerSampleNorm(ChannelAffineKind):
    """A normalisation whose statistics are per (sample, group): pointwise but for its sums."""

    model_modes = ("none", "channel")    # channel-split activations: each rank's slice whole groups
    statistics = STATISTICS
    affine_mistake = ("a per-channel scale and shift error: group-norm statistics (mean, variance; biased vs. "
                      "unbiased; eps) or gamma/beta differ from the case's (per-sample statistics, biased "
                      "variance, eps 1e-5)")

    def groups(self, spec) -> int:
        """G of the whole layer."""
        raise NotImplementedError

    def validate(self, spec):
        super().validate(spec)
        c, g = spec.input[1], self.groups(spec)
        if c % g:
            raise ValueError(f"--num-groups {g} must divide the channels ({c})")
        if spec.model_parallel == "channel" and len(spec.grid) == 5:
            per = c // g
            slices = [channel_range(c, spec.grid[4], m) for m in range(spec.grid[4])]
            if any(edge % per for s in slices for edge in s):
                raise ValueError(f"--grid puts Pm={spec.grid[4]} model ranks on {c} channels in groups of {per}: "
                                 f"the channel slices {slices} cut a group (choose Pm dividing {g})")

    def forward(self, spec, x, w, b):
        return F.group_norm3d(x, self.groups(spec), w, b, EPS)

    def backward(self, spec, dy, cache):
        return F.group_norm3d_backward(dy, cache)

    def reduction_length(self, spec, tensor, out_shape):
        n, c, d, h, w = spec.input
        if tensor in ("dw", "db", "dw_partial", "db_partial"):
            return n * d * h * w, "N·D·H·W values per channel"
        return c // self.groups(spec) * d * h * w, "C/G·D·H·W values per (sample, group) statistic"

    def rank_partials(self, spec, inputs, layout):
        """The per-(sample, group) sums a rank contributes to the allreduces (x, x*x forward; g, g*xhat
        backward, g = gamma*dy) and its per-channel dgamma, dbeta before theirs."""
        x, dy, w = inputs["x"], inputs["dy"], inputs["w"]
        g = self.groups(spec)
        per = spec.input[1] // g
        _, cache = F.group_norm3d(x, g, w, inputs["b"], EPS)            # the whole samples' statistics
        block = layout.index("x")
        samples, channels = block[0], block[1]
        groups = slice(channels.start // per, channels.stop // per)
        xs, dys = x[block], dy[block]
        n_r, c_r = xs.shape[:2]
        mean = cache.mean[samples, groups].reshape(n_r, -1, 1, 1)
        inv_std = cache.inv_std[samples, groups].reshape(n_r, -1, 1, 1)
        xg = xs.reshape(n_r, c_r // per, per, int(numpy.prod(xs.shape[2:])))
        xhat = (xg - mean) * inv_std
        gg = (dys * w[channels].reshape(1, -1, 1, 1, 1)).reshape(xg.shape)
        offset = [samples.start, groups.start]
        sums = {"sum_partial": xg.sum(axis=(2, 3)), "sumsq_partial": (xg * xg).sum(axis=(2, 3)),
                "gsum_partial": gg.sum(axis=(2, 3)), "gxhat_partial": (gg * xhat).sum(axis=(2, 3))}
        out = {k: (v, offset) for k, v in sums.items()}
        dyg = dys.reshape(xg.shape)
        out["dw_partial"] = ((dyg * xhat).sum(axis=(0, 3)).reshape(-1), [channels.start])
        out["db_partial"] = (dyg.sum(axis=(0, 3)).reshape(-1), [channels.start])
        return out

    def known_mistakes(self, case, dtype):
        """Statistics over each rank's own block: not reduced over the spatial group."""
        a = {k: numpy.asarray(v, numpy.float64) for k, v in case.inputs[dtype].items()}
        y, dx = numpy.zeros_like(a["x"]), numpy.zeros_like(a["x"])
        g_all, per = self.groups(case.spec), case.spec.input[1] // self.groups(case.spec)
        for lo in case.layouts:
            index = lo.index("x")
            xs = a["x"][index]
            if not xs.size:
                continue
            ch = index[1]
            ys, cache = F.group_norm3d(xs, (ch.stop - ch.start) // per, a["w"][ch], a["b"][ch], EPS)
            y[index], dx[index] = ys, F.group_norm3d_backward(a["dy"][index], cache)[0]
        del g_all
        yield (f"{self.name} statistics computed over each rank's own block: not reduced over the spatial group "
               "(every rank holds a different part of the same samples)", (y, dx))

    def torch_ranks(self, case, inputs, torch, plant):
        """Per rank: its per-(sample, group) sums, summed over the ranks holding the same samples and
        channels (the spatial group; 'local-stats': the rank alone), then normalise; autograd
        carries the backward through the sums."""
        local = plant is not None and plant[0] == "local-stats"
        g_all = self.groups(case.spec)
        per = case.spec.input[1] // g_all
        xs = {lo.rank: inputs["x"][lo.index("x")].clone().requires_grad_(True) for lo in case.layouts}
        gamma = {lo.rank: inputs["w"][slice(*lo.in_channels)].clone().requires_grad_(True) for lo in case.layouts}
        beta = {lo.rank: inputs["b"][slice(*lo.in_channels)].clone().requires_grad_(True) for lo in case.layouts}

        def grouped(t):
            return t.reshape(t.shape[0], t.shape[1] // per, per, int(numpy.prod(t.shape[2:])))
        ys, loss = {}, 0
        for lo in case.layouts:
            group = [lo] if local else [q for q in case.layouts
                                        if q.samples == lo.samples and q.in_channels == lo.in_channels]
            count = max(1, sum(per * int(numpy.prod(xs[q.rank].shape[2:])) for q in group))
            s1 = sum(grouped(xs[q.rank]).sum(dim=(2, 3)) for q in group)
            s2 = sum((grouped(xs[q.rank]) ** 2).sum(dim=(2, 3)) for q in group)
            mean = s1 / count
            inv_std = 1 / torch.sqrt(s2 / count - mean ** 2 + EPS)
            xg = grouped(xs[lo.rank])
            xhat = (xg - mean[..., None, None]) * inv_std[..., None, None]
            y = xhat.reshape(xs[lo.rank].shape) * gamma[lo.rank].reshape(1, -1, 1, 1, 1) \
                + beta[lo.rank].reshape(1, -1, 1, 1, 1)
            ys[lo.rank] = (y, xhat.detach())
            loss = loss + (y * inputs["dy"][lo.index("x")]).sum()
        loss.backward()
        result = {}
        for lo in case.layouts:
            y, xhat = ys[lo.rank]
            x = grouped(xs[lo.rank].detach())
            dy = grouped(inputs["dy"][lo.index("x")])
            gg = dy * grouped(gamma[lo.rank].detach().reshape(1, -1, 1, 1, 1).expand(xs[lo.rank].shape))
            result[lo.rank] = {"y": y.detach().numpy(), "dx": xs[lo.rank].grad.numpy(),
                               "sum_partial": x.sum(dim=(2, 3)).numpy(), "sumsq_partial": (x * x).sum(dim=(2, 3)).numpy(),
                               "gsum_partial": gg.sum(dim=(2, 3)).numpy(),
                               "gxhat_partial": (gg * xhat).sum(dim=(2, 3)).numpy(),
                               "dw_partial": (dy * xhat).sum(dim=(0, 3)).reshape(-1).numpy(),
                               "db_partial": dy.sum(dim=(0, 3)).reshape(-1).numpy()}
        for tensor in ("dw", "db"):
            for lo in case.layouts:
                same = [q for q in case.layouts if q.in_channels == lo.in_channels]
                if plant is not None and plant[0] == "dw-unsummed":
                    same = [q for q in same if q.coords[1:4] == lo.coords[1:4]]
                result[lo.rank][tensor] = sum(result[q.rank][f"{tensor}_partial"] for q in same)
        return result

    def plan_split_channels(self, layer):
        return layer.c_out

    def plan_param_sizes(self, layer, pm, m, width):
        """weight and bias: the rank's channel slice when the activation is channel-split."""
        c = layer.c_out if layer.split == "none" or pm == 1 else width(layer.c_out)
        return [c, c]

    def plan_groups(self, layer) -> int:
        """Statistics groups per sample of the whole layer."""
        raise NotImplementedError

    def plan_cost(self, layer, rank, cost):
        """Memory-bound at its element rate (batch norm's passes: sums, normalise; backward
        sums, dx); over the spatial group the value count (8 bytes) and the (2, N_r, G_r)
        float64 sums allreduced forward, the (2, N_r, G_r) gradient sums backward, G_r the
        groups of the rank's channels."""
        n_r, f_local, v_block = rank.n_r, rank.f_local(layer), rank.block_voxels(layer)
        cost.flops = 10.0 * n_r * f_local * v_block
        compute_s = n_r * f_local * v_block / rank.machine.element_rate(self)
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
    options = (NUM_GROUPS,)

    def groups(self, spec):
        return spec.options["num_groups"]

    def local(self, spec, *, rng, dtype):
        from ..nn import GroupNorm3d
        return GroupNorm3d(self.groups(spec), spec.input[1], EPS, dtype=dtype)

    def partitioned(self, spec, *, grid, rng, dtype):
        from ..nn.model_parallel import ModelParallelGroupNorm3d
        from ..nn.spatial import SpatialGroupNorm3d
        layer = ModelParallelGroupNorm3d if spec.model_parallel == "channel" else SpatialGroupNorm3d
        return layer(self.groups(spec), spec.input[1], EPS, grid=grid, dtype=dtype)

    def torch_forward(self, spec, tf, x, w, b):
        return tf.group_norm(x, self.groups(spec), w, b, EPS)

    def plan_groups(self, layer):
        return layer.option("num_groups")

    def plan_reference(self, channels):
        """Group norm in groups of 4 channels (the U-Net's default of 8 groups at 32 channels)."""
        groups = max(1, channels // 4)
        return (lambda x, w, b: F.group_norm3d(x, groups, w, b, EPS)), F.group_norm3d_backward


class InstanceNorm3dKind(_PerSampleNorm):
    name = "instance_norm3d"
    plan_label = "instance_norm"

    def groups(self, spec):
        return spec.input[1]

    def forward(self, spec, x, w, b):
        return F.instance_norm3d(x, w, b, EPS)

    def backward(self, spec, dy, cache):
        return F.instance_norm3d_backward(dy, cache)

    def local(self, spec, *, rng, dtype):
        from ..nn import InstanceNorm3d
        return InstanceNorm3d(spec.input[1], EPS, dtype=dtype)

    def partitioned(self, spec, *, grid, rng, dtype):
        from ..nn.model_parallel import ModelParallelInstanceNorm3d
        from ..nn.spatial import SpatialInstanceNorm3d
        layer = ModelParallelInstanceNorm3d if spec.model_parallel == "channel" else SpatialInstanceNorm3d
        return layer(spec.input[1], EPS, grid=grid, dtype=dtype)

    def torch_forward(self, spec, tf, x, w, b):
        return tf.instance_norm(x, weight=w, bias=b, use_input_stats=True, eps=EPS)

    def plan_groups(self, layer):
        return layer.c_out

    def plan_reference(self, channels):
        return (lambda x, w, b: F.instance_norm3d(x, w, b, EPS)), F.instance_norm3d_backward


KINDS = (GroupNorm3dKind(), InstanceNorm3dKind())
