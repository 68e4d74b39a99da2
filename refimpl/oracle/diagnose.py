"""Name the mistake behind a mismatch, where its pattern is one partitioned codes are known
to make.  Each test below rebuilds what the buggy computation would have produced (from
the case's own inputs and per-rank partials) or checks where the errors lie; a diagnosis
is given only when it explains every mismatching element of the tensor within the
tolerance, and where two causes explain it both are named with the tensor that decides.

    pattern                                         diagnosis
    dx, dw or db all zero (expected not)            that gradient is missing
    got[i] == want[i -+ 1] along one axis           padding or offset off by one
    a rank's y == its windows on the local stride   strided windows misplaced (stride restarted at
      grid (starting at its block's first cell)       the block edge, not the global phase)
    a rank's y == its windows with cells beyond     padding applied at an internal face (names the
      one internal face read as padding               two ranks; zeros: or ghosts that arrived as
                                                      zeros, x_needed decides)
    a pooling rank's y == its own block pooled      pooled locally without a halo (the kind's
                                                      ``no_halo_mistake``)
    a rank's y == its windows with the cells of     halo needs cells from a non-neighbour (names
      non-neighbours read as zeros                    the rank reached and the one skipped)
    y wrong only where windows read ghost cells     forward halo exchange (names the rank and the
      of one face (not every output does)             fewest faces that hold every error)
    dx - want == the ghost gradients r receives     adjoint exchange: ghosts added twice (not cleared)
    dx - want == -(those ghost gradients)           adjoint exchange missing
    dx - want == -(one sender's ghost gradients)    dx lacks exactly that sender's ghost gradients
    dx wrong only on cells others read as ghosts    adjoint halo exchange (backward)
    x_needed wrong outside the owned block          forward halo exchange (names the sending ranks;
                                                      only non-neighbours: their halo reaches past
                                                      the neighbour's block)
    batch norm == statistics of each block / group  statistics not reduced over the spatial / data group
    per-channel affine error                        scale/shift or statistics convention
    dw == a subset sum or a mean of the partials    which reduction is missing or averaged
    y of a wrong shape (``output_size``)            the output-size rule that gives that extent
                                                      (ignores output_padding, dilation, ...)

A diagnosis of y that blames the forward halo exchange is worded "<pattern>: the forward
halo exchange ..." so that compare.py can reduce it to a possibility where the results hold
no x_needed (only x_needed tells a wrong halo from a wrong local computation).
"""
from __future__ import annotations

import itertools

import numpy

from .. import layers
from ..parallel.partition import block_range, grid_rank, ceil_block_range
from . import expect

AXES = "DHW"
#: gradient tensors and what they are the gradient of
GRADIENTS = {"dx": "input gradient", "dx_needed": "input gradient", "dw": "weight gradient",
             "dw_partial": "weight gradient", "db": "bias gradient", "db_partial": "bias gradient"}


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


def gradient_missing(tensor, got, want, atol, block=False) -> str | None:
    """A gradient that is all zero (or nowhere finite) where the expected one is not: never
    computed (no requires_grad, a backward that skips the input), or never written back.
    ``block``: got is one rank's block of a global tensor (the message names ``{who}``)."""
    what = GRADIENTS.get(tensor)
    if what is None:
        return None
    got = numpy.asarray(got, numpy.float64)
    want = numpy.asarray(want, numpy.float64)
    if not got.size or got.shape != want.shape or not (numpy.abs(want) > atol).any():
        return None
    if (got == 0).all():
        how = "all zero"
    elif not numpy.isfinite(got).any():
        how = "nowhere finite"
    else:
        return None
    where = f" on {{who}}: its block of {tensor} is" if block else f": {tensor} is"
    return f"{what} missing{where} {how} where the expected one is not (never computed, or never written back)"


