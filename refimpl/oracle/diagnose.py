"""Name the mistake behind a mismatch, where its pattern is one partitioned codes are known
to make.  Each test below rebuilds what the buggy computation would have produced (from
the case's own inputs and per-rank partials) or checks where the errors lie; a diagnosis
is given only when it explains every mismatching element within the tolerance.

    pattern                                         diagnosis
    got[i] == want[i -+ 1] along one axis           padding or offset off by one
    y wrong only where windows read ghost cells     forward halo exchange (names the rank, faces)
    dx - want == the ghost gradients r receives     adjoint exchange: ghosts added twice (not cleared)
    dx - want == -(those ghost gradients)           adjoint exchange missing
    dx wrong only on cells others read as ghosts    adjoint halo exchange (backward)
    x_needed wrong outside the owned block          forward halo exchange (names the sending ranks)
    batch norm == statistics of each block / group  statistics not reduced over the spatial / data group
    per-channel affine error                        scale/shift or statistics convention
    dw == a subset sum or a mean of the partials    which reduction is missing or averaged
"""
from __future__ import annotations

import numpy

from .. import layers
from ..parallel.partition import grid_rank
from . import expect

AXES = "DHW"


def _err(a, b):
    a = numpy.asarray(a, numpy.float64)
    b = numpy.asarray(b, numpy.float64)
    with numpy.errstate(invalid="ignore"):
        return numpy.where(a == b, 0.0, numpy.abs(a - b))


def _key(index):
    """A hashable form of a tuple of slices (slices are hashable only from Python 3.12)."""
    return tuple((s.start, s.stop) for s in index)


def _matches(got, cand, atol) -> bool:
    return cand is not None and got.shape == cand.shape and (not got.size or float(_err(got, cand).max()) <= atol)


def shift(got, want, bad, atol) -> str | None:
    """got equals want shifted by one voxel along one spatial axis (but for the planes the
    shift brings in)."""
    if got.ndim != 5 or bad.sum() < 2:
        return None
    best = None
    for a in range(3):
        axis = 2 + a
        if got.shape[axis] < 3:
            continue
        for delta in (1, -1):
            lo, hi = (slice(1, None), slice(None, -1)) if delta == 1 else (slice(None, -1), slice(1, None))
            g = got[(slice(None),) * axis + (lo,)]
            w = want[(slice(None),) * axis + (hi,)]
            left = int((_err(g, w) > atol).sum())
            if left <= 0.1 * bad.sum() and (best is None or left < best[0]):
                best = (left, a, delta)
    if best is None:
        return None
    _, a, delta = best
    return (f"values shifted by {delta:+d} along {AXES[a]} (got[{AXES[a].lower()}] == expected"
            f"[{AXES[a].lower()}{-delta:+d}]): a padding or offset off by one on that axis")


# ---------------------------------------------------------------- halo patterns

def ghost_reading_outputs(case, lo):
    """Per axis, (low, high) boolean vectors over rank ``lo``'s output block: the outputs
    whose window reads inputs below / above the rank's own input block."""
    kind = layers.lookup(case.spec.layer)
    sides = []
    for a in range(3):
        (o0, o1), (b0, b1) = lo.outputs[a], lo.owned[a]
        ranges = [kind.input_window(case.spec, a, o) for o in range(o0, o1)]
        sides.append((numpy.array([r[0] < b0 for r in ranges], bool), numpy.array([r[1] > b1 for r in ranges], bool)))
    return sides


def halo_forward(case, lo, bad) -> str | None:
    """Every mismatch of rank lo's y lies in an output whose window reads ghost cells."""
    if not bad.any() or not layers.lookup(case.spec.layer).has_halo:
        return None
    sides = ghost_reading_outputs(case, lo)
    shape = bad.shape[2:]
    mask = numpy.zeros(shape, bool)
    faces = []
    where = bad.any(axis=(0, 1))
    for a, (low, high) in enumerate(sides):
        view = [1, 1, 1]
        view[a] = shape[a]
        for side, vec in (("low", low), ("high", high)):
            plane = numpy.broadcast_to(vec.reshape(view), shape)
            mask |= plane
            if (where & plane).any():
                faces.append(f"{AXES[a]} {side}")
    if (where & ~mask).any():
        return None
    return (f"errors only in outputs whose windows read ghost cells ({', '.join(faces)} face) of {{who}}: "
            f"the forward halo exchange delivered wrong ghost values")


def _peers(case, lo):
    """Ranks whose partial input gradients add into rank lo's dx: same samples, and the
    same channels (the same model coordinate unless the conv is filter-parallel)."""
    return [q for q in case.layouts if q.samples == lo.samples and q.compute_channels[0] <= lo.in_channels[0]
            and lo.in_channels[1] <= q.compute_channels[1]
            and (case.spec.model_parallel != "none" or q.coords[4] == lo.coords[4])]


