"""Compare an implementation's results with a case, tensor by tensor and rank by rank.

Error measure.  ``max_rel = max|got - want| / max|want|``, the largest error relative to
the tensor's largest magnitude (over all ranks for a per-rank tensor, so a rank whose
block happens to be small is held to the same absolute standard).  Elementwise relative
error would fail on sums that cancel to near zero, where no summation order is
privileged.

Tolerance and why.  Every output element is a sum of ``K`` products (the op's reduction
length: C·kd·kh·kw for a conv's y, the batch·output volume for dw, ...).  Computed in a
different order, such a sum differs by about ``eps·sqrt(K)`` of its terms' magnitude
(random rounding errors add like a random walk); we allow ``SAFETY`` times that,

    tolerance = SAFETY · eps(dtype) · sqrt(K)       (SAFETY = 16; exact copies: K = 1)

with eps = 2^-52 (float64) or 2^-23 (float32).  PyTorch CPU's float32 errors on the
``hard`` suite stay below a tenth of it (docs/oracle.md).  An implementation with
inexact algorithms (Winograd, FFT) needs ``--tolerance-factor``.

A failing (tensor, rank) gets the first mismatching global index (row-major), the rank
that owns it, and a diagnosis from ``diagnose.py`` where the error pattern matches a
known mistake.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy

from .. import functional as F, layers
from . import casefile, diagnose, expect
from .casefile import Case, Results

SAFETY = 16.0
EPS = {"float64": 2.0 ** -52, "float32": 2.0 ** -23}


def reduction_length(case: Case, tensor: str) -> tuple[int, str]:
    """(K, what K counts) for one tensor of the case's layer (refimpl/layers: ``reduction_length``)."""
    if tensor in ("x_needed",):
        return 1, "an exact copy"
    out = case.expected[case.spec.dtypes[0]]["y"].shape
    return layers.lookup(case.spec.layer).reduction_length(case.spec, tensor, out)


def tolerance(case: Case, dtype: str, tensor: str, factor: float = 1.0) -> tuple[float, str]:
    k, what = reduction_length(case, tensor)
    tol = factor * SAFETY * EPS[dtype] * math.sqrt(k)
    why = f"{dtype}: {SAFETY:g}·eps·sqrt(K), K = {k} ({what})"
    if factor != 1.0:
        why += f", × {factor:g} (--tolerance-factor)"
    return tol, why


@dataclass
class Finding:
    """The comparison of one tensor (global, or one rank's block) in one dtype.

    ``max_abs``/``max_rel`` are inf where ``nonfinite`` (NaN/inf values where the expectation
    differs, each one a mismatch) is not 0; ``finite_max_rel`` is over the finite errors.  A block whose shape cannot be placed
    has ``problem`` "shape", its ``message``, and None for the error measures."""
    dtype: str
    tensor: str
    rank: int | None            # None: the global tensor; else the results' rank number
    max_abs: float | None
    max_rel: float | None
    tolerance: float
    why: str
    ok: bool
    mismatches: int = 0
    first_index: tuple | None = None     # global index of the first mismatch
    owner: int | None = None             # the rank that owns it (in the results' layout)
    diagnosis: str | None = None
    nonfinite: int = 0
    problem: str | None = None           # "shape": the block cannot be placed (see message)
    message: str | None = None
    offset: tuple | None = None          # where the block was placed (global index of its first element)
    shape: tuple | None = None
    finite_max_rel: float | None = None  # max_rel over the finite errors (max_rel is inf where NaN/inf are)

    @property
    def status(self) -> str:
        return "pass" if self.ok else "fail"

    def as_dict(self) -> dict:
        out = {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}
        for k in ("max_abs", "max_rel"):        # strict JSON has no inf: "inf" (a NaN/inf mismatch)
            if isinstance(out[k], float) and not math.isfinite(out[k]):
                out[k] = str(out[k])
        out["status"] = self.status
        return out


@dataclass
class CaseReport:
    """One case's verdict.  ``status``: pass, fail (a mismatch, or a piece ``--require``
    asks for is missing), not run (no results), unusable (``error``)."""
    case: str
    findings: list = field(default_factory=list)
    not_provided: list = field(default_factory=list)   # {"dtype", "tensor", "covered", "total"}
    missing: list = field(default_factory=list)        # the not_provided entries --require asks for
    unchecked: list = field(default_factory=list)      # {"dtype", "tensor", "rank", "why"}
    incomplete: list = field(default_factory=list)     # {"dtype", "tensor", "ranks"}: absent on those ranks
    first_wrong: list = field(default_factory=list)    # {"dtype", "tensor", "index", "ranks"}: over all ranks
    layout: str = "case"                               # "case", or "results": the results' own split
    layout_note: str | None = None
    error: str | None = None                           # unusable: why
    run: bool = True

    @property
    def ok(self) -> bool:
        return (self.error is None and not self.missing and not self.incomplete
                and all(f.ok for f in self.findings))

    @property
    def status(self) -> str:
        """pass; fail (a mismatch, or a missing piece --require asks for); incomplete (no
        mismatch, but a tensor some ranks hold is absent on others: a rank that crashed);
        not run; unusable."""
        if self.error is not None:
            return "unusable"
        if not self.run:
            return "fail" if self.missing else "not run"
        if self.ok:
            return "pass"
        return "incomplete" if self.incomplete and not self.missing and all(f.ok for f in self.findings) \
            else "fail"

    def as_dict(self) -> dict:
        return {"case": self.case, "ok": self.ok, "status": self.status,
                "findings": [f.as_dict() for f in self.findings], "not_provided": self.not_provided,
                "missing": self.missing, "unchecked": self.unchecked, "incomplete": self.incomplete,
                "first_wrong": self.first_wrong, "layout": self.layout,
                "layout_note": self.layout_note, "error": self.error}


