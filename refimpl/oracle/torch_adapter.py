"""``refimpl oracle run-torch``: PyTorch as the implementation under test — the model for
your own adapter.

This module is not part of refimpl's math: it is the *other* implementation, which the
oracle checks.  (It is the one place in ``refimpl/`` that imports torch, and only when
``run-torch`` is asked for; refimpl's layers never call it.)  It shows what an adapter
does with a case file:

1. the global run: the whole layer with ``torch.nn.functional`` and autograd;
2. per rank, by slicing with the case's ranges: rank r takes ``x[needed range]`` (what
   its halo exchange would deliver), pads the part of its windows the clip removed,
   runs the layer on its block, and back-propagates its ``dy`` block; then the
   "messages" — adding ghost gradients into their owners (the adjoint halo exchange),
   allreducing dw/db and batch-norm sums — are done by summing the ranks' tensors in
   this one process.

``--plant`` injects a known mistake, to see what ``oracle check`` says about it:

    halo:R          rank R receives zeros instead of its ghost cells
    ghost-clear     the adjoint halo exchange adds ghost gradients into their owners but
                    does not clear them: every rank's dx gets its neighbours' ghosts twice
    padding:AXIS    every rank pads one more at the low end of AXIS (D, H or W), one less
                    at the high end (a padding off by one)
    bn-local-stats  batch norm statistics over each rank's own block (no allreduce)
    dw-unsummed     dw and db allreduced over the sample groups only, not over the
                    spatial shards
"""
from __future__ import annotations

import numpy

from . import expect

PLANTS = ("halo:R", "ghost-clear", "padding:AXIS", "bn-local-stats", "dw-unsummed")


def parse_plant(text, case=None):
    """('halo', R) / ('padding', axis) / (name, None); ValueError for anything else."""
    if text is None:
        return None
    name, _, arg = text.partition(":")
    if name == "halo":
        if not arg.isdigit():
            raise ValueError(f"--plant halo:R needs a rank number R, got {text!r}")
        if case is not None and int(arg) >= case.spec.ranks:
            raise ValueError(f"--plant {text}: case {case.name} has ranks 0..{case.spec.ranks - 1}")
        return name, int(arg)
    if name == "padding":
        if arg not in ("D", "H", "W"):
            raise ValueError(f"--plant padding:AXIS needs AXIS = D, H or W, got {text!r}")
        return name, "DHW".index(arg)
    if name in ("ghost-clear", "bn-local-stats", "dw-unsummed") and not arg:
        return name, None
    raise ValueError(f"--plant must be one of {', '.join(PLANTS)}, got {text!r}")


def _torch():
    try:
        import torch
    except ImportError:
        raise ValueError("run-torch needs PyTorch: pip install 'refimpl[oracle]'") from None
    return torch


def _layer_fn(spec, torch):
    """fn(x, w, b) of the whole layer, with torch.nn.functional."""
    tf = torch.nn.functional
    k, s, p, d = spec.kernel, spec.stride, spec.padding, spec.dilation
    if spec.layer == "conv3d":
        return lambda x, w, b: tf.conv3d(x, w, b, s, p, d)
    if spec.layer == "conv_transpose3d":
        return lambda x, w, b: tf.conv_transpose3d(x, w, b, s, p, spec.output_padding, 1, d)
    if spec.layer == "max_pool3d":
        return lambda x, w, b: tf.max_pool3d(x, k, s, p, d)
    if spec.layer == "avg_pool3d":
        return lambda x, w, b: tf.avg_pool3d(x, k, s, p)
    return lambda x, w, b: tf.batch_norm(x, None, None, w, b, training=True, eps=1e-5)


def run_global(case, dtype, torch):
    """The unpartitioned layer: y and the gradients of L = sum(y * dy)."""
    a = {k: torch.tensor(v, requires_grad=k in ("x", "w", "b")) for k, v in case.inputs[dtype].items()}
    y = _layer_fn(case.spec, torch)(a["x"], a.get("w"), a.get("b"))
    y.backward(a["dy"])
    out = {"y": y.detach().numpy(), "dx": a["x"].grad.numpy()}
    if "w" in a:
        out["dw"], out["db"] = a["w"].grad.numpy(), a["b"].grad.numpy()
    return out