def _one_voxel_shift(got, want, bad, atol, blocks, min_extent):
    """``(axis, delta)`` of the one-voxel shift along one spatial axis under which ``got``
    matches ``want`` best, each of ``blocks`` (index tuples) compared apart, or None when no
    shift explains at least 90 % of the ``bad`` voxels.  Shifted by ``delta``,
    ``got[..., i + delta, ...]`` is compared with ``want[..., i, ...]`` inside each block; a
    block narrower than ``min_extent`` on the axis counts all its bad voxels as unexplained."""
    best = None
    for a in range(3):
        axis = 2 + a
        for delta in (1, -1):
            g_side, w_side = (slice(1, None), slice(None, -1)) if delta == 1 else (slice(None, -1), slice(1, None))
            left, compared = 0, 0
            for index in blocks:
                g, w = got[index], want[index]
                if g.shape[axis] < min_extent:
                    left += int(bad[index].sum())
                    continue
                compared += 1
                left += int((_err(g[(slice(None),) * axis + (g_side,)], w[(slice(None),) * axis + (w_side,)])
                             > atol).sum())
            if compared and left <= 0.1 * bad.sum() and (best is None or left < best[0]):
                best = (left, a, delta)
    return None if best is None else best[1:]


def _shift_message(a, delta, where=""):
    return (f"values shifted by {delta:+d} along {AXES[a]} (got[{AXES[a].lower()}] == expected"
            f"[{AXES[a].lower()}{-delta:+d}]){where}: a padding or offset off by one on that axis")


def shift(got, want, bad, atol) -> str | None:
    """got equals want shifted by one voxel along one spatial axis (but for the planes the
    shift brings in)."""
    if got.ndim != 5 or bad.sum() < 2:
        return None
    found = _one_voxel_shift(got, want, bad, atol, [(slice(None),) * 5], min_extent=3)
    return found and _shift_message(*found)


def blockwise_shift(case, tensor, got, want, bad, atol) -> str | None:
    """Every rank's block of a global tensor equals the expectation shifted by one voxel along
    one axis (but for the plane each block's shift brings in): ``shift`` block by block, blocks
    too narrow for it included."""
    if got.ndim != 5 or bad.sum() < 2 or got.shape != want.shape:
        return None
    blocks = list({_key(lo.index(tensor)): lo.index(tensor) for lo in case.layouts}.values())
    found = _one_voxel_shift(got, want, bad, atol, blocks, min_extent=2)
    return found and _shift_message(*found, where=" in every rank's block")


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
    """Every mismatch of rank lo's y lies in outputs whose windows read the ghost cells of the
    fewest faces that hold them all, and not every output of the block reads those (where
    every output reads a ghost cell, where the errors lie proves nothing about the halo)."""
    if not bad.any() or not layers.lookup(case.spec.layer).has_halo:
        return None
    shape = bad.shape[2:]
    where = bad.any(axis=(0, 1))
    planes = []
    for a, (low, high) in enumerate(ghost_reading_outputs(case, lo)):
        view = [1, 1, 1]
        view[a] = shape[a]
        for side, vec in (("low", low), ("high", high)):
            if vec.any():
                planes.append((f"{AXES[a]} {side}", numpy.broadcast_to(vec.reshape(view), shape)))
    for size in range(1, len(planes) + 1):
        covers = []
        for combo in itertools.combinations(planes, size):
            union = numpy.logical_or.reduce([plane for _, plane in combo])
            if not (where & ~union).any():
                covers.append((int(union.sum()), combo, union))
        if covers:
            _, combo, union = min(covers, key=lambda c: c[0])
            if union.all():
                return None
            faces = " and ".join(name for name, _ in combo) + (" face" if size == 1 else " faces")
            return (f"errors only in outputs whose windows read ghost cells ({faces}) of {{who}}: "
                    f"the forward halo exchange delivered wrong ghost values")
    return None


def _row(case, lo):
    """The ranks whose input blocks tile the same samples and channels as lo's."""
    return [q for q in case.layouts if q.samples == lo.samples and q.coords[4] == lo.coords[4]]


def _owner(case, lo, point):
    """The rank of lo's row whose input block holds the spatial cell ``point``."""
    return next((q for q in _row(case, lo) if all(b0 <= i < b1 for i, (b0, b1) in zip(point, q.owned))), None)


