"""``refimpl oracle trace check``: a peer's training step judged layer by layer, on its own input.

Comparing every layer of a peer's step with the trace tells only where the difference
*shows*: after the first wrong layer every later one differs too.  So each layer is
judged **on the peer's own input**: its reference is recomputed for that layer alone
from the previous layers' outputs *as the peer reported them* (assembled from the
ranks' blocks), and its gradient from the peer's own gradient at its output.  A layer
that is wrong there is a finding of its own; a later layer that is right on its input,
whose output still differs from the trace, merely **follows** (and is listed as such).
A second, independent bug later is still a finding.  Order: the forward layers, the
loss, the backward layers in reverse, the update.

Tolerances.  float64: the layer oracle's rule, 16·eps·sqrt(K) (compare.py), K the terms
summed per output of that layer and tensor.  float32: an error analysis on the peer's
own input: the reference layer runs in float32 and in float64 on that input, and the
tolerance is ``SPREAD_FACTOR`` times the spread between the two (a correct float32
implementation differs from the float64 answer by about as much as refimpl's own
float32 one does), with 16·eps32·sqrt(K) as its floor.  The float32 verdict is
compared with the float64 answer.

Diagnoses.  First the trace's own, by rebuilding what a known mistake would produce (the
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

import math
import tomllib
from dataclasses import dataclass, field

import numpy

from . import trace as T
from .casefile import UnusableInput

EPS = {"float64": float(numpy.finfo(numpy.float64).eps), "float32": float(numpy.finfo(numpy.float32).eps)}
SAFETY = 16               # the layer oracle's factor over eps·sqrt(K)
SPREAD_FACTOR = 16        # float32: the tolerance over the float32-vs-float64 spread of the reference
TENSORS = ("y", "dx", "dw", "db")


# ---------------------------------------------------------------- the peer's results file

@dataclass
class Peer:
    """A results file: dtype -> step -> {"layers": {layer: {"rank": {r: {t: (array, offset)}},
    "global": {t: array}}}, "loss", "update", "update_ranks"}; ``shape_errors`` lists blocks
    that cannot be placed (findings, not unusable input)."""
    path: str
    steps: dict = field(default_factory=dict)
    shape_errors: list = field(default_factory=list)


def load_names(path: str | None, trace: T.Trace) -> dict:
    """``--names FILE``: TOML ``peer_name = "canonical.name"`` (a layer or a parameter)."""
    if path is None:
        return {}
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except OSError as err:
        raise ValueError(f"--names {path}: cannot read it ({err.strerror})") from None
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"--names {path}: not valid TOML ({err})") from None
    known = {e["name"] for e in trace.layers} | set(trace.param_names)
    for peer, canonical in table.items():
        if not isinstance(canonical, str) or canonical not in known:
            raise ValueError(f"--names {path}: {peer!r} maps to {canonical!r}, which is no layer or parameter "
                             f"of the trace (layers: {', '.join(e['name'] for e in trace.layers)})")
    return table


def load_peer(path: str, trace: T.Trace, names: dict | None = None) -> Peer:
    """Read and validate a results file against ``trace`` (UnusableInput: exit 2)."""
    import h5py

    from ..data.reader import check_stored
    from .casefile import _open
    names, what = names or {}, "results file"
    layers = {e["name"]: e for e in trace.layers}
    param_shapes = {n: a.shape for n, a in next(iter(trace.data.values()))["initial"].items()}
    peer = Peer(path)

    def bad(where, message):
        raise UnusableInput(f"{what} {path}: /{where}: {message}")

    def read(dataset, where, dtype, ndim, limit=None):
        """The dataset's array once its metadata holds: a dataset, ``dtype``, ``ndim`` axes, no
        axis longer than ``limit`` (the global tensor's), and the bytes it declares stored."""
        if not isinstance(dataset, h5py.Dataset):
            bad(where, "must be a dataset")
        if dataset.dtype != numpy.dtype(dtype):
            bad(where, f"dtype {dataset.dtype}, expected {dtype}")
        if len(dataset.shape) != ndim:
            bad(where, f"{len(dataset.shape)} dimensions, expected {ndim}")
        if limit is not None and any(n > m for n, m in zip(dataset.shape, limit)):
            bad(where, f"shape {dataset.shape} is larger than the whole tensor {tuple(limit)}")
        try:
            check_stored(dataset, path)
            return dataset[()]
        except (ValueError, OSError) as err:
            raise UnusableInput(f"{what} {err}") from None

    def offset(dataset, where, ndim):
        if "offset" not in dataset.attrs:
            return None
        value = numpy.asarray(dataset.attrs["offset"])
        if value.shape != (ndim,) or not numpy.issubdtype(value.dtype, numpy.integer) or (value < 0).any():
            bad(where, f"attribute 'offset' must be {ndim} non-negative integers (the global index of the "
                       f"block's first element), got {value.tolist()}")
        return [int(v) for v in value]

    h5 = _open(path, what)
    with h5:
        got = h5.attrs.get("trace_digest")
        if got is None:
            raise UnusableInput(f"{what} {path}: no root attribute 'trace_digest' (copy the trace file's "
                                f"'digest' attribute, {trace.digest!r})")
        if got != trace.digest:
            raise UnusableInput(f"{what} {path}: made for trace digest {got!r}, but {trace.path} has digest "
                                f"{trace.digest!r} (another trace): rerun your implementation on this trace")
        for dtype in h5:
            if dtype not in trace.spec.dtypes:
                bad(dtype, f"unknown group (the trace has dtypes {', '.join(trace.spec.dtypes)})")
            for key in h5[dtype]:
                if key != "step":
                    bad(f"{dtype}/{key}", "unknown group (expected 'step')")
            steps = h5[dtype].get("step", {})
            for s_key in steps:
                if not s_key.isdigit() or int(s_key) >= trace.spec.steps:
                    bad(f"{dtype}/step/{s_key}", f"no such step (the trace has steps 0..{trace.spec.steps - 1})")
                s, group = int(s_key), steps[s_key]
                entry = peer.steps.setdefault(dtype, {}).setdefault(
                    s, {"layers": {}, "loss": None, "update": {}, "update_ranks": {}})
                for key in group:
                    where = f"{dtype}/step/{s}/{key}"
                    if key == "loss":
                        entry["loss"] = float(read(group[key], where, dtype, 0))
                    elif key == "update":
                        for pkey in group[key]:
                            if pkey == "rank":
                                for r_key in group[key]["rank"]:
                                    if not r_key.isdigit():
                                        bad(f"{where}/rank/{r_key}", "rank must be a non-negative integer")
                                    for pk in group[key]["rank"][r_key]:
                                        pname = _param_name(pk, names, param_shapes, f"{where}/rank/{r_key}/{pk}", bad)
                                        entry["update_ranks"].setdefault(int(r_key), {})[pname] = \
                                            _whole(read(group[key]["rank"][r_key][pk], f"{where}/rank/{r_key}/{pk}",
                                                        dtype, len(param_shapes[pname]), param_shapes[pname]),
                                                   param_shapes[pname],
                                                   f"{where}/rank/{r_key}/{pk}", bad)
                                continue
                            pname = _param_name(pkey, names, param_shapes, f"{where}/{pkey}", bad)
                            entry["update"][pname] = _whole(read(group[key][pkey], f"{where}/{pkey}", dtype,
                                                                 len(param_shapes[pname]), param_shapes[pname]),
                                                            param_shapes[pname],
                                                            f"{where}/{pkey}", bad)
                    else:
                        layer = names.get(key, key)
                        if layer not in layers:
                            bad(where, f"unknown layer (give --names for your own names; the trace's layers: "
                                       f"{', '.join(layers)})")
                        _read_layer(group[key], where, layers[layer], trace, dtype, s, param_shapes,
                                    entry["layers"].setdefault(layer, {"rank": {}, "global": {}}), peer,
                                    read, offset, bad)
    return peer


def _param_name(key, names, param_shapes, where, bad):
    name = names.get(key, key)
    if name not in param_shapes:
        bad(where, f"unknown parameter (the trace's: {', '.join(param_shapes)})")
    return name


def _whole(array, shape, where, bad):
    if tuple(array.shape) != tuple(shape):
        bad(where, f"shape {tuple(array.shape)}, the parameter has {tuple(shape)}")
    return array


def _read_layer(group, where, entry, trace, dtype, step, param_shapes, out, peer, read, offset, bad):
    """One layer's rank blocks and global tensors, each placed (or a shape finding)."""
    allowed = ["y", "dx"] + list(entry["params"])
    shapes = {"y": entry["y_shape"], "dx": entry["x_shape"],
              **{t: param_shapes[p] for t, p in entry["params"].items()}}
    for key in group:
        if key == "global":
            for t in group[key]:
                if t not in allowed:
                    bad(f"{where}/global/{t}", f"unknown tensor (this layer has: {', '.join(allowed)})")
                out["global"][t] = read(group[key][t], f"{where}/global/{t}", dtype, len(shapes[t]), shapes[t])
                if tuple(out["global"][t].shape) != tuple(shapes[t]):
                    peer.shape_errors.append((dtype, step, entry["name"], t, None,
                                              f"global {t} has shape {tuple(out['global'][t].shape)}, the layer "
                                              f"has {tuple(shapes[t])}"))
                    del out["global"][t]
        elif key == "rank":
            for r_key in group[key]:
                if not r_key.isdigit():
                    bad(f"{where}/rank/{r_key}", "rank must be a non-negative integer")
                r = int(r_key)
                for t in group[key][r_key]:
                    w = f"{where}/rank/{r}/{t}"
                    if t not in allowed:
                        bad(w, f"unknown tensor (this layer has: {', '.join(allowed)})")
                    dataset = group[key][r_key][t]
                    ndim = len(shapes[t])
                    start = offset(dataset, w, ndim) if isinstance(dataset, _h5dataset()) else None
                    array = read(dataset, w, dtype, ndim, shapes[t])
                    if start is None:
                        if t in ("dw", "db"):
                            start = [0] * ndim
                        elif r >= trace.spec.ranks:
                            bad(w, f"no 'offset' attribute, and the trace's grid has no rank {r} to place it by "
                                   f"(ranks 0..{trace.spec.ranks - 1})")
                        else:
                            start = [s.start for s in T.rank_slices(shapes[t], trace.spec.grid, r)]
                    problem = _placement(array.shape, start, shapes[t], t, r)
                    if problem:
                        peer.shape_errors.append((dtype, step, entry["name"], t, r, problem))
                        continue
                    out["rank"].setdefault(r, {})[t] = (array, start)
        else:
            bad(f"{where}/{key}", "unknown group (expected 'rank' or 'global')")


def _h5dataset():
    import h5py
    return h5py.Dataset


def _placement(shape, start, global_shape, tensor, rank):
    for axis, (a, n, total) in enumerate(zip(start, shape, global_shape)):
        if a + n > total:
            return (f"rank {rank}'s {tensor} has {n} elements along axis {axis} at offset {a}, "
                    f"the layer has {total - min(a, total)} there (global extent {total})")
    return None


# ---------------------------------------------------------------- the reference of one layer, with its tolerance

def reduction_terms(entry: dict, tensor: str, module) -> tuple[int, str]:
    """K (the terms summed per element) of ``tensor`` of a layer, and what they are."""
    kind, x, y = entry["kind"], entry["x_shape"], entry["y_shape"]
    if kind in ("conv3d", "conv_transpose3d"):
        k = int(numpy.prod(module.kernel_size))
        if tensor == "y":
            return x[1] * k, "C·kd·kh·kw terms per output"
        if tensor == "dx":
            return y[1] * k, "F·kd·kh·kw terms per input"
        vol = x if (kind == "conv_transpose3d" and tensor == "dw") else y
        return vol[0] * int(numpy.prod(vol[2:])), "N·(volume) terms per weight"
    if kind == "batch_norm3d":
        return x[0] * int(numpy.prod(x[2:])), "N·D·H·W (per-channel statistics)"
    if kind in ("linear", "flatten_linear"):
        if tensor == "y":
            return int(numpy.prod(x[1:])), "input features per output"
        if tensor == "dx":
            return y[1], "output features per input"
        return x[0], "N samples per weight"
    if kind == "avg_pool3d" and tensor == "y":
        return int(numpy.prod(module.kernel_size)), "kd·kh·kw terms per output"
    return 1, "elementwise"


def max_rel(got, want) -> float:
    scale = float(numpy.max(numpy.abs(want))) if want.size else 0.0
    if not got.size:
        return 0.0
    err = numpy.abs(numpy.asarray(got, dtype=numpy.float64) - want)
    if not numpy.isfinite(err).all():
        return math.inf
    return float(err.max()) / (scale or 1.0)


class Reference:
    """refimpl's layers of the trace's model in one dtype (and in float64 for a float32
    trace's error analysis), parameters set per step."""

    def __init__(self, trace: T.Trace, dtype: str):
        self.dtype = dtype
        self.model = T.build_reference(trace.spec, dtype=dtype)
        self.layers = {l.name: l for l in T.model_layers(trace.spec.model, self.model)}
        self.model64 = self.model if dtype == "float64" else T.build_reference(trace.spec, dtype="float64")
        self.layers64 = self.layers if dtype == "float64" else \
            {l.name: l for l in T.model_layers(trace.spec.model, self.model64)}

    def set_params(self, params: dict) -> None:
        T.load_parameters(self.model, params)
        if self.model64 is not self.model:
            T.load_parameters(self.model64, {n: numpy.asarray(a, dtype=self.dtype) for n, a in params.items()})

    def tolerance(self, entry, tensor, spread=None) -> tuple[float, str]:
        k, what = reduction_terms(entry, tensor, self.layers[entry["name"]].module)
        floor = SAFETY * EPS[self.dtype] * math.sqrt(k)
        why = f"{self.dtype}: {SAFETY}·eps·sqrt(K), K = {k} ({what})"
        if spread is None or SPREAD_FACTOR * spread <= floor:
            return floor, why + ("" if spread is None else f"; float32 vs float64 spread {spread:.1e} on this input")
        return SPREAD_FACTOR * spread, (f"{self.dtype}: {SPREAD_FACTOR}× the spread {spread:.1e} of the reference "
                                        f"in float32 vs float64 on this input (floor {floor:.1e}: {SAFETY}·eps·sqrt(K), "
                                        f"K = {k})")

    def forward64(self, name, x, mask):
        return T.forward(self.layers64[name], numpy.asarray(x, dtype=numpy.float64), mask)

    def forward(self, entry, x, mask):
        """(y in float64, tolerance, why) of the layer on input x."""
        want = self.forward64(entry["name"], x, mask)
        spread = None
        if self.dtype == "float32":
            spread = max_rel(T.forward(self.layers[entry["name"]], numpy.asarray(x, dtype=numpy.float32), mask), want)
        return (want,) + self.tolerance(entry, "y", spread)

    def backward64(self, name, x, dy, mask):
        dx, grads = T.backward(self.layers64[name], numpy.asarray(x, dtype=numpy.float64),
                               numpy.asarray(dy, dtype=numpy.float64), mask)
        return {"dx": dx, **grads}

    def backward(self, entry, x, dy, mask):
        """{tensor: (want in float64, tolerance, why)} of the layer's backward."""
        want = self.backward64(entry["name"], x, dy, mask)
        low = None
        if self.dtype == "float32":
            dx, grads = T.backward(self.layers[entry["name"]], numpy.asarray(x, dtype=numpy.float32),
                                   numpy.asarray(dy, dtype=numpy.float32), mask)
            low = {"dx": dx, **grads}
        return {t: (w,) + self.tolerance(entry, t, None if low is None else max_rel(low[t], w))
                for t, w in want.items() if w is not None}


# ---------------------------------------------------------------- findings

@dataclass
class Finding:
    dtype: str
    step: int
    phase: str                    # forward | loss | backward | update
    layer: str                    # a layer, "loss", or a parameter name (update)
    tensor: str
    status: str                   # fail | follows | pass
    max_rel: float | None = None
    tolerance: float | None = None
    why: str = ""
    ranks: list = field(default_factory=list)        # the failing ranks (None: the global tensor)
    mismatches: int = 0
    first_index: list | None = None
    owner: int | None = None
    diagnosis: str | None = None
    note: str | None = None
    scale: float | None = None    # got ≈ scale × want, when the error is one factor
    drift: float | None = None    # follows: how far the peer's tensor is from the trace's

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    @property
    def where(self) -> str:
        ranks = "global" if self.ranks == [None] else \
            ", ".join("global" if r is None else f"rank {r}" for r in self.ranks) or "all"
        return f"{self.dtype} step {self.step} {self.phase} {self.layer} {self.tensor} ({ranks})"


def judge(want, blocks, tol):
    """Compare blocks [(rank, array, offset)] with ``want``: (max_rel, failing ranks,
    mismatches, first wrong global index, its rank), errors relative to max|want|."""
    scale = float(numpy.max(numpy.abs(want))) if want.size else 0.0
    scale = scale or 1.0
    worst, bad, count, first = 0.0, [], 0, None
    for rank, array, offset in blocks:
        sl = tuple(slice(a, a + n) for a, n in zip(offset, array.shape))
        err = numpy.abs(numpy.asarray(array, dtype=numpy.float64) - want[sl]) / scale
        err[~numpy.isfinite(err)] = numpy.inf
        if err.size:
            worst = max(worst, float(err.max()))
        wrong = err > tol
        if wrong.any():
            bad.append(rank)
            count += int(wrong.sum())
            index = [int(i) + a for i, a in zip(numpy.argwhere(wrong)[0], offset)]
            if first is None or index < first[0]:
                first = (index, rank)
    return worst, bad, count, first


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
    pn, ps = grid[0], int(numpy.prod(grid[1:]))
    out = []
    for k, what in ((pn * ps, "the P ranks of the whole grid"), (ps, "the spatial group's ranks"),
                    (pn, "the data group's ranks")):
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


def check_trace(trace: T.Trace, peer: Peer) -> list[Finding]:
    """Every finding (passing tensors included), in the order: per dtype and step, the
    forward layers, the loss, the backward layers in reverse, the update."""
    findings = []
    for dtype in [d for d in trace.spec.dtypes if d in peer.steps]:
        steps = peer.steps[dtype]
        ref = Reference(trace, dtype)
        optimizers = _Optimizers(trace, dtype)
        for s in sorted(steps):
            findings += _check_step(trace, peer, ref, optimizers, dtype, s)
    _drift_follows(findings)
    for dtype, s, layer, t, r, message in peer.shape_errors:
        findings.append(Finding(dtype, s, "forward" if t == "y" else "backward", layer, t, "fail",
                                ranks=[r], diagnosis=message, note="shape"))
    return findings


def _drift_follows(findings) -> None:
    """After a rank's update went wrong, its parameters differ from the others' in every later
    step: its later updates of them, and its blocks computed with them, follow from the first."""
    first = {}
    for f in findings:
        if f.phase != "update" or f.status != "fail":
            continue
        for r in f.ranks:
            key = (f.dtype, f.layer, r)
            if key in first and first[key].step < f.step:
                f.status, f.note = "follows", f"follows from the update of {f.layer} at step {first[key].step}"
            else:
                first.setdefault(key, f)
    for f in findings:
        if f.status == "fail" and f.phase == "forward" and f.diagnosis and "drifted between ranks" in f.diagnosis:
            earlier = [g for (d, _, r), g in first.items() if d == f.dtype and r in f.ranks and g.step < f.step]
            if earlier:
                f.status = "follows"
                f.note = f"follows from the update of {earlier[0].layer} at step {earlier[0].step} (drift)"


def _params_before(trace, peer, dtype, s):
    """The parameters step s starts from: the peer's update of step s-1 where it reported it
    (judged on its own), else the trace's."""
    data = trace.data[dtype]
    if s == 0:
        return dict(data["initial"])
    mine = peer.steps.get(dtype, {}).get(s - 1, {}).get("update", {})
    return {n: mine.get(n, a) for n, a in data["steps"][s - 1]["update"].items()}


def _assemble(shape, blocks):
    """The global tensor from rank blocks (the first rank wins where they overlap), or None
    when they do not cover it."""
    out, covered = numpy.zeros(shape), numpy.zeros(shape, dtype=bool)
    for _, array, offset in blocks:
        sl = tuple(slice(a, a + n) for a, n in zip(offset, array.shape))
        fresh = ~covered[sl]
        out[sl][fresh] = numpy.asarray(array, dtype=numpy.float64)[fresh]
        covered[sl] = True
    return out if covered.all() else None


def _blocks(layer_results, tensor):
    out = [(r, arrays[tensor][0], arrays[tensor][1]) for r, arrays in sorted(layer_results["rank"].items())
           if tensor in arrays]
    if tensor in layer_results["global"]:
        array = layer_results["global"][tensor]
        out.append((None, array, [0] * array.ndim))
    return out


def _check_step(trace, peer, ref, optimizers, dtype, s):
    spec, data = trace.spec, trace.data[dtype]
    step_trace, step_peer = data["steps"][s], peer.steps[dtype][s]
    results = step_peer["layers"]
    ref.set_params(_params_before(trace, peer, dtype, s))
    masks = step_trace["masks"]
    findings, failed = [], []
    peer_y, notes = {}, {}

    def layer_input(entry):
        parts, missing = [], []
        for source in entry["inputs"]:
            if source == "input":
                parts.append(data["x"])
            elif peer_y.get(source) is not None:
                parts.append(peer_y[source])
            else:
                parts.append(step_trace["tensors"][source]["y"])
                missing.append(source)
        x = parts[0] if len(parts) == 1 else numpy.concatenate(parts, axis=1)
        note = f"input from the trace ({', '.join(missing)} not fully reported)" if missing else None
        return numpy.asarray(x, dtype=numpy.float64), note

    # ---- forward, in order
    for entry in trace.layers:
        name = entry["name"]
        x, notes[name] = layer_input(entry)
        blocks = _blocks(results.get(name, {"rank": {}, "global": {}}), "y")
        if not blocks:
            continue
        want, tol, why = ref.forward(entry, x, masks.get(name))
        peer_y[name] = _assemble(tuple(entry["y_shape"]), blocks)
        findings.append(_finding(dtype, s, "forward", name, "y", want, blocks, tol, why, notes[name], failed,
                                 step_trace["tensors"][name]["y"], peer_y[name],
                                 lambda bad: diagnose_forward(ref, entry, x, masks.get(name), want, blocks, bad,
                                                              tol, spec.grid)
                                 or diagnose_drift(ref, entry, x, masks.get(name), blocks, bad, tol, want,
                                                   peer.steps[dtype].get(s - 1, {}).get("update_ranks", {}), s),
                                 lambda bad: layer_level_diagnosis(ref, entry, x, None, dtype, "y", blocks, bad, tol,
                                                                   spec.grid)))

    # ---- the loss, on the peer's output
    last = trace.layers[-1]["name"]
    out = peer_y.get(last)
    out = step_trace["tensors"][last]["y"] if out is None else out
    target = data["target"]
    loss64, dout, _ = ref.model64.loss(numpy.asarray(out, dtype=numpy.float64),
                                       target if spec.model == "unet3d" else numpy.asarray(target, numpy.float64))
    loss_scale = None
    if step_peer["loss"] is not None:
        tol, why = SAFETY * EPS[dtype] * math.sqrt(out.size), f"{dtype}: {SAFETY}·eps·sqrt(K), K = {out.size} (loss terms)"
        if dtype == "float32":
            loss32 = ref.model.loss(numpy.asarray(out, dtype=numpy.float32), target if spec.model == "unet3d"
                                    else numpy.asarray(target, numpy.float32))[0]
            spread = abs(loss32 - loss64) / (abs(loss64) or 1.0)
            if SPREAD_FACTOR * spread > tol:
                tol, why = SPREAD_FACTOR * spread, f"float32: {SPREAD_FACTOR}× the float32 vs float64 spread {spread:.1e}"
        rel = abs(step_peer["loss"] - loss64) / (abs(loss64) or 1.0)
        f = Finding(dtype, s, "loss", "loss", "loss", "pass" if rel <= tol else "fail", rel, tol, why, ranks=[None])
        if f.status == "fail":
            loss_scale = step_peer["loss"] / loss64 if loss64 else None
            f.scale = loss_scale
            if loss_scale:
                f.diagnosis = (f"the loss is {name_factor(loss_scale, spec.grid)}: normalised by the wrong count "
                               "(every gradient scales with it)")
            failed.append(f)
        findings.append(f)

    # ---- backward, in reverse
    consumers = {e["name"]: [c for c in trace.layers if e["name"] in c["inputs"]] for e in trace.layers}
    peer_dx = {}
    for entry in reversed(trace.layers):
        name = entry["name"]
        layer_results = results.get(name, {"rank": {}, "global": {}})
        wanted = [t for t in ("dx", "dw", "db") if _blocks(layer_results, t)]
        dx_blocks = _blocks(layer_results, "dx")
        if dx_blocks:
            peer_dx[name] = _assemble(tuple(entry["x_shape"]), dx_blocks)
        if not wanted:
            continue
        dy, dy_note = _output_gradient(entry, consumers[name], peer_dx, step_trace, dout, last)
        x, note = layer_input(entry)
        note = "; ".join(n for n in (note, dy_note) if n) or None
        wants = ref.backward(entry, x, dy, masks.get(name))
        for t in wanted:
            if t not in wants:
                continue
            want, tol, why = wants[t]
            blocks = _blocks(layer_results, t)
            assembled = peer_dx.get(name) if t == "dx" else None
            traced = step_trace["tensors"][name].get(t)
            f = _finding(dtype, s, "backward", name, t, want, blocks, tol, why, note, failed, traced, assembled,
                         lambda bad, t=t, want=want, tol=tol, blocks=blocks:
                         diagnose_gradient(ref, entry, t, x, dy, masks.get(name), want, blocks, bad, tol, spec.grid),
                         lambda bad, t=t, tol=tol, blocks=blocks:
                         layer_level_diagnosis(ref, entry, x, dy, dtype, t, blocks, bad, tol, spec.grid))
            if f.status == "fail" and loss_scale and f.scale and abs(f.scale / loss_scale - 1) < 1e-6:
                f.status, f.note = "follows", f"follows from the loss, scaled by the same {loss_scale:.6g}"
                failed.remove(f)
            elif f.status == "fail" and any(g.layer == name and g.phase == "forward" for g in failed if g is not f):
                f.status = "follows"         # the derivative of the layer's own wrong forward
                f.note = f"follows from {name} y (forward): the backward of its wrong forward"
                failed.remove(f)
            findings.append(f)

    # ---- the update, from the peer's own gradients
    findings += _check_update(trace, peer, optimizers, dtype, s, failed)
    return findings


def _output_gradient(entry, consumers, peer_dx, step_trace, dout, last):
    """The gradient at a layer's output: d loss/d out for the last layer (from the peer's
    output), else the sum of its consumers' input gradients (the peer's where reported)."""
    if entry["name"] == last:
        return dout, None
    total, missing = None, []
    for consumer in consumers:
        dx = peer_dx.get(consumer["name"])
        if dx is None:
            dx = step_trace["tensors"][consumer["name"]]["dx"]
            missing.append(consumer["name"])
        start = 0
        for source in consumer["inputs"]:
            width = entry["y_shape"][1] if source == entry["name"] else None
            if source == entry["name"]:
                part = numpy.asarray(dx[:, start:start + width], dtype=numpy.float64)
                total = part.copy() if total is None else total + part
                break
            start += step_trace["tensors"][source]["y"].shape[1] if source != "input" else 0
    note = f"output gradient from the trace ({', '.join(missing)} dx not fully reported)" if missing else None
    return total, note


def _finding(dtype, s, phase, name, tensor, want, blocks, tol, why, note, failed, traced, assembled, diagnose,
             layer_level=None):
    worst, bad, count, first = judge(want, blocks, tol)
    f = Finding(dtype, s, phase, name, tensor, "fail" if bad else "pass", worst, tol, why, ranks=bad,
                mismatches=count, note=note)
    if bad:
        f.first_index, f.owner = first
        f.diagnosis = diagnose(bad)
        if f.diagnosis is None and layer_level is not None:
            f.diagnosis = layer_level(bad)
        whole = [b for b in blocks if b[0] in bad]
        f.scale = scalar_fit(numpy.concatenate([numpy.ravel(b[1]) for b in whole]),
                             numpy.concatenate([numpy.ravel(want[tuple(slice(a, a + n) for a, n in
                                                                         zip(b[2], b[1].shape))]) for b in whole]),
                             tol)
        failed.append(f)
    elif failed and traced is not None and assembled is not None:
        drift = max_rel(assembled, numpy.asarray(traced, dtype=numpy.float64))
        if drift > max(tol, 1e-3 if dtype == "float32" else tol):
            f.status, f.drift = "follows", drift
            f.note = "follows from the loss" if failed[0].phase == "loss" else \
                f"follows from {failed[0].layer} {failed[0].tensor} ({failed[0].phase})"
    return f


# ---------------------------------------------------------------- diagnoses

def diagnose_forward(ref, entry, x, mask, want, blocks, bad, tol, grid):
    """What a known mistake in the failing ranks' blocks of y rebuilds, in words, or None."""
    if entry["kind"] not in T.WINDOW_KINDS + ("batch_norm3d",) or len(entry["y_shape"]) != 5:
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

        in_sl = T.rank_slices(tuple(x.shape), grid, r)
        if entry["kind"] == "batch_norm3d":
            if same(ref.forward64(entry["name"], x[in_sl], mask)):
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
        group = "the data group" if all(p == 1 for p in grid[1:]) else "the spatial group" if grid[0] == 1 \
            else "the spatial and data groups"
        return (f"batch-norm statistics of each failing rank's own block (rank(s) {', '.join(map(str, matched))}): "
                f"not reduced over {group}")
    def only_own_block(r):
        """Rank r's block of y computed from its own input block alone (zeros beyond every face)."""
        in_sl = T.rank_slices(tuple(x.shape), grid, r)
        out_sl = T.rank_slices(tuple(want.shape), grid, r)
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
            if r not in bad or not all(p in own for p in entry["params"].values()):
                continue
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
    return (f"rank(s) {', '.join(map(str, drifted))} computed their block with their own parameters of "
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


CASE_KINDS = ("conv3d", "conv_transpose3d", "max_pool3d", "avg_pool3d", "batch_norm3d")


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
    keep[T.rank_slices(dy.shape, grid, rank)] = True
    return ref.backward64(entry["name"], x, numpy.where(keep, dy, 0.0), mask)["dx"]


def _contribution(ref, entry, x, dy, mask, grid, ranks):
    """The layer's parameter gradients from the output blocks of ``ranks`` alone."""
    keep = numpy.zeros(dy.shape, dtype=bool)
    for r in ranks:
        keep[T.rank_slices(dy.shape, grid, r)] = True
    return ref.backward64(entry["name"], x, numpy.where(keep, dy, 0.0), mask)


# ---------------------------------------------------------------- the update

class _Optimizers:
    """The reference optimizer (its state carried over the steps) in the trace's dtype and in
    float64 (float32's error analysis), fed with the peer's gradients."""

    def __init__(self, trace, dtype):
        from ..nn.parameter import Parameter
        initial = trace.data[dtype]["initial"]
        self.params = {d: [Parameter(numpy.array(a, dtype=d), n) for n, a in initial.items()]
                       for d in {dtype, "float64"}}
        self.opt = {d: T.make_optimizer(trace.spec.optimizer, ps) for d, ps in self.params.items()}

    def step(self, before, grads):
        out = {}
        for d, params in self.params.items():
            for p in params:
                p.data[...] = before[p.name]
                p.grad = numpy.asarray(grads[p.name], dtype=d)
            self.opt[d].step()
            out[d] = {p.name: p.data.copy() for p in params}
        return out


def _check_update(trace, peer, optimizers, dtype, s, failed):
    step_peer, data = peer.steps[dtype][s], trace.data[dtype]
    before = _params_before(trace, peer, dtype, s)
    grads = {}
    layer_of = {p: (e["name"], t) for e in trace.layers for t, p in e["params"].items()}
    for pname in before:
        layer, t = layer_of[pname]
        lr = step_peer["layers"].get(layer, {"rank": {}, "global": {}})
        given = lr["global"].get(t)
        if given is None:
            ranks = sorted(r for r, a in lr["rank"].items() if t in a)
            given = lr["rank"][ranks[0]][t][0] if ranks else None
        grads[pname] = data["steps"][s]["tensors"][layer][t] if given is None else given
    after = optimizers.step(before, grads)
    want_all = after["float64"]
    findings = []
    if not step_peer["update"] and not step_peer["update_ranks"]:
        return findings
    for pname, want in want_all.items():
        blocks = []
        if pname in step_peer["update"]:
            blocks.append((None, step_peer["update"][pname], [0] * want.ndim))
        blocks += [(r, arrays[pname], [0] * want.ndim) for r, arrays in sorted(step_peer["update_ranks"].items())
                   if pname in arrays]
        if not blocks:
            continue
        tol = SAFETY * EPS[dtype]
        why = f"{dtype}: {SAFETY}·eps (an elementwise update)"
        if dtype == "float32":
            spread = max_rel(after["float32"][pname], want)
            if SPREAD_FACTOR * spread > tol:
                tol, why = SPREAD_FACTOR * spread, f"float32: {SPREAD_FACTOR}× the float32 vs float64 spread {spread:.1e}"
        worst, bad, count, first = judge(want, blocks, tol)
        f = Finding(dtype, s, "update", pname, "update", "fail" if bad else "pass", worst, tol, why, ranks=bad,
                    mismatches=count)
        if bad:
            f.first_index, f.owner = first
            f.diagnosis = _diagnose_update(pname, before[pname], want, blocks, bad, tol)
            failed.append(f)
        findings.append(f)
    return findings


def _diagnose_update(pname, before, want, blocks, bad, tol):
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


__all__ = ["Peer", "Finding", "load_peer", "load_names", "check_trace", "Reference", "SPREAD_FACTOR"]