def _ghost_gradients(case, dtype, lo):
    """(own, received): rank lo's own partial dx on its block, and the ghost gradients its
    peers send it in the adjoint exchange (both shaped like lo's dx block)."""
    block = lo.index("x")
    shape = tuple(s.stop - s.start for s in block)
    own = numpy.zeros(shape)
    received = numpy.zeros(shape)
    for q in _peers(case, lo):
        piece, offset = case.ranks[dtype][q.rank]["dx_needed"]
        src, dst = [], []
        for axis in range(5):
            g0 = max(offset[axis], block[axis].start)
            g1 = min(offset[axis] + piece.shape[axis], block[axis].stop)
            if g0 >= g1:
                break
            src.append(slice(g0 - offset[axis], g1 - offset[axis]))
            dst.append(slice(g0 - block[axis].start, g1 - block[axis].start))
        else:
            (own if q.rank == lo.rank else received)[tuple(dst)] += piece[tuple(src)]
    return own, received


def halo_adjoint(case, dtype, lo, got, want, bad, atol) -> str | None:
    if not layers.lookup(case.spec.layer).has_halo or case.spec.model_parallel == "filter" or not bad.any():
        return None
    own, received = _ghost_gradients(case, dtype, lo)
    err = numpy.asarray(got, numpy.float64) - numpy.asarray(want, numpy.float64)
    if received.any() and float(numpy.abs(err - received).max()) <= atol:
        return ("doubled gradient on ghost cells of {who}: dx holds the neighbours' ghost gradients "
                "twice; the adjoint halo exchange added them into their owner without clearing the "
                "ghosts, so they were added again")
    if received.any() and float(numpy.abs(err + received).max()) <= atol:
        return ("dx of {who} lacks the neighbours' ghost gradients: the adjoint halo exchange (adding "
                "ghost gradients back into their owners) is missing")
    if received.any() and not (bad & (received == 0)).any():
        return ("errors only on cells of {who} that other ranks read as ghosts: the adjoint halo "
                "exchange (backward) returned wrong ghost gradients")
    return None


def ghost_cells(case, lo, bad) -> str | None:
    """x_needed wrong only outside the rank's own block: name the owners of the bad cells."""
    if not bad.any():
        return None
    needed = lo.index("needed")
    owners = set()
    for index in numpy.argwhere(bad):
        g = [int(i) + s.start for i, s in zip(index, needed)]
        if all(s.start <= i < s.stop for s, i in zip(lo.index("x"), g)):
            return None
        owner = next((q.rank for q in case.layouts if q.coords[4] == lo.coords[4]
                      and all(s.start <= i < s.stop for s, i in zip(q.index("x")[2:], g[2:]))
                      and q.samples[0] <= g[0] < q.samples[1]), None)
        owners.add(owner)
    return (f"rank {lo.rank}'s ghost cells are wrong (cells owned by rank(s) "
            f"{', '.join(str(o) for o in sorted(o for o in owners if o is not None))}), its own block is right: "
            f"the forward halo exchange")


# ---------------------------------------------------------------- mistakes of one layer kind

def known_mistake(case, dtype, tensor, got, want, index, atol) -> str | None:
    """y or dx equal to what a known mistake of the case's layer kind produces
    (refimpl/layers: ``known_mistakes``, ``affine_mistake``; batch norm's statistics)."""
    if tensor not in ("y", "dx"):
        return None
    kind = layers.lookup(case.spec.layer)
    part = ("y", "dx").index(tensor)
    for message, candidate in kind.known_mistakes(case, dtype):
        if candidate is not None and _matches(got, candidate[part][index], atol):
            return message
    return kind.affine_mistake and _affine(got, want, atol, kind.affine_mistake)


def _affine(got, want, atol, message) -> str | None:
    """got == a_c * want + b_c per channel (least squares), with some a_c != 1 or b_c != 0."""
    got = numpy.asarray(got, numpy.float64)
    want = numpy.asarray(want, numpy.float64)
    for c in range(got.shape[1]):
        g, w = got[:, c].ravel(), want[:, c].ravel()
        if g.size < 3:
            return None
        coef = numpy.linalg.lstsq(numpy.stack([w, numpy.ones_like(w)], 1), g, rcond=None)[0]
        if float(numpy.abs(coef[0] * w + coef[1] - g).max()) > atol:
            return None
    return message


# ---------------------------------------------------------------- gradient reductions