def _plural(n, word="cell"):
    return f"{n} {word}" + ("" if n == 1 else "s")


def far_cells(case, lo):
    """(mask over lo's needed block (D, H, W), parts): the cells lo's windows read from ranks
    that are not its direct neighbours, each part (axis, side, rank reached, the neighbour's
    rank skipped, the neighbour's width, global range along the axis)."""
    shape = tuple(b - a for a, b in lo.needed)
    mask = numpy.zeros(shape, bool)
    parts = []
    if any(b0 >= b1 for b0, b1 in lo.owned):
        return mask, parts
    base = [b0 for b0, _ in lo.owned]
    for a in range(3):
        (i0, i1), (b0, b1) = lo.needed[a], lo.owned[a]
        for side, edge in (("low", b0 - 1), ("high", b1)):
            if not i0 <= edge < i1:
                continue
            point = list(base)
            point[a] = edge
            near = _owner(case, lo, point)
            if near is None:
                continue
            q0, q1 = near.owned[a]
            far = (i0, q0) if side == "low" else (q1, i1)
            if far[0] >= far[1]:
                continue
            point[a] = far[0] if side == "low" else far[1] - 1
            reached = _owner(case, lo, point)
            view = [slice(None)] * 3
            view[a] = slice(far[0] - i0, far[1] - i0)
            mask[tuple(view)] = True
            parts.append((a, side, reached.rank if reached else None, near.rank, q1 - q0, far))
    return mask, parts


def _far_text(part, who="{who}") -> str:
    _, _, reached, near, width, _ = part
    return (f"halo needs cells from a non-neighbour: {who}'s window reaches rank {reached}'s block, past rank "
            f"{near}'s ({_plural(width)} wide)")


def _peers(case, lo):
    """Ranks whose partial input gradients add into rank lo's dx: same samples, and the
    same channels (the same model coordinate unless the conv is filter-parallel)."""
    return [q for q in case.layouts if q.samples == lo.samples and q.compute_channels[0] <= lo.in_channels[0]
            and lo.in_channels[1] <= q.compute_channels[1]
            and (case.spec.model_parallel != "none" or q.coords[4] == lo.coords[4])]


def _ghost_gradients_by_sender(case, dtype, lo):
    """{rank: its partial dx on lo's block} for every peer whose partial reaches lo's block
    (lo's own partial included), each shaped like lo's dx block."""
    block = lo.index("x")
    shape = tuple(s.stop - s.start for s in block)
    out = {}
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
            part = out.setdefault(q.rank, numpy.zeros(shape))
            part[tuple(dst)] += piece[tuple(src)]
    return out


def halo_adjoint(case, dtype, lo, got, want, bad, atol) -> str | None:
    """dx - want equals (plus or minus) the ghost gradients lo receives from all its peers,
    or from exactly one of them (each sender tested alone), or lies on received cells only."""
    if not layers.lookup(case.spec.layer).has_halo or case.spec.model_parallel == "filter" or not bad.any():
        return None
    by = _ghost_gradients_by_sender(case, dtype, lo)
    shape = tuple(s.stop - s.start for s in lo.index("x"))
    by.pop(lo.rank, None)
    senders = {q: c for q, c in by.items() if c.any()}
    received = sum(senders.values(), numpy.zeros(shape))
    err = numpy.asarray(got, numpy.float64) - numpy.asarray(want, numpy.float64)
    if not senders:
        return None
    if float(numpy.abs(err - received).max()) <= atol:
        return ("doubled gradient on ghost cells of {who}: dx holds the neighbours' ghost gradients "
                "twice; the adjoint halo exchange added them into their owner without clearing the "
                "ghosts, so they were added again")
    if float(numpy.abs(err + received).max()) <= atol:
        return ("dx of {who} lacks the neighbours' ghost gradients: the adjoint halo exchange (adding "
                "ghost gradients back into their owners) is missing")
    if len(senders) > 1:           # one sender, then every proper subset of them (fewest first)
        ranks = sorted(senders)
        for size in range(1, len(ranks)):
            for group in itertools.combinations(ranks, size):
                part = sum((senders[q] for q in group), numpy.zeros(shape))
                far = "; ".join(f for f in (_sender_far(case, q, lo) for q in group) if f)
                whose = f"rank {group[0]}'s" if size == 1 else f"ranks {', '.join(map(str, group))}'"
                if float(numpy.abs(err + part).max()) <= atol:
                    return (f"dx on {{who}} lacks exactly {whose} ghost gradients: the adjoint halo exchange "
                            f"did not add {whose} into their owner" + (f" ({far})" if far else ""))
                if float(numpy.abs(err - part).max()) <= atol:
                    return (f"dx on {{who}} holds exactly {whose} ghost gradients twice: the adjoint halo exchange "
                            f"added {whose} without clearing them" + (f" ({far})" if far else ""))
            if size >= 3:                  # 2^senders grows fast: the likely cases are one or two senders
                break
    if not (bad & (received == 0)).any():
        return ("errors only on cells of {who} that other ranks read as ghosts: the adjoint halo "
                "exchange (backward) returned wrong ghost gradients")
    return None


