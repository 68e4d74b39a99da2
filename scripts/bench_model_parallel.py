#!/usr/bin/env python
"""Bytes per rank per training step, per layer, of CosmoFlow on data, spatial, model and mixed grids,
next to what the cost formulas predict from the shapes alone; and the head's parameter memory.

    mpiexec --oversubscribe -n 8 python scripts/bench_model_parallel.py [--json FILE]

One CosmoFlow training step (forward, loss, backward, gradient allreduce) on each grid of the
world size in ``GRIDS`` (8 ranks: pure data (8,1,1,1), pure spatial (1,2,2,2), pure model
(1,1,1,1,8), mixed (2,2,1,1,2) and (2,1,1,1,4)); with a model axis the model splits its two conv
blocks (filter-parallel) and its head (Gholami's 1.5-D layers).  Every message is counted where
refimpl hands it to MPI, per layer:

- halo: the buffers ``HaloExchange`` sends (forward exchange + adjoint), predicted by
  ``partition.bytes_sent`` from the halo plan, the channels exchanged and the local batch;
- channel: what the channel allgathers / reduce-scatters exchange (``channels.TRAFFIC``: received
  in an allgather, contributed to a reduce-scatter), predicted by ``channels.moved_bytes``:
  ``(C - c_m) * N * V * itemsize``;
- allreduce: the payload each rank hands to an allreduce inside a layer (the spatial sum of the
  flatten-dense's partial products, the model-group sum of a replicated input's gradient),
  predicted from the output / input shape; what MPI's algorithm then sends is its business;
- gradients: the payload of the bucketed gradient allreduce (``GradientSynchronizer``): the
  rank's parameters, 1/Pm of each split one.

The table shows rank 0; "same on all ranks" says whether every rank's measured bytes equal its
own prediction.  The head's parameter bytes per rank fall as 1/Pm (fc1 and fc2 split by rows, the
4-output layer replicated).
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np
from mpi4py import MPI

from refimpl.progress import label_layers
from refimpl.models import build_model
from refimpl.nn import model_parallel as mp
from refimpl.nn import spatial
from refimpl.parallel import channels as channel_module
from refimpl.parallel.channels import TRAFFIC, moved_bytes
from refimpl.parallel.grad_sync import GradientSynchronizer
from refimpl.parallel.grid import ProcessGrid, format_grid
from refimpl.parallel.partition import bytes_sent

GRIDS = {8: [(8, 1, 1, 1), (1, 2, 2, 2), (1, 1, 1, 1, 8), (2, 2, 1, 1, 2), (2, 1, 1, 1, 4)],
         4: [(4, 1, 1, 1), (1, 2, 2, 1), (1, 1, 1, 1, 4), (2, 1, 1, 1, 2)],
         2: [(2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 1, 1, 2)], 1: [(1, 1, 1, 1)]}
CONFIG = {"input_shape": (4, 16, 16, 16), "conv_size": 8, "n_conv_layers": 2, "fc1_size": 32, "fc2_size": 16,
          "dropout": 0.5}
BATCH = 8
ITEM = 4        # float32


class Ledger:
    """Measured and predicted bytes per (layer, kind) on this rank; the layer being run."""

    def __init__(self):
        self.rows, self.current = {}, None

    def add(self, layer, kind, measured=0, predicted=0):
        row = self.rows.setdefault((layer, kind), [0, 0])
        row[0] += int(measured)
        row[1] += int(predicted)


def instrument(model, grid, ledger):
    """Wrap every layer's forward / backward: count what it sends, predict it from the shapes."""
    names = dict((id(m), n) for n, m in model.named_modules())
    pm, m = grid.model_dims, grid.model_coord
    srank = grid.spatial_rank

    def halo_prediction(layer, x_channels, batch, adjoint):
        return bytes_sent(layer.halo.plan, ITEM, x_channels, batch, adjoint=adjoint)[srank]

    for module in list(dict(model.named_modules()).values()):
        if module._modules:            # containers: their leaves are counted
            continue
        name = names[id(module)]
        fwd, bwd = module.forward, module.backward

        def forward(x, module=module, name=name, fwd=fwd):
            halo0, traffic0 = getattr(getattr(module, "halo", None), "bytes_sent", 0), TRAFFIC.bytes
            ledger.current = name
            module._bench_in = x.shape
            y = fwd(x)
            n, c = x.shape[0], x.shape[1]
            voxels = int(np.prod(x.shape[2:])) if x.ndim > 2 else 1
            if getattr(module, "halo", None) is not None:
                exchanged = module.in_channels if isinstance(module, mp.FilterParallelConv3d) else c
                ledger.add(name, "halo", module.halo.bytes_sent - halo0, halo_prediction(module, exchanged, n, False))
            predicted = 0
            if isinstance(module, mp.FilterParallelConv3d) and module.input_split:
                predicted = moved_bytes(module.in_channels, pm, m, n * voxels, ITEM)
            elif isinstance(module, mp.ChannelParallelConv3d):
                predicted = moved_bytes(module.total_out, pm, m, n * int(np.prod(y.shape[2:])), ITEM)
            elif isinstance(module, mp.RowParallelLinear) and module.input_split:
                predicted = moved_bytes(module.in_features, pm, m, n, ITEM)
            elif isinstance(module, mp.GatherFeatures):
                predicted = moved_bytes(module.features, pm, m, n * voxels, ITEM)
            ledger.add(name, "channel", TRAFFIC.bytes - traffic0, predicted)
            if isinstance(module, spatial.SpatialFlattenLinear) and grid.spatial_comm.Get_size() > 1:
                ledger.add(name, "allreduce", predicted=n * module.out_features * ITEM)
            return y

        def backward(dy, module=module, name=name, bwd=bwd):
            halo0, traffic0 = getattr(getattr(module, "halo", None), "bytes_sent", 0), TRAFFIC.bytes
            ledger.current = name
            dx = bwd(dy)
            shape = module._bench_in
            n, c = shape[0], shape[1]
            voxels = int(np.prod(shape[2:])) if len(shape) > 2 else 1
            if getattr(module, "halo", None) is not None and dx is not None:
                exchanged = module.in_channels if isinstance(module, mp.FilterParallelConv3d) else c
                ledger.add(name, "halo", module.halo.bytes_sent - halo0, halo_prediction(module, exchanged, n, True))
            predicted = 0
            if isinstance(module, mp.FilterParallelConv3d) and module.input_split and dx is not None:
                predicted = moved_bytes(module.in_channels, pm, m, n * voxels, ITEM)
            elif isinstance(module, mp.ChannelParallelConv3d):
                predicted = moved_bytes(module.total_out, pm, m, n * int(np.prod(dy.shape[2:])), ITEM)
            elif isinstance(module, mp.RowParallelLinear) and module.input_split:
                predicted = moved_bytes(module.in_features, pm, m, n, ITEM)
            ledger.add(name, "channel", TRAFFIC.bytes - traffic0, predicted)
            replicated_input = (isinstance(module, mp.FilterParallelConv3d) and not module.input_split) or \
                isinstance(module, mp.RowParallelFlattenLinear)
            if replicated_input and pm > 1 and dx is not None:
                ledger.add(name, "allreduce", predicted=n * c * voxels * ITEM)
            return dx

        module.forward, module.backward = forward, backward


