"""Diagnoses of a trace's findings: which known mistake rebuilds what the peer reported.

First the trace's own, by rebuilding what a known mistake would produce (the
same approach as diagnose.py on one layer): a rank's block computed with zeros beyond
one internal face (forward halo) or beyond every internal face (padding at internal
faces), batch-norm statistics of a rank's own block, a dx without (or with twice) the
neighbours' ghost gradients, a gradient that is one rank's own contribution or scaled by
a count of ranks, a loss scaled by a count, an update not applied (or scaled) on one
rank.  Where none matches, a window or batch-norm layer's y / dx is handed to the
layer-level diagnoses (diagnose.py) as an in-memory layer case (``layer_case``: the
layer's spec through the suite's rules, its expectations through expect.py, on the
peer's input and output gradient): shifts, strided windows, far halos, ...
"""
from __future__ import annotations

import numpy

from . import trace as T
#: the layer kinds that are layer-level oracle kinds too (refimpl/layers): diagnose.py applies
CASE_KINDS = ("conv3d", "conv_transpose3d", "max_pool3d", "avg_pool3d", "batch_norm3d")


def scalar_fit(got, want, tol) -> float | None:
    """c when got == c · want within the tolerance (c != 1), else None."""
    got, want = numpy.asarray(got, dtype=numpy.float64), numpy.asarray(want, dtype=numpy.float64)
    denom = float(numpy.sum(want * want))
    if not denom or not numpy.isfinite(got).all():
        return None
    c = float(numpy.sum(got * want)) / denom
    scale = float(numpy.max(numpy.abs(want)))
    if abs(c - 1.0) < 1e-9 or float(numpy.max(numpy.abs(got - c * want))) > 4 * tol * scale:
        return None
    return c


def counts_of(grid) -> list:
    """(count, what) of the rank counts a gradient or loss can be wrongly normalised by."""
    pn, ps, pm = grid[0], int(numpy.prod(grid[1:4])), int(numpy.prod(grid[4:]))
    out = []
    for k, what in ((pn * ps * pm, "the P ranks of the whole grid"), (ps, "the spatial group's ranks"),
                    (pn, "the data group's ranks"), (pm, "the model group's ranks")):
        if k > 1 and all(k != c for c, _ in out):
            out.append((k, what))
    return out


def name_factor(c: float, grid) -> str:
    for k, what in counts_of(grid):
        if abs(c * k - 1.0) < 1e-6:
            return f"1/{k} of the expected: divided by {k} ({what})"
        if abs(c / k - 1.0) < 1e-6:
            return f"{k} × the expected: multiplied by {k} ({what})"
    return f"{c:.6g} × the expected"