def _sender_far(case, q, lo) -> str | None:
    """Where sender q reads lo's block past a neighbour of its own: the reason its ghost
    gradients take more than a neighbour exchange."""
    parts = [p for p in far_cells(case, case.layouts[q])[1] if p[2] == lo.rank]
    return _far_text(parts[0], who=f"rank {q}") if parts else None


def ghost_cells(case, lo, bad) -> str | None:
    """x_needed wrong only outside the rank's own block: name the owners of the bad cells,
    and where they are all past the direct neighbours, the halo that reaches them."""
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
    known = sorted(o for o in owners if o is not None)
    named = f"rank{'s' * (len(known) != 1)} {', '.join(map(str, known))}"
    mask, parts = far_cells(case, lo)
    where = bad.any(axis=(0, 1))
    if parts and where.shape == mask.shape and not (where & ~mask).any():
        hit = []
        for part in parts:
            a, _, _, _, _, (f0, f1) = part
            view = [slice(None)] * 3
            view[a] = slice(f0 - lo.needed[a][0], f1 - lo.needed[a][0])
            if where[tuple(view)].any():
                hit.append(_far_text(part, who=f"rank {lo.rank}").split(": ", 1)[1])
        return (f"halo needs cells from a non-neighbour: {'; '.join(hit)}; its ghost cells from {named} "
                f"are wrong, those from its neighbours right: the forward halo exchange served the direct "
                f"neighbours only")
    return (f"rank {lo.rank}'s ghost cells are wrong (cells owned by {named}), its own block is right: "
            f"the forward halo exchange")


# ---------------------------------------------------------------- a rank's y block rebuilt with a mistake

def _pads(spec):
    """(low, high) padding per axis (the per-side form where the spec has it)."""
    try:
        from ..layers.base import spec_padding
        return tuple(tuple(int(v) for v in p) for p in spec_padding(spec))
    except (ImportError, ValueError, TypeError):
        return tuple((int(p), int(p)) for p in spec.padding[:3])


