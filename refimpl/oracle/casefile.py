"""Case and results files (HDF5, no pickle): writing cases, reading and validating both.

Case file ``NAME.GRID.h5`` (written by ``refimpl oracle generate``)::

    /  attrs  format = "refimpl-oracle-case", format_version, refimpl_version, digest,
              case (JSON: every CaseSpec field: name, layer, input, out_channels, kernel, stride,
              padding, dilation, output_padding, grid, model_parallel, values, seed, dtypes),
              output_shape
    /<dtype>/inputs/{x, dy, w, b}            global inputs (w, b: conv weight/bias, or
                                             batch norm's scale/shift)
    /<dtype>/global/{y, dx, dw, db}          expected global outputs and gradients
    /<dtype>/rank/<r>/...                    expected blocks of rank r (expect.py lists them),
                                             each with attr ``offset`` (global index of its
                                             first element); the group's attrs hold r's layout
                                             (coords, samples, channels, owned, outputs, needed)

``<dtype>`` is ``float64`` and/or ``float32``.  A results file has the same layout,
holds only what an implementation computed, and carries the case's ``digest`` as its
root attribute ``case_digest``::

    /  attrs  case_digest = <the case's digest>
    /<dtype>/global/{y, dx, dw, db}          optional: the gathered global results
    /<dtype>/rank/<r>/{y, dx, dw, db, ...}   optional: every rank's blocks (all ranks)

Anything unusable (unreadable or truncated file, a case from another refimpl version, a
missing or unknown dataset, a wrong shape or dtype, NaN/inf where a finite value is
expected) raises ``UnusableInput`` naming the file and dataset; the CLI exits 2.  Both
files are untrusted: every dataset's dtype and shape are checked against what the case
implies (``case_shapes``; for results, the case's arrays), and its declared size against
the bytes the file stores (``data.reader.check_stored``), before it is read: a 6 KB file
declaring a 700 GB dataset is refused, not allocated.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

import numpy

from .. import __version__, layers
from ..data.reader import check_stored
from . import expect
from .suite import DTYPES, CaseSpec

FORMAT = "refimpl-oracle-case"
FORMAT_VERSION = 1
GLOBAL_TENSORS = ("y", "dx", "dw", "db")
#: per-rank tensors an implementation may report (the first two, and dw/db where the layer
#: has parameters, are required; the rest are compared when present)
RANK_TENSORS = ("y", "dx", "dw", "db", "x_needed", "dx_needed", "y_partial", "dw_partial", "db_partial",
                "sum_partial", "sumsq_partial")


class UnusableInput(ValueError):
    """A case or results file that cannot be checked (the CLI exits 2)."""


def digest(spec: CaseSpec) -> str:
    """Identifies a case: its full specification and the refimpl version that generated it."""
    text = json.dumps({"spec": spec_json(spec), "version": __version__, "format": FORMAT_VERSION},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def spec_json(spec: CaseSpec) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in spec.__dict__.items()}


def write_case(spec: CaseSpec, directory: str) -> str:
    """Generate and write one case file (atomically); returns its path."""
    import h5py

    from ..failstop import atomic_write
    path = os.path.join(directory, spec.file_name)
    content = {dtype: expect.expectations(spec, dtype) for dtype in spec.dtypes}
    layouts = expect.rank_layouts(spec)

    def write(f):
        with h5py.File(f, "w") as h5:
            h5.attrs.update({"format": FORMAT, "format_version": FORMAT_VERSION, "refimpl_version": __version__,
                             "digest": digest(spec), "case": json.dumps(spec_json(spec)),
                             "output_shape": list(expect.output_shape(spec)),
                             "about": "refimpl oracle case: see docs/oracle.md (refimpl oracle check)"})
            for dtype, (inputs, glob, ranks) in content.items():
                group = h5.create_group(dtype)
                for name, array in inputs.items():
                    group.create_dataset(f"inputs/{name}", data=array)
                for name, array in glob.items():
                    group.create_dataset(f"global/{name}", data=array)
                for layout, arrays in zip(layouts, ranks):
                    rank = group.create_group(f"rank/{layout.rank}")
                    rank.attrs.update(layout.as_attrs())
                    for name, (array, offset) in arrays.items():
                        rank.create_dataset(name, data=array).attrs["offset"] = list(offset)
    atomic_write(path, write, binary=True)
    return path


@dataclass
class Case:
    """A loaded case file: its spec, layouts, and for each dtype its inputs and expectations."""
    path: str
    spec: CaseSpec
    digest: str
    layouts: list
    inputs: dict = field(default_factory=dict)     # dtype -> {name: array}
    expected: dict = field(default_factory=dict)   # dtype -> {name: array}
    ranks: dict = field(default_factory=dict)      # dtype -> [{name: (array, offset)}]

    @property
    def name(self) -> str:
        return os.path.basename(self.path)


def _open(path, what):
    import h5py
    try:
        return h5py.File(path, "r")
    except FileNotFoundError:
        raise UnusableInput(f"{what} {path}: no such file") from None
    except OSError as err:
        raise UnusableInput(f"{what} {path}: not a readable HDF5 file (truncated or corrupt?): {err}") from None


def _read(h5, name, path, what, dtype, shape):
    """Dataset /``name``, read once its metadata holds: ``dtype``, ``shape``, and the bytes it
    declares stored in the file."""
    import h5py
    where = f"{what} {path}: /{name}"
    dataset = h5.get(name)
    if not isinstance(dataset, h5py.Dataset):
        raise UnusableInput(f"{where} must be a dataset")
    if dataset.dtype != dtype:
        raise UnusableInput(f"{where}: dtype {dataset.dtype}, expected {dtype}")
    if dataset.shape != tuple(shape):
        raise UnusableInput(f"{where}: shape {dataset.shape}, expected {tuple(shape)}")
    try:
        check_stored(dataset, path)
        return dataset[()]
    except ValueError as err:
        raise UnusableInput(f"{what} {err}") from None
    except OSError as err:
        raise UnusableInput(f"{path}: cannot read dataset /{name} ({err})") from None


def case_shapes(spec: CaseSpec, layouts) -> dict:
    """The shape of every dataset of a case file (its path below ``/<dtype>/``), from its spec."""
    out = expect.output_shape(spec)
    shapes = {"inputs/x": spec.input, "inputs/dy": out, "global/y": out, "global/dx": spec.input}
    w, b = layers.lookup(spec.layer).parameter_shapes(spec) or (None, None)
    if w is not None:
        shapes.update({"inputs/w": w, "inputs/b": b, "global/dw": w, "global/db": b})

    def extent(index):
        return tuple(s.stop - s.start for s in index)

    def shard(shape, part):              # the shape of expect.take(array of ``shape``, part)
        axis, start, stop = part if part is not None else (None, 0, 0)
        return tuple(stop - start if a == axis else m for a, m in enumerate(shape))

    for lo in layouts:
        x, y, needed = (extent(lo.index(k)) for k in ("x", "y", "needed"))
        per = {"x": x, "dx": x, "y": y, "dy": y, "x_needed": needed, "dx_needed": needed,
               "y_partial": (y[0], out[1]) + y[2:]}
        if w is not None:
            wr, br = shard(w, expect.weight_shard(spec, lo)), shard(b, expect.bias_shard(spec, lo))
            per.update({"dw": wr, "dw_partial": wr, "db": br, "db_partial": br, "sum_partial": br,
                        "sumsq_partial": br})
        shapes.update({f"rank/{lo.rank}/{k}": v for k, v in per.items()})
    return shapes


def load_case(path: str) -> Case:
    """Read and validate a case file (``UnusableInput`` if it is not one this refimpl wrote)."""
    try:
        return _load_case(path)
    except (TypeError, AttributeError, KeyError, OSError, RuntimeError) as err:   # bytes HDF5 cannot make sense of
        raise UnusableInput(f"case file {path} is damaged: not laid out as docs/oracle.md describes "
                            f"({type(err).__name__}: {err})") from None


def _load_case(path: str) -> Case:
    with _open(path, "case file") as h5:
        attrs = dict(h5.attrs)
        if attrs.get("format") != FORMAT:
            raise UnusableInput(f"case file {path}: not a refimpl oracle case (no format attribute "
                                f"{FORMAT!r}); generate cases with 'refimpl oracle generate'")
        if int(attrs.get("format_version", -1)) != FORMAT_VERSION or attrs.get("refimpl_version") != __version__:
            raise UnusableInput(f"case file {path}: generated by refimpl {attrs.get('refimpl_version')} (format "
                                f"{attrs.get('format_version')}); this is refimpl {__version__} (format "
                                f"{FORMAT_VERSION}): regenerate the cases with this version")
        try:
            raw = json.loads(attrs["case"])
            spec = CaseSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
        except (KeyError, TypeError, ValueError, RecursionError) as err:
            raise UnusableInput(f"case file {path}: unreadable case description ({err})") from None
        if attrs.get("digest") != digest(spec):
            raise UnusableInput(f"case file {path}: its digest does not match its description (edited?)")
        try:                         # the digest vouches for no one: check-layer's rules, and a group per rank
            if spec.layer not in layers.names() or not set(spec.dtypes) <= set(DTYPES):
                raise ValueError(f"layer {spec.layer!r}, dtypes {spec.dtypes!r}")
            spec.layer_check()
        except (KeyError, TypeError, ValueError) as err:
            raise UnusableInput(f"case file {path} is damaged: its case description is invalid ({err})") from None
        for dtype in spec.dtypes:
            if len(h5[f"{dtype}/rank"]) != spec.ranks:
                raise UnusableInput(f"case file {path} is damaged: /{dtype}/rank holds {len(h5[f'{dtype}/rank'])} "
                                    f"groups for the {spec.ranks} ranks of grid {list(spec.grid)}")
        case = Case(path, spec, attrs["digest"], expect.rank_layouts(spec))
        shapes = case_shapes(spec, case.layouts)

        def read(dtype, name):
            if name not in shapes:
                raise UnusableInput(f"case file {path} is damaged: unknown dataset /{dtype}/{name}")
            return _read(h5, f"{dtype}/{name}", path, "case file", dtype, shapes[name])
        for dtype in spec.dtypes:
            case.inputs[dtype] = {k: read(dtype, f"inputs/{k}") for k in h5[f"{dtype}/inputs"]}
            case.expected[dtype] = {k: read(dtype, f"global/{k}") for k in h5[f"{dtype}/global"]}
            case.ranks[dtype] = [{k: (read(dtype, f"rank/{r}/{k}"),
                                      tuple(int(o) for o in h5[f"{dtype}/rank/{r}/{k}"].attrs["offset"]))
                                  for k in h5[f"{dtype}/rank/{r}"]} for r in range(spec.ranks)]
    return case


@dataclass
class Results:
    """What an implementation reported for one case: dtype -> global {name: array} and
    dtype -> {rank: {name: array}} (either may be empty, not both)."""
    path: str
    global_: dict = field(default_factory=dict)
    ranks: dict = field(default_factory=dict)


def _check_finite(array, want, where):
    bad = ~numpy.isfinite(array) & numpy.isfinite(want)
    if bad.any():
        index = tuple(int(i) for i in numpy.argwhere(bad)[0])
        raise UnusableInput(f"{where}: {int(bad.sum())} NaN/inf value(s) where the expectation is finite "
                            f"(first at local index {index})")


def required(case: Case) -> tuple:
    return ("y", "dx") + (("dw", "db") if "dw" in next(iter(case.expected.values())) else ())


def _read_tensors(h5, path, where, need, expected) -> dict:
    """The datasets of group ``where``: every name in ``need`` present, none outside
    ``expected`` ({name: expected array}), each of the expected dtype and shape (checked before
    it is read) and finite."""
    import h5py
    if not isinstance(h5[where], h5py.Group):
        raise UnusableInput(f"results file {path}: /{where} must be a group of datasets, found a dataset")
    names = set(h5[where])
    unknown = sorted(names - set(expected))
    missing = [n for n in need if n not in names]
    if unknown or missing:
        raise UnusableInput(f"results file {path}: /{where}: "
                            + (f"missing dataset(s) {missing}" if missing else "")
                            + ("; " if missing and unknown else "")
                            + (f"unknown dataset(s) {unknown} (this case has: {sorted(expected)})"
                               if unknown else ""))
    arrays = {}
    for name in sorted(names):
        want = expected[name]
        array = numpy.asarray(_read(h5, f"{where}/{name}", path, "results file", want.dtype, want.shape))
        _check_finite(array, want, f"results file {path}: /{where}/{name}")
        arrays[name] = array
    return arrays


def load_results(path: str, case: Case) -> Results:
    """Read a results file for ``case`` and validate it against the case's expectations."""
    try:
        return _load_results(path, case)
    except (TypeError, AttributeError, KeyError, OSError) as err:    # e.g. a dataset where a group belongs
        raise UnusableInput(f"results file {path}: not laid out as docs/oracle.md describes "
                            f"({type(err).__name__}: {err})") from None


