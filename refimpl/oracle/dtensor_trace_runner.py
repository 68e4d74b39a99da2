"""One rank of ``refimpl oracle run-dtensor --trace``: a DTensor-sharded training step of a
trace's model, every layer's local shards written with their offsets.

Started N times by ``dtensor_adapter.run_trace`` (N: the trace grid's rank count; gloo on
the CPU)::

    RANK=r WORLD_SIZE=N MASTER_ADDR=127.0.0.1 MASTER_PORT=P \\
        python -m refimpl.oracle.dtensor_trace_runner PARTS_DIR TIMEOUT_S JOBS.json

``JOBS.json`` holds ``[[trace file, dtype], ...]``.  For each, rank r:

1. builds a ``DeviceMesh`` shaped like the trace's grid (the axes n, d, h, w of size > 1,
   as ``run-dtensor`` does for a layer case) and the model's PyTorch twin
   (``model_twins.py``: the trace's module names), loads the trace's initial parameters
   and makes every parameter a ``Replicate`` DTensor — what a DTensor user does to a
   ``torch.nn`` model for data and spatial parallelism;
2. distributes the batch: x ``Shard(0)`` on n and ``Shard(2|3|4)`` on d, h, w; the target
   ``Shard(0)`` on n;
3. runs the trace's steps: forward with a hook on every layer of the trace (its input is
   kept for its gradient, its output's local shard written as ``y`` with the offset
   DTensor's placements give — or, where the local shape contradicts them, the offset
   its shape gives: ``dtensor_adapter.offset_by_shape``), the loss, ``backward``, each
   layer input's gradient written as ``dx`` the same way, the parameter gradients
   gathered (``full_tensor``) and written once by rank 0, the optimizer's step (the
   trace's SGD or Adam) and the parameters after it.

Whatever fails (a refusal, a crash) is recorded in ``PARTS_DIR/rank<r>.json`` with its
stage and layer; what was written before stays, so ``refimpl oracle trace check`` judges
the layers the step reached.  The first failure ends the rank (exit status 3).
"""
from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

from .dtensor_runner import TENSOR_DIM, classify, first_line, local_with_offset, mesh_layout, rank_main


class Writer:
    """Rank r's results of one (trace, dtype), written as they come into PARTS_DIR."""

    def __init__(self, parts, rank, dtype):
        self.h5 = os.path.join(parts, f"rank{rank}.{dtype}.h5")
        self.json = os.path.join(parts, f"rank{rank}.{dtype}.json")
        self.rank, self.dtype, self.events = rank, dtype, []

    def array(self, name, array, offset=None, claimed=None, placements=None):
        import h5py
        with h5py.File(self.h5, "a") as h5:
            ds = h5.create_dataset(name, data=array)
            if offset is not None:
                ds.attrs["offset"] = offset
                ds.attrs["claimed_shape"] = claimed
                ds.attrs["placements"] = json.dumps(placements)

    def event(self, **record):
        self.events.append(record)
        tmp = self.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.events, f)
        os.replace(tmp, self.json)