def window_block(case, dtype, lo, x, starts):
    """Rank lo's output block from the windows starting at the global input positions
    ``starts`` (per axis; outside the domain reads the kind's padding) over ``x`` (lo's
    samples, every channel, float64): None where the kind has no ``window_values``."""
    kind = layers.lookup(case.spec.layer)
    spec = case.spec
    k, d = spec.kernel, spec.dilation
    pads = _pads(spec)
    idx = [numpy.asarray(st, int)[:, None] + d[a] * numpy.arange(k[a]) for a, st in enumerate(starts)]
    if any(i.shape[0] == 0 for i in idx):
        return None
    n = x.shape[2:]
    if x.shape[0] * x.shape[1] * numpy.prod([i.size for i in idx]) > 3e7:      # too big to rebuild here
        return None
    low = [max(0, -int(i.min())) for i in idx]
    high = [max(0, int(i.max()) + 1 - n[a]) for a, i in enumerate(idx)]
    xp = numpy.pad(x, [(0, 0), (0, 0)] + list(zip(low, high)), constant_values=getattr(kind, "pad_value", 0.0))
    i0, i1, i2 = (i + lo_ for i, lo_ in zip(idx, low))
    patches = xp[:, :, i0[:, None, None, :, None, None], i1[None, :, None, None, :, None],
                 i2[None, None, :, None, None, :]]
    padded = [((i >= -p[0]) & (i < m + p[1])).sum(axis=1) for i, p, m in zip(idx, pads, n)]
    inside = [((i >= 0) & (i < m)).sum(axis=1) for i, m in zip(idx, n)]
    counts = tuple(numpy.einsum("i,j,k->ijk", *c).astype(numpy.float64) for c in (padded, inside))
    a = case.inputs[dtype]
    w = None if "w" not in a else numpy.asarray(a["w"], numpy.float64)
    b = None if "b" not in a else numpy.asarray(a["b"], numpy.float64)
    y = kind.window_values(spec, patches, w, b, counts)
    return None if y is None else y[:, slice(*lo.out_channels)]


def _internal_faces(case, lo):
    """(axis, side, neighbour rank) of every face of lo's block its windows read across."""
    faces = []
    if any(b0 >= b1 for b0, b1 in lo.owned):
        return faces
    base = [b0 for b0, _ in lo.owned]
    for a in range(3):
        (i0, i1), (b0, b1) = lo.needed[a], lo.owned[a]
        for side, edge, reads in (("low", b0 - 1, i0 < b0), ("high", b1, i1 > b1)):
            if reads:
                point = list(base)
                point[a] = edge
                q = _owner(case, lo, point)
                faces.append((a, side, q.rank if q else None))
    return faces


def _beyond(x, lo, faces, value):
    """x with the cells beyond the given faces of lo's block set to ``value``."""
    xm = x.copy()
    for a, side, _ in faces:
        b0, b1 = lo.owned[a]
        index = [slice(None)] * 5
        index[2 + a] = slice(None, b0) if side == "low" else slice(b1, None)
        xm[tuple(index)] = value
    return xm


def _faces_text(lo, faces) -> tuple[str, str]:
    """('D low face', 'between ranks 0 and 1') for one face, or the lists for several."""
    names = " and ".join(f"{AXES[a]} {side}" for a, side, _ in faces) + (" face" if len(faces) == 1 else " faces")
    pairs = ", ".join(f"between ranks {min(q, lo.rank)} and {max(q, lo.rank)}" for _, _, q in faces if q is not None)
    return names, pairs


def _owners(faces) -> str:
    ranks = [str(q) for _, _, q in faces if q is not None]
    return f"rank {ranks[0]}'s cells" if len(ranks) == 1 else f"cells of ranks {', '.join(ranks)}"