def _load_results(path: str, case: Case) -> Results:
    import h5py
    with _open(path, "results file") as h5:
        got = h5.attrs.get("case_digest")
        if isinstance(got, (bytes, numpy.bytes_)):         # a fixed-length string from another writer
            got = got.decode()
        if got is None:
            raise UnusableInput(f"results file {path}: no root attribute 'case_digest' (copy the case "
                                f"file's 'digest' attribute, {case.digest!r})")
        if got != case.digest:
            raise UnusableInput(f"results file {path}: made for case digest {got!r}, but case {case.name} "
                                f"has digest {case.digest!r} (another case, or cases from another refimpl "
                                f"version): rerun your implementation on these cases")
        results = Results(path)
        unknown = sorted(set(h5) - set(case.spec.dtypes))
        if unknown:
            raise UnusableInput(f"results file {path}: unknown group(s) {unknown}; the case has "
                                f"{list(case.spec.dtypes)}")
        if not len(h5):
            raise UnusableInput(f"results file {path}: holds no results (expected a group per dtype: "
                                f"{list(case.spec.dtypes)})")
        need = required(case)
        for dtype in h5:
            group = h5[dtype]
            if not isinstance(group, h5py.Group):
                raise UnusableInput(f"results file {path}: /{dtype} must be a group, found a dataset")
            extra = sorted(set(group) - {"global", "rank"})
            if extra or not len(group):
                raise UnusableInput(f"results file {path}: /{dtype} must hold 'global' and/or 'rank', "
                                    f"found {sorted(group)}")
            if "global" in group:
                expected = case.expected[dtype]
                results.global_[dtype] = _read_tensors(h5, path, f"{dtype}/global", need,
                                                       {k: expected[k] for k in GLOBAL_TENSORS if k in expected})
            if "rank" in group:
                present = sorted(group["rank"], key=lambda s: (len(s), s))
                expected_ranks = [str(r) for r in range(case.spec.ranks)]
                if present != expected_ranks:
                    raise UnusableInput(f"results file {path}: /{dtype}/rank must hold groups "
                                        f"0..{case.spec.ranks - 1} (one per rank of grid "
                                        f"{list(case.spec.grid)}), found {present}")
                results.ranks[dtype] = {
                    r: _read_tensors(h5, path, f"{dtype}/rank/{r}", need,
                                     {k: a for k, (a, _) in case.ranks[dtype][r].items() if k in RANK_TENSORS})
                    for r in range(case.spec.ranks)}
    return results


def write_results(path: str, case: Case, global_: dict | None = None, ranks: dict | None = None) -> None:
    """Write a results file for ``case``: ``global_`` = {dtype: {name: array}},
    ``ranks`` = {dtype: {rank: {name: array}}} (atomically; what ``run-torch`` uses)."""
    import h5py

    from ..failstop import atomic_write

    def write(f):
        with h5py.File(f, "w") as h5:
            h5.attrs["case_digest"] = case.digest
            for dtype, arrays in (global_ or {}).items():
                for name, array in arrays.items():
                    h5.create_dataset(f"{dtype}/global/{name}", data=array)
            for dtype, per_rank in (ranks or {}).items():
                for r, arrays in per_rank.items():
                    for name, array in arrays.items():
                        h5.create_dataset(f"{dtype}/rank/{r}/{name}", data=array)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write(path, write, binary=True)
