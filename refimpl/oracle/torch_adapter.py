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

What is particular to one kind of layer — its ``torch.nn.functional`` call, the block of a
transposed conv, batch norm's per-rank statistics — is the kind's PyTorch twin in the layer
registry (refimpl/layers: ``torch_forward``, ``torch_block``, ``torch_ranks``).

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

from .. import layers
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


def run_global(case, dtype, torch):
    """The unpartitioned layer: y and the gradients of L = sum(y * dy)."""
    a = {k: torch.tensor(v, requires_grad=k in ("x", "w", "b")) for k, v in case.inputs[dtype].items()}
    kind = layers.lookup(case.spec.layer)
    y = kind.torch_forward(case.spec, torch.nn.functional, a["x"], a.get("w"), a.get("b"))
    y.backward(a["dy"])
    out = {"y": y.detach().numpy(), "dx": a["x"].grad.numpy()}
    if "w" in a:
        out["dw"], out["db"] = a["w"].grad.numpy(), a["b"].grad.numpy()
    return out


def run_ranks(case, dtype, torch, plant=None):
    """Every rank's blocks, computed from its own slice of the inputs."""
    spec = case.spec
    kind = layers.lookup(spec.layer)
    g = {k: torch.tensor(v) for k, v in case.inputs[dtype].items()}
    results = kind.torch_ranks(case, g, torch, plant)
    if results is not None:
        return results
    tf = torch.nn.functional
    shift_axis = plant[1] if plant and plant[0] == "padding" else None
    partial_sums = spec.model_parallel == "channel" and kind.mixes_channels
    out = {lo.rank: {} for lo in case.layouts}
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
        if partial_sums:                                             # partial sums, no bias
            out[lo.rank]["y_partial"] = kind.torch_block(spec, tf, lo, xn, w, None, shift_axis)
        else:
            out[lo.rank]["y"] = kind.torch_block(spec, tf, lo, xn, w, b, shift_axis)
    if partial_sums:                                                 # the reduce-scatter
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