def _errors(got, want):
    """|got - want| with equal entries (two -inf windows of max pooling) counting as 0; NaN
    where got is NaN, inf where one side is infinite and the other is not."""
    got = numpy.asarray(got, dtype=numpy.float64)
    want = numpy.asarray(want, dtype=numpy.float64)
    with numpy.errstate(invalid="ignore"):
        return numpy.where(got == want, 0.0, numpy.abs(got - want))


def _scale(arrays) -> float:
    values = [numpy.abs(a[numpy.isfinite(a)]).max() for a in arrays if a.size and numpy.isfinite(a).any()]
    return float(max(values)) if values else 0.0


def _inside(index, piece) -> bool:
    array, offset = piece
    return all(o <= i < o + n for i, o, n in zip(index, offset, array.shape))


def owner_of(case: Case, tensor: str, index, results: Results | None = None, dtype: str | None = None):
    """The lowest rank holding global element ``index`` of ``tensor`` (x_needed, dx_needed:
    of the input).  With ``results`` in their own layout, the results' rank whose block of the
    tensor (dx for the input; y for the output) holds it (None: no results block does)."""
    if results is not None and dtype is not None and results.own_layout(case, dtype):
        name = "dx" if tensor in ("x_needed", "dx_needed") else tensor
        for r in sorted(results.ranks[dtype]):
            if name in results.ranks[dtype][r] and _inside(index, (results.ranks[dtype][r][name],
                                                                   results.offsets[dtype][r][name])):
                return r
        return None
    if tensor in ("dw", "db"):
        holders = [lo.rank for lo, arrays in zip(case.layouts, case.ranks[case.spec.dtypes[0]])
                   if _inside(index, arrays[tensor])]
        return holders[0] if holders else None
    which = "y" if tensor in ("y",) else "x"
    for lo in case.layouts:
        if all(s.start <= i < s.stop for s, i in zip(lo.index(which), index)):
            return lo.rank
    return None


def _finding(dtype, tensor, rank, got, want, scale, tol, why, offset):
    err = _errors(got, want)
    finite = numpy.isfinite(err)
    max_abs = float(err[finite].max()) if finite.any() else 0.0
    max_rel = max_abs / scale if scale > 0 else max_abs
    with numpy.errstate(invalid="ignore"):
        bad = ~(err <= tol * (scale if scale > 0 else 1.0))       # NaN and inf errors included
    nonfinite = int((bad & ~finite).sum())
    finite_rel = max_rel
    if nonfinite:                    # a NaN or an infinity where a finite value is due: infinitely wrong
        max_abs = max_rel = math.inf
    finding = Finding(dtype, tensor, rank, max_abs, max_rel, tol, why, not bad.any(), int(bad.sum()),
                      nonfinite=nonfinite, offset=tuple(int(o) for o in offset),
                      shape=tuple(int(n) for n in numpy.shape(got)), finite_max_rel=finite_rel)
    if bad.any():
        finding.first_index = tuple(int(i) + int(o) for i, o in zip(numpy.argwhere(bad)[0], offset))
    return finding, bad


AXIS_NAMES = ("N", "C", "D", "H", "W")


def _what(tensor) -> str:
    if tensor in ("y", "y_partial"):
        return "outputs"
    if tensor in ("dx", "x_needed", "dx_needed"):
        return "inputs"
    return "elements"


def shape_message(case: Case, error: dict) -> tuple[str, tuple | None]:
    """(what is wrong with a block's shape, the global index where it first goes wrong)."""
    dtype, tensor, rank, shape, offset = (error[k] for k in ("dtype", "tensor", "rank", "shape", "offset"))
    who = "the global" if rank is None else f"rank {rank}'s"
    domain = casefile.domain_shape(case, dtype, tensor)
    names = AXIS_NAMES if len(domain) == 5 else tuple(f"axis {a}" for a in range(len(domain)))
    if len(shape) != len(domain):
        return f"{who} {tensor} has {len(shape)} dimensions {list(shape)}; it needs {len(domain)}", None
    if offset is None and rank is not None:              # the case's block of this rank
        want, at = case.ranks[dtype][rank][tensor]
        a = next(a for a in range(len(shape)) if shape[a] != want.shape[a])
        index = tuple(at[:a]) + (at[a] + min(shape[a], want.shape[a]),) + tuple(at[a + 1:])
        return (f"{who} {tensor} has {_count(shape[a], tensor)} along {names[a]}; the case's block of rank {rank} "
                f"has {want.shape[a]} there ([{at[a]}, {at[a] + want.shape[a]}) of {domain[a]}): a wrong "
                f"output-size rule, or another split (then give each block an 'offset' attribute)", index)
    if rank is None:                                     # a global tensor
        a = next(a for a in range(len(shape)) if shape[a] != domain[a])
        index = (0,) * a + (min(shape[a], domain[a]),) + (0,) * (len(shape) - a - 1)
        text = f"the global {tensor} has {_count(shape[a], tensor)} along {names[a]}; the layer has {domain[a]}"
        rule = layers.lookup(case.spec.layer).output_size_rule
        if tensor == "y" and a >= 2 and rule:
            text += f" (the output-size rule: {rule})"
        return text, index
    a = next(a for a in range(len(shape)) if offset[a] < 0 or offset[a] + shape[a] > domain[a])
    index = tuple(offset[:a]) + (offset[a] if offset[a] < 0 else domain[a],) + tuple(offset[a + 1:])
    have = max(0, domain[a] - offset[a])
    text = f"{who} {tensor} has {_count(shape[a], tensor)} along {names[a]} at offset {offset[a]}, "
    if offset[a] < 0:
        text += f"{-offset[a]} of them before the domain [0, {domain[a]})"
    else:
        noun = "layer" if tensor in ("y", "y_partial") else "input" if _what(tensor) == "inputs" else "tensor"
        text += f"the {noun} has {have} there"
    if tensor in ("x_needed", "dx_needed") and a >= 2:
        text += ": cells outside the domain are padding, not data; cut them off before writing " + tensor
    return text, index


