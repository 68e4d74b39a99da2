"""One rank of ``refimpl oracle run-dtensor``: PyTorch DTensor runs the cases' layers.

Started N times by ``dtensor_adapter`` (one process per rank, gloo on the CPU)::

    RANK=r WORLD_SIZE=N MASTER_ADDR=127.0.0.1 MASTER_PORT=P \\
        python -m refimpl.oracle.dtensor_runner PARTS_DIR TIMEOUT_S JOBS.json

``JOBS.json`` lists ``[case file, dtype]`` pairs, all cases with N ranks.  What rank r
does for each:

1. a ``DeviceMesh`` shaped like the case's grid, one mesh dimension per split axis
   (n, d, h, w, m; axes of size 1 are left out: a DTensor user would not name them);
2. ``distribute_tensor`` of the global x: ``Shard(0)`` on n, ``Shard(2|3|4)`` on d, h, w,
   ``Shard(1)`` on m for channel-parallel cases (Replicate otherwise); the parameters
   Replicate, or ``Shard`` along their output (filter-parallel) / input (channel-parallel)
   channel axis on m;
3. forward: the layer's own ``torch.nn.functional`` call from the layer registry
   (``torch_forward``) on the DTensors; rank r's local shard of y (Partial placements
   reduced first) goes to ``PARTS_DIR/<case>/rank<r>.h5`` with attribute ``offset``, the
   global index of its first element as DTensor's placements place it (torch.chunk
   splits), and ``claimed_shape``, the local shape those placements imply;
4. backward, in its own ``try``: ``y.backward(dy)`` with dy distributed like y; rank r's
   shard of dx (with its offset); dw and db gathered (``full_tensor``), written by rank 0.

Each step's outcome per tensor — ``ok``, ``refused`` (DTensor raised NotImplementedError,
or a RuntimeError from a ``raise`` of its own, for an op or sharding it does not support)
or ``crashed`` (anything else: a local kernel's error, a collective failing or timing
out) — goes to ``PARTS_DIR/<case>/rank<r>.json`` at once, so a rank that hangs or dies
later still leaves what it did; ``PARTS_DIR/rank<r>.progress`` lists the jobs after
which it went on.  A refusal that every rank records alike (sharding propagation, before any
message) lets the ranks go on to the next job; after any other failure a rank stops
(exit status 3, no barrier: its peers may sit in another collective) and the adapter
starts fresh ranks for the jobs left.
"""
from __future__ import annotations

import json
import linecache
import os
import sys
import time
import traceback
from datetime import timedelta

MESH_AXES = "ndhwm"                  # the grid's axes: samples, depth, height, width, model
TENSOR_DIM = {"n": 0, "d": 2, "h": 3, "w": 4}


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def classify(err: BaseException) -> str:
    """'refused' for DTensor declining an op or sharding, 'crashed' for everything else."""
    import torch.distributed as dist
    if isinstance(err, NotImplementedError):
        return "refused"
    if isinstance(err, RuntimeError) and not isinstance(err, dist.DistError):
        frames = traceback.extract_tb(err.__traceback__)
        if frames:
            last = frames[-1]
            code = (last.line or linecache.getline(last.filename, last.lineno)).strip()
            if "distributed/tensor" in last.filename.replace(os.sep, "/") and code.startswith("raise"):
                return "refused"
    return "crashed"


def mesh_layout(grid):
    """[(axis letter, size)] of the mesh for a grid (Pn, Pd, Ph, Pw[, Pm]) — a case's or a
    trace's: the axes of size > 1 (one axis if none)."""
    axes = [(MESH_AXES[i], p) for i, p in enumerate(grid) if p > 1]
    return axes or [("n", 1)]


