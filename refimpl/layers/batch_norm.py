"""batch_norm3d: pointwise in space, but every output depends on whole-tensor statistics.

Training-mode batch norm with the statistics of the whole batch (the sums allreduced over
the spatial and data ranks: ``global_stats=True``), the biased variance and eps 1e-5, as
``torch.nn.functional.batch_norm(training=True)``.  No halo; what the partitioned layer
reduces are per-channel sums, which is what the oracle derives per rank.
"""
from __future__ import annotations

import numpy

from .. import functional as F
from .base import ChannelAffineKind
from .options import Statistic

EPS = 1e-5
#: the axes a channel's statistics sum over
AXES = (0, 2, 3, 4)


def per_channel(spec, layout=None) -> tuple:
    """One value per channel: of the whole layer, or of the channels rank ``layout`` holds."""
    return (spec.input[1],) if layout is None else (layout.in_channels[1] - layout.in_channels[0],)


class BatchNorm3dKind(ChannelAffineKind):
    name = "batch_norm3d"
    statistics = (Statistic("sum_partial", "per-channel sum of x over the rank's block", per_channel),
                  Statistic("sumsq_partial", "per-channel sum of x*x over the rank's block", per_channel))
    model_modes = ("none", "channel")    # channel-split activations: statistics per channel slice
    affine_mistake = ("a per-channel scale and shift error: batch-norm statistics (mean, variance; biased vs. "
                      "unbiased; eps) or gamma/beta differ from the case's (global statistics, biased variance, "
                      "eps 1e-5)")

    def validate(self, spec):
        super().validate(spec)
        n, _, d, h, w = spec.input
        if n * d * h * w < 2:
            raise ValueError(f"{self.name} needs more than one value per channel (N*D*H*W >= 2)")

    def forward(self, spec, x, w, b):
        return F.batch_norm3d(x, w, b, training=True)

    def backward(self, spec, dy, cache):
        return F.batch_norm3d_backward(dy, cache)

    # ------------------------------------------------------------ planner

    plan_label = "bn"

    def plan_split_channels(self, layer):
        return layer.c_out

    def plan_param_sizes(self, layer, pm, m, width):
        """gamma and beta: the rank's channel slice when the activation is channel-split."""
        c = layer.c_out if layer.split == "none" or pm == 1 else width(layer.c_out)
        return [c, c]

    def plan_reference(self, channels):
        return F.batch_norm3d, F.batch_norm3d_backward

    def plan_cost(self, layer, rank, cost):
        """Memory-bound at its element rate; the statistics of the whole batch allreduced:
        forward the element count and the (2, C) float64 sums, backward the (2, C) gradient sums."""
        n_r, f_local, v_block = rank.n_r, rank.f_local(layer), rank.block_voxels(layer)
        cost.flops = 10.0 * n_r * f_local * v_block
        compute_s = n_r * f_local * v_block / rank.machine.element_rate(self)
        cost.saved_bytes = n_r * f_local * v_block * rank.itemsize
        everyone = rank.group((0, 1, 2, 3))     # statistics of the whole batch
        cost.comm_s = rank.allreduce_s(8, everyone) + 2 * rank.allreduce_s(16 * f_local, everyone)
        cost.allreduce_bytes = 2 * 16 * f_local if everyone[0] > 1 else 0
        return compute_s

    def local(self, spec, *, rng, dtype):
        from ..nn import BatchNorm3d
        return BatchNorm3d(spec.input[1], dtype=dtype)

    def partitioned(self, spec, *, grid, rng, dtype):
        from ..nn.model_parallel import ModelParallelBatchNorm3d
        from ..nn.spatial import SpatialBatchNorm3d
        if spec.model_parallel == "channel":
            return ModelParallelBatchNorm3d(spec.input[1], grid=grid, dtype=dtype)
        return SpatialBatchNorm3d(spec.input[1], grid=grid, global_stats=True, dtype=dtype)

    # ------------------------------------------------------------ oracle

    def rank_partials(self, spec, inputs, layout):
        """The per-channel sums a rank contributes to the allreduces: of x and x*x (forward
        statistics), of dy*xhat and dy (dgamma, dbeta, and backward's statistics)."""
        x, dy = inputs["x"], inputs["dy"]
        xs, dys = x[layout.index("x")], dy[layout.index("x")]
        channels = slice(*layout.in_channels)
        mean = x.mean(axis=AXES, keepdims=True)
        var = x.var(axis=AXES, keepdims=True)
        xhat = (xs - mean[:, channels]) / numpy.sqrt(var[:, channels] + EPS)
        offset = [layout.in_channels[0]]
        return {"sum_partial": (xs.sum(axis=AXES), offset), "sumsq_partial": ((xs * xs).sum(axis=AXES), offset),
                "dw_partial": ((dys * xhat).sum(axis=AXES), offset), "db_partial": (dys.sum(axis=AXES), offset)}

    def reduction_length(self, spec, tensor, out_shape):
        n, _, d, h, w = spec.input
        return n * d * h * w, "N·D·H·W values per channel statistic"

    def known_mistakes(self, case, dtype):
        """Statistics reduced over too few ranks: over each rank's own block, or over the
        spatial group but not the sample groups."""
        blocks = list({tuple((s.start, s.stop) for s in lo.index("x")): lo.index("x")
                       for lo in case.layouts}.values())
        yield ("batch-norm statistics computed over each rank's own block: not reduced over the spatial group "
               "(every rank holds a different part of the same samples)", self._statistics_over(case, dtype, blocks))
        sample_groups = case.spec.grid[0]
        if sample_groups > 1:
            groups = [(slice(*s), slice(*c)) + (slice(None),) * 3
                      for s, c in dict.fromkeys((lo.samples, lo.in_channels) for lo in case.layouts)]
            yield (f"batch-norm statistics reduced over the spatial group but not over the {sample_groups} sample "
                   f"groups (the case uses statistics of the whole batch)", self._statistics_over(case, dtype, groups))

    def _statistics_over(self, case, dtype, groups):
        """Global (y, dx) with statistics computed separately over each (samples, spatial) group;
        None where a group holds fewer than two values per channel."""
        a = {k: numpy.asarray(v, numpy.float64) for k, v in case.inputs[dtype].items()}
        y = numpy.zeros_like(a["x"])
        dx = numpy.zeros_like(a["x"])
        for index in groups:
            xs, dys = a["x"][index], a["dy"][index]
            if xs.size == 0 or xs.shape[0] * numpy.prod(xs.shape[2:]) < 2:
                return None
            ch = index[1]
            ys, cache = F.batch_norm3d(xs, a["w"][ch], a["b"][ch], training=True)
            y[index] = ys
            dx[index] = F.batch_norm3d_backward(dys, cache)[0]
        return y, dx

    # ------------------------------------------------------------ PyTorch twin

    def torch_forward(self, spec, tf, x, w, b):
        return tf.batch_norm(x, None, None, w, b, training=True, eps=EPS)

    def torch_ranks(self, case, inputs, torch, plant):
        """Per rank: local sums, allreduced (summed here) over every rank holding the same
        channels, then normalise; autograd carries the backward through the sums.  Plants
        (refimpl/oracle/torch_adapter.py): 'local-stats' reduces over the rank alone,
        'dw-unsummed' sums dw and db over the sample groups only."""
        name = plant[0] if plant else None
        xs = {lo.rank: inputs["x"][lo.index("x")].clone().requires_grad_(True) for lo in case.layouts}
        gamma = {lo.rank: inputs["w"][slice(*lo.in_channels)].clone().requires_grad_(True) for lo in case.layouts}
        beta = {lo.rank: inputs["b"][slice(*lo.in_channels)].clone().requires_grad_(True) for lo in case.layouts}
        loss = 0
        ys = {}
        for lo in case.layouts:
            group = [lo] if name == "local-stats" else [q for q in case.layouts if q.in_channels == lo.in_channels]
            count = sum(xs[q.rank].shape[0] * numpy.prod(xs[q.rank].shape[2:]) for q in group)
            s1 = sum(xs[q.rank].sum(dim=AXES) for q in group)
            s2 = sum((xs[q.rank] ** 2).sum(dim=AXES) for q in group)
            mean = s1 / count
            var = s2 / count - mean ** 2
            shape = (1, -1, 1, 1, 1)
            y = (xs[lo.rank] - mean.reshape(shape)) / torch.sqrt(var.reshape(shape) + EPS) * \
                gamma[lo.rank].reshape(shape) + beta[lo.rank].reshape(shape)
            ys[lo.rank] = (y, mean.detach(), var.detach())
            loss = loss + (y * inputs["dy"][lo.index("x")]).sum()
        loss.backward()
        result = {}
        for lo in case.layouts:
            y, mean, var = ys[lo.rank]
            x = xs[lo.rank].detach()
            dy = inputs["dy"][lo.index("x")]
            xhat = (x - mean.reshape(1, -1, 1, 1, 1)) / torch.sqrt(var.reshape(1, -1, 1, 1, 1) + EPS)
            result[lo.rank] = {"y": y.detach().numpy(), "dx": xs[lo.rank].grad.numpy(),
                               "sum_partial": x.sum(dim=AXES).numpy(), "sumsq_partial": (x * x).sum(dim=AXES).numpy(),
                               "dw_partial": (dy * xhat).sum(dim=AXES).numpy(), "db_partial": dy.sum(dim=AXES).numpy()}
        for tensor in ("dw", "db"):
            for lo in case.layouts:
                same = [q for q in case.layouts if q.in_channels == lo.in_channels]
                if name == "dw-unsummed":
                    same = [q for q in same if q.coords[1:4] == lo.coords[1:4]]
                result[lo.rank][tensor] = sum(result[q.rank][f"{tensor}_partial"] for q in same)
        return result