def run_job(trace_path, dtype, rank, world, parts):
    """One (trace, dtype) on this rank; True if it ran to the end."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from .model_twins import load_parameters, torch_model
    from .trace import OPTIMIZERS, load_trace, model_config
    trace = load_trace(trace_path)
    spec = trace.spec
    data = trace.data[dtype]
    out = Writer(parts, rank, dtype)
    axes = mesh_layout(spec.grid)
    mesh = init_device_mesh("cpu", tuple(p for _, p in axes), mesh_dim_names=tuple(a for a, _ in axes))
    stage = {"where": "setup", "layer": None}
    try:
        config = model_config(spec.model, spec.preset, spec.input, overrides=spec.overrides)
        net = torch_model(spec.model, config, dropout_masks=data["steps"][0]["masks"] or None)
        net = (net.double() if dtype == "float64" else net.float()).train()
        load_parameters(net, data["initial"])
        for module in net.modules():                         # every parameter Replicate on the mesh
            for pname, p in list(module.named_parameters(recurse=False)):
                module.register_parameter(pname, torch.nn.Parameter(
                    distribute_tensor(p.detach(), mesh, [Replicate()] * len(axes))))
        modules = dict(net.named_modules())
        settings = OPTIMIZERS[spec.optimizer]
        params = list(net.parameters())
        optimizer = torch.optim.SGD(params, lr=settings["lr"], momentum=settings["momentum"]) \
            if spec.optimizer == "sgd" else torch.optim.Adam(params, lr=settings["lr"])
        x_placements = [Shard(TENSOR_DIM[a]) for a, _ in axes] if axes[0][1] > 1 else [Replicate()]
        t_placements = [Shard(0) if a == "n" else Replicate() for a, _ in axes] if axes[0][1] > 1 else [Replicate()]
        x = distribute_tensor(torch.as_tensor(data["x"]), mesh, x_placements)
        target = distribute_tensor(torch.as_tensor(data["target"]), mesh, t_placements)
        loss_fn = torch.nn.MSELoss() if spec.model == "cosmoflow" else torch.nn.CrossEntropyLoss()
        record = {}

        def pre_hook(name):
            def hook(module, args):
                stage.update(where="forward", layer=name)
                inp = args[0]
                if inp.requires_grad:
                    inp = inp.clone()               # this layer's own input: its gradient is this layer's dx
                    inp.retain_grad()
                record[name] = {"x": inp}
                return (inp,)
            return hook

        def post_hook(name):
            def hook(module, args, result):
                record[name]["y"] = result
                _write_shard(out, trace, spec, f"step/{step}/{name}/y", name, "y", result, rank)
                return None
            return hook

        for entry in trace.layers:
            modules[entry["name"]].register_forward_pre_hook(pre_hook(entry["name"]))
            modules[entry["name"]].register_forward_hook(post_hook(entry["name"]))
        for step in range(spec.steps):
            for name, mask in data["steps"][step]["masks"].items():     # the trace's masks, on the mesh too
                modules[name].mask = distribute_tensor(torch.as_tensor(mask), mesh, [Replicate()] * len(axes))
            optimizer.zero_grad()
            record.clear()
            stage.update(where="forward", layer=trace.layers[0]["name"])
            result = net(x)
            stage.update(where="loss", layer=None)
            loss = loss_fn(result, target)
            loss_value = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
            if rank == 0:
                out.array(f"step/{step}/loss", loss_value.detach().numpy())
            stage.update(where="backward", layer=None)
            loss.backward()
            for entry in reversed(trace.layers):
                name = entry["name"]
                stage.update(where="backward", layer=name)
                grad = record[name]["x"].grad
                if grad is not None:
                    _write_shard(out, trace, spec, f"step/{step}/{name}/dx", name, "dx", grad, rank)
                for tensor, attr in (("dw", "weight"), ("db", "bias")):
                    g = getattr(modules[name], attr, None)
                    g = None if g is None else g.grad
                    if g is not None and tensor in entry["params"]:
                        g = g.full_tensor() if hasattr(g, "full_tensor") else g
                        if rank == 0:
                            out.array(f"step/{step}/{name}/global/{tensor}", g.detach().numpy())
            stage.update(where="update", layer=None)
            optimizer.step()
            for pname, p in net.named_parameters():
                value = p.full_tensor() if hasattr(p, "full_tensor") else p
                if rank == 0:
                    out.array(f"step/{step}/update/{pname}", value.detach().numpy())
            out.event(status="ok", stage="step", step=step)
        return True
    except Exception as err:                                         # noqa: BLE001 (the peer's failure)
        out.event(status=classify(err), stage=stage["where"], layer=stage["layer"], error=first_line(err))
        return False


def _write_shard(out, trace, spec, path, layer, tensor, value, rank):
    """A DTensor's local shard (or a plain tensor, whole) with its offset: DTensor's, or the
    one its shape gives where the shape contradicts DTensor's placements."""
    import numpy
    from torch.distributed.tensor import DTensor

    from .dtensor_adapter import offset_by_shape_in
    shape = trace.layer(layer)["y_shape" if tensor == "y" else "x_shape"]
    if isinstance(value, DTensor):
        local, offset, claimed, where = local_with_offset(value)
    else:                                                            # a plain tensor: the whole of it
        local = value.detach().contiguous().numpy()
        offset, claimed, where = [0] * local.ndim, list(local.shape), ["plain tensor"]
    if list(local.shape) != list(claimed):
        offset = offset_by_shape_in(mesh_layout(spec.grid), rank, tuple(shape), local.shape, offset)
    out.array(path, numpy.ascontiguousarray(local), [int(o) for o in offset], [int(n) for n in claimed], where)


def run(parts, timeout_s, jobs):
    import torch.distributed as dist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    for trace_path, dtype in jobs:
        if not run_job(trace_path, dtype, rank, world, parts):
            return False
    dist.barrier()
    dist.destroy_process_group()
    return True


def main(argv=None):
    return rank_main(run, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