def _suspects(case, lo, x, right, kind):
    """(message, x as the mistake reads it, window starts) for each mistake a rank's y block
    is rebuilt with, most specific first."""
    spec = case.spec
    s, pads, pad = spec.stride, _pads(spec), float(getattr(kind, "pad_value", 0.0))
    owned = lo.owned
    phase = {a: s[a] * lo.outputs[a][0] - owned[a][0] for a in range(3)
             if s[a] > 1 and owned[a][0] < owned[a][1] and s[a] * lo.outputs[a][0] != owned[a][0]}

    def local(axes):
        return [[owned[a][0] - pads[a][0] + s[a] * j for j in range(len(right[a]))] if a in axes else right[a]
                for a in range(3)]

    def phase_text(axes):
        clauses = "; ".join(f"along {AXES[a]} local 0 is input {owned[a][0] - pads[a][0]} (its block's first cell "
                            f"{owned[a][0]} less the padding {pads[a][0]})" for a in axes)
        firsts = ", ".join(f"{phase[a]}" for a in axes)
        return (f"strided windows misplaced: {{who}}'s outputs are those of windows starting at local 0, the global "
                f"stride grid puts the first at local {firsts} ({clauses}): the stride restarts at the block's edge "
                f"instead of keeping the global phase")

    for axes in [[a] for a in phase] + ([list(phase)] if len(phase) > 1 else []):
        yield phase_text(axes), x, local(axes)
    mask, parts = far_cells(case, lo)
    if parts:
        xm = x.copy()
        region = xm[(slice(None), slice(None)) + tuple(slice(*r) for r in lo.needed)]
        region[:, :, mask] = 0.0
        yield ("; ".join(_far_text(p) for p in parts) + ", and read zeros there: the forward halo exchange "
               "reached the direct neighbours only"), xm, right
    faces = _internal_faces(case, lo)
    if not faces:
        return
    what = "zeros" if pad == 0 else f"{pad:g} (the padding of {spec.layer})"
    if kind.no_halo_mistake:
        xm = _beyond(x, lo, faces, pad)
        text = kind.no_halo_mistake
        if pad != 0:               # ghosts that arrived as the padding value look the same
            text += (f", or ghost cells that arrived as {pad:g}: the forward halo exchange (x_needed decides: "
                     f"{pad:g} in its ghost cells means the exchange)")
        yield text, xm, right
        if phase:
            yield (kind.no_halo_mistake + "; its windows also start at its block's edge, off the global stride "
                   "grid"), xm, local(list(phase))
    singles = [[f] for f in faces]
    several = [faces] if len(faces) > 1 else []
    # a pooling rank with one internal face: padding it is pooling without a halo (above)
    for group in (singles if len(faces) > 1 or not kind.no_halo_mistake else []) + several:
        names, pairs = _faces_text(lo, group)
        text = (f"{{who}} read {what} for the cells beyond its {names} ({_owners(group)}): padding applied at "
                f"{'an internal face' if len(group) == 1 else 'internal faces'} ({pairs})")
        if pad == 0:
            text += (", or ghost cells that arrived as zeros: the forward halo exchange (x_needed decides: "
                     "zeros in its ghost cells mean the exchange)")
        if pad != 0:               # ghosts that arrived as the padding value look the same
            text += (f", or ghost cells that arrived as {pad:g}: the forward halo exchange (x_needed decides: "
                     f"{pad:g} in its ghost cells means the exchange)")
        yield text, _beyond(x, lo, group, pad), right
    if pad != 0:
        for group in singles + several:
            names, _ = _faces_text(lo, group)
            yield (f"{{who}} read zeros for the cells beyond its {names} ({_owners(group)}), where {spec.layer} "
                   f"pads with {pad:g}: ghost cells "
                   f"that arrived as zeros: the forward halo exchange delivered zeros there"), \
                _beyond(x, lo, group, 0.0), right


def block_mistake(case, dtype, lo, got, want, atol) -> str | None:
    """Rank lo's y block rebuilt with each mistake of ``_suspects``: the one that matches every
    element names it (``{who}``: the rank); where several do, all are named, a cause only
    x_needed can confirm last.  Tried only where the rebuild without a mistake reproduces the
    expectation."""
    kind = layers.lookup(case.spec.layer)
    if not kind.has_halo or lo.samples[0] == lo.samples[1] or any(o0 == o1 for o0, o1 in lo.outputs):
        return None
    got = numpy.asarray(got)
    s, pads = case.spec.stride, _pads(case.spec)
    x = numpy.asarray(case.inputs[dtype]["x"], numpy.float64)[slice(*lo.samples)]
    right = [[s[a] * o - pads[a][0] for o in range(*lo.outputs[a])] for a in range(3)]
    base = window_block(case, dtype, lo, x, right)
    if base is None or not _matches(numpy.asarray(want), base, atol) or got.shape != base.shape:
        return None
    fits = [message for message, xm, starts in _suspects(case, lo, x, right, kind)
            if _matches(got, window_block(case, dtype, lo, xm, starts), atol)]
    if len(fits) <= 1:
        return fits[0] if fits else None
    fits.sort(key=lambda m: "halo exchange" in m)          # a cause that needs x_needed to stand goes last
    return "; ".join(fits[:-1]) + "; equally (the data here cannot tell them apart): " + fits[-1]