def diagnose_forward(ref, entry, x, mask, want, blocks, bad, tol, grid):
    """What a known mistake in the failing ranks' blocks of y rebuilds, in words, or None."""
    if entry["kind"] not in T.WINDOW_KINDS + T.statistics_kinds() or len(entry["y_shape"]) != 5:
        return None
    scale = float(numpy.max(numpy.abs(want))) or 1.0
    got = {r: (a, o) for r, a, o in blocks if r is not None}
    ranks = int(numpy.prod(grid))
    matched = {}
    for r in bad:
        if r is None or r not in got or r >= ranks:
            continue
        array, offset = got[r]
        out_sl = tuple(slice(a, a + n) for a, n in zip(offset, array.shape))

        def same(y_bug):
            return float(numpy.max(numpy.abs(array - y_bug))) <= 4 * tol * scale if array.size else False

        in_sl = T.layer_slices(entry, "dx", grid, r)
        if entry["kind"] in T.statistics_kinds():   # statistics of its own block: every channel, then its share
            spatial = T.rank_slices(tuple(x.shape), grid, r)
            if same(ref.forward64(entry["name"], x[spatial], mask)[:, out_sl[1]]):
                matched[r] = ("bn",)
            continue
        faces = T.internal_faces(tuple(x.shape), grid, r)
        for axis, side in faces:
            cut = [slice(None)] * 5
            cut[axis] = slice(0, in_sl[axis].start) if side == "low" else slice(in_sl[axis].stop, None)
            x_bug = x.copy()
            x_bug[tuple(cut)] = 0
            if same(ref.forward64(entry["name"], x_bug, mask)[out_sl]):
                matched[r] = ("face", axis, side, len(faces))
                break
        else:
            if len(faces) > 1:
                x_bug = numpy.zeros_like(x)
                x_bug[in_sl] = x[in_sl]
                if same(ref.forward64(entry["name"], x_bug, mask)[out_sl]):
                    matched[r] = ("all", len(faces))
    if not matched or set(matched) != set(r for r in bad if r is not None):
        return None
    kinds = {m[0] for m in matched.values()}
    if kinds == {"bn"}:
        per_sample = entry["kind"] != "batch_norm3d"     # group / instance norm: statistics of each sample
        group = "the spatial group" if per_sample or grid[0] == 1 else "the data group" \
            if all(p == 1 for p in grid[1:4]) else "the spatial and data groups"
        what = entry["kind"].replace("_norm3d", "-norm")
        return (f"{what} statistics of each failing rank's own block (rank{'s' * (len(matched) != 1)} {', '.join(map(str, matched))}): "
                f"not reduced over {group}")
    def only_own_block(r):
        """Rank r's block of y computed from its own input block alone (zeros beyond every face)."""
        in_sl = T.layer_slices(entry, "dx", grid, r)
        out_sl = T.layer_slices(entry, "y", grid, r)
        x_bug = numpy.zeros_like(x)
        x_bug[in_sl] = x[in_sl]
        return ref.forward64(entry["name"], x_bug, mask)[out_sl], out_sl

    def close(a, b):
        return a.size == 0 or float(numpy.max(numpy.abs(a - b))) <= 4 * tol * scale

    # the ranks whose windows read past their block at all, and whether each of them read zeros there
    reads_past = [r for r in range(ranks) if T.internal_faces(tuple(x.shape), grid, r)
                  and not close(*(lambda y, sl: (y, want[sl]))(*only_own_block(r)))]
    if len(reads_past) > 1 and set(matched) == set(reads_past) and \
            all(close(only_own_block(r)[0], got[r][0]) for r in reads_past):
        return ("every rank computed its block as if its internal faces were the domain's edge: padding applied "
                "at internal faces instead of a halo exchange"
                + (" (pooled locally, without a halo)" if "pool" in entry["kind"] else ""))
    pooling = "pool" in entry["kind"]
    parts = []
    for r, m in matched.items():
        if m[0] == "face":
            axis, side = "DHW"[m[1] - 2], m[2]
            parts.append(f"rank {r} read zeros beyond its {axis} {side} face (a neighbour's cells): the forward halo "
                         f"exchange delivered zeros there, or padding was applied at that internal face"
                         + (" (pooled without its halo)" if pooling else ""))
        else:
            parts.append(f"rank {r} read zeros beyond all its internal faces: no halo exchange (padding at internal faces)")
    return "; ".join(parts)


def diagnose_drift(ref, entry, x, mask, blocks, bad, tol, want, rank_params, step):
    """Ranks whose block of y is the layer with their own parameters of the step before
    (``update/rank/<r>`` of step s-1) where those differ from the others': drift."""
    if step == 0 or not entry["params"] or not rank_params:
        return None
    layer = ref.layers64[entry["name"]]
    saved = {t: T.parameter(layer, t).data.copy() for t in entry["params"]}
    scale = float(numpy.max(numpy.abs(want))) or 1.0
    drifted = []
    try:
        for r, array, offset in blocks:
            own = rank_params.get(r, {})
            if r not in bad or not all(p in own and own[p].shape == saved[t].shape for t, p in entry["params"].items()):
                continue                       # a rank's own parameters, whole, are needed to rebuild its block
            for t, pname in entry["params"].items():
                T.parameter(layer, t).data[...] = own[pname]
            y = T.forward(layer, x, mask)[tuple(slice(a, a + n) for a, n in zip(offset, array.shape))]
            if float(numpy.max(numpy.abs(array - y))) <= 4 * tol * scale:
                drifted.append(r)
    finally:
        for t, data in saved.items():
            T.parameter(layer, t).data[...] = data
    if not drifted:
        return None
    return (f"rank{'s' * (len(drifted) != 1)} {', '.join(map(str, drifted))} computed their block with their own parameters of "
            f"{', '.join(entry['params'].values())} (their update/rank of step {step - 1}), which differ from "
            f"the others': the parameters drifted between ranks")


