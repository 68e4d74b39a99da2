"""Case and results files (HDF5, no pickle): writing cases, reading and validating both.

Case file ``NAME.GRID.h5`` (written by ``refimpl oracle generate``)::

    /  attrs  format = "refimpl-oracle-case", format_version, refimpl_version, digest,
              case (JSON: every CaseSpec field: name, layer, input, out_channels, kernel, stride,
              padding, dilation, output_padding, grid, model_parallel, values, seed, dtypes,
              options: {name: value} of the layer kind's options), output_shape
    /<dtype>/inputs/{x, dy, w, b}            global inputs (w, b: conv weight/bias, or
                                             batch norm's scale/shift)
    /<dtype>/global/{y, dx, dw, db}          expected global outputs and gradients
    /<dtype>/rank/<r>/...                    expected blocks of rank r (expect.py lists them),
                                             each with attr ``offset`` (global index of its
                                             first element); the group's attrs hold r's layout
                                             (coords, samples, channels, owned, outputs, needed)

``<dtype>`` is ``float64`` and/or ``float32``.  A results file has the same layout,
holds what an implementation computed (any subset of it), and carries the case's
``digest`` as its root attribute ``case_digest``::

    /  attrs  case_digest = <the case's digest>
    /<dtype>/global/{y, dx, dw, db}          optional: the gathered global results (any of them)
    /<dtype>/rank/<r>/{y, dx, dw, db, ...}   optional: rank blocks (any ranks, any tensors)

A rank block with an ``offset`` attribute (the global index of its first element: 5
entries, or 3 spatial ones for a 5-d block) is placed there, whatever split produced it
(empty blocks included); without one it is the case's block of rank r.  Parameter
gradients may be given by one rank, or in ``global``.

Structurally unusable input (unreadable or truncated file, a case from another refimpl
version, an unknown dataset, a wrong dtype, a bad ``offset``) raises ``UnusableInput``
naming the file and dataset.  Values are not judged here: NaN/inf values and blocks whose
shape cannot be placed are mismatches, which ``compare`` locates (``Results.shape_errors``).
Both files are untrusted: every dataset's dtype is checked, its shape is placed inside the
global tensor, and its declared size is checked against the bytes the file stores
(``data.reader.check_stored``) before it is read: a 6 KB file declaring a 700 GB dataset is
refused, not allocated.
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
FORMAT_VERSION = 2                  # 2: the layer's options as one 'options' object of the case
GLOBAL_TENSORS = ("y", "dx", "dw", "db")
#: per-rank tensors an implementation may report for every kind (the first two, and dw/db where
#: the layer has parameters, are required; the rest are compared when present); a kind with
#: statistics adds its partial tensors (``rank_tensors``)
RANK_TENSORS = ("y", "dx", "dw", "db", "x_needed", "dx_needed", "y_partial", "dw_partial", "db_partial")


def rank_tensors(spec) -> tuple:
    """The per-rank tensors of a case: ``RANK_TENSORS`` and its layer kind's statistics."""
    return RANK_TENSORS + layers.lookup(spec.layer).statistic_names()


#: per-rank tensors that are blocks of an activation (placed by the rank's spatial block)
ACTIVATIONS = ("y", "dx", "x_needed", "dx_needed", "y_partial")


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
    from ..atomic import atomic_write, hdf5_file
    path = os.path.join(directory, spec.file_name)
    content = {dtype: expect.expectations(spec, dtype) for dtype in spec.dtypes}
    layouts = expect.rank_layouts(spec)

    def write(f):
        with hdf5_file(f) as (h5, _):
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

    from ..paths import special_kind
    kind = special_kind(path)
    if kind is not None:                       # h5py would block on a FIFO forever
        raise UnusableInput(f"{what} {path} is {kind}, not a regular file")
    try:
        return h5py.File(path, "r")
    except FileNotFoundError:
        raise UnusableInput(f"{what} {path}: no such file") from None
    except OSError as err:
        raise UnusableInput(f"{what} {path}: not a readable HDF5 file (truncated or corrupt?): {err}") from None