def _layout_of(case, which, index):
    """The layout whose block ``which`` ('y' or 'x') is ``index`` (None: no rank's)."""
    key = _key(index)
    return next((lo for lo in case.layouts if _key(lo.index(which)) == key), None)


# ---------------------------------------------------------------- a whole tensor gathered wrongly

#: (name, rule) of the splits a peer's blocks may follow or its gather may assume
SPLITS = (("refimpl's balanced split", block_range), ("torch.chunk's", ceil_block_range))


def gathered_with_sizes(whole, axis, blocks, slots, fill):
    """``whole`` (N, C, D, H, W) as a gather along spatial ``axis`` makes it that takes block i
    (``blocks[i]``, [start, stop)) into slot i (``slots[i]``), cut to the shorter of the two;
    what a slot's block does not fill holds ``fill``."""
    out = numpy.full_like(whole, fill)
    for (b0, b1), (s0, s1) in zip(blocks, slots):
        m = min(b1 - b0, s1 - s0)
        src, dst = [slice(None)] * 5, [slice(None)] * 5
        src[2 + axis], dst[2 + axis] = slice(b0, b0 + m), slice(s0, s0 + m)
        out[tuple(dst)] = whole[tuple(src)]
    return out


def gathered_sizes(case, tensor, got, want, atol) -> str | None:
    """A whole y or dx (every rank's copy, or the global one) gathered from the ranks' blocks
    with the wrong shard sizes along one split axis: block i, of the size one split rule
    gives, was placed at another rule's offset of block i and cut (or padded) to that rule's
    size (a gather that assumes torch.chunk's sizes while the blocks are balanced, or the
    reverse).  Cells a padded block filled are not judged (their value is the gatherer's)."""
    if tensor not in ("y", "dx") or got.ndim != 5 or got.shape != numpy.shape(want):
        return None
    dims = expect.grid5(case.spec.grid)
    got = numpy.asarray(got, numpy.float64)
    want = numpy.asarray(want, numpy.float64)
    for a in range(3):
        p, n = dims[1 + a], want.shape[2 + a]
        if p < 2:
            continue
        for (have_name, have), (assumed_name, assumed) in itertools.permutations(SPLITS, 2):
            blocks = [have(n, p, i) for i in range(p)]
            slots = [assumed(n, p, i) for i in range(p)]
            if blocks == slots:
                continue
            cand = gathered_with_sizes(want, a, blocks, slots, numpy.nan)
            known = ~numpy.isnan(cand)
            if known.all() or not (numpy.abs(got - want) > atol).any():
                continue
            # evidence beyond "the unjudged cells are wrong": a block visibly moved, or the cells
            # the gather padded holding one value (its padding), not arbitrary errors
            moved = (_err(cand[known], want[known]) > atol).any()
            padded = got[~known]
            if not moved and not (padded.size and numpy.all(padded == padded.flat[0])):
                continue
            with numpy.errstate(invalid="ignore"):
                if (_err(got[known], cand[known]) <= atol).all():
                    sizes = [b1 - b0 for b0, b1 in blocks]
                    slot_sizes = [s1 - s0 for s0, s1 in slots]
                    return (f"{tensor} gathered along {AXES[a]} with {assumed_name} shard sizes {tuple(slot_sizes)} where "
                            f"the {p} blocks have {have_name} sizes {tuple(sizes)}: each block placed at the wrong "
                            f"offset and cut or padded to the wrong size (gather with the blocks' actual sizes)")
    return None


# ---------------------------------------------------------------- wrong-shaped results