def placements(spec, kind, axes, what):
    """Placements of x / w / b on the mesh ``axes``."""
    from torch.distributed.tensor import Replicate, Shard
    out_axis, in_axis = kind.weight_axes
    result = []
    for letter, _ in axes:
        if letter in TENSOR_DIM:
            result.append(Shard(TENSOR_DIM[letter]) if what == "x" else Replicate())
        elif letter == "m" and spec.model_parallel != "none":
            channel = spec.model_parallel == "channel"
            if what == "x":
                result.append(Shard(1) if channel else Replicate())
            elif what == "w":
                result.append(Shard(in_axis if channel else out_axis))
            else:                                   # the bias follows the output channels
                filter_like = not channel or not kind.mixes_channels
                result.append(Shard(0) if filter_like else Replicate())
        else:
            result.append(Replicate())
    return result


def local_with_offset(dt):
    """(local array, global offset, DTensor's claimed local shape, placements) of a DTensor."""
    from torch.distributed.tensor import Partial, Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    if any(isinstance(p, Partial) for p in dt.placements):
        dt = dt.redistribute(dt.device_mesh, [Replicate() if isinstance(p, Partial) else p
                                              for p in dt.placements])
    shape, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    local = dt.to_local().detach().contiguous().numpy()
    return local, [int(o) for o in offset], [int(s) for s in shape], [str(p) for p in dt.placements]


class Part:
    """Rank r's results and statuses for one case, written as they come (h5 and JSON files
    in PARTS_DIR/<case file name>/)."""

    def __init__(self, directory, rank, job, timeout_s):
        os.makedirs(directory, exist_ok=True)
        self.rank, self.job, self.timeout_s = rank, job, timeout_s
        self.h5 = os.path.join(directory, f"rank{rank}.h5")
        self.json = os.path.join(directory, f"rank{rank}.json")
        self.status = []
        if os.path.exists(self.json):            # an earlier launch's dtypes (the adapter relaunches)
            with open(self.json) as f:
                self.status = json.load(f)

    def array(self, dtype, name, array, offset, claimed, placements):
        import h5py
        with h5py.File(self.h5, "a") as h5:
            ds = h5.create_dataset(f"{dtype}/{name}", data=array)
            ds.attrs["offset"] = offset
            ds.attrs["claimed_shape"] = claimed
            ds.attrs["placements"] = json.dumps(placements)

    def record(self, dtype, tensor, status, error="", secondary=False, **extra):
        self.status.append({"dtype": dtype, "tensor": tensor, "status": status, "error": error,
                            "secondary": secondary, **extra})
        tmp = self.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.status, f)
        os.replace(tmp, self.json)

    def failure(self, dtype, tensor, err):
        """A step's exception; a gloo error (a peer died or hung) is marked secondary."""
        import torch.distributed as dist
        self.record(dtype, tensor, classify(err), first_line(err),
                    secondary=isinstance(err, dist.DistError) or "third_party/gloo" in str(err))