def digest_attribute(h5, name: str, path: str, what: str) -> str | None:
    """The root attribute ``name`` (a digest) of a results file as text, None if absent;
    UnusableInput naming the file and the attribute when it is not one string (an array,
    a number: another writer's mistake, not a digest to compare)."""
    got = h5.attrs.get(name)
    if isinstance(got, (bytes, numpy.bytes_)):         # a fixed-length string from another writer
        try:
            got = got.decode()
        except UnicodeDecodeError:
            raise UnusableInput(f"{what} {path}: root attribute {name!r} is not UTF-8 text") from None
    if got is not None and not isinstance(got, str):
        raise UnusableInput(f"{what} {path}: root attribute {name!r} must be one string (the digest), got "
                            f"{type(got).__name__} {numpy.shape(got)}")
    return got


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
    kind = layers.lookup(spec.layer)
    w, b = kind.parameter_shapes(spec) or (None, None)
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
            per.update({"dw": wr, "dw_partial": wr, "db": br, "db_partial": br})
        per.update({stat.name: tuple(stat.shape(spec, lo)) for stat in kind.statistics})
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
    """What an implementation reported for one case (any subset of it).

    ``global_``: dtype -> {name: array}; ``ranks``: dtype -> {rank: {name: array}} (the
    results' own rank numbers); ``offsets``: dtype -> {rank: {name: offset}}, the global index
    of each block's first element (its ``offset`` attribute, or the case's block of that rank
    when it has none); ``given``: the (dtype, rank, name) whose offset the file gave;
    ``shape_errors``: tensors whose shape cannot be placed in the global tensor (not read;
    ``compare`` reports them as mismatches), as dicts (dtype, tensor, rank (None: global),
    shape, offset (None: not given)); ``excess``: rank blocks that run past the tensor's end
    (held in ``ranks`` cut to their in-range cells; ``compare`` reports the excess), as dicts
    (dtype, tensor, rank, shape (as written), offset)."""
    path: str
    global_: dict = field(default_factory=dict)
    ranks: dict = field(default_factory=dict)
    offsets: dict = field(default_factory=dict)
    given: set = field(default_factory=set)
    shape_errors: list = field(default_factory=list)
    excess: list = field(default_factory=list)

    def own_layout(self, case, dtype) -> bool:
        """True when the per-rank blocks of ``dtype`` are not the case's (another split, other
        ranks): then ranks are named by the results' layout."""
        expected = case.ranks.get(dtype, [])
        for r, names in self.offsets.get(dtype, {}).items():
            for name, offset in names.items():
                if r >= len(expected) or name not in expected[r]:
                    return True
                want, want_offset = expected[r][name]
                if tuple(offset) != tuple(want_offset) or self.ranks[dtype][r][name].shape != want.shape:
                    return True
        return any(e["dtype"] == dtype and e["rank"] is not None and e["offset"] is not None
                   for e in self.shape_errors)


def required(case: Case) -> tuple:
    """The tensors every case has results for: y and dx, and dw, db for layers with parameters."""
    return ("y", "dx") + (("dw", "db") if "dw" in next(iter(case.expected.values())) else ())


def domain_shape(case: Case, dtype: str, name: str) -> tuple:
    """The global tensor a (per-rank) results tensor is a block of."""
    expected = case.expected[dtype]
    if name in ("y", "y_partial"):
        return expected["y"].shape
    if name in ("dx", "x_needed", "dx_needed"):
        return expected["dx"].shape
    if name in ("dw", "dw_partial"):
        return expected["dw"].shape
    statistic = next((s for s in layers.lookup(case.spec.layer).statistics if s.name == name), None)
    if statistic is not None:            # a partial statistic: the kind says its whole shape
        return tuple(statistic.shape(case.spec, None))
    return expected["db"].shape          # db, db_partial


def _offset_attr(dataset, ndim, where):
    """The ``offset`` attribute of a results dataset (a global start per axis; for a 5-d block
    3 entries are spatial, samples and channels then start at 0); None if absent."""
    if "offset" not in dataset.attrs:
        return None
    raw = numpy.asarray(dataset.attrs["offset"])
    if raw.ndim != 1 or raw.dtype.kind not in "iu" or len(raw) not in ((ndim, 3) if ndim == 5 else (ndim,)):
        raise UnusableInput(f"{where}: attribute 'offset' must be {ndim} integers (the global index of the "
                            f"block's first element" + (", or 3 spatial ones" if ndim == 5 else "")
                            + f"), got {raw.tolist()!r}")
    offset = tuple(int(o) for o in raw)
    return (0, 0) + offset if len(offset) < ndim else offset