def _local_conv(spec, lo, x_needed, w, b, torch, plant):
    """Rank lo's outputs from its needed input block (conv, pooling, transposed conv)."""
    tf = torch.nn.functional
    k, s, p, d = spec.kernel, spec.stride, spec.padding, spec.dilation
    if spec.layer == "conv_transpose3d":
        # full local transposed conv, then the window of it that is lo's output block
        y = tf.conv_transpose3d(x_needed, w, None, s, 0, 0, 1, d) if all(x_needed.shape[2:]) else None
        pads = []
        for a in reversed(range(3)):
            (i0, i1), (o0, o1) = lo.needed[a], lo.outputs[a]
            start = i0 * s[a] - p[a]
            length = y.shape[2 + a] if y is not None else 0
            pads += [start - o0, (o1 - o0) - (start - o0) - length]   # negative pad = crop
        if y is None:
            y = torch.zeros(x_needed.shape[:2][:1] + (w.shape[1],) + tuple(o1 - o0 for o0, o1 in lo.outputs),
                            dtype=x_needed.dtype)
        else:
            y = tf.pad(y, pads)
        return y if b is None else y + b.reshape(1, -1, 1, 1, 1)
    pads = []
    for a in reversed(range(3)):
        (i0, i1), (o0, o1) = lo.needed[a], lo.outputs[a]
        low = i0 - (s[a] * o0 - p[a])
        high = (s[a] * (o1 - 1) - p[a] + d[a] * (k[a] - 1) + 1) - i1
        if plant and plant[0] == "padding" and plant[1] == a:
            low, high = low + 1, high - 1
        pads += [low, high]
    value = -numpy.inf if spec.layer == "max_pool3d" else 0.0
    xp = tf.pad(x_needed, pads, value=value) if any(pads) else x_needed
    if spec.layer == "conv3d":
        return tf.conv3d(xp, w, b, s, 0, d)
    if spec.layer == "max_pool3d":
        return tf.max_pool3d(xp, k, s, 0, d)
    return tf.avg_pool3d(xp, k, s, 0)