# ---------------------------------------------------------------- expectations in the results' layout

def _window_range(case, axis, o0, o1):
    """The input range [i0, i1) outputs [o0, o1) read along ``axis`` (clipped to the domain)."""
    kind = layers.lookup(case.spec.layer)
    lo, hi = None, None
    for o in range(o0, o1):
        a, b = kind.input_window(case.spec, axis, o)
        if a < b:
            lo, hi = (a, b) if lo is None else (min(lo, a), max(hi, b))
    return (o0, o0) if lo is None else (lo, hi)


def _span(offsets, arrays, name, axis):
    off, shape = offsets[name], arrays[name].shape
    return int(off[axis]), int(off[axis] + shape[axis])


def results_layout(case: Case, dtype: str, r: int, arrays: dict, offsets: dict):
    """(RankLayout, complete) of results rank r, from where its blocks lie; ``complete``:
    its output block and its owned input block are both known (else placeholders)."""
    spec, kind = case.spec, layers.lookup(case.spec.layer)
    base = case.layouts[r] if r < len(case.layouts) else None
    c, f = spec.input[1], expect.output_shape(spec)[1]
    first = next((n for n in ("y", "dx", "y_partial", "x_needed", "dx_needed") if n in arrays), None)
    samples = _span(offsets, arrays, first, 0) if first else (base.samples if base else (0, spec.input[0]))
    out_channels = _span(offsets, arrays, "y", 1) if "y" in arrays else (base.out_channels if base else (0, f))
    in_channels = _span(offsets, arrays, "dx", 1) if "dx" in arrays else (base.in_channels if base else (0, c))
    comp = next((_span(offsets, arrays, n, 1) for n in ("x_needed", "dx_needed") if n in arrays), None)
    if comp is None:
        comp = base.compute_channels if base else (in_channels if spec.model_parallel == "channel" else (0, c))
    out_name = next((n for n in ("y", "y_partial") if n in arrays), None)
    outputs = tuple(_span(offsets, arrays, out_name, 2 + a) for a in range(3)) if out_name else None
    owned = tuple(_span(offsets, arrays, "dx", 2 + a) for a in range(3)) if "dx" in arrays else None
    if not kind.has_halo:             # pointwise in space: the output block is the input block
        outputs = outputs or owned
        owned = owned or outputs
    needed = tuple(_window_range(case, a, *outputs[a]) for a in range(3)) if outputs else None
    complete = outputs is not None and owned is not None
    empty = ((0, 0),) * 3
    layout = expect.RankLayout(r, (0, 0, 0, 0, 0), tuple(samples), tuple(in_channels), tuple(out_channels),
                               tuple(comp), owned or needed or empty, outputs or empty, needed or empty)
    return layout, complete, outputs is not None


def infer_owned(case, layouts, complete, has_outputs) -> dict:
    """{rank: owned input block} for ranks whose results give y but no dx (so their input
    block is unknown), where every rank's output blocks along each axis are one split rule of
    the output extent (``diagnose.SPLITS``): the input is then taken as split by the same rule.
    With it, y-only results in a peer's own layout get the halo and window diagnoses results
    with dx get."""
    todo = [r for r in layouts if not complete[r] and has_outputs[r]]
    if not todo or not layers.lookup(case.spec.layer).has_halo or not all(has_outputs.values()):
        return {}
    n_in, n_out = case.spec.input[2:], expect.output_shape(case.spec)[2:]
    owned = {r: [None] * 3 for r in todo}
    for a in range(3):
        spans = sorted({layouts[r].outputs[a] for r in layouts})
        p = len(spans)
        rule = next((f for _, f in diagnose.SPLITS if [f(n_out[a], p, i) for i in range(p)] == spans), None)
        if rule is None:
            return {}
        for r in todo:
            owned[r][a] = rule(n_in[a], p, spans.index(layouts[r].outputs[a]))
    return {r: tuple(v) for r, v in owned.items()}


def _reference64(case, dtype):
    a = {k: numpy.asarray(v, numpy.float64) for k, v in case.inputs[dtype].items()}
    with F.reference_only():
        glob = layers.lookup(case.spec.layer).reference(case.spec, a["x"], a.get("w"), a.get("b"), a["dy"])
    return a, glob