def diagnose_gradient(ref, entry, tensor, x, dy, mask, want, blocks, bad, tol, grid):
    """dw/db: one rank's own contribution, a sum over the data group only, or a count's
    factor; dx: a factor.  Ranks with the same pattern are named together."""
    scale = float(numpy.max(numpy.abs(want))) or 1.0
    got = {r: (a, tuple(slice(o, o + n) for o, n in zip(offset, a.shape))) for r, a, offset in blocks}
    patterns = {}
    for r in bad:
        array, sl = got[r]
        pattern = None
        if tensor in ("dw", "db") and r is not None and r < int(numpy.prod(grid)):
            own = _contribution(ref, entry, x, dy, mask, grid, [r])[tensor][sl]
            coords = T.grid_coords(r, grid)
            mates = [q for q in range(int(numpy.prod(grid))) if T.grid_coords(q, grid)[1:] == coords[1:]]
            if float(numpy.max(numpy.abs(array - own))) <= 4 * tol * scale:
                pattern = (f"{tensor} is its own contribution only (its block's share, before the allreduce): "
                           f"not summed over the spatial shards")
            elif 1 < len(mates) < int(numpy.prod(grid)):
                part = _contribution(ref, entry, x, dy, mask, grid, mates)[tensor][sl]
                if float(numpy.max(numpy.abs(array - part))) <= 4 * tol * scale:
                    pattern = (f"{tensor} is summed over the data group only (the sample groups of its spatial "
                               f"block), not over the spatial shards")
        if tensor == "dx" and r is not None and entry["kind"] in T.WINDOW_KINDS and r < int(numpy.prod(grid)):
            own = _own_input_gradient(ref, entry, x, dy, mask, grid, r)[sl]
            if float(numpy.max(numpy.abs(array - own))) <= 4 * tol * scale:
                pattern = ("dx holds only the gradient of its own outputs: the ghost gradients its neighbours "
                           "computed for its cells never arrived (the adjoint halo exchange is missing)")
            elif float(numpy.max(numpy.abs(array - (2 * want[sl] - own)))) <= 4 * tol * scale:
                pattern = ("dx holds its neighbours' ghost gradients twice: the adjoint halo exchange added "
                           "them without clearing the ghosts")
        if pattern is None:
            c = scalar_fit(array, want[sl], tol)
            if c is not None:
                pattern = f"{tensor} is {name_factor(c, grid)}"
                if tensor != "dx":
                    pattern += ": averaged over the wrong count" if c < 1 else ": summed where it should be averaged"
        if pattern is not None:
            patterns.setdefault(pattern, []).append("global" if r is None else f"rank {r}")
    return "; ".join(f"{', '.join(who)}: {pattern}" for pattern, who in patterns.items()) or None


def layer_case(ref, entry, x, dy, grid, dtype):
    """The layer as a layer-level oracle case (casefile.Case, in memory) on the peer's input
    ``x`` and output gradient ``dy``: its spec through the suite's own rules, its
    expectations through expect.py, so diagnose.py's patterns apply to it unchanged."""
    from .. import layers as registry
    from .casefile import Case
    from .expect import rank_arrays, rank_layouts
    from .suite import parse_suite
    module = ref.layers64[entry["name"]].module
    case = {"name": entry["name"].replace(".", "_"), "layer": entry["kind"], "input": list(x.shape),
            "grids": [list(grid)], "dtypes": [dtype]}
    if entry["kind"] != "batch_norm3d":
        case.update(kernel=list(module.kernel_size), stride=list(module.stride), padding=list(module.padding))
    if entry["kind"].startswith("conv"):
        case.update(out_channels=entry["y_shape"][1], dilation=list(module.dilation))
    (spec,) = parse_suite({"case": [case]}, f"trace layer {entry['name']}")
    params = {t: numpy.asarray(T.parameter(ref.layers64[entry["name"]], t).data, dtype=numpy.float64)
              for t in entry["params"]}
    inputs = {"x": x, "dy": numpy.zeros(entry["y_shape"]) if dy is None else dy,
              "w": params.get("dw"), "b": params.get("db")}
    if inputs["w"] is not None and inputs["b"] is None:
        inputs["b"] = numpy.zeros(entry["y_shape"][1])          # a conv without bias: a zero bias
    inputs = {k: v for k, v in inputs.items() if v is not None}
    with T.reference_math():
        expected = registry.lookup(spec.layer).reference(spec, x, inputs.get("w"), inputs.get("b"), inputs["dy"])
        layouts = rank_layouts(spec)
        ranks = [rank_arrays(spec, inputs, expected, lo) for lo in layouts]
    glob = {k: v for k, v in zip(("y", "dx", "dw", "db"), expected) if v is not None}
    return Case(path=f"layer {entry['name']}", spec=spec, digest="", layouts=layouts, inputs={dtype: inputs},
                expected={dtype: glob}, ranks={dtype: ranks})