def run_ranks(case, dtype, torch, plant=None):
    """Every rank's blocks, computed from its own slice of the inputs."""
    spec = case.spec
    g = {k: torch.tensor(v) for k, v in case.inputs[dtype].items()}
    mode = spec.model_parallel
    out = {lo.rank: {} for lo in case.layouts}
    if spec.layer == "batch_norm3d":
        return _run_bn(case, g, torch, plant, out)
    leaves = {}
    for lo in case.layouts:
        xn = g["x"][lo.index("needed")].clone()
        if plant and plant[0] == "halo" and plant[1] == lo.rank:     # ghosts never arrive
            keep = torch.zeros_like(xn)
            own = tuple(slice(max(a0, n0) - n0, min(a1, n1) - n0) for (a0, a1), (n0, n1) in zip(lo.owned, lo.needed))
            keep[(slice(None), slice(None)) + own] = 1
            xn = xn * keep
        xn.requires_grad_(True)
        w = b = None
        if "w" in g:
            shard = expect.weight_shard(spec, lo)
            w = (g["w"] if shard is None else g["w"].narrow(shard[0], shard[1], shard[2] - shard[1])).clone()
            b = g["b"][slice(*lo.out_channels)].clone()
            w.requires_grad_(True)
            b.requires_grad_(True)
        leaves[lo.rank] = (xn, w, b)
        if any(o0 == o1 for o0, o1 in lo.outputs) or lo.samples[0] == lo.samples[1]:
            continue
        if mode == "channel" and spec.layer in expect.CONV_LAYERS:     # partial sums, no bias
            part = _local_conv(spec, lo, xn, w, None, torch, plant)
            out[lo.rank]["y_partial"] = part
        else:
            out[lo.rank]["y"] = _local_conv(spec, lo, xn, w, b, torch, plant)
    if mode == "channel" and spec.layer in expect.CONV_LAYERS:           # the reduce-scatter
        for lo in case.layouts:
            if "y_partial" not in out[lo.rank]:
                continue
            peers = [q for q in case.layouts if q.samples == lo.samples and q.coords[:4] == lo.coords[:4]]
            total = sum(out[q.rank]["y_partial"] for q in peers)
            out[lo.rank]["y"] = total[:, slice(*lo.out_channels)] + leaves[lo.rank][2].reshape(1, -1, 1, 1, 1)
    # backward: L = sum over ranks of y_r * dy_r (each rank's own outputs)
    loss = 0
    for lo in case.layouts:
        if "y" in out[lo.rank]:
            loss = loss + (out[lo.rank]["y"] * g["dy"][lo.index("y")]).sum()
    if torch.is_tensor(loss):
        loss.backward()
    result = {}
    for lo in case.layouts:
        xn, w, b = leaves[lo.rank]
        r = {k: v.detach().numpy() for k, v in out[lo.rank].items()}
        r.setdefault("y", numpy.zeros(_shape(lo, "y"), dtype))
        r["x_needed"] = xn.detach().numpy()
        r["dx_needed"] = xn.grad.numpy() if xn.grad is not None else numpy.zeros(tuple(xn.shape), dtype)
        if w is not None:
            r["dw_partial"] = w.grad.numpy() if w.grad is not None else numpy.zeros(tuple(w.shape), dtype)
            r["db_partial"] = b.grad.numpy() if b.grad is not None else numpy.zeros(tuple(b.shape), dtype)
        result[lo.rank] = r
    _adjoint_exchange(case, dtype, result, plant)
    if "w" in g:
        _allreduce_params(case, result, plant)
    return result


def _shape(lo, which):
    return tuple(s.stop - s.start for s in lo.index(which))


def _peers(case, lo):
    return [q for q in case.layouts if q.samples == lo.samples
            and (case.spec.model_parallel != "none" or q.coords[4] == lo.coords[4])]


def _adjoint_exchange(case, dtype, result, plant):
    """dx of every rank: the ghost gradients of all its peers added into its block."""
    shape = case.inputs[dtype]["x"].shape
    for lo in case.layouts:
        index = lo.index("x")
        pieces, own = [], None
        for q in _peers(case, lo):
            start = [s.start for s in q.index("needed")]
            piece = (result[q.rank]["dx_needed"].astype(numpy.float64), start)
            pieces.append(piece)
            if q.rank == lo.rank:
                own = expect.embed(shape, [piece])
        total = expect.embed(shape, pieces)
        if plant and plant[0] == "ghost-clear":
            total = 2 * total - own         # the ghosts, never cleared, are added again
        result[lo.rank]["dx"] = total[index].astype(dtype)


def _allreduce_params(case, result, plant):
    for name in ("dw", "db"):
        for lo in case.layouts:
            same = [q for q in case.layouts if q.coords[4] == lo.coords[4]]
            if plant and plant[0] == "dw-unsummed":         # over the sample groups only
                same = [q for q in same if q.coords[1:4] == lo.coords[1:4]]
            result[lo.rank][name] = sum(result[q.rank][f"{name}_partial"] for q in same)