class _OwnLayout:
    """Expectations of every results rank's blocks where the results use their own split."""

    SLICES = {"y": "y", "dx": "dx", "x_needed": None, "dw": "dw", "db": "db"}   # slices of a global array

    def __init__(self, case, dtype, results):
        self.case, self.dtype, self.results = case, dtype, results
        self.layouts, self.complete, self.has_outputs, self._partials = {}, {}, {}, {}
        self._ref = None
        for r, arrays in results.ranks[dtype].items():
            lo, complete, has_out = results_layout(case, dtype, r, arrays, results.offsets[dtype][r])
            self.layouts[r], self.complete[r], self.has_outputs[r] = lo, complete, has_out
        for r, owned in infer_owned(case, self.layouts, self.complete, self.has_outputs).items():
            self.layouts[r] = dataclasses.replace(self.layouts[r], owned=owned)
            self.complete[r] = True
        if case.spec.model_parallel != "none":     # the model coordinate: which channel slice a rank holds
            which = "out_channels" if case.spec.model_parallel == "filter" else "in_channels"
            slices = sorted({getattr(lo, which) for lo in self.layouts.values()})
            for r, lo in self.layouts.items():
                self.layouts[r] = dataclasses.replace(lo, coords=(0, 0, 0, 0, slices.index(getattr(lo, which))))

    def partials(self, r):
        """{name: (array, offset)} of rank r's rank-specific tensors (float64), from its layout."""
        if r not in self._partials:
            if self._ref is None:
                self._ref = _reference64(self.case, self.dtype)
            a, glob = self._ref
            with F.reference_only():
                self._partials[r] = expect.rank_arrays(self.case.spec, a, glob, self.layouts[r])
        return self._partials[r]

    def expected(self, r, name, got, offset):
        """The expectation of rank r's block ``name`` at ``offset`` (None: not derivable, and why)."""
        index = tuple(slice(o, o + n) for o, n in zip(offset, got.shape))
        dt = numpy.dtype(self.dtype)
        if name == "x_needed":
            return self.case.inputs[self.dtype]["x"][index], None
        if name in self.SLICES:
            return self.case.expected[self.dtype][name][index], None
        if not self.has_outputs[r]:
            return None, (f"{name} of rank {r} depends on the rank's output block: the results give rank {r} "
                          f"no y (or y_partial) to place it")
        try:
            pieces = self.partials(r)
        except (RuntimeError, ValueError) as err:       # blocks that no partitioned run could produce
            return None, f"rank {r}'s blocks do not make a layout the layer can run on ({err})"
        if name not in pieces:
            return None, f"the layer has no {name}"
        whole = expect.embed(casefile.domain_shape(self.case, self.dtype, name), [pieces[name]])
        return whole[index].astype(dt), None

    def view(self):
        """A Case whose layouts and rank blocks are the results' (for diagnose.py), or None
        when the results' ranks are not 0..R-1 with known blocks."""
        ranks = sorted(self.layouts)
        if ranks != list(range(len(ranks))) or not all(self.complete.values()):
            return None
        blocks = [{k: (numpy.asarray(v).astype(self.dtype), o) for k, (v, o) in self.partials(r).items()}
                  for r in ranks]
        return dataclasses.replace(self.case, layouts=[self.layouts[r] for r in ranks],
                                   ranks={**self.case.ranks, self.dtype: blocks})


def _diagnose(call, *args):
    """A diagnosis, or None where diagnose.py cannot make sense of the input (it must never
    stop a report)."""
    try:
        return call(*args)
    except (KeyError, IndexError, ValueError, TypeError, AttributeError, ArithmeticError,
            numpy.linalg.LinAlgError):
        return None


HALO_CLAIM = "halo exchange"


def _unconfirmed_halo(text, has_x_needed) -> str | None:
    """A forward-halo diagnosis of y needs the results' x_needed to stand; without it the
    pattern is reported, the cause only as a possibility."""
    if not text or has_x_needed or HALO_CLAIM not in text or "forward" not in text:
        return text
    pattern = text.split(": the forward halo exchange")[0]
    return (f"{pattern}: possibly a wrong halo (forward exchange), not confirmed: the results hold no "
            f"x_needed (report it to tell the halo from the local computation)")


def _describe_nonfinite(finding, got, bad, pad_value=0.0):
    values = numpy.asarray(got)[bad & ~numpy.isfinite(numpy.asarray(got, numpy.float64))]
    if not values.size:
        return None
    kinds = ", ".join(k for k, m in (("NaN", numpy.isnan(values)), ("-inf", values == -numpy.inf),
                                     ("+inf", values == numpy.inf)) if m.any())
    text = (f"{finding.nonfinite} non-finite value{'s' * (finding.nonfinite != 1)} ({kinds}) where the "
            f"expectation is finite")
    if (values == -numpy.inf).any() and pad_value == -numpy.inf:
        text += " (a cell left at -inf: max pooling's padding value, as a halo that was never filled leaves it)"
    return text


