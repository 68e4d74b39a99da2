"""What a split of training data *is*, in a few lines: recorded in a run's checkpoint, checked on resume.

Why: a run's data directory can be regenerated or replaced while the run is stopped
(``datagen --overwrite``, a copy from elsewhere).  ``--resume`` would then train its
remaining steps on other data, silently: the loader's position and the input statistics
in the checkpoint refer to samples that are gone.  So the checkpoint holds each split's
identity and ``refimpl train --resume`` compares it with what the directory holds now
(``--data-changed-ok`` says a change is meant).

An identity is cheap to take at any size: the layout, the sample count and shape, the
target kind, the writer's attributes (``generator``, ``params``, ``seed``, ``first_index``:
refimpl datagen's, docs/data.md) and a SHA-256 over a bounded sample of the content — the
targets of every sample where they are small (CosmoFlow's parameters), and for the first,
middle and last sample the middle D-plane of every channel of ``full`` (C·H·W values) and
of ``labels``.  Data regenerated with the same generator, seed and sizes is the same data
and keeps its identity; another seed, size, sample count or file does not.
"""
from __future__ import annotations

import hashlib
import json
import os

import numpy

from .layout import DATA_KEY, LABEL_KEY, PER_SAMPLE_SUFFIXES, TARGET_KEY

#: the writer's root attributes that say what generated the data
WRITER_ATTRIBUTES = ("format", "version", "generator", "params", "seed", "first_index")
#: targets hashed whole below this many bytes (CosmoFlow's (N, 4) parameters); labels by plane
WHOLE_TARGET_BYTES = 1 << 20


def data_identity(path) -> dict:
    """The identity of the split at ``path`` (a ``single`` HDF5 file or a ``per-sample``
    directory); the file must be readable (HDF5Reader has opened it)."""
    import h5py
    path = os.fspath(path)
    if os.path.isdir(path):
        files = sorted(n for n in os.listdir(path) if n.endswith(PER_SAMPLE_SUFFIXES))
        picks = sorted({0, len(files) // 2, len(files) - 1})
        digest = hashlib.sha256(json.dumps(files).encode())
        writer, shape, kind = {}, None, None
        for i in picks:
            with h5py.File(os.path.join(path, files[i]), "r") as f:
                if i == 0:
                    writer, shape, kind = _writer(f), list(f[DATA_KEY].shape), _kind(f)
                _hash_sample(digest, f[DATA_KEY], None, f, kind)
        return {"layout": "per-sample", "samples": len(files), "sample_shape": shape, "kind": kind,
                "writer": writer, "content_sha256": digest.hexdigest()}
    with h5py.File(path, "r") as f:
        full, kind = f[DATA_KEY], _kind(f)
        n = full.shape[0]
        digest = hashlib.sha256()
        target = f[TARGET_KEY if kind == "cosmoflow" else LABEL_KEY]
        if target.size * target.dtype.itemsize <= WHOLE_TARGET_BYTES:
            _update(digest, target[()])
        for i in sorted({0, n // 2, n - 1}):
            _hash_sample(digest, full, i, f, kind)
        return {"layout": "single", "samples": int(n), "sample_shape": list(full.shape[1:]), "kind": kind,
                "writer": _writer(f), "content_sha256": digest.hexdigest()}


def changes(recorded: dict, now: dict) -> list[str]:
    """What differs between two identities of a split, in words (empty: the same data)."""
    out = []
    for key, what in (("layout", "layout"), ("samples", "sample count"), ("sample_shape", "sample shape"),
                      ("kind", "target kind")):
        if recorded.get(key) != now.get(key):
            out.append(f"{what} {recorded.get(key)} -> {now.get(key)}")
    mine, theirs = recorded.get("writer", {}), now.get("writer", {})
    for key in WRITER_ATTRIBUTES:
        if mine.get(key) != theirs.get(key):
            out.append(f"writer's {key} {mine.get(key)!r} -> {theirs.get(key)!r}")
    if not out and recorded.get("content_sha256") != now.get("content_sha256"):
        out.append("its content (sampled digest) differs")
    return out


def _kind(f) -> str:
    return "cosmoflow" if TARGET_KEY in f else "segmentation"


def _writer(f) -> dict:
    """The writer's attributes, as JSON-able values (numpy scalars made plain, JSON text parsed)."""
    out = {}
    for key in WRITER_ATTRIBUTES:
        if key in f.attrs:
            value = f.attrs[key]
            if isinstance(value, bytes):
                value = value.decode("utf-8", "replace")
            if isinstance(value, str) and value[:1] in "{[":
                try:
                    value = json.loads(value)
                except ValueError:
                    pass
            out[key] = value.item() if isinstance(value, numpy.generic) else value
    return out


def _hash_sample(digest, full, index, f, kind) -> None:
    """The middle D-plane of every channel of sample ``index`` (None: the file holds one
    sample), and its target: the parameters whole, the labels' same plane."""
    lead = () if index is None else (index,)
    d = full.shape[len(lead) + 1] // 2
    _update(digest, full[lead + (slice(None), d)])                          # (C, H, W)
    target = f[TARGET_KEY if kind == "cosmoflow" else LABEL_KEY]
    _update(digest, target[lead] if kind == "cosmoflow" else target[lead + (d,)])


def _update(digest, array) -> None:
    array = numpy.ascontiguousarray(array)
    digest.update(f"{array.dtype.str}{array.shape}".encode())
    digest.update(array.tobytes())


__all__ = ["data_identity", "changes"]