def _run_bn(case, g, torch, plant, out):
    """Batch norm per rank: local sums, allreduced (summed here) over every rank holding
    the same channels, then normalise; autograd carries the backward through the sums."""
    eps = 1e-5
    xs = {lo.rank: g["x"][lo.index("x")].clone().requires_grad_(True) for lo in case.layouts}
    gamma = {lo.rank: g["w"][slice(*lo.in_channels)].clone().requires_grad_(True) for lo in case.layouts}
    beta = {lo.rank: g["b"][slice(*lo.in_channels)].clone().requires_grad_(True) for lo in case.layouts}
    axes = (0, 2, 3, 4)
    loss = 0
    ys = {}
    for lo in case.layouts:
        group = [lo] if plant and plant[0] == "bn-local-stats" else \
            [q for q in case.layouts if q.in_channels == lo.in_channels]
        count = sum(xs[q.rank].shape[0] * numpy.prod(xs[q.rank].shape[2:]) for q in group)
        s1 = sum(xs[q.rank].sum(dim=axes) for q in group)
        s2 = sum((xs[q.rank] ** 2).sum(dim=axes) for q in group)
        mean = s1 / count
        var = s2 / count - mean ** 2
        shape = (1, -1, 1, 1, 1)
        y = (xs[lo.rank] - mean.reshape(shape)) / torch.sqrt(var.reshape(shape) + eps) * \
            gamma[lo.rank].reshape(shape) + beta[lo.rank].reshape(shape)
        ys[lo.rank] = (y, mean.detach(), var.detach())
        loss = loss + (y * g["dy"][lo.index("x")]).sum()
    loss.backward()
    result = {}
    for lo in case.layouts:
        y, mean, var = ys[lo.rank]
        x = xs[lo.rank].detach()
        dy = g["dy"][lo.index("x")]
        xhat = (x - mean.reshape(1, -1, 1, 1, 1)) / torch.sqrt(var.reshape(1, -1, 1, 1, 1) + eps)
        result[lo.rank] = {"y": y.detach().numpy(), "dx": xs[lo.rank].grad.numpy(),
                           "sum_partial": x.sum(dim=axes).numpy(), "sumsq_partial": (x * x).sum(dim=axes).numpy(),
                           "dw_partial": (dy * xhat).sum(dim=axes).numpy(), "db_partial": dy.sum(dim=axes).numpy()}
    for name in ("dw", "db"):
        for lo in case.layouts:
            same = [q for q in case.layouts if q.in_channels == lo.in_channels]
            if plant and plant[0] == "dw-unsummed":
                same = [q for q in same if q.coords[1:4] == lo.coords[1:4]]
            result[lo.rank][name] = sum(result[q.rank][f"{name}_partial"] for q in same)
    return result


def gathered(case, dtype, ranks) -> dict:
    """Global tensors assembled from the ranks' blocks (what a partitioned run reports)."""
    shape_y = case.expected[dtype]["y"].shape
    shape_x = case.inputs[dtype]["x"].shape
    y = numpy.zeros(shape_y, dtype)
    dx = numpy.zeros(shape_x, dtype)
    for lo in case.layouts:
        y[lo.index("y")] = ranks[lo.rank]["y"]
        dx[lo.index("x")] = ranks[lo.rank]["dx"]
    out = {"y": y, "dx": dx}
    if "dw" in case.expected[dtype]:
        for name in ("dw", "db"):
            whole = numpy.zeros(case.expected[dtype][name].shape, dtype)
            for lo in reversed(case.layouts):     # the lowest rank's copy is reported
                _, offset = case.ranks[dtype][lo.rank][name]
                array = ranks[lo.rank][name]
                whole[tuple(slice(o, o + n) for o, n in zip(offset, array.shape))] = array
            out[name] = whole
    return out


def run_case(case, plant=None, global_mode="whole", per_rank=True):
    """(global, ranks) results of PyTorch on ``case`` for every dtype it has."""
    torch = _torch()
    torch.use_deterministic_algorithms(False)
    glob, ranks = {}, {}
    for dtype in case.spec.dtypes:
        if per_rank or global_mode == "gathered":
            ranks[dtype] = run_ranks(case, dtype, torch, plant)
        if global_mode == "whole":
            glob[dtype] = run_global(case, dtype, torch)
        elif global_mode == "gathered":
            glob[dtype] = gathered(case, dtype, ranks[dtype])
    if not per_rank:
        ranks = {}
    return glob, ranks