def compare(case: Case, results: Results, tolerance_factor: float = 1.0,
            allow_missing_ranks: bool = False) -> CaseReport:
    """Every tensor the results hold, global and per rank, against the case.  A tensor the
    results leave out is not judged (``coverage`` lists it); one that some ranks hold and
    others lack makes the case incomplete (``incomplete_ranks``: a rank that crashed), unless
    ``allow_missing_ranks``; cells of a tensor every rank holds that no block covers are a
    finding (``holes``), and so is the part of a block past the tensor's end."""
    report = CaseReport(case.name)
    x_needed_given = {d: any("x_needed" in a for a in per.values()) for d, per in results.ranks.items()}
    own = {d: _OwnLayout(case, d, results) for d in results.ranks if results.own_layout(case, d)}
    views = {d: o.view() for d, o in own.items()}
    for dtype, arrays in results.global_.items():
        for tensor, got in arrays.items():
            want = case.expected[dtype][tensor]
            tol, why = tolerance(case, dtype, tensor, tolerance_factor)
            finding, bad = _finding(dtype, tensor, None, got, want, _scale([want]), tol, why, (0,) * want.ndim)
            if not finding.ok:
                finding.owner = owner_of(case, tensor, finding.first_index, results, dtype)
                if dtype in own and (views[dtype] is None or tensor in ("dw", "db")):
                    # no whole layout to split by (or, for dw and db, no grid to group the ranks by):
                    # the patterns of the whole tensor only
                    finding.diagnosis = _diagnose(_global_only, case, dtype, tensor, got, want, bad,
                                                  tol * _scale([want]), own[dtype])
                else:
                    finding.diagnosis = _diagnose(diagnose.global_tensor, views.get(dtype) or case, dtype, tensor,
                                                  got, want, bad, tol * _scale([want]))
                if tensor == "y":
                    finding.diagnosis = _unconfirmed_halo(finding.diagnosis, x_needed_given.get(dtype, False))
                finding.nonfinite and _note_nonfinite(finding, got, bad, case)
            report.findings.append(finding)
    for dtype, per_rank in results.ranks.items():
        expected = case.ranks[dtype]
        layout = own.get(dtype)
        order = list(expected[0])
        names = sorted({t for arrays in per_rank.values() for t in arrays},
                       key=lambda t: (order.index(t) if t in order else 99, t))
        for tensor in names:
            tol, why = tolerance(case, dtype, tensor, tolerance_factor)
            wants = {}
            for r, arrays in per_rank.items():
                if tensor not in arrays:
                    continue
                if layout is None:
                    wants[r] = expected[r][tensor]
                    continue
                want, reason = layout.expected(r, tensor, arrays[tensor], results.offsets[dtype][r][tensor])
                if want is None:
                    report.unchecked.append({"dtype": dtype, "tensor": tensor, "rank": r, "why": reason})
                else:
                    wants[r] = (want, results.offsets[dtype][r][tensor])
            scale = _scale([w for w, _ in wants.values()])
            for r, (want, offset) in wants.items():
                got = per_rank[r][tensor]
                finding, bad = _finding(dtype, tensor, r, got, want, scale, tol, why, offset)
                if not finding.ok:   # a ghost cell's owner is the rank that sent it
                    finding.owner = (owner_of(case, tensor, finding.first_index, results, dtype)
                                     if tensor.endswith("needed") or layout is not None else r)
                    if layout is None:
                        finding.diagnosis = _diagnose(diagnose.rank_tensor, case, dtype, tensor, r, got, want, bad,
                                                      tol * scale)
                        if tensor == "y":
                            finding.diagnosis = _unconfirmed_halo(finding.diagnosis, "x_needed" in per_rank[r])
                    else:
                        finding.diagnosis = _own_layout_diagnosis(layout, views[dtype], dtype, tensor, r, got, want,
                                                                  bad, tol * scale, "x_needed" in per_rank[r])
                    finding.nonfinite and _note_nonfinite(finding, got, bad, case)
                report.findings.append(finding)
    for error in results.shape_errors:
        tol, why = tolerance(case, error["dtype"], error["tensor"], tolerance_factor)
        message, index = shape_message(case, error)
        rule = getattr(diagnose, "output_size", None)      # the output-size rule that gives the wrong extent
        rule = rule and _diagnose(rule, case, error["dtype"], error["tensor"], error["rank"], tuple(error["shape"]),
                                  error["offset"])
        report.findings.append(Finding(error["dtype"], error["tensor"], error["rank"], None, None, tol, why, False,
                                       first_index=index, owner=error["rank"], problem="shape", message=message,
                                       diagnosis=f"{message}; {rule}" if rule else message,
                                       offset=error["offset"], shape=tuple(error["shape"])))
    for error in results.excess:
        report.findings.append(_excess_finding(case, error, *tolerance(case, error["dtype"], error["tensor"],
                                                                        tolerance_factor)))
    report.incomplete = incomplete_ranks(case, results, allow_missing_ranks)
    report.findings += holes(case, results, report.incomplete, tolerance_factor)
    report.first_wrong = first_wrong(report.findings)
    if own:
        report.layout = "results"
        report.layout_note = _layout_note(case, results, own)
    report.findings.sort(key=lambda f: (f.dtype != "float64", causal_index(f.tensor), f.rank is not None,
                                        f.rank or 0))
    trace_consequences(report, layers.lookup(case.spec.layer).dx_reads_forward)
    holed = {(f.dtype, f.tensor) for f in report.findings if f.problem == "uncovered"}
    report.not_provided = [g for g in coverage(case, results) if (g["dtype"], g["tensor"]) not in holed]
    return report


def _count(n, tensor) -> str:
    """'1 output', '6 outputs' (``_what``'s noun, singular where it is one)."""
    what = _what(tensor)
    return f"{n} {what[:-1] if n == 1 else what}"


def _excess_finding(case, error, tol, why) -> Finding:
    """A rank block that runs past the tensor's end: its in-range cells are compared as any
    block's (``casefile._in_range``); the excess is this finding, with the output-size rule
    behind it where one of the layer kind's rules gives the block's end."""
    dtype, tensor, r, shape, offset = (error[k] for k in ("dtype", "tensor", "rank", "shape", "offset"))
    domain = casefile.domain_shape(case, dtype, tensor)
    names = AXIS_NAMES if len(domain) == 5 else tuple(f"axis {a}" for a in range(len(domain)))
    noun = "layer" if tensor in ("y", "y_partial") else "input" if _what(tensor) == "inputs" else "tensor"
    clauses = [f"{_count(shape[a], tensor)} along {names[a]} from offset {offset[a]}; the {noun} has {domain[a]}"
               + (f" (so {offset[a] + shape[a] - domain[a]} past its end)" if offset[a] else "")
               for a in range(len(domain)) if offset[a] + shape[a] > domain[a]]
    message = f"rank {r}'s {tensor} has " + "; and ".join(clauses) + " (its in-range cells are compared apart)"
    rule = _diagnose(diagnose.output_size, case, dtype, tensor, r, tuple(shape), tuple(offset))
    return Finding(dtype, tensor, r, None, None, tol, why, False, mismatches=0, owner=r, problem="excess",
                   message=message, diagnosis=f"{message}; {rule}" if rule else message, offset=tuple(offset),
                   shape=tuple(shape))


def _expected_ranks(case, per_rank, allow_missing_ranks) -> list:
    """The ranks a complete result holds: the case's ranks and every rank number below the
    highest the results use (only those present with ``allow_missing_ranks``)."""
    if allow_missing_ranks or not per_rank:
        return sorted(per_rank)
    return list(range(max(case.spec.ranks, max(per_rank) + 1)))