def _read_group(h5, path, where, allowed, dtype, place):
    """The datasets of group ``where`` (any subset of ``allowed``): ``place(name, shape,
    offset)`` says where each goes: (offset, True) to read it, or (offset, False) for a shape
    that cannot be placed (recorded, not read)."""
    import h5py
    if not isinstance(h5[where], h5py.Group):
        raise UnusableInput(f"results file {path}: /{where} must be a group of datasets, found a dataset")
    unknown = sorted(set(h5[where]) - set(allowed))
    if unknown:
        raise UnusableInput(f"results file {path}: /{where}: unknown dataset(s) {unknown} (this case has: "
                            f"{sorted(allowed)})")
    out = {}
    for name in sorted(h5[where]):
        dataset = h5[f"{where}/{name}"]
        full = f"results file {path}: /{where}/{name}"
        if not isinstance(dataset, h5py.Dataset):
            raise UnusableInput(f"{full} must be a dataset")
        if dataset.dtype != numpy.dtype(dtype):
            raise UnusableInput(f"{full}: dtype {dataset.dtype}, expected {dtype}")
        if dataset.shape is None:
            raise UnusableInput(f"{full}: no shape (an empty dataspace)")
        offset, fits = place(name, dataset.shape, _offset_attr(dataset, len(dataset.shape), full))
        array = _read(h5, f"{where}/{name}", path, "results file", numpy.dtype(dtype), dataset.shape) \
            if fits else None
        if isinstance(fits, tuple):            # the part of the block that is judged (slices)
            array = array[fits]
        out[name] = (array, offset, "offset" in dataset.attrs)
    return out


def _fits(shape, offset, domain) -> bool:
    return (offset is not None and len(shape) == len(domain)
            and all(0 <= o and o + n <= m for o, n, m in zip(offset, shape, domain)))


def _in_range(shape, offset, domain) -> tuple | None:
    """The shape of the part of a block at ``offset`` that lies inside ``domain``, where the
    block starts inside it (no negative offset) but runs past its end on some axis; None
    otherwise.  Such a block is compared on its in-range cells, and its excess is a finding
    of its own (``Results.excess``): one cell too many on one rank must not hide the right
    or wrong values of the rest."""
    if offset is None or len(shape) != len(domain) or any(o < 0 for o in offset):
        return None
    if all(o + n <= m for o, n, m in zip(offset, shape, domain)):
        return None
    return tuple(slice(0, max(0, min(n, m - o))) for o, n, m in zip(offset, shape, domain))


def _wider_halo(name, shape, offset, mine, domain) -> tuple | None:
    """The slices of a rank's x_needed / dx_needed that hold the case's block of that rank,
    where the results' halo buffer is wider than needed but inside the domain (docs/oracle.md
    allows it; cells outside the domain are padding, not data: a finding): the case's block
    is judged, and the rank keeps the case's layout; None otherwise."""
    if name not in ("x_needed", "dx_needed") or name not in mine or not _fits(shape, offset, domain):
        return None
    want, at = mine[name]
    if not all(o <= a and a + n <= o + m for o, m, a, n in zip(offset, shape, at, want.shape)):
        return None
    return tuple(slice(a - o, a - o + n) for o, a, n in zip(offset, at, want.shape))


def load_results(path: str, case: Case) -> Results:
    """Read a results file for ``case`` and validate its structure (``UnusableInput`` if it
    cannot be checked).  Values are not judged here: NaN/inf and wrong shapes are
    mismatches that ``compare`` locates."""
    try:
        return _load_results(path, case)
    except (TypeError, AttributeError, KeyError, OSError) as err:    # e.g. a dataset where a group belongs
        raise UnusableInput(f"results file {path}: not laid out as docs/oracle.md describes "
                            f"({type(err).__name__}: {err})") from None


