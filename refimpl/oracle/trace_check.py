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

The results file is read by trace_results.py; the diagnoses are in trace_diagnose.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy

from . import trace as T
from .trace_diagnose import (diagnose_drift, diagnose_forward, diagnose_gradient, diagnose_update,
                             layer_level_diagnosis, name_factor, scalar_fit)
from .trace_results import Peer, load_names, load_peer

EPS = {"float64": float(numpy.finfo(numpy.float64).eps), "float32": float(numpy.finfo(numpy.float32).eps)}
SAFETY = 16               # the layer oracle's factor over eps·sqrt(K)
SPREAD_FACTOR = 16        # float32: the tolerance over the float32-vs-float64 spread of the reference


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
    if kind in ("batch_norm3d", "group_norm3d", "instance_norm3d"):
        if kind == "batch_norm3d":
            k, what = x[0] * int(numpy.prod(x[2:])), "N·D·H·W (per-channel statistics)"
        else:
            groups = x[1] if kind == "instance_norm3d" else module.num_groups
            k, what = x[1] // groups * int(numpy.prod(x[2:])), "(C/G)·D·H·W (per-sample, per-group statistics)"
        if tensor == "dx":
            # dx = (gamma/sigma)(dy - mean(dy) - xhat mean(dy xhat)) carries four sums of K terms:
            # the forward's mean and variance (through sigma and xhat) and the backward's two
            return 4 * k, f"4·{what.split(' ', 1)[0]}: the mean, the variance, sum(dy), sum(dy·xhat)"
        return k, what
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


def _whole_updates(step_peer) -> dict:
    """{rank: {parameter: array}} of the ranks' updates placed at offset 0 (diagnose_drift
    rebuilds a rank's block with those that are the whole parameter)."""
    return {r: {p: a for p, (a, offset) in arrays.items() if not any(offset)}
            for r, arrays in step_peer.get("update_ranks", {}).items()}


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
                                                   _whole_updates(peer.steps[dtype].get(s - 1, {})), s),
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
    scale = gradient_convention(trace, ref, results, step_trace, dout, layer_input, masks, loss_scale)
    if scale != 1.0:
        findings.append(Finding(dtype, s, "convention", "", "dx", "pass", note=(
            f"the input gradients carry {scale:g} × the global loss's (the data-parallel convention: each of the "
            f"{scale:g} sample groups normalises its loss by its own samples, and the parameter gradients are "
            f"averaged over the groups); judged so, with dw and db those of the global loss")))
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
        dy, dy_note = _output_gradient(entry, consumers[name], peer_dx, step_trace, dout, last, scale)
        x, note = layer_input(entry)
        note = "; ".join(n for n in (note, dy_note) if n) or None
        wants = ref.backward(entry, x, dy, masks.get(name))
        for t in wanted:
            if t not in wants:
                continue
            want, tol, why = wants[t]
            if t != "dx":
                want = want / scale            # the parameter gradients: of the global loss
            blocks = _blocks(layer_results, t)
            assembled = peer_dx.get(name) if t == "dx" else None
            traced = step_trace["tensors"][name].get(t)
            if t == "dx" and traced is not None:
                traced = traced * scale
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


def gradient_convention(trace, ref, results, step_trace, dout, layer_input, masks, loss_scale) -> float:
    """Pn where the peer's input gradients carry Pn × the global loss's, else 1.

    A data-parallel implementation normalises each sample group's loss by its own samples
    (PyTorch's DDP; refimpl hands back Pn × dL/dout for the same reason) and averages the
    parameter gradients over the Pn groups: its dx are then Pn × those of the global loss,
    with nothing wrong.  Seen on the first layer (in backward order) whose dx the peer
    reports, judged from the global loss's gradient, when the loss itself is right."""
    pn = trace.spec.grid[0]
    if pn == 1 or loss_scale is not None:
        return 1.0
    for entry in reversed(trace.layers):
        blocks = _blocks(results.get(entry["name"], {"rank": {}, "global": {}}), "dx")
        if not blocks:
            continue
        dy, _ = _output_gradient(entry, [c for c in trace.layers if entry["name"] in c["inputs"]], {},
                                 step_trace, dout, trace.layers[-1]["name"])
        x, _ = layer_input(entry)
        want, tol, _ = ref.backward(entry, x, dy, masks.get(entry["name"]))["dx"]
        got = numpy.concatenate([numpy.ravel(b) for _, b, _ in blocks])
        wanted = numpy.concatenate([numpy.ravel(want[tuple(slice(o, o + n) for o, n in zip(off, b.shape))])
                                    for _, b, off in blocks])
        factor = scalar_fit(got, wanted, tol)
        return float(pn) if factor is not None and abs(factor / pn - 1.0) < 1e-6 else 1.0
    return 1.0


def _output_gradient(entry, consumers, peer_dx, step_trace, dout, last, scale=1.0):
    """The gradient at a layer's output: d loss/d out for the last layer (from the peer's
    output), else the sum of its consumers' input gradients (the peer's where reported);
    ``scale``: the peer's gradient convention (``gradient_convention``)."""
    if entry["name"] == last:
        return dout * scale, None
    total, missing = None, []
    for consumer in consumers:
        dx = peer_dx.get(consumer["name"])
        if dx is None:
            dx = step_trace["tensors"][consumer["name"]]["dx"] * scale
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


def _never_stopping(diagnose, bad):
    """A diagnosis, or None where the blocks do not fit its rebuild (a peer's own split: the
    patterns assume the trace's grid); a diagnosis must never stop a report."""
    try:
        return diagnose(bad)
    except (KeyError, IndexError, ValueError, TypeError, ArithmeticError):
        return None


def _finding(dtype, s, phase, name, tensor, want, blocks, tol, why, note, failed, traced, assembled, diagnose,
             layer_level=None):
    worst, bad, count, first = judge(want, blocks, tol)
    f = Finding(dtype, s, phase, name, tensor, "fail" if bad else "pass", worst, tol, why, ranks=bad,
                mismatches=count, note=note)
    if bad:
        f.first_index, f.owner = first
        f.diagnosis = _never_stopping(diagnose, bad)
        if f.diagnosis is None and layer_level is not None:
            f.diagnosis = _never_stopping(layer_level, bad)
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
        traced = data["steps"][s]["tensors"][layer][t]
        if given is None:            # the ranks' gradients, whole or their shares of a split layer
            given = _assemble(traced.shape, _blocks(lr, t))
        grads[pname] = traced if given is None else given
    after = optimizers.step(before, grads)
    want_all = after["float64"]
    findings = []
    if not step_peer["update"] and not step_peer["update_ranks"]:
        return findings
    for pname, want in want_all.items():
        blocks = []
        if pname in step_peer["update"]:
            blocks.append((None, step_peer["update"][pname], [0] * want.ndim))
        blocks += [(r, *arrays[pname]) for r, arrays in sorted(step_peer["update_ranks"].items())
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
            f.diagnosis = diagnose_update(pname, before[pname], want, blocks, bad, tol)
            failed.append(f)
        findings.append(f)
    return findings


__all__ = ["Peer", "Finding", "load_peer", "load_names", "check_trace", "Reference", "SPREAD_FACTOR"]