def _held(results, dtype, r) -> set:
    """The tensors results rank r holds (read, or present with a shape that cannot be placed)."""
    return set(results.ranks[dtype].get(r, {})) | {e["tensor"] for e in results.shape_errors
                                                   if e["dtype"] == dtype and e["rank"] == r}


def incomplete_ranks(case, results, allow_missing_ranks=False) -> list:
    """{"dtype", "tensor", "ranks"}: a per-rank tensor (not dw/db, which one rank may give for
    all) that some ranks hold and these ranks lack: the mark of a rank that crashed, which
    must not let the case pass on the others' blocks alone."""
    out = []
    for dtype, per_rank in results.ranks.items():
        expected = _expected_ranks(case, per_rank, allow_missing_ranks)
        held = {r: _held(results, dtype, r) for r in expected}
        names = sorted({t for h in held.values() for t in h} - {"dw", "db"},
                       key=lambda t: (causal_index(t), t))
        for tensor in names:
            lacking = [r for r in expected if tensor not in held[r]]
            if lacking:
                out.append({"dtype": dtype, "tensor": tensor, "ranks": lacking})
    return out


def holes(case, results, incomplete, tolerance_factor=1.0) -> list:
    """Findings for the cells of a required tensor that every rank holds (and none gives
    globally) which no rank's block covers: an output the peer never computed is wrong, not
    "not provided".  Located at the first such cell (row-major)."""
    out = []
    gaps = {(g["dtype"], g["tensor"]) for g in incomplete}
    for dtype, per_rank in results.ranks.items():
        if not per_rank:
            continue
        for tensor in casefile.required(case):
            if tensor in results.global_.get(dtype, {}) or (dtype, tensor) in gaps:
                continue
            if not all(tensor in _held(results, dtype, r) for r in _expected_ranks(case, per_rank, False)):
                continue
            seen = covered_cells(case, results, dtype, tensor)
            if seen.all():
                continue
            tol, why = tolerance(case, dtype, tensor, tolerance_factor)
            first = tuple(int(i) for i in numpy.argwhere(~seen)[0])
            n = int((~seen).sum())
            cells = "output cells" if _what(tensor) == "outputs" else f"{tensor} cells"
            message = (f"{n} {cells[:-1] if n == 1 else cells} no rank holds (of {seen.size}; first at global index "
                       f"{list(first)}): every rank gave {tensor}, but the blocks leave a gap, so the peer "
                       f"never computed them (or wrote a block at the wrong offset)")
            out.append(Finding(dtype, tensor, None, None, None, tol, why, False, mismatches=n, first_index=first,
                               owner=owner_of(case, tensor, first), problem="uncovered", message=message,
                               diagnosis=message))
    return out


def first_wrong(findings) -> list:
    """{"dtype", "tensor", "index", "ranks"}: the first wrong cell of each tensor over all its
    blocks, in global row-major order, and every rank whose block is wrong there."""
    firsts = {}
    for f in findings:
        if f.ok or f.first_index is None or f.problem == "shape":
            continue
        key = (f.dtype, f.tensor)
        index = tuple(f.first_index)
        if key not in firsts or index < firsts[key][0]:
            firsts[key] = (index, [])
        if index == firsts[key][0] and f.rank is not None:
            firsts[key][1].append(f.rank)
    return [{"dtype": d, "tensor": t, "index": list(i), "ranks": sorted(ranks)}
            for (d, t), (i, ranks) in firsts.items()]


def _note_nonfinite(finding, got, bad, case):
    text = _describe_nonfinite(finding, got, bad, getattr(layers.lookup(case.spec.layer), "pad_value", 0.0))
    if text:
        finding.message = text
        finding.diagnosis = f"{text}; {finding.diagnosis}" if finding.diagnosis else text


def _own_reduction(layout, dtype, tensor, got, index, atol) -> str | None:
    """dw or db (its block ``index``) in a peer's own layout, where the case's grid cannot
    group the ranks: equal to one rank's partial sum alone (the allreduce over the shards
    missing), or to the sum averaged over the ranks that hold a part of it."""
    shape = casefile.domain_shape(layout.case, dtype, tensor)
    parts = {}
    for r in sorted(layout.layouts):
        if layout.has_outputs[r] and layout.complete[r]:
            piece = layout.partials(r).get(f"{tensor}_partial")
            if piece is not None and numpy.asarray(piece[0]).size and numpy.abs(piece[0]).max() > 0:
                parts[r] = piece
    if len(parts) < 2:
        return None
    got = numpy.asarray(got, numpy.float64)
    for r, piece in parts.items():
        if diagnose._matches(got, expect.embed(shape, [piece])[index], atol):
            return (f"{tensor} equals rank {r}'s partial sum alone: not summed over the shards (the allreduce of "
                    f"the {len(parts)} ranks' partial {tensor} is missing)")
    whole = expect.embed(shape, list(parts.values()))
    if diagnose._matches(got, whole[index] / len(parts), atol):
        return (f"{tensor} averaged over the {len(parts)} ranks instead of summed: the shards hold different "
                f"voxels of the same samples, so their partial sums add")
    return None


def _global_only(case, dtype, tensor, got, want, bad, atol, own=None):
    """The patterns of a whole tensor that need no rank layout (dw and db: the reductions of
    the results' own layout ``own``, where given)."""
    if tensor in ("dw", "db"):
        everything = (slice(None),) * numpy.ndim(got)
        return diagnose.gradient_missing(tensor, got, want, atol) or (
            own is not None and _own_reduction(own, dtype, tensor, got, everything, atol)) or None
    everything = (slice(None),) * want.ndim
    return diagnose.known_mistake(case, dtype, tensor, numpy.asarray(got), want, everything, atol) \
        or diagnose.shift(numpy.asarray(got), want, bad, atol)