def _load_results(path: str, case: Case) -> Results:
    import h5py
    with _open(path, "results file") as h5:
        got = digest_attribute(h5, "case_digest", path, "results file")
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

                def place_global(name, shape, offset, expected=expected, dtype=dtype):
                    if offset is not None and any(offset):
                        raise UnusableInput(f"results file {path}: /{dtype}/global/{name}: a global tensor "
                                            f"starts at 0, its 'offset' is {list(offset)}")
                    fits = tuple(shape) == expected[name].shape
                    if not fits:
                        results.shape_errors.append({"dtype": dtype, "tensor": name, "rank": None,
                                                     "shape": tuple(shape), "offset": None})
                    return (0,) * len(shape), fits
                read = _read_group(h5, path, f"{dtype}/global", [k for k in GLOBAL_TENSORS if k in expected],
                                   dtype, place_global)
                results.global_[dtype] = {k: a for k, (a, _, _) in read.items() if a is not None}
            if "rank" in group:
                if not isinstance(group["rank"], h5py.Group):
                    raise UnusableInput(f"results file {path}: /{dtype}/rank must be a group of rank groups")
                bad = [r for r in group["rank"] if not r.isdigit() or (len(r) > 1 and r[0] == "0")]
                if bad:
                    raise UnusableInput(f"results file {path}: /{dtype}/rank holds {sorted(bad)}: rank groups "
                                        f"are named by their rank number (0, 1, ...)")
                allowed = sorted({k for arrays in case.ranks[dtype] for k in arrays
                                  if k in rank_tensors(case.spec)})
                results.ranks[dtype], results.offsets[dtype] = {}, {}
                for r in sorted(int(name) for name in group["rank"]):
                    mine = case.ranks[dtype][r] if r < case.spec.ranks else {}

                    def place_rank(name, shape, offset, r=r, mine=mine, dtype=dtype):
                        where = f"results file {path}: /{dtype}/rank/{r}/{name}"
                        if offset is None and name not in mine and name not in ACTIVATIONS:
                            offset = (0,) * len(shape)      # a parameter tensor of a rank the case lacks: whole
                        if offset is None:
                            if name not in mine:
                                raise UnusableInput(f"{where}: no 'offset' attribute, and the case has no rank "
                                                    f"{r} to place it by (ranks 0..{case.spec.ranks - 1}): "
                                                    f"give each block of another split its 'offset'")
                            want, at = mine[name]
                            fits = tuple(shape) == want.shape
                            at = tuple(at)
                        else:
                            at = offset
                            fits = _fits(shape, offset, domain_shape(case, dtype, name))
                        domain = domain_shape(case, dtype, name)
                        wider = _wider_halo(name, shape, offset, mine, domain)
                        if wider is not None and tuple(shape) != mine[name][0].shape:
                            return tuple(mine[name][1]), wider
                        cut = None if fits else _in_range(shape, at, domain)
                        if cut is not None:          # compared on its in-range cells, the excess reported
                            results.excess.append({"dtype": dtype, "tensor": name, "rank": r,
                                                   "shape": tuple(shape), "offset": tuple(at)})
                            return tuple(min(o, m) for o, m in zip(at, domain)), cut
                        if not fits:
                            results.shape_errors.append({"dtype": dtype, "tensor": name, "rank": r,
                                                         "shape": tuple(shape), "offset": offset})
                        return at, fits
                    read = _read_group(h5, path, f"{dtype}/rank/{r}", allowed, dtype, place_rank)
                    results.ranks[dtype][r] = {k: a for k, (a, _, _) in read.items() if a is not None}
                    results.offsets[dtype][r] = {k: o for k, (a, o, _) in read.items() if a is not None}
                    results.given |= {(dtype, r, k) for k, (a, _, given) in read.items() if given}
    return results


def write_results(path: str, case: Case, global_: dict | None = None, ranks: dict | None = None) -> None:
    """Write a results file for ``case``: ``global_`` = {dtype: {name: array}},
    ``ranks`` = {dtype: {rank: {name: array}}} (atomically; what ``run-torch`` uses).  A rank's
    value may be ``(array, offset)``: the block is then written with its ``offset``
    attribute (a block of another split than the case's)."""

    from ..atomic import atomic_write, hdf5_file

    def write(f):
        with hdf5_file(f) as (h5, _):
            h5.attrs["case_digest"] = case.digest
            for dtype, arrays in (global_ or {}).items():
                for name, array in arrays.items():
                    h5.create_dataset(f"{dtype}/global/{name}", data=array)
            for dtype, per_rank in (ranks or {}).items():
                for r, arrays in per_rank.items():
                    for name, array in arrays.items():
                        array, offset = array if isinstance(array, tuple) else (array, None)
                        dataset = h5.create_dataset(f"{dtype}/rank/{r}/{name}", data=array)
                        if offset is not None:
                            dataset.attrs["offset"] = numpy.asarray(offset, dtype=numpy.int64)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write(path, write, binary=True)
