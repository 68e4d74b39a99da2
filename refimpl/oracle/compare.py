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

import math
from dataclasses import dataclass, field

import numpy

from .. import layers
from . import diagnose
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
    """The comparison of one tensor (global, or one rank's block) in one dtype."""
    dtype: str
    tensor: str
    rank: int | None            # None: the global tensor
    max_abs: float
    max_rel: float
    tolerance: float
    why: str
    ok: bool
    mismatches: int = 0
    first_index: tuple | None = None     # global index of the first mismatch
    owner: int | None = None             # the rank that owns it
    diagnosis: str | None = None

    def as_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


@dataclass
class CaseReport:
    case: str
    findings: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(f.ok for f in self.findings)

    def as_dict(self) -> dict:
        return {"case": self.case, "ok": self.ok, "findings": [f.as_dict() for f in self.findings]}


def _errors(got, want):
    """|got - want| with equal entries (two -inf windows of max pooling) counting as 0."""
    got = numpy.asarray(got, dtype=numpy.float64)
    want = numpy.asarray(want, dtype=numpy.float64)
    with numpy.errstate(invalid="ignore"):
        return numpy.where(got == want, 0.0, numpy.abs(got - want))


def _scale(arrays) -> float:
    values = [numpy.abs(a[numpy.isfinite(a)]).max() for a in arrays if a.size and numpy.isfinite(a).any()]
    return float(max(values)) if values else 0.0


def owner_of(case: Case, tensor: str, index) -> int | None:
    """The lowest rank holding global element ``index`` of ``tensor``."""
    if tensor in ("dw", "db"):
        holders = [lo.rank for lo, arrays in zip(case.layouts, case.ranks[case.spec.dtypes[0]])
                   if _inside(index, arrays[tensor])]
        return holders[0] if holders else None
    which = "y" if tensor in ("y",) else "x"
    for lo in case.layouts:
        if all(s.start <= i < s.stop for s, i in zip(lo.index(which), index)):
            return lo.rank
    return None


def _inside(index, piece) -> bool:
    array, offset = piece
    return all(o <= i < o + n for i, o, n in zip(index, offset, array.shape))


def _finding(dtype, tensor, rank, got, want, scale, tol, why, offset):
    err = _errors(got, want)
    max_abs = float(err.max()) if err.size else 0.0
    max_rel = max_abs / scale if scale > 0 else max_abs
    bad = err > tol * (scale if scale > 0 else 1.0)
    finding = Finding(dtype, tensor, rank, max_abs, max_rel, tol, why, not bad.any(), int(bad.sum()))
    if bad.any():
        finding.first_index = tuple(int(i) + int(o) for i, o in zip(numpy.argwhere(bad)[0], offset))
    return finding, bad


def compare(case: Case, results: Results, tolerance_factor: float = 1.0) -> CaseReport:
    """Every tensor the results hold, global and per rank, against the case."""
    report = CaseReport(case.name)
    for dtype, arrays in results.global_.items():
        for tensor, got in arrays.items():
            want = case.expected[dtype][tensor]
            tol, why = tolerance(case, dtype, tensor, tolerance_factor)
            finding, bad = _finding(dtype, tensor, None, got, want, _scale([want]), tol, why, (0,) * want.ndim)
            if not finding.ok:
                finding.owner = owner_of(case, tensor, finding.first_index)
                finding.diagnosis = diagnose.global_tensor(case, dtype, tensor, got, want, bad,
                                                           tol * _scale([want]))
            report.findings.append(finding)
    for dtype, per_rank in results.ranks.items():
        expected = case.ranks[dtype]
        names = sorted({t for arrays in per_rank.values() for t in arrays},
                       key=lambda t: (list(expected[0]).index(t) if t in expected[0] else 99, t))
        for tensor in names:
            scale = _scale([expected[r][tensor][0] for r in per_rank if tensor in per_rank[r]])
            tol, why = tolerance(case, dtype, tensor, tolerance_factor)
            for r, arrays in per_rank.items():
                if tensor not in arrays:
                    continue
                want, offset = expected[r][tensor]
                finding, bad = _finding(dtype, tensor, r, arrays[tensor], want, scale, tol, why, offset)
                if not finding.ok:   # a ghost cell's owner is the rank that sent it
                    finding.owner = owner_of(case, "dx", finding.first_index) if tensor.endswith("needed") else r
                    finding.diagnosis = diagnose.rank_tensor(case, dtype, tensor, r, arrays[tensor], want,
                                                             bad, tol * scale)
                report.findings.append(finding)
    report.findings.sort(key=lambda f: (f.dtype != "float64", CAUSAL_ORDER.index(f.tensor), f.rank is not None,
                                        f.rank or 0))
    trace_consequences(report)
    return report


#: the order in which a partitioned layer computes its tensors: an error upstream spoils
#: everything computed from it
CAUSAL_ORDER = ("x_needed", "sum_partial", "sumsq_partial", "y_partial", "y", "dx_needed", "dw_partial",
                "db_partial", "dx", "dw", "db")


def root_cause(report: CaseReport):
    """The first diagnosed failure in causal order (None if no failure was diagnosed)."""
    failed = [f for f in report.findings if not f.ok and f.diagnosis and not f.diagnosis.startswith("follows")]
    return min(failed, key=lambda f: (CAUSAL_ORDER.index(f.tensor), f.rank is None, f.rank or 0, f.dtype != "float64"),
               default=None)


def trace_consequences(report: CaseReport) -> None:
    """An undiagnosed failure downstream of a diagnosed one is most likely its consequence."""
    for f in report.findings:
        if f.ok or f.diagnosis:
            continue
        upstream = [u for u in report.findings if not u.ok and u.diagnosis and u.dtype == f.dtype
                    and not u.diagnosis.startswith("follows")
                    and CAUSAL_ORDER.index(u.tensor) < CAUSAL_ORDER.index(f.tensor)]
        if upstream:
            # the same rank's error first (its own y spoils its own dw_partial), then the earliest
            u = min(upstream, key=lambda u: (f.rank is not None and u.rank != f.rank, CAUSAL_ORDER.index(u.tensor), u.rank is None,
                                             u.rank or 0))
            where = "global" if u.rank is None else f"rank {u.rank}"
            f.diagnosis = f"follows from the error in {u.tensor} ({where}) diagnosed above"