def _own_layout_diagnosis(layout, view, dtype, tensor, r, got, want, bad, atol, has_x_needed):
    """diagnose.py's patterns for a block of the results' own layout: those that need only the
    block, and (with a whole view of the results' layout) the halo patterns; reductions of dw
    and db need the case's grid and are not tried."""
    got = numpy.asarray(got)
    lo = layout.layouts[r]
    if tensor in ("dw", "db"):
        index = tuple(slice(o, o + n) for o, n in zip(layout.results.offsets[dtype][r][tensor], got.shape))
        return _diagnose(diagnose.gradient_missing, tensor, got, want, atol) \
            or _diagnose(_own_reduction, layout, dtype, tensor, got, index, atol)
    if tensor in ("dw_partial", "db_partial") or tensor in layers.lookup(layout.case.spec.layer).statistic_names():
        return None
    if tensor == "x_needed":
        return _diagnose(diagnose.ghost_cells, view, lo, bad) if view is not None else None
    whole = casefile.domain_shape(layout.case, dtype, tensor)
    if tensor in ("y", "dx") and got.shape == whole:       # a replicated tensor: every rank holds it all
        found = _diagnose(diagnose.known_mistake, layout.case, dtype, tensor, got, want, (slice(None),) * 5, atol) \
            or _diagnose(diagnose.gathered_sizes, layout.case, tensor, got, want, atol) \
            or _diagnose(diagnose.shift, got, want, bad, atol)
        if found:
            return found
    if tensor in ("y", "dx") and layout.complete[r]:
        index = lo.index("y" if tensor == "y" else "x")
        found = _diagnose(diagnose.known_mistake, view or layout.case, dtype, tensor, got, want, index, atol) \
            or _diagnose(diagnose.shift, got, want, bad, atol)
        if found:          # the same hedge as in the case's layout: only x_needed confirms a halo
            return _unconfirmed_halo(found, has_x_needed) if tensor == "y" else found
        if view is None:
            return None
        if tensor == "y":
            found = _diagnose(diagnose.halo_forward, view, lo, bad)
            found = found and found.format(who=f"rank {r}")
            return _unconfirmed_halo(found, has_x_needed)
        found = _diagnose(diagnose.halo_adjoint, view, dtype, lo, got, want, bad, atol)
        return found and found.format(who=f"rank {r}")
    return _diagnose(diagnose.shift, got, want, bad, atol)


def _layout_note(case, results, own) -> str:
    """Where the results' blocks differ from the case's split, over every dtype in the
    results' own layout (a dtype whose differences repeat another's is not listed again)."""
    notes, counted = {}, set()
    for dtype, layout in own.items():
        diffs = []
        for r in sorted(layout.layouts):
            lo = layout.layouts[r]
            base = case.layouts[r] if r < len(case.layouts) else None
            if base is None:
                diffs.append(f"rank {r} (not in the case)")
                continue
            axes = [f"{AXIS_NAMES[2 + a]} [{lo.outputs[a][0]}, {lo.outputs[a][1]})"
                    + (" empty" if lo.outputs[a][0] == lo.outputs[a][1] else "")
                    + f" (case: [{base.outputs[a][0]}, {base.outputs[a][1]}))"
                    for a in range(3) if layout.has_outputs[r] and lo.outputs[a] != base.outputs[a]]
            if layout.has_outputs[r] and (axes or lo.samples != base.samples or lo.out_channels != base.out_channels):
                diffs.append(f"rank {r} outputs " + (", ".join(axes) or f"samples {list(lo.samples)}, channels "
                                                     f"{list(lo.out_channels)}"))
                continue
            other = [name for name, offset in results.offsets[dtype][r].items()
                     if name not in case.ranks[dtype][r]
                     or (tuple(offset), results.ranks[dtype][r][name].shape)
                     != (tuple(case.ranks[dtype][r][name][1]), case.ranks[dtype][r][name][0].shape)]
            if other:
                diffs.append(f"rank {r}'s " + ", ".join(
                    f"{n} at {list(results.offsets[dtype][r][n])} shaped {list(results.ranks[dtype][r][n].shape)}"
                    for n in other))
        counted |= {d.split()[1].rstrip("'s") for d in diffs}
        notes.setdefault("; ".join(diffs[:6]) + ("; ..." if len(diffs) > 6 else ""), []).append(dtype)
    n = len(counted)
    text = (f"ranks are the results' own: {n} rank{'s' * (n != 1)} whose blocks are not the case's split of "
            f"grid {list(case.spec.grid)}")
    parts = [(f"{' and '.join(dtypes)}: " if len(notes) > 1 else "") + diff for diff, dtypes in notes.items() if diff]
    return text + (": " + " | ".join(parts) if parts else "")


def covered_cells(case: Case, results: Results, dtype: str, tensor: str):
    """Boolean mask over the global ``tensor``: the cells some rank's block of it holds."""
    seen = numpy.zeros(case.expected[dtype][tensor].shape, bool)
    for r, arrays in results.ranks.get(dtype, {}).items():
        if tensor in arrays:
            offset = results.offsets[dtype][r][tensor]
            seen[tuple(slice(o, o + n) for o, n in zip(offset, arrays[tensor].shape))] = True
    return seen