def layer_level_diagnosis(ref, entry, x, dy, dtype, tensor, blocks, bad, tol, grid):
    """diagnose.py's diagnosis of the failing ranks' blocks (y, dx), on the layer as a case;
    None where the layer is no case kind, a block is not the case's, or nothing matches."""
    if entry["kind"] not in CASE_KINDS or tensor not in ("y", "dx") or (tensor == "dx" and dy is None):
        return None
    if len(grid) == 5 and grid[4] > 1 and (entry.get("x_split") or entry.get("y_split")):
        return None            # a layer the model axis splits: the layer cases here are of unsplit layers
    try:
        from . import diagnose
        case = layer_case(ref, entry, x, dy, grid, dtype)
        scale = float(numpy.max(numpy.abs(case.expected[dtype][tensor]))) or 1.0
        words = []
        for r, array, offset in blocks:
            if r not in bad or r is None or r >= len(case.layouts):
                continue
            want, want_offset = case.ranks[dtype][r][tensor]
            if list(want_offset) != list(offset) or want.shape != array.shape:
                return None
            wrong = numpy.abs(array - want) > tol * scale
            found = diagnose.rank_tensor(case, dtype, tensor, r, array, want, wrong, tol * scale)
            if found:
                words.append(found)
        return "; ".join(dict.fromkeys(words)) or None
    except (KeyError, IndexError, ValueError, TypeError, AttributeError, ArithmeticError):
        return None            # the layer-level patterns must never stop a report


def _own_input_gradient(ref, entry, x, dy, mask, grid, rank):
    """The layer's dx from rank's output block alone (no ghost gradients from the others)."""
    keep = numpy.zeros(dy.shape, dtype=bool)
    keep[T.layer_slices(entry, "y", grid, rank)] = True
    return ref.backward64(entry["name"], x, numpy.where(keep, dy, 0.0), mask)["dx"]


def _contribution(ref, entry, x, dy, mask, grid, ranks):
    """The layer's parameter gradients from the output blocks of ``ranks`` alone."""
    keep = numpy.zeros(dy.shape, dtype=bool)
    for r in ranks:
        keep[T.layer_slices(entry, "y", grid, r)] = True
    return ref.backward64(entry["name"], x, numpy.where(keep, dy, 0.0), mask)


def diagnose_update(pname, before, want, blocks, bad, tol):
    """A rank whose parameters after the update are those before it, or whose step is a
    multiple of the expected one; and the drift that follows between ranks."""
    scale = float(numpy.max(numpy.abs(want))) or 1.0
    got = {r: a for r, a, _ in blocks}
    words = []
    for r in bad:
        who = "the global update" if r is None else f"rank {r}"
        array = got[r]
        if float(numpy.max(numpy.abs(array - before))) <= 4 * tol * scale:
            words.append(f"{who} did not apply the update to {pname}: its parameters are those before the step")
            continue
        c = scalar_fit(array - before, want - before, tol * scale / (float(numpy.max(numpy.abs(want - before))) or 1))
        words.append(f"{who}'s update of {pname} is {c:.6g} × the expected step" if c is not None else
                     f"{who}'s {pname} after the update differs from the update of its gradient")
    others = [r for r in got if r is not None and r not in bad]
    if others and any(r is not None for r in bad):
        words.append("the parameters now differ between ranks: they drift apart from this step on")
    return "; ".join(words)


__all__ = ["scalar_fit", "name_factor", "diagnose_forward", "diagnose_drift", "diagnose_gradient",
           "diagnose_update", "layer_case", "layer_level_diagnosis"]
