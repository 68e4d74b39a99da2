"""``refimpl oracle run-dtensor``: PyTorch DTensor as the implementation under test.

Where ``run-torch`` (torch_adapter.py) plays a partitioned implementation inside one
process, this adapter hands each case to a real one: ``torch.distributed.tensor``
(DeviceMesh, Shard, Replicate, distribute_tensor) on N processes talking gloo on the
CPU.  It starts N ranks (``python -m refimpl.oracle.dtensor_runner``; N is the case's
rank count; consecutive cases with the same N share a launch), waits for them
(``--timeout`` a case; a hung rank is killed), and merges what they wrote into one
results file per case, in DTensor's *own* layout:

    /  attrs  case_digest
    /<dtype>/rank/<r>/{y, dx}    rank r's local shards, each with attribute ``offset``: the
                                 global index of its first element (N, C, D, H, W), from
                                 DTensor's placements: torch.chunk splits, so W = 6 over 4
                                 ranks is 2, 2, 2, 0 (an empty shard's offset is where it
                                 would start), not refimpl's balanced 2, 2, 1, 1
    /<dtype>/global/{dw, db}     parameter gradients, given once (rank 0's full_tensor())

Whatever a rank could not compute is left out (partial results); each (case, dtype,
tensor) gets a status in ``DIR/dtensor_summary.json``: ``ok``, ``refused`` (DTensor
raised NotImplementedError or one of its own RuntimeErrors: an op or sharding it does not
support), ``crashed`` (any other error, a rank that died or hung), with the exception's
first line.  The forward and the backward run in separate ``try`` blocks, so a failing
backward still leaves y.  ``verdicts`` folds a case's statuses and its ``oracle check``
report into one word per tensor (pass / fail / refused / crashed: docs/peers.md's tables).

torch is imported only by the rank processes (dtensor_runner.py), never here.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

SUMMARY = "dtensor_summary.json"
STATUSES = ("ok", "refused", "crashed")


def torch_version() -> str:
    """PyTorch's version without importing it (ValueError if it is not installed)."""
    from importlib import metadata
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        raise ValueError("run-dtensor needs PyTorch: pip install 'refimpl[oracle]'") from None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(parts: str, world: int, timeout_s: float, jobs: list, runner: str = "refimpl.oracle.dtensor_runner") -> dict:
    """Start ``world`` rank processes of ``runner`` on ``jobs`` ([case or trace path, dtype],
    in order); {rank: exit description, or None for exit status 0 or 3 (stopped after a
    recorded failure)}."""
    port = _free_port()
    jobs_file = os.path.join(parts, "jobs.json")
    with open(jobs_file, "w") as f:
        json.dump(jobs, f)
    env_base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "WORLD_SIZE": str(world), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    procs = []
    for r in range(world):
        log = open(os.path.join(parts, f"rank{r}.log"), "a")
        procs.append((subprocess.Popen(
            [sys.executable, "-m", runner, parts, str(timeout_s / 2), jobs_file],
            env={**env_base, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True), log))
    deadline = time.monotonic() + timeout_s * len({path for path, _ in jobs})
    exits = {}
    for r, (proc, log) in enumerate(procs):
        try:
            code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            exits[r] = None if code in (0, 3) else (f"rank {r} killed by signal {-code}" if code < 0 else
                                                   f"rank {r} exited with status {code}")
        except subprocess.TimeoutExpired:
            exits[r] = f"rank {r} did not finish in time (--timeout {timeout_s:g} s a case; killed)"
        log.close()
    for proc, _ in procs:                    # only the processes started here, by their ids
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return exits


def _progress(parts: str, world: int) -> set:
    """The (case name, dtype) jobs every rank finished."""
    done = None
    for r in range(world):
        try:
            with open(os.path.join(parts, f"rank{r}.progress")) as f:
                mine = {tuple(line.rstrip("\n").split("\t")) for line in f if line.strip()}
        except OSError:
            mine = set()
        done = mine if done is None else done & mine
    return done or set()


def _tail(parts: str, rank: int) -> str:
    try:
        with open(os.path.join(parts, f"rank{rank}.log")) as f:
            lines = [ln.strip() for ln in f if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def merge(case, parts: str, exits: dict):
    """(global_, ranks, records) from the ranks' part files (``parts``: the case's folder;
    ``exits``: how ranks ended, with the rank logs one level up): arrays with their
    offsets, and one status record per (dtype, tensor)."""
    import h5py
    import numpy
    tensors = ["y", "dx"] + (["dw", "db"] if "w" in case.inputs[case.spec.dtypes[0]] else [])
    status = {}
    for r in range(case.spec.ranks):
        try:
            with open(os.path.join(parts, f"rank{r}.json")) as f:
                status[r] = {(s["dtype"], s["tensor"]): s for s in json.load(f)}
        except (OSError, ValueError):
            status[r] = {}
    glob, ranks, records = {}, {}, []
    for dtype in case.spec.dtypes:
        for name in tensors:
            per = [status[r].get((dtype, name)) for r in range(case.spec.ranks)]
            missing = [r for r, s in enumerate(per) if s is None]
            bad = [(r, s) for r, s in enumerate(per) if s is not None and s["status"] != "ok"]
            refused = [(r, s) for r, s in bad if s["status"] == "refused"]
            primary = [(r, s) for r, s in bad if not s.get("secondary")]
            died = [r for r in range(case.spec.ranks) if exits.get(r)]
            if refused:                          # the first cause wins over its consequences
                verdict, error = "refused", f"rank {refused[0][0]}: {refused[0][1]['error']}"
            elif primary:
                verdict, error = "crashed", f"rank {primary[0][0]}: {primary[0][1]['error']}"
            elif bad or missing:                 # a peer died or hung: its own words, from its log
                r = (died or missing or [bad[0][0]])[0]
                said = _tail(os.path.dirname(parts), r) if r in died or r in missing else ""
                verdict, error = "crashed", (f"{exits.get(r) or f'rank {r} wrote no status'}: {said}" if said or
                                             r in missing else f"rank {r}: {bad[0][1]['error']}")
            else:
                verdict, error = "ok", ""
            ok_rec = next((s for s in per if s is not None and s["status"] == "ok"), None) or {}
            records.append({"dtype": dtype, "tensor": name, "status": verdict, "error": error,
                            "placements": ok_rec.get("placements"),
                            "shape_disagrees": sorted({r for r, s in enumerate(per) if s and s["status"] == "ok"
                                                       and s["local_shape"] != s["claimed_shape"]})})
    for r in range(case.spec.ranks):
        path = os.path.join(parts, f"rank{r}.h5")
        if not os.path.exists(path):
            continue
        with h5py.File(path, "r") as h5:
            for dtype in h5:
                for name in h5[dtype]:
                    ds = h5[f"{dtype}/{name}"]
                    array, offset = numpy.asarray(ds[()]), [int(o) for o in ds.attrs["offset"]]
                    claimed = [int(n) for n in ds.attrs.get("claimed_shape", array.shape)]
                    if list(array.shape) != claimed and name not in ("dw", "db"):
                        offset = offset_by_shape(case, r, dtype, name, array.shape, offset)
                    item = (array, offset)
                    if name in ("dw", "db"):
                        glob.setdefault(dtype, {})[name] = item
                    else:
                        ranks.setdefault(dtype, {}).setdefault(r, {})[name] = item
    return glob, ranks, records


def offset_by_shape(case, r, dtype, name, shape, offset) -> list:
    """Where rank r's local shard of a case's tensor ``name`` lies (``offset_by_shape_in``)."""
    from .casefile import domain_shape
    from .dtensor_runner import mesh_layout
    return offset_by_shape_in(mesh_layout(case.spec.grid), r, domain_shape(case, dtype, name), shape, offset)


def offset_by_shape_in(axes, r, domain, shape, offset) -> list:
    """Where rank r's local shard of a tensor of shape ``domain`` lies, from its ``shape``,
    where DTensor's placements claim another shape (a sharded result labelled Replicate is
    placed at 0 by its label): along each axis whose extent is not the whole, the
    torch.chunk block of the rank's coordinate on the mesh axis (of ``axes``, [(letter,
    size)], row-major as ``init_device_mesh`` lays ranks out) that splits it, if that block
    has the shard's extent (else DTensor's offset stays, and the oracle reports the
    misplaced block).  The label that contradicts the shape is reported apart (the
    summary's ``shape_disagrees``)."""
    from ..parallel.partition import ceil_block_range, grid_coords
    from .dtensor_runner import TENSOR_DIM
    coords = grid_coords(r, [p for _, p in axes])
    placed = list(offset)
    for d, (n, m) in enumerate(zip(shape, domain)):
        if n == m:
            placed[d] = 0
            continue
        split = [(c, p) for (letter, p), c in zip(axes, coords)
                 if TENSOR_DIM.get(letter) == d or (letter == "m" and d == 1)]
        if len(split) == 1:
            start, stop = ceil_block_range(m, split[0][1], split[0][0])
            if stop - start == n:
                placed[d] = start
    return placed


def write_results(path: str, case, glob: dict, ranks: dict) -> None:
    """The results file: the case's digest, rank shards with ``offset``, parameters once."""

    from ..atomic import atomic_write, hdf5_file

    def write(f):
        with hdf5_file(f) as (h5, _):
            h5.attrs["case_digest"] = case.digest
            h5.attrs["about"] = "refimpl oracle run-dtensor: PyTorch DTensor's own layout (docs/peers.md)"
            for dtype, arrays in glob.items():
                for name, (array, offset) in arrays.items():
                    h5.create_dataset(f"{dtype}/global/{name}", data=array).attrs["offset"] = offset
            for dtype, per_rank in ranks.items():
                for r, arrays in per_rank.items():
                    for name, (array, offset) in arrays.items():
                        h5.create_dataset(f"{dtype}/rank/{r}/{name}", data=array).attrs["offset"] = offset
    atomic_write(path, write, binary=True)


def run_cases(cases: list, out_dir: str, timeout_s: float = 120.0, keep_parts: bool = False, report=None) -> list:
    """Run DTensor on ``cases``; writes ``out_dir/<case file name>`` for each; returns their
    summary entries.  Consecutive cases with the same rank count share one launch (torch
    starts in seconds, a case runs in milliseconds); after a failure that may have left
    the ranks out of step, fresh ranks take the jobs left.  ``report(entry)`` is called as
    each case is written."""
    entries = []
    os.makedirs(out_dir, exist_ok=True)
    groups = []
    for case in cases:
        if groups and groups[-1][0].spec.ranks == case.spec.ranks:
            groups[-1].append(case)
        else:
            groups.append([case])
    for group in groups:
        world = group[0].spec.ranks
        parts = tempfile.mkdtemp(prefix=".run-dtensor.", dir=out_dir)
        try:
            start = time.perf_counter()
            todo = [(os.path.abspath(c.path), c.name, d) for c in group for d in c.spec.dtypes]
            exits = {c.name: {} for c in group}              # how ranks ended, by the case they failed on
            while todo:
                launched = launch(parts, world, timeout_s, [[path, d] for path, _, d in todo])
                done = _progress(parts, world)
                left = [i for i, (_, name, d) in enumerate(todo) if (name, d) not in done]
                if left:                                      # the first job not done failed: skip it
                    exits[todo[left[0]][1]].update({r: e for r, e in launched.items() if e})
                todo = todo[left[0] + 1:] if left else []
            seconds = (time.perf_counter() - start) / len(group)
            for case in group:
                folder = os.path.join(parts, case.name)
                os.makedirs(folder, exist_ok=True)
                glob, ranks, records = merge(case, folder, exits[case.name])
                write_results(os.path.join(out_dir, case.name), case, glob, ranks)
                entry = {"case": case.name, "layer": case.spec.layer, "grid": list(case.spec.grid),
                         "world": world, "seconds": round(seconds, 2), "tensors": records}
                entries.append(entry)
                if report is not None:
                    report(entry)
        finally:
            if not keep_parts:
                shutil.rmtree(parts, ignore_errors=True)
    return entries


def run_case(case, out_dir: str, timeout_s: float = 120.0) -> dict:
    """Run DTensor on one case (its own launch); its summary entry."""
    return run_cases([case], out_dir, timeout_s)[0]


def tensor_status(entry: dict) -> dict:
    """{tensor: ok / refused / crashed} of one summary entry, over its dtypes (the worst)."""
    worst = {}
    for rec in entry["tensors"]:
        old = worst.get(rec["tensor"], "ok")
        worst[rec["tensor"]] = max(old, rec["status"], key=STATUSES.index)
    return worst


def write_summary(out_dir: str, entries: list, nproc) -> str:
    from ..atomic import atomic_write
    path = os.path.join(out_dir, SUMMARY)
    flat = [{"case": e["case"], **{k: r[k] for k in ("dtype", "tensor", "status", "error")}}
            for e in entries for r in e.get("tensors", [])]
    text = json.dumps({"peer": f"torch.distributed.tensor (PyTorch {torch_version()}, gloo, CPU)",
                       "nproc": nproc, "records": flat, "cases": entries}, indent=1)
    atomic_write(path, lambda f: f.write(text))
    return path


VERDICTS = ("pass", "fail", "refused", "crashed")


def verdicts(entry: dict, report: dict | None) -> dict:
    """{tensor: pass / fail / refused / crashed} of one case over its dtypes (the worst):
    DTensor's own status (``entry``: the case's summary entry) where it computed nothing,
    else the verdict of ``refimpl oracle check`` (``report``: the case's entry of its
    ``--json``): fail if any block mismatches, or if part of the tensor was not provided
    although DTensor said it computed it."""
    out = {}
    for tensor, status in tensor_status(entry).items():
        if status != "ok":
            out[tensor] = status
            continue
        if report is None:
            out[tensor] = "fail"
            continue
        bad = any(f["tensor"] == tensor and not f["ok"] for f in report.get("findings", ()))
        gap = any(n["tensor"] == tensor for n in report.get("not_provided", ()))
        out[tensor] = "fail" if bad or gap or report.get("error") else "pass"
    return out


# ---------------------------------------------------------------- a whole model's step (run-dtensor --trace)

def run_trace(trace, out_path: str, timeout_s: float = 300.0) -> list:
    """DTensor runs the trace's steps on the trace grid's ranks (dtensor_trace_runner.py, one
    launch per dtype); the ranks' shards are merged into one results file in the trace
    results layout (docs/oracle.md, "Model traces"; each block with its ``offset``, dw and db
    once in ``global``), written atomically to ``out_path``.  Returns the events: per dtype
    and rank, the steps that ran and the first failure (stage, layer, refused/crashed, the
    exception's first line), or how the rank ended."""
    import h5py
    import numpy

    from ..atomic import atomic_write, hdf5_file
    if trace.spec.model_dims > 1 or trace.spec.model_parallel != "none":
        raise ValueError(f"run-dtensor --trace {trace.path}: the DTensor CosmoFlow shards the batch and the "
                         f"volume (grids Pn,Pd,Ph,Pw); this trace splits channels over a model axis "
                         f"(grid {list(trace.spec.grid)}, model_parallel {trace.spec.model_parallel!r})")
    world = trace.spec.ranks
    directory = os.path.dirname(os.path.abspath(out_path))
    parts = tempfile.mkdtemp(prefix=".run-dtensor-trace.", dir=directory)
    events, arrays = [], {}
    try:
        for dtype in trace.spec.dtypes:
            exits = launch(parts, world, timeout_s, [[os.path.abspath(trace.path), dtype]],
                           runner="refimpl.oracle.dtensor_trace_runner")
            for r in range(world):
                try:
                    with open(os.path.join(parts, f"rank{r}.{dtype}.json")) as f:
                        mine = json.load(f)
                except (OSError, ValueError):
                    mine = []
                failed = [e for e in mine if e["status"] != "ok"]
                events.append({"dtype": dtype, "rank": r, "steps": sum(e["status"] == "ok" for e in mine),
                               "failure": failed[0] if failed else None,
                               "exit": exits.get(r) or None, "log": _tail(parts, r) if exits.get(r) else ""})
                path = os.path.join(parts, f"rank{r}.{dtype}.h5")
                if not os.path.exists(path):
                    continue
                with h5py.File(path, "r") as h5:
                    def visit(name, obj, r=r, dtype=dtype):
                        if isinstance(obj, h5py.Dataset):
                            arrays[(dtype, r, name)] = (numpy.asarray(obj[()]),
                                                        [int(o) for o in obj.attrs["offset"]]
                                                        if "offset" in obj.attrs else None,
                                                        obj.attrs.get("placements"),
                                                        [int(n) for n in obj.attrs.get("claimed_shape", [])])
                    h5.visititems(visit)
    finally:
        shutil.rmtree(parts, ignore_errors=True)

    def write(f):
        with hdf5_file(f) as (h5, _):
            h5.attrs["trace_digest"] = trace.digest
            h5.attrs["about"] = "refimpl oracle run-dtensor --trace: PyTorch DTensor's own layout (docs/peers.md)"
            for (dtype, r, name), (array, offset, _, _) in sorted(arrays.items()):
                step, _, rest = name.partition("/")[2].partition("/")
                head, _, tensor = rest.rpartition("/")
                if offset is not None:                         # a layer's y or dx: rank r's block
                    h5.create_dataset(f"{dtype}/step/{step}/{head}/rank/{r}/{tensor}",
                                      data=array).attrs["offset"] = offset
                else:                                          # loss, update, global dw / db: rank 0 once
                    h5.create_dataset(f"{dtype}/{name}", data=array)
    atomic_write(out_path, write, binary=True)
    for (dtype, r, name), (array, offset, placements, claimed) in sorted(arrays.items()):
        if offset is not None and claimed and list(array.shape) != claimed:
            events.append({"dtype": dtype, "rank": r, "mislabelled": name, "placements": placements,
                           "claimed_shape": claimed, "local_shape": list(array.shape)})
    return events