def uniform_refusal(parts, job, dtype, tensor, world, wait_s):
    """True when every rank recorded the same refusal for this step (DTensor's sharding
    propagation refuses on every rank alike, before any message): the ranks then agree on
    what comes next and may go on.  Read from the ranks' status files, for up to wait_s."""
    deadline = time.monotonic() + wait_s
    while True:
        seen = []
        for r in range(world):
            try:
                with open(os.path.join(parts, job, f"rank{r}.json")) as f:
                    rec = next((s for s in json.load(f) if s["dtype"] == dtype and s["tensor"] == tensor), None)
            except (OSError, ValueError):
                rec = None
            seen.append(rec)
        if all(rec is not None for rec in seen):
            return all(rec["status"] == "refused" and rec["error"] == seen[0]["error"] for rec in seen)
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def run_step(case, dtype, part, mesh, axes, world, parts):
    """One (case, dtype): forward, then backward; True if the ranks may go on."""
    import torch
    from torch.distributed.tensor import Partial, Replicate, distribute_tensor

    from .. import layers
    rank = part.rank
    spec = case.spec
    kind = layers.lookup(spec.layer)
    g = {k: torch.from_numpy(v.copy()) for k, v in case.inputs[dtype].items()}
    backward = ["dx"] + (["dw", "db"] if "w" in g else [])
    wait = part.timeout_s / 4
    try:                                                            # forward
        x = distribute_tensor(g["x"], mesh, placements(spec, kind, axes, "x")).requires_grad_(True)
        w = b = None
        if "w" in g:
            w = distribute_tensor(g["w"], mesh, placements(spec, kind, axes, "w")).requires_grad_(True)
            b = distribute_tensor(g["b"], mesh, placements(spec, kind, axes, "b")).requires_grad_(True)
        y = kind.torch_forward(spec, torch.nn.functional, x, w, b)
        local, offset, claimed, where = local_with_offset(y)
        part.array(dtype, "y", local, offset, claimed, where)
        part.record(dtype, "y", "ok", placements=where, local_shape=list(local.shape), claimed_shape=claimed)
    except Exception as err:                                        # noqa: BLE001 (the peer's failure)
        part.failure(dtype, "y", err)
        for name in backward:
            part.record(dtype, name, "crashed", "no forward to differentiate (y failed)")
        return uniform_refusal(parts, part.job, dtype, "y", world, wait)
    try:                                                            # backward
        dy = distribute_tensor(g["dy"], mesh, [Replicate() if isinstance(p, Partial) else p for p in y.placements])
        y.backward(dy)
    except Exception as err:                                        # noqa: BLE001
        for name in backward:
            part.failure(dtype, name, err)
        return uniform_refusal(parts, part.job, dtype, "dx", world, wait)
    grads = {"dx": x.grad, "dw": w.grad if w is not None else None, "db": b.grad if b is not None else None}
    ok = True
    for name in backward:
        try:
            grad = grads[name]
            if grad is None:
                raise RuntimeError(f"no gradient reached {name[1:]} (its .grad is None)")
            if name == "dx":
                local, offset, claimed, where = local_with_offset(grad)
            else:                                                   # given once, gathered
                where = [str(p) for p in grad.placements]
                local = grad.full_tensor().detach().contiguous().numpy()
                offset, claimed = [0] * local.ndim, list(grad.shape)
            if name == "dx" or rank == 0:
                part.array(dtype, name, local, offset, claimed, where)
            part.record(dtype, name, "ok", placements=where, local_shape=list(local.shape), claimed_shape=claimed)
        except Exception as err:                                    # noqa: BLE001
            part.failure(dtype, name, err)
            ok = False
    return ok


def run(parts, timeout_s, jobs):
    """Rank $RANK's part of ``jobs`` ([case path, dtype], in order, all with this world
    size); False once a step failed other than by a refusal all ranks share (the ranks may
    then disagree on which collective comes next: the adapter starts fresh ranks for the
    jobs left)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from .casefile import load_case

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    cases, meshes = {}, {}
    for path, dtype in jobs:
        if path not in cases:
            cases[path] = load_case(path)
        case = cases[path]
        axes = mesh_layout(case.spec.grid)
        key = tuple(axes)
        if key not in meshes:                 # a mesh per shape (new_group is collective: every rank alike)
            meshes[key] = init_device_mesh("cpu", tuple(p for _, p in axes), mesh_dim_names=tuple(a for a, _ in axes))
        part = Part(os.path.join(parts, case.name), rank, case.name, timeout_s)
        if not run_step(case, dtype, part, meshes[key], axes, world, parts):
            return False                      # not in the progress file: the adapter skips this job
        with open(os.path.join(parts, f"rank{rank}.progress"), "a") as f:
            f.write(f"{case.name}\t{dtype}\n")
    dist.barrier()
    dist.destroy_process_group()
    return True


def rank_main(run_jobs, usage, argv=None):
    """The command line of a rank process (this one's, and dtensor_trace_runner's):
    PARTS_DIR TIMEOUT_S JOBS.json; ``run_jobs(parts, timeout_s, jobs)`` False after a
    recorded failure ends the process with status 3 at once."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3:
        print(usage, file=sys.stderr)
        return 2
    with open(argv[2]) as f:
        jobs = json.load(f)
    if not run_jobs(argv[0], float(argv[1]), jobs):
        sys.stdout.flush()                    # peers may be blocked in a collective: no barrier
        sys.stderr.flush()
        os._exit(3)
    return 0


def main(argv=None):
    return rank_main(run, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