def reduction_candidates(case, dtype, tensor):
    """(message, global array) for every wrong way of reducing the ranks' partial dw or db."""
    want = numpy.asarray(case.expected[dtype][tensor], numpy.float64)
    dims = expect.grid5(case.spec.grid)
    pn, ps, pm = dims[0], dims[1] * dims[2] * dims[3], dims[4]
    split = case.spec.model_parallel != "none"

    def spatial(lo):
        return grid_rank(lo.coords[1:4], dims[1:4])

    def total(pred):
        pieces = [case.ranks[dtype][lo.rank][f"{tensor}_partial"] for lo in case.layouts
                  if pred(lo) and (split or lo.coords[4] == 0)]
        return expect.embed(want.shape, [(numpy.asarray(a, numpy.float64), o) for a, o in pieces])

    out = []
    if pn * ps > 1:
        for n0 in range(pn):
            for s0 in range(ps):
                ranks = [lo.rank for lo in case.layouts if lo.coords[0] == n0 and spatial(lo) == s0]
                out.append((f"{tensor} equals the partial sum of rank(s) {ranks} alone: not summed over the "
                            + ("spatial shards" if ps > 1 else "") + (" nor " if ps > 1 and pn > 1 else "")
                            + ("sample groups" if pn > 1 else "") + " (allreduce missing)",
                            total(lambda lo, n0=n0, s0=s0: lo.coords[0] == n0 and spatial(lo) == s0)))
    if pn > 1 and ps > 1:
        for n0 in range(pn):
            out.append((f"{tensor} summed over the spatial shards of sample group {n0} only: not summed over "
                        f"the {pn} sample groups", total(lambda lo, n0=n0: lo.coords[0] == n0)))
        for s0 in range(ps):
            out.append((f"{tensor} summed over the sample groups of spatial block {s0} only: not summed over "
                        f"the {ps} spatial shards", total(lambda lo, s0=s0: spatial(lo) == s0)))
    if pn > 1:
        out.append((f"{tensor} averaged over the {pn} sample groups: this case's loss sums over the whole "
                    f"batch (L = sum y*dy), so gradients are sums; multiply by Pn = {pn}", want / pn))
    if ps > 1:
        out.append((f"{tensor} averaged over the {ps} spatial shards instead of summed: shards hold "
                    f"different voxels of the same samples", want / ps))
    if pn > 1 and ps > 1:
        out.append((f"{tensor} averaged over all {pn * ps} ranks", want / (pn * ps)))
    if not split and pm > 1:
        out.append((f"{tensor} summed over the {pm} model ranks, which each computed the whole layer",
                    want * pm))
    return out


def reduction(case, dtype, tensor, got, index, atol) -> str | None:
    base = tensor.split("_")[0]
    if base not in ("dw", "db") or tensor.endswith("_partial") or f"{base}_partial" not in case.ranks[dtype][0]:
        return None
    for message, cand in reduction_candidates(case, dtype, base):
        if _matches(got, cand[index], atol):
            return message
    return None


# ---------------------------------------------------------------- entry points

def global_tensor(case, dtype, tensor, got, want, bad, atol) -> str | None:
    """Diagnosis of a mismatching global tensor (the results' /<dtype>/global/<tensor>)."""
    got = numpy.asarray(got)
    everything = (slice(None),) * want.ndim
    if tensor in ("dw", "db"):
        return reduction(case, dtype, tensor, got, everything, atol)
    found = known_mistake(case, dtype, tensor, got, want, everything, atol) or shift(got, want, bad, atol)
    if found:
        return found
    # split into the ranks' blocks (one copy per block) and test each rank's pattern
    groups, seen = {}, set()
    for lo in case.layouts:
        index = lo.index("y" if tensor == "y" else "x")
        if _key(index) in seen:
            continue
        seen.add(_key(index))
        block_bad = bad[index]
        if not block_bad.any():
            continue
        message = shift(got[index], want[index], block_bad, atol) or (
            halo_forward(case, lo, block_bad) if tensor == "y" else
            halo_adjoint(case, dtype, lo, got[index], want[index], block_bad, atol))
        if message is None:
            return None
        groups.setdefault(message, []).append(lo.rank)
    if len(groups) == 1 and "{who}" not in next(iter(groups)):       # one shift in every block
        return next(iter(groups)) + " (in every rank's block)"
    return "; ".join(text.format(who=_who(ranks)) for text, ranks in groups.items()) or None


def _who(ranks) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(str(r) for r in ranks)}"


def rank_tensor(case, dtype, tensor, r, got, want, bad, atol) -> str | None:
    """Diagnosis of rank r's mismatching block of ``tensor``."""
    lo = case.layouts[r]
    got = numpy.asarray(got)
    if tensor in ("dw", "db"):
        _, offset = case.ranks[dtype][r][tensor]
        index = tuple(slice(o, o + n) for o, n in zip(offset, want.shape))
        return reduction(case, dtype, tensor, got, index, atol)
    if tensor == "x_needed":
        return ghost_cells(case, lo, bad)
    if tensor in ("y", "dx"):
        index = lo.index("y" if tensor == "y" else "x")
        found = known_mistake(case, dtype, tensor, got, want, index, atol) or shift(got, want, bad, atol)
        if found:
            return found
        found = halo_forward(case, lo, bad) if tensor == "y" else \
            halo_adjoint(case, dtype, lo, got, want, bad, atol)
        return found and found.format(who=_who([r]))
    return shift(got, want, bad, atol)