def count_allreduces(ledger):
    """Count the payload of every allreduce the layers make (the modules bind the name at import)."""
    from refimpl.parallel import collectives
    original = collectives.allreduce

    def counted(buf, comm, *args, **kwargs):
        if ledger.current is not None and comm.Get_size() > 1:
            ledger.add(ledger.current, "allreduce", measured=buf.nbytes)
        return original(buf, comm, *args, **kwargs)
    spatial.allreduce = mp.allreduce = counted


def one_grid(dims, comm):
    grid = ProcessGrid(comm, dims)
    pm = grid.model_dims
    config = dict(CONFIG, model_parallel="filter" if pm > 1 else "none", model_parallel_blocks=2)
    model = build_model("cosmoflow", config, grid, seed=0, dtype="float32", global_batch=BATCH)
    label_layers(model)
    sync = GradientSynchronizer(model.parameters(), grid.data_comm, grid.spatial_comm)
    ledger = Ledger()
    instrument(model, grid, ledger)
    count_allreduces(ledger)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((BATCH,) + tuple(config["input_shape"])).astype(np.float32)
    y = rng.uniform(-1, 1, (BATCH, 4)).astype(np.float32)
    model.zero_grad()
    out = model.forward(np.ascontiguousarray(model.local_input(x)))
    ledger.current = None
    loss, dout, _ = model.loss(out, model.local_target(y))
    model.backward(dout)
    ledger.current = None
    sync.finish()
    # gradient payload: every parameter, a split one by its channel_range share of the whole
    reference = build_model("cosmoflow", config, None, seed=0, dtype="float32")
    predicted_grads = 0
    for (_, p), (_, whole) in zip(model.named_parameters(), reference.named_parameters()):
        share = 1.0 if p.shard is None else (p.shard[2] - p.shard[1]) / p.shard[3]
        predicted_grads += int(round(whole.data.size * share)) * ITEM
    if grid.batch_comm.Get_size() > 1:
        ledger.add("(gradients)", "allreduce", sum(int(p.grad.nbytes) for p in model.parameters()),
                   predicted_grads)
    head = sum(int(p.data.nbytes) for p in model.head.parameters())
    rows = {f"{k[0]}|{k[1]}": v for k, v in ledger.rows.items() if v != [0, 0]}
    agree = all(measured == predicted for measured, predicted in rows.values())
    everyone = comm.allgather(agree)
    grid.free()
    return {"grid": list(dims), "rows": rows, "all_ranks_agree": all(everyone), "head_bytes": head,
            "rank0": comm.Get_rank() == 0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--json", metavar="FILE", help="write the tables to FILE (rank 0)")
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    if size not in GRIDS:
        if comm.Get_rank() == 0:
            print(f"bench_model_parallel: run with 1, 2, 4 or 8 ranks, not {size}", file=sys.stderr)
        return 2
    results = [one_grid(dims, comm) for dims in GRIDS[size]]
    if comm.Get_rank() != 0:
        return 0
    print(f"# bench_model_parallel: CosmoFlow {CONFIG}, global batch {BATCH}, float32, one training step; "
          f"bytes per rank per step, rank 0 shown")
    for r in results:
        print(f"\n## grid {format_grid(r['grid'])}: measured = predicted on every rank: {r['all_ranks_agree']}; "
              f"head parameters on rank 0: {r['head_bytes']} B")
        print(f"{'layer':<14} {'kind':<10} {'measured B':>11} {'predicted B':>11}")
        for key, (measured, predicted) in sorted(r["rows"].items()):
            layer, kind = key.split("|")
            print(f"{layer:<14} {kind:<10} {measured:>11} {predicted:>11}")
        total = sum(v[0] for v in r["rows"].values())
        print(f"{'total':<14} {'':<10} {total:>11}")
    base = results[0]["head_bytes"]
    print("\n# head parameter bytes per rank: " + ", ".join(
        f"{format_grid(r['grid'])}: {r['head_bytes']} ({r['head_bytes'] / base:.3f} of the data-parallel grid's)"
        for r in results))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"config": CONFIG, "batch": BATCH, "grids": results}, fh, indent=1)
    return 0 if all(r["all_ranks_agree"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
