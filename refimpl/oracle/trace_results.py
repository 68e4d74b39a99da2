"""A peer's results of a trace (``refimpl oracle trace check``'s RESULTS): read and validated.

Layout (docs/oracle.md, "Model traces")::

    /  attrs  trace_digest = <the trace file's digest>
    /<dtype>/step/<s>/<layer>/rank/<r>/<tensor>    y, dx, dw, db; attribute ``offset`` (optional)
    /<dtype>/step/<s>/<layer>/global/<tensor>      dw, db given once (or y, dx whole)
    /<dtype>/step/<s>/loss
    /<dtype>/step/<s>/update/<parameter>           and update/rank/<r>/<parameter> (``offset``: a shard)

The file is untrusted, as a layer case's results (casefile.py): every dataset's dtype,
rank and extent are checked, and the bytes it declares stored (``data.reader.check_stored``),
before it is read.  Structural problems (another trace, an unknown name, a wrong dtype, a
malformed offset) raise ``UnusableInput`` (exit 2); a block that does not fit its layer's
tensor is a finding (``Peer.shape_errors``), as a wrong output size is.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy

from . import trace as T
from .casefile import UnusableInput, digest_attribute


@dataclass
class Peer:
    """A results file: dtype -> step -> {"layers": {layer: {"rank": {r: {t: (array, offset)}},
    "global": {t: array}}}, "loss", "update": {p: array}, "update_ranks": {r: {p: (array,
    offset)}}}; ``shape_errors`` lists blocks that cannot be placed (findings, not unusable
    input)."""
    path: str
    steps: dict = field(default_factory=dict)
    shape_errors: list = field(default_factory=list)


def load_names(path: str | None, trace: T.Trace) -> dict:
    """``--names FILE``: TOML ``peer_name = "canonical.name"`` (a layer or a parameter)."""
    if path is None:
        return {}
    from ..config import read_toml
    table = read_toml(path, "--names")                # peer names as written (no '-' -> '_')
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
    param_layer = {p: (e, t) for e in trace.layers for t, p in e["params"].items()}
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
        got = digest_attribute(h5, "trace_digest", path, what)
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
                                        w = f"{where}/rank/{r_key}/{pk}"
                                        pname = _param_name(pk, names, param_shapes, w, bad)
                                        dataset, shape = group[key]["rank"][r_key][pk], param_shapes[pname]
                                        start = offset(dataset, w, len(shape)) if isinstance(dataset, _h5dataset()) \
                                            else None
                                        array = read(dataset, w, dtype, len(shape), shape)
                                        start = _parameter_offset(array, start, shape, *param_layer[pname], trace,
                                                                  int(r_key), w, bad)
                                        entry["update_ranks"].setdefault(int(r_key), {})[pname] = (array, start)
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
                    if t in ("dw", "db"):
                        start = _parameter_offset(array, start, shapes[t], entry, t, trace, r, w, bad)
                    elif start is None:
                        if r >= trace.spec.ranks:
                            bad(w, f"no 'offset' attribute, and the trace's grid has no rank {r} to place it by "
                                   f"(ranks 0..{trace.spec.ranks - 1})")
                        start = [s.start for s in T.layer_slices(entry, t, trace.spec.grid, r)]
                    problem = _placement(array.shape, start, shapes[t], t, r)
                    if problem:
                        peer.shape_errors.append((dtype, step, entry["name"], t, r, problem))
                        continue
                    out["rank"].setdefault(r, {})[t] = (array, start)
        else:
            bad(f"{where}/{key}", "unknown group (expected 'rank' or 'global')")


def _parameter_offset(array, start, shape, entry, tensor, trace, rank, where, bad):
    """Where a rank's parameter gradient or update lies in the whole parameter: its
    ``offset``; without one, at 0 when it is the whole parameter, else at the rank's share of
    a layer the model axis splits (``trace.param_slices``)."""
    if start is not None:
        return start
    if tuple(array.shape) == tuple(shape):
        return [0] * len(shape)
    if rank < trace.spec.ranks:
        share = T.param_slices(entry, tensor, shape, trace.spec.grid, rank)
        if tuple(s.stop - s.start for s in share) == tuple(array.shape):
            return [s.start for s in share]
    bad(where, f"shape {tuple(array.shape)} is neither the whole parameter {tuple(shape)} nor rank {rank}'s "
               f"share of it: give an 'offset' attribute (the global index of its first element)")


def _h5dataset():
    import h5py
    return h5py.Dataset


def _placement(shape, start, global_shape, tensor, rank):
    for axis, (a, n, total) in enumerate(zip(start, shape, global_shape)):
        if a + n > total:
            return (f"rank {rank}'s {tensor} has {n} elements along axis {axis} at offset {a}, "
                    f"the layer has {total - min(a, total)} there (global extent {total})")
    return None



__all__ = ["Peer", "load_names", "load_peer"]