def output_size(case, dtype, tensor, rank, shape, offset=None) -> str | None:
    """The output-size rule behind a wrong-shaped y (global, or rank ``rank``'s block at
    ``offset``, None: the case's block of that rank): each spatial extent that differs is
    matched to the kind's ``output_size_rules``; None where one is not."""
    if tensor not in ("y", "y_partial") or len(shape) != 5:
        return None
    kind = layers.lookup(case.spec.layer)
    full = case.expected[dtype]["y"].shape
    lo = case.layouts[rank] if rank is not None and rank < len(case.layouts) else None
    clauses, causes = [], []
    for a in range(3):
        rules = kind.output_size_rules(case.spec, a)
        if rank is None:
            if shape[2 + a] == full[2 + a]:
                continue
            fits = [what for what, e in rules if e == shape[2 + a]]
            clauses.append(f"{AXES[a]} has {shape[2 + a]} outputs where the layer has {full[2 + a]}")
        else:
            start = offset[2 + a] if offset is not None else (lo.outputs[a][0] if lo else None)
            want_stop = lo.outputs[a][1] if lo and offset is None else full[2 + a]
            if start is None or start + shape[2 + a] == want_stop:
                continue
            fits = [what for what, e in rules if start + shape[2 + a] == e and want_stop == full[2 + a]]
            clauses.append(f"its {AXES[a]} block ends at output {start + shape[2 + a]} where the layer's output "
                           f"ends at {full[2 + a]}")
        if not fits:
            return None
        causes.append(" or ".join(fits))
    if not clauses:
        return None
    who = "the global y" if rank is None else f"rank {rank}'s y"
    return (f"output size {'; '.join(dict.fromkeys(causes))}: {who}: {'; '.join(clauses)}")


# ---------------------------------------------------------------- mistakes of one layer kind

def known_mistake(case, dtype, tensor, got, want, index, atol) -> str | None:
    """y or dx equal to what a known mistake of the case's layer kind produces
    (refimpl/layers: ``known_mistakes``, ``affine_mistake``; batch norm's statistics); a
    gradient that is missing; and where ``index`` is a rank's output block, that block
    rebuilt with a mistake of its windows (``block_mistake``)."""
    missing = gradient_missing(tensor, got, want, atol)
    if missing or tensor not in ("y", "dx"):
        return missing
    kind = layers.lookup(case.spec.layer)
    part = ("y", "dx").index(tensor)
    for message, candidate in kind.known_mistakes(case, dtype):
        if candidate is not None and _matches(got, candidate[part][index], atol):
            return message
    found = kind.affine_mistake and _affine(got, want, atol, kind.affine_mistake)
    if found or tensor != "y":
        return found or None
    lo = _layout_of(case, "y", index)
    found = lo is not None and block_mistake(case, dtype, lo, got, want, atol)
    return found.format(who=f"rank {lo.rank}") if found else None


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
                out.append((f"{tensor} equals the partial sum of {_who(ranks)} alone: not summed over the "
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
    if got.shape != numpy.shape(want):                  # a wrong shape: the output-size rule behind it
        return output_size(case, dtype, tensor, None, got.shape)
    everything = (slice(None),) * want.ndim
    missing = gradient_missing(tensor, got, want, atol)
    if missing:
        return missing
    if tensor in ("dw", "db"):
        return reduction(case, dtype, tensor, got, everything, atol)
    found = known_mistake(case, dtype, tensor, got, want, everything, atol) or shift(got, want, bad, atol) or \
        gathered_sizes(case, tensor, got, want, atol) or (
        blockwise_shift(case, "y" if tensor == "y" else "x", got, want, bad, atol) if tensor in ("y", "dx") else None)
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
        g, w = got[index], want[index]
        message = gradient_missing(tensor, g, w, atol, block=True) or (
            block_mistake(case, dtype, lo, g, w, atol) if tensor == "y" else None) or shift(g, w, block_bad, atol) or (
            halo_forward(case, lo, block_bad) if tensor == "y" else
            halo_adjoint(case, dtype, lo, g, w, block_bad, atol))
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
    if got.shape != numpy.shape(want):                  # a wrong shape: the output-size rule behind it
        return output_size(case, dtype, tensor, r, got.shape)
    missing = gradient_missing(tensor, got, want, atol)
    if missing:
        return missing
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