def coverage(case: Case, results: Results) -> list:
    """The required tensors (y, dx, and the parameter gradients) the results do not cover,
    per dtype of the case: neither globally nor by the union of the ranks' blocks."""
    out = []
    for dtype in case.spec.dtypes:
        for tensor in casefile.required(case):
            total = int(numpy.prod(case.expected[dtype][tensor].shape))
            if tensor in results.global_.get(dtype, {}):
                continue
            covered = int(covered_cells(case, results, dtype, tensor).sum())
            if covered < total:
                out.append({"dtype": dtype, "tensor": tensor, "covered": covered, "total": total})
    return out


#: --require: what must be provided (the levels, and single tensors)
REQUIRE = {"all": ("y", "dx", "dw", "db"), "forward": ("y",), "backward": ("dx", "dw", "db"),
           "params": ("dw", "db"), "y": ("y",), "dx": ("dx",), "dw": ("dw",), "db": ("db",)}


def parse_require(text) -> tuple | None:
    """``--require`` (comma-separated levels or tensors) as (tensors, every dtype of the case?)."""
    if text is None or text == "none":
        return None
    words = [w.strip() for w in text.split(",") if w.strip()]
    bad = [w for w in words if w not in REQUIRE]
    if bad or not words:
        raise ValueError(f"--require must be a comma-separated list of {', '.join(REQUIRE)} (or none), got {text!r}")
    tensors = tuple(dict.fromkeys(t for w in words for t in REQUIRE[w]))
    return tensors, "all" in words


def apply_require(case: Case, report: CaseReport, require, results: Results | None) -> None:
    """Mark as missing what ``--require`` asks for and the results do not cover: in every
    dtype of the case for ``all``, else in every dtype the results hold (all of them when the
    case was not run)."""
    if require is None:
        return
    tensors, every_dtype = require
    present = set() if results is None else set(results.global_) | set(results.ranks)
    dtypes = set(case.spec.dtypes) if every_dtype or not present else present
    params = casefile.required(case)
    gaps = report.not_provided if results is not None else [
        {"dtype": d, "tensor": t, "covered": 0, "total": int(numpy.prod(case.expected[d][t].shape))}
        for d in case.spec.dtypes for t in params]
    report.missing = [g for g in gaps if g["tensor"] in tensors and g["tensor"] in params and g["dtype"] in dtypes]


#: the order in which a partitioned layer computes its tensors: an error upstream spoils
#: everything computed from it
CAUSAL_ORDER = ("x_needed", "statistics", "y_partial", "y", "dx_needed", "backward statistics", "dw_partial",
                "db_partial", "dx", "dw", "db")


def causal_index(tensor: str) -> int:
    """``tensor``'s place in ``CAUSAL_ORDER``; a layer's partial statistics (its kind's
    ``statistics``: batch norm's sums) come after x_needed and before y, those of the backward
    pass (``Statistic.backward``: sums of dy) after dx_needed."""
    if tensor in CAUSAL_ORDER:
        return CAUSAL_ORDER.index(tensor)
    backward = any(s.name == tensor and s.backward for kind in layers.REGISTRY.values() for s in kind.statistics)
    return CAUSAL_ORDER.index("backward statistics" if backward else "statistics")


def root_cause(report: CaseReport):
    """The first diagnosed failure in causal order (None if no failure was diagnosed)."""
    failed = [f for f in report.findings if not f.ok and f.diagnosis and not f.diagnosis.startswith("follows")]
    # a diagnosed value error first: a block's excess or a gap is a finding, seldom the cause
    return min(failed, key=lambda f: (f.problem in ("excess", "uncovered"), causal_index(f.tensor),
                                      f.rank is None, f.rank or 0, f.dtype != "float64"), default=None)


def _can_cause(upstream: str, tensor: str, dx_reads_forward: bool, upstream_diagnosis: str = "") -> bool:
    """Whether an error in ``upstream`` can spoil ``tensor``: anything computed before it, but
    the input gradient only from its own partial sums (``dx_needed``) and, where it reads them
    (``LayerKind.dx_reads_forward``), the forward's tensors; never from dw or db.  Where the
    backward reads no forward output (a conv: dW = x ⋆ dy, db = Σ dy), dw follows only from
    the input cells it reads (x_needed, or a y error diagnosed as wrong input cells: a halo or
    padding) and its partials, db only from its partials."""
    if causal_index(upstream) >= causal_index(tensor):
        return False
    if tensor in ("dx_needed", "dx"):
        return upstream == "dx_needed" or (dx_reads_forward and causal_index(upstream) < causal_index("dx_needed"))
    if tensor in ("dw", "db", "dw_partial", "db_partial") and not dx_reads_forward:
        base = tensor[:2]
        if upstream == f"{base}_partial":
            return True
        reads_input = upstream == "x_needed" or (upstream in ("y", "y_partial") and any(
            word in (upstream_diagnosis or "") for word in ("halo", "padding", "ghost")))
        return base == "dw" and reads_input
    return True


def trace_consequences(report: CaseReport, dx_reads_forward: bool = True) -> None:
    """An undiagnosed failure downstream of a diagnosed one it can follow from (``_can_cause``)
    is most likely its consequence."""
    for f in report.findings:
        if f.ok or f.diagnosis:
            continue
        upstream = [u for u in report.findings if not u.ok and u.diagnosis and u.dtype == f.dtype
                    and u.problem not in ("excess", "uncovered")
                    and not u.diagnosis.startswith("follows")
                    and _can_cause(u.tensor, f.tensor, dx_reads_forward, u.diagnosis)]
        if upstream:
            # the same rank's error first (its own y spoils its own dw_partial), then the earliest
            u = min(upstream, key=lambda u: (f.rank is not None and u.rank != f.rank, causal_index(u.tensor), u.rank is None,
                                             u.rank or 0))
            where = "global" if u.rank is None else f"rank {u.rank}"
            f.diagnosis = f"follows from the error in {u.tensor} ({where}) diagnosed above"
